#!/usr/bin/env python3
"""The planner's predictions against measurement, in one launch (issue 30 item 5): calibrate, then time the rows of
`fp8comm bench comm`, then print per row the measured and the predicted milliseconds and whether they agree within
20%.

  .venv/bin/python launch/plan_check.py                         4 gloo ranks on 127.0.0.1 as 2 nodes x 2
  .venv/bin/python launch/plan_check.py --nproc 8 --local-size 4 --json out.json
  launch/cluster.py --name pc up --nodes 2 --rate 1gbit         the simulated cluster: one torchrun per node
  launch/cluster.py --name pc run --nproc-per-node 2 -- launch/plan_check.py --json out.json
  launch/plan_check.py --rounds 3 --json out.json              3 paired rounds (calibrate, then the table) in
                                                                one launch; each row: the median of the rounds
  launch/plan_check.py --from out.json                          re-predict a saved run's measurements with this
                                                                checkout's model (its calibration, or --calibration)
  launch/plan_check.py --from a.json b.json c.json              pool the rounds of several launches of one shape
  launch/plan_check.py --repeat a.json b.json                   two launches of one shape against each other: how
                                                                many rows the measurement itself repeats within
                                                                20%, and the predictions on those rows

Every rank first runs fp8comm.comm.calibrate.calibrate() over the world (as `fp8comm calibrate` does ahead of
time: with every option's small real call and its large one, which the engines' start-up leaves out;
--no-small-calls: as they do; --large-call-elems 0: small calls only; the summary also counts the same rows
predicted without the large calls and without either), then fp8comm.tools.bench.comm's own table
(its timing: median per call, barrier before each, the slowest rank's; `--ops`, `--min-size`, ... are bench comm's
options, with this check's defaults). Rank 0 predicts each row with fp8comm.comm.planner.predict (the planner's own
numbers) from that calibration:

  bench comm row   the planner's option                      prediction
  bf16 / fp32      Option("native") in bf16 / fp32           torch's gloo call (planner.predict)
  fp8, mxfp4       Option(codec, "flat")                     fp8comm's flat call (planner.predict)
  fp8-2l, mxfp4-2l Option(codec, "two_level")                fp8comm's two-level call (planner.predict)
  bf16-ring        (not an option: fp8comm's bench baseline) linkmodel.time(op, "ring", "bf16", ...)

With --rounds N (or several --from files) each round is a pair: a calibration and the table measured right after
it; a row's measured time is the median of its rounds' and its prediction the median of each round's prediction from
that round's own calibration (issue 30 item 5: "the median of at least 5 alternating steps or 3 paired runs").
mxfp4 rows are bench comm's (no error feedback), so they are predicted without it. Rows of a codec the calibration
did not time are left out. The summary counts the planner's options and every row apart; exit 0 whatever the count
(it is a measurement, not a test), 1 when the calibration fell back or a rank failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOLERANCE = 0.20
# bench comm's variant -> (planner wire, levels) or None for the ring baseline
VARIANTS: dict[str, tuple[str, str] | None] = {
    "bf16": ("native", "flat"),
    "fp32": ("native", "flat"),
    "bf16-ring": None,
    "fp8": ("fp8", "flat"),
    "fp8-2l": ("fp8", "two_level"),
    "fp8-e8m0": ("fp8_e8m0", "flat"),
    "fp8-e8m0-2l": ("fp8_e8m0", "two_level"),
    "mxfp4": ("mxfp4", "flat"),
    "mxfp4-2l": ("mxfp4", "two_level"),
    "nvfp4": ("nvfp4", "flat"),
    "nvfp4-2l": ("nvfp4", "two_level"),
}
DEFAULTS = {
    "nproc": 4,
    "ops": "all_gather,reduce_scatter",
    "min_size": 64 << 10,
    "max_size": 16 << 20,
    "factor": 4,
    "scales": "fp32",
    "fp4": "mxfp4",
    "ef_steps": 0,
    "check_cost_size": 0,
    "timeout": 1800.0,
}


# ------------------------------------------------------------------------------------------ the comparison
def option_label(variant: str) -> str:
    """The table's option column for a bench comm variant."""
    v = VARIANTS[variant]
    if v is None:
        return "bf16 ring (bench baseline)"
    wire, levels = v
    if wire == "native":
        return f"engine's own {variant} (torch gloo)"
    return f"{wire} {'two-level' if levels == 'two_level' else 'flat'}"


def predict_row(row: dict, cal, nodes: int, local: int) -> float | None:
    """Predicted seconds of one bench comm row (its op, size, variant) from `cal` on a group of nodes x local, or
    None where the row is not predicted (an unknown variant, a codec the calibration lacks, two levels on a group
    that does not span nodes)."""
    from fp8comm.comm import linkmodel
    from fp8comm.comm.planner import GroupShape, Option, predict
    from fp8comm.tools.bench.comm import _full_count

    variant = row["variant"]
    if variant not in VARIANTS:
        return None
    world = nodes * local
    elems = _full_count(row["op"], row["count"], world, row.get("hidden", 4096))
    spec = VARIANTS[variant]
    if spec is None:
        return linkmodel.time(row["op"], "ring", "bf16", cal.machine(nodes, local), elems).seconds
    wire, levels = spec
    shape = GroupShape(nodes, local)
    if levels == "two_level" and not shape.spans_nodes:
        return None
    if wire != "native" and wire not in cal.codecs and "*" not in cal.codecs:
        return None
    dtype = "fp32" if variant == "fp32" else "bf16"
    return predict(row["op"], elems * (4 if dtype == "fp32" else 2), dtype, shape, Option(wire, levels), cal)


def compare(rows: list[dict], cal, nodes: int, local: int, tolerance: float = TOLERANCE) -> list[dict]:
    """One entry per predicted bench comm row: op, size, variant, option, measured and predicted ms, their ratio
    (predicted / measured) and whether it lies within `tolerance` (|ratio - 1| <= tolerance)."""
    out = []
    for r in rows:
        p = predict_row(r, cal, nodes, local)
        if p is None:
            continue
        m = r["time"]
        ratio = p / m if m > 0 else float("inf")
        out.append(
            {
                "op": r["op"],
                "size": r["size"],
                "variant": r["variant"],
                "option": option_label(r["variant"]),
                "planner_option": VARIANTS[r["variant"]] is not None,
                "measured_ms": m * 1e3,
                "predicted_ms": p * 1e3,
                "ratio": ratio,
                "within": abs(ratio - 1) <= tolerance,
            }
        )
    return out


def compare_rounds(rounds: list[tuple], nodes: int, local: int, tolerance: float = TOLERANCE) -> list[dict]:
    """compare() over paired rounds [(calibration, rows), ...]: per row (op, size, variant) the median of the rounds'
    measured ms against the median of each round's prediction from its own calibration; the rounds' figures in
    measured_rounds / predicted_rounds. Rows follow the first round's order; a row some round lacks uses the rounds
    that have it."""
    per: dict[tuple, list[dict]] = {}
    for cal, rows in rounds:
        for c in compare(rows, cal, nodes, local, tolerance):
            per.setdefault((c["op"], c["size"], c["variant"]), []).append(c)
    out = []
    for cs in per.values():
        m = statistics.median(c["measured_ms"] for c in cs)
        p = statistics.median(c["predicted_ms"] for c in cs)
        ratio = p / m if m > 0 else float("inf")
        out.append(
            {
                **cs[0],
                "measured_ms": m,
                "predicted_ms": p,
                "ratio": ratio,
                "within": abs(ratio - 1) <= tolerance,
                "rounds": len(cs),
                "measured_rounds": [c["measured_ms"] for c in cs],
                "predicted_rounds": [c["predicted_ms"] for c in cs],
            }
        )
    return out


CHOICE_SLACK = 0.05  # issue 30 item 5: never more than 5% slower than the best fixed choice


def choices(checked: list[dict], allow_4bit: bool = True, slack: float = CHOICE_SLACK) -> list[dict]:
    """Per (op, size): the option the predictions pick among the planner's options for a bf16 buffer (the engine's
    own bf16 call, FP8 and, with allow_4bit, MXFP4, flat or two-level) against the best of them as measured: the
    picked option's measured ms over the best's, and whether that stays within `slack`."""
    groups: dict[tuple, list[dict]] = {}
    for c in checked:
        if c["planner_option"] and c["variant"] != "fp32" and (allow_4bit or "fp4" not in c["variant"]):
            groups.setdefault((c["op"], c["size"]), []).append(c)
    out = []
    for (op, size), cs in groups.items():
        pick = min(cs, key=lambda c: c["predicted_ms"])
        best = min(cs, key=lambda c: c["measured_ms"])
        slower = pick["measured_ms"] / best["measured_ms"]
        out.append(
            {
                "op": op,
                "size": size,
                "picked": pick["variant"],
                "picked_ms": pick["measured_ms"],
                "best": best["variant"],
                "best_ms": best["measured_ms"],
                "slower": slower,
                "within": slower <= 1 + slack,
            }
        )
    return out


def format_choices(picked: list[dict], title: str) -> str:
    lines = [f"# {title}: picked by prediction against the best as measured"]
    for c in picked:
        lines.append(
            f"#   {c['op']:<15}{_human(c['size']):>5}  picked {c['picked']:<9} {c['picked_ms']:9.3f} ms  best "
            f"{c['best']:<9} {c['best_ms']:9.3f} ms  {c['slower']:.2f}x {'ok' if c['within'] else 'SLOWER'}"
        )
    n = sum(c["within"] for c in picked)
    lines.append(f"# {title}: {n} / {len(picked)} within {CHOICE_SLACK:.0%} of the best")
    return "\n".join(lines)


def summary(checked: list[dict], tolerance: float = TOLERANCE) -> dict:
    opts = [c for c in checked if c["planner_option"]]
    return {
        "tolerance": tolerance,
        "planner_options_within": sum(c["within"] for c in opts),
        "planner_options_total": len(opts),
        "rows_within": sum(c["within"] for c in checked),
        "rows_total": len(checked),
    }


def repeat(first: list[dict], second: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """Two launches of one shape (compare_rounds() of each) row by row: the second's measured ms over the first's
    and whether the measurement repeats within `tolerance`; each launch's prediction against its own measurement.
    Rows one launch lacks are left out."""
    theirs = {(c["op"], c["size"], c["variant"]): c for c in second}
    out = []
    for a in first:
        b = theirs.get((a["op"], a["size"], a["variant"]))
        if b is None:
            continue
        ratio = b["measured_ms"] / a["measured_ms"] if a["measured_ms"] > 0 else float("inf")
        out.append(
            {
                "op": a["op"],
                "size": a["size"],
                "variant": a["variant"],
                "option": a["option"],
                "planner_option": a["planner_option"],
                "measured_ms": [a["measured_ms"], b["measured_ms"]],
                "predicted_ms": [a["predicted_ms"], b["predicted_ms"]],
                "predicted_ratio": [a["ratio"], b["ratio"]],
                "ratio": ratio,
                "repeats": abs(ratio - 1) <= tolerance,
                "predicted_within": [a["within"], b["within"]],
            }
        )
    return out


def repeat_summary(rows: list[dict], tolerance: float = TOLERANCE) -> dict:
    """Counts over the planner's options: rows whose measurement repeats, rows predicted within `tolerance` in each
    launch and in both, and of the repeating rows those predicted within in both (the rest of those: the model's own
    misses)."""
    opts = [r for r in rows if r["planner_option"]]
    same = [r for r in opts if r["repeats"]]
    return {
        "tolerance": tolerance,
        "planner_options": len(opts),
        "measurement_repeats": len(same),
        "predicted_within": [sum(r["predicted_within"][i] for r in opts) for i in (0, 1)],
        "predicted_within_both": sum(all(r["predicted_within"]) for r in opts),
        "repeating_predicted_within_both": sum(all(r["predicted_within"]) for r in same),
    }


def format_repeat(rows: list[dict], summ: dict) -> str:
    tol = f"{summ['tolerance']:.0%}"
    lines = [
        "| op | size | option | 1st ms | 2nd ms | 2nd/1st | repeats | pred/meas 1st | pred/meas 2nd |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, q = r["measured_ms"], r["predicted_ratio"]
        lines.append(
            f"| {r['op']} | {_human(r['size'])} | {r['option']} | {m[0]:.3f} | {m[1]:.3f} | {r['ratio']:.2f} | "
            f"{'yes' if r['repeats'] else 'no'} | {q[0]:.2f} | {q[1]:.2f} |"
        )
    n = summ["planner_options"]
    lines += [
        f"# the measurement repeats within {tol} (2nd launch against the 1st): {summ['measurement_repeats']} / {n} rows"
        " of the planner's options",
        f"# predicted within {tol} of the 1st: {summ['predicted_within'][0]} / {n}; of the 2nd: "
        f"{summ['predicted_within'][1]} / {n}; of both: {summ['predicted_within_both']} / {n}",
        f"# of the {summ['measurement_repeats']} rows that repeat, predicted within {tol} of both: "
        f"{summ['repeating_predicted_within_both']}",
    ]
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, s in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= s and n % s == 0:
            return f"{n // s}{unit}"
    return str(n)


def format_table(checked: list[dict], summ: dict) -> str:
    head = ["op", "size", "option", "measured ms", "predicted ms", "pred/meas", f"within {summ['tolerance']:.0%}"]
    body = [
        [
            c["op"],
            _human(c["size"]),
            c["option"],
            f"{c['measured_ms']:.3f}",
            f"{c['predicted_ms']:.3f}",
            f"{c['ratio']:.2f}",
            "yes" if c["within"] else "no",
        ]
        for c in checked
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in [head, *body]]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.append(
        f"# within {summ['tolerance']:.0%}: {summ['planner_options_within']} / {summ['planner_options_total']} rows of "
        f"the planner's options; {summ['rows_within']} / {summ['rows_total']} rows in all (with the bench's baselines)"
    )
    return "\n".join(lines)


def _speeds(v) -> str:
    out = f"{v.pack / 1e6:.0f} / {v.unpack_sum / 1e6:.0f}"
    if v.fixed:
        out += f" + {v.fixed * 1e6:.0f} us per call"
    if v.above is not None:
        out += f" (>= {v.above[0]}: {_speeds(v.above[1])})"
    return out


def describe_calibration(cal, report: dict) -> str:
    s = report.get("seconds", {})
    lines = [
        f"# calibration: {cal.source}",
        f"# cross-node {cal.inter.bandwidth * 8 / 1e6:.0f} Mbit/s per node ({cal.inter.latency * 1e6:.0f} us/step), "
        f"node-local {cal.intra.bandwidth * 8 / 1e6:.0f} Mbit/s per rank ({cal.intra.latency * 1e6:.0f} us/step), "
        f"host cost per quantized call {cal.call_overhead * 1e6:.0f} us",
        "# codecs (M elements/s, pack / unpack_sum; calls >= N elements: theirs): "
        + ", ".join(f"{k} {_speeds(v)}" for k, v in cal.codecs.items()),
    ]
    if s:
        lines.append(
            f"# calibration took {s.get('decided_s', 0):.2f} s ({s.get('first_calls_s', 0):.2f} s first codec calls)"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the ranks
def _rank(args) -> int:
    """One rank's part: --rounds times calibrate over the world, then bench comm's table; rank 0 compares and
    prints."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    rounds = []
    for i in range(args.rounds):
        got = _round(args, rank, i)
        if got is None:
            return 1
        rounds.append(got)
    if rank != 0:
        return 0
    nodes = world // local if world % local == 0 else 1
    result = {"meta": _meta(world, local, nodes, rounds[0]["calibrate_s"], args), "rounds": rounds}
    _finish(result, args)
    return 0


def _round(args, rank: int, i: int) -> dict | None:
    """One paired round: calibrate(), then bench comm's table. Rank 0 gets {calibration, calibration_report,
    calibrate_s, rows}, the others {}; None when the calibration fell back (on every rank alike)."""
    import warnings

    from fp8comm.comm.calibrate import CalibrationWarning, calibrate
    from fp8comm.tools.bench import comm as bench

    report: dict = {}
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CalibrationWarning)
        cal = calibrate(
            timeout_s=args.calibrate_timeout,
            report=report,
            small_calls=args.small_calls,
            large_call_elems=args.large_call_elems if args.small_calls else 0,
        )
    cal_s = time.monotonic() - t0
    if cal is None:
        if rank == 0:
            print(f"# plan_check: calibration fell back: {caught[0].message if caught else report}", file=sys.stderr)
        return None
    rows_file = None
    if rank == 0:
        fd, rows_file = tempfile.mkstemp(prefix="plan_check_rows_", suffix=".jsonl")
        os.close(fd)
        print(f"# round {i + 1} of {args.rounds}", flush=True)
        print(describe_calibration(cal, report), flush=True)
    bench._table(argparse.Namespace(**{**vars(args), "json": rows_file or ""}))
    if rank != 0:
        return {}
    assert rows_file is not None
    rows = [json.loads(line) for line in Path(rows_file).read_text().splitlines() if line.strip()]
    os.unlink(rows_file)
    for r in rows:
        r.pop("times", None)
        r["hidden"] = args.hidden
    return {"calibration": cal.to_dict(), "calibration_report": report, "calibrate_s": cal_s, "rows": rows}


def _meta(world: int, local: int, nodes: int, cal_s: float, args) -> dict:
    import platform

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted": bool(git("status", "--porcelain", "--untracked-files=no")),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "world": world,
        "local": local,
        "nodes": nodes,
        "calibrate_s": cal_s,
        "link": os.environ.get("GLOO_SOCKET_IFNAME", "") or "loopback (127.0.0.1)",
        "argv": sys.argv[1:],
    }


def rounds_of(result: dict, where: str = "", calibration=None) -> list[tuple]:
    """A saved run's paired rounds as [(Calibration, rows), ...]: its "rounds", or (files written before --rounds)
    its one calibration and rows; `calibration`: predict every round from it instead."""
    from fp8comm.comm.calibration import Calibration

    saved = result.get("rounds") or [{"calibration": result["calibration"], "rows": result["rows"]}]
    return [(calibration or Calibration.from_dict(r["calibration"], where=where), r["rows"]) for r in saved]


def _finish(result: dict, args, calibration=None) -> None:
    m = result["meta"]
    rounds = rounds_of(result, calibration=calibration)
    checked = compare_rounds(rounds, m["nodes"], m["local"], args.tolerance)
    summ = {**summary(checked, args.tolerance), "rounds": len(rounds)}
    # the same rows predicted without the large calls, and without the small calls too (call_overhead alone, as the
    # engines' start-up calibration has)
    small = [(replace(cal, large_calls={}, large_call_elems=0), rows) for cal, rows in rounds]
    summ["planner_options_within_without_large_calls"] = summary(
        compare_rounds(small, m["nodes"], m["local"], args.tolerance), args.tolerance
    )["planner_options_within"]
    bare = [
        (replace(cal, small_calls={}, small_call_elems=0, large_calls={}, large_call_elems=0), rows)
        for cal, rows in rounds
    ]
    summ["planner_options_within_without_small_calls"] = summary(
        compare_rounds(bare, m["nodes"], m["local"], args.tolerance), args.tolerance
    )["planner_options_within"]
    picked = {"fp8": choices(checked, allow_4bit=False), "4bit": choices(checked, allow_4bit=True)}
    for k, v in picked.items():
        summ[f"choices_within_{k}"] = sum(c["within"] for c in v)
        summ[f"choices_{k}"] = len(v)
    result.update(checked=checked, summary=summ, choices=picked)
    print(
        f"# plan_check: {m['nodes']} node(s) x {m['local']} ranks, {m['link']}, commit {m['commit']}"
        f"{' (uncommitted changes)' if m['uncommitted'] else ''}, {m['date']}, load {m['load'][0]:.1f}"
    )
    if len(rounds) > 1:
        print(f"# {len(rounds)} paired rounds: per row the median measured and the median predicted")
    print(format_table(checked, summ))
    if any(cal.large_calls for cal, _ in rounds):
        print(
            f"# without the large calls (small calls alone): {summ['planner_options_within_without_large_calls']} / "
            f"{summ['planner_options_total']} rows of the planner's options within {args.tolerance:.0%}"
        )
    if any(cal.small_calls for cal, _ in rounds):
        print(
            f"# without the small calls (call_overhead alone): {summ['planner_options_within_without_small_calls']} / "
            f"{summ['planner_options_total']} rows of the planner's options within {args.tolerance:.0%}"
        )
    print(format_choices(picked["fp8"], "FP8 allowed (no 4 bits)"))
    print(format_choices(picked["4bit"], "4 bits allowed"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"# written: {args.json}")


def _worker(rank: int, world: int, local: int, port: int, argd: dict) -> None:
    import torch.distributed as dist

    from fp8comm.tools.calibrate import join

    join(rank, world, local, port, store_timeout_s=120.0)
    code = 1
    try:
        code = _rank(argparse.Namespace(**argd))
    finally:
        from fp8comm.tools.bench.comm import _shutdown

        _shutdown()
        dist.destroy_process_group()
    sys.exit(code)


def _spawn(args) -> int:
    """Start --nproc gloo ranks on 127.0.0.1, --local-size per node (LOCAL_WORLD_SIZE), as bench comm and
    fp8comm calibrate start theirs."""
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120)
    )
    ctx = mp.get_context("spawn")
    local = args.local_size if args.local_size is not None else 2
    procs = [
        ctx.Process(target=_worker, args=(r, args.nproc, local, store.port, vars(args))) for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    bad = [i for i, p in enumerate(procs) if p.is_alive() or p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if bad:
        print(f"# plan_check: rank(s) {bad} failed or timed out", file=sys.stderr)
    return 1 if bad else 0


def _load_runs(flag: str, files: list[str]) -> list[tuple[str, dict, list[tuple]]] | None:
    """Saved --json runs of one shape as [(file, run, its rounds_of())], or None after naming on stderr a file that
    is not one (missing, unreadable, no rounds or rows, a bad calibration) or files of different shapes."""
    saved, shapes = [], set()
    for f in files:
        try:
            d = json.loads(Path(f).read_text())
            shapes.add((d["meta"]["nodes"], d["meta"]["local"]))
            if not (d.get("rounds") or "rows" in d):
                raise KeyError("rounds")
            saved.append((f, d, rounds_of(d, where=f)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"plan_check.py: {flag} {f}: not a saved plan_check run ({type(e).__name__}: {e})", file=sys.stderr)
            return None
    if len(shapes) != 1:
        print(
            f"plan_check.py: {flag} files of different shapes (nodes, ranks per node): {sorted(shapes)}",
            file=sys.stderr,
        )
        return None
    return saved


def _from_file(args) -> int:
    """Re-predict saved runs: their measured rows, their calibrations (or --calibration's), this checkout's model;
    several files (launches of one shape) pool their rounds."""
    from fp8comm.comm.calibration import Calibration

    saved = _load_runs("--from", args.from_file)
    if saved is None:
        return 2
    result = saved[0][1]
    result["rounds"] = [
        {**saved_round, "calibration": cal.to_dict(), "rows": rows, "from": f}
        for f, d, rounds in saved
        for saved_round, (cal, rows) in zip(d.get("rounds") or [{}], rounds)
    ]
    result.pop("calibration", None)
    result.pop("rows", None)
    result["meta"]["repredicted"] = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    result["meta"]["from"] = [f for f, _, _ in saved]
    cal = Calibration.load(args.calibration) if args.calibration else None
    if cal is not None:
        print(describe_calibration(cal, {}))
    _finish(result, args, calibration=cal)
    return 0


def _repeat_files(args) -> int:
    """--repeat A B: two saved launches of one shape, each re-predicted (its rounds pooled) with this checkout's
    model, compared row by row."""
    saved = _load_runs("--repeat", args.repeat)
    if saved is None:
        return 2
    checked = [compare_rounds(rounds, d["meta"]["nodes"], d["meta"]["local"], args.tolerance) for _, d, rounds in saved]
    for f, d, _ in saved:
        m = d["meta"]
        print(f"# {f}: {m['nodes']} node(s) x {m['local']} ranks, {m['link']}, commit {m['commit']}, {m['date']}")
    rows = repeat(checked[0], checked[1], args.tolerance)
    summ = repeat_summary(rows, args.tolerance)
    print(format_repeat(rows, summ), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"files": args.repeat, "rows": rows, "summary": summ}, indent=1) + "\n")
        print(f"# written: {args.json}")
    return 0


def parser() -> argparse.ArgumentParser:
    from fp8comm.tools.bench.comm import add_args

    p = argparse.ArgumentParser(prog="plan_check.py", description=__doc__.splitlines()[0])
    add_args(p)  # bench comm's options (--json: this check's file, not bench comm's rows)
    p.set_defaults(**DEFAULTS)
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="|predicted / measured - 1| counted as agreeing")
    p.add_argument("--calibrate-timeout", type=float, default=240.0, help="calibrate()'s timeout_s (compiles)")
    p.add_argument("--rounds", type=int, default=1, help="paired rounds (calibrate, then the table); rows: medians")
    p.add_argument(
        "--from",
        dest="from_file",
        nargs="+",
        default=[],
        help="re-predict saved --json runs, pooled (no ranks started)",
    )
    p.add_argument("--calibration", default="", help="with --from: predict from this calibration file instead")
    p.add_argument(
        "--repeat",
        nargs=2,
        default=[],
        metavar=("FIRST", "SECOND"),
        help="two saved --json launches of one shape against each other: does the measurement repeat (no ranks)",
    )
    p.add_argument(
        "--no-small-calls",
        dest="small_calls",
        action="store_false",
        help="calibrate without timing each option as a real call, small or large (as the engines' start-up does)",
    )
    from fp8comm.comm.smallcalls import LARGE_CALL_ELEMS

    p.add_argument(
        "--large-call-elems",
        type=int,
        default=LARGE_CALL_ELEMS,
        help="elements of each option's large real call in the calibration (0: none; as fp8comm calibrate's)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.repeat and args.from_file:
        print("plan_check.py: --repeat and --from are two different reports; give one", file=sys.stderr)
        return 2
    if args.repeat and args.calibration:
        said = "plan_check.py: --calibration goes with --from (--repeat predicts each launch from its own)"
        print(said, file=sys.stderr)
        return 2
    if args.repeat:
        return _repeat_files(args)
    if args.from_file:
        return _from_file(args)
    if args.calibration:
        print("plan_check.py: --calibration goes with --from", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"plan_check.py: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    from fp8comm.comm.smallcalls import LARGE_MARGIN_S, SMALL_ELEMS

    if args.large_call_elems and args.small_calls:
        if args.large_call_elems <= 2 * SMALL_ELEMS or args.calibrate_timeout < 2 * LARGE_MARGIN_S:
            print(
                f"plan_check.py: --large-call-elems must be 0 or > {2 * SMALL_ELEMS}, with --calibrate-timeout >= "
                f"{2 * LARGE_MARGIN_S:g}; got {args.large_call_elems}, {args.calibrate_timeout:g}",
                file=sys.stderr,
            )
            return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist

        from fp8comm.tools.bench.comm import _shutdown

        dist.init_process_group("gloo")
        try:
            return _rank(args)
        finally:
            _shutdown()
            dist.destroy_process_group()
    local = args.local_size if args.local_size is not None else 2
    if args.nproc < 2 or local < 1 or args.nproc % local:
        print(f"plan_check.py: need --nproc >= 2 divisible by --local-size, got {args.nproc}, {local}", file=sys.stderr)
        return 2
    return _spawn(args)


if __name__ == "__main__":
    raise SystemExit(main())
