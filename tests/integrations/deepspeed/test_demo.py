"""`fp8comm demo` end to end at a few steps: torchrun, both runs, the table, report.json and the PNGs."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (pip install deepspeed==0.19.8 torch==2.13.0)")

pytestmark = pytest.mark.dist


def test_demo_smoke(tmp_path, capsys):
    from fp8comm.tools import demo

    p = argparse.ArgumentParser()
    demo.add_args(p)
    args = p.parse_args(["--steps", "4", "--out", str(tmp_path), "--timeout", "300"])
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    (folder,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    for name in ("report.json", "loss_curves.png", "loss_diff.png", "log.txt", "progress.jsonl"):
        assert (folder / name).exists(), name
    report = json.loads((folder / "report.json").read_text())
    base, fp8 = report["baseline"], report["fp8"]
    assert len(base["losses"]) == len(fp8["losses"]) == 4
    # The baseline only measured DeepSpeed's own bytes; the FP8 run moved FP8 for weights and gradients.
    assert base["hook_stats"]["weights"]["fp8_calls"] == 0 and base["bytes_per_step"]["weights"] > 0
    for role in ("weights", "gradients"):
        assert fp8["hook_stats"][role]["fp8_calls"] > 0
        assert fp8["bytes_per_step"][role] < base["bytes_per_step"][role]
    assert "GEMMs FP8 blockwise" in fp8["summary"] and "MEASURE mode" in base["summary"]
    assert "bytes on the wire" in out and "final train loss" in out
