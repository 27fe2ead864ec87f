"""fp8comm inside torchtitan (0.3.0): its llama3 debugmodel and its own FSDP2 code (parallelize_llama ->
apply_fsdp_to_decoder), 2 gloo ranks, through examples/torchtitan_fsdp2.py. One launch (the FSDP2 harness)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is the `titan` extra: pip install -e '.[titan]'")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fsdp2"))
import fsdp2_harness as H  # noqa: E402

NAMES = ["titan_llama3_vs_plain"]


@pytest.mark.dist
@pytest.mark.slow
def test_torchtitan_llama3_with_fp8comm(tmp_path):
    env = {"OMP_NUM_THREADS": "1", H.EXTRA: f"{HERE}:titan_checks"}
    run = H.launch(2, NAMES, tmp_path, env=env, timeout=420)
    rec = H.record(run, NAMES[0])
    print(f"\n{NAMES[0]} ({run['seconds']} s launch): {json.dumps(rec and rec['info'], default=str)}")
    msgs = H.failures(run, NAMES)
    assert not msgs, "\n".join(msgs)
