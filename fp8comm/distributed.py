"""init_distributed(): start torch.distributed from whatever launched this process.

Detected, in this order:
  torchrun   RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK, LOCAL_WORLD_SIZE) - also torchrun under srun
  MPI        PMI_RANK/PMI_SIZE (MPICH, Intel MPI) or OMPI_COMM_WORLD_RANK/SIZE (Open MPI); rank 0 opens the
             rendezvous store on a free port and broadcasts the port with mpi4py (MASTER_ADDR/PORT, if both set,
             are used instead and mpi4py is not needed)
  SLURM      srun with one task per rank: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST
             (address of the first node from `scontrol show node`, port MASTER_PORT or derived from SLURM_JOB_ID)
An incomplete environment raises DistEnvError naming the missing variables. LOCAL_RANK / LOCAL_WORLD_SIZE / RANK /
WORLD_SIZE are exported afterwards, so fp8comm's hierarchical collectives find the node layout on every launcher.

`python -m fp8comm.distributed` initialises, runs an FP8 all-gather and reduce-scatter against exact references
and prints one line per rank: a smoke test for a new launch setup (used by the Slurm and MPI tests).
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

LAUNCHERS = ("auto", "torchrun", "mpi", "slurm")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST")


class DistEnvError(RuntimeError):
    """The launch environment is missing something init_distributed needs; the message says what."""


@dataclass(frozen=True)
class DistInfo:
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str


def _missing(env, names) -> list[str]:
    return [n for n in names if not env.get(n)]


def detect_launcher(env=None) -> str:
    """'torchrun' | 'mpi' | 'slurm'; raises DistEnvError when none (or only part of one) is present."""
    env = os.environ if env is None else env
    if any(env.get(n) for n in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")):
        return "torchrun"
    # MPI before SLURM: mpirun inside an allocation inherits SLURM_* of the job (SLURM_PROCID is not the MPI rank).
    if env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK"):
        return "mpi"
    if env.get("SLURM_PROCID") and env.get("SLURM_STEP_ID") is not None:
        return "slurm"
    if env.get("SLURM_JOB_ID"):
        raise DistEnvError(
            "inside a Slurm allocation but not in a job step: start the ranks with `srun` "
            "(one task per rank) or `srun torchrun ...` (launch/slurm/*.sbatch)"
        )
    raise DistEnvError(
        "no launcher environment found. Expected one of: torchrun ("
        + ", ".join(TORCHRUN_VARS)
        + "), MPI (PMI_RANK + PMI_SIZE, or OMPI_COMM_WORLD_RANK + OMPI_COMM_WORLD_SIZE), Slurm srun ("
        + ", ".join(SLURM_VARS)
        + "). Launch with launch/torchrun.sh, launch/mpirun.sh or sbatch "
        "launch/slurm/*.sbatch."
    )


def _int(env, name: str, who: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise DistEnvError(f"{who}: {name}={env[name]!r} is not an integer") from None


# ------------------------------------------------------------------------------------------------ torchrun
def torchrun_env(env) -> dict:
    miss = _missing(env, TORCHRUN_VARS)
    if miss:
        raise DistEnvError(
            f"torchrun-style environment incomplete: missing {', '.join(miss)} "
            f"(set: {', '.join(n for n in TORCHRUN_VARS if env.get(n)) or 'none'})"
        )
    rank, world = _int(env, "RANK", "torchrun"), _int(env, "WORLD_SIZE", "torchrun")
    local = _int(env, "LOCAL_RANK", "torchrun") if env.get("LOCAL_RANK") else rank
    lws = _int(env, "LOCAL_WORLD_SIZE", "torchrun") if env.get("LOCAL_WORLD_SIZE") else world
    return dict(
        rank=rank, world=world, local=local, lws=lws, addr=env["MASTER_ADDR"], port=_int(env, "MASTER_PORT", "torchrun")
    )


# --------------------------------------------------------------------------------------------------- slurm
def expand_nodelist(nodelist: str) -> list[str]:
    """'n[0-2,5],gpu7' -> ['n0', 'n1', 'n2', 'n5', 'gpu7'] (zero padding kept), without needing scontrol."""
    out = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            out.append(prefix)
            continue
        for part in ranges.split(","):
            a, _, b = part.partition("-")
            for k in range(int(a), int(b or a) + 1):
                out.append(f"{prefix}{k:0{len(a)}d}")
    return out


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM_TASKS_PER_NODE ('2(x3),1') -> the task count on node `node_id`."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise DistEnvError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node_id >= len(counts):
        raise DistEnvError(
            f"SLURM_NODEID={node_id} but SLURM_TASKS_PER_NODE={tasks_per_node!r} lists {len(counts)} nodes"
        )
    return counts[node_id]


def node_addr(host: str) -> str:
    """The address Slurm uses for `host` (NodeAddr), else the host name itself (resolved by the resolver)."""
    if shutil.which("scontrol"):
        try:
            r = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True, text=True, timeout=20)
            m = re.search(r"\bNodeAddr=(\S+)", r.stdout)
            if r.returncode == 0 and m:
                return m.group(1)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return host


def slurm_env(env) -> dict:
    miss = _missing(env, SLURM_VARS)
    if miss:
        raise DistEnvError(f"Slurm environment incomplete: missing {', '.join(miss)} (run the ranks with srun)")
    rank, world = _int(env, "SLURM_PROCID", "slurm"), _int(env, "SLURM_NTASKS", "slurm")
    local = _int(env, "SLURM_LOCALID", "slurm") if env.get("SLURM_LOCALID") else 0
    if env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"):
        tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"]
        lws = tasks_on_node(tpn, _int(env, "SLURM_NODEID", "slurm") if env.get("SLURM_NODEID") else 0)
    else:
        lws = 1
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    else:
        hosts = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        addr = node_addr(hosts[0])
    # Every rank must derive the same port without talking: MASTER_PORT, or one derived from the job id.
    port = (
        _int(env, "MASTER_PORT", "slurm")
        if env.get("MASTER_PORT")
        else 20000 + _int(env, "SLURM_JOB_ID", "slurm") % 20000
        if env.get("SLURM_JOB_ID")
        else 29500
    )
    return dict(rank=rank, world=world, local=local, lws=lws, addr=addr, port=port)


# ----------------------------------------------------------------------------------------------------- MPI
def mpi_env(env) -> dict:
    if env.get("OMPI_COMM_WORLD_RANK"):
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        local_names = ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:
        names = ("PMI_RANK", "PMI_SIZE")
        local_names = ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")  # MPICH hydra
    miss = _missing(env, names)
    if miss:
        raise DistEnvError(f"MPI environment incomplete: missing {', '.join(miss)}")
    rank, world = _int(env, names[0], "mpi"), _int(env, names[1], "mpi")
    local = int(env[local_names[0]]) if env.get(local_names[0]) else None
    lws = int(env[local_names[1]]) if env.get(local_names[1]) else None
    return dict(
        rank=rank,
        world=world,
        local=local,
        lws=lws,
        addr=env.get("MASTER_ADDR"),
        port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
    )


def _mpi_comm():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistEnvError(
            "launched by MPI but mpi4py is not importable (pip install mpi4py mpich), and "
            f"MASTER_ADDR/MASTER_PORT are not both set: {e}"
        ) from None
    return MPI


def link_bytes(ifname: str = "eth0") -> tuple[int, int] | None:
    """(tx, rx) bytes `ifname` has moved, as this process's network namespace sees it; None: no such interface.

    Read from /proc/net/dev, which is per network namespace; /sys/class/net is the namespace of whoever mounted
    sysfs, so inside a simulated-cluster node it would show the host's interface of the same name."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            f = rest.split()
            return int(f[8]), int(f[0])
    return None


def link_ifname() -> str | None:
    """The interface whose counters measure this node's link: FP8COMM_LINK_IFNAME, GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME (the first that names an interface of this namespace); None: not measured."""
    for var in ("FP8COMM_LINK_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        name = os.environ.get(var, "").split(",")[0].strip()
        if name and link_bytes(name) is not None:
            return name
    return None


def _iface_addr(ifname: str) -> str | None:
    """IPv4 address of interface `ifname` (Linux), for the rendezvous address when GLOO_SOCKET_IFNAME names it."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def _mpi_rendezvous(info: dict, timeout: datetime.timedelta):
    """Local layout from MPI, and rank 0's store on a free port (port 0: the OS picks it, no race)."""
    MPI = _mpi_comm()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != info["world"] or comm.Get_rank() != info["rank"]:
        raise DistEnvError(
            f"MPI says rank {comm.Get_rank()}/{comm.Get_size()}, the environment {info['rank']}/{info['world']}"
        )
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if info["local"] is None:
        info["local"], info["lws"] = node.Get_rank(), node.Get_size()
    store = None
    if comm.Get_rank() == 0:
        addr = info["addr"]
        if not addr:
            ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
            # All ranks on this host: loopback. Otherwise an address the other hosts can reach.
            addr = (
                "127.0.0.1"
                if node.Get_size() == comm.Get_size()
                else (ifname and _iface_addr(ifname)) or socket.gethostbyname(socket.gethostname())
            )
        try:
            store = dist.TCPStore(addr, 0, info["world"], is_master=True, timeout=timeout, wait_for_workers=False)
            msg: tuple[str, int, str | None] | None = (addr, store.port, None)
        except Exception as e:
            msg = (addr, 0, f"rank 0 could not open the rendezvous store on {addr}: {e}")
    else:
        msg = None
    addr, port, err = comm.bcast(msg, root=0)
    if err:
        raise DistEnvError(err)
    if addr.startswith("127.") and node.Get_size() != comm.Get_size():
        raise DistEnvError(
            "ranks span several hosts but rank 0's address is loopback; set MASTER_ADDR (or "
            "GLOO_SOCKET_IFNAME to the interface the hosts share)"
        )
    if store is None:
        store = dist.TCPStore(addr, port, info["world"], is_master=False, timeout=timeout)
    info["addr"], info["port"] = addr, port
    return store


# ---------------------------------------------------------------------------------------------------- init
def init_distributed(
    backend: str | None = None, launcher: str | None = None, timeout_s: float | None = None, env=None
) -> DistInfo:
    """Initialise the default process group from the launch environment (see module doc); idempotent.

    backend: 'gloo' on CPU, 'nccl' when CUDA is available (default); launcher: 'auto' (default, or
    FP8COMM_LAUNCHER) or force one; timeout_s: collective timeout (default FP8COMM_PG_TIMEOUT or 600 s).
    """
    env = os.environ if env is None else env
    launcher = launcher or env.get("FP8COMM_LAUNCHER", "auto")
    if launcher not in LAUNCHERS:
        raise DistEnvError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if launcher == "auto":
        launcher = detect_launcher(env)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=float(timeout_s or env.get("FP8COMM_PG_TIMEOUT", 600)))
    info = {"torchrun": torchrun_env, "mpi": mpi_env, "slurm": slurm_env}[launcher](env)
    if dist.is_initialized():
        if dist.get_world_size() != info["world"]:
            raise DistEnvError(
                f"torch.distributed already initialised with world size {dist.get_world_size()}, "
                f"the environment says {info['world']}"
            )
    else:
        store = None
        if launcher == "mpi" and not (info["addr"] and info["port"]):
            store = _mpi_rendezvous(info, timeout)
        if info["local"] is None:
            info["local"], info["lws"] = info["rank"], info["world"]
        if backend == "nccl":
            torch.cuda.set_device(info["local"] % max(1, torch.cuda.device_count()))
        kw = dict(backend=backend, rank=info["rank"], world_size=info["world"], timeout=timeout)
        if store is not None:
            dist.init_process_group(store=store, **kw)
        elif launcher == "torchrun" and env is os.environ:
            dist.init_process_group(init_method="env://", **kw)  # reuses torchrun's agent store when it has one
        else:
            dist.init_process_group(init_method=f"tcp://{_host(info['addr'])}:{info['port']}", **kw)
    if env is os.environ:
        # fp8comm's hierarchical mode and user code read these, whichever launcher ran.
        os.environ.update(
            RANK=str(info["rank"]),
            WORLD_SIZE=str(info["world"]),
            LOCAL_RANK=str(info["local"]),
            LOCAL_WORLD_SIZE=str(info["lws"]),
        )
    return DistInfo(
        launcher, info["rank"], info["world"], info["local"], info["lws"], str(info["addr"]), int(info["port"]), backend
    )


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


# ---------------------------------------------------------------------------------------------------- smoke
def smoke(numel: int = 1 << 16) -> str:
    """FP8 all-gather + reduce-scatter (flat and, across nodes, hierarchical) against exact references."""
    import fp8comm.comm as fc
    from fp8comm.quant import Scaling, quantize

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(numel, generator=g) * (rank + 1)
    sc = Scaling(1, 128, "fp32")
    # all-gather: every rank must hold exactly the quantize->dequantize of every rank's shard.
    got = fc.all_gather(x)
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x)
    want = torch.cat([quantize(s.view(1, -1), "e4m3", scaling=sc).dequantize(torch.float32).view(-1) for s in shards])
    ag_ok = torch.equal(got, want)
    # reduce-scatter: sum over senders (rank order, fp32) of each sender's quantized chunk for this rank.
    y = torch.randn(world * numel, generator=g)
    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ys, y)
    chunk = slice(rank * numel, (rank + 1) * numel)
    ref = torch.zeros(numel)
    for t in ys:
        q = quantize(t[chunk].view(1, -1), "e4m3", scaling=sc).dequantize(torch.float32).view(-1)
        ref = ref + q  # fp32, rank order: what the receiver sums
    rs_ok = torch.equal(fc.reduce_scatter(y), ref)
    true = torch.stack([t[chunk].double() for t in ys]).sum(0)
    sqnr = float("inf")
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:  # several nodes: the hierarchical path too
        noise = (fc.reduce_scatter(y, hierarchical=True).double() - true).pow(2).sum()
        sqnr = float(10 * torch.log10(true.pow(2).sum() / noise.clamp_min(1e-300)))
    # Hierarchical sums differ from flat ones (fp32 inside a node first), so no bit check: E4M3 with 1x128 scales
    # gives ~31 dB on Gaussian data; 25 dB catches a wrong layout (which gives ~0 dB) with margin.
    hier_ok = sqnr > 25
    ok = torch.tensor([int(ag_ok and rs_ok and hier_ok)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return (
        f"all_gather exact={ag_ok} reduce_scatter exact={rs_ok} hierarchical sqnr_db={sqnr:.1f} "
        f"all_ranks_ok={bool(ok.item())}"
    )


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description="init_distributed + an FP8 collective smoke test, one line per rank")
    p.add_argument("--launcher", default=None, choices=LAUNCHERS)
    p.add_argument("--numel", type=int, default=1 << 16)
    a = p.parse_args()
    torch.set_num_threads(1)
    info = init_distributed(launcher=a.launcher, timeout_s=120)
    line = smoke(a.numel)
    print(
        f"fp8comm-smoke launcher={info.launcher} rank={info.rank}/{info.world_size} "
        f"local={info.local_rank}/{info.local_world_size} master={info.master_addr}:{info.master_port} "
        f"host={socket.gethostname()} {line}",
        flush=True,
    )
    ok = "all_ranks_ok=True" in line
    from .comm import shutdown

    shutdown()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
