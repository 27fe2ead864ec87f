"""The `fp8comm` command: `demo` (the README's main job: DeepSpeed ZeRO-3 training, BF16 vs FP8) and `bench ...`."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_args(parser) and run(args); modules are imported only when used.
BENCHES = {"quant": "fp8comm.bench.quant", "comm": "fp8comm.bench.comm", "gemm": "fp8comm.bench.gemm"}
DEMO = "fp8comm.demo"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fp8comm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="the main job (see README)")
    importlib.import_module(DEMO).add_args(demo)
    bench = sub.add_parser("bench", help="benchmarks that print side-by-side tables").add_subparsers(
        dest="bench", required=True)
    for name, mod in BENCHES.items():
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        m.add_args(bench.add_parser(name, help=(m.__doc__ or "").strip().splitlines()[0]))
    args = p.parse_args(argv)
    mod = DEMO if args.cmd == "demo" else BENCHES[args.bench]
    return importlib.import_module(mod).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
