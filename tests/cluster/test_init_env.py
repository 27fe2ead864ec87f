"""fp8comm.distributed: launcher detection and the errors for incomplete environments (single process, fast)."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist

from fp8comm.distributed import (
    DistEnvError,
    detect_launcher,
    expand_nodelist,
    init_distributed,
    mpi_env,
    slurm_env,
    tasks_on_node,
    torchrun_env,
)


def test_detect_each_launcher():
    assert detect_launcher({"RANK": "0", "WORLD_SIZE": "1"}) == "torchrun"
    assert detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2"}) == "mpi"
    assert detect_launcher({"OMPI_COMM_WORLD_RANK": "1"}) == "mpi"
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "5"}) == "slurm"
    # torchrun under srun: the torchrun variables win (SLURM_PROCID is the node's task, not the rank).
    assert detect_launcher({"RANK": "3", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}) == "torchrun"
    # mpirun inside an allocation inherits SLURM_* of the job: MPI wins.
    assert detect_launcher({"PMI_RANK": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}) == "mpi"


def test_no_launcher_names_all_options():
    with pytest.raises(DistEnvError) as e:
        detect_launcher({})
    msg = str(e.value)
    for word in ("torchrun", "MASTER_ADDR", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        assert word in msg
    with pytest.raises(DistEnvError, match="srun"):
        detect_launcher({"SLURM_JOB_ID": "7"})  # the batch script itself, not a job step


def test_incomplete_torchrun_lists_missing():
    with pytest.raises(DistEnvError) as e:
        torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert "MASTER_ADDR" in str(e.value) and "MASTER_PORT" in str(e.value) and "RANK" in str(e.value)
    with pytest.raises(DistEnvError, match="not an integer"):
        torchrun_env({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_incomplete_slurm_and_mpi():
    with pytest.raises(DistEnvError, match="SLURM_NTASKS.*SLURM_JOB_NODELIST"):
        slurm_env({"SLURM_PROCID": "0"})
    with pytest.raises(DistEnvError, match="PMI_SIZE"):
        mpi_env({"PMI_RANK": "0"})


def test_slurm_layout():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
        "SLURM_JOB_NODELIST": "gpu[07-09]",
        "SLURM_JOB_ID": "123",
        "MASTER_ADDR": "10.0.0.7",
    }
    i = slurm_env(env)
    assert (i["rank"], i["world"], i["local"], i["lws"], i["addr"]) == (3, 5, 1, 2, "10.0.0.7")
    assert i["port"] == 20123  # every rank derives the same port from the job id
    assert tasks_on_node("2(x2),1", 2) == 1
    with pytest.raises(DistEnvError):
        tasks_on_node("2(x2)", 2)
    assert expand_nodelist("gpu[07-09,11],login1") == ["gpu07", "gpu08", "gpu09", "gpu11", "login1"]


def test_mpi_layout_from_env():
    i = mpi_env(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (i["rank"], i["world"], i["local"], i["lws"]) == (2, 4, 0, 2)


def test_init_single_rank_from_torchrun_env(monkeypatch):
    """A real init (world 1) from a torchrun-style environment; LOCAL_* are exported for hierarchical mode."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    saved = dict(os.environ)  # init_distributed exports RANK/LOCAL_*; do not leak them into later tests
    info = init_distributed(backend="gloo", timeout_s=30)
    try:
        assert (info.launcher, info.rank, info.world_size, info.local_world_size) == ("torchrun", 0, 1, 1)
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert os.environ["LOCAL_WORLD_SIZE"] == "1" and os.environ["LOCAL_RANK"] == "0"
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
