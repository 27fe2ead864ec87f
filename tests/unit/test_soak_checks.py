"""launch/soak_checks.py: --malloc-check must reach the ranks' loader (LD_PRELOAD is read when a process starts)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("soak_checks", ROOT / "launch" / "soak_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rank(env: dict, q) -> None:
    os.environ.update(env)  # as the harness's ranks apply a launch's env=: after the process started
    q.put("libc_malloc_debug" in Path("/proc/self/maps").read_text())


def _fake_harness() -> types.ModuleType:
    """mcore_harness's launch/failures, with one spawned rank that reports whether the allocator is loaded."""

    def launch(world, names, out, env=None, timeout=0.0):
        ctx = mp.get_context("spawn")  # as tests/dist/dist_harness.py starts its ranks
        q = ctx.Queue()
        p = ctx.Process(target=_rank, args=(dict(env or {}), q))
        p.start()
        loaded = q.get(timeout=60)
        p.join(60)
        return {"loaded": loaded}

    def failures(run, names):
        return [] if run["loaded"] else ["rank 0: the checking allocator is not loaded"]

    return types.SimpleNamespace(launch=launch, failures=failures)


def test_malloc_check_loads_the_checking_allocator_in_the_ranks(monkeypatch, tmp_path):
    tool = _tool()
    if not Path(tool.MALLOC_DEBUG).exists():
        pytest.skip(f"{tool.MALLOC_DEBUG} is not on this machine")
    monkeypatch.setitem(sys.modules, "mcore_harness", _fake_harness())
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool prepends the harness folders
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    before = dict(os.environ)
    assert tool.main(["--runs", "1", "--malloc-check", "any_check"]) == 0
    assert dict(os.environ) == before  # the parent's own environment is given back


def test_checks_or_megatron_alone_exactly_one(capsys):
    tool = _tool()
    assert tool.main(["--runs", "1"]) == 2  # neither
    assert tool.main(["--runs", "1", "--megatron-alone", "gpt_dp2"]) == 2  # both
    assert tool.main(["--runs", "1", "--megatron-alone", "--builds", "0"]) == 2
    assert "check names or --megatron-alone" in capsys.readouterr().err
