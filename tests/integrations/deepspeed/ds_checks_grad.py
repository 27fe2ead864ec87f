"""Gradient-numerics checks (scenario "zero"): fp32 accumulation of the ZeRO-1/2 FP8 reduction (bit for bit, each
stage), error feedback.

Imported by ds_worker.py after cpu.prepare().
"""

from __future__ import annotations

import ds_train as T
import torch
import torch.distributed as dist
from ds_common import SMALL_BUCKET, SQNR, SQNR_STEPS, GradSqnr, parity

import fp8comm.integrations.deepspeed as fd


def _qdq(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """One parameter's piece (fp32) through the wire's reference quantizer, decoded in fp32: FP8 e4m3 1x128 fp32
    scales, or MXFP4 (1x32 E8M0 blocks; the piece starts a block, its tail padded with zeros as on the wire)."""
    import fp8comm
    from fp8comm.quant import quantize_fp4
    from fp8comm.quant.fp4 import decode_2d

    if fmt == "e4m3":
        return fp8comm.quantize(x, "e4m3", 128).dequantize(torch.float32)
    y = torch.zeros(1, -(-x.numel() // 32) * 32)
    y[0, : x.numel()] = x
    q = quantize_fp4(y, fmt)
    return decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt).view(-1)[: x.numel()]


def _fp32_accumulation_once(stage: int, bucket_size: int | None, fmt: str = "e4m3", local: int = 1) -> dict:
    """One forward/backward of a ZeRO-`stage` bf16 engine (reduce_bucket_size, None: DeepSpeed's default): every
    owned slice compared with the reference: per node of `local` ranks (1: flat), the fp32 sum of its ranks'
    inputs in rank order, quantized per parameter piece in `fmt` and decoded in fp32, summed in fp32 in node
    order (flat: every sender's contribution decoded into fp32, summed in rank order). Returns the counts."""
    info: dict = {}
    zero = {} if bucket_size is None else {"reduce_bucket_size": bucket_size}
    cfg = T.ds_config(stage, "bf16", {"gemm": False, "gradients": {"fmt": fmt}}, **zero)
    if stage == 2:  # DeepSpeed's compact fp32 gradient partition: no merged slices
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    eng, _ = T.build(cfg)
    opt, seen, bounds = eng.optimizer, [], {}  # bounds: per call, where each parameter starts in the bucket
    inner = opt.allreduce_and_scatter
    spans: list = []  # per call: [(start in the bucket, parameter)] to find a slice's parameters after the backward

    def spy(bucket, dtype, *a, **k):
        ipg = opt.ipg_buckets[dtype]
        base = ipg.buffer[ipg.index]
        n, bounds[len(seen)], where = 0, set(), []
        for g, i, _ in ipg.params:  # the hook's blocks restart at each parameter
            bounds[len(seen)].add(n)
            where.append((n, opt.bit16_groups[g][i]))
            n += opt.bit16_groups[g][i].numel()
        if len(ipg.params) == 1 and bucket and bucket[0][1].untyped_storage().data_ptr() != base.data_ptr():
            base = None  # a parameter larger than the bucket: its own gradient, not the bucket buffer
        spans.append(where)
        # (call, offset in the reduce bucket, owner, this rank's input, the fp32 partition slice or None, its
        # value before)
        items = [
            (
                len(seen),
                0 if base is None else (b[1].data_ptr() - base.data_ptr()) // b[1].element_size(),
                next(iter(b[0])) if isinstance(b[0], frozenset) else b[0],
                b[1].detach().clone(),
                b[2],
                None if b[2] is None else b[2].detach().clone(),
            )
            for b in bucket
        ]
        inner(bucket, dtype, *a, **k)
        seen.append(items)

    def landed(c, off, n, out, before):
        """What the owner holds after the backward: the fp32 partition's increment, else the parameters' reduced
        gradients (results of coalesced calls arrive after the call returned, where DeepSpeed moved them)."""
        if out is not None:
            return (out - before).view(-1)
        parts = []
        for start, p in spans[c]:
            a, b = max(off, start), min(off + n, start + p.numel())
            if a < b:
                parts.append(opt.get_gradient_for_reduction(p).detach().reshape(-1)[a - start : b - start].clone())
        return torch.cat(parts)

    me, inner_end, done = dist.get_rank(), opt.reduce_ipg_grads, []

    def end(*a, **k):  # DeepSpeed's epilogue: everything has landed; ZeRO-1 reads (then frees) the gradients next
        inner_end(*a, **k)
        if not a and not k:
            done.append(
                [
                    [
                        (c, off, o, t, landed(c, off, t.numel(), out, before) if o == me else None)
                        for c, off, o, t, out, before in call
                    ]
                    for call in seen
                ]
            )

    opt.allreduce_and_scatter, opt.reduce_ipg_grads = spy, end
    x, y = T.batch(0, dist.get_rank())
    _, loss = eng(x, y)
    eng.backward(loss)
    del opt.allreduce_and_scatter, opt.reduce_ipg_grads
    assert len(done) == 1, f"DeepSpeed's epilogue ran {len(done)} times in one backward"
    seen = done[0]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [[(c, off, t) for c, off, _, t, _ in call] for call in seen])

    def piece(calls, c, off, n):  # rank's input for bucket elements [off, off + n) of call c (slices may merge)
        for _, o, t in calls[c]:
            if o <= off and off + n <= o + t.numel():
                return t[off - o : off - o + n]
        raise AssertionError(f"no slice covers [{off}, {off + n}) of call {c}")

    def fp32_decode(x, c, off):  # x = call c's bucket elements [off, off + len): per parameter, fp32 decode
        cuts = sorted({0, x.numel()} | {b - off for b in bounds[c] if off < b < off + x.numel()})
        return torch.cat([_qdq(x[a:b], fmt) for a, b in zip(cuts, cuts[1:])])

    def node_sum(calls, c, off, n):  # fp32 sum of one node's inputs in local-rank order (each widened first)
        acc = piece(calls[0], c, off, n).float()
        for other in calls[1:]:
            acc = acc + piece(other, c, off, n).float()
        return acc

    exact, bf16_decode, checked = 0, 0, 0
    lands = torch.float32 if stage == 2 else torch.bfloat16
    for call in seen:
        for c, off, owner, t, got in call:
            if owner != me:
                continue
            assert got.dtype == lands, f"owned slice landed in {got.dtype}, expected {lands}"
            nodes = [everyone[i : i + local] for i in range(0, len(everyone), local)]
            dec = [fp32_decode(node_sum(calls, c, off, t.numel()), c, off) for calls in nodes]
            want = dec[0].clone()
            for d in dec[1:]:
                want += d  # rank order, fp32
            rounded = sum(d.to(torch.bfloat16).float() for d in dec)  # each contribution decoded into bf16
            checked += got.numel()
            exact += int((got == want.to(lands)).sum())
            bf16_decode += int((rounded.to(lands) != want.to(lands)).sum())
    info.update(owned_elements=checked, exact=exact, differ_if_decoded_in_bf16=bf16_decode)
    assert checked > 0 and seen, "no owned slice was reduced through the hook"
    if fmt == "e4m3":  # a 4-bit code x E8M0 scale has 1 mantissa bit: bf16 holds it exactly, nothing to tell apart
        assert bf16_decode > checked // (4 if stage == 2 else 8), "this data cannot tell a bf16 decode from fp32"
    assert exact == checked, (
        f"{checked - exact} of {checked} owned elements differ from the fp32 sum of the "
        f"{fmt} contributions decoded in fp32{'' if stage == 2 else ' (rounded once to bf16)'}"
    )
    info["paths"] = {k: v for k, v in fd.hook_stats(eng)["hooks"].items() if k.startswith("zero12.grad_reduce.")}
    T.destroy(eng)
    fd.uninstall()
    return info


def _fp32_accumulation(stage: int):
    """ZeRO-1/2 bf16: what the owner receives is, bit for bit, the fp32 sum (in rank order) of every sender's FP8
    contribution decoded straight into fp32.

    ZeRO-2 with fp32 gradient partitions (data_types.grad_accum_dtype fp32): the fp32 partition receives that sum.
    ZeRO-1 (bf16 gradients; fp32 accumulation there would be DeepSpeed's BF16_Optimizer, which fp8comm refuses): the
    owner's bf16 gradient slice receives that sum rounded once to bf16. Decoding or summing in bf16 (up to be321a2
    each contribution was decoded into the communication dtype first) rounds each code x scale to 8 bits and fails
    this; the check also counts how many elements a bf16 decode would change, and fails if the data cannot tell."""

    def check(info):
        # Two bucket sizes: small buckets (mostly one owner each: the exact-size FP8 all-to-all) and DeepSpeed's
        # default (every parameter, owners balanced: the padded reduce-scatter). Both paths must be exact.
        paths: dict = {}
        for bucket in (SMALL_BUCKET, None):
            one = _fp32_accumulation_once(stage, bucket)
            for k, v in one.pop("paths").items():
                paths[k] = paths.get(k, 0) + v
            for k, v in one.items():
                info[k] = info.get(k, 0) + v
        info["paths"] = paths
        assert paths.get("zero12.grad_reduce.all_to_all") and paths.get("zero12.grad_reduce.reduce_scatter"), (
            f"both reduction paths must be checked: {paths}"
        )

    check.__name__ = f"zero{stage}_bf16_fp32_accumulation"
    return check


zero2_bf16_fp32_accumulation = _fp32_accumulation(2)
zero1_bf16_fp32_accumulation = _fp32_accumulation(1)


def zero1_fp32_error_feedback(info):
    """ZeRO-1 fp32 with error feedback: over the first SQNR_STEPS steps the running sum of the reduced gradients
    tracks the exact sum at least 6 dB closer than without it (each step re-sends the previous step's quantization
    error); loss within tolerance of the baseline; residual memory as the docs state: 4 bytes per parameter, plus the
    call's padding."""
    plain = SQNR.get("zero1_fp32")
    if plain is None:  # run alone (`only`): measure the run without error feedback here
        plain = GradSqnr(SQNR_STEPS)
        parity({}, 1, "fp32", on_step=plain)
        fd.uninstall()
    sq = GradSqnr(SQNR_STEPS)
    run = parity(info, 1, "fp32", {"gemm": False, "gradients": {"error_feedback": True}}, on_step=sq)
    ef = run.stats["error_feedback"]
    n = sum(p.numel() for p in run.engine.module.parameters())
    info.update(
        step_sqnr_db_mean=sum(sq.step_db) / len(sq.step_db),
        sum_sqnr_db=sq.sum_db[-1],
        plain_step_sqnr_db_mean=sum(plain.step_db) / len(plain.step_db),
        plain_sum_sqnr_db=plain.sum_db[-1],
        residual_bytes=ef["residual_bytes"],
        params=n,
        summary=fd.summary(),
    )
    assert "error feedback (float32 residuals)" in info["summary"], info["summary"]
    # 4 bytes per parameter, held as the call's send layout (residuals.py: resident buffers), whose row pads and
    # owner padding add at most 1/8 (grad_reduce.BALANCE_SLACK; 1.2% on this model)
    assert 4 * n <= ef["residual_bytes"] <= 4 * n * 9 // 8, (ef, n)
    assert sq.sum_db[-1] >= plain.sum_db[-1] + 6, (
        f"error feedback: summed-gradient SQNR {sq.sum_db[-1]:.1f} dB vs {plain.sum_db[-1]:.1f} dB without"
    )
    fd.uninstall()
