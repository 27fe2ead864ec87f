#!/usr/bin/env python3
"""GPU checks for fp8comm as one script: `PYTHONPATH=. python3 launch/device_check.py` on a CUDA machine.

Runs the sections in SECTIONS in order (others add theirs with @section("name")): env, triton_bitexact (every
Triton function against the CPU reference, PASS/FAIL counts), triton_ptx (hazards in the compiled kernels),
triton_bandwidth (quantize+pack and unpack against a device copy), gemm (launch/device_check_gemm.py, when
present). A section's exception is caught and reported, never aborts the rest. Results go to
$OUT/device_check.json when OUT is set; exit status 1 if any section failed.
`--quick` shrinks every size, so the script's logic also runs on CPU under TRITON_INTERPRET=1 (--device cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SECTIONS: list[tuple[str, Callable]] = []


def section(name: str):
    """Register `fn(ctx) -> dict` as a section; the dict may carry "status": "ok" | "fail" | "skipped"."""

    def deco(fn):
        SECTIONS.append((name, fn))
        return fn

    return deco


@dataclass
class Ctx:
    """What every section gets: the device, size mode, timing repetitions and the results so far."""

    device: torch.device
    quick: bool
    reps: int = 20
    warmup: int = 3
    sizes_mib: tuple = (16, 64, 256, 1024)
    sweep: bool = True  # the pack kernel's tile x warps sweep at 256 MiB (CUDA only; ~20 s)
    results: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# --- comparison ------------------------------------------------------------------------------------------------------
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[str, int]:
    """('exact' | 'nan-bits' | 'FAIL', n): nan-bits = same NaN positions and every other bit equal, only NaN
    payloads differ (CUDA returns the canonical NaN where x86 keeps the operand's); n = elements that differ."""
    got = got.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return "FAIL", -1
    if got.dtype not in _INT_VIEW:
        n = int((got != want).sum())
        return ("exact", 0) if n == 0 else ("FAIL", n)
    gi, wi = got.view(_INT_VIEW[got.dtype]), want.view(_INT_VIEW[want.dtype])
    diff = gi != wi
    if not bool(diff.any()):
        return "exact", 0
    gn, wn = torch.isnan(got), torch.isnan(want)
    bad = (gn != wn) | (diff & ~gn)
    if bool(bad.any()):
        return "FAIL", int(bad.sum())
    return "nan-bits", int(diff.sum())


class Tally:
    """PASS/FAIL counts of named comparisons; 'nan-bits' passes and is counted apart."""

    def __init__(self) -> None:
        self.passed = self.nan_bits = 0
        self.failures: list[str] = []

    def check(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        verdict, n = compare(got, want)
        if verdict == "FAIL":
            self.failures.append(f"{name}: {n} elements differ")
            print(f"  FAIL {name}: {n} elements differ", flush=True)
        else:
            self.passed += 1
            self.nan_bits += verdict == "nan-bits"

    def guard(self, name: str, thunk: Callable[[], None]) -> None:
        """Run one case; an exception (say a kernel that fails to compile) is a failure of that case only."""
        try:
            thunk()
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            self.failures.append(f"{name}: {msg}")
            print(f"  ERROR {name}: {msg}", flush=True)
            if len(self.failures) <= 2:
                traceback.print_exc()

    def summary(self) -> dict:
        return {
            "status": "fail" if self.failures else "ok",
            "pass": self.passed,
            "fail": len(self.failures),
            "pass_with_nan_payload_diffs": self.nan_bits,
            "failures": self.failures[:50],
        }


# --- data ----------------------------------------------------------------------------------------------------------
def bf16_patterns() -> torch.Tensor:
    """All 65536 bf16 bit patterns as [512, 128]."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(512, 128)


def mixed(m: int, k: int, seed: int, dtype=torch.float32, lo: int = -40, hi: int = 40) -> torch.Tensor:
    """Random values over binades [lo, hi) with +-0, +-inf, NaN, fp32 subnormals and format maxima sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(lo, hi, (m, k), generator=g).float())
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-45, 3e38, -448.0, 57344.0])
    pick = torch.rand(m, k, generator=g) < 0.02
    x[pick] = special[torch.randint(0, special.numel(), (int(pick.sum()),), generator=g)]
    return x.to(dtype)


def tiny(m: int, k: int, seed: int) -> torch.Tensor:
    """fp32 values in [2**-149, 2**-110]: subnormal amax, clamped scales, subnormal quotients and products."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(1, 0x04800000, (m, k), generator=g, dtype=torch.int32)  # exponent field <= 9
    sign = (torch.rand(m, k, generator=g) < 0.5).to(torch.int32) << 31
    x = (bits | sign).view(torch.float32)
    x[: m // 2] = torch.where(x[: m // 2].abs() < 2.0**-126, x[: m // 2], x[: m // 2] * 2.0**-20)
    return x


# --- section: env --------------------------------------------------------------------------------------------------
@section("env")
def env_section(ctx: Ctx) -> dict:
    import triton

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(ctx.device),
        "interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        info.update(
            name=p.name,
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            cuda=torch.version.cuda,
        )
    for k, v in info.items():
        print(f"  {k}: {v}")
    return info


# --- section: bit-exactness against the CPU reference --------------------------------------------------------------
def _quant_cases():
    from fp8comm.quant.scaling import Scaling

    return [  # (scaling, rounding, seed, caller-given scales?)
        (Scaling(1, 32), "nearest", 0, False),
        (Scaling(1, 128), "nearest", 0, False),
        (Scaling(1, 128, "e8m0"), "nearest", 0, False),
        (Scaling(1, 128, "e8m0"), "stochastic", 1, False),
        (Scaling(1, 128, "pow2", margin=3), "stochastic", 2**40 + 3, False),
        (Scaling(1, None), "nearest", 0, False),
        (Scaling(None, None), "nearest", 0, False),
        (Scaling(None, None, "pow2", margin=-2), "stochastic", 5, False),
        (Scaling(128, 128), "nearest", 0, False),
        (Scaling(128, 128, "e8m0"), "stochastic", 7, False),
        (Scaling(1, 100, "fp32", margin=8), "nearest", 0, False),
        (Scaling(1, 128), "nearest", 0, True),
        (Scaling(None, None, "pow2"), "stochastic", 3, True),
    ]


def _given(shape, pow2: bool) -> torch.Tensor:
    vals = [1.0, 2.0**-126, 2.0**100, 2.0**-20, 0.0625] + ([] if pow2 else [3.7e-3, 1.2345e20, 0.7, 1e-37])
    n = shape[0] * shape[1]
    return torch.tensor(vals, dtype=torch.float32).repeat(n // len(vals) + 1)[:n].reshape(shape)


@section("triton_bitexact")
def bitexact_section(ctx: Ctx) -> dict:
    from fp8comm.quant import backend_reference as br
    from fp8comm.quant import backend_triton as bt
    from fp8comm.quant.formats import E4M3, E5M2
    from fp8comm.quant.scaling import Scaling
    from fp8comm.quant.wire import ChunkLayout

    dev, t, q = ctx.device, Tally(), ctx.quick
    big = (64, 512) if q else (1024, 4096)
    data = {
        "bf16_all": bf16_patterns(),
        "bf16_rand": mixed(*big, seed=1, dtype=torch.bfloat16),
        "fp32_odd": mixed(33 if q else 257, 200 if q else 1000, seed=2),
        "fp16": mixed(40 if q else 300, 384, seed=3, dtype=torch.float16, lo=-20, hi=16),
        "tiny": tiny(16 if q else 64, 256, seed=4),
    }
    cases = _quant_cases()
    t0 = time.time()

    def quant(dname, fmt, sc, rnd, seed, given):
        x = data[dname]
        scale = _given(sc.scale_shape(*x.shape), sc.encoding != "fp32") if given else None
        want = br.quantize_2d(x, fmt, sc, rnd, seed, scale)
        got = bt.quantize_2d(x.to(dev), fmt, sc, rnd, seed, None if scale is None else scale.to(dev))
        name = f"quantize {dname} {fmt.name} {sc.describe()} {rnd}{' given' if given else ''}"
        for part, a, b in zip(("codes", "scale", "amax"), got, want):
            t.check(f"{name} {part}", a, b)

    runs = [("bf16_all", fmt) + c for fmt in (E4M3, E5M2) for c in cases]
    runs += [(d, E4M3 if d != "fp16" else E5M2) + c for d in ("bf16_rand", "fp32_odd", "fp16") for c in cases[::2]]
    runs += [
        ("tiny", fmt, sc, "stochastic" if sc.margin else "nearest", 9, False)
        for fmt in (E4M3, E5M2)
        for sc in (
            Scaling(1, 128),
            Scaling(1, 128, "fp32", 10),
            Scaling(1, 128, "fp32", -10),
            Scaling(None, None),
            Scaling(1, 32, "pow2", 30),
            Scaling(1, 64, "e8m0", -5),
        )
    ]
    for r in runs:
        t.guard(f"quantize {r[0]} {r[1].name} {r[2].describe()} {r[3]}", lambda r=r: quant(*r))

    def quant_t(dname, fmt, sc, rnd, seed, given):  # per tensor, codes + transposed codes in one pass
        x = data[dname]
        scale = torch.tensor([[0.0625 if sc.encoding != "fp32" else 3.7e-3]]) if given else None
        c, s, a = br.quantize_2d(x, fmt, sc, rnd, seed, scale)
        got = bt.quantize_2d_t(x.to(dev), fmt, sc, rnd, seed, None if scale is None else scale.to(dev))
        name = f"quantize_2d_t {dname} {fmt.name} {sc.describe()} {rnd}{' given' if given else ''}"
        for part, g_, w_ in zip(("codes", "codes_t", "scale", "amax"), got, (c, c.t().contiguous(), s, a)):
            t.check(f"{name} {part}", g_, w_)

    for d in ("bf16_all", "bf16_rand", "fp32_odd", "fp16", "tiny"):
        for fmt in (E4M3, E5M2):
            for c in cases:
                if c[0].rows is None and c[0].cols is None:
                    t.guard(f"quantize_2d_t {d} {fmt.name} {c[0].describe()}", lambda r=(d, fmt) + c: quant_t(*r))

    def quant_rowcol(dname, fmt, sc, rnd):  # 1xB blocks of x and of x^T from one read
        x = data[dname]
        got, got_t = bt.quantize_2d_rowcol(x.to(dev), fmt, sc, rnd, 11)
        name = f"quantize_2d_rowcol {dname} {fmt.name} {sc.describe()} {rnd}"
        for tag, g3, w3 in (
            ("x", got, br.quantize_2d(x, fmt, sc, rnd, 11)),
            ("x^T", got_t, br.quantize_2d(x.t(), fmt, sc, rnd, 11)),
        ):
            for part, g_, w_ in zip(("codes", "scale", "amax"), g3, w3):
                t.check(f"{name} {tag} {part}", g_, w_)

    for d in ("bf16_all", "bf16_rand", "fp32_odd", "fp16"):
        for fmt in (E4M3, E5M2):
            for sc, rnd in (
                (Scaling(1, 128), "nearest"),
                (Scaling(1, 128, "e8m0"), "stochastic"),
                (Scaling(1, 32, "pow2", margin=2), "nearest"),
            ):
                t.guard(
                    f"quantize_2d_rowcol {d} {fmt.name} {sc.describe()}", lambda r=(d, fmt, sc, rnd): quant_rowcol(*r)
                )
    print(f"  quantize: {t.passed} pass, {len(t.failures)} fail ({time.time() - t0:.0f} s)", flush=True)

    m, k = (64, 260) if q else (512, 1024)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(m * k // 256 + 1)[: m * k].reshape(m, k)
    g = torch.Generator().manual_seed(5)
    for sc in (Scaling(1, 128), Scaling(128, 128), Scaling(None, None), Scaling(1, None, "e8m0")):
        mb, kb = sc.scale_shape(m, k)
        scale = torch.exp2(torch.randint(-126, 128, (mb, kb), generator=g).float())
        if sc.encoding == "fp32":
            scale = scale * (1 + torch.rand(mb, kb, generator=g))
        for fmt in (E4M3, E5M2):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                name = f"dequantize {sc.describe()} {fmt.name} {dt}"
                t.guard(
                    name,
                    lambda: t.check(
                        name,
                        bt.dequantize_2d(codes.to(dev), scale.to(dev), fmt, sc, dt),
                        br.dequantize_2d(codes, scale, fmt, sc, dt),
                    ),
                )

    x = data["bf16_rand"]
    wide = mixed(8 if q else 64, 20000 if q else 40000, seed=6)  # cols=None: on CUDA wider than one tile
    layouts = [
        (x, ChunkLayout((x.shape[0] // 8,) * 8, x.shape[1], Scaling(1, 128)), E4M3, "nearest"),
        (x, ChunkLayout((x.shape[0] // 8,) * 8, x.shape[1], Scaling(1, 128, "e8m0")), E4M3, "stochastic"),
        (data["fp32_odd"][:9], ChunkLayout((3, 0, 5, 1, 0), 200 if q else 1000, Scaling(1, 32)), E5M2, "nearest"),
        (
            wide,
            ChunkLayout((wide.shape[0] // 2, 0, wide.shape[0] // 2), wide.shape[1], Scaling(1, None, "e8m0")),
            E4M3,
            "nearest",
        ),
    ]

    def wire(xx, lay, fmt, rnd):
        name = f"{lay.rows[:3]}.. k={lay.k} {lay.scaling.describe()} {fmt.name} {rnd}"
        want = torch.full((lay.total_bytes + 5,), 0xAB, dtype=torch.uint8)
        br.pack_chunks(xx, lay, fmt, rnd, 4, want)
        got = torch.full_like(want, 0xAB, device=dev)
        t.guard(
            f"pack {name}", lambda: t.check(f"pack {name}", bt.pack_chunks(xx.to(dev), lay, fmt, rnd, 4, got), want)
        )
        for dt in (torch.float32, torch.bfloat16):
            o = br.unpack_chunks(want, lay, fmt, torch.empty(lay.total_rows, lay.k, dtype=dt))
            t.guard(
                f"unpack_chunks {name} {dt}",
                lambda: t.check(
                    f"unpack_chunks {name} {dt}",
                    bt.unpack_chunks(want.to(dev), lay, fmt, torch.empty(o.shape, dtype=dt, device=dev)),
                    o,
                ),
            )

    def wire_sum(n, sc, fmt):
        rows, kk = (4, 256) if q else (64, 2048)
        xx = mixed(rows * n, kk, seed=10 + n)
        lay = ChunkLayout((rows,) * n, kk, sc)
        buf = br.pack_chunks(xx, lay, fmt, "nearest", 0, torch.empty(lay.total_bytes, dtype=torch.uint8))
        want = br.unpack_sum(buf, lay, fmt, torch.empty(rows, kk))
        got = bt.unpack_sum(buf.to(dev), lay, fmt, torch.full((rows, kk), 7.0, device=dev))
        t.check(f"unpack_sum n={n} {sc.describe()} {fmt.name}", got, want)

    for xx, lay, fmt, rnd in layouts:
        wire(xx, lay, fmt, rnd)
    for n in (1, 2, 3, 4, 8):
        for sc, fmt in ((Scaling(1, 128), E5M2), (Scaling(1, 32, "e8m0"), E4M3)):
            t.guard(f"unpack_sum n={n} {sc.describe()}", lambda n=n, sc=sc, fmt=fmt: wire_sum(n, sc, fmt))
    out = t.summary()
    print(
        f"  PASS {out['pass']}  FAIL {out['fail']}  (of which NaN-payload-only diffs: {t.nan_bits}); "
        f"{time.time() - t0:.0f} s",
        flush=True,
    )
    return out


# --- section: compiled-code hazards --------------------------------------------------------------------------------
HAZARDS = {
    "fma.rn.f32": r"\bfma\.rn(\.ftz)?(\.sat)?\.f32",
    "ftz.f32": r"\.ftz(\.sat)?\.f32",
    "div.full/approx": r"\bdiv\.(full|approx)",
    "rcp.approx": r"\brcp\.approx",
}


@section("triton_ptx")
def ptx_section(ctx: Ctx) -> dict:
    """Counts FMA contraction, flush-to-zero and approximate division in every kernel compiled so far."""
    from fp8comm.quant import backend_triton as bt

    if not ctx.cuda:
        return {"status": "skipped", "reason": "no compiled kernels without CUDA"}
    per_kernel, bad = {}, []
    for kname, variants in bt.LAUNCHED.items():
        counts = dict.fromkeys(HAZARDS, 0)
        for compiled in variants.values():
            ptx = compiled.asm.get("ptx", "")
            for hz, rx in HAZARDS.items():
                counts[hz] += len(re.findall(rx, ptx))
        per_kernel[kname] = {"variants": len(variants), **counts}
        bad += [f"{kname}: {hz} x{n}" for hz, n in counts.items() if n]
        print(f"  {kname}: {len(variants)} variants, " + ", ".join(f"{h}={n}" for h, n in counts.items()))
    return {"status": "fail" if bad else "ok", "kernels": per_kernel, "hazards": bad}


# --- section: bandwidth --------------------------------------------------------------------------------------------
def time_fn(ctx: Ctx, fn: Callable[[], object], graph: bool = False) -> float:
    """Median seconds of fn over ctx.reps runs after ctx.warmup (CUDA events on CUDA, wall clock elsewhere).

    Events around a plain call include the host's launch time whenever the GPU waits for it; graph=True replays
    one captured call instead, which times the GPU work alone."""
    for _ in range(ctx.warmup):
        fn()
    run = fn
    if graph and ctx.cuda:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        run()
    from fp8comm.tools.bench.gemm import bench

    return bench(run, ctx.reps, 0, ctx.device)


def host_us(ctx: Ctx, fn: Callable[[], object], n: int = 50) -> float:
    """Host microseconds per call of fn, enqueued back to back (small kernels: the host is the bottleneck)."""
    n = n if ctx.cuda else 2
    fn()
    if ctx.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    if ctx.cuda:
        torch.cuda.synchronize()
    return dt / n * 1e6


@section("triton_bandwidth")
def bandwidth_section(ctx: Ctx) -> dict:
    """GB/s (bytes read + written) of quantize+pack, unpack_chunks and unpack_sum vs a bf16 device copy."""
    from fp8comm.quant import backend_triton as bt
    from fp8comm.quant.formats import E4M3
    from fp8comm.quant.scaling import Scaling
    from fp8comm.quant.wire import ChunkLayout

    if not ctx.cuda and not ctx.quick:
        return {"status": "skipped", "reason": "timings need CUDA (use --quick to exercise the logic on CPU)"}
    world, k = 8, (256 if ctx.quick else 4096)
    sizes = (1,) if ctx.quick else ctx.sizes_mib
    rows = []
    print("  GB/s count bytes read + written; e2e = one call timed with its host launch, gpu = CUDA-graph replay")
    print("     MiB  copy  pack32 e2e/gpu  ratio  packE8 e2e/gpu  ratio  unpack gpu  sum gpu   host us (pack/unpack)")
    for mib in sizes:
        n = mib * 2**20 // 2 if not ctx.quick else 8 * k * 8
        m = n // k
        x = torch.randn(m, k, device=ctx.device).to(torch.bfloat16)
        dst = torch.empty_like(x)
        row = {"MiB": mib, "elements": n}
        # the baseline is the faster of the two timings: a captured copy_ can become a copy-engine memcpy node
        # (slower than the SM copy kernel at 1 GiB on an H200), while a plain call carries its launch at 16 MiB
        copy = lambda dst=dst, x=x: dst.copy_(x)
        row["copy_GBps"] = 2 * x.numel() * 2 / min(time_fn(ctx, copy), time_fn(ctx, copy, graph=True)) / 1e9
        for enc in ("fp32", "e8m0"):
            lay = ChunkLayout((m // world,) * world, k, Scaling(1, 128, enc))
            buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device=ctx.device)
            nbytes = 2 * n + n + n // 128 * lay.scaling.scale_bytes
            pack = lambda: bt.pack_chunks(x, lay, E4M3, "nearest", 0, buf)
            row[f"pack_{enc}_e2e_GBps"] = nbytes / time_fn(ctx, pack) / 1e9
            row[f"pack_{enc}_GBps"] = nbytes / time_fn(ctx, pack, graph=True) / 1e9
            row[f"pack_{enc}_ratio"] = row[f"pack_{enc}_GBps"] / row["copy_GBps"]
            if enc == "fp32":
                row["pack_host_us"] = host_us(ctx, pack)
                unpack = lambda buf=buf, lay=lay, dst=dst: bt.unpack_chunks(buf, lay, E4M3, dst)
                row["unpack_chunks_bf16_GBps"] = (n + n // 32 + 2 * n) / time_fn(ctx, unpack, graph=True) / 1e9
                row["unpack_host_us"] = host_us(ctx, unpack)
                acc = torch.empty(m // world, k, device=ctx.device)
                row["unpack_sum_GBps"] = (
                    (n + n // 32 + 4 * n // world)
                    / time_fn(ctx, lambda: bt.unpack_sum(buf, lay, E4M3, acc), graph=True)
                    / 1e9
                )
            del buf
        rows.append(row)
        print(
            f"  {mib:>6} {row['copy_GBps']:>5.0f} {row['pack_fp32_e2e_GBps']:>7.0f}/{row['pack_fp32_GBps']:<6.0f}"
            f" {row['pack_fp32_ratio']:>5.2f} {row['pack_e8m0_e2e_GBps']:>7.0f}/{row['pack_e8m0_GBps']:<6.0f}"
            f" {row['pack_e8m0_ratio']:>5.2f} {row['unpack_chunks_bf16_GBps']:>10.0f} {row['unpack_sum_GBps']:>8.0f}"
            f"   {row['pack_host_us']:>5.0f}/{row['unpack_host_us']:.0f}",
            flush=True,
        )
        del x, dst
    sweep = {}
    if ctx.cuda and ctx.sweep:  # tile x warps sweep of the fused pack at 256 MiB: defaults are a guess until measured
        m = 256 * 2**20 // 2 // k
        x = torch.randn(m, k, device=ctx.device).to(torch.bfloat16)
        default = bt.GPU_TILE, bt.GPU_WARPS
        try:
            for enc in ("fp32", "e8m0"):
                lay = ChunkLayout((m // world,) * world, k, Scaling(1, 128, enc))
                buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device=ctx.device)
                for tile, warps in ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)):
                    bt.GPU_TILE, bt.GPU_WARPS = tile, warps
                    s = time_fn(ctx, lambda: bt.pack_chunks(x, lay, E4M3, "nearest", 0, buf), graph=True)
                    sweep[f"{enc} tile={tile} warps={warps}"] = round(
                        (3 * x.numel() + x.numel() // 128 * lay.scaling.scale_bytes) / s / 1e9
                    )
        finally:
            bt.GPU_TILE, bt.GPU_WARPS = default
        print("  pack 256 MiB GB/s by tile/warps: " + ", ".join(f"{t_}: {v}" for t_, v in sweep.items()))
    big = [r for r in rows if r["MiB"] >= 256]
    ok = all(r["pack_fp32_ratio"] >= 0.8 and r["pack_e8m0_ratio"] >= 0.8 for r in big)
    return {
        "status": "ok" if ok or not ctx.cuda else "fail",
        "target": "pack GB/s (CUDA-graph replay) >= 0.80 x copy at >= 256 MiB",
        "rows": rows,
        "tile_sweep_GBps": sweep,
    }


def bandwidth_result_rows(res: dict, device_name: str) -> list[dict]:
    """triton_bandwidth's pack/copy ratios as docs/results/gpu.json rows (>= 256 MiB: the target's sizes)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_results import result_row

    out = []
    for r in res.get("rows", []):
        if r["MiB"] < 256:
            continue
        for enc in ("fp32", "e8m0"):
            unit = f"x bf16 device copy GB/s, CUDA-graph replay ({r['copy_GBps']:.0f} GB/s copy)"
            out.append(
                result_row(
                    f"pack_{enc}_vs_copy_{r['MiB']}MiB", round(r[f"pack_{enc}_ratio"], 3), 0.8, unit, device_name
                )
            )
    return out


# --- section: GEMMs (launch/device_check_gemm.py, owned by the GEMM work; optional) --------------------------------
@section("gemm")
def gemm_section(ctx: Ctx) -> dict:
    """Rows of device_check_gemm.gemm_section(quick, device); any row with status FAIL/ERROR fails the section."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_check_gemm.py")
    if not os.path.exists(path):
        return {"status": "skipped", "reason": f"{path} not present"}
    spec = importlib.util.spec_from_file_location("device_check_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    rows = mod.gemm_section(ctx.quick, ctx.device)
    bad = [r for r in rows if str(r.get("status", "")).upper() in ("FAIL", "ERROR")]
    return {"status": "fail" if bad else "ok", "rows": rows, "failed_rows": len(bad)}


# --- driver --------------------------------------------------------------------------------------------------------
def run_sections(ctx: Ctx, only: set[str] | None = None) -> dict:
    """Run every registered section (or those in `only`), catching errors; returns {name: result}."""
    for name, fn in SECTIONS:
        if only and name not in only:
            continue
        print(f"== {name}", flush=True)
        t0 = time.time()
        try:
            res = fn(ctx) or {}
        except Exception as e:  # a broken section must not hide the others' results
            traceback.print_exc()
            res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res.setdefault("status", "ok")
        res["seconds"] = round(time.time() - t0, 2)
        ctx.results[name] = res
        print(f"== {name}: {res['status']} ({res['seconds']} s)", flush=True)
    return ctx.results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--only", default="", help="comma-separated section names (default: all): " + ", ".join(n for n, _ in SECTIONS)
    )
    p.add_argument("--quick", action="store_true", help="small sizes (logic check; runs on CPU with --device cpu)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", default="16,64,256,1024", help="MiB of bf16 for the bandwidth table")
    p.add_argument("--no-sweep", action="store_true", help="skip the pack kernel's tile sweep")
    p.add_argument("--no-write", action="store_true", help="do not merge pack/copy rows into docs/results/gpu.json")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
    ctx = Ctx(
        dev,
        a.quick,
        reps=a.reps if not a.quick else 2,
        warmup=3 if not a.quick else 1,
        sizes_mib=tuple(int(s) for s in a.sizes.split(",")),
        sweep=not a.no_sweep,
    )
    t0 = time.time()
    results = run_sections(ctx, {s for s in a.only.split(",") if s} or None)
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "argv": sys.argv[1:],
        "seconds": round(time.time() - t0, 1),
        "sections": results,
    }
    bw = results.get("triton_bandwidth", {})
    if dev.type == "cuda" and not a.quick and not a.no_write and bw.get("rows"):
        from gpu_results import merge

        merge(bandwidth_result_rows(bw, torch.cuda.get_device_name(dev)))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "device_check.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {path}")
    bad = [n for n, r in results.items() if r["status"] in ("fail", "error")]
    print(f"== overall: {'FAIL: ' + ', '.join(bad) if bad else 'ok'} ({doc['seconds']} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
