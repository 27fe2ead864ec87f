#!/usr/bin/env python3
"""The check to run before a change to the codec, comm or quant layers lands: `fp8comm bench comm` on the simulated
cluster (2 nodes x 2 ranks, 1 Gbit/s links; `--nproc-per-node 4`: 2 nodes x 4 ranks), compared with the committed
results of the same layout (docs/results/bench_comm.json).

  launch/bench_check.py                       run, print the table against the results file, exit 1 on a drop
  launch/bench_check.py --nproc-per-node 4    the 2x4 layout, against the file's 2x4 rows
  launch/bench_check.py --with /tmp/wt-old    also run another checkout's fp8comm (a `git worktree` of the base
                                              commit), interleaved with this one: an A/B in the same session
  launch/bench_check.py --update              write this run as the layout's results (after a reviewed change)

A row is flagged when its FP8 / bf16 speed ratio (torch gloo bf16 median time / FP8 median time, both from the same
run) fell by more than --tolerance (default 15%, about three times the run-to-run spread of medians on a quiet
machine) below the committed one. Ratios, not times: both sides of a ratio share the run's machine load. Beside it
the table prints the ratio against the bf16 ring (NCCL's ring algorithm on gloo point-to-point, the `bf16-ring`
rows of bench comm) where the run has one: torch's gloo reduce_scatter is a ring all-reduce, twice the bytes.

Results file: format 1 held one layout (2x2) as {"meta", "runs"}; format 2 keeps that layout there (so a format-1
reader still finds it) and every other layout under "layouts": {"2x4": {"meta", "runs"}, ...}. Not a timed test: it
needs root, network namespaces and minutes of quiet CPU; it prints the reason and exits 2 where the cluster cannot
run.
Every launch runs the same benchmark driver (this checkout's fp8comm/tools/bench/comm.py, run as a file) with
PYTHONPATH selecting the fp8comm under test.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results" / "bench_comm.json"
DRIVER = REPO / "fp8comm" / "tools" / "bench" / "comm.py"
FORMAT = 2  # 1: one layout (2x2) at the top level; 2: plus "layouts" {"NxG": {"meta", "runs"}}; both are read
PRIMARY = "2x2"  # the layout stored at the top level (format 1's only one)
BASELINES = ("bf16", "fp32", "bf16-ring")  # torch's rows and the ring: every other variant is fp8comm's


def _cluster_tool():
    spec = importlib.util.spec_from_file_location("fp8comm_cluster_tool", REPO / "launch" / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def commit_of(path: Path) -> str:
    """Short commit of the checkout at `path`, '+dirty' when its tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> str:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        kb = int(next(ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")))
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores {cpu}{mem}".strip()


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def bench_args(a) -> list[str]:
    return [
        "--ops",
        a.ops,
        "--min-size",
        a.size,
        "--max-size",
        a.size,
        "--scales",
        "fp32",
        "--fp4",
        "mxfp4",
        "--iters",
        str(a.iters),
        "--target-s",
        "1e9",  # exactly --iters timed calls per row
        "--ef-steps",
        "0",
        "--check-cost-size",
        "0",
        "--hidden",
        "4096",
    ]


def summarize(jsonl: Path) -> list[dict]:
    """The driver's JSON lines as result rows: op, size (bytes of the bf16 buffer), variant, median/all ms."""
    rows = []
    for line in jsonl.read_text().splitlines():
        r = json.loads(line)
        times = [t * 1e3 for t in r.get("times") or [r["time"]]]
        rows.append(
            {
                "op": r["op"],
                "size": r["size"],
                "variant": r["variant"],
                "world": r["world"],
                "median_ms": round(statistics.median(times), 2),
                "times_ms": [round(t, 2) for t in times],
                "wire_bytes": r["wire"],
                "sqnr_db": None if r["sqnr"] == float("inf") else round(r["sqnr"], 2),
            }
        )
        for k_in, k_out in (("xnode", "xnode_bytes"), ("link", "link_bytes"), ("link_flag", "link_flag")):
            if r.get(k_in) not in (None, ""):
                rows[-1][k_out] = r[k_in]
    return rows


def layout_key(nodes: int, nproc: int) -> str:
    return f"{nodes}x{nproc}"


def layout_of(res: dict) -> str:
    """The layout of a results file's top level: format 1 files (and format 2's top level) are 2x2 unless
    meta says otherwise."""
    return res.get("meta", {}).get("layout", PRIMARY)


def layout_result(res: dict | None, layout: str) -> dict | None:
    """{"meta", "runs"} of `layout` in a results file of format 1 or 2, or None."""
    if not res:
        return None
    if layout_of(res) == layout and "runs" in res:
        return {"meta": res["meta"], "runs": res["runs"]}
    return res.get("layouts", {}).get(layout)


def with_layout(res: dict | None, layout: str, result: dict) -> dict:
    """The results file with `layout`'s {"meta", "runs"} replaced by `result` (the other layouts kept)."""
    res = dict(res or {})
    layouts = dict(res.get("layouts", {}))
    if layout == PRIMARY or not res.get("runs"):
        if res.get("runs") and layout_of(res) != layout:
            layouts[layout_of(res)] = {"meta": res["meta"], "runs": res["runs"]}
        res["meta"], res["runs"] = result["meta"], result["runs"]
    else:
        layouts[layout] = result
    res["meta"] = dict(res["meta"], format=FORMAT)
    if layouts:
        res["layouts"] = layouts
    return res


def merge(rounds: list[list[dict]]) -> list[dict]:
    """Rows of several launches of one fp8comm: all their per-call times pooled, the median over the pool."""
    out: dict[tuple, dict] = {}
    for rows in rounds:
        for r in rows:
            k = (r["op"], r["size"], r["variant"])
            if k not in out:
                out[k] = dict(r, times_ms=list(r["times_ms"]))
            else:
                out[k]["times_ms"] += r["times_ms"]
    for r in out.values():
        r["median_ms"] = round(statistics.median(r["times_ms"]), 2)
    return list(out.values())


def ratios(rows: list[dict], baseline: str = "bf16") -> dict[tuple, float]:
    """(op, size, variant) -> `baseline`'s median / this FP8 row's median (> 1: FP8 faster); baseline "bf16" is
    torch's gloo call, "bf16-ring" the ring."""
    base = {(r["op"], r["size"]): r["median_ms"] for r in rows if r["variant"] == baseline}
    return {
        (r["op"], r["size"], r["variant"]): base[(r["op"], r["size"])] / r["median_ms"]
        for r in rows
        if r["variant"] not in BASELINES and (r["op"], r["size"]) in base and r["median_ms"] > 0
    }


def compare(current: list[dict], committed: list[dict], tol: float) -> tuple[list[str], list[str]]:
    """(table lines, flagged rows): this run's FP8/bf16 ratios against the committed run's."""
    now, then = ratios(current), ratios(committed)
    ring_now = ratios(current, "bf16-ring")
    med = {(r["op"], r["size"], r["variant"]): r["median_ms"] for r in current}
    lines = [
        "# ratio = torch gloo bf16 ms / FP8 ms (the committed comparison); vs ring = bf16 ring ms / FP8 ms",
        f"{'op':<16}{'size':>10}  {'variant':<10}{'FP8 ms':>9}{'bf16 ms':>9}{'vs torch gloo':>14}{'committed':>11}"
        f"{'change':>9}{'vs bf16 ring':>13}  verdict",
    ]
    flagged = []
    for k in sorted(now):
        op, size, var = k
        old = then.get(k)
        change = (now[k] / old - 1) if old else None
        bad = change is not None and change < -tol
        verdict = "DROP" if bad else ("ok" if old else "new row")
        ring = f"{ring_now[k]:.2f}x" if k in ring_now else "-"
        lines.append(
            f"{op:<16}{size:>10}  {var:<10}{med[k]:>9.1f}{med[(op, size, 'bf16')]:>9.1f}{now[k]:>13.2f}x"
            + (f"{old:>10.2f}x{change * 100:>+8.1f}%" if old else f"{'-':>11}{'-':>9}")
            + f"{ring:>13}  {verdict}"
        )
        if bad:
            flagged.append(f"{op} {size} {var}: FP8/bf16 {now[k]:.2f}x vs committed {old:.2f}x ({change * 100:+.1f}%)")
    for k in sorted(set(then) - set(now)):
        lines.append(f"{k[0]:<16}{k[1]:>10}  {k[2]:<10}  (in the results file, not run now)")
    return lines, flagged


def _without_note(argv: list[str]) -> list[str]:
    """The command line as recorded: --note's text is stored on its own."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--note":
            skip = True
        elif not x.startswith("--note="):
            out.append(x)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="all_gather,reduce_scatter,all_to_all", help="bench comm --ops")
    p.add_argument("--size", default="64M", help="bytes of the bf16 buffer (all_to_all: 32 Mi elements per rank)")
    p.add_argument("--iters", type=int, default=7, help="timed calls per row and launch")
    p.add_argument("--rounds", type=int, default=1, help="launches per fp8comm (interleaved with --with)")
    p.add_argument("--with", dest="other", default="", help="another checkout (its root) to run interleaved")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (layouts: 2x2, 2x4)")
    p.add_argument("--tolerance", type=float, default=0.15, help="flag FP8/bf16 ratio drops larger than this")
    p.add_argument("--results", default=str(RESULTS), help="the committed results file")
    p.add_argument("--update", action="store_true", help="write this run as the results file")
    p.add_argument("--note", default="", help="stored with --update (e.g. 'machine shared with other work')")
    p.add_argument("--name", default="bchk", help="simulated cluster name")
    p.add_argument("--out-dir", default="/tmp/fp8comm-bench-check", help="raw JSON lines and result.json")
    p.add_argument("--timeout", type=float, default=1500, help="per launch (s)")
    a = p.parse_args(argv)

    tool = _cluster_tool()
    reason = tool.unsupported_reason()
    if reason:
        print(f"bench_check: the simulated cluster cannot run here: {reason}")
        return 2
    impls = [("this", REPO)] + ([("with", Path(a.other).resolve())] if a.other else [])
    for _label, path in impls:
        if not (path / "fp8comm" / "__init__.py").exists():
            print(f"bench_check: {path} holds no fp8comm package")
            return 2
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    layout = layout_key(a.nodes, a.nproc_per_node)
    meta = {
        "format": FORMAT,
        "date": stamp.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_at_start": load(),
        "layout": layout,
        "cluster": f"{a.nodes} nodes x {a.nproc_per_node} ranks, {a.rate} links (launch/cluster.py, tc tbf), gloo, "
        "1 thread per rank",
        "command": "launch/bench_check.py " + " ".join(_without_note(argv if argv is not None else sys.argv[1:])),
        "bench_args": bench_args(a),
        "note": a.note,
    }
    runs: dict[str, dict] = {
        label: {"commit": commit_of(path), "path": str(path), "launches": []} for label, path in impls
    }
    c = tool.Cluster(a.name)
    c.down(quiet=True)
    rc = 0
    try:
        c.up(a.nodes, a.rate)
        for rnd in range(a.rounds):
            order = impls if rnd % 2 == 0 else impls[::-1]  # alternate who goes first
            for label, path in order:
                jl = out / f"{stamp:%Y%m%d-%H%M%S}-{layout}-{label}-{rnd}.jsonl"
                print(f"# bench_check: round {rnd + 1}/{a.rounds}, {label} = {runs[label]['commit']} ({path})")
                before = load()
                r = c.run(
                    [str(DRIVER), *bench_args(a), "--json", str(jl)],
                    nproc=a.nproc_per_node,
                    timeout=a.timeout,
                    env={"PYTHONPATH": str(path)},
                    echo=True,
                )
                if r or not jl.exists():
                    print(f"bench_check: launch failed (exit {r})")
                    rc = rc or 3
                    continue
                runs[label]["launches"].append({"load_before": before, "load_after": load(), "rows": summarize(jl)})
    finally:
        c.down(quiet=True)
    for run in runs.values():
        run["rows"] = merge([x["rows"] for x in run["launches"]])
    meta["load_at_end"] = load()
    result = {"meta": meta, "runs": runs}
    (out / f"result-{layout}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"# bench_check: {out / f'result-{layout}.json'}")

    committed_path = Path(a.results)
    whole = json.loads(committed_path.read_text()) if committed_path.exists() else None
    committed = layout_result(whole, layout)
    if committed is None:
        print(f"# no {layout} results in {committed_path}: nothing to compare with")
    cur = runs["this"]["rows"]
    ref_rows = committed["runs"]["this"]["rows"] if committed else []
    ref_what = (
        f"{committed_path.name} {layout} ({committed['runs']['this']['commit']}, {committed['meta']['date']})"
        if committed
        else "-"
    )
    print(
        f"# {layout}: this checkout {runs['this']['commit']} vs {ref_what}; tolerance {a.tolerance:.0%} on "
        "FP8 / torch gloo bf16 ratios"
    )
    lines, flagged = compare(cur, ref_rows, a.tolerance)
    print("\n".join(lines))
    if a.other:
        o = runs["with"]
        print(f"# A/B in this session: {o['commit']} ({o['path']}) as the reference")
        print("\n".join(compare(cur, o["rows"], a.tolerance)[0]))
    links = [
        f"{r['op']} {r['variant']}: model {r['xnode_bytes']} / link {r['link_bytes']}{r.get('link_flag', '')}"
        for r in cur
        if "xnode_bytes" in r and "link_bytes" in r
    ]
    if links:
        print(
            "# bytes node 0 sent to the other node(s) per call, model (stats / algorithm) / link counter "
            "(! = more than 10% apart):\n#   " + "\n#   ".join(links)
        )
    if a.update:
        committed_path.parent.mkdir(parents=True, exist_ok=True)
        for run in runs.values():
            run.pop("path", None)
        committed_path.write_text(json.dumps(with_layout(whole, layout, result), indent=1) + "\n")
        print(f"# wrote {layout} into {committed_path}")
    if flagged:
        print("bench_check: FP8/bf16 ratio dropped by more than the tolerance:\n  " + "\n  ".join(flagged))
        return 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
