"""Checks for the all-to-all's piece plan in steady state (launched by test_a2a_plan.py, 2 gloo ranks).

With given splits the automatic piece count needs the largest message of any rank. The metadata check's table
carried it on every call until 24936a2 made the check run on the first calls only; later calls then travelled in
one piece (codec and wire in sequence: the all-to-all regression of issue 22). These checks count the payload
collectives of every call, checked and unchecked, and compare every output bit for bit with the one-piece call.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from dist_checks import Ctx, randn

import fp8comm.comm as fc
from fp8comm.comm import pieces

H = 256  # two 1x128 blocks per token
PIECE = 512  # elements per piece while these checks run (the library's 2 Mi would need 4 Mi-element messages)
CALLS = 6  # more than the "first" policy's checked calls (3)


@contextlib.contextmanager
def small_pieces():
    """Pieces of PIECE elements (pieces.piece_count reads the module constant per call), restored after."""
    old = pieces.PIPELINE_PIECE
    pieces.PIPELINE_PIECE = PIECE
    try:
        yield
    finally:
        pieces.PIPELINE_PIECE = old


@contextlib.contextmanager
def counted(log: list):
    """Append one entry per torch all_to_all_single issued (the FP8 wire moves each piece with one)."""
    real = dist.all_to_all_single

    def spy(*a, **k):
        log.append(1)
        return real(*a, **k)

    dist.all_to_all_single = spy
    try:
        yield
    finally:
        dist.all_to_all_single = real


def expected_pieces(sent_tokens: int) -> int:
    """What the plan must give: the largest rank's message (elements) in PIECE-sized pieces, at most 8."""
    t = torch.tensor([sent_tokens], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(1, min(pieces.PIPELINE_MAX, int(t) * H // PIECE))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def check_steady_state_pieces(ctx: Ctx) -> None:
    """Given uneven splits: every call (checked or not) travels in the planned pieces, bit-identical to one piece;
    the forward with out= and fp8_out=, and the FP8-wire backward, alike. Token counts: plan_bytes, not checks."""
    r, W = ctx.rank, ctx.world
    ins = [3 + 2 * j + r for j in range(W)]  # uneven, and different on every rank
    outs = [3 + 2 * r + j for j in range(W)]
    x = randn((sum(ins), H), 4000 + r, torch.bfloat16)
    g = dist.new_group(list(range(W)), backend="gloo")  # fresh: the "first" policy counts from zero here
    buf = fc.Buffer(group=g)
    with small_pieces():
        want = expected_pieces(sum(ins))
        want_bwd = expected_pieces(sum(outs))
        assert want > 1 and want_bwd > 1, (want, want_bwd)
        one = buf.all_to_all(x, outs, ins, pipeline=False)
        q1 = buf.all_to_all(x, outs, ins, fp8_out=True, pipeline=False)
        gy = randn(tuple(one.shape), 4100 + r, torch.bfloat16)
        seen: dict[str, list[int]] = {"forward": [], "out=": [], "fp8_out": [], "backward": []}
        grads = []
        fc.reset_comm_stats()
        for _ in range(CALLS):
            log: list = []
            with counted(log):
                y = buf.all_to_all(x, outs, ins)
            seen["forward"].append(len(log))
            assert torch.equal(bits(y), bits(one)), "pieces changed the output bits"
            log = []
            o = torch.empty_like(one)
            with counted(log):
                assert buf.all_to_all(x, outs, ins, out=o) is o
            seen["out="].append(len(log))
            assert torch.equal(bits(o), bits(one)), "out=: pieces changed the output bits"
            log = []
            with counted(log):
                q = buf.all_to_all(x, outs, ins, fp8_out=True)
            seen["fp8_out"].append(len(log))
            assert torch.equal(q.data.view(torch.uint8), q1.data.view(torch.uint8)) and torch.equal(q.scale, q1.scale)
            xg = x.clone().requires_grad_(True)
            yg = buf.all_to_all(xg, outs, ins, grad_wire="fp8")
            log = []
            with counted(log):
                yg.backward(gy)
            seen["backward"].append(len(log))
            grads.append(xg.grad)
        ctx.info["pieces"] = seen
        ctx.info["planned"] = {"forward": want, "backward": want_bwd}
        for k, v in seen.items():
            w = want_bwd if k == "backward" else want
            assert v == [w] * CALLS, f"{k}: pieces per call {v}, planned {w} (later calls lost the pipelining)"
        assert all(torch.equal(bits(gr), bits(grads[0])) for gr in grads), "backward bits changed between calls"
        st = buf.state.stats.snapshot()["all_to_all"]
        ctx.info["stats"] = {k: st[k] for k in ("check_bytes", "plan_bytes")}
        # 4 forward calls per loop: checked ones carry the table, the rest exchange 2 int64 per rank
        assert st["plan_bytes"] > 0 and st["plan_bytes"] % (2 * 8 * (W - 1)) == 0, st
    dist.destroy_process_group(g)


def check_mixed_even_ranks(ctx: Ctx) -> None:
    """Given splits that happen to be even on one rank but not on another: the ranks still agree on the plan (the
    decision depends on the call's form, never on split values), so nothing hangs and the pieces match."""
    r, W = ctx.rank, ctx.world
    # 4 tokens between every pair; rank 0 keeps 4 for itself (even splits), rank r > 0 keeps 5 + r (uneven)
    ins = [4] * W
    ins[r] = 4 if r == 0 else 5 + r
    outs = list(ins)
    x = randn((sum(ins), H), 4200 + r, torch.bfloat16)
    g = dist.new_group(list(range(W)), backend="gloo")
    with small_pieces():
        want = expected_pieces(sum(ins))
        one = fc.all_to_all(x, outs, ins, group=g, pipeline=False)
        counts = []
        for _ in range(CALLS):
            log: list = []
            with counted(log):
                y = fc.all_to_all(x, outs, ins, group=g)
            counts.append(len(log))
            assert torch.equal(bits(y), bits(one))
        ctx.info["pieces"] = counts
        assert counts == [want] * CALLS, (counts, want)
    dist.destroy_process_group(g)


def check_even_splits_unchanged(ctx: Ctx) -> None:
    """Omitted splits plan from the local size (equal on every rank): no token-count exchange, same pieces."""
    r, W = ctx.rank, ctx.world
    x = randn((6 * W, H), 4300 + r, torch.bfloat16)
    g = dist.new_group(list(range(W)), backend="gloo")
    buf = fc.Buffer(group=g)
    with small_pieces():
        one = buf.all_to_all(x, pipeline=False)
        counts = []
        for _ in range(CALLS):
            log: list = []
            with counted(log):
                y = buf.all_to_all(x)
            counts.append(len(log))
            assert torch.equal(bits(y), bits(one))
        want = max(1, min(pieces.PIPELINE_MAX, x.numel() // PIECE))
        assert counts == [want] * CALLS, (counts, want)
        assert buf.state.stats.snapshot()["all_to_all"].get("plan_bytes", 0) == 0
    dist.destroy_process_group(g)


def check_error_feedback_pieces(ctx: Ctx) -> None:
    """With error feedback (the ZeRO-1/2 gradient path to the owners) the call travels in its planned pieces too,
    each piece's rows quantized with the residual and their residual updated: outputs and residuals bit-identical
    to the one-piece call, step after step, for FP8 and MXFP4 wires and a float32 and a compact fp8 residual."""
    r, W = ctx.rank, ctx.world
    ins = [3 + 2 * j + r for j in range(W)]
    outs = [3 + 2 * r + j for j in range(W)]
    g = dist.new_group(list(range(W)), backend="gloo")
    seen = {}
    with small_pieces():
        want = expected_pieces(sum(ins))
        assert want > 1, want
        for fmt in ("e4m3", "mxfp4"):
            for rdt in ("float32", "fp8"):
                cfg = fc.WireConfig(fmt=fmt, error_feedback=True, residual_dtype=rdt)
                ef1, efp = fc.ErrorFeedback(rdt), fc.ErrorFeedback(rdt)
                counts = []
                for step in range(3):
                    x = randn((sum(ins), H), 4400 + 10 * step + r, torch.float32)
                    one = fc.all_to_all(x, outs, ins, group=g, config=cfg, error_feedback=ef1, pipeline=False)
                    log: list = []
                    with counted(log):
                        y = fc.all_to_all(x, outs, ins, group=g, config=cfg, error_feedback=efp)
                    counts.append(len(log))
                    assert torch.equal(y.view(torch.int32), one.view(torch.int32)), f"{fmt}/{rdt} step {step}: output"
                    a, b = ef1.value(), efp.value()
                    assert a is not None and b is not None and a.numel() == b.numel(), (fmt, rdt, step)
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{fmt}/{rdt} step {step}: residual"
                seen[f"{fmt}/{rdt}"] = counts
        ctx.info["pieces"], ctx.info["planned"] = seen, want
        assert all(c == [want] * 3 for c in seen.values()), (seen, want)
    dist.destroy_process_group(g)


CHECKS = [check_steady_state_pieces, check_mixed_even_ranks, check_even_splits_unchanged, check_error_feedback_pieces]


def worker(rank: int, world: int, port: int, outdir: str, env: dict, names: list[str] | None) -> None:
    import os

    import dist_harness

    os.environ.update(env)
    out = dist_harness.join(rank, world, port, outdir, 60.0, dist_harness.PG_TIMEOUT_S)
    dist_harness.run_checks(sys.modules[__name__], rank, world, out, names)
    dist.destroy_process_group()
    out.close()
