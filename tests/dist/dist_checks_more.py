"""Checks for the MoE all-to-all, subgroups of the world and hierarchical (nodes x local ranks) mode."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_checks import Ctx, assert_within, bound, gather, out_cast_slack, padded, qdq, randn, rs_reference
from on_device import comm_under_test

import fp8comm.comm as _fc

fc = comm_under_test(_fc)  # the module, or FP8COMM_TEST_DEVICE's proxy (device copies in, host results out)
H = 160  # not a multiple of 128: every token has a partial block


def plain_a2a(x: torch.Tensor, outs, ins, group=None) -> torch.Tensor:
    out = torch.empty(sum(outs), x.shape[1], dtype=x.dtype)
    dist.all_to_all_single(out, x.contiguous(), list(outs), list(ins), group=group)
    return out


def split_matrices(W: int):
    """S[i][j] = tokens rank i sends to rank j: uneven with zeros; the second one has a rank that sends nothing."""
    a = [[(i + 2 * j) % 3 for j in range(W)] for i in range(W)]
    b = [[0 if i == W - 1 else (i + j) % 2 + 1 for j in range(W)] for i in range(W)]
    return [a, b]


def check_all_to_all(ctx: Ctx) -> None:
    """Uneven and zero splits, forward against a bf16 reference, backward bf16 (exact) and FP8, async + autograd."""
    r, W = ctx.rank, ctx.world
    for k, S in enumerate(split_matrices(W)):
        ins, outs = S[r], [S[j][r] for j in range(W)]
        x = randn((sum(ins), H), 1000 + 10 * k + r, torch.bfloat16, scale=1 + r).requires_grad_(True)
        y = fc.all_to_all(x, outs, ins)
        ref = plain_a2a(x.detach(), outs, ins)
        assert y.shape == ref.shape and y.dtype == torch.bfloat16
        assert torch.equal(y, qdq(ref, "e4m3", "fp32", torch.bfloat16)), f"splits {k}: not the per-token reference"
        assert_within(y, ref, bound(ref, "e4m3", "fp32") + out_cast_slack(ref, torch.bfloat16), f"splits {k}")
        gy = randn(tuple(y.shape), 1100 + 10 * k + r, torch.bfloat16)
        y.backward(gy)
        gref = plain_a2a(gy, ins, outs)
        assert torch.equal(x.grad, gref), f"splits {k}: bf16 backward must be exact"
        # FP8 backward, and an FP8 combine (the reverse direction) of the dispatched tokens.
        x.grad = None
        fc.all_to_all(x, outs, ins, grad_wire="fp8").backward(gy)
        assert torch.equal(x.grad, qdq(gref, "e4m3", "fp32", torch.bfloat16)), f"splits {k}: FP8 backward"
        back = fc.all_to_all(y.detach(), ins, outs, wire="bf16")
        assert torch.equal(back, qdq(x.detach(), "e4m3", "fp32", torch.bfloat16)), "bf16 combine must be lossless"
        back8 = fc.all_to_all(y.detach(), ins, outs, wire="fp8")
        xd = x.detach().float()
        yq = qdq(xd, "e4m3", "fp32", torch.bfloat16)  # what the receivers got for these tokens (checked above)
        slack = bound(xd, "e4m3", "fp32") + bound(yq, "e4m3", "fp32") + 2 * out_cast_slack(xd, torch.bfloat16)
        assert_within(back8, xd, slack * 1.01, f"splits {k}: fp8 round trip")
        # Async: the transfer starts at the call, wait() dequantizes and attaches the backward.
        x.grad = None
        h = fc.all_to_all(x, outs, ins, async_op=True)
        ya = h.wait()
        assert torch.equal(ya, y) and ya.requires_grad
        ya.backward(gy)
        assert torch.equal(x.grad, gref), "async backward"
    # fp32 tokens: native wire is exact; the default bf16 gradient wire rounds gradients to bf16.
    ins, outs = [2] * W, [2] * W
    x = randn((2 * W, H), 1200 + r).requires_grad_(True)
    assert torch.equal(fc.all_to_all(x.detach(), outs, ins, wire="native"), plain_a2a(x.detach(), outs, ins))
    gy = randn((2 * W, H), 1210 + r)
    fc.all_to_all(x, outs, ins).backward(gy)
    assert torch.equal(x.grad, plain_a2a(gy, ins, outs).to(torch.bfloat16).float())
    # One inf in one token on one rank: exactly that element of that token is non-finite at the receiver.
    x = randn((2 * W, H), 1220 + r, torch.bfloat16)
    if r == 0:
        x[2 * (W - 1), 131] = float("inf")  # the first token rank 0 sends to the last rank
    y = fc.all_to_all(x, outs, ins)
    expect = torch.zeros_like(y, dtype=torch.bool)
    if r == W - 1:
        expect[0, 131] = True
    assert torch.equal(~torch.isfinite(y), expect), "non-finite token element not exactly preserved"
    s = fc.comm_stats()
    assert s["all_to_all"]["wire_bytes"] < s["all_to_all"]["dtype_bytes"]


def check_subgroup(ctx: Ctx) -> None:
    """Collectives on a subset of the world; non-members get a clear error, not a hang."""
    r, W = ctx.rank, ctx.world
    assert check_subgroup.applies(W), f"check_subgroup needs >= 3 ranks, launched with {W}"
    members = [0, 2] if W == 3 else [1, 2, 3]
    g = dist.new_group(members)  # every rank takes part in creating it
    if r not in members:
        try:
            fc.all_gather(torch.randn(4), group=g)
        except fc.Fp8CommError as e:
            assert "not a member" in str(e)
            return
        raise AssertionError("non-member call did not raise")
    gr, gw = dist.get_rank(g), len(members)
    x = randn((3, 50), 1300 + r)
    out = fc.all_gather(x, group=g)
    for o in gather(out, g):
        assert torch.equal(o, out), "subgroup all_gather replicas differ"
    for j, xj in enumerate(gather(x, g)):
        assert torch.equal(out[3 * j : 3 * j + 3].reshape(1, -1), qdq(xj.reshape(1, -1), "e4m3", "fp32"))
    y = randn((gw * 64 + 3,), 1310 + r)
    rs = fc.reduce_scatter(y, group=g, op="avg")
    acc, _, _ = rs_reference(gather(y, g), gw, gr, "e4m3", "fp32", avg=True)
    assert torch.equal(rs, acc[: rs.numel()]), "subgroup reduce_scatter"
    ar = fc.all_reduce(y, group=g)
    for o in gather(ar, g):
        assert torch.equal(o, ar)
    ins = [gr + 1] * gw
    outs = [j + 1 for j in range(gw)]
    t = randn((sum(ins), H), 1320 + r, torch.bfloat16)
    a = fc.all_to_all(t, outs, ins, group=g)
    assert torch.equal(a, qdq(plain_a2a(t, outs, ins, g), "e4m3", "fp32", torch.bfloat16)), "subgroup all_to_all"


def check_hierarchical(ctx: Ctx) -> None:
    """2 "nodes" x 2 ranks (LOCAL_WORLD_SIZE=2): fp32 inside the node, FP8 only across nodes."""
    r, W = ctx.rank, ctx.world
    assert check_hierarchical.applies(W), f"check_hierarchical runs with 4 ranks as 2 nodes x 2, launched with {W}"
    nodes, local = 2, 2
    fc.reset_comm_stats()
    x = randn((7, 45), 1400 + r, scale=1 + r)
    out = fc.reduce_scatter(x, hierarchical=True)
    xs = gather(x)
    # Exact reference: node partial sums in fp32 (2 terms: order-free), each quantized once per node.
    pads = [padded(v, W)[0] for v in xs]
    acc = torch.zeros(pads[0].shape[1])
    true = torch.zeros(pads[0].shape[1], dtype=torch.float64)
    bnd = torch.zeros(pads[0].shape[1])
    for n in range(nodes):
        part = pads[n * local] + pads[n * local + 1]
        acc += qdq(part, "e4m3", "fp32")[r]
        bnd += bound(part, "e4m3", "fp32")[r] + part[r].abs() * 2.0**-23
        true += pads[n * local][r].double() + pads[n * local + 1][r].double()
    n_out = out.numel()
    assert torch.equal(out.reshape(-1), acc[:n_out]), "hierarchical reduce_scatter != node-partial reference"
    assert_within(out.reshape(-1), true[:n_out], bnd[:n_out], "hierarchical reduce_scatter")
    s = fc.comm_stats()
    assert s["reduce_scatter.intra"]["wire_bytes"] > 0 and s["reduce_scatter"]["ratio"] > 1.5, s
    # all_gather: FP8 across nodes, the same bytes inside: bit-identical to the flat all_gather.
    w = randn((3, 77), 1410 + r, torch.bfloat16)
    assert torch.equal(fc.all_gather(w, hierarchical=True), fc.all_gather(w)), "hierarchical all_gather"
    hg = fc.node_groups(local_size=2)
    assert (hg.nodes, hg.local, hg.node, hg.local_rank) == (2, 2, r // 2, r % 2)
    ar = fc.all_reduce(x, hierarchical=hg, op="avg")
    for o in gather(ar):
        assert torch.equal(o, ar), "hierarchical all_reduce replicas differ"
    h = fc.reduce_scatter(x, hierarchical=hg, async_op=True)
    assert torch.equal(h.wait(), out)
    check_hierarchical_fp4(ctx, hg, x, pads)
    ctx.info["stats"] = {k: (v["wire_bytes"], v["dtype_bytes"]) for k, v in fc.comm_stats().items()}


def check_hierarchical_fp4(ctx: Ctx, hg, x, pads) -> None:
    """Two levels on the 4-bit wire: the node's exact partial sums (2 terms: order-free) quantized once per rail
    by the 4-bit reference, summed in fp32 across the 2 nodes (order-free); all_gather bit-identical to flat."""
    from dist_checks_fp4 import CASES, q4_rows

    from fp8comm.quant.fp4 import hadamard_inverse

    r = ctx.rank
    for fmt, h in CASES:
        out = fc.reduce_scatter(x, hierarchical=hg, fmt=fmt, hadamard=h)
        acc = None
        for n in range(2):
            part = (pads[2 * n] + pads[2 * n + 1]).float()
            v = q4_rows(part[r].reshape(1, -1), fmt, h)
            acc = v if acc is None else acc + v
        acc = hadamard_inverse(acc, h, 0) if h else acc
        assert torch.equal(out.reshape(-1), acc.reshape(-1)[: out.numel()]), (fmt, h)
        w = randn((3, 77), 1420 + r, torch.bfloat16)
        flat = fc.all_gather(w, fmt=fmt, hadamard=h)
        assert torch.equal(fc.all_gather(w, hierarchical=hg, fmt=fmt, hadamard=h), flat), (fmt, h)
        ar = fc.all_reduce(x, hierarchical=hg, fmt=fmt, hadamard=h)
        for o in gather(ar):
            assert torch.equal(o, ar), (fmt, h, "all_reduce replicas differ")
    # Pipelined two-level calls (the levels overlapping piece by piece) are bit-identical to one piece, error
    # feedback included (each piece's residual covers its own columns; a compact residual is encoded once, after
    # the last piece).
    big = randn((4 * 3 * 128 + 40,), 1430 + r, torch.bfloat16)
    for fmt, rdt in (("e4m3", "float32"), ("mxfp4", "float32"), ("mxfp4", "fp8")):
        outs, res = [], []
        for pipeline in (1, 3):
            ef = fc.ErrorFeedback(rdt)
            cfg = fc.WireConfig(fmt=fmt, pipeline=pipeline, error_feedback=True, residual_dtype=rdt)
            o = [fc.reduce_scatter(big, hierarchical=hg, config=cfg, error_feedback=ef) for _ in range(2)]
            outs.append(torch.cat(o))
            res.append(ef.value().clone())
            g = fc.all_gather(big, hierarchical=hg, fmt=fmt, pipeline=pipeline)
            outs[-1] = torch.cat([outs[-1], g])
        assert torch.equal(outs[0], outs[1]) and torch.equal(res[0], res[1]), (fmt, "pipelined two-level")
        assert res[0].numel() == 2 * (-(-big.numel() // 4)), "the residual covers the node's partial sums"
    # Automatic pieces: a two-level all-gather plans its rail pieces from what crosses the rails (2 nodes x the
    # shard), GATHER_SPLIT times smaller (a shorter tail after the link), with the one-piece bits.
    from fp8comm.comm import levels, pieces, planner

    shape = planner.GroupShape(2, 2)

    rails: list[int] = []
    real_gather, old_piece = levels.all_gather_bytes, pieces.PIPELINE_PIECE

    def counting(out, inp, group, async_op):
        rails.append(group is hg.inter)
        return real_gather(out, inp, group, async_op)

    levels.all_gather_bytes, pieces.PIPELINE_PIECE = counting, 2048
    try:
        auto = fc.all_gather(big, hierarchical=hg, fmt="e4m3")
    finally:
        levels.all_gather_bytes, pieces.PIPELINE_PIECE = real_gather, old_piece
    k, cpu = 13 * 128, torch.device("cpu")  # the shard's padded width: 13 whole 1x128 blocks
    pieces.PIPELINE_PIECE = 2048
    try:  # 2k rail elements: 1 piece of 2048 or more, 3 of 1024 or more (5, 5, 3 blocks); 4k (the whole output) 5
        planned = [len(pieces.plan_pieces(k, 128, n * k, cpu, "nearest", 0, pieces.GATHER_SPLIT)) for n in (2, 4)]
        # the planner's model cuts the call as the collective does
        modelled = planner.pieces("all_gather", planner.Option("fp8", "two_level"), 4 * big.numel(), shape, "cpu")
    finally:
        pieces.PIPELINE_PIECE = old_piece
    assert planned == [3, 5] and sum(rails) == 3 and modelled == 3, (planned, rails, modelled)
    assert torch.equal(auto, fc.all_gather(big, hierarchical=hg, fmt="e4m3", pipeline=1)), "automatic pieces"


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_pipeline_and_fp8_out(ctx: Ctx) -> None:
    """Pipelined calls (pieces) are bit-identical to one piece; FP8 outputs carry exactly the codes and scales the
    dequantizing calls decode and feed fp8comm.gemm; bad FP8-out inputs fail before any bytes move."""
    from dist_checks import expect_error

    from fp8comm.gemm.backends import gemm
    from fp8comm.quant import Fp8Tensor, quantize

    r, W = ctx.rank, ctx.world
    # all-gather of a weight shard [rows, 384] (3 blocks per row): pieces, async, FP8 out
    w = randn((3, 384), 3000 + r, torch.bfloat16, scale=1 + r)
    one = fc.all_gather(w, pipeline=False)
    for p in (2, 3):
        assert torch.equal(bits16(fc.all_gather(w, pipeline=p)), bits16(one)), f"all_gather pipeline={p}"
    assert torch.equal(bits16(fc.all_gather(w, pipeline=3, async_op=True).wait()), bits16(one)), "async pieces"
    for p in (False, 2):
        q = fc.all_gather(w, fp8_out=True, pipeline=p)
        assert isinstance(q, Fp8Tensor) and q.shape == (3 * W, 384) and q.scale.shape == (3 * W, 3)
        assert torch.equal(bits16(q.dequantize(torch.bfloat16, backend="reference")), bits16(one)), "fp8_out deq"
        full = torch.cat(gather(w))
        want = quantize(full, "e4m3", 128, backend="reference")  # 1x128 row blocks of the whole weight
        assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8)), "fp8_out codes"
        assert torch.equal(q.scale, want.scale), "fp8_out scales"
    # The gathered FP8 weight feeds the FP8 GEMM as is.
    xq = quantize(randn((5, 384), 3100 + r), "e4m3", 128)
    assert torch.equal(gemm(xq, q, backend="emulation"), gemm(xq, want, backend="emulation")), "gemm on fp8_out"
    qa = fc.all_gather(w, fp8_out=True, async_op=True, pipeline=2).wait()
    assert torch.equal(qa.data.view(torch.uint8), q.data.view(torch.uint8))
    # Preallocated outputs (engines keep their gathered buffers): written in place, same bits.
    o = torch.empty(3 * W, 384, dtype=torch.bfloat16)
    assert fc.all_gather(w, out=o, pipeline=2) is o and torch.equal(bits16(o), bits16(one)), "all_gather out="
    keep = fc.all_gather(w * 0, fp8_out=True)
    got = fc.all_gather(w, fp8_out=True, out=keep, async_op=True).wait()
    assert got is keep and torch.equal(keep.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(keep.scale, q.scale), "all_gather fp8_out out="
    expect_error(
        lambda: fc.all_gather(w, out=torch.empty(3 * W, 383, dtype=torch.bfloat16)), fc.Fp8CommError, "expected"
    )
    expect_error(lambda: fc.all_gather(w, fp8_out=True, out=keep, fmt="e5m2"), fc.Fp8CommError, "produces")
    # reduce-scatter: sizes that do not divide (padding), bf16 and fp32, sum and avg
    for n, dt, op in ((W * 384 + 200, torch.float32, "sum"), (W * 1024, torch.bfloat16, "avg")):
        x = randn((n,), 3200 + r, dt, scale=1 + r)
        a = fc.reduce_scatter(x, op=op, pipeline=False)
        for p in (2, 5):
            assert torch.equal(bits16(fc.reduce_scatter(x, op=op, pipeline=p)), bits16(a)), f"rs {n} {dt} p={p}"
        assert torch.equal(bits16(fc.all_reduce(x, op=op, pipeline=3)), bits16(fc.all_reduce(x, op=op, pipeline=False)))
    # all-to-all: uneven splits, H = 320 (a partial block), pieces and FP8 out
    S = split_matrices(W)[0]
    ins, outs = S[r], [S[j][r] for j in range(W)]
    x = randn((sum(ins), 320), 3300 + r, torch.bfloat16)
    y1 = fc.all_to_all(x, outs, ins, pipeline=False)
    for p in (2, 7):  # pieces of whole rows; 7 leaves some pieces without rows for the smaller chunks
        assert torch.equal(bits16(fc.all_to_all(x, outs, ins, pipeline=p)), bits16(y1)), f"a2a pieces p={p}"
    # Without the metadata check, uneven splits leave no size every rank agrees on: auto stays one piece.
    assert torch.equal(bits16(fc.all_to_all(x, outs, ins, check=False)), bits16(y1)), "a2a unchecked"
    for p in (False, 2, 7):
        q = fc.all_to_all(x, outs, ins, fp8_out=True, pipeline=p)
        assert q.shape == (sum(outs), 320) and q.scale.shape == (sum(outs), 3)
        assert torch.equal(bits16(q.dequantize(torch.bfloat16, backend="reference")), bits16(y1)), "a2a fp8_out"
    assert torch.equal(
        fc.all_to_all(x, outs, ins, fp8_out=True, async_op=True).wait().data.view(torch.uint8), q.data.view(torch.uint8)
    )
    ya = torch.empty(sum(outs), 320, dtype=torch.bfloat16)
    assert fc.all_to_all(x, outs, ins, out=ya) is ya and torch.equal(bits16(ya), bits16(y1)), "a2a out="
    qk = fc.all_to_all(x * 0, outs, ins, fp8_out=True)
    assert fc.all_to_all(x, outs, ins, fp8_out=True, out=qk, pipeline=2) is qk
    assert torch.equal(qk.data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(qk.scale, q.scale)
    expect_error(lambda: fc.all_to_all(x.clone().requires_grad_(True), outs, ins, out=ya), fc.Fp8CommError, "detach")
    # out= in fp32 takes every contribution decoded straight into fp32 (1bd7f37); any other dtype is refused
    expect_error(lambda: fc.all_to_all(x, outs, ins, out=ya.half()), fc.Fp8CommError, "expected")
    # Errors, raised on every rank before any payload moves.
    expect_error(lambda: fc.all_gather(randn((2, 200), 1), fp8_out=True), fc.Fp8CommError, "multiple of the block")
    expect_error(lambda: fc.all_to_all(x, outs, ins, wire="bf16", fp8_out=True), fc.Fp8CommError, "wire='fp8'")
    expect_error(
        lambda: fc.all_to_all(x.clone().requires_grad_(True), outs, ins, fp8_out=True), fc.Fp8CommError, "detach"
    )
    expect_error(lambda: fc.reduce_scatter(randn((W * 256,), 1), pipeline="many"), fc.Fp8CommError, "pipeline")
    expect_error(
        lambda: fc.reduce_scatter(randn((W * 256,), 1), pipeline=2 if r == 0 else 1, check=True),
        fc.CommMismatchError,
        "pipeline",
    )


CHECKS_MORE = [check_all_to_all, check_subgroup, check_hierarchical, check_pipeline_and_fp8_out]


# World sizes a check can run at: tests/dist/test_collectives.py generates ids only where it applies, so no check
# returns early and reports PASSED having run nothing; launched elsewhere, it fails loudly.
check_subgroup.applies = lambda world: world >= 3  # type: ignore[attr-defined]
check_hierarchical.applies = lambda world: world == 4  # type: ignore[attr-defined]
