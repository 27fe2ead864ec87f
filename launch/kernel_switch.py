"""Where CPU FP8 should switch from the torch reference to the compiled kernels (quant.dispatch.COMPILE_MIN_NUMEL).

Times each FP8 wire codec's pack (quantize into the send buffer, 8 destination chunks) and unpack_sum (decode one
chunk into an fp32 sum) with each kernel at sizes from 4 Ki to 1 Mi elements (calibration.measure_codecs: one
untimed call first, the median of --reps), one process, one thread, and what the compiled kernels' first calls cost
in this process (the compile, or the load from inductor's cache when an earlier process compiled the same graphs).

    .venv/bin/python launch/kernel_switch.py [--reps 7] [--codecs fp8,fp8_e8m0]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8comm.comm.calibration import measure_codecs
from fp8comm.quant.dispatch import COMPILE_MIN_NUMEL

SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 19, 1 << 20)  # 4 Ki .. 1 Mi elements


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--codecs", default="fp8,fp8_e8m0")
    a = p.parse_args()
    torch.set_num_threads(1)  # one rank's share: the collectives' ranks run one thread each
    print(f"# torch {torch.__version__}, cpus {os.cpu_count()}, COMPILE_MIN_NUMEL {COMPILE_MIN_NUMEL}; ms per call")
    cols = ("ref pack", "cmp pack", "x", "ref usum", "cmp usum", "x")
    print(f"{'codec':<10}{'elements':>9}" + "".join(f"{c:>{6 if c == 'x' else 10}}" for c in cols))
    for name in a.codecs.split(","):
        first = 0.0
        for n in SIZES:
            row = {}
            for backend in ("reference", "compiled"):
                t: dict = {}
                s = measure_codecs([name], elems=n, reps=a.reps, kinds=("pack", "unpack_sum"), timings=t,
                                   backend=backend)[name]  # fmt: skip
                row[backend] = (n / s.pack * 1e3, n // 8 / s.unpack_sum * 1e3)  # unpack_sum: one of 8 chunks
                if backend == "compiled":
                    first += t[name]["first_call_s"]
            (rp, ru), (cp, cu) = row["reference"], row["compiled"]
            print(f"{name:<10}{n:>9}{rp:>10.3f}{cp:>10.3f}{rp / cp:>6.1f}{ru:>10.3f}{cu:>10.3f}{ru / cu:>6.1f}")
        print(f"# {name}: the compiled kernels' first calls in this process, every size: {first:.2f} s")


if __name__ == "__main__":
    main()
