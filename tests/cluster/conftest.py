"""Fixtures for tests/cluster: the simulated cluster tool (launch/cluster.py) and a 2-node cluster per module."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "dist")]


def _load_tool():
    spec = importlib.util.spec_from_file_location("fp8comm_cluster_tool", ROOT / "launch" / "cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tool = _load_tool()


def cluster_name(tag: str) -> str:
    # Unique per test process: several people (and CI) may run this suite on one machine at the same time.
    return f"{tag}{os.getpid() % 10**6}"[:8]


@pytest.fixture(scope="module")
def cluster2():
    """Two nodes x one 1 Gbit/s link (rate-limited both ways), removed afterwards even when tests fail."""
    reason = tool.unsupported_reason()
    if reason:
        pytest.skip(f"simulated cluster unavailable: {reason}")
    c = tool.Cluster(cluster_name("t"))
    c.down(quiet=True)  # leftovers of a crashed earlier run with the same name
    c.up(2, "1gbit")
    try:
        yield c
    finally:
        c.down(quiet=True)
