"""launch/planner_steps.py's report of the planner's runs: every launch's plans (each calibrates and plans anew)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mod():
    spec = importlib.util.spec_from_file_location("planner_steps", ROOT / "launch" / "planner_steps.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(chosen: str, trials=(), times=None) -> dict:
    plan = {"op": "reduce_scatter", "role": "gradients", "size_class": 26, "chosen": chosen}
    return {"fp8comm_hook_stats": {"plans": [plan], "plan_trials": list(trials)}, "planned_times": times or {}}


def test_every_runs_plans_are_reported():
    trial = {"op": "reduce_scatter", "size_class": 26, "measured_ms": {"fp8": 480.0, "mxfp4+ef": 433.0},
             "running": "mxfp4+ef"}  # fmt: skip
    times = {"reduce_scatter": {"timed_calls": 8, "predicted_s": 0.41, "measured_s": 0.45}}
    lines = _mod().planner_report([_run("fp8"), _run("fp8", [trial]), _run("mxfp4+ef two-level", times=times)])
    assert lines == [
        "  run 1 plan: reduce_scatter gradients class 26: fp8",
        "  run 2: the same plans as run 1",
        "  run 2 trial: reduce_scatter class 26: fp8 480 ms, mxfp4+ef 433 ms -> mxfp4+ef",
        "  run 3 plan: reduce_scatter gradients class 26: mxfp4+ef two-level",
        "  run 3 reduce_scatter: 8 timed calls, predicted 410 ms, measured 450 ms",
    ]
