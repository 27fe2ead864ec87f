"""Megatron-Core runs two levels by default where a data-parallel group spans nodes (mcore_checks_levels.py) and
flat, with the reason, where it cannot be split (mcore_checks.gpt_tp2_dp2_hierarchical): 4 gloo ranks as
2 simulated nodes x 2 (LOCAL_WORLD_SIZE=2; GROUP_RANK set by the checks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent))

NAMES = ["gpt_dp4_levels_default_and_off", "gpt_dp4_levels_4bit_updates", "gpt_tp2_dp2_hierarchical"]


@pytest.mark.dist
def test_four_ranks_two_levels_by_default(tmp_path):
    import mcore_harness as H

    run = H.launch(4, NAMES, tmp_path, env={"LOCAL_WORLD_SIZE": "2"}, timeout=300)  # a hang guard
    for n in NAMES:
        print(f"[4 ranks, {run['seconds']} s] {n}: {json.dumps(H.info(run, n), default=str)[:3000]}")
    fails = H.failures(run, NAMES)
    assert not fails, "\n".join(fails)
