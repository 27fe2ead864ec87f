#!/usr/bin/env python3
"""Render docs/benchmarks.md tables from committed result files, so the tables are generated, not hand-written.

  launch/bench_tables.py            print every table
  launch/bench_tables.py --write    replace each table's block in docs/benchmarks.md (between its markers)
  launch/bench_tables.py --check    exit 1 when a block in docs/benchmarks.md differs from its rendering

A block is the text between `<!-- bench_tables:NAME -->` and `<!-- /bench_tables:NAME -->`; TABLES maps NAME to
(result file, renderer). docs/results/bench_comm.json comes from launch/bench_check.py --update, and
bench_comm_200mbit.json from the same tool with --results (docs/benchmarks.md says the command).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"


def _mib(nbytes: int) -> str:
    v = nbytes / 2**20
    return f"{v:g}" if v >= 1 else f"{nbytes / 2**10:g} KiB"


def _label(run: dict, key: str) -> str:
    return f"{run['commit']}" + (" (this change)" if key == "this" else " (base)")


BASELINES = ("bf16", "fp32", "bf16-ring")  # torch's rows and the ring (NCCL's algorithm on gloo point-to-point)


def _ours(rows) -> list[str]:
    """fp8comm's variants in a row set (every variant but torch's bf16 and fp32 and the bf16 ring), FP8 first."""
    return sorted((v for v in rows if v not in BASELINES), key=lambda v: (not v.startswith("fp8"), v))


def render_bench_comm(res: dict) -> str:
    """`fp8comm bench comm` on the simulated cluster: per op, every run in the file (this change, the A/B base); a
    format-2 file's other layouts (2x4, ...) follow, each with its own table."""
    text = _render_layout(res)
    for layout, sub in sorted(res.get("layouts", {}).items()):
        text += f"\n\nLayout {layout}:\n\n" + _render_layout(sub)
    return text


def _render_layout(res: dict) -> str:
    m = res["meta"]
    runs = res["runs"]
    # Runs with bf16 ring rows name both baselines; older files render exactly as they always did.
    has_ring = any(r["variant"] == "bf16-ring" for run in runs.values() for r in run["rows"])
    lines = [
        f"Measured {m['date']} on {m['machine']}; {m['cluster']}; load average {m['load_at_start']} at start, "
        f"{m.get('load_at_end', '?')} at the end. Command: `{m['command']}` (bench comm arguments: "
        f"`{' '.join(m['bench_args'])}`)." + (f" Note: {m['note']}." if m.get("note") else ""),
        "",
    ]
    if has_ring:
        lines += [
            "| op | MiB (bf16 buffer) | fp8comm | wire | ms (median) | ms min-max | torch gloo bf16 ms | bf16 ring ms "
            "| fp32 ms | speed vs torch gloo bf16 | speed vs bf16 ring | calls | wire B/rank / bf16 ring |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| op | MiB (bf16 buffer) | fp8comm | wire | ms (median) | ms min-max | bf16 ms | fp32 ms "
            "| speed vs bf16 | calls | wire B/rank / bf16 |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    keys = list(runs)
    ops = sorted({(r["op"], r["size"]) for run in runs.values() for r in run["rows"]}, key=lambda k: (k[0], k[1]))
    for op, size in ops:
        for key in keys:
            rows = {r["variant"]: r for r in runs[key]["rows"] if r["op"] == op and r["size"] == size}
            b16, f32 = rows.get("bf16"), rows.get("fp32")
            if not b16:
                continue
            ring = rows.get("bf16-ring")
            for var in _ours(rows):
                v = rows[var]
                ratio = b16["median_ms"] / v["median_ms"]
                fp32 = f"{f32['median_ms']:.0f}" if f32 else "-"
                if has_ring:
                    rms = f"{ring['median_ms']:.0f}" if ring else "-"
                    rr = f"**{ring['median_ms'] / v['median_ms']:.2f}x**" if ring else "-"
                    # the bytes a ring/direct bf16 call sends (torch's gloo reduce_scatter sends twice that)
                    wb = ring["wire_bytes"] if ring else b16["wire_bytes"]
                    lines.append(
                        f"| {op} | {_mib(size)} | {_label(runs[key], key)} | {var} | {v['median_ms']:.0f} | "
                        f"{min(v['times_ms']):.0f}-{max(v['times_ms']):.0f} | {b16['median_ms']:.0f} | {rms} | "
                        f"{fp32} | **{ratio:.2f}x** | {rr} | {len(v['times_ms'])} | {v['wire_bytes']} / {wb} |"
                    )
                    continue
                lines.append(
                    f"| {op} | {_mib(size)} | {_label(runs[key], key)} | {var} | {v['median_ms']:.0f} | "
                    f"{min(v['times_ms']):.0f}-{max(v['times_ms']):.0f} | {b16['median_ms']:.0f} | {fp32} | "
                    f"**{ratio:.2f}x** | {len(v['times_ms'])} | {v['wire_bytes']} / {b16['wire_bytes']} |"
                )
    per_launch = []
    for key in keys:
        for i, launch in enumerate(runs[key].get("launches", [])):
            rows = {(r["op"], r["variant"]): r["median_ms"] for r in launch["rows"]}

            def part(op: str, var: str, rows=rows) -> str:
                txt = f"{op} {var} {rows[(op, 'bf16')] / rows[(op, var)]:.2f}x"
                if not has_ring:
                    return txt
                ring = rows.get((op, "bf16-ring"))
                return txt + " vs torch gloo" + (f", {ring / rows[(op, var)]:.2f}x vs bf16 ring" if ring else "")

            parts = [
                part(op, var)
                for op, _ in ops
                for var in _ours({v: 1 for o, v in rows if o == op})
                if (op, "bf16") in rows
            ]
            when = f"load {launch['load_before']} before, " if "load_before" in launch else "load "
            load = f"{when}{launch['load_after']} after"
            per_launch.append(f"{runs[key]['commit']} launch {i + 1} ({load}): {', '.join(parts)}")
    if per_launch:
        what = "FP8 speed vs torch gloo bf16 and vs bf16 ring" if has_ring else "FP8/bf16 speed"
        lines += ["", f"{what} per launch (launches interleaved): " + "; ".join(per_launch) + "."]
    return "\n".join(lines)


# NAME -> (result file, renderer)
TABLES: dict[str, tuple[Path, Callable[[dict], str]]] = {
    "bench_comm": (REPO / "docs" / "results" / "bench_comm.json", render_bench_comm),
    # the topology targets: 2 nodes x 4 ranks, 200 Mbit/s, 16 MiB per rank (launch/bench_check.py --results ...)
    "bench_comm_200mbit": (REPO / "docs" / "results" / "bench_comm_200mbit.json", render_bench_comm),
}


def render(name: str) -> str:
    path, fn = TABLES[name]
    return fn(json.loads(path.read_text()))


def _block(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- bench_tables:{re.escape(name)} -->\n)(.*?)(<!-- /bench_tables:{re.escape(name)} -->)", re.S
    )


def stale(doc: str) -> list[str]:
    """Names whose block in `doc` is missing or differs from its rendering."""
    out = []
    for name in TABLES:
        m = _block(name).search(doc)
        if m is None or m.group(2) != render(name) + "\n":
            out.append(name)
    return out


def write(doc: str) -> str:
    for name in TABLES:
        pat = _block(name)
        if not pat.search(doc):
            raise SystemExit(f"docs/benchmarks.md has no block for {name!r} (add the two marker lines)")
        doc = pat.sub(lambda m, name=name: m.group(1) + render(name) + "\n" + m.group(3), doc)
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    doc = DOC.read_text()
    if a.write:
        DOC.write_text(write(doc))
        return 0
    if a.check:
        bad = stale(doc)
        if bad:
            print(f"docs/benchmarks.md is out of date for {', '.join(bad)}: run launch/bench_tables.py --write")
            return 1
        return 0
    for name in TABLES:
        print(f"## {name}\n{render(name)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
