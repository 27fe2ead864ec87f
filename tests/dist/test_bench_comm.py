"""`fp8comm bench comm` end to end on 2 gloo ranks at the smallest size: the table and the wire-bytes ratios."""

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
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    print(out)
    for op in ("all_gather", "reduce_scatter"):
        for variant in ("bf16", "fp32", "fp8", "fp8-e8m0"):
            assert re.search(rf"^{op}\s+65536\s+32768\s+{variant}\s", out, re.M), (op, variant)
    # 2 / (1 + 4/128) = 1.9394 and 4 / (1 + 4/128) = 3.8788 with fp32 scales; 1.9845 / 3.9690 with byte scales.
    ratios = {
        m[0]: tuple(map(float, m[1:]))
        for m in re.findall(
            r"^# (fp8(?:-e8m0)?): wire bytes vs bf16 ([\d.]+)x\.\.[\d.]+x, vs fp32 ([\d.]+)x", out, re.M
        )
    }
    assert ratios["fp8"][0] >= 1.939 and ratios["fp8"][1] >= 3.878, ratios
    assert ratios["fp8-e8m0"][0] >= 1.984 and ratios["fp8-e8m0"][1] >= 3.968, ratios
    # The FP8 rows carry a real error figure, and the error-feedback table shows its effect.
    sq = [float(m) for m in re.findall(r"^\w+\s+65536\s+32768\s+fp8\s.*\s([\d.]+)$", out, re.M)]
    assert sq and all(25 < v < 40 for v in sq), sq
    assert "metadata check, all_gather" in out and re.search(r"^error_feedback\s+[\d.]+\s+[\d.]+$", out, re.M)
