"""Quantization report: SQNR, underflow and overflow per scaling method x format x data, and path throughput."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import dataclass

import torch

from fp8comm.quant import (
    BlockScaling,
    DelayedScaling,
    MXScaling,
    RowScaling,
    Scaling,
    TensorScaling,
    get_format,
    quantize,
)
from fp8comm.quant import reference as ref
from fp8comm.quant.dispatch import triton_available
from fp8comm.quant.tensor import view_2d
from fp8comm.tools.bench.gemm import bench


@dataclass(frozen=True)
class Method:
    """A scaling method as the report names it; `stale` feeds a delayed/constant scale instead of current amax."""

    name: str
    scaling: Scaling
    fixed: str | None = None  # None: current scaling; "delayed": amax history of earlier batches; "cscale": 1.0


METHODS = [
    Method("tensor fp32 (current)", TensorScaling()),
    Method("tensor pow2 m=0 (FP8-AMAX)", TensorScaling("pow2")),
    Method("tensor delayed (data grew 2x)", TensorScaling(), fixed="delayed"),
    Method("tensor constant 1.0 (CSCALE)", TensorScaling(), fixed="cscale"),
    Method("rowwise fp32", RowScaling()),
    Method("1x128 fp32", BlockScaling(128)),
    Method("1x128 e8m0", BlockScaling(128, encoding="e8m0")),
    Method("128x128 fp32", BlockScaling(128, 128)),
    Method("MXFP8 1x32 e8m0", MXScaling()),
]


def make_data(name: str, g: torch.Generator) -> torch.Tensor:
    """The report's inputs: 2-D tensors, plus shapes not divisible by any block."""
    if name == "gaussian":
        return torch.randn(1024, 1024, generator=g)
    if name == "heavy-tailed":  # Student-t with 3 degrees of freedom
        z = torch.randn(1024, 1024, generator=g)
        chi = torch.randn(3, 1024, 1024, generator=g).pow(2).sum(0)
        return z / (chi / 3).sqrt()
    if name == "outlier-channels":  # 4 columns x200, as in LLM activations
        x = torch.randn(1024, 1024, generator=g)
        x[:, torch.tensor([3, 100, 517, 900])] *= 200
        return x
    if name == "gradient-like":  # tiny magnitudes: constant scale 1 underflows
        return torch.randn(1024, 1024, generator=g) * 1e-5
    if name == "1-D 100003":
        return torch.randn(100003, generator=g)
    if name == "2-D 999x1000":
        return torch.randn(999, 1000, generator=g) * torch.linspace(0.01, 10, 999).unsqueeze(1)
    raise ValueError(name)


DATA = ["gaussian", "heavy-tailed", "outlier-channels", "gradient-like", "1-D 100003", "2-D 999x1000"]


def measure(x: torch.Tensor, fmt_name: str, m: Method, g: torch.Generator) -> dict:
    """SQNR (dB), underflow (non-zero inputs that became 0), overflow (inputs that saturated: |x/s| at or beyond
    the max plus half the top binade's spacing, where round-to-nearest would have left the grid)."""
    fmt = get_format(fmt_name)
    scale = None
    if m.fixed == "delayed":
        # History from 16 earlier batches half this one's magnitude (a tensor that grew 2x): the classic
        # delayed-scaling failure, overflow of the newest values.
        ds = DelayedScaling(history_len=16)
        for _ in range(16):
            ds.update(ref.block_amax(view_x(x) * 0.5, TensorScaling()))
        scale = ds.scale(fmt)
    elif m.fixed == "cscale":
        scale = torch.tensor(1.0)
    q = quantize(x, fmt, scaling=m.scaling, scale=scale, backend="reference")
    d = q.dequantize()
    err = (d - x).double().pow(2).sum().item()
    sig = x.double().pow(2).sum().item()
    sqnr = 10 * math.log10(sig / err) if err > 0 else float("inf")
    mm, kk = view_2d(x.shape)
    y = (x.reshape(mm, kk) / ref.expand_scale(q.scale, mm, kk, q.scaling)).abs()
    nz = x != 0
    return {
        "sqnr": sqnr,
        "underflow": float(((d == 0) & nz).sum()) / max(1, int(nz.sum())),
        "overflow": float((y >= fmt.max + 2.0 ** (fmt.max_exp - fmt.mantissa_bits - 1)).sum()) / x.numel(),
    }


def view_x(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(view_2d(x.shape))


def throughput(numel: int, reps: int) -> list[dict]:
    """Each available path quantizing bf16 -> FP8 + 1x128 scales, as a fraction of a plain copy, same run."""
    x = torch.randn(numel, dtype=torch.float32).to(torch.bfloat16).reshape(-1, 4096)
    rows = []
    copy = bench(lambda: x.clone(), reps, 1, x.device)
    rows.append({"path": "copy (x.clone)", "ms": copy * 1e3, "ratio_to_copy": 1.0})
    paths = ["reference", "compiled"] + (["triton"] if triton_available(x.device) else [])
    for p in paths:
        t = bench(lambda p=p: quantize(x, "e4m3", 128, backend=p), reps, 1, x.device)
        rows.append({"path": f"quantize 1x128 ({p})", "ms": t * 1e3, "ratio_to_copy": copy / t})
    return rows


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="*", default=DATA, help=f"inputs (default all): {', '.join(DATA)}")
    p.add_argument("--formats", nargs="*", default=["e4m3", "e5m2"])
    p.add_argument("--numel", type=int, default=16 * 2**20, help="elements for the throughput rows (bf16)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results as JSON to this path")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 132))
    g = torch.Generator().manual_seed(args.seed)
    results = []
    t = Table(title="fp8comm quantization report: SQNR dB / underflow % / overflow % (reference bits)")
    t.add_column("data")
    t.add_column("method")
    for f in args.formats:
        t.add_column(f"{f} SQNR", justify="right")
        t.add_column(f"{f} uf%", justify="right")
        t.add_column(f"{f} of%", justify="right")
    for dname in args.data:
        x = make_data(dname, g)
        for m in METHODS:
            cells = [dname, m.name]
            for f in args.formats:
                r = measure(x, f, m, g)
                results.append({"data": dname, "method": m.name, "format": f, **r})
                cells += [f"{r['sqnr']:.1f}", f"{100 * r['underflow']:.2f}", f"{100 * r['overflow']:.3f}"]
            t.add_row(*cells)
        t.add_section()
    console.print(t)
    tp = throughput(args.numel, args.reps)
    t2 = Table(
        title=f"throughput, {args.numel / 2**20:.0f} Mi bf16 elements on {x.device} "
        f"({torch.get_num_threads()} threads), median of {args.reps}"
    )
    for c in ("path", "ms", "ratio to copy"):
        t2.add_column(c, justify="right" if c != "path" else "left", no_wrap=True)
    for r in tp:
        t2.add_row(r["path"], f"{r['ms']:.1f}", f"{r['ratio_to_copy']:.3f}")
    console.print(t2)
    console.print(
        f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"quality": results, "throughput": tp}, fh, indent=1)
    return 0
