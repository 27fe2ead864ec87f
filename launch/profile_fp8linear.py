#!/usr/bin/env python3
"""Where the time of one Fp8Linear fwd+bwd goes on a GPU: a kernel table (torch.profiler) and the pieces timed alone.

    PYTHONPATH=. python3 launch/profile_fp8linear.py [--recipe tensorwise] [--tokens 16384 --k 8192 --n 8192]

Prints (1) nn.Linear bf16 vs Fp8Linear fwd+bwd, (2) the profiler's top kernels by CUDA time for Fp8Linear,
(3) each quantize / transpose / GEMM of the FP8 path timed alone (medians of CUDA-event timed calls), so the sum
of the pieces can be compared with the whole. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8comm.gemm import Fp8Linear, backends, get_recipe
from fp8comm.quant import quantize
from fp8comm.tools.bench.gemm import bench


def sweep_tiles(x: torch.Tensor, dev: torch.device, reps: int) -> None:
    """Time per-tensor quantize_with_transpose for several (rows, cols) tiles and warps; keep the fastest."""
    from fp8comm.quant import backend_triton as bt
    from fp8comm.quant import quantize_with_transpose

    best = None
    gb = x.numel() * 4 / 1e9  # bf16 read + two FP8 writes
    for tile in ((32, 128), (64, 128), (128, 128), (64, 256), (128, 64), (32, 256)):
        for warps in (4, 8):
            bt.GPU_T_TILE, bt.GPU_T_WARPS = tile, warps
            t = bench(lambda: quantize_with_transpose(x, "e4m3"), reps, 3, dev)
            print(f"quantize_with_transpose tile {tile} warps {warps}: {t * 1e3:.3f} ms, {gb / t:.0f} GB/s", flush=True)
            if best is None or t < best[0]:
                best = (t, tile, warps)
    bt.GPU_T_TILE, bt.GPU_T_WARPS = best[1], best[2]
    print(f"using tile {best[1]} warps {best[2]}")


def sweep_gemm(dev: torch.device, reps: int, s: int = 8192) -> None:
    """Time the Triton block-scaled GEMM at s^3 per tile config (blockwise, then MX 1x32); keep the fastest."""
    from fp8comm.gemm import triton_gemm as tg
    from fp8comm.tools.bench.gemm import operands

    flop = 2.0 * s**3
    for layout, name in (("blockwise", "GPU_CONFIG"), ("mxfp8", "GPU_CONFIG_SMALL_K")):
        a, b = operands(s, s, s, layout, dev)
        best = None
        for bm, bn in ((128, 128), (128, 256), (256, 128), (64, 256)):
            for warps in (4, 8):
                for stages in (3, 4):
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=stages)
                    setattr(tg, name, cfg)
                    try:
                        t = bench(lambda a=a, b=b: tg.triton_gemm(a, b, torch.bfloat16), reps, 2, dev)
                    except Exception as e:
                        print(f"gemm {layout} {cfg}: failed: {str(e).splitlines()[0][:100]}", flush=True)
                        continue
                    print(f"gemm {layout} {cfg}: {t * 1e3:.3f} ms, {flop / t / 1e12:.0f} TFLOP/s", flush=True)
                    if best is None or t < best[0]:
                        best = (t, cfg)
        setattr(tg, name, best[1])
        print(f"using {name} = {best[1]} ({flop / best[0] / 1e12:.0f} TFLOP/s)", flush=True)
        del a, b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--sweep",
        action="store_true",
        help="first time quantize_with_transpose per tile shape and warps, and use the fastest",
    )
    p.add_argument(
        "--sweep-gemm",
        action="store_true",
        help="first time the Triton GEMM per tile config at 8192^3 and use the fastest",
    )
    a = p.parse_args()
    dev = torch.device(os.environ.get("PROFILE_DEVICE", "cuda"))
    m, k, n, reps = a.tokens, a.k, a.n, a.reps
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    if a.sweep:
        sweep_tiles(x.detach(), dev, reps)
    if a.sweep_gemm:
        sweep_gemm(dev, reps)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    lin = Fp8Linear(k, n, bias=False, device=dev, recipe=a.recipe)

    def step(layer, requant):
        if requant:
            layer.invalidate_weight_cache()
        layer(x).backward(dy)
        x.grad = None
        layer.weight.grad = None

    rows = []

    def row(name, fn, gbytes=None):
        t = bench(fn, reps, 3, dev)
        extra = f"{gbytes / t:.0f} GB/s" if gbytes else ""
        rows.append((name, t * 1e3, extra))
        print(f"{name:60s} {t * 1e3:8.3f} ms  {extra}", flush=True)
        return t

    t16 = row("nn.Linear bf16 fwd+bwd", lambda: step(ref, False))
    t8 = row(f"Fp8Linear {a.recipe} fwd+bwd (weight re-quantized)", lambda: step(lin, True))
    t8c = row(f"Fp8Linear {a.recipe} fwd+bwd (weight cached)", lambda: step(lin, False))
    print(f"speedup: {t16 / t8:.3f}x (re-quantized), {t16 / t8c:.3f}x (cached)")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(lin, True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total" if dev.type == "cuda" else "cpu_time_total",
            row_limit=30,
            max_name_column_width=70,
        )
    )

    r = get_recipe(a.recipe)
    mb = m * k * 2 / 1e9
    row("copy x (bf16 clone)", lambda: x.detach().clone(), 2 * mb)
    row("quantize x (input role)", lambda: quantize(x.detach(), r.input.fmt, scaling=r.input.scaling), 1.5 * mb)
    row("quantize dy (grad role)", lambda: quantize(dy, r.grad.fmt, scaling=r.grad.scaling), 1.5 * mb)
    w = lin.weight.detach()
    row(
        "quantize W fp32 (weight role)",
        lambda: quantize(w, r.weight.fmt, scaling=r.weight.scaling),
        w.numel() * 5 / 1e9,
    )
    row("amax x (torch: abs().amax())", lambda: x.detach().abs().amax())
    xq = quantize(x.detach(), r.input.fmt, scaling=r.input.scaling)
    s1 = xq.scale
    row(
        "quantize x, scale given",
        lambda: quantize(x.detach(), r.input.fmt, scaling=r.input.scaling, scale=s1),
        1.5 * mb,
    )
    row("quantize x 1x128 e4m3 (reference point)", lambda: quantize(x.detach(), "e4m3", 128), 1.5 * mb)
    from fp8comm.quant import quantize_with_transpose

    if r.input.transpose_invariant:
        row(
            "quantize_with_transpose x (input role)",
            lambda: quantize_with_transpose(x.detach(), r.input.fmt, scaling=r.input.scaling),
            2 * mb,
        )
    else:
        row(
            "quantize x^T (input role, along tokens)",
            lambda: quantize(x.detach().t(), r.input.fmt, scaling=r.input.scaling),
            1.5 * mb,
        )
    row("transpose x codes (torch .t().contiguous())", lambda: xq.data.t().contiguous(), mb)
    row("transpose x codes as uint8", lambda: xq.data.view(torch.uint8).t().contiguous(), mb)
    dyq = quantize(dy, r.grad.fmt, scaling=r.grad.scaling)
    wq = quantize(w, r.weight.fmt, scaling=r.weight.scaling)
    if r.input.transpose_invariant and r.grad.transpose_invariant and r.weight.transpose_invariant:
        xq_t, dyq_t, wq_t = (backends.transpose(q, contiguous=True) for q in (xq, dyq, wq))
        row("GEMM fwd  x.W^T  -> bf16", lambda: backends.gemm(xq, wq, torch.bfloat16))
        row("GEMM dgrad dy.W  -> bf16", lambda: backends.gemm(dyq, wq_t, torch.bfloat16))
        row("GEMM wgrad dy^T.x -> fp32", lambda: backends.gemm(dyq_t, xq_t, torch.float32))
        row("GEMM wgrad dy^T.x -> bf16", lambda: backends.gemm(dyq_t, xq_t, torch.bfloat16))
    x16 = x.detach()
    w16 = ref.weight.detach()
    row("bf16 GEMM fwd", lambda: x16 @ w16.t())
    row("bf16 GEMM dgrad", lambda: dy @ w16)
    row("bf16 GEMM wgrad", lambda: dy.t() @ x16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
