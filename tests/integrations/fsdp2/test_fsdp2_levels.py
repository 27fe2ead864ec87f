"""FSDP2 runs two levels by default where a shard group spans nodes (fsdp2_checks_levels.py, one 4-rank launch
as 2 simulated nodes x 2 ranks), and refuses a bad `hierarchical` value naming the option."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fp8comm.integrations.fsdp2 as f2

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fsdp2_harness as H  # noqa: E402

NAMES = ["levels_default_two_level", "levels_off_is_flat", "levels_unsplittable_group_is_flat"]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_hierarchical_value_names_the_option(bad):
    with pytest.raises(f2.Fp8CommFsdp2Error, match=r"hierarchical must be True or False, got"):
        f2.parse(hierarchical=bad)


def test_default_is_on():
    assert f2.parse().hierarchical is True and f2.defaults()["hierarchical"] is True


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = H.launch(4, NAMES, tmp_path_factory.mktemp("fsdp2_levels"), env={"OMP_NUM_THREADS": "1"}, timeout=240)
    r["names"] = NAMES
    return r


@pytest.mark.dist
@pytest.mark.parametrize("name", NAMES)
def test_levels(run, name):
    msgs = [m for m in H.failures(run, NAMES) if f": {name}" in m or "exited" in m or "timed out" in m]
    rec = H.record(run, name)
    print(f"\n{name} ({run['seconds']} s launch): {rec and rec['info']}")
    assert not msgs, "\n".join(msgs)
