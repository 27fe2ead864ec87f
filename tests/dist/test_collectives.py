"""Multi-process FP8 collectives on gloo (CPU): one pytest id per dist check and run, one launch per run.

Each run (a world size, or the staged backend) launches its ranks once and runs every selected check inside them
(dist_checks*.py); each test id asserts one check's result on every rank, so `pytest -k error_feedback` selects
one check (and launches only it). "staged": the same checks through the staged backend and the device proxy (on
CPU copies here; on a GPU, launch/gpu_ready_check.py runs them with CUDA tensors, several ranks on one GPU).
"""

from __future__ import annotations

import json

import dist_checks
import dist_harness
import pytest

pytestmark = pytest.mark.dist

# run id -> (world size, environment); 4 ranks are laid out as 2 "nodes" x 2 for the hierarchical checks
RUNS = {
    "w2": (2, {}),
    "w3": (3, {}),
    "w4": (4, {"LOCAL_WORLD_SIZE": "2"}),
    "w4-staged": (4, {"LOCAL_WORLD_SIZE": "2", "FP8COMM_TEST_BACKEND": "staged", "FP8COMM_TEST_PROXY": "1"}),
}
CHECKS = [c.__name__ for c in dist_checks.CHECKS]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """run id -> the harness result of ONE launch running every check pytest selected for that run."""
    runs: dict = {}

    def get(run: str) -> dict:
        if run not in runs:
            selected = [
                i.callspec.params["check"]
                for i in request.session.items
                if i.module is request.module and getattr(i, "callspec", None) and i.callspec.params.get("run") == run
            ]
            world, env = RUNS[run]
            names = [c for c in CHECKS if c in selected]  # the harness order, which the checks assume
            runs[run] = dist_harness.launch(world, tmp_path_factory.mktemp(run), env=env, names=names, timeout=240)
        return runs[run]

    return get


def _applies(check: str, run: str) -> bool:
    """Whether `check` can run at `run`'s world size (a check states it as .applies; default: every size)."""
    fn = next(c for c in dist_checks.CHECKS if c.__name__ == check)
    return getattr(fn, "applies", lambda world: True)(RUNS[run][0])


@pytest.mark.parametrize(("check", "run"), [(c, r) for c in CHECKS for r in RUNS if _applies(c, r)])
def test_collective(check, run, launched):
    result = launched(run)
    problems = []
    for rank, recs in result["results"].items():
        done = [x for x in recs if x.get("check") == check and x.get("state") == "done"]
        if not done:
            stopped = [x["after"] for x in recs if x.get("state") == "stopped"]
            started = any(x.get("check") == check and x.get("state") == "started" for x in recs)
            why = (
                "never finished (timeout or crash)"
                if started
                else f"not run: the ranks stopped after {stopped[0]} failed"
                if stopped
                else "not run"
            )
            problems.append(f"rank {rank}: {why}")
            continue
        x = done[0]
        if "skipped" in (x.get("info") or {}):
            problems.append(f"rank {rank}: returned early without running ({x['info']['skipped']})")
        if x.get("info"):
            print(f"[{run} rank {rank}] {check} ({x['seconds']} s): {json.dumps(x['info'])}")
        if not x["ok"]:
            problems.append(f"rank {rank}: {x['error']}\n{x.get('trace', '')}")
    if result["timed_out"]:
        problems.append("the launch timed out")
    assert not problems, "\n".join(problems)
