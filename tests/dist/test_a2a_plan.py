"""The all-to-all's piece plan in steady state (after the first, checked calls): one launch of 2 gloo ranks."""

from __future__ import annotations

import a2a_plan_checks
import dist_harness
import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one 2-rank launch: 18-80 s on the 2-core VM


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return dist_harness.launch(2, tmp_path_factory.mktemp("a2a_plan"), target=a2a_plan_checks.worker, timeout=180)


@pytest.mark.parametrize("check", [c.__name__ for c in a2a_plan_checks.CHECKS])
def test_a2a_plan(check, result):
    problems = []
    for rank, recs in result["results"].items():
        done = [x for x in recs if x.get("check") == check and x.get("state") == "done"]
        if not done:
            problems.append(f"rank {rank}: not finished (timed out: {result['timed_out']})")
            continue
        print(f"rank {rank} {check}: {done[0].get('info')}")
        if not done[0]["ok"]:
            problems.append(f"rank {rank}: {done[0]['error']}\n{done[0].get('trace', '')}")
    assert not problems, "\n".join(problems)
