"""DeepSpeed's "fp8_comm": {"planner": ...} (issue 30 items 3 and 6): the key's values and the errors that name both
sides of a conflict (no launch), and the "planner" scenario (ds_checks_planner.py) on 4 ranks as 2 simulated nodes x 2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (pip install deepspeed==0.19.8 torch==2.13.0)")

from ds_harness import failures, launch, summary

from fp8comm.comm.planned import PlannerSettings
from fp8comm.errors import Fp8CommConfigError
from fp8comm.integrations.deepspeed.config import parse


def test_planner_values():
    assert parse({"fp8_comm": {}}).planner is None
    assert parse({"fp8_comm": {"planner": False}}).planner is None
    on = parse({"fp8_comm": {"planner": True}})
    assert on.planner == PlannerSettings() and on.gradients.fmt == "e4m3" and on.weights.enabled
    four = parse({"fp8_comm": {"planner": {"allow_4bit": True, "calibration": "c.json"}}})
    assert four.planner == PlannerSettings(allow_4bit=True, calibration="c.json")
    g = four.gradients
    assert (g.fmt, g.error_feedback, g.allow_unpartitioned_residuals) == ("mxfp4", True, True)
    assert (
        parse(
            {"fp8_comm": {"planner": {"allow_4bit": True}, "gradients": {"residual_dtype": "fp8"}}}
        ).gradients.residual_dtype
        == "fp8"
    )


@pytest.mark.parametrize(
    "section, match",
    [
        ({"planner": "auto"}, r"fp8_comm.planner = 'auto' is not valid; valid: true, false, or an object"),
        ({"planner": {"allow4bit": True}}, r"unknown key\(s\) \['allow4bit'\] in fp8_comm.planner"),
        ({"planner": {"timeout_s": -1}}, r"fp8_comm.planner.timeout_s must be a number > 0"),
        ({"planner": True, "gradients": {"fmt": "mxfp4"}}, r"fp8_comm.planner and fp8_comm.gradients.fmt both choose"),
        ({"planner": True, "weights": {"update_fmt": "mxfp4"}}, r"fp8_comm.planner and fp8_comm.weights.update_fmt"),
        ({"planner": True, "gradients": False}, r"fp8_comm.planner with fp8_comm.gradients off"),
        ({"planner": True, "weights": {"enabled": False}}, r"fp8_comm.planner with fp8_comm.weights off"),
        ({"planner": True, "mode": "measure"}, r"fp8_comm.planner with mode 'measure'"),
        (
            {"planner": {"allow_4bit": True}, "gradients": {"error_feedback": False}},
            r"fp8_comm.planner.allow_4bit with fp8_comm.gradients.error_feedback false",
        ),
        ({"planer": True}, r"unknown key 'fp8_comm.planer' \(did you mean 'planner'\?\)"),
    ],
)
def test_planner_errors_name_the_keys(section, match):
    with pytest.raises(Fp8CommConfigError, match=match):
        parse({"fp8_comm": section})


@pytest.mark.dist
def test_planner_scenario(tmp_path):
    run = launch("planner", tmp_path / "planner", ranks=4, timeout=500)  # a hang guard
    print(f"\nplanner:\n{summary(run)}")
    problems = failures(run)
    assert not problems, "\n".join(problems)
    assert run["results"][0], "no results written"
