"""The GPU scripts' machine-readable rows (docs/results/gpu.json): names, targets and the merge by name, on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
sys.path.insert(0, str(LAUNCH))

import device_check_gemm  # noqa: E402
import gpu_results  # noqa: E402


def test_timings_become_named_rows_and_merge_by_name(tmp_path):
    timings = [
        {"check": "timing", "case": "fp8 blockwise scaled_mm 8192^3", "status": "ok", "speedup": 1.71},
        {"check": "timing", "case": "fp8 blockwise triton 8192^3", "status": "ok", "speedup": 0.83},
        {"check": "timing", "case": "Fp8Linear rowwise fwd+bwd 16384x8192->8192", "status": "ok", "speedup": 0.96},
        {"check": "timing", "case": "fp8 blockwise scaled_mm 4096^3", "status": "ok", "speedup": 9.0},  # not named
    ]
    rows = device_check_gemm.result_rows(timings, "test device")
    got = {r["name"]: (r["value"], r["target"]) for r in rows}
    assert got == {"gemm_blockwise_vs_bf16_8192": (1.71, 1.5), "linear_rowwise_vs_bf16": (0.96, 1.3)}
    assert all(set(r) == {"name", "value", "target", "unit", "date", "commit", "device"} for r in rows)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps([{"name": "linear_rowwise_vs_bf16", "value": 0.5}, {"name": "keep", "value": 1}]))
    gpu_results.merge(rows, path)
    merged = {r["name"]: r["value"] for r in json.loads(path.read_text())}
    assert merged == {"keep": 1, "gemm_blockwise_vs_bf16_8192": 1.71, "linear_rowwise_vs_bf16": 0.96}


def test_training_results_become_rows_per_recipe():
    results = [
        {"recipe": "bf16", "seed": 0, "val_loss": 2.00, "seconds": 10.0},
        {"recipe": "bf16", "seed": 1, "val_loss": 2.02, "seconds": 12.0},
        {"recipe": "blockwise", "seed": 0, "val_loss": 2.03, "seconds": 8.0},
        {"recipe": "blockwise", "seed": 1, "val_loss": 2.03, "seconds": 14.0},
    ]
    rows = {r["name"]: r for r in device_check_gemm.train_rows(results, "test device")}
    assert set(rows) == {"train_blockwise_val_loss_rel", "train_blockwise_tokens_per_s_vs_bf16"}
    assert rows["train_blockwise_val_loss_rel"]["value"] == round((2.03 - 2.01) / 2.01, 5)  # signed: worse > 0
    assert rows["train_blockwise_tokens_per_s_vs_bf16"]["value"] == 1.0  # 11 s per run either way
    assert "2 seeds" in rows["train_blockwise_val_loss_rel"]["unit"]
    assert device_check_gemm.train_rows(results[2:], "test device") == []  # no baseline, no ratio
