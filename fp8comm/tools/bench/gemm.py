"""FP8 vs BF16 GEMM and Fp8Linear fwd+bwd throughput per backend and shape, ratios measured in one run.

On CPU the FP8 paths are an exact emulation (FP8 codes upcast, fp32 matmul per K block) or torch._scaled_mm's CPU
kernel: both are SLOWER than a BF16 matmul there. They exist for exactness, not speed; the CPU table says so.
The speedups that matter come from a GPU run (see launch/device_check_gemm.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from fp8comm.gemm import Fp8Linear, backends, telemetry
from fp8comm.quant import Scaling, quantize

LAYOUTS = {  # name -> (scaling of a [M, K], scaling of b [N, K], formats)
    "tensorwise": (Scaling(None, None), Scaling(None, None), ("e4m3", "e4m3")),
    "rowwise": (Scaling(1, None), Scaling(1, None), ("e4m3", "e4m3")),
    "blockwise": (Scaling(1, 128), Scaling(128, 128), ("e4m3", "e4m3")),
    "mxfp8": (Scaling(1, 32, "e8m0"), Scaling(1, 32, "e8m0"), ("e4m3", "e4m3")),
}


def parse_shapes(s: str) -> list[tuple[int, int, int]]:
    """'MxNxK,...' -> [(M, N, K), ...]; a single number n means n x n x n."""
    out = []
    for part in s.split(","):
        dims = [int(d) for d in part.lower().split("x") if d]
        if len(dims) == 1:
            dims *= 3
        if len(dims) != 3 or min(dims) <= 0:
            raise ValueError(f"bad shape {part!r}: expected MxNxK with positive ints")
        out.append((dims[0], dims[1], dims[2]))
    return out


def bench(fn, reps: int, warmup: int, device: torch.device) -> float:
    """Median seconds of fn() over `reps` runs (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def operands(m: int, n: int, k: int, layout: str, device: torch.device, seed: int = 0):
    sa, sb, (fa, fb) = LAYOUTS[layout]
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device) * 0.05
    return quantize(x, fa, scaling=sa), quantize(w, fb, scaling=sb)


def gemm_rows(shapes, layouts, backend_names, device, reps, warmup) -> list[dict]:
    """One row per (shape, layout, backend): FP8 GEMM time vs a BF16 matmul of the same shape."""
    rows = []
    for m, n, k in shapes:
        g = torch.Generator(device="cpu").manual_seed(1)
        a16 = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        b16 = torch.randn(n, k, generator=g).to(device, torch.bfloat16)
        t16 = bench(lambda a16=a16, b16=b16: a16 @ b16.t(), reps, warmup, device)
        flop = 2.0 * m * n * k
        rows.append(
            dict(
                kind="gemm",
                shape=f"{m}x{n}x{k}",
                layout="bf16",
                backend="torch.matmul",
                ms=t16 * 1e3,
                tflops=flop / t16 / 1e12,
                speedup_vs_bf16=1.0,
            )
        )
        del a16, b16
        for layout in layouts:
            a, b = operands(m, n, k, layout, device)
            names = backend_names or [c for c, _ in backends.candidates(a, b, torch.bfloat16)][:1]
            for be in names:
                row = dict(kind="gemm", shape=f"{m}x{n}x{k}", layout=layout, backend=be)
                try:
                    t = bench(
                        lambda a=a, b=b, be=be: backends.gemm(a, b, torch.bfloat16, backend=be), reps, warmup, device
                    )
                    row.update(ms=t * 1e3, tflops=flop / t / 1e12, speedup_vs_bf16=t16 / t)
                except Exception as e:
                    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                rows.append(row)
            del a, b
    return rows


def linear_rows(shapes, recipes, device, reps, warmup, backend="auto") -> list[dict]:
    """One row per (tokens x in -> out, recipe): Fp8Linear forward+backward vs nn.Linear in bf16."""
    rows = []
    for tokens, n_out, k_in in shapes:
        g = torch.Generator(device="cpu").manual_seed(2)
        x = torch.randn(tokens, k_in, generator=g).to(device, torch.bfloat16).requires_grad_()
        dy = torch.randn(tokens, n_out, generator=g).to(device, torch.bfloat16)
        ref = torch.nn.Linear(k_in, n_out, bias=False, device=device, dtype=torch.bfloat16)

        def step(layer, x=x, dy=dy):
            y = layer(x)
            y.backward(dy)
            x.grad = None
            layer.weight.grad = None

        t16 = bench(lambda ref=ref: step(ref), reps, warmup, device)
        flop = 6.0 * tokens * n_out * k_in
        shape = f"{tokens}x{k_in}->{n_out}"
        rows.append(
            dict(
                kind="linear",
                shape=shape,
                recipe="bf16 nn.Linear",
                ms=t16 * 1e3,
                tflops=flop / t16 / 1e12,
                speedup_vs_bf16=1.0,
            )
        )
        for r in recipes:
            row = dict(kind="linear", shape=shape, recipe=r)
            try:
                lin = Fp8Linear(k_in, n_out, bias=False, device=device, dtype=torch.float32, recipe=r, backend=backend)
                telemetry.reset_counters()
                t = bench(lambda lin=lin: step(lin), reps, warmup, device)
                row.update(
                    ms=t * 1e3,
                    tflops=flop / t / 1e12,
                    speedup_vs_bf16=t16 / t,
                    routes=",".join(f"{k[5:]}:{v}" for k, v in telemetry.counters("gemm.").items()),
                )
                del lin
            except Exception as e:
                row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            rows.append(row)
        del x, dy, ref
    return rows


def format_rows(rows: list[dict]) -> str:
    out = [
        "| kind | shape | case | backend / routes | ms | TFLOP/s | speedup vs bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        case = r.get("layout") or r.get("recipe")
        be = r.get("backend") or r.get("routes", "")
        if "error" in r:
            out.append(f"| {r['kind']} | {r['shape']} | {case} | {be} | error: {r['error']} | | |")
        else:
            out.append(
                f"| {r['kind']} | {r['shape']} | {case} | {be} | {r['ms']:.3f} | {r['tflops']:.2f} | "
                f"{r['speedup_vs_bf16']:.2f}x |"
            )
    return "\n".join(out)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=None, help="GEMM shapes MxNxK,... (default: 1024,2048 on CPU; 4096,8192 GPU)")
    p.add_argument(
        "--linear-shapes",
        default=None,
        help="Fp8Linear shapes TOKENSxOUTxIN,... (default: 2048x1024x1024 CPU; 16384x8192x8192 GPU)",
    )
    p.add_argument("--layouts", default="tensorwise,rowwise,blockwise,mxfp8")
    p.add_argument("--backends", default="", help="comma list of emulation,scaled_mm,triton (default: auto's pick)")
    p.add_argument("--recipes", default="tensorwise,fp8_amax,rowwise,blockwise")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the rows to this file")


def run(args) -> int:
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    shapes = parse_shapes(args.shapes or ("4096,8192" if gpu else "1024,2048"))
    lshapes = parse_shapes(args.linear_shapes or ("16384x8192x8192" if gpu else "2048x1024x1024"))
    reps = args.reps or (20 if gpu else 3)
    names = [b for b in args.backends.split(",") if b]
    for b in names:
        if b not in backends.BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; valid: {', '.join(backends.BACKENDS)}")
    layouts = [x for x in args.layouts.split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            raise SystemExit(f"unknown layout {x!r}; valid: {', '.join(LAYOUTS)}")
    dev_name = (
        torch.cuda.get_device_name(device)
        if gpu
        else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    )
    print(
        f"fp8comm bench gemm on {dev_name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
        f"median of {reps}"
    )
    if not gpu:
        print(
            "NOTE: CPU has no FP8 GEMM hardware. 'emulation' (the exact reference) and torch._scaled_mm's CPU "
            "kernel are expected to be SLOWER than bf16 here; ratios < 1 are the honest CPU result."
        )
    rows = gemm_rows(shapes, layouts, names, device, reps, args.warmup)
    rows += linear_rows(lshapes, [r for r in args.recipes.split(",") if r], device, reps, args.warmup)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
