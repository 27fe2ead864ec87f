#!/usr/bin/env python3
"""GPU-readiness checks as one prepared script (H100/H200): `PYTHONPATH=. python3 launch/gpu_ready_check.py`.

One hard budget (`--budget`, default 360 s, so that a run and a rerun fit 15 minutes of device time with the
machine's start): every section checks the deadline (SIGALRM in this process, subprocesses killed with their process
group, a watchdog ends the run if a section hangs in C code past it) and has its own cap; sections run in order of
value and a section that cannot start in time is recorded as skipped. Every row goes into docs/results/gpu.json the
moment it is measured, with a `section_<name>` status row (running / ok / fail / error / cut / skipped) before and
after each section, atomically (launch/gpu_results.py): a crash or a cut loses nothing already measured.
$OUT/gpu_ready.json (when OUT is set) holds the run's record, rewritten after each section.

Sections, most valuable first (issue 20's correctness checks, then the GPU speed goals, then the 0.2 checks):
env; codec_speeds (every wire codec's pack / unpack-and-sum / unpack / residual speed and fixed cost per call,
the rows `fp8comm plan` reads); stream_reuse (launch/gpu_check_streams.py: async calls on one stream decoded on
another behind a delay, eviction and clear()); streams (two streams share one scratch pool; an unordered pool
must corrupt); version_counters (out= writes of every collective bump tensor._version, Triton and reference backends);
e8m0_decode (all 256 E8M0 scale bytes through every decoder on the GPU: 0 -> 2^-127, 255 -> NaN, bit for bit);
reference_on_device (the torch reference on the GPU gives the CPU's bits);
host_ahead (a GPU sleep queued ahead of the calls: the host must return first); blockwise_gemm (the cuBLASLt
block-scaled layout the probe trusts, agreement, 8192^3 and Fp8Linear timings); pack_vs_copy (quantize+pack vs a
device copy at 256 MiB and 1 GiB); train (examples/train_gpt.py, bf16 / fp8_amax / tensorwise / blockwise, seeds in
turn so a cut keeps whole pairs); sync_free (torch's sync detector); offsets (past 2^31); host_time; multi_rank
(tests/dist on CUDA tensors, staged backend); examples (demo, Megatron; needs the wheels of
launch/gpu_wheels.sh). `--only a,b` runs some sections.
Multi-GPU behaviours (NCCL streams, uneven all_to_all_single, hierarchical NCCL groups): launch/gpu_cluster_check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))
from gpu_results import PATH, Runner, Section  # noqa: E402

# calls whose contract is "once per step, where the engine synchronizes anyway": they wait for the PREVIOUS
# call's work (guard.step reads the counts of the step before), so several of them in a row behind a queued sleep
# block by design; host_ahead checks one call after the engine's sync point instead of ten in a row
AT_SYNC_POINT = {"guard.step"}


def init_nccl_1rank() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))


def collective_calls(n: int = 1 << 20) -> dict:
    """name -> thunk of every collective form a steady-state engine makes (tensors allocated once)."""
    import fp8comm.comm as fc

    dev = torch.device("cuda")
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    o = torch.empty(n, device=dev, dtype=torch.bfloat16)
    tok = torch.randn(n // 4096, 4096, device=dev, dtype=torch.bfloat16)
    tok_out = torch.empty_like(tok)
    t = tok.shape[0]
    splits = [t]
    ef = fc.ErrorFeedback()
    guard = fc.Guard(fc.GuardPolicy())
    return {
        "reduce_scatter.guard": lambda: fc.reduce_scatter(x, guard=guard.bucket("b", dev)),
        "guard.step": guard.step,
        "all_gather": lambda: fc.all_gather(x),
        "all_gather_into": lambda: fc.all_gather_into(o, x),
        "all_gather_into.async": lambda: fc.all_gather_into(o, x, async_op=True).wait(),
        "all_gather.fp8_out": lambda: fc.all_gather(x.view(-1, 4096), fp8_out=True),
        "reduce_scatter": lambda: fc.reduce_scatter(x),
        "reduce_scatter_into": lambda: fc.reduce_scatter_into(o, x),
        "reduce_scatter_into.async": lambda: fc.reduce_scatter_into(o, x, async_op=True).wait(),
        "reduce_scatter.error_feedback": lambda: fc.reduce_scatter(x, error_feedback=ef),
        "reduce_scatter.stochastic": lambda: fc.reduce_scatter(x, rounding="stochastic"),
        "all_reduce": lambda: fc.all_reduce(x),
        "all_reduce_into.async": lambda: fc.all_reduce_into(o, x, async_op=True).wait(),
        "all_to_all": lambda: fc.all_to_all(tok, out=tok_out),
        "all_to_all.splits": lambda: fc.all_to_all(tok, splits, splits, out=tok_out),
        "all_to_all.autograd": lambda: fc.all_to_all(tok.clone().requires_grad_(), splits, splits).sum().backward(),
        "all_to_all.fp8_out": lambda: fc.all_to_all(tok, fp8_out=True),
        "all_to_all.async": lambda: fc.all_to_all(tok, out=tok_out, async_op=True).wait(),
    }


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


# ----------------------------------------------------------------------------------------------------- sections
def env(run) -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "gpu": p.name,
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "gpus": torch.cuda.device_count(),
    }
    run.row("env_versions", f"torch {info['torch']}, triton {info['triton']}, cuda {info['cuda']}", None, "versions")
    return info


def codec_speeds(run, device: str = "cuda", elems: tuple[int, int] = (1 << 25, 1 << 28), reps: int = 9) -> dict:
    """Every wire codec's pack, unpack_sum, unpack and residual speed on this GPU (calibration.measure_codecs: bf16
    in 8 chunks at two sizes, from the difference, median of `reps`) and its fixed cost per kernel call: the rows
    `fp8comm plan --codec-speeds docs/results/gpu.json` reads (issue 30; until now 4-bit GPU speeds were assumed)."""
    from fp8comm.comm.calibration import WIRE_CONFIGS, measure_codecs, speed_rows

    res: dict = {}
    # one codec at a time: a cut keeps the codecs already measured
    for name in getattr(run, "codecs", None) or WIRE_CONFIGS:
        t: dict = {}
        sp = measure_codecs([name], elems=elems, chunks=8, reps=reps, device=device, timings=t)
        for row in speed_rows(sp):
            run.row(*row)
        res[name] = {"first_call_s": round(t[name]["first_call_s"], 2), "source": sp[name].source}
    return {"status": "ok", "codecs": res}


def stream_reuse(run) -> dict:
    """launch/gpu_check_streams.py's check_stream_reuse(device) -> list of rows (issue 20, Streams): nine or more
    async calls on stream A decoded on stream B behind a delay, then eviction and clear(); outputs exact."""
    try:
        from gpu_check_streams import check_stream_reuse
    except ImportError as e:
        return {"status": "error", "error": f"launch/gpu_check_streams.py not importable: {e}"}
    init_nccl_1rank()
    rows = check_stream_reuse(torch.device("cuda")) or []
    bad = []
    for i, r in enumerate(rows):  # {"name", "ok", "detail"} rows; gpu.json-schema or {"case", "status"} ones too
        name = r.get("name") or f"stream_reuse.{r.get('case') or r.get('check') or i}"
        if "value" in r:
            value, target = r["value"], r.get("target")
        elif "ok" in r:
            value, target = bool(r["ok"]), True
        else:
            value, target = r.get("status"), "ok"
        run.row(name, value, target, str(r.get("unit") or r.get("detail", ""))[:300])
        if r.get("ok") is False or str(r.get("status", "ok")).lower() in ("fail", "error"):
            bad.append(name)
    return {"status": "fail" if bad or not rows else "ok", "rows": len(rows), "failed": bad}


def version_counters(run) -> dict:
    """Every out= write of a collective bumps the output's tensor._version (autograd's in-place checks and
    Fp8Linear's cache key see fp8comm's writes), with the Triton kernels as with the reference backend."""
    import fp8comm.comm as fc

    init_nccl_1rank()
    dev = torch.device("cuda")
    n = 1 << 16
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    tok = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
    res, bad = {}, []
    for backend in ("triton", "reference"):
        o = torch.empty(n, device=dev, dtype=torch.bfloat16)
        o2 = torch.empty(n, device=dev, dtype=torch.bfloat16)
        o3 = torch.empty(n, device=dev, dtype=torch.bfloat16)
        t_out = torch.empty_like(tok)
        forms = {
            "all_gather_into": (o, lambda: fc.all_gather_into(o, x, backend=backend)),
            "all_gather.out": (o2, lambda: fc.all_gather(x, out=o2, backend=backend)),
            "reduce_scatter_into": (o, lambda: fc.reduce_scatter_into(o, x, backend=backend)),
            "all_reduce_into": (o3, lambda: fc.all_reduce_into(o3, x, backend=backend)),
            "all_to_all.out": (t_out, lambda: fc.all_to_all(tok, out=t_out, backend=backend)),
        }
        for name, (out, fn) in forms.items():
            try:
                v0 = out._version
                fn()
                torch.cuda.synchronize()
                moved = out._version > v0
            except Exception as e:
                res[f"{backend}.{name}"] = _first_line(e)
                bad.append(f"{backend}.{name}")
                continue
            res[f"{backend}.{name}"] = moved
            if not moved:
                bad.append(f"{backend}.{name}")
    run.row("version_counter_bumped_forms", sum(v is True for v in res.values()), len(res), "out= forms")
    return {"status": "fail" if bad else "ok", "forms": res, "not_bumped": bad}


def capture_refused(run) -> dict:
    """Inside CUDA graph capture a collective, and wait() of a call started before the capture, raise
    Fp8CommCaptureError before anything is queued; after the capture both work and match the eager result."""
    import fp8comm.comm as fc
    from fp8comm.errors import Fp8CommCaptureError

    init_nccl_1rank()
    x = torch.randn(1 << 16, device="cuda")
    want = fc.all_gather(x, check=False)
    h = fc.all_gather(x, async_op=True, check=False)  # started before the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    refused: dict = {}
    for name, fn in (("all_gather", lambda: fc.all_gather(x, check=False)), ("Handle.wait", h.wait)):
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side), torch.cuda.graph(g):
                fn()
            refused[name] = False
        except Fp8CommCaptureError:
            refused[name] = True
        except Exception as e:  # the capture failed some other way: report it, it is not the refusal
            refused[name] = _first_line(e)
    torch.cuda.synchronize()
    after = bool(torch.equal(h.wait(), want)) and bool(torch.equal(fc.all_gather(x, check=False), want))
    ok = all(v is True for v in refused.values()) and after
    run.row("capture_refused_calls", sum(v is True for v in refused.values()), len(refused), "calls")
    return {"status": "ok" if ok else "fail", "refused": refused, "eager_after_capture_ok": after}


def guard_streams(run) -> dict:
    """Guard counters across streams: packs on two side streams (one delayed by a GPU sleep) and Guard.step() on a
    third. Every block has one outlier, so each bucket's underflow fraction is 127/128 at every step; a count lost
    or read before its pack (unordered counters) shows as a smaller or zero fraction."""
    import fp8comm.comm as fc

    init_nccl_1rank()
    dev = torch.device("cuda")
    guard = fc.Guard(fc.GuardPolicy(threshold=0.999, patience=1000, cooldown=1))
    buckets = {k: guard.bucket(k, dev) for k in ("delayed", "plain")}
    x = torch.randn(1 << 20, device=dev)
    x[::128] = 1e12
    streams = {"delayed": torch.cuda.Stream(), "plain": torch.cuda.Stream()}
    step_stream = torch.cuda.Stream()
    for s in (*streams.values(), step_stream):
        s.wait_stream(torch.cuda.current_stream())
    steps = 6
    for _ in range(steps):
        for key, s in streams.items():
            with torch.cuda.stream(s):
                if key == "delayed":
                    torch.cuda._sleep(int(2e8))
                fc.reduce_scatter(x, guard=buckets[key], check=False)
        with torch.cuda.stream(step_stream):
            guard.step()
    torch.cuda.synchronize()
    with torch.cuda.stream(step_stream):
        guard.step()  # decisions lag one step: this one reads the last step's counts
    torch.cuda.synchronize()
    want = 127 / 128
    seen = [{k: h.get(k) for k in buckets} for h in guard.history]
    counted = [row for row in seen if all(v is not None for v in row.values())]
    bad = [row for row in counted if any(abs(v - want) > 1e-6 for v in row.values())]
    ok = len(counted) >= steps - 1 and not bad
    run.row("guard_streams_steps_exact", len(counted) - len(bad), len(counted), "steps")
    return {"status": "ok" if ok else "fail", "fractions": seen, "want": want}


def e8m0_decode(run) -> dict:
    """All 256 E8M0 scale bytes through every decoder on the GPU (torch ops, the compiled backend, the Triton
    kernels: unpack_chunks fp32 and bf16, unpack_sum, Fp8Tensor.unpack): byte b -> 2^(b-127), 0 -> 2^-127 (an fp32
    subnormal: must not flush), 255 -> NaN (OCP MX), bit for bit against that on the host."""
    from fp8comm.quant import E4M3, Fp8Tensor, Scaling
    from fp8comm.quant.wire import ChunkLayout, unpack_chunks, unpack_sum

    sc = Scaling(1, 128, "e8m0")
    lay = ChunkLayout((256,), 128, sc)
    buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    pb = lay.payload_bytes(0)
    buf[: 256 * 128] = 0x38  # E4M3 1.0 everywhere: the output is the decoded scale
    buf[pb : pb + 256] = torch.arange(256, dtype=torch.uint8)
    b = torch.arange(256, dtype=torch.float64)
    want = torch.where(b == 255, torch.nan, torch.ldexp(torch.ones(256, dtype=torch.float64), b - 127)).float()
    want = want[:, None].expand(256, 128)
    dbuf = buf.cuda()
    got = {}
    for backend in ("reference", "compiled", "triton"):
        for dt in (torch.float32, torch.bfloat16):
            key = f"unpack_chunks.{backend}.{str(dt)[6:]}"
            try:
                got[key] = (unpack_chunks(dbuf, lay, E4M3, dt, backend=backend).cpu(), want.to(dt))
            except Exception as e:
                got[key] = e
    for backend in ("reference", "compiled", "triton"):
        try:
            got[f"unpack_sum.{backend}"] = (unpack_sum(dbuf, lay, E4M3, backend=backend).cpu(), want)
        except Exception as e:
            got[f"unpack_sum.{backend}"] = e
    try:
        t = Fp8Tensor.unpack(dbuf, (256, 128), torch.float32, E4M3, sc)  # same bytes: payload, then scales
        got["Fp8Tensor.unpack"] = (t.dequantize(torch.float32).cpu(), want)
    except Exception as e:
        got["Fp8Tensor.unpack"] = e
    res, bad = {}, []
    for key, v in got.items():
        if isinstance(v, Exception):
            res[key] = _first_line(v)
            bad.append(key)
            continue
        g, w = v
        same_nan = torch.equal(g.isnan(), w.isnan())
        bits = torch.int32 if g.dtype == torch.float32 else torch.int16
        fin = ~w.isnan()
        exact = same_nan and torch.equal(g[fin].view(bits), w[fin].view(bits))
        res[key] = (
            "exact" if exact else f"FAIL: {int((g[fin] != w[fin]).sum())} values, NaN positions equal: {same_nan}"
        )
        if not exact:
            bad.append(key)
    run.row("e8m0_decoders_exact", len(res) - len(bad), len(res), "decoder paths, 256 bytes each")
    return {"status": "fail" if bad else "ok", "paths": res}


def reference_on_device(run, dev: str = "cuda") -> dict:
    """The pure-torch reference run on the GPU gives the CPU's bits (it defines them on every device): FP8 quantize
    with fp32 / E8M0 / pow2 scales, MXFP4 and NVFP4 quantize, at magnitudes from 1e-30 to 1e30, and a mean over 3
    ranks' worth of sums. Run 2 of 2026-12-04 found the FP8 one differing (amax / 448 as a reciprocal multiply)."""
    from fp8comm.quant import Scaling, quantize
    from fp8comm.quant.formats import div_exact
    from fp8comm.quant.fp4_api import quantize_fp4

    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 1024, generator=g) * torch.logspace(-30, 30, 256).reshape(256, 1)
    res, bad = {}, []
    for enc in ("fp32", "e8m0", "pow2"):
        c = quantize(x, "e4m3", scaling=Scaling(1, 128, enc), backend="reference")
        d = quantize(x.to(dev), "e4m3", scaling=Scaling(1, 128, enc), backend="reference")
        res[f"fp8.{enc}"] = torch.equal(c.data.view(torch.uint8), d.data.cpu().view(torch.uint8)) and torch.equal(
            c.scale, d.scale.cpu()
        )
    for fmt in ("mxfp4", "nvfp4"):
        c4 = quantize_fp4(x, fmt, backend="reference")
        d4 = quantize_fp4(x.to(dev), fmt, backend="reference")
        res[fmt] = all(torch.equal(getattr(c4, f), getattr(d4, f).cpu()) for f in ("codes", "scales", "tensor_scale"))
    y = torch.randn(1 << 16, generator=g)
    res["mean_of_3"] = torch.equal(y / 3, div_exact(y.to(dev), 3).cpu())
    bad = [k for k, ok in res.items() if not ok]
    run.row("reference_on_device_exact", len(res) - len(bad), len(res), "reference paths, GPU bits == CPU bits")
    return {"status": "fail" if bad else "ok", "paths": res}


def fp4_wire(run) -> dict:
    """The 4-bit wire's Triton path on the GPU: pack_fp4 (fused quantize+pack per buffer) and unpack_fp4_sum bit for
    bit against the reference on the host (mxfp4 and nvfp4, nearest and stochastic, with and without the Hadamard
    transform, wide magnitudes and a non-finite block), then pack and sum throughput at 64M elements against a
    bf16 device copy of the same elements (what "4 bits pay" rests on for a GPU: docs/collectives.md)."""
    from fp8comm.quant import MXFP4, NVFP4
    from fp8comm.quant.wire4 import fp4_layout, pack_fp4, unpack_fp4_sum

    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 4096, generator=g) * torch.logspace(-6, 6, 4).reshape(4, 1)
    x[2, 100] = float("inf")
    res, bad = {}, []
    for fmt in (MXFP4, NVFP4):
        lay = fp4_layout((1,) * 4, 4096, fmt)
        for rounding in ("nearest", "stochastic"):
            for h in (0, 16):
                key = f"{fmt.name}.{rounding}.h{h}"
                try:
                    want = pack_fp4(x, lay, rounding, 9, h, 3, backend="reference")
                    got = pack_fp4(x.cuda(), lay, rounding, 9, h, 3, backend="triton").cpu()
                    s_want = unpack_fp4_sum(want, lay, h, 3, backend="reference")
                    s_got = unpack_fp4_sum(got.cuda(), lay, h, 3, backend="triton").cpu()
                    same = torch.equal(got, want) and torch.equal(s_got.isnan(), s_want.isnan())
                    fin = ~s_want.isnan()
                    same = same and torch.equal(s_got[fin].view(torch.int32), s_want[fin].view(torch.int32))
                    res[key] = "exact" if same else f"FAIL: {int((got != want).sum())} bytes differ"
                except Exception as e:
                    res[key] = _first_line(e)
                if res[key] != "exact":
                    bad.append(key)
    from fp8comm.quant.wire4 import residual_fp4, unpack_fp4

    x2 = torch.randn(4, 4064, generator=g) * torch.logspace(-6, 6, 4).reshape(4, 1)  # 127 MXFP4 blocks per row
    x2[1, 7] = float("nan")
    for fmt in (MXFP4, NVFP4):  # the fused wire kernel: uneven and empty chunks, strided outputs, residuals
        key = f"{fmt.name}.wire_kernel"
        try:
            lay = fp4_layout((2, 0, 1, 1), 4064, fmt)
            want = pack_fp4(x2, lay, "nearest", backend="reference")
            full = unpack_fp4(want, lay, backend="reference")
            stale = torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8, device="cuda")
            packed = pack_fp4(x2.cuda(), lay, "nearest", out=stale, backend="triton").cpu()
            if not torch.equal(packed, want):
                raise RuntimeError(f"pack into the sections: {int((packed != want).sum())} bytes differ")
            dev = want.cuda()
            wide = torch.zeros(4, 4200, device="cuda")
            unpack_fp4(dev, lay, out=wide[:, 100:4100], backend="triton")
            checks = [(wide[:, 100:4100].cpu(), full[:, :4000])]
            for xin in (x2[:, :4000].contiguous(), x2[:, :4000].bfloat16()):
                r32 = torch.empty(4, 4000, device="cuda")
                residual_fp4(dev, lay, xin.cuda(), r32, "triton")
                ref = xin.float() - full[:, :4000]
                checks.append((r32.cpu(), ref.masked_fill(~torch.isfinite(ref), 0.0)))
            eq = fp4_layout((2, 2), 4064, fmt)
            weq = pack_fp4(x2, eq, "nearest", backend="reference")
            acc = torch.zeros(2, 4200, device="cuda")
            unpack_fp4_sum(weq.cuda(), eq, out=acc[:, 100:4164], backend="triton")
            checks.append((acc[:, 100:4164].cpu(), unpack_fp4_sum(weq, eq, backend="reference")))
            ok = all(
                torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in checks
            )
            res[key] = (
                "exact"
                if ok
                else "FAIL: "
                + ", ".join(
                    str(i) for i, (a, b) in enumerate(checks) if not torch.equal(a.nan_to_num(), b.nan_to_num())
                )
            )
        except Exception as e:
            res[key] = _first_line(e)
        if res[key] != "exact":
            bad.append(key)
    run.row(
        "fp4_wire_exact",
        len(res) - len(bad),
        len(res),
        "pack, fused decode / sum / residual, bit for bit vs the reference",
    )
    n = 1 << 26
    big = torch.randn(4, n // 4, device="cuda")
    lay = fp4_layout((1,) * 4, n // 4, MXFP4)
    buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device="cuda")
    acc = torch.empty(1, n // 4, device="cuda")
    bf = big.to(torch.bfloat16)
    dst = torch.empty_like(bf)

    def timed(fn, reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / reps

    copy_ms = timed(lambda: dst.copy_(bf))
    pack_ms = timed(lambda: pack_fp4(big, lay, out=buf, backend="triton"))
    sum_ms = timed(lambda: unpack_fp4_sum(buf, lay, out=acc, backend="triton"))
    run.row("fp4_pack_ms_64M", round(pack_ms, 3), round(copy_ms, 3), "ms; target = a bf16 copy of the elements")
    run.row("fp4_sum4_ms_64M", round(sum_ms, 3), round(copy_ms, 3), "ms, 4 chunks decoded + fp32 sum")
    return {"status": "fail" if bad else "ok", "paths": res, "copy_ms": copy_ms, "pack_ms": pack_ms, "sum_ms": sum_ms}


def fp8_residual(run) -> dict:
    """FP8 error feedback's one-pass residual on the GPU (Fp8Codec.residual on Triton: decode and subtract in one
    kernel from the wire buffer) bit for bit against the CPU reference's decode then subtraction: uneven chunks,
    fp32 and bf16 inputs, column-slice views in and out, a non-finite element."""
    from fp8comm.quant import E4M3
    from fp8comm.quant import backend_reference as br
    from fp8comm.quant.codec import Fp8Codec, subtract_into
    from fp8comm.quant.layout import ChunkLayout
    from fp8comm.quant.scaling import Scaling

    g = torch.Generator().manual_seed(6)
    res, bad = {}, []
    for sc in (Scaling(1, 128), Scaling(1, 128, "e8m0")):
        lay = ChunkLayout((3, 0, 2, 5), 4096, sc)
        wide = torch.randn(10, 4160, generator=g) * torch.logspace(-4, 4, 10).reshape(10, 1)
        wide[4, 9] = float("inf")
        buf = br.pack_chunks(
            wide[:, 32:4128].contiguous(), lay, E4M3, "nearest", 0, torch.empty(lay.total_bytes, dtype=torch.uint8)
        )
        deq = br.unpack_chunks(buf, lay, E4M3, torch.empty(10, 4096))
        for x in (wide[:, 32:4128], wide[:, 32:4128].bfloat16()):
            key = f"{sc.describe()}.{x.dtype}"
            try:
                want = torch.empty(10, 4096)
                subtract_into(x, deq, want)
                out = torch.zeros(10, 4200, device="cuda")
                Fp8Codec(E4M3, sc).residual(buf.cuda(), lay, x.cuda(), out[:, 50:4146], kernel="triton")
                ok = torch.equal(out[:, 50:4146].cpu().view(torch.int32), want.view(torch.int32))
                res[key] = "exact" if ok else f"FAIL: {int((out[:, 50:4146].cpu() != want).sum())} differ"
            except Exception as e:
                res[key] = _first_line(e)
            if res[key] != "exact":
                bad.append(key)
    run.row("fp8_residual_exact", len(res) - len(bad), len(res), "one-pass FP8 residuals, bit for bit vs the reference")
    return {"status": "fail" if bad else "ok", "paths": res}


def host_ran_ahead(fn, calls: int, cuda=torch.cuda) -> tuple[bool, float]:
    """Queue a ~1 s GPU sleep, then `calls` calls of `fn`: (True when the host returned from all of them before the
    sleep ended, host seconds). `cuda` is torch.cuda (a stand-in in the CPU test of this logic)."""
    cuda.synchronize()  # the engine's sync point: work from before is complete
    done = cuda.Event()
    cuda._sleep(int(2e9))  # ~1 s of GPU clock cycles queued ahead
    done.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    ahead = not done.query()
    cuda.synchronize()
    return ahead, host


def calls_for(name: str) -> int:
    """Ten calls in a row behind the sleep; one for a call made at the engine's sync point (AT_SYNC_POINT)."""
    return 1 if name in AT_SYNC_POINT else 10


def host_ahead(run) -> dict:
    """torch's detector sees only syncs made through torch: queue a long GPU sleep, then calls of each collective;
    the host must return from all of them before the sleep has ended (no hidden sync anywhere). guard.step waits
    for its previous call's counts by contract, so it is checked once after a sync (calls_for)."""
    init_nccl_1rank()
    calls = collective_calls()
    res, bad = {}, []
    for name, fn in calls.items():
        if name.endswith(".autograd"):
            continue  # autograd's backward engine may synchronize its own streams; covered by sync_free
        for _ in range(6):
            fn()
        n = calls_for(name)
        ahead, host = host_ran_ahead(fn, n)
        res[name] = {"calls": n, "host_ms_per_call": round(host / n * 1e3, 3), "host_ran_ahead": ahead}
        if not ahead:
            bad.append(name)
    run.row("host_ahead_calls", len(res) - len(bad), len(res), "collective forms")
    return {"status": "fail" if bad else "ok", "calls": res, "blocked": bad}


def blockwise_gemm(run) -> dict:
    """The cuBLASLt block-scaled GEMM (fp8comm/gemm/block_scaled_mm.py): which layout the probe trusts per operand
    pair, agreement with float64 at aligned and odd shapes, 8192^3 next to the Triton GEMM and bf16, Fp8Linear
    blockwise fwd+bwd at 16384 x 8192 -> 8192 (launch/device_check_gemm.py's functions, rows as they come)."""
    import device_check_gemm as g

    from fp8comm.gemm import backends
    from fp8comm.gemm.block_scaled_mm import PAIRS

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    found = {}
    for pair in PAIRS:
        lay = backends.blockwise_layout(dev, pair)
        found[pair] = lay.name if lay is not None else None
        run.row(f"gemm_blockwise_layout_1x128_{pair[5:]}", found[pair] or "none", None, "layout the probe trusted")
    rows = g.agreement_rows(dev, False, layouts=("blockwise",))
    rows += g.timing_rows(
        dev, False, cases=[("blockwise", "scaled_mm"), ("blockwise", "triton")], sizes=(8192,), recipes=()
    )
    for r in g.result_rows(rows, name):
        run.row(r["name"], r["value"], r["target"], r["unit"])
    rows += g.timing_rows(dev, False, cases=[], sizes=(), recipes=("blockwise",))
    for r in g.result_rows(rows, name):
        if r["name"].startswith("linear_"):
            run.row(r["name"], r["value"], r["target"], r["unit"])
    fails = [f"{r['case']}: {r['detail']}" for r in rows if r["status"] == "FAIL"]
    print("| check | case | status | detail |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['case']} | {r['status']} | {r['detail']} |")
    return {"status": "fail" if fails else "ok", "layouts": found, "fails": fails, "rows": rows}


def pack_vs_copy(run) -> dict:
    """quantize+pack (fp32 and E8M0 scales) vs a bf16 device copy at 256 MiB and 1 GiB, CUDA-graph replay (target
    0.8x copy; launch/device_check.py's triton_bandwidth without its tile sweep)."""
    import device_check as dc

    ctx = dc.Ctx(torch.device("cuda"), False, sizes_mib=(256, 1024), sweep=False)
    res = dc.bandwidth_section(ctx)
    for r in dc.bandwidth_result_rows(res, torch.cuda.get_device_name(0)):
        run.row(r["name"], r["value"], r["target"], r["unit"])
    return res


def train(run) -> dict:
    """examples/train_gpt.py on the GPU, one process per seed (all four recipes each), so a cut keeps whole
    pairs; rows per recipe (train_<recipe>_val_loss_rel, _tokens_per_s_vs_bf16) rewritten after every seed."""
    import device_check_gemm as g

    name = torch.cuda.get_device_name(0)
    recipes = "bf16,fp8_amax,tensorwise,blockwise"
    out_dir = Path(os.environ.get("OUT") or "/tmp") / "train_gpt_gpu"
    results, seeds_done, bad = [], [], []
    for seed in run.train_seeds:
        folder = out_dir / f"seed{seed}"
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--device", "cuda", "--recipes", recipes]
        cmd += ["--seeds", str(seed), "--out", str(folder)] + run.train_args
        try:
            p = run.run_sub(cmd, cwd=ROOT, env=_env())
        finally:  # a cut seed still leaves the recipes it finished (results.json is written after each run)
            f = folder / "results.json"
            if f.exists():
                results = [r for r in results if r.get("seed") != seed] + json.loads(f.read_text())
                for r in g.train_rows(results, name):
                    run.row(r["name"], r["value"], r["target"], r["unit"])
        if p["rc"]:
            bad.append(seed)
        seeds_done.append(seed)
    return {"status": "fail" if bad else "ok", "seeds": seeds_done, "failed_seeds": bad, "runs": len(results)}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def sync_free(run) -> dict:
    """After warm-up no collective and no Fp8Linear step may sync the host with the device (torch's detector)."""
    from fp8comm.gemm import RECIPES, Fp8Linear

    init_nccl_1rank()
    calls = collective_calls()
    failures, ok = {}, []
    for name, fn in calls.items():
        for _ in range(6):  # past the metadata check's first calls, layouts and kernels cached
            fn()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            ok.append(name)
        except RuntimeError as e:
            failures[name] = str(e).splitlines()[0][:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for recipe in RECIPES:
        if recipe == "fp8_noscale":
            continue
        for cache in ("step", "gathered"):
            name = f"Fp8Linear.{recipe}.{cache}"
            lin = Fp8Linear(1024, 1024, recipe=recipe, weight_cache=cache, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3):
                lin(x).sum().backward()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                lin(x).sum().backward()
                ok.append(name)
            except RuntimeError as e:
                failures[name] = str(e).splitlines()[0][:300]
            finally:
                torch.cuda.set_sync_debug_mode("default")
    run.row("sync_free_calls", len(ok), len(ok) + len(failures), "calls")
    return {"status": "fail" if failures else "ok", "sync_free": ok, "syncing": failures}


def host_time(run) -> dict:
    """Host time per steady-state call at 16 Mi elements, next to NCCL's own call of the same op (host time: the
    GPU is kept busy by a queued sleep, so only the host's own work is timed); and the GPU part by CUDA-graph
    replay where the call can be captured (nearest rounding, fixed buffers, check off after warm-up)."""
    import torch.distributed as dist

    import fp8comm.comm as fc

    init_nccl_1rank()
    n = 16 << 20
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(x)
    tok = x.view(-1, 4096)
    tok_out = torch.empty_like(tok)
    pairs = {
        "all_gather_into": (lambda: fc.all_gather_into(o, x), lambda: dist.all_gather_into_tensor(o, x)),
        "reduce_scatter_into": (lambda: fc.reduce_scatter_into(o, x), lambda: dist.reduce_scatter_tensor(o, x)),
        "all_to_all": (lambda: fc.all_to_all(tok, out=tok_out), lambda: dist.all_to_all_single(tok_out, tok)),
    }
    out = {}
    for name, (ours, nccl) in pairs.items():
        r = {}
        for who, fn in (("fp8comm", ours), ("nccl", nccl)):
            for _ in range(6):
                fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(4e9))
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            r[who] = (time.perf_counter() - t0) / 50 * 1e3
            torch.cuda.synchronize()
        run.row(f"host_ms_{name}_16Mi", round(r["fp8comm"], 4), 0.1, "ms")
        run.row(f"host_ms_{name}_16Mi_nccl", round(r["nccl"], 4), None, "ms")
        try:  # CUDA-graph capture of the same steady-state call
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    ours()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ours()
            want = o.clone() if name != "all_to_all" else tok_out.clone()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(20):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            got = o if name != "all_to_all" else tok_out
            r["graph_gpu_ms"] = e0.elapsed_time(e1) / 20
            r["graph_equal"] = bool(torch.equal(got, want))
            run.row(f"graph_gpu_ms_{name}_16Mi", round(r["graph_gpu_ms"], 4), None, "ms")
        except Exception as e:
            r["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out[name] = r
    over = [k for k, v in out.items() if v["fp8comm"] > 0.1]
    return {"status": "fail" if over else "ok", "calls": out, "over_budget": over}


def streams(run) -> dict:
    """Two CUDA streams lease from one scratch pool (DeepSpeed ZeRO-3's gather and reduce streams): the first
    call's decode is delayed by a GPU sleep, the second call on the other stream reuses its buffers. With the
    pool's events both outputs equal the reference; an unordered pool (no event wait) is run too and must differ,
    or the scenario proves nothing."""
    import fp8comm.comm as fc
    from fp8comm.comm import buffers

    init_nccl_1rank()

    class Unordered(buffers.ScratchPool):
        def give(self, block, event=None, stream=None):
            super().give(block, None, None)  # forget the event: the next lease does not wait

    n = 1 << 22
    x1 = torch.randn(n, device="cuda")
    x2 = torch.randn(n, device="cuda") * 100
    want1, want2 = fc.all_gather(x1, check=False), fc.all_gather(x2, check=False)
    res = {}
    for label, pool in (("ordered", buffers.ScratchPool()), ("unordered", Unordered())):
        buf = fc.Buffer(check=False)
        buf.pool = pool
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        o1, o2 = torch.empty_like(want1), torch.empty_like(want2)
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            h = buf.all_gather_into(o1, x1, async_op=True)
            torch.cuda._sleep(int(1e9))  # the decode (in wait) is queued behind this on s1
            h.wait()
        with torch.cuda.stream(s2):
            buf.all_gather_into(o2, x2)  # leases the buffers just returned by the first call
        torch.cuda.synchronize()
        res[label] = {
            "first_equal": bool(torch.equal(o1, want1)),
            "second_equal": bool(torch.equal(o2, want2)),
            "cross_stream_waits": getattr(pool, "cross_stream_waits", None),
        }
    ok = res["ordered"]["first_equal"] and res["ordered"]["second_equal"]
    shows = not (res["unordered"]["first_equal"] and res["unordered"]["second_equal"])
    run.row("streams_ordered_outputs_equal", int(ok), 1, "bool")
    run.row("streams_unordered_pool_corrupts", int(shows), 1, "bool")
    return {"status": "ok" if ok else "fail", "runs": res, "scenario_can_fail": shows}


def offsets(
    run, dev: str = "cuda", k: int = 1 << 30, m: int = 140000, kk: int = 16384, backend: str = "triton", gemm=None
) -> dict:
    """Past 2^31, each kernel on its own: the Triton pack of 3 chunks of 2^30 elements (a 3 GiB buffer) against the
    reference's pack of windows in each chunk; the Triton unpack_sum of that buffer against the reference's sum of
    the same bytes' windows; the Triton quantize of a 140000 x 16384 activation (2.3e9 elements) on sampled rows
    against the reference; the Triton GEMM of that operand x 256 columns on those rows against the same kernel on
    the rows alone (bit for bit) and against emulate (relative norm error). The reference runs on the CPU, where its
    bits are defined: torch ops on CUDA may round differently (a Python divisor becomes a reciprocal multiply)."""
    from fp8comm.gemm.backends import emulate
    from fp8comm.quant import Fp8Tensor, Scaling, quantize
    from fp8comm.quant.formats import E4M3
    from fp8comm.quant.wire import layout_of, pack_chunks, unpack_sum

    if gemm is None:
        from fp8comm.gemm.triton_gemm import triton_gemm as gemm
    out: dict = {}
    w = 4096
    sc = Scaling(1, 128)
    sb = sc.scale_bytes
    x = torch.randn(3, k, device=dev, dtype=torch.bfloat16)
    lay = layout_of((1, 1, 1), k, sc)
    buf = pack_chunks(x, lay, E4M3, backend=backend)
    wl = layout_of((1,), w, sc)
    starts = [sum(lay.chunk_bytes[:c]) for c in range(3)]
    pay = lay.payload_bytes(0)
    wins = (0, k // 2, k - w)

    def window_bytes(
        buf: torch.Tensor, c: int, a0: int
    ) -> torch.Tensor:  # chunk c's payload and scales of elements a0 .. a0 + w
        s0 = starts[c] + pay + (a0 // 128) * sb
        return torch.cat([buf[starts[c] + a0 : starts[c] + a0 + w], buf[s0 : s0 + (w // 128) * sb]])

    pack_bad = [
        f"chunk {c} @ {a0}"
        for c in range(3)
        for a0 in wins
        if not torch.equal(
            window_bytes(buf, c, a0).cpu(), pack_chunks(x[c : c + 1, a0 : a0 + w].cpu(), wl, E4M3, backend="reference")
        )
    ]
    out["pack_bad"] = pack_bad
    run.row("offsets_pack_3GiB_windows_equal", 9 - len(pack_bad), 9, "chunk windows (byte offsets to 3.1 GiB)")
    acc = unpack_sum(buf, lay, E4M3, backend=backend)
    sum_bad = []
    for a0 in wins:
        small = torch.cat([window_bytes(buf, c, a0) for c in range(3)]).cpu()
        ref = unpack_sum(small, layout_of((1, 1, 1), w, sc), E4M3, backend="reference")
        if not torch.equal(acc[:, a0 : a0 + w].cpu(), ref):
            sum_bad.append(a0)
    out["unpack_sum_bad_windows"] = sum_bad
    out["unpack_sum_packed_gib"] = round(lay.total_bytes / 2**30, 2)
    run.row("offsets_unpack_sum_3GiB_windows_equal", 3 - len(sum_bad), 3, "windows, same bytes as the reference")
    del x, buf, acc
    n = 256
    xa = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
    qa = quantize(xa, "e4m3", scaling=Scaling(1, 128), backend=backend)
    rows = torch.tensor(sorted({0, m // 2, (1 << 31) // kk - 1, (1 << 31) // kk, m - 1} & set(range(m))), device=dev)
    qr = quantize(xa[rows].cpu(), "e4m3", scaling=Scaling(1, 128), backend="reference")
    q_bad = [
        int(r)
        for i, r in enumerate(rows.tolist())
        if not (
            torch.equal(qa.data[r].cpu().view(torch.uint8), qr.data[i].view(torch.uint8))
            and torch.equal(qa.scale[r].cpu(), qr.scale[i])
        )
    ]
    out["quantize_bad_rows"] = q_bad
    run.row("offsets_quantize_2.3e9_rows_equal", len(rows) - len(q_bad), len(rows), "sampled rows, bit for bit")
    del xa
    qb = quantize(torch.randn(n, kk, device=dev), "e4m3", scaling=Scaling(128, 128))
    got = gemm(qa, qb, torch.float32)[rows]
    sub = Fp8Tensor(qa.data[rows], qa.scale[rows], qa.fmt, qa.scaling, qa.dtype)
    alone = gemm(sub, qb, torch.float32)
    g_bad = [int(r) for i, r in enumerate(rows.tolist()) if not torch.equal(got[i], alone[i])]
    want = emulate(sub, qb, torch.float32)
    err = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
    out["gemm_bad_rows_vs_rows_alone"] = g_bad
    out["gemm_rel_norm_err_vs_emulate"] = err
    # information, not a pass condition: nothing promises the same bits for a row inside another tile of rows
    run.row("offsets_gemm_140000x16384_rows_equal", len(rows) - len(g_bad), None, "rows bit-equal to the rows alone")
    # 1e-3: FP8 MMA on Hopper accumulates each 128-wide K tile in reduced precision (blockwise_gemm's agreement
    # rows: 1.5e-4 to 1.9e-4 vs emulate on the H200); an offset that wraps gives garbage rows (error ~1)
    run.row("offsets_gemm_140000x16384_rel_err", err, 1e-3, "max over rows of |got - emulate| / |emulate|")
    ok = not (pack_bad or sum_bad or q_bad) and err < 1e-3
    return {"status": "ok" if ok else "fail", **out}


def multi_rank(run) -> dict:
    """tests/dist's checks with CUDA tensors on 2 and 4 ranks sharing this GPU (staged backend: gloo on host copies;
    NCCL refuses two ranks per GPU). Bit-exact against the CPU reference like the CPU suite."""
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    import dist_checks
    import dist_harness

    out, bad = {}, []
    for world in (2, 4):
        env = {"FP8COMM_TEST_BACKEND": "staged", "FP8COMM_TEST_DEVICE": "cuda"}
        if world == 4:
            env["LOCAL_WORLD_SIZE"] = "2"
        left = run.left() - 10  # launch() kills its ranks at its own timeout: leave it time to report
        if left < 30:
            out[world] = {"skipped": f"{left:.0f} s left"}
            continue
        names = [c.__name__ for c in dist_checks.CHECKS if getattr(c, "applies", lambda w: True)(world)]
        res = dist_harness.launch(world, Path("/tmp/fp8comm_gpu_dist") / str(world), env=env, names=names, timeout=left)
        fails = dist_harness.failures(res)
        done = [x["check"] for x in res["results"].get(0, []) if x.get("state") == "done" and x.get("ok")]
        out[world] = {"passed": done, "failures": [f[:400] for f in fails], "seconds": res["seconds"]}
        run.row(f"multi_rank_cuda_world{world}_checks_passed", len(done), None, "checks")
        bad += fails
    return {"status": "fail" if bad else "ok", "worlds": out}


def examples(run) -> dict:
    """The main job and the Megatron example on the GPU with every fp8comm flag on (world 1: the hooks' CUDA paths,
    the FP8 GEMMs, the loss; examples/train_gpt.py is the train section's). Needs DeepSpeed and megatron-core
    (wheels: launch/gpu_wheels.sh)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:  # fp8comm.integrations maps to integrations/ through pyproject: an (offline) editable install
        __import__("fp8comm.integrations.megatron")
    except ImportError:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-e",
                str(ROOT),
            ],
            check=False,
            timeout=300,
        )
    runs = {
        "demo": [
            sys.executable,
            "-m",
            "fp8comm.tools.cli",
            "demo",
            "--device",
            "cuda",
            "--ranks",
            "1",
            "--steps",
            "60",
            "--out",
            "/tmp/fp8comm_gpu_demo",
        ],
        "megatron": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "fp8comm.integrations.megatron.pretrain_gpt",
            "--num-layers",
            "2",
            "--hidden-size",
            "256",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "128",
            "--max-position-embeddings",
            "128",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "4",
            "--train-iters",
            "20",
            "--lr",
            "3e-4",
            "--bf16",
            "--use-distributed-optimizer",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1024",
            "--transformer-impl",
            "local",
            "--no-persist-layer-norm",
            # fusions need APEX's or Megatron's compiled extensions, absent there (docs/megatron.md's flags)
            "--no-gradient-accumulation-fusion",
            "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion",
            "--no-masked-softmax-fusion",
            "--log-interval",
            "5",
            "--fp8comm-grad-reduce",
            "--fp8comm-param-gather",
        ],
    }
    out, bad = {}, []
    for name, cmd in runs.items():
        need = {"demo": "deepspeed", "megatron": "megatron.core"}.get(name)
        if need:
            try:
                __import__(need)
            except ImportError as e:
                out[name] = {"status": "skipped", "reason": f"{need} not importable ({e}); carry wheels"}
                continue
        out[name] = run.run_sub(cmd, cwd=ROOT, env=env, tail=3000)
        if out[name]["rc"]:
            bad.append(name)
    return {"status": "fail" if bad else "ok", "runs": out}


# ------------------------------------------------------------------------------------------------------- driver
# (name, function, cap seconds, seconds needed to start): most valuable first; the run's deadline cuts the rest
SECTIONS = [
    Section("env", env, 30, 1),
    Section("codec_speeds", codec_speeds, 90, 20),
    Section("stream_reuse", stream_reuse, 60, 10),
    Section("streams", streams, 30, 10),
    Section("version_counters", version_counters, 60, 10),
    Section("e8m0_decode", e8m0_decode, 60, 10),
    Section("reference_on_device", reference_on_device, 30, 10),
    Section("fp4_wire", fp4_wire, 60, 15),
    Section("fp8_residual", fp8_residual, 30, 10),
    Section("capture_refused", capture_refused, 30, 10),
    Section("guard_streams", guard_streams, 60, 10),
    Section("host_ahead", host_ahead, 60, 15),
    Section("blockwise_gemm", blockwise_gemm, 90, 30),
    Section("pack_vs_copy", pack_vs_copy, 60, 20),
    Section("train", train, 150, 60),
    Section("sync_free", sync_free, 60, 15),
    Section("offsets", offsets, 60, 30),
    Section("host_time", host_time, 45, 15),
    Section("examples", examples, 150, 60),
    Section("multi_rank", multi_rank, 200, 60),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated sections: " + ", ".join(s.name for s in SECTIONS))
    p.add_argument("--budget", type=float, default=360, help="seconds for the whole run (hard: sections are cut)")
    p.add_argument("--train-seeds", default="0,1,2", help="examples/train_gpt.py seeds, one process each")
    p.add_argument("--train-args", default="", help="extra examples/train_gpt.py arguments (e.g. --steps 200)")
    p.add_argument("--no-write", action="store_true", help="do not write rows into docs/results/gpu.json")
    p.add_argument("--codecs", default="", help="codec_speeds: only these codecs (comma-separated; default every one)")
    a = p.parse_args(argv)
    from fp8comm.comm.calibration import WIRE_CONFIGS

    codecs = [c for c in a.codecs.split(",") if c]
    if set(codecs) - set(WIRE_CONFIGS):  # refused before anything runs
        p.error(f"--codecs: unknown {sorted(set(codecs) - set(WIRE_CONFIGS))}; known: {', '.join(WIRE_CONFIGS)}")
    if not torch.cuda.is_available():
        print("gpu_ready_check: no CUDA device; nothing to run (every section needs a GPU)", file=sys.stderr)
        return 2
    out = os.environ.get("OUT")
    run = Runner(
        a.budget,
        torch.cuda.get_device_name(0),
        rows_path=None if a.no_write else PATH,
        doc_path=Path(out) / "gpu_ready.json" if out else None,
    )
    run.train_seeds = [int(s) for s in a.train_seeds.split(",") if s]
    run.train_args = a.train_args.split()
    run.codecs = codecs
    only = {s for s in a.only.split(",") if s}
    unknown = only - {s.name for s in SECTIONS}
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}")
    run.run(SECTIONS, only or None)
    bad = run.failed()
    print(f"== overall: {'NOT OK: ' + ', '.join(bad) if bad else 'ok'} ({time.monotonic() - run.t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
