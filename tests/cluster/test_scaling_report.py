"""fp8comm.tools.bench.scaling's report: speedups, link bytes and the codec table from result files (no cluster)."""

from __future__ import annotations

import json

from fp8comm.tools.bench import scaling


def _row(key, ms, link=None, mib=32.0):
    return {
        "key": key,
        "mib": mib,
        "elements": int(mib * 2**19),
        "median_s": ms / 1e3,
        "times_s": [ms / 1e3] * 3,
        "link_tx_bytes": link,
    }


def test_report_ratios_and_tables(tmp_path):
    meta = {
        "nodes": 2,
        "ranks_per_node": 2,
        "world": 4,
        "rate": "1gbit",
        "reps": 3,
        "warmup": 1,
        "threads": 1,
        "machine": "test",
        "date": "2026-01-01 00:00 UTC",
        "torch": "x",
        "load": "0.1 0.1 0.1",
    }
    rows = [
        _row("ag.fp8", 500, 52e6),
        _row("ag.bf16", 1000, 101e6),
        _row("rs.fp8_f32", 250, 17e6),
        _row("rs.fp32", 1000, 101e6),
        _row("codec.ag", 123),
        _row("ag.fp8", 10, 1e6, mib=1.0),
        _row("ag.bf16", 20, 2e6, mib=1.0),
    ]
    (tmp_path / "coll_n2.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    text = scaling.report(tmp_path)
    assert "| 2 | all_gather | 32.0 | ag.fp8 | 500 | ag.bf16 | 1000 | **2.00x** | 52.0 / 101.0 |" in text
    assert "| 2 | reduce_scatter | 32.0 | rs.fp8_f32 | 250 | rs.fp32 | 1000 | **4.00x** |" in text
    assert "| 2 | 32 | 123 | - | - |" in text  # codec table
    assert "| 2 | all_gather | 1.0 |" not in text  # sizes below 16 MiB stay out of the speedup table
    assert "1gbit" in text and "0.1 0.1 0.1" in text
