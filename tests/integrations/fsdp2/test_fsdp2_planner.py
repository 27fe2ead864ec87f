"""enable(model, planner=...): the option's errors and base configs (one process), and one 4-rank launch (2 simulated
nodes x 2 ranks) of fsdp2_checks_planner.py: a slow link quantizes (FP8 weights, 4-bit gradients, two levels), a
fast one runs FSDP2's own collectives bit-identical to FSDP2 without fp8comm, bad calibration files are refused
before any bytes move, and a calibration measured at enable() decides alike on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import fp8comm.integrations.fsdp2 as f2
from fp8comm.comm import WireConfig, config_for
from fp8comm.comm.planned import PlannerSettings

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fsdp2_harness as H  # noqa: E402

NAMES = [
    "planner_bad_input_refused_before_bytes",
    "planner_slow_link_quantizes",
    "planner_fast_link_is_fsdp2_own",
    "planner_measured_at_enable",
]


# ------------------------------------------------------------------------------------------- one process
def test_planner_values():
    assert f2.parse().planner is None and f2.defaults()["planner"] is None
    assert f2.parse(planner=False).planner is None
    cfg = f2.parse(planner=True)
    assert cfg.planner == PlannerSettings()
    assert cfg.weights.wire(None) == WireConfig(fmt="e4m3", scaling="fp32", block_size=128)
    assert cfg.gradients.wire(None) == WireConfig(fmt="e4m3") and not cfg.gradients.error_feedback
    cfg = f2.parse(planner={"calibration": "c.json", "timeout_s": 5}, hierarchical=False, weights=False)
    assert cfg.planner == PlannerSettings(False, "c.json", 5.0) and not cfg.weights.enabled and not cfg.hierarchical


def test_users_error_feedback_survives_the_planner():
    """planner=True with gradients' own error feedback: kept (it rides on the FP8 the plan chooses), never dropped."""
    cfg = f2.parse(planner=True, gradients={"error_feedback": True, "allow_unpartitioned_residuals": True})
    assert cfg.gradients.wire(None) == WireConfig(fmt="e4m3", error_feedback=True)


def test_allow_4bit_is_the_validated_recipe():
    cfg = f2.parse(
        planner={"allow_4bit": True},
        gradients={"allow_unpartitioned_residuals": True, "residual_dtype": "bf16"},
    )
    base = cfg.gradients.wire(None)
    assert base == WireConfig(fmt="mxfp4", rounding="nearest", error_feedback=True, residual_dtype="bfloat16")
    assert cfg.gradients.allow_unpartitioned_residuals and cfg.weights.fmt == "e4m3"
    fp8 = config_for(base, "fp8")  # the 4-bit base demoted (the planner's FP8 classes then drop error feedback)
    assert (fp8.fmt, fp8.block_size, fp8.scaling, fp8.error_feedback) == ("e4m3", 128, "fp32", True)
    assert "mxfp4 + error feedback (bfloat16 residuals)" in cfg.planned_wires["gradients"]
    assert cfg.planned_wires["weights"] == "planned per size class: FSDP2's own or e4m3 1x128 fp32 scales"


@pytest.mark.parametrize(
    "options, match",
    [
        ({"planner": "yes"}, r"planner = 'yes' is not valid; valid: true, false, or an object with keys allow_4bit"),
        ({"planner": {"allow4bit": True}}, r"unknown key\(s\) \['allow4bit'\] in planner"),
        ({"planner": {"allow_4bit": "yes"}}, r"planner.allow_4bit must be true or false"),
        ({"planner": {"calibration": 3}}, r"planner.calibration must be a file path"),
        ({"planner": {"timeout_s": -1}}, r"planner.timeout_s must be a number > 0"),
        (
            {"planner": True, "gradients": {"fmt": "mxfp4"}},
            r"planner=True and gradients=\{'fmt': 'mxfp4'\} both set the gradient reduce-scatter's format.*'fmt'",
        ),
        (
            {"planner": {"allow_4bit": True}, "gradients": {"error_feedback": False}},
            r"validated recipe is mxfp4 WITH error feedback, but gradients=\{'error_feedback': False\}",
        ),
        ({"planner": True, "weights": {"fmt": "e5m2"}}, r"planner=True and weights=.* weight all-gather's format"),
        ({"planner": True, "weights": f2.WeightWire()}, r"both set the weight all-gather's format.*'WeightWire'"),
        ({"planner": {"allow_4bit": True}, "gradients": False}, r"allows 4-bit gradients but gradients=False"),
        ({"planner": True, "gradients": {"rouding": "x"}}, r"did you mean 'rounding'"),  # typos first, as without
    ],
)
def test_bad_planner_options_name_the_problem(options, match):
    with pytest.raises(f2.Fp8CommFsdp2Error, match=match):
        f2.parse(**options)


def test_timed_work_closes_its_timer_once():
    events = []

    class Timer:
        def __exit__(self, *exc):
            events.append("timed")

    class Inner:
        def wait(self):
            events.append("inner")

    w = f2.Fp8Work(Inner(), lambda: events.append("after"), Timer())
    w.wait()
    w.wait()
    assert events == ["inner", "after", "timed"]
    events.clear()
    assert f2.hooks._own(None, False, Timer()) is None and events == ["timed"]  # FSDP2's own, synchronous


# ------------------------------------------------------------------------------------------------ the launch
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    env = {"OMP_NUM_THREADS": "1", H.EXTRA: f"{HERE}:fsdp2_checks_planner"}
    r = H.launch(4, NAMES, tmp_path_factory.mktemp("fsdp2_planner"), env=env, timeout=300)
    r["names"] = NAMES
    return r


@pytest.mark.dist
@pytest.mark.parametrize("name", NAMES)
def test_planner(run, name):
    msgs = [m for m in H.failures(run, NAMES) if f": {name}" in m or "exited" in m or "timed out" in m]
    rec = H.record(run, name)
    print(f"\n{name} ({run['seconds']} s launch, {rec and rec['seconds']} s): {json.dumps(rec and rec['info'])}")
    assert not msgs, "\n".join(msgs)


def test_fp16_plans_with_bf16_bytes():
    assert f2.hooks._PLAN_DTYPES[torch.float16] == "bf16"
