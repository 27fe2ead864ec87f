"""`fp8comm calibrate`: measure this cluster's links (node-local, cross-node: bandwidth and latency) and this
device's codec speeds once, ahead of time, and write the calibration JSON the planner loads (`fp8comm plan
--calibration FILE`, Calibration.load).

Runs as one rank under torchrun (every rank calls it; rank 0 writes the file), or starts --nproc gloo ranks itself
on 127.0.0.1, --local-size of them per node (LOCAL_WORLD_SIZE), as `fp8comm bench comm` does. The measurement is
fp8comm.comm.calibrate.calibrate(): every rank times, rank 0 decides (the slowest per level and per codec) and
publishes; a calibration that cannot finish within --timeout writes nothing and exits 1 with the reason.
Ahead of time it also times every option as a small real call (the fixed cost per call the model charges; a few
seconds more, which the engines' own start-up calibration does not spend); --no-small-calls leaves that out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

from ..errors import Fp8CommError
from .plan import Usage, count


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="fp8comm-calibration.json", help="where to write the calibration JSON")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument(
        "--local-size",
        type=int,
        default=None,
        help="ranks per node of the started ranks (LOCAL_WORLD_SIZE; default: all on one node); under torchrun its "
        "own GROUP_RANK / LOCAL_WORLD_SIZE",
    )
    p.add_argument("--sizes", default="16Ki,2Mi", help="bytes per link exchange: small,large (default 16Ki,2Mi)")
    p.add_argument(
        "--codec-elems",
        default="16Ki,256Ki",
        help="elements per codec call: small,large (both below the CPU kernel switch, dispatch.COMPILE_MIN_NUMEL, "
        "or both at or above)",
    )
    p.add_argument("--codecs", default="fp8,fp8_e8m0,mxfp4,nvfp4", help="codecs to time")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per size (median kept)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds before the calibration gives up (falls back)")
    p.add_argument("--json", action="store_true", help="print the calibration and its details as JSON")
    p.add_argument(
        "--no-small-calls",
        dest="small_calls",
        action="store_false",
        help="do not time each option as a small real call (the model then charges call_overhead per quantized call)",
    )
    p.add_argument(
        "--large-call-elems",
        default=None,
        help="time each option again as a real call of this many elements (default 4Mi with the small calls and a "
        "--timeout of 60 s or more; the planner's default wires first, timed calls within "
        "smallcalls.LARGE_BUDGET_S seconds); the model scales its prediction toward it; 0: not (needs the small calls)",
    )


def _checked(args) -> dict:
    """calibrate()'s keyword arguments from the command line; bad values raise Usage before any rank starts."""
    from ..comm.calibrate import codec_elems_problem
    from ..comm.calibration import WIRE_CONFIGS
    from ..comm.smallcalls import LARGE_CALL_ELEMS, LARGE_MARGIN_S, SMALL_ELEMS

    def pair(text: str, what: str) -> tuple[int, int]:
        parts = [count(x, what) for x in text.split(",")]
        if len(parts) != 2 or parts[0] >= parts[1]:
            raise Usage(f"{what}: give small,large with small < large, got {text!r}")
        return parts[0], parts[1]

    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    bad = [c for c in codecs if c not in WIRE_CONFIGS]
    if bad or not codecs:
        raise Usage(f"--codecs: unknown {', '.join(bad) or '(none given)'}; valid: {', '.join(WIRE_CONFIGS)}")
    if args.reps < 1:
        raise Usage(f"--reps must be >= 1, got {args.reps}")
    if not args.timeout > 0:
        raise Usage(f"--timeout must be > 0 seconds, got {args.timeout}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise Usage(f"--out: directory {str(out.parent)!r} does not exist")
    codec_elems = pair(args.codec_elems, "--codec-elems")
    if (problem := codec_elems_problem(codec_elems)) is not None:
        raise Usage(f"--codec-elems: {problem}")
    given = args.large_call_elems
    if given is None:  # by default with the small calls and time for them (a short --timeout: without, silently)
        given = str(LARGE_CALL_ELEMS) if args.small_calls and args.timeout >= 2 * LARGE_MARGIN_S else "0"
    large = 0 if re.fullmatch(r"\s*0*(\.0*)?\s*", given) else count(given, "--large-call-elems")
    if large and not args.small_calls:
        raise Usage(
            "--large-call-elems needs the small calls (the model scales between the two sizes): drop "
            "--no-small-calls, or give --large-call-elems 0"
        )
    if large and large <= 2 * SMALL_ELEMS:
        raise Usage(f"--large-call-elems must be 0 or > {2 * SMALL_ELEMS} (twice the small calls'), got {large}")
    if large and args.timeout < 2 * LARGE_MARGIN_S:
        raise Usage(
            f"--large-call-elems needs --timeout >= {2 * LARGE_MARGIN_S:g} s (a first call may compile), "
            f"got {args.timeout:g}; or --large-call-elems 0"
        )
    return {
        "codecs": codecs,
        "sizes": pair(args.sizes, "--sizes"),
        "codec_elems": codec_elems,
        "reps": args.reps,
        "timeout_s": args.timeout,
        "small_calls": args.small_calls,
        "large_call_elems": large,
    }


def run(args) -> int:
    local = 0
    try:
        kw = _checked(args)
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            if args.nproc < 2:
                raise Usage(f"--nproc must be >= 2 (links are timed between ranks), got {args.nproc}")
            local = args.local_size if args.local_size is not None else args.nproc
            if local < 1 or args.nproc % local:
                raise Usage(f"--local-size {local} must be >= 1 and divide --nproc {args.nproc}")
    except Fp8CommError as e:
        print(f"fp8comm calibrate: {e}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            return _rank(args, kw)
        finally:
            dist.destroy_process_group()
    return _spawn(args, kw, local)


def _spawn(args, kw: dict, local: int) -> int:
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, args.nproc, local, store.port, vars(args), kw)) for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout + 120  # start-up and imports on top of the calibration's own limit
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    if hung or any(c not in (0, 1, 2) for c in codes):
        print(f"fp8comm calibrate: rank(s) {hung} hung, exit codes {codes}", file=sys.stderr)
        return 1
    return int(codes[0] or 0)


def join(rank: int, world: int, local: int, port: int, store_timeout_s: float = 60.0) -> None:
    """A started rank joins the gloo world on 127.0.0.1:port as `local` ranks per node, its threads its share."""
    import torch
    import torch.distributed as dist

    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=store_timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))


def _worker(rank: int, world: int, local: int, port: int, argd: dict, kw: dict) -> None:
    import torch.distributed as dist

    join(rank, world, local, port)
    code = 1
    try:
        code = _rank(argparse.Namespace(**argd), kw)
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def _rank(args, kw: dict) -> int:
    """One rank's part: calibrate; rank 0 writes the file and prints. 0: written; 1: fell back; 2: refused."""
    import warnings

    import torch.distributed as dist

    from ..comm.calibrate import CalibrationWarning, calibrate

    report: dict = {}
    rank = dist.get_rank()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CalibrationWarning)
            cal = calibrate(**kw, report=report)
    except Fp8CommError as e:
        if rank == 0:
            print(f"fp8comm calibrate: {e}", file=sys.stderr)
        return 2
    if cal is None:
        if rank == 0:
            why = caught[0].message if caught else report.get("fallback", "?")
            print(f"fp8comm calibrate: nothing written: {why}", file=sys.stderr)
        return 1
    if rank == 0:
        Path(args.out).write_text(cal.to_json() + "\n")
        if args.json:
            print(json.dumps({"calibration": cal.to_dict(), "report": report, "file": args.out}, indent=1))
        else:
            _print(cal, report, args.out)
    return 0


def _print(cal, report: dict, out: str) -> None:
    s = report["seconds"]
    print(f"# fp8comm calibrate: {cal.source}")
    print(
        f"# {s['decided_s']:.2f} s in all ({s['first_calls_s']:.2f} s first codec calls, i.e. compiles and caches; "
        f"{s['without_first_calls_s']:.2f} s without them): links {s['links_s']:.2f} s, codecs {s['codecs_s']:.2f} s"
    )
    print(f"# rule: {report['rule']}")
    rows = [
        ["node-local (per rank)", f"{cal.intra.bandwidth / 1e6:.1f}", f"{cal.intra.bandwidth * 8 / 1e6:.0f}",
         f"{cal.intra.latency * 1e6:.0f}"],
        ["cross-node (per node)", f"{cal.inter.bandwidth / 1e6:.1f}", f"{cal.inter.bandwidth * 8 / 1e6:.0f}",
         f"{cal.inter.latency * 1e6:.0f}"],
    ]  # fmt: skip
    _table(["level", "MB/s", "Mbit/s", "latency us"], rows)
    print()
    _table(
        ["codec", "pack M elem/s", "unpack_sum M elem/s"],
        [[k, f"{v.pack / 1e6:.1f}", f"{v.unpack_sum / 1e6:.1f}"] for k, v in cal.codecs.items()],
    )
    for kind, calls, n, spent in (
        ("small", cal.small_calls, cal.small_call_elems, s.get("calls_s", 0.0)),
        ("large", cal.large_calls, cal.large_call_elems, s.get("large_calls_s", 0.0)),
    ):
        if calls:
            print()
            _table([f"option ({kind} call)", "ms"], [[k, f"{v * 1e3:.2f}"] for k, v in sorted(calls.items())])
            print(f"# {kind} calls: {n} elements per buffer, {spent:.2f} s")
    for n in cal.notes:
        print(f"# note: {n}")
    print(f"# written: {out} (fp8comm plan --calibration {out})")


def _table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="fp8comm calibrate", description=__doc__)
    add_args(ap)
    sys.exit(run(ap.parse_args()))
