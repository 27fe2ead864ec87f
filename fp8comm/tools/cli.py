"""The `fp8comm` command: `demo` (the README's main job: DeepSpeed ZeRO-3 training, BF16 vs FP8), `plan` (predicted
communication time per step for each wire choice on a cluster you describe), `calibrate` (measure this cluster's
links and codecs, write the calibration `plan` and the engines load) and `bench ...`."""

from __future__ import annotations

import argparse
import importlib
import sys

EXTRA = "tools"
EXTRA_PACKAGES = ("rich", "matplotlib")  # pyproject's [project.optional-dependencies] tools, by import name

# subcommand -> (module with add_args(parser) and run(args), one-line help, what it imports from the tools extra).
# Help texts live here so that `fp8comm -h` and `fp8comm bench -h` import nothing: a subcommand's module is imported
# only when that subcommand is on the command line, and its extra is checked only when it is about to run.
DEMO = (
    "fp8comm.tools.demo",
    "the main job: DeepSpeed ZeRO-3 training, BF16 vs FP8 GEMMs + FP8 communication (see README)",
    ("rich", "matplotlib"),
)
PLAN = (
    "fp8comm.tools.plan",
    "predicted communication time per step for each wire choice on a cluster you describe, and the planner's pick",
    (),
)
CALIBRATE = (
    "fp8comm.tools.calibrate",
    "measure this cluster's links and codec speeds (under torchrun or --nproc ranks) and write the calibration JSON",
    (),
)
TOP = {"demo": DEMO, "plan": PLAN, "calibrate": CALIBRATE}  # subcommands of their own (not under `bench`)
BENCHES = {
    "quant": (
        "fp8comm.tools.bench.quant",
        "quantization report: SQNR, underflow and overflow per scaling method x format x data, and path throughput",
        ("rich",),
    ),
    "comm": (
        "fp8comm.tools.bench.comm",
        "FP8 collectives vs plain torch.distributed (bf16, fp32), side by side in one run",
        (),
    ),
    "gemm": ("fp8comm.tools.bench.gemm", "FP8 vs BF16 GEMM and Fp8Linear fwd+bwd throughput per backend and shape", ()),
}


def missing_extra(command: str, needs: tuple[str, ...]) -> str | None:
    """None when every package in `needs` imports, else the one-line message naming the extra to install."""
    missing = []
    for name in needs:
        try:
            importlib.import_module(name)
        except ImportError as e:  # not installed, or installed but broken: either way the extra is what to fix
            missing.append(f"{name} ({e})")
    if not missing:
        return None
    return (
        f"{command} needs the '{EXTRA}' extra ({', '.join(EXTRA_PACKAGES)}): pip install 'fp8comm[{EXTRA}]'"
        f"; not importable: {'; '.join(missing)}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="fp8comm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {
        (name,): sub.add_parser(name, help=text) for name, (_, text, _) in TOP.items()
    }
    bench = sub.add_parser("bench", help="benchmarks that print side-by-side tables").add_subparsers(
        dest="bench", required=True
    )
    for name, (_, text, _) in BENCHES.items():
        parsers[("bench", name)] = bench.add_parser(name, help=text)
    chosen = tuple(argv[:1]) if argv[:1] and argv[0] in TOP else tuple(argv[:2])
    checked = False
    if chosen in parsers:  # only the chosen subcommand's module is imported (for its arguments)
        mod, text, needs = TOP[chosen[0]] if chosen[0] in TOP else BENCHES[chosen[1]]
        if not {"-h", "--help"} & set(argv):  # it is going to run: the extra first, before anything is imported
            if _report(missing_extra("fp8comm " + " ".join(chosen), needs)):
                return 2
            checked = True
        parsers[chosen].description = text
        importlib.import_module(mod).add_args(parsers[chosen])
    args = p.parse_args(argv)  # help (which needs no extra) and usage errors exit here
    mod, _, needs = TOP[args.cmd] if args.cmd in TOP else BENCHES[args.bench]
    if not checked and _report(missing_extra("fp8comm " + " ".join(chosen), needs)):
        return 2
    return importlib.import_module(mod).run(args) or 0


def _report(problem: str | None) -> bool:
    if problem:
        print(problem, file=sys.stderr)
    return bool(problem)


if __name__ == "__main__":
    sys.exit(main())
