"""Checks for fp8comm's gradient/weight collectives, run inside every rank of one gloo launch (see dist_harness).

Each check compares against (a) the exact reference (fp8comm.quantize of each sender's chunk, dequantized and summed
in rank order in fp32: must match bit for bit) and (b) the fp32 reference within the documented error bound.
Assertions use values every rank agrees on, or per-rank facts, so a failure is reported on the rank it happens.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from on_device import COLLECTIVES, comm_under_test

import fp8comm.comm as _fc
from fp8comm.quant import Scaling, get_format, quantize, scale_from_amax
from fp8comm.quant.reference import block_amax

fc = comm_under_test(_fc)  # the module, or FP8COMM_TEST_DEVICE's proxy (device copies in, host results out)


class Ctx:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.info = rank, world, {}


# ------------------------------------------------------------------------------------------------- helpers
def gather(x: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's tensor (same shape everywhere), moved exactly as bytes by plain torch.distributed."""
    n = dist.get_world_size(group)
    b = x.detach().contiguous().reshape(-1).view(torch.uint8)
    outs = [torch.empty_like(b) for _ in range(n)]
    dist.all_gather(outs, b, group=group)
    return [o.view(x.dtype).reshape(x.shape) for o in outs]


def randn(shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def qdq(x2: torch.Tensor, fmt: str, enc: str, dtype=torch.float32) -> torch.Tensor:
    """The reference: rows of x2 quantized with 1x128 blocks along the last dim, dequantized."""
    return quantize(x2, fmt, scaling=Scaling(1, 128, enc)).dequantize(dtype)


def bound(x2: torch.Tensor, fmt: str, enc: str, rounding: str = "nearest") -> torch.Tensor:
    """Per-element error bound of qdq: max(|x| 2^-(m+1), s 2^(emin-m-1)) (their sum), 0 where x == 0; x2 for SR."""
    f, sc = get_format(fmt), Scaling(1, 128, enc)
    x = x2.float()
    s = scale_from_amax(block_amax(x, sc), f, sc).repeat_interleave(128, 1)[:, : x.shape[1]]
    a = x.abs()
    b = a * 2.0 ** -(f.mantissa_bits + 1) + s * 2.0 ** (f.min_normal_exp - f.mantissa_bits - 1)
    b = torch.where(a == 0, torch.zeros_like(b), b)
    return b * (2 if rounding == "stochastic" else 1)


def padded(x: torch.Tensor, world: int) -> tuple[torch.Tensor, int, int]:
    """x's flat fp32 values zero-padded to [world, L] (the reduce-scatter chunking), L, and rows per chunk."""
    n0 = x.shape[0]
    row = x.numel() // n0 if n0 else 0
    c = -(-n0 // world)
    L = c * row
    p = torch.zeros(world * L)
    p[: x.numel()] = x.reshape(-1).float()
    return p.view(world, L), L, c


def rs_reference(inputs, world, rank, fmt, enc, avg=False):
    """(exact expected fp32 chunk, fp32 true chunk, error bound) of rank's reduce-scatter output, flat [L]."""
    acc, true, bnd, tot = None, None, None, None
    for x in inputs:
        p, L, _ = padded(x, world)
        q = qdq(p, fmt, enc)[rank]
        acc = q.clone() if acc is None else acc + q  # fp32, rank order: what the receiver does
        true = p[rank].double() if true is None else true + p[rank].double()
        b = bound(p, fmt, enc)[rank]
        bnd = b if bnd is None else bnd + b
        tot = p[rank].abs() if tot is None else tot + p[rank].abs()
    bnd = bnd + tot * (len(inputs) * 2.0**-23)  # fp32 accumulation
    if avg:
        acc, true, bnd = acc / world, true / world, bnd / world + acc.abs() * 2.0**-24
    return acc, true, bnd


def assert_within(out: torch.Tensor, true: torch.Tensor, bnd: torch.Tensor, what: str) -> float:
    err = (out.detach().double() - true.detach().double()).abs()
    if err.numel() == 0:
        return 0.0
    excess = err - bnd.double()
    if excess.max() > 0:
        i = int(excess.argmax())
        raise AssertionError(
            f"{what}: error {err.view(-1)[i]:.3g} > bound {bnd.view(-1)[i]:.3g} at {i} "
            f"(out {out.reshape(-1)[i]}, true {true.reshape(-1)[i]})"
        )
    return float(err.max()) if err.numel() else 0.0


def sqnr_db(out: torch.Tensor, true: torch.Tensor) -> tuple[float, float]:
    return float((true.double() ** 2).sum()), float(((out.double() - true.double()) ** 2).sum())


def global_sqnr(sig: float, noise: float) -> float:
    t = torch.tensor([sig, noise], dtype=torch.float64)
    dist.all_reduce(t)
    return 10 * math.log10(t[0] / t[1]) if t[1] > 0 else float("inf")


def out_cast_slack(v: torch.Tensor, dtype) -> torch.Tensor:
    """Half an ulp of the output dtype (the final cast from fp32)."""
    return v.float().abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-24)


# ---------------------------------------------------------------------------------------------- all_gather
def check_all_gather(ctx: Ctx) -> None:
    r, W = ctx.rank, ctx.world
    cases = [
        ((5, 37), torch.float32, "e4m3", "fp32", "nearest"),
        ((3, 256), torch.bfloat16, "e4m3", "e8m0", "nearest"),
        ((4, 33), torch.bfloat16, "e5m2", "pow2", "nearest"),
        ((1,), torch.float32, "e4m3", "fp32", "nearest"),
        ((2, 300), torch.float32, "e4m3", "fp32", "stochastic"),
    ]
    for i, (shape, dtype, fmt, enc, rnd) in enumerate(cases):
        x = randn(shape, 100 * i + r, dtype, scale=10.0**r)
        out = fc.all_gather(x, fmt=fmt, scaling=enc, rounding=rnd)
        assert out.shape == (W * shape[0],) + shape[1:] and out.dtype == dtype, (out.shape, out.dtype)
        outs = gather(out)
        for j in range(W):  # replicas must compute with identical weights: compare bytes
            assert torch.equal(outs[j].view(-1).view(torch.uint8), out.view(-1).view(torch.uint8)), (
                f"case {i}: rank {j}'s all_gather output differs from rank {r}'s"
            )
        for j, xj in enumerate(gather(x)):
            chunk = out[j * shape[0] : (j + 1) * shape[0]]
            flat = xj.reshape(1, -1)
            if rnd == "nearest":
                assert torch.equal(chunk.reshape(1, -1), qdq(flat, fmt, enc, dtype)), f"case {i}: shard {j} != ref"
            assert_within(
                chunk.reshape(1, -1),
                flat,
                bound(flat, fmt, enc, rnd) + out_cast_slack(flat, dtype),
                f"case {i} shard {j}",
            )
    # Flat-buffer variant, sync and async, into a caller-owned buffer of another dtype.
    x = randn((1000,), 7 + r)
    o1 = torch.empty(W * 1000, dtype=torch.float32)
    assert fc.all_gather_into(o1, x) is o1
    o2 = torch.empty(W * 1000)
    h = fc.all_gather_into(o2, x, async_op=True)
    assert h.wait() is o2 and h.is_completed()
    assert torch.equal(o1, o2) and torch.equal(o1, fc.all_gather(x))


# ------------------------------------------------------------------------------------------ reduce_scatter
def rs_cases(W):
    return [
        ((7, 45), torch.float32, "e4m3", "fp32", "sum"),
        ((W * 256,), torch.bfloat16, "e4m3", "e8m0", "avg"),
        ((2, 300), torch.float32, "e5m2", "pow2", "sum"),
        ((W * 3 + 1, 130), torch.float32, "e4m3", "fp32", "avg"),
        ((W * 128,), torch.float32, "e5m2", "fp32", "avg"),
    ]


def check_reduce_scatter(ctx: Ctx) -> None:
    r, W = ctx.rank, ctx.world
    for i, (shape, dtype, fmt, enc, op) in enumerate(rs_cases(W)):
        x = randn(shape, 200 * i + r, dtype, scale=1 + r)
        out = fc.reduce_scatter(x, op=op, fmt=fmt, scaling=enc)
        c = -(-shape[0] // W)
        mine = max(0, min(c, shape[0] - r * c))
        assert out.shape == (mine,) + shape[1:] and out.dtype == dtype, (i, out.shape, mine)
        acc, true, bnd = rs_reference(gather(x), W, r, fmt, enc, avg=op == "avg")
        n = out.numel()
        assert torch.equal(out.reshape(-1), acc[:n].to(dtype)), f"case {i}: not the exact reference sum"
        assert_within(out.reshape(-1), true[:n], bnd[:n] + out_cast_slack(acc[:n], dtype), f"case {i} ({op})")
    # Flat buffers: N not divisible by the world size or the block.
    x = randn((1000,), 9 + r)
    L = -(-1000 // W)
    out = torch.empty(max(0, min(L, 1000 - r * L)))
    assert fc.reduce_scatter_into(out, x, op="sum") is out
    assert torch.equal(out, fc.reduce_scatter(x))
    # ReduceOp enums work like the strings.
    assert torch.equal(fc.reduce_scatter(x, op=dist.ReduceOp.AVG), fc.reduce_scatter(x, op="avg"))


def check_rs_magnitudes(ctx: Ctx) -> None:
    """Ranks' inputs 1e6 apart: per-sender scales keep every contribution (no shared scale to underflow)."""
    r, W = ctx.rank, ctx.world
    for op in ("sum", "avg"):
        x = randn((W * 1024,), 300 + r, scale=1e6 if r == 0 else 1.0)
        if r == 0:  # the big rank is silent in odd blocks: there only the small ranks' values remain
            x.view(-1, 128)[1::2] = 0
        out = fc.reduce_scatter(x, op=op)
        acc, true, bnd = rs_reference(gather(x), W, r, "e4m3", "fp32", avg=op == "avg")
        assert torch.equal(out, acc)
        ctx.info[f"max_err_{op}"] = assert_within(out, true, bnd, f"1e6 spread ({op})")
        odd = out.view(-1, 128)[1::2]
        t_odd = true.view(-1, 128)[1::2]
        rel = float(((odd.double() - t_odd).abs() / t_odd.abs().clamp_min(1e-30)).median())
        ctx.info[f"median_rel_err_small_blocks_{op}"] = rel
        assert rel < 0.05, f"small ranks' contributions lost in blocks where rank 0 is silent (median rel {rel})"


# --------------------------------------------------------------------------------------------- non-finite
def check_nonfinite(ctx: Ctx) -> None:
    """One inf/NaN on one rank: exactly those output elements are non-finite, everywhere they land."""
    r, W = ctx.rank, ctx.world
    N = W * 64 + 5
    L = -(-N // W)
    bad = W - 1  # the rank holding the special value
    for fmt in ("e4m3", "e5m2"):
        for val in (float("inf"), float("-inf"), float("nan")):
            for p in (3, N - 2):
                x = randn((N,), 400 + r)
                if r == bad:
                    x[p] = val
                out = fc.reduce_scatter(x, fmt=fmt)
                expect = torch.zeros(out.numel(), dtype=torch.bool)
                if p // L == r:
                    expect[p - r * L] = True
                assert torch.equal(~torch.isfinite(out), expect), f"reduce_scatter {fmt} {val} at {p}"
                ar = fc.all_reduce(x, fmt=fmt)
                e2 = torch.zeros(N, dtype=torch.bool)
                e2[p] = True
                assert torch.equal(~torch.isfinite(ar), e2), f"all_reduce {fmt} {val} at {p}"
                ag = fc.all_gather(x, fmt=fmt)
                e3 = torch.zeros(W * N, dtype=torch.bool)
                e3[bad * N + p] = True
                assert torch.equal(~torch.isfinite(ag), e3), f"all_gather {fmt} {val} at {p}"
    # Error feedback never carries a non-finite residual into the next call (fp32 and compact residuals alike);
    # the inf itself still reaches its owner through the wire.
    for dtype in ("float32", "fp8"):
        ef = fc.ErrorFeedback(dtype)
        x = randn((N,), 450 + r)
        if r == bad:
            x[5] = float("inf")
        out = fc.reduce_scatter(x, error_feedback=ef)
        assert bool((~torch.isfinite(out)).any()) == (r == 0), (dtype, "the inf did not arrive")  # rank 0's chunk
        assert bool(torch.isfinite(ef.value()).all()), f"non-finite {dtype} residual kept"
        assert bool(torch.isfinite(fc.reduce_scatter(randn((N,), 460 + r), error_feedback=ef)).all())


# --------------------------------------------------------------------------------------------- all_reduce
def check_all_reduce(ctx: Ctx) -> None:
    r, W = ctx.rank, ctx.world
    for i, (shape, dtype, op) in enumerate([((7, 45), torch.float32, "sum"), ((W * 200 + 3,), torch.bfloat16, "avg")]):
        x = randn(shape, 500 + 10 * i + r, dtype)
        out = fc.all_reduce(x, op=op)
        assert out.shape == x.shape and out.dtype == dtype
        for o in gather(out):
            assert torch.equal(o.view(-1).view(torch.uint8), out.view(-1).view(torch.uint8)), "replicas differ"
        xs = [v.reshape(-1) for v in gather(x)]  # all_reduce chunks the flat buffer: ceil(numel / world)
        # Exact: every owner's reduce-scatter chunk, quantized again (one 1xL row) and gathered.
        parts, trues, bnds = [], [], []
        for j in range(W):
            acc, true, bnd = rs_reference(xs, W, j, "e4m3", "fp32", avg=op == "avg")
            parts.append(qdq(acc.view(1, -1), "e4m3", "fp32").view(-1))
            trues.append(true)
            bnds.append(bnd + bound(acc.view(1, -1), "e4m3", "fp32").view(-1))
        n = x.numel()
        exp = torch.cat(parts)[:n]
        assert torch.equal(out.reshape(-1), exp.to(dtype)), f"case {i}: not the exact two-stage reference"
        assert_within(
            out.reshape(-1),
            torch.cat(trues)[:n],
            torch.cat(bnds)[:n] + out_cast_slack(exp, dtype),
            f"all_reduce case {i}",
        )
    # In place: output may be the input buffer.
    x = randn((W * 100,), 550 + r)
    ref = fc.all_reduce(x)
    assert fc.all_reduce_into(x, x) is x and torch.equal(x, ref)


# -------------------------------------------------------------------------------------------------- async
def check_async(ctx: Ctx) -> None:
    """Several ops in flight at once, waited in reverse order; inputs may change after the call returns."""
    r, W = ctx.rank, ctx.world
    a, b, c = randn((3, 70), 600 + r), randn((W * 90,), 610 + r), randn((5, 40), 620 + r)
    want = [fc.all_gather(a), fc.reduce_scatter(b, op="avg"), fc.all_reduce(c)]
    hs = [
        fc.all_gather(a, async_op=True),
        fc.reduce_scatter(b, op="avg", async_op=True),
        fc.all_reduce(c, async_op=True),
    ]
    for t in (a, b, c):
        t.add_(1000.0)  # packed at call time: later writes to the input must not change the result
    got = [h.wait() for h in reversed(hs)][::-1]
    for w, g, name in zip(want, got, ("all_gather", "reduce_scatter", "all_reduce")):
        assert torch.equal(w, g), f"async {name} differs from the synchronous result"
    assert all(h.is_completed() for h in hs) and hs[0].wait() is got[0]


# -------------------------------------------------------------------------------------------- error feedback
def check_error_feedback(ctx: Ctx) -> None:
    """A constant gradient for T steps: the mean of the outputs converges with EF (and SR), not without."""
    r, W = ctx.rank, ctx.world
    T = 16
    g = randn((W * 2048,), 700 + r)
    _, true, _ = rs_reference(gather(g), W, r, "e4m3", "fp32")
    res = {}
    for name, kw in (
        ("nearest", {}),
        ("error_feedback", {"error_feedback": fc.ErrorFeedback()}),
        ("stochastic", {"rounding": "stochastic"}),
    ):
        mean = torch.zeros(true.numel(), dtype=torch.float64)
        first = None
        for _ in range(T):
            o = fc.reduce_scatter(g, **kw).double()
            first = o if first is None else first
            mean += o / T
        s1, n1 = sqnr_db(first, true)
        s, n = sqnr_db(mean, true)
        res[name] = (global_sqnr(s1, n1), global_sqnr(s, n))
    ctx.info.update({f"{k}_sqnr_step1_dB": round(v[0], 2) for k, v in res.items()})
    ctx.info.update({f"{k}_sqnr_mean{T}_dB": round(v[1], 2) for k, v in res.items()})
    gain_ef, gain_sr = res["error_feedback"][1] - res["nearest"][1], res["stochastic"][1] - res["nearest"][1]
    assert gain_ef > 12, f"error feedback improved the {T}-step mean by only {gain_ef:.1f} dB"
    assert gain_sr > 3, f"stochastic rounding improved the {T}-step mean by only {gain_sr:.1f} dB"
    # bf16 residuals (half the memory) keep most of the gain
    ef16 = fc.ErrorFeedback(torch.bfloat16)
    mean = torch.zeros(true.numel(), dtype=torch.float64)
    for _ in range(T):
        mean += fc.reduce_scatter(g, error_feedback=ef16).double() / T
    db16 = global_sqnr(*sqnr_db(mean, true))
    ctx.info[f"error_feedback_bf16_sqnr_mean{T}_dB"] = round(db16, 2)
    assert ef16.residual.dtype == torch.bfloat16 and db16 - res["nearest"][1] > 10, db16
    # compact residuals (E5M2 codes + one scale: 1 byte per element) keep most of it too
    ef8 = fc.ErrorFeedback("fp8")
    mean = torch.zeros(true.numel(), dtype=torch.float64)
    for _ in range(T):
        mean += fc.reduce_scatter(g, error_feedback=ef8).double() / T
    db8 = global_sqnr(*sqnr_db(mean, true))
    ctx.info[f"error_feedback_fp8_sqnr_mean{T}_dB"] = round(db8, 2)
    assert ef8.residual is None and ef8.nbytes() == g.numel() + 4, (ef8.residual, ef8.nbytes())  # codes + scale
    assert db8 - res["nearest"][1] > 10, db8
    # all_to_all (the ZeRO-1/2 gradient path) with error feedback: the same convergence of the mean
    tok = randn((W * 8, 256), 710 + r)
    want = torch.cat([t.view(W, 8, 256)[r] for t in gather(tok)])  # what rank r receives, exactly
    out = {}
    for name, ef in (
        ("nearest", None),
        ("error_feedback", fc.ErrorFeedback()),
        ("error_feedback_fp8", fc.ErrorFeedback("fp8")),
    ):
        mean = torch.zeros_like(want, dtype=torch.float64)
        for _ in range(T):
            mean += fc.all_to_all(tok, error_feedback=ef).double() / T
        out[name] = global_sqnr(*sqnr_db(mean, want))
    ctx.info.update({f"a2a_{k}_sqnr_mean{T}_dB": round(v, 2) for k, v in out.items()})
    assert out["error_feedback"] - out["nearest"] > 12 and out["error_feedback_fp8"] - out["nearest"] > 10, out
    expect_error(
        lambda: fc.all_to_all(tok, wire="bf16", error_feedback=fc.ErrorFeedback()), fc.Fp8CommError, "error_feedback"
    )


# ------------------------------------------------------------------------------------------------- SQNR
def check_sqnr(ctx: Ctx) -> None:
    """SQNR of reduce_scatter (SUM) vs the fp32 reference, per format and scale encoding, at this world size."""
    r, W = ctx.rank, ctx.world
    floors = {"e4m3": 28.0, "e5m2": 22.0}
    for fmt in ("e4m3", "e5m2"):
        for enc in ("fp32", "e8m0"):
            x = randn((W * 8192,), 800 + r)
            out = fc.reduce_scatter(x, fmt=fmt, scaling=enc)
            _, true, _ = rs_reference(gather(x), W, r, fmt, enc)
            db = global_sqnr(*sqnr_db(out, true))
            ctx.info[f"rs_sum_{fmt}_{enc}_dB"] = round(db, 2)
            assert db > floors[fmt], f"{fmt}/{enc}: SQNR {db:.1f} dB below {floors[fmt]}"


# ------------------------------------------------------------------------------------------------ stats
def check_stats(ctx: Ctx) -> None:
    r, W = ctx.rank, ctx.world
    fc.reset_comm_stats()
    x = randn((1000,), 900 + r, torch.bfloat16)
    fc.all_gather(x, check=True)
    cb = 1008 + 32  # payload 1000 -> 1008 (16-byte aligned), 8 fp32 scales = 32 bytes
    s = fc.comm_stats()["all_gather"]
    assert (s["calls"], s["wire_bytes"], s["dtype_bytes"]) == (1, (W - 1) * cb, (W - 1) * 2000), s
    assert s["check_bytes"] == (17 + 2 * W) * 8 * (W - 1), s
    for enc, lo in (("fp32", 1.939), ("e8m0", 1.984)):
        fc.reset_comm_stats()
        fc.reduce_scatter(randn((W * 4096,), 910 + r, torch.bfloat16), scaling=enc)
        s = fc.comm_stats(reset=True)["reduce_scatter"]
        ctx.info[f"rs_ratio_vs_bf16_{enc}"] = round(s["ratio"], 4)
        assert s["ratio"] >= lo, (enc, s)
        assert fc.comm_stats() == {}
    # A Buffer reuses its scratch memory: no allocation on the second call of the same size.
    buf = fc.Buffer(fmt="e4m3", scaling="fp32")
    y = randn((W * 300,), 920 + r)
    o1 = buf.reduce_scatter(y)
    n_alloc = buf.pool.allocations
    o2 = buf.reduce_scatter(y)
    assert buf.pool.allocations == n_alloc > 0 and torch.equal(o1, o2)


# ------------------------------------------------------------------------------------- mismatches, bad input
def expect_error(fn, exc, *fragments) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        fn()
    except exc as e:
        msg = str(e)
        for f in fragments:
            assert f in msg, f"error message lacks {f!r}: {msg}"
        return msg, time.perf_counter() - t0
    raise AssertionError(f"no {exc.__name__} raised")


class _Checked:
    """fp8comm.comm with check=True on every call (the collectives it forwards; everything else as is)."""

    def __getattr__(self, name):
        f = getattr(_fc_under_test, name)
        if name in COLLECTIVES:
            return lambda *a, **k: f(*a, **{"check": True, **k})
        return f


_fc_under_test = fc


def check_mismatch(ctx: Ctx) -> None:
    """Ranks that disagree get the same clear error on every rank within seconds, not a hang (check=True: every
    call checked, the debugging mode; check_check_policy covers the default, which checks the first calls)."""
    r, W = ctx.rank, ctx.world
    fc = _Checked()
    times = {}
    _, times["numel"] = expect_error(
        lambda: fc.all_gather(torch.randn(64 + r)),
        fc.CommMismatchError,
        "numel per rank",
        str([64 + i for i in range(W)]),
    )
    _, times["shape"] = expect_error(
        lambda: fc.reduce_scatter(torch.randn(W * 8 if r else 8, 8 if r else W * 8)),
        fc.CommMismatchError,
        "different shapes",
    )
    dt = torch.bfloat16 if r == 0 else torch.float32
    _, times["dtype"] = expect_error(
        lambda: fc.reduce_scatter(torch.randn(W * 8).to(dt)), fc.CommMismatchError, "input dtype"
    )
    _, times["option"] = expect_error(
        lambda: fc.all_reduce(torch.randn(W * 8), fmt="e5m2" if r == 0 else "e4m3"), fc.CommMismatchError, "wire format"
    )
    outs = [1] * W
    if r == 0:
        outs[W - 1] = 2  # rank 0 expects 2 rows from the last rank, which sends 1
    _, times["splits"] = expect_error(
        lambda: fc.all_to_all(torch.randn(W, 16), outs, [1] * W),
        fc.CommMismatchError,
        "sends 1 rows to rank 0, which expects 2",
    )
    # Deferred checks (they travel while the first piece is quantized) raise the same way, before any payload:
    # even splits of different token counts, one rank with an empty input, a bf16 wire.
    _, times["even_splits"] = expect_error(
        lambda: fc.all_to_all(torch.randn(W * (1 + r), 16)), fc.CommMismatchError, "which expects"
    )
    expect_error(
        lambda: fc.all_to_all(torch.randn(W * (1 + r), 16), wire="bf16"), fc.CommMismatchError, "which expects"
    )
    _, times["empty"] = expect_error(
        lambda: fc.all_gather(torch.randn(0 if r == 0 else 128)), fc.CommMismatchError, "numel per rank"
    )
    expect_error(
        lambda: fc.reduce_scatter_into(torch.empty(0 if r == 0 else 8), torch.randn(0 if r == 0 else W * 8)),
        fc.CommMismatchError,
        "numel per rank",
    )
    ins = [1] * W
    if r == 1:
        ins[0] = 2  # split sizes that do not add up to the tokens: a local error on rank 1 only
    frag = "sums to" if r == 1 else "rejected their input"
    _, times["split_sum"] = expect_error(lambda: fc.all_to_all(torch.randn(W, 16), [1] * W, ins), fc.Fp8CommError, frag)
    nc = torch.randn(16, W * 4).t() if r == 1 else torch.randn(W * 4, 16)
    frag = "not contiguous" if r == 1 else "rejected their input"
    _, times["contiguity"] = expect_error(lambda: fc.reduce_scatter(nc), fc.Fp8CommError, frag)
    _, times["float8"] = expect_error(
        lambda: fc.all_gather(torch.randn(8).to(torch.float8_e4m3fn)), fc.Fp8CommError, "gloo rejects float8"
    )
    # With the check off, local errors still raise before any collective (every rank passes the same bad input).
    expect_error(lambda: fc.all_gather(torch.arange(8), check=False), fc.Fp8CommError, "float32, bfloat16")
    bad_out = torch.empty(W * 8 + 1)
    _, times["into_size"] = expect_error(
        lambda: fc.all_gather_into(bad_out, torch.randn(8)), fc.Fp8CommError, "output has"
    )
    _, times["typo"] = expect_error(
        lambda: fc.reduce_scatter(torch.randn(W * 8), scalling="e8m0"), fc.Fp8CommError, "unknown option"
    )
    # One rank asks for hierarchical mode: no node group is created before the check, so no rank can hang.
    _, times["hierarchical"] = expect_error(
        lambda: fc.all_reduce(torch.randn(W * 8), hierarchical=r == 0), fc.Fp8CommError
    )
    ctx.info["seconds_to_error"] = {k: round(v, 3) for k, v in times.items()}
    # The group is still usable afterwards.
    x = randn((40,), 950 + r)
    out = fc.all_gather(x)
    assert torch.equal(out[r * 40 : (r + 1) * 40], qdq(x.view(1, -1), "e4m3", "fp32").view(-1))


def check_check_policy(ctx: Ctx) -> None:
    """Default options: the metadata check runs on the first calls of each op per group only, so steady-state calls
    add no collective (and no host sync on GPU); a mismatch in a first call still raises on every rank."""
    import os

    from fp8comm.comm import state

    FIRST_CALLS = getattr(state, "FIRST_CALLS", 3)
    r, W = ctx.rank, ctx.world
    assert os.environ.get("FP8COMM_CHECK") is None, "this check measures the library default"
    g = dist.new_group(list(range(W)), backend="gloo")  # a fresh group: no calls made on it yet
    # a first-call mismatch on the fresh group: the same clear error on every rank
    expect_error(lambda: fc.all_gather(torch.randn(64 + r), group=g), fc.CommMismatchError, "numel per rank")
    fc.reset_comm_stats()
    x, t = randn((W * 256,), 1500 + r), randn((W * 3, 256), 1510 + r, torch.bfloat16)
    ins = [1 + j for j in range(W)]
    outs = [1 + r] * W
    tt = randn((sum(ins), 256), 1520 + r, torch.bfloat16)
    calls = {
        "all_gather": [
            lambda: fc.all_gather(x, group=g),
            lambda: fc.all_gather_into(torch.empty(W * x.numel()), x, group=g, async_op=True).wait(),
        ],
        "reduce_scatter": [
            lambda: fc.reduce_scatter(x, group=g),
            lambda: fc.reduce_scatter(x, group=g, async_op=True).wait(),
        ],
        "all_reduce": [lambda: fc.all_reduce(x, group=g), lambda: fc.all_reduce_into(x.clone(), x, group=g)],
        "all_to_all": [lambda: fc.all_to_all(t, group=g), lambda: fc.all_to_all(tt, outs, ins, group=g)],
    }
    growth = {}
    for op, fns in calls.items():
        seen = []
        for _ in range(6):
            for fn in fns:
                fn()
                seen.append(fc.comm_stats().get(op, {}).get("check_bytes", 0))
        # the first call above was already this group's first all_gather (the mismatch): one fewer checked there
        first = FIRST_CALLS - (1 if op == "all_gather" else 0)
        growth[op] = seen
        assert all(seen[i] > seen[i - 1] for i in range(1, first)) and seen[0] > 0, (op, seen)
        assert len(set(seen[first - 1 :])) == 1, f"{op}: check bytes still growing after {first} calls: {seen}"
    ctx.info["check_bytes_per_call"] = growth
    # explicit modes: check=True checks every call, check=False none
    before = fc.comm_stats()["reduce_scatter"]["check_bytes"]
    fc.reduce_scatter(x, group=g, check=True)
    fc.reduce_scatter(x, group=g, check="always")
    mid = fc.comm_stats()["reduce_scatter"]["check_bytes"]
    fc.reduce_scatter(x, group=g, check=False)
    assert mid == before + 2 * (17 + 2 * W) * 8 * (W - 1) and fc.comm_stats()["reduce_scatter"]["check_bytes"] == mid
    expect_error(lambda: fc.reduce_scatter(x, group=g, check="sometimes"), fc.Fp8CommError, "check")
    dist.destroy_process_group(g)


def check_is_completed(ctx: Ctx) -> None:
    """An async handle says is_completed() only once its output is valid (decoded), without wait() being called."""
    r = ctx.rank
    x = randn((4000,), 1600 + r)
    pending = 0  # polls that answered False: the staged backend's works stay "in flight" for a few polls
    for name, start, want in (
        ("all_gather_into", lambda o: fc.all_gather_into(o, x, async_op=True), fc.all_gather(x)),
        ("reduce_scatter_into", lambda o: fc.reduce_scatter_into(o, x, async_op=True), fc.reduce_scatter(x)),
    ):
        out = torch.full_like(want, float("nan"))
        h = start(out)
        deadline = time.monotonic() + 30
        while not h.is_completed():
            pending += 1
            assert time.monotonic() < deadline, f"{name}: never completed"
            time.sleep(0.001)
        assert torch.equal(out, want), f"{name}: is_completed() before the output was written"
        assert h.wait() is out
    ctx.info["polls_in_flight"] = pending
    if dist.get_backend() == "staged":  # its works report in flight first: the polling path must have seen it
        assert pending > 0, "every poll answered True at once: the in-flight path was never exercised"


def check_guard(ctx: Ctx) -> None:
    """The numerics guard through real collectives: the packing kernels count underflow per bucket, Guard.step()
    sums the counts over the ranks, and a bucket whose data stops fitting (outliers on ONE rank) falls back to BF16
    on every rank at the same step while the healthy bucket stays FP8."""
    from on_device import test_device

    r, W = ctx.rank, ctx.world
    dev = test_device()
    guard = fc.Guard(fc.GuardPolicy(threshold=0.01, patience=2, cooldown=3))
    decisions, bf16_steps = [], 0
    for step in range(9):
        for key in ("healthy", "outliers"):
            x = randn((W * 1024,), 1700 + 10 * step + r)
            if key == "outliers" and r == 0 and 1 <= step <= 3:
                x[::128] = 1e12  # one outlier per block: the rest of every block underflows (on rank 0 only)
            if guard.wire(key) == "fp8":
                fc.reduce_scatter(x, guard=guard.bucket(key, dev))
            else:  # what an engine does in fallback: its own high-precision collective, nothing counted
                bf16_steps += 1
                out = torch.empty(1024, dtype=torch.bfloat16)
                dist.reduce_scatter_tensor(out, x.to(torch.bfloat16))
        decisions.append(guard.step())
    wires = [(d["healthy"], d["outliers"]) for d in decisions]
    ctx.info.update(wires=[w[1] for w in wires], fractions=[round(h.get("outliers", 0), 4) for h in guard.history])
    everyone = [None] * W
    dist.all_gather_object(everyone, wires)
    assert all(e == wires for e in everyone), "ranks took different guard decisions"
    assert all(h == "fp8" for h, _ in wires), "the healthy bucket fell back"
    # step() k decides on step k-1's counts: steps 1 and 2 over -> decided at k = 2, 3 -> patience 2 reached at
    # k = 3, whose returned wires (for steps 4, 5, 6: cooldown 3) say BF16
    assert [o for _, o in wires] == ["fp8", "fp8", "fp8", "bf16", "bf16", "bf16", "fp8", "fp8", "fp8"], wires
    assert bf16_steps == 3 and guard.summary()["outliers"]["switches"] == 2
    assert guard.history[1]["outliers"] > 0.9 / W  # rank 0's blocks: 127 of 128 elements underflowed
    expect_error(lambda: fc.reduce_scatter(randn((W * 128,), 1), guard="outliers"), fc.Fp8CommError, "GuardBucket")
    # The MoE all-to-all: its bucket counts the forward's tokens and, on the FP8 grad wire, the backward's gradient
    # (one outlier per 1x128 block of it: 127 of 128 elements underflow); a bf16 backward adds nothing.
    for grad_wire in ("fp8", "bf16"):
        moe = guard.bucket(f"moe.{grad_wire}", dev)
        tokens = randn((W * 4, 256), 1790 + r).requires_grad_()
        out = fc.all_to_all(tokens, guard=moe, grad_wire=grad_wire)
        assert moe.elements == tokens.numel() and int(moe.counters.sum()) == 0, (moe.elements, moe.counters)
        g = randn(tuple(out.shape), 1795 + r)
        g[:, ::128] = 1e12
        out.backward(g)
        if grad_wire == "fp8":
            assert moe.elements == 2 * tokens.numel(), f"the FP8 backward was not counted: {moe.elements}"
            assert int(moe.counters[1]) == g.numel() * 127 // 128, moe.counters.tolist()
        else:
            assert moe.elements == tokens.numel() and int(moe.counters.sum()) == 0, moe.counters.tolist()


def check_poll_issues_no_collective(ctx: Ctx) -> None:
    """Polling never issues a collective: rank 0 polls an async all_reduce (its reduce-scatter finished: the barrier
    waits for it) before its next all_gather, the other ranks do not poll. A poll that started the all-gather phase
    would put it before that all_gather on rank 0 only (gloo: a reset connection or a timeout)."""
    r, W = ctx.rank, ctx.world
    x = randn((W * 512,), 1800 + r)
    want = fc.all_reduce(x)
    h = fc.all_reduce(x, async_op=True)
    dist.barrier()  # gloo: completes after the work queued before it, the reduce-scatter phase
    if r == 0:
        polls = [h.is_completed() for _ in range(3)]
        assert polls == [False] * 3, f"is_completed() before wait() on a two-phase op: {polls}"
    z = randn((W * 128 + 256,), 1810 + r)
    got = fc.all_gather(z)
    assert torch.equal(got.view(W, -1)[r], qdq(z.view(1, -1), "e4m3", "fp32")[0]), "all_gather after the poll"
    out = h.wait()
    assert torch.equal(out, want), "the polled all_reduce differs from the same call made synchronously"
    assert h.is_completed()


def check_guard_bucket_order(ctx: Ctx) -> None:
    """The guard sums bucket counts row by row: buckets registered in a different order on one rank (same count)
    are a clear error on every rank, not counts added to the wrong bucket."""
    r = ctx.rank
    guard = fc.Guard(fc.GuardPolicy())
    for key in ("attn", "mlp") if r == 0 else ("mlp", "attn"):
        guard.bucket(key, torch.device("cpu")).add_elements(128)
    msg, _ = expect_error(guard.step, fc.Fp8CommError, "order", "attn")
    ctx.info["error"] = msg[:120]
    same = fc.Guard(fc.GuardPolicy())
    for key in ("attn", "mlp"):
        same.bucket(key, torch.device("cpu")).add_elements(128)
    assert same.step() == {"attn": "fp8", "mlp": "fp8"}


CHECKS_GRAD = [
    check_all_gather,
    check_reduce_scatter,
    check_rs_magnitudes,
    check_nonfinite,
    check_all_reduce,
    check_async,
    check_error_feedback,
    check_sqnr,
    check_stats,
    check_mismatch,
    check_check_policy,
    check_is_completed,
    check_poll_issues_no_collective,
    check_guard,
    check_guard_bucket_order,
]

from dist_checks_fp4 import CHECKS_FP4  # noqa: E402  (the 4-bit wire)
from dist_checks_more import CHECKS_MORE  # noqa: E402  (MoE, subgroups, hierarchical)

CHECKS = CHECKS_GRAD + CHECKS_MORE + CHECKS_FP4
