"""`fp8comm bench comm` end to end on 2 gloo ranks at the smallest size: the table, the bf16 ring rows, the
wire-bytes ratios and the speed ratios naming their baseline."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist


def test_bench_comm_prints_ratios():
    cmd = [
        sys.executable,
        "-m",
        "fp8comm.tools.cli",
        "bench",
        "comm",
        "--nproc",
        "2",
        "--max-size",
        "64K",
        "--ops",
        "all_gather,reduce_scatter",
        "--iters",
        "1",
        "--target-s",
        "0",
        "--ef-steps",
        "2",
        "--hidden",
        "1024",
        "--timeout",
        "150",
        "--local-size",
        "1",  # two-level rows too: 2 nodes x 1 rank (under torchrun the default is LOCAL_WORLD_SIZE)
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    print(out)
    for op in ("all_gather", "reduce_scatter"):
        for variant in ("bf16", "fp32", "bf16-ring", "fp8", "fp8-e8m0", "mxfp4", "fp8-2l", "mxfp4-2l"):
            assert re.search(rf"^{op}\s+65536\s+32768\s+{variant}\s", out, re.M), (op, variant)
    # Two-level rows beside the flat ones: the same bits on one rank per node (nothing is summed inside a node).
    sq2 = {m[0]: m[1] for m in re.findall(r"^reduce_scatter\s+65536\s+32768\s+(\S+)\s.*\s([\d.]+)$", out, re.M)}
    assert sq2["fp8-2l"] == sq2["fp8"] and sq2["mxfp4-2l"] == sq2["mxfp4"], sq2
    # The ring sends the minimal bf16 count; torch's gloo reduce_scatter (a ring all-reduce) twice that. Both
    # reduce-scatters sum in bf16: the same error against the fp32 sum.
    wire = {
        m[0]: int(m[1])
        for m in re.findall(r"^reduce_scatter\s+65536\s+32768\s+(\S+)\s+\S+\s+\S+\s+\S+\s+(\d+)", out, re.M)
    }
    assert wire["bf16"] == 2 * wire["bf16-ring"] == 65536, wire
    sq = {m[0]: m[1] for m in re.findall(r"^reduce_scatter\s+65536\s+32768\s+(bf16\S*)\s.*\s([\d.]+)$", out, re.M)}
    assert sq["bf16"] == sq["bf16-ring"], sq
    # Every speed ratio names its baseline.
    assert re.search(r"^# speed reduce_scatter 65536: fp8 [\d.]+x vs torch gloo bf16, [\d.]+x vs bf16 ring", out, re.M)
    # 2 / (1 + 4/128) = 1.9394 and 4 / (1 + 4/128) = 3.8788 with fp32 scales; 1.9845 / 3.9690 with byte scales.
    ratios = {
        m[0]: tuple(map(float, m[1:]))
        for m in re.findall(
            r"^# (fp8(?:-e8m0)?): wire bytes vs bf16 ring ([\d.]+)x\.\.[\d.]+x, vs fp32 ring ([\d.]+)x", out, re.M
        )
    }
    assert ratios["fp8"][0] >= 1.939 and ratios["fp8"][1] >= 3.878, ratios
    assert ratios["fp8-e8m0"][0] >= 1.984 and ratios["fp8-e8m0"][1] >= 3.968, ratios
    # The FP8 rows carry a real error figure, and the error-feedback table shows its effect.
    sq = [float(m) for m in re.findall(r"^\w+\s+65536\s+32768\s+fp8\s.*\s([\d.]+)$", out, re.M)]
    assert sq and all(25 < v < 40 for v in sq), sq
    assert "metadata check, all_gather" in out and re.search(r"^error_feedback\s+[\d.]+\s+[\d.]+$", out, re.M)


def _load(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(fp8_ms: float, bf16_ms: float, op: str = "all_to_all") -> list[dict]:
    return [
        {"op": op, "size": 1 << 26, "variant": v, "median_ms": t, "times_ms": [t]}
        for v, t in (("bf16", bf16_ms), ("fp32", 2 * bf16_ms), ("fp8", fp8_ms))
    ]


def test_bench_check_flags_ratio_drops_beyond_the_tolerance():
    """launch/bench_check.py compares FP8/bf16 speed ratios of one run with the committed run's: a drop past the
    tolerance is flagged (the issue-22 regression: 1.86x -> 1.35x), a smaller one or a gain is not."""
    bc = _load("bench_check")
    committed = _rows(334, 620)  # 1.86x
    lines, flagged = bc.compare(_rows(442, 600), committed, 0.15)  # 1.36x: -27%
    assert len(flagged) == 1 and "all_to_all" in flagged[0] and "DROP" in "\n".join(lines), lines
    assert bc.compare(_rows(360, 620), committed, 0.15)[1] == []  # 1.72x: -7.2%, within the tolerance
    assert bc.compare(_rows(300, 620), committed, 0.15)[1] == []  # faster
    lines, flagged = bc.compare(_rows(300, 620, op="all_gather"), committed, 0.15)
    assert flagged == [] and any("new row" in ln for ln in lines) and any("not run now" in ln for ln in lines)
    # Launches of one checkout pool their per-call times; the median is over the pool.
    a, b = _rows(300, 600), _rows(400, 600)
    a[2]["times_ms"], b[2]["times_ms"] = [300.0, 310.0], [400.0]
    merged = {r["variant"]: r for r in bc.merge([a, b])}
    assert merged["fp8"]["times_ms"] == [300.0, 310.0, 400.0] and merged["fp8"]["median_ms"] == 310.0


def test_benchmarks_md_collective_tables_are_generated():
    """docs/benchmarks.md's bench comm table is what launch/bench_tables.py renders from docs/results/*.json."""
    bt = _load("bench_tables")
    assert bt.stale(bt.DOC.read_text()) == [], "run launch/bench_tables.py --write"


def test_bench_check_layouts_and_ring_baseline():
    """Results per layout: format 1 files are the 2x2 layout; a 2x4 run is stored beside it (format 2) and the 2x2
    rows stay readable where they were. The bf16 ring row is a baseline, never compared as an FP8 row."""
    bc = _load("bench_check")
    old = {"meta": {"format": 1, "date": "d"}, "runs": {"this": {"commit": "a", "rows": _rows(334, 620)}}}
    assert bc.layout_result(old, "2x2")["runs"] == old["runs"] and bc.layout_result(old, "2x4") is None
    r24 = {"meta": {"layout": "2x4", "date": "e"}, "runs": {"this": {"commit": "b", "rows": _rows(300, 600)}}}
    both = bc.with_layout(old, "2x4", r24)
    assert both["meta"]["format"] == 2 and both["runs"] == old["runs"]  # 2x2 still at the top level
    assert bc.layout_result(both, "2x4") == r24 and bc.layout_result(both, "2x2")["runs"] == old["runs"]
    r22 = {"meta": {"layout": "2x2", "date": "f"}, "runs": {"this": {"commit": "c", "rows": _rows(310, 620)}}}
    again = bc.with_layout(both, "2x2", r22)
    assert again["runs"] == r22["runs"] and bc.layout_result(again, "2x4") == r24
    rows = _rows(300, 600) + [{"op": "all_to_all", "size": 1 << 26, "variant": "bf16-ring", "median_ms": 450.0}]
    assert set(bc.ratios(rows)) == {("all_to_all", 1 << 26, "fp8")}
    assert bc.ratios(rows, "bf16-ring")[("all_to_all", 1 << 26, "fp8")] == 1.5
    lines, _ = bc.compare(rows, _rows(334, 620), 0.15)
    assert "vs torch gloo" in lines[1] and "vs bf16 ring" in lines[1] and lines[2].split()[-2] == "1.50x", lines
