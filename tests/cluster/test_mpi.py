"""The MPI launch path: launch/mpirun.sh -> init_distributed() from PMI_* (rank 0's port via mpi4py) -> FP8."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.dist


@pytest.mark.timeout(150)
def test_mpirun_initialises_and_runs_fp8_collectives():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py not installed (launch/install_cluster_deps.sh)")
    mpirun = ROOT / ".venv" / "bin" / "mpirun"
    if not mpirun.exists() and shutil.which("mpirun") is None:
        pytest.skip("no mpirun (pip install mpich)")
    env = {**os.environ, "PYTHON": sys.executable, "FP8COMM_TIMEOUT": "120"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # nothing but MPI may tell the ranks who they are
    r = subprocess.run(
        [str(ROOT / "launch" / "mpirun.sh"), "-n", "2", "-m", "fp8comm.distributed"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
    )
    # Two processes share one stdout: lines may interleave, so split on the marker rather than on newlines.
    lines = r.stdout.split("fp8comm-smoke")[1:]
    assert r.returncode == 0 and len(lines) == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert all("launcher=mpi" in x and "all_ranks_ok=True" in x and "exact=True" in x for x in lines), lines
    # Rank 0 chose the port; both ranks report the same one.
    assert len({x.split("master=")[1].split()[0] for x in lines}) == 1
