"""DeepSpeed runs two levels by default where a group spans nodes: the "levels" scenario (ds_checks_levels.py) on
4 ranks as 2 simulated nodes x 2, and bad values of fp8_comm.hierarchical name the key."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (pip install deepspeed==0.19.8 torch==2.13.0)")

from ds_harness import failures, launch, summary

from fp8comm.errors import Fp8CommConfigError
from fp8comm.integrations.deepspeed.config import parse


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_hierarchical_value_names_the_key(bad):
    with pytest.raises(Fp8CommConfigError, match=r"fp8_comm\.hierarchical must be true/false, got"):
        parse({"fp8_comm": {"hierarchical": bad}})


def test_hierarchical_defaults_to_on():
    assert parse({"fp8_comm": {}}).hierarchical is True
    assert parse({"fp8_comm": {"hierarchical": False}}).hierarchical is False


@pytest.mark.dist
def test_levels_scenario(tmp_path):
    run = launch("levels", tmp_path / "levels", ranks=4, timeout=400)  # a hang guard
    print(f"\nlevels:\n{summary(run)}")
    problems = failures(run)
    assert not problems, "\n".join(problems)
    assert run["results"][0], "no results written"
