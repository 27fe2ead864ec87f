"""Checks for the 4-bit wire (fmt="mxfp4" / "nvfp4") run inside every rank of the shared gloo launches.

The exact reference: each sender's destination chunk zero-padded to whole blocks and quantized alone by the 4-bit
reference (fp8comm.quant.quantize_fp4: its own block and, NVFP4, tensor scales), decoded in the transform domain,
summed in fp32 in rank order, the Hadamard transform inverted once; outputs must equal it bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_checks import Ctx, expect_error, gather, randn
from on_device import comm_under_test

import fp8comm.comm as _fc
from fp8comm.quant import dequantize_fp4, quantize_fp4
from fp8comm.quant.fp4 import decode_2d, hadamard_forward, hadamard_inverse

fc = comm_under_test(_fc)
CASES = [("mxfp4", 0), ("mxfp4", 32), ("nvfp4", 0), ("nvfp4", 16)]


def _pad(v: torch.Tensor, block: int) -> torch.Tensor:
    lp = -(-v.numel() // block) * block
    out = torch.zeros(lp)
    out[: v.numel()] = v.float()
    return out


def rs4_reference(inputs, world: int, rank: int, fmt: str, h: int) -> torch.Tensor:
    """The exact fp32 chunk rank receives (flat, L elements) from every rank's flat input."""
    n = inputs[0].numel()
    L = -(-n // world)
    block = 32 if fmt == "mxfp4" else 16
    acc = None
    for x in inputs:
        p = torch.zeros(world * L)
        p[:n] = x.reshape(-1).float()
        row = _pad(p.view(world, L)[rank], block).view(1, -1)
        y = hadamard_forward(row, h, 0) if h else row
        q = quantize_fp4(y, fmt)
        v = decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt)
        acc = v if acc is None else acc + v
    acc = hadamard_inverse(acc, h, 0) if h else acc
    return acc.view(-1)[:L]


def check_fp4_reduce_scatter(ctx: Ctx) -> None:
    r, W = ctx.rank, ctx.world
    for i, (fmt, h) in enumerate(CASES):
        # N not a multiple of the world size or the block: every destination chunk has a padded tail block
        x = randn((W * 100 + 7,), 300 * i + r, scale=1 + r)
        out = fc.reduce_scatter(x, fmt=fmt, hadamard=h)
        exp = rs4_reference(gather(x), W, r, fmt, h)
        assert torch.equal(out, exp[: out.numel()]), f"{fmt} h={h}: not the exact reference sum"
        # all_reduce: the 4-bit reduce-scatter, then the 4-bit all-gather of the sums; identical on every rank
        ar = fc.all_reduce(x, fmt=fmt, hadamard=h, op="avg")
        outs = gather(ar)
        assert all(torch.equal(outs[0], o) for o in outs), f"{fmt} h={h}: all_reduce differs across ranks"
        true = sum(v.double() for v in gather(x)) / W
        rel = float((ar.double() - true).norm() / true.norm())
        assert rel < 0.25, (fmt, h, rel)
        ctx.info[f"all_reduce_rel_err_{fmt}_h{h}"] = round(rel, 4)
    # bf16 input, stochastic rounding: output in bf16, unbiased on average (mean of 64 calls near the true sum)
    x = randn((W * 64,), 77 + r, torch.bfloat16)
    true = sum(v.double() for v in gather(x)).view(W, 64)[r]
    outs = torch.stack([fc.reduce_scatter(x, fmt="mxfp4", rounding="stochastic").double() for _ in range(64)])
    assert outs.dtype == torch.float64 and outs.shape == (64, 64)
    one = fc.reduce_scatter(x, fmt="mxfp4", rounding="stochastic")
    assert one.dtype == torch.bfloat16
    err_mean = float((outs.mean(0) - true).abs().mean())
    err_one = float((outs[0] - true).abs().mean())
    assert err_mean < 0.4 * err_one, (err_mean, err_one)


def check_fp4_all_gather(ctx: Ctx) -> None:
    r, W = ctx.rank, ctx.world
    for i, (fmt, h) in enumerate(CASES):
        x = randn((3, 45), 400 * i + r, torch.bfloat16)  # 135 elements: a padded tail block
        g = fc.all_gather(x, fmt=fmt, hadamard=h)
        assert g.shape == (3 * W, 45) and g.dtype == torch.bfloat16
        outs = gather(g)
        assert all(torch.equal(outs[0], o) for o in outs), f"{fmt} h={h}: replicas differ"
        block = 32 if fmt == "mxfp4" else 16
        for j, xj in enumerate(gather(x)):
            row = _pad(xj.reshape(-1), block).view(1, -1)
            q = quantize_fp4(hadamard_forward(row, h, 0) if h else row, fmt)
            v = decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt)
            v = hadamard_inverse(v, h, 0) if h else v
            assert torch.equal(g[3 * j : 3 * j + 3].reshape(-1), v.view(-1)[:135].to(torch.bfloat16)), (fmt, h, j)
    # the API path and the building block agree (no transform): quantize_fp4 of the padded shard
    x = randn((64,), 5 + r)
    g = fc.all_gather(x, fmt="mxfp4")
    assert torch.equal(g[64 * r : 64 * r + 64], dequantize_fp4(quantize_fp4(x, "mxfp4")))


def check_fp4_error_feedback(ctx: Ctx) -> None:
    """Over 24 steps the summed output tracks the summed true gradient better with error feedback (the residual
    lives in the un-transformed domain, so it works with the Hadamard transform too)."""
    r, W = ctx.rank, ctx.world
    for h in (0, 32):
        res = {}
        for ef_on in (False, True):
            ef = fc.ErrorFeedback() if ef_on else None
            cfg = fc.WireConfig(fmt="mxfp4", hadamard=h, error_feedback=ef_on)
            acc = tacc = 0
            for s in range(24):
                x = randn((W * 256,), 1000 * s + r)
                acc = acc + fc.reduce_scatter(x, config=cfg, error_feedback=ef).double()
                tacc = tacc + sum(v.double() for v in gather(x)).view(W, 256)[r]
            res[ef_on] = float((acc - tacc).norm() / tacc.norm())
        assert res[True] < 0.5 * res[False], (h, res)
        ctx.info[f"ef_h{h}"] = {str(k): round(v, 4) for k, v in res.items()}


def check_fp4_replica_update(ctx: Ctx) -> None:
    """Replicas stay bit-identical through 4-bit weight changes; drift from the master stays at one step's
    quantization error (it is re-sent, not accumulated); bytes >= 3.5x fewer than a bf16 gather."""
    r, W, n = ctx.rank, ctx.world, 4096
    rep = torch.zeros(W * n, dtype=torch.bfloat16)
    master = randn((n,), 11 + r)
    ru = _fc.ReplicaUpdate(_fc.WireConfig(fmt="mxfp4"))
    # the reference kernels decode, then add in torch: the native one-pass decode-and-add must give these bits
    rep_ref, ru_ref = rep.clone(), _fc.ReplicaUpdate(_fc.WireConfig(fmt="mxfp4", backend="reference"))
    ru.gather(rep, master)  # first gather: the values themselves, replicas exactly equal
    ru_ref.gather(rep_ref, master)
    assert torch.equal(rep.view(W, n)[r], master.to(torch.bfloat16))
    drifts = []
    for s in range(12):
        master += 1e-2 * randn((n,), 100 * s + r)  # an optimizer step's change
        ru.gather(rep, master)
        ru_ref.gather(rep_ref, master)
        assert torch.equal(rep.view(torch.int16), rep_ref.view(torch.int16)), f"step {s}: native != reference"
        drifts.append(float((rep.view(W, n)[r].float() - master).abs().max() / master.abs().max()))
    reps = gather(rep)
    assert all(torch.equal(reps[0], o) for o in reps), "replicas differ across ranks"
    # one step's change is ~1e-2 * 4 sigma; 4-bit error of it ~1/5 of a block's max, plus bf16's own rounding
    assert max(drifts) < 0.02 and drifts[-1] < 2 * drifts[2] + 1e-3, drifts
    assert 2 * n / ru.wire_bytes(n) >= 3.5 and ru.last_dtype_bytes / ru.last_wire_bytes >= 3.5
    ctx.info["replica_drift"] = [round(d, 5) for d in drifts[::4]]
    ctx.info["update_bytes_ratio_vs_bf16"] = round(ru.last_dtype_bytes / ru.last_wire_bytes, 3)
    sd = ru.state_dict()
    ru2 = _fc.ReplicaUpdate(fmt="mxfp4")
    ru2.load_state_dict(sd)
    assert ru2.primed
    expect_error(lambda: ru.gather(rep[:-1], master), _fc.Fp8CommError, "expected world")
    expect_error(lambda: _fc.ReplicaUpdate(error_feedback=True), _fc.Fp8CommError, "no error_feedback")


def check_fp4_replica_update_async(ctx: Ctx) -> None:
    """async_op=True (started, then waited; several buckets in flight at once) and two levels give the bits of the
    synchronous flat gather, step after step; the replica moves only in wait(); a gather after an unwaited one
    applies that one first; reset() drops a change in flight; state_dict() finishes one. 2 nodes x 2 ranks."""
    r, W, n = ctx.rank, ctx.world, 3000  # n: not a whole number of 32-element blocks
    hg = _fc.node_groups(local_size=2)
    masters = [randn((n,), 7 + 10 * b + r) for b in range(3)]  # three "buckets"
    reps = {m: [torch.zeros(W * n, dtype=torch.bfloat16) for _ in masters] for m in ("sync", "async", "hier")}
    rus = {m: [_fc.ReplicaUpdate(fmt="mxfp4") for _ in masters] for m in reps}
    for s in range(6):
        for b, master in enumerate(masters):
            master += 1e-2 * randn((n,), 1000 * s + 10 * b + r)
            rus["sync"][b].gather(reps["sync"][b], master)
        hs = {
            m: [
                rus[m][b].gather(reps[m][b], masters[b], async_op=True, hierarchical=hg if m == "hier" else None)
                for b in range(3)
            ]
            for m in ("async", "hier")
        }
        if s > 0:  # a change (s == 0: the values themselves, which land in the replica as the bytes arrive)
            before = reps["async"][0].clone()
            assert not hs["async"][0].is_completed() and torch.equal(reps["async"][0], before)
        for m in ("async", "hier"):
            for b in reversed(range(3)):  # waited in another order than started
                assert hs[m][b].wait() is reps[m][b] and hs[m][b].is_completed()
                assert torch.equal(reps[m][b], reps["sync"][b]), f"step {s}: {m} bucket {b} differs from sync"
    for b in range(3):
        assert all(torch.equal(reps["sync"][b], o) for o in gather(reps["sync"][b])), "replicas differ across ranks"
    # an unwaited gather is applied before the next one computes its change: two steps, one wait
    m0 = masters[0]
    ref, ru_ref = reps["sync"][0], rus["sync"][0]
    rep, ru = reps["async"][0], rus["async"][0]
    for s in range(2):
        m0 += 1e-2 * randn((n,), 5000 + s + r)
        ru_ref.gather(ref, m0)
        h = ru.gather(rep, m0, async_op=True)
    h.wait()
    assert torch.equal(rep, ref), "a gather after an unwaited one"
    # state_dict() finishes the one in flight; reset() drops it (the replica was rewritten)
    m0 += 1e-2 * randn((n,), 6000 + r)
    h = ru.gather(rep, m0, async_op=True)
    assert ru.state_dict() == {"primed": True} and h.is_completed()
    ru_ref.gather(ref, m0)
    assert torch.equal(rep, ref), "state_dict() did not finish the gather in flight"
    m0 += 1e-2 * randn((n,), 7000 + r)
    kept = rep.clone()
    h = ru.gather(rep, m0, async_op=True)
    ru.reset()
    assert h.is_completed() and torch.equal(rep, kept) and not ru.primed, "reset() applied a dropped change"
    ctx.info["steps_bit_identical"] = 6


def check_fp4_refusals(ctx: Ctx) -> None:
    r, W = ctx.rank, ctx.world
    x = randn((W * 64,), r)
    expect_error(lambda: fc.all_gather(x.view(W, 64), fmt="mxfp4", fp8_out=True), _fc.Fp8CommError, "no such output")
    expect_error(
        lambda: fc.all_to_all(x.view(W * 2, 32), fmt="mxfp4", fp8_out=True), _fc.Fp8CommError, "no such output"
    )
    # ranks that disagree on the wire format or on the transform: refused on every rank before bytes move
    expect_error(
        lambda: fc.reduce_scatter(x, fmt="mxfp4" if r == 0 else "nvfp4", check=True),
        _fc.CommMismatchError,
        "wire format",
    )
    expect_error(
        lambda: fc.reduce_scatter(x, fmt="mxfp4", hadamard=32 if r == 0 else 0, check=True),
        _fc.CommMismatchError,
        "Hadamard",
    )
    dist.barrier()


def check_fp4_pipelined_pieces(ctx: Ctx) -> None:
    """MXFP4 calls cut into pipelined pieces (whole blocks each) give the one-piece bits: reduce_scatter with and
    without error feedback (output and residual, over two steps), all_reduce, all_gather into bf16 and fp32, with
    padded tail blocks; NVFP4 (a second-level scale per whole row) stays one piece and still matches."""
    r, W = ctx.rank, ctx.world
    x = randn((W * 1000 + 7,), 900 + r, scale=1 + r)
    for fmt in ("mxfp4", "nvfp4"):
        one = fc.reduce_scatter(x, fmt=fmt, pipeline=False)
        assert torch.equal(one, rs4_reference(gather(x), W, r, fmt, 0)[: one.numel()]), fmt
        for p in (2, 3, 5):
            assert torch.equal(fc.reduce_scatter(x, fmt=fmt, pipeline=p), one), f"{fmt} rs pipeline={p}"
        ar = fc.all_reduce(x, fmt=fmt, pipeline=False)
        assert torch.equal(fc.all_reduce(x, fmt=fmt, pipeline=3), ar), f"{fmt} all_reduce pieces"
    res = {}
    for p in (False, 3):
        ef = fc.ErrorFeedback()
        cfg = fc.WireConfig(fmt="mxfp4", error_feedback=True)
        outs = [fc.reduce_scatter(x * (s + 1), config=cfg, error_feedback=ef, pipeline=p) for s in range(2)]
        res[p] = (outs, ef.residual.clone())
    assert all(torch.equal(a, b) for a, b in zip(res[False][0], res[3][0])), "EF outputs differ with pieces"
    assert torch.equal(res[False][1], res[3][1]), "EF residual differs with pieces"
    for dt in (torch.bfloat16, torch.float32):
        w = randn((5, 333), 950 + r, dt)
        one = fc.all_gather(w, fmt="mxfp4", pipeline=False)
        for p in (2, 4):
            assert torch.equal(fc.all_gather(w, fmt="mxfp4", pipeline=p), one), f"all_gather {dt} pipeline={p}"


def q4_rows(rows: torch.Tensor, fmt: str, h: int) -> torch.Tensor:
    """One destination chunk's rows, padded to whole blocks, quantized alone by the 4-bit reference, decoded in the
    transform domain (padded width)."""
    block = 32 if fmt == "mxfp4" else 16
    n, k = rows.shape
    kp = -(-k // block) * block
    y = torch.zeros(n, kp)
    y[:, :k] = rows.float()
    y = hadamard_forward(y, h, 0) if h else y
    q = quantize_fp4(y, fmt)
    return decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt)


def _qdq4_rows(rows: torch.Tensor, fmt: str, h: int) -> torch.Tensor:
    v = q4_rows(rows, fmt, h)
    return (hadamard_inverse(v, h, 0) if h else v)[:, : rows.shape[1]]


def check_fp4_all_to_all(ctx: Ctx) -> None:
    """The MoE token all-to-all on the 4-bit wire: uneven splits, tokens of a width that is no whole number of
    blocks; every received chunk is exactly the sender's chunk through the 4-bit reference (MXFP4: per-row blocks;
    NVFP4: the chunk's own tensor scale)."""
    r, W = ctx.rank, ctx.world
    ins = [(r + j) % 3 + 1 for j in range(W)]  # rows I send to rank j
    outs = [(j + r) % 3 + 1 for j in range(W)]  # rows rank j sends me
    for i, (fmt, h) in enumerate(CASES):
        x = randn((sum(ins), 72), 500 * i + r, torch.bfloat16)
        got = fc.all_to_all(x, outs, ins, fmt=fmt, hadamard=h)
        assert got.shape == (sum(outs), 72) and got.dtype == torch.bfloat16
        # a float32 out: every contribution decoded straight into fp32 (ZeRO-1/2's gradients to their owners)
        wide = torch.full((sum(outs), 72), float("nan"))
        assert fc.all_to_all(x, outs, ins, fmt=fmt, hadamard=h, out=wide) is wide
        xs = gather(torch.nn.functional.pad(x, (0, 0, 0, 3 * W - x.shape[0])))
        o = 0
        for j in range(W):
            js = [(j + t) % 3 + 1 for t in range(W)]  # rank j's send splits
            a = sum(js[:r])
            exp32 = _qdq4_rows(xs[j][a : a + js[r]], fmt, h)
            assert torch.equal(got[o : o + js[r]], exp32.to(torch.bfloat16)), (fmt, h, j)
            assert torch.equal(wide[o : o + js[r]], exp32), (fmt, h, j, "float32 out")
            o += js[r]
    # the unquantized wire into a float32 out: the tokens themselves, widened
    x = randn((sum(ins), 72), 999 + r, torch.bfloat16)
    wide = torch.empty(sum(outs), 72)
    fc.all_to_all(x, outs, ins, wire="native", out=wide)
    assert torch.equal(wide, fc.all_to_all(x, outs, ins, wire="native").float()), "native wire into float32 out"


CHECKS_FP4 = [
    check_fp4_all_to_all,
    check_fp4_reduce_scatter,
    check_fp4_pipelined_pieces,
    check_fp4_all_gather,
    check_fp4_error_feedback,
    check_fp4_replica_update,
    check_fp4_replica_update_async,
    check_fp4_refusals,
]

# Where each check runs (tests/dist/test_collectives.py makes ids only there): the exact-reference checks at every
# size and through the staged backend; the longer statistical ones once, to keep the shared launches short.
check_fp4_error_feedback.applies = lambda world: world == 2  # type: ignore[attr-defined]
check_fp4_replica_update.applies = lambda world: world == 3  # type: ignore[attr-defined]
check_fp4_replica_update_async.applies = lambda world: world == 4  # type: ignore[attr-defined]
check_fp4_refusals.applies = lambda world: world == 2  # type: ignore[attr-defined]
