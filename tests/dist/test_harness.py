"""The launcher's own report: a rank that dies says how (its signal) and what it last wrote to stderr."""

from __future__ import annotations

import os

import dist_harness
import pytest

pytestmark = pytest.mark.dist


def _aborting_target(rank: int, world: int, port: int, outdir: str, env: dict, names) -> None:
    if rank == 1:
        # what a C++ std::terminate leaves: a line on fd 2, then SIGABRT
        os.write(2, b"terminate called after throwing an instance of 'Example'\n")
        os.abort()


def test_a_rank_killed_by_a_signal_names_it_and_quotes_its_stderr(tmp_path):
    run = dist_harness.launch(2, tmp_path, target=_aborting_target, timeout=60)
    assert run["exitcodes"] == [0, -6]
    (msg,) = dist_harness.failures(run)
    assert msg.startswith("rank 1 exited with -6 (SIGABRT); stderr ends: ")
    assert "terminate called after throwing an instance of 'Example'" in msg
    assert "in _aborting_target" in msg  # faulthandler: the aborting thread's innermost Python frame
    assert "\n" not in msg  # one line: CI logs keep a failure's first line
