"""Real network namespaces joined by a rate-limited veth link: FP8 collectives across 2 nodes, a Slurm job from
the sbatch template, torchrun's elastic restart, and cleanup after the tool itself is killed.

Skips (with the reason) where namespaces cannot be created, e.g. without root. Every launch has a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, cluster_name, tool

pytestmark = pytest.mark.dist


def _records(outdir):
    return {int(f.stem[4:]): [json.loads(x) for x in f.read_text().splitlines()] for f in outdir.glob("rank*.jsonl")}


@pytest.mark.timeout(300)
def test_fp8_collectives_across_two_nodes(cluster2, tmp_path):
    """Every check of tests/dist (bit-exact references, error bounds, non-finite, async, mismatch errors, MoE,
    hierarchical with REAL node groups) on 2 nodes x 2 ranks over the 1 Gbit/s link, in one launch."""
    import dist_checks
    import dist_harness

    qdisc = tool.sh("ip", "netns", "exec", cluster2.ns(1), "tc", "qdisc", "show", "dev", tool.IFNAME).stdout
    assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc  # the link really is rate-limited
    assert "burst 125000b" in qdisc, qdisc  # with a bucket of 1 ms of its rate (launch/cluster.py, burst_for)
    out = tmp_path / "checks"
    out.mkdir()
    rc = cluster2.run(
        [str(ROOT / "tests" / "cluster" / "cluster_checks.py"), str(out)],
        nproc=2,
        timeout=240,
        log_dir=tmp_path / "logs",
        echo=False,
    )
    recs = _records(out)
    run = {"results": recs, "timed_out": rc == 124, "exitcodes": [rc]}
    fails = dist_harness.failures(run)
    assert not fails, "\n".join(fails) + "\n" + (tmp_path / "logs" / "node0.log").read_text()[-3000:]
    assert sorted(recs) == [0, 1, 2, 3]
    names = [c.__name__ for c in dist_checks.CHECKS]
    for r, rs in recs.items():
        assert [x["check"] for x in rs if x.get("state") == "done"] == names, f"rank {r} did not run every check"
        link = next(x for x in rs if x.get("state") == "link")
        assert link["local_world"] == 2
        # The cross-node halves of the collectives went over eth0 (the veth link), not loopback.
        assert link["tx_bytes"] > 100_000 and link["rx_bytes"] > 100_000, link
    hier = next(x for x in recs[0] if x.get("check") == "check_hierarchical" and x.get("state") == "done")
    assert "skipped" not in hier["info"], hier


@pytest.mark.timeout(300)
def test_sbatch_torchrun_template_on_local_slurm(cluster2):
    """launch/slurm/torchrun.sbatch on a real slurmctld + 2 slurmd: srun -> torchrun.sh per node -> FP8 check."""
    reason = tool.slurm_missing()
    if reason:
        pytest.skip(reason)
    rc, out = cluster2.sbatch(
        str(ROOT / "launch" / "slurm" / "torchrun.sbatch"), ["-m", "fp8comm.distributed"], timeout=240
    )
    assert rc == 0, out[-4000:]
    lines = out.split("fp8comm-smoke")[1:]  # ranks share the job's output file: split on the marker
    assert len(lines) == 4, out[-4000:]
    assert all("launcher=torchrun" in x and "all_ranks_ok=True" in x and "exact=True" in x for x in lines), lines
    assert {x.split("rank=")[1].split()[0] for x in lines} == {"0/4", "1/4", "2/4", "3/4"}
    assert all(f"master={tool.Cluster.addr(0)}:" in x for x in lines)  # rendezvous found via Slurm's NodeAddr
    # Slurm saw a 2-node job that completed.
    acct = tool.sh(
        *cluster2.in_node(0, ["scontrol", "show", "job", "-o"]), env=cluster2.slurm_env(), check=False
    ).stdout
    assert "NumNodes=2" in acct and "JobState=COMPLETED" in acct, acct[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_elastic_restart_resumes_from_checkpoint(cluster2, tmp_path):
    """SIGKILL one rank on node 1 mid-run: torchrun restarts every worker, training resumes from the last
    checkpoint and finishes; replicas end bit-identical (train_demo checks that before exiting 0)."""
    rc, facts = tool.elastic_demo(cluster2, steps=12, kill_at=4, timeout=360, log_dir=tmp_path, extra=("--dim", "256"))
    log = (tmp_path / "node0.log").read_text(errors="replace")
    assert facts["killed_pid"], f"no worker was killed: {facts}\n{log[-3000:]}"
    assert rc == 0 and facts["finished"], f"{facts}\n{log[-3000:]}"
    # Resumed from a checkpoint written at or after the kill threshold (never from scratch).
    assert facts["resumed_from"] is not None and facts["resumed_from"] >= 4 and facts["resumed_from"] % 2 == 0
    assert facts["resumed_from"] >= facts["killed_after_ckpt"], facts


@pytest.mark.timeout(120)
def test_down_cleans_up_after_the_tool_is_killed(tmp_path):
    """kill -9 the cluster tool while its job runs: `down` still finds and ends the job and removes the nodes."""
    reason = tool.unsupported_reason()
    if reason:
        pytest.skip(f"simulated cluster unavailable: {reason}")
    name = cluster_name("k")
    c = tool.Cluster(name)
    c.down(quiet=True)
    c.up(1, "1gbit")
    try:
        env = {**os.environ, "FP8COMM_CLUSTER_DIR": str(tool.STATE_ROOT)}
        p = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "launch" / "cluster.py"),
                "--name",
                name,
                "run",
                "--timeout",
                "100",
                "--nproc-per-node",
                "1",
                "--",
                "--no-python",
                "sleep",
                "90",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        pids = []
        while time.monotonic() < deadline and not any(_cmd(x) == "sleep" for x in pids):
            time.sleep(0.5)
            pids = [int(x) for x in tool.sh("ip", "netns", "pids", c.ns(0), check=False).stdout.split()]
        assert any(_cmd(x) == "sleep" for x in pids), "the job never started"
        os.kill(p.pid, signal.SIGKILL)  # the tool dies without any cleanup
        p.wait(10)
        assert tool.sh("ip", "netns", "pids", c.ns(0), check=False).stdout.split(), "job should outlive the tool"
    finally:
        tool.Cluster(name).down(quiet=True)  # a fresh object: everything it knows comes from the state file
    assert not [n for n in tool._list_netns() if n.startswith(f"fp8c-{name}-")]
    assert not (tool.STATE_ROOT / name).exists()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _cmd(pid) != "sleep", f"pid {pid} survived down"


def _cmd(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""
