"""launch/cluster.py's link: tbf's bucket is 1 ms of the rate (not a fixed 128 KiB, which let bench comm's 256 KiB
calls cross a 200 Mbit/s link partly at line speed), and a bad rate or bucket is a clear error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fp8comm_cluster_link", ROOT / "launch" / "cluster.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


@pytest.mark.parametrize(
    "rate,bps,burst",
    [("1gbit", 125e6, 125_000), ("200mbit", 25e6, 25_000), ("125mbps", 125e6, 125_000), ("10mbit", 1.25e6, 8192)],
)
def test_the_bucket_is_a_millisecond_of_the_rate(rate, bps, burst):
    assert tool.rate_bytes(rate) == bps
    assert tool.burst_for(rate) == burst  # 10 Mbit/s: 1 ms is 1250 bytes, the floor (a few frames) holds


@pytest.mark.parametrize("rate", ["fast", "0mbit", "1 gbit x", "-5mbit", "200"])
def test_a_bad_rate_is_named(rate):
    with pytest.raises(tool.ClusterError, match="--rate"):
        tool.burst_for(rate)


@pytest.mark.parametrize(
    "rate, burst, match",
    [
        ("1gbit", 100, "--burst 100"),  # a bucket below a few frames
        ("none", 50000, "--burst 50000.*no rate limit"),  # a bucket without a rate limit: refused, not dropped
    ],
)
def test_a_bad_bucket_is_refused_before_anything_is_created(tmp_path, monkeypatch, rate, burst, match):
    monkeypatch.setattr(tool, "STATE_ROOT", tmp_path)
    c = tool.Cluster("tb")
    with pytest.raises(tool.ClusterError, match=match):
        c.up(2, rate, burst=burst)
    assert not c.state.get("namespaces")
