"""Multi-process FP8 collectives on gloo (CPU): one launch per world size runs every check in dist_checks*.py."""
from __future__ import annotations

import json

import pytest

import dist_harness

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world,backend", [(2, "gloo"), (3, "gloo"), (4, "gloo"), (4, "staged")])
def test_collectives(world, backend, tmp_path):
    # 4 ranks are laid out as 2 "nodes" x 2 for the hierarchical checks. "staged": the same checks through the
    # staged backend and the device proxy (on CPU copies here; on a GPU, launch/gpu_ready_check.py runs them with
    # CUDA tensors: several ranks on one GPU), which is how those two test tools are themselves tested.
    env = {"LOCAL_WORLD_SIZE": "2"} if world == 4 else {}
    if backend == "staged":
        env.update(FP8COMM_TEST_BACKEND="staged", FP8COMM_TEST_PROXY="1")
    run = dist_harness.launch(world, tmp_path, env=env, timeout=240)
    for r, recs in run["results"].items():
        for x in recs:
            if x.get("state") == "done" and x.get("info"):
                print(f"[world {world} rank {r}] {x['check']} ({x['seconds']} s): {json.dumps(x['info'])}")
    fails = dist_harness.failures(run)
    assert not fails, "\n".join(fails)
    # Every check ran to the end on every rank (none skipped by an early stop).
    import dist_checks

    names = [c.__name__ for c in dist_checks.CHECKS]
    for r, recs in run["results"].items():
        assert [x["check"] for x in recs if x.get("state") == "done"] == names, f"rank {r} did not run every check"
