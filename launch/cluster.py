#!/usr/bin/env python3
"""Simulated multi-node cluster on one machine: network namespaces as nodes, bandwidth-limited veth links.

  cluster.py up --nodes 3 --rate 1gbit      N "nodes" (namespaces fp8c-<name>-n<i>, address 10.77.0.<i+1> on eth0),
                                            each joined to a switch namespace (a bridge) by a veth pair whose BOTH
                                            ends are rate-limited with tc tbf (a full-duplex NIC of that rate)
  cluster.py run [--nodes K] -- PROG ARGS   one torchrun per node (c10d rendezvous on node 0), waits, prefixed output
  cluster.py slurm SCRIPT [ARGS]            starts munged + slurmctld + one slurmd per node (once), sbatch --wait
  cluster.py bench [...]                    the scaling benchmark (fp8comm.tools.bench.scaling) over 1..N nodes,
                                            --nproc-per-node G ranks on each (default 2)
  cluster.py down                           kills everything started in the namespaces, removes them and the state

State (namespaces, daemon and job process groups) lives in $FP8COMM_CLUSTER_DIR/<name>/state.json (default
/tmp/fp8comm-cluster), written BEFORE each resource is created, so `down` also cleans up after a crash or kill -9
of this tool. Every launch has a timeout; SIGINT/SIGTERM during `run`/`slurm` kill the launched process groups.
Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2 and nsenter; Slurm mode needs slurm-wlm and munge
(launch/install_cluster_deps.sh). See docs/launch.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE_ROOT = Path(os.environ.get("FP8COMM_CLUSTER_DIR", "/tmp/fp8comm-cluster"))
SUBNET = "10.77.0"  # lives only inside our namespaces, never on the host's own interfaces
RDZV_PORT = 29400
IFNAME = "eth0"  # the same name on every node, so GLOO_SOCKET_IFNAME is one value for the whole job


class ClusterError(RuntimeError):
    pass


# tbf's bucket: the bytes a link passes at line speed after an idle spell. A link of that rate has none to give, so
# the bucket holds BURST_S of the rate (what tbf needs to keep the rate), never less than BURST_MIN (a few frames).
# A fixed 128 KiB was 5.2 ms of a 200 Mbit/s link: bench comm's 256 KiB calls, after their barrier, crossed in part
# at line speed, 1.3-2.3x faster than a model of the rate predicted (docs/planner.md, "The link's bucket").
BURST_S = 1e-3
BURST_MIN = 8 << 10
_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
_RATE_UNITS |= {"bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate (200mbit, 1gbit, 125mbps: tc's units, SI prefixes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate.strip().lower())
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ClusterError(f"--rate {rate!r}: expected a positive number and one of {', '.join(_RATE_UNITS)}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def burst_for(rate: str) -> int:
    """tbf's bucket in bytes for a link of `rate`: BURST_S of it, at least BURST_MIN."""
    return max(BURST_MIN, round(rate_bytes(rate) * BURST_S))


def sh(*cmd: str, check: bool = True, timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode:
        raise ClusterError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def unsupported_reason() -> str | None:
    """Why this machine cannot host a simulated cluster, or None when it can (root, ip netns, tc, nsenter)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN)"
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install iproute2 / util-linux: launch/install_cluster_deps.sh)"
    probe = f"fp8c-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def slurm_missing() -> str | None:
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(t) is None]
    return (
        f"Slurm/munge not installed (missing {', '.join(missing)}; launch/install_cluster_deps.sh)" if missing else None
    )


class Cluster:
    def __init__(self, name: str = "c0") -> None:
        if not re.fullmatch(r"[a-z0-9]{1,8}", name):
            raise ClusterError(f"cluster name must be 1-8 of [a-z0-9], got {name!r}")
        self.name = name
        self.dir = STATE_ROOT / name
        self.state_file = self.dir / "state.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    # ------------------------------------------------------------------------------------------- state
    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_file)  # atomic: a crash never leaves a half-written state

    def ns(self, i: int) -> str:
        return f"fp8c-{self.name}-n{i}"

    @property
    def switch(self) -> str:
        return f"fp8c-{self.name}-sw"

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def nodes(self) -> int:
        return int(self.state.get("nodes", 0))

    def in_node(self, i: int, argv: list[str]) -> list[str]:
        # nsenter --net switches only the network namespace; `ip netns exec` also remounts /sys, which breaks
        # slurmd's cgroup detection (notes/platform.md).
        return ["nsenter", f"--net=/run/netns/{self.ns(i)}", "--", *argv]

    def _track(self, key: str, pid: int) -> None:
        self.state.setdefault(key, []).append(pid)
        self._save()

    # ---------------------------------------------------------------------------------------------- up
    def up(self, nodes: int, rate: str = "1gbit", burst: int | None = None) -> None:
        if nodes < 1 or nodes > 8:
            raise ClusterError(f"--nodes must be 1..8, got {nodes}")
        limited = rate not in ("0", "none")
        if not limited and burst is not None:
            raise ClusterError(f"--burst {burst}: the links have no rate limit (--rate {rate}), so no bucket to size")
        if limited:
            burst = burst_for(rate) if burst is None else burst
            if burst < BURST_MIN:
                raise ClusterError(f"--burst {burst}: at least {BURST_MIN} bytes (a few frames)")
        if self.state.get("namespaces"):
            raise ClusterError(f"cluster {self.name!r} is already up ({self.state_file}); run `down` first")
        reason = unsupported_reason()
        if reason:
            raise ClusterError(reason)
        self.state = {
            "name": self.name,
            "nodes": nodes,
            "rate": rate,
            "burst": burst if limited else None,
            "namespaces": [],
            "addrs": [self.addr(i) for i in range(nodes)],
            "created": time.time(),
        }
        try:
            self._ns_add(self.switch)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(nodes):
                ns, port = self.ns(i), f"p{i}"
                self._ns_add(ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                # Both ends are created inside namespaces: no interface ever appears in the host namespace.
                sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                sh("ip", "-n", self.switch, "link", "set", port, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
                sh("ip", "-n", ns, "link", "set", IFNAME, "up")
                if limited:
                    # tbf on the node's egress (upload) and on the switch port's egress (the node's download).
                    for n, dev in ((ns, IFNAME), (self.switch, port)):
                        sh(
                            "ip",
                            "netns",
                            "exec",
                            n,
                            "tc",
                            "qdisc",
                            "add",
                            "dev",
                            dev,
                            "root",
                            "tbf",
                            "rate",
                            rate,
                            "burst",
                            str(burst),
                            "latency",
                            "20ms",
                        )
            self._wait_reachable()
        except BaseException:
            self.down(quiet=True)
            raise

    def _ns_add(self, ns: str) -> None:
        self.state["namespaces"].append(ns)
        self._save()  # recorded first: `down` removes it even if creation dies half-way
        sh("ip", "netns", "add", ns)

    def _wait_reachable(self) -> None:
        # A bridge port can take a moment to forward: connect over TCP from node 0 to a listener on every other
        # node before declaring the cluster up (no ping on minimal images).
        listen = (
            "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); "
            "s.bind((sys.argv[1],29399)); s.listen(); s.settimeout(20); s.accept()"
        )
        connect = (
            "import socket,sys,time\nfor _ in range(100):\n try: socket.create_connection((sys.argv[1],29399),"
            "1); break\n except OSError: time.sleep(0.1)\nelse: sys.exit(1)"
        )
        for i in range(1, self.nodes):
            srv = subprocess.Popen(self.in_node(i, [sys.executable, "-c", listen, self.addr(i)]))
            try:
                r = sh(*self.in_node(0, [sys.executable, "-c", connect, self.addr(i)]), check=False, timeout=30)
            finally:
                srv.kill()
                srv.wait()
            if r.returncode:
                raise ClusterError(f"node {i} ({self.addr(i)}) unreachable from node 0")

    def describe(self) -> str:
        if not self.state.get("namespaces"):
            return f"cluster {self.name}: down"
        return (
            f"cluster {self.name}: {self.nodes} nodes ({', '.join(self.state['addrs'])} on {IFNAME}), "
            f"links {self.state['rate']} each way"
            + (f" (bucket {self.state['burst']} bytes)" if self.state.get("burst") else "")
            + f", state {self.state_file}"
        )

    # --------------------------------------------------------------------------------------------- run
    def torchrun_argv(
        self, i: int, nnodes: int, nproc: int, prog: list[str], max_restarts: int, job_id: str
    ) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc),
            "--node-rank",
            str(i),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.addr(0)}:{RDZV_PORT}",
            "--rdzv-id",
            job_id,
            # Every namespace shares the host name (which maps to 127.0.0.1): say explicitly who hosts the
            # rendezvous and which address this node advertises.
            "--rdzv-conf",
            f"is_host={int(i == 0)},join_timeout=120",
            "--local-addr",
            self.addr(i),
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "1",
            *prog,
        ]

    def run(
        self,
        prog: list[str],
        nnodes: int | None = None,
        nproc: int = 2,
        timeout: float = 600,
        max_restarts: int = 0,
        env: dict | None = None,
        log_dir: Path | None = None,
        echo: bool = True,
        watch=None,
    ) -> int:
        """torchrun `prog` on nodes 0..nnodes-1; returns the worst exit code (124 on timeout).

        watch(cluster, procs) runs in a thread while the job is up (the elastic demo kills a rank from there).
        """
        if not self.state.get("namespaces"):
            raise ClusterError(f"cluster {self.name!r} is not up (cluster.py up --nodes N)")
        nnodes = nnodes or self.nodes
        if nnodes > self.nodes:
            raise ClusterError(f"job wants {nnodes} nodes, cluster {self.name!r} has {self.nodes}")
        log_dir = Path(log_dir or self.dir / "logs" / time.strftime("%Y%m%d-%H%M%S"))
        log_dir.mkdir(parents=True, exist_ok=True)
        job_id = f"{self.name}-{secrets.token_hex(4)}"
        full_env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": IFNAME,
            "PYTHONUNBUFFERED": "1",
            # torchrun otherwise hands the restarted workers the SAME store as the failed ones, without a
            # per-round prefix, and they read the dead ranks' gloo addresses (connection refused).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **(env or {}),
        }
        procs = []
        for i in range(nnodes):
            log = open(log_dir / f"node{i}.log", "w")
            p = subprocess.Popen(
                self.in_node(i, self.torchrun_argv(i, nnodes, nproc, prog, max_restarts, job_id)),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=REPO,
                start_new_session=True,
            )  # own process group: killpg takes the whole tree
            self._track("jobs", p.pid)
            procs.append((p, log))
        tails = (
            [
                threading.Thread(target=_tail, args=(log_dir / f"node{i}.log", f"[node{i}] ", procs[i][0]), daemon=True)
                for i in range(nnodes)
            ]
            if echo
            else []
        )
        for t in tails:
            t.start()
        if watch is not None:
            threading.Thread(target=watch, args=(self, [p for p, _ in procs]), daemon=True).start()
        rc = _wait_all([p for p, _ in procs], timeout)
        for t in tails:
            t.join(5)
        for p, log in procs:
            log.close()
            self.state["jobs"] = [x for x in self.state.get("jobs", []) if x != p.pid]
        self._save()
        if rc == 124:
            print(f"[cluster] job timed out after {timeout:.0f} s; killed (logs: {log_dir})", file=sys.stderr)
        return rc

    def worker_pids(self, i: int) -> list[int]:
        """PIDs of torchrun's worker processes in node i (children of the agent running `prog`)."""
        out = sh("ip", "netns", "pids", self.ns(i), check=False).stdout.split()
        pids = []
        for pid in map(int, out):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            # Workers carry torchrun's per-worker environment; the agent itself does not have LOCAL_RANK.
            if b"LOCAL_RANK=" in env and b"torch.distributed.run" not in b" ".join(cmd):
                pids.append(pid)
        return sorted(pids)

    # ------------------------------------------------------------------------------------------- slurm
    def slurm_env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.dir / "slurm" / "slurm.conf")}

    def slurm_up(self, timeout: float = 60) -> None:
        reason = slurm_missing()
        if reason:
            raise ClusterError(reason)
        if not self.state.get("namespaces"):
            raise ClusterError(f"cluster {self.name!r} is not up")
        if self.state.get("slurm"):
            return
        d = self.dir / "slurm"
        for sub in ("state", "spool", "munge", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))  # a private key: never the host's /etc/munge/munge.key
            key.chmod(0o400)
        (d / "munge").chmod(0o755)  # munged wants its socket's directory searchable by everyone
        sock = d / "munge" / "munge.socket"
        conf = _slurm_conf(self, d, sock)
        (d / "slurm.conf").write_text(conf)
        self.state["slurm"] = True
        self._save()
        # munged on a private socket (unix socket: no network namespace needed); -F keeps it in our process group.
        self._daemon(
            "munged",
            [
                "munged",
                "-F",
                "-f",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={d / 'munge' / 'munged.pid'}",
                f"--log-file={d / 'log' / 'munged.log'}",
                f"--seed-file={d / 'munge' / 'munged.seed'}",
            ],
        )
        _wait_for(lambda: sock.exists(), 10, "munged socket")
        env = self.slurm_env()
        self._daemon("slurmctld", self.in_node(0, ["slurmctld", "-D", "-f", str(d / "slurm.conf")]), env)
        for i in range(self.nodes):
            self._daemon(
                f"slurmd-n{i}", self.in_node(i, ["slurmd", "-D", "-N", f"n{i}", "-f", str(d / "slurm.conf")]), env
            )

        def idle() -> bool:
            r = sh(*self.in_node(0, ["sinfo", "-h", "-o", "%D %t"]), check=False, timeout=10, env=env)
            return r.returncode == 0 and r.stdout.split() == [str(self.nodes), "idle"]

        _wait_for(idle, timeout, f"{self.nodes} idle Slurm nodes (logs: {d / 'log'})")

    def _daemon(self, name: str, argv: list[str], env: dict | None = None) -> None:
        log = open(self.dir / "slurm" / "log" / f"{name}.out", "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._track("daemons", p.pid)
        time.sleep(0.2)
        if p.poll() is not None:
            raise ClusterError(f"{name} exited at start ({p.returncode}); see {log.name}")

    def sbatch(self, script: str, args: list[str], timeout: float = 600, env: dict | None = None) -> tuple[int, str]:
        """Submit `script` and wait for the job; returns (exit code, the job's output)."""
        self.slurm_up()
        out = self.dir / "slurm" / f"job-{secrets.token_hex(3)}.out"
        full_env = {
            **self.slurm_env(),
            "GLOO_SOCKET_IFNAME": IFNAME,
            "PYTHONUNBUFFERED": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **(env or {}),
        }
        # --wait: sbatch returns when the job ends, with the job's exit code; --time bounds it inside Slurm too.
        argv = self.in_node(
            0,
            [
                "sbatch",
                "--wait",
                "-o",
                str(out),
                f"--time={max(1, int(timeout // 60))}",
                str(Path(script).resolve()),
                *args,
            ],
        )
        p = subprocess.Popen(
            argv,
            env=full_env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._track("jobs", p.pid)
        try:
            msg, _ = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            sh(*self.in_node(0, ["scancel", "--user", "root"]), check=False, env=self.slurm_env())
            _killpg(p.pid)
            msg, rc = f"sbatch timed out after {timeout:.0f} s (job cancelled)", 124
        finally:
            self.state["jobs"] = [x for x in self.state.get("jobs", []) if x != p.pid]
            self._save()
        text = out.read_text() if out.exists() else ""
        return rc, f"{msg.strip()}\n{text}"

    # -------------------------------------------------------------------------------------------- down
    def down(self, quiet: bool = False) -> None:
        """Kill every process we started (tracked process groups, then anything left inside our namespaces),
        delete the namespaces and the state. Safe to call repeatedly and after a crash."""
        _killpg(*self.state.get("jobs", []))  # jobs first, then the daemons (slurmd would otherwise notice and log)
        _killpg(*self.state.get("daemons", []))
        names = list(self.state.get("namespaces", []))
        # Namespaces of this cluster that the state lost track of (e.g. state deleted by hand).
        names += [n for n in _list_netns() if n.startswith(f"fp8c-{self.name}-") and n not in names]
        for ns in names:
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                _kill(int(pid))
        for ns in names:
            sh("ip", "netns", "del", ns, check=False)
        left = [n for n in _list_netns() if n.startswith(f"fp8c-{self.name}-")]
        if left:
            raise ClusterError(f"could not remove namespaces {left}")
        if self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
        self.state = {}
        if not quiet:
            print(f"cluster {self.name}: down ({len(names)} namespaces removed)")

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.down(quiet=True)


def elastic_demo(
    c: Cluster,
    steps: int = 24,
    kill_at: int = 8,
    timeout: float = 400,
    modes: str = "fp8",
    log_dir: Path | None = None,
    extra: tuple = (),
) -> tuple[int, dict]:
    """Train on every node with --max-restarts 1; SIGKILL one worker of the last node once a checkpoint at step
    >= kill_at exists. Returns (exit code, facts): whether a rank was killed, the step the restart resumed from,
    and whether the run finished."""
    ckpt = Path(log_dir or c.dir / "elastic") / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    facts: dict = {"killed_pid": None, "killed_after_ckpt": None}

    def watch(cl: Cluster, procs) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            latest = ckpt / "latest"
            step = int(latest.read_text()) if latest.exists() else 0
            pids = cl.worker_pids(cl.nodes - 1) if step >= kill_at else []
            if pids:
                _kill(pids[-1])  # one rank dies hard (as on a node failure): no cleanup, no goodbye
                facts.update(killed_pid=pids[-1], killed_after_ckpt=step)
                print(
                    f"[cluster] killed worker pid {pids[-1]} on node {cl.nodes - 1} (checkpoint at step {step})",
                    flush=True,
                )
                return
            time.sleep(0.2)

    logs = Path(log_dir or c.dir / "elastic")
    prog = [
        str(REPO / "launch" / "train_demo.py"),
        "--modes",
        modes,
        "--steps",
        str(steps),
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        "2",
        "--step-delay",
        "0.3",
        *extra,
    ]
    rc = c.run(prog, timeout=timeout, max_restarts=1, log_dir=logs, watch=watch)
    text = (logs / "node0.log").read_text(errors="replace")
    m = re.findall(r"restart (\d+), resumed from step (\d+)", text)
    facts.update(
        rc=rc,
        resumed_from=int(m[-1][1]) if m else None,
        restart=int(m[-1][0]) if m else None,
        finished=f"step {steps}/{steps}" in text and "[train] done" in text,
    )
    return rc, facts


# ---------------------------------------------------------------------------------------------- helpers
def _slurm_conf(c: Cluster, d: Path, sock: Path) -> str:
    # slurmctld insists that SlurmctldHost names this host; every namespace shares the host name, so the
    # controller is "<hostname>" reached at node 0's address.
    nodes = "\n".join(
        f"NodeName=n{i} NodeAddr={c.addr(i)} CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN"
        for i in range(c.nodes)
    )
    return f"""# generated by launch/cluster.py for the simulated cluster {c.name}
ClusterName=fp8c{c.name}
SlurmctldHost={socket.gethostname()}({c.addr(0)})
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
# No cgroups: every "node" shares the host's cgroup tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=5
{nodes}
PartitionName=sim Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _list_netns() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(*pids: int) -> None:
    """SIGTERM the process groups led by pids, then SIGKILL whatever is left after a shared 3 s grace period."""

    def alive(pid):
        try:
            os.killpg(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")


def _wait_all(procs: list, timeout: float) -> int:
    """Wait for every process; on timeout or when one fails while others hang, kill all process groups."""
    deadline = time.monotonic() + timeout
    first_fail = None
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            _killpg(*[p.pid for p in procs])
            return 124
        if first_fail is None and any(p.poll() not in (None, 0) for p in procs):
            first_fail = time.monotonic()
        # One node's agent gave up: the others would wait for their rendezvous timeout; give them 60 s.
        if first_fail is not None and time.monotonic() - first_fail > 60:
            _killpg(*[p.pid for p in procs])
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c), 0)


def _tail(path: Path, prefix: str, proc) -> None:
    with open(path, errors="replace") as f:
        while True:
            line = f.readline()
            if line:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()
            elif proc.poll() is not None:
                rest = f.read()
                if rest:
                    sys.stdout.write("".join(prefix + x + "\n" for x in rest.splitlines()))
                return
            else:
                time.sleep(0.1)


def _install_signal_handlers(c: Cluster) -> None:
    def handler(sig, _frame):
        # Kill the job's process groups (not the namespaces: `down` is explicit unless --down was given).
        _killpg(*c.state.get("jobs", []))
        raise SystemExit(128 + sig)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="c0", help="cluster name (several clusters can coexist)")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create N nodes joined by rate-limited links")
    u.add_argument("--nodes", type=int, default=2)
    u.add_argument("--rate", default="1gbit", help="tc rate per link direction (e.g. 200mbit, 1gbit; none)")
    u.add_argument(
        "--burst",
        type=int,
        default=None,
        help=f"tbf bucket in bytes (default: {BURST_S * 1e3:g} ms of the rate, at least {BURST_MIN})",
    )
    r = sub.add_parser("run", help="torchrun PROG on the nodes")
    r.add_argument("--nodes", type=int, default=None, help="first K nodes (default all)")
    r.add_argument("--nproc-per-node", type=int, default=2)
    r.add_argument("--max-restarts", type=int, default=0)
    r.add_argument("--timeout", type=float, default=600)
    r.add_argument("--down", action="store_true", help="remove the cluster afterwards (also on failure)")
    r.add_argument("prog", nargs=argparse.REMAINDER, help="-- script.py args  |  -- -m module args")
    s = sub.add_parser("slurm", help="start Slurm on the nodes (once) and sbatch SCRIPT, waiting for the job")
    s.add_argument("--timeout", type=float, default=600)
    s.add_argument("script")
    s.add_argument("args", nargs=argparse.REMAINDER)
    b = sub.add_parser(
        "bench",
        help="scaling benchmark across 1..N nodes (fp8comm.tools.bench.scaling; --nodes 1,2 --nproc-per-node 4 ...)",
    )
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for fp8comm.tools.bench.scaling drive")
    e = sub.add_parser("elastic", help="train, kill one rank, show torchrun's restart resuming from the checkpoint")
    e.add_argument("--steps", type=int, default=24)
    e.add_argument("--kill-at", type=int, default=8, help="kill once a checkpoint at this step exists")
    e.add_argument("--timeout", type=float, default=400)
    sub.add_parser("status", help="print the cluster's state")
    sub.add_parser("down", help="remove everything (works after crashes)")
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after `bench` belongs to the benchmark's own parser (argparse's REMAINDER rejects leading --opts).
    tail = argv[argv.index("bench") + 1 :] if "bench" in argv else []
    a = p.parse_args(argv[: len(argv) - len(tail)])
    c = Cluster(a.name)
    try:
        if a.cmd == "up":
            c.up(a.nodes, a.rate, a.burst)
            print(c.describe())
        elif a.cmd == "status":
            print(c.describe())
        elif a.cmd == "down":
            c.down()
        elif a.cmd == "run":
            prog = a.prog[1:] if a.prog[:1] == ["--"] else a.prog
            if not prog:
                p.error("run needs a program: run -- script.py args")
            _install_signal_handlers(c)
            try:
                return c.run(prog, a.nodes, a.nproc_per_node, a.timeout, a.max_restarts)
            finally:
                if a.down:
                    c.down()
        elif a.cmd == "slurm":
            _install_signal_handlers(c)
            rc, out = c.sbatch(a.script, a.args, a.timeout)
            print(out)
            return rc
        elif a.cmd == "elastic":
            _install_signal_handlers(c)
            rc, facts = elastic_demo(c, a.steps, a.kill_at, a.timeout)
            print(f"[cluster] elastic demo: {json.dumps(facts)}")
            ok = rc == 0 and facts["killed_pid"] and facts["resumed_from"] and facts["finished"]
            return 0 if ok else 1
        elif a.cmd == "bench":
            sys.path.insert(0, str(REPO))
            from fp8comm.tools.bench import scaling

            _install_signal_handlers(c)
            return scaling.drive(c, tail[1:] if tail[:1] == ["--"] else tail, REPO / "launch" / "train_demo.py")
    except ClusterError as e:
        print(f"cluster.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
