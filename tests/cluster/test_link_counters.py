"""fp8comm.distributed.link_bytes: the interface counters of THIS network namespace (what the cluster benchmarks and
pretrain_gpt's summary report as bytes on the link)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from fp8comm.distributed import link_bytes


def test_counts_loopback_traffic():
    before = link_bytes("lo")
    assert before is not None
    srv = socket.create_server(("127.0.0.1", 0))
    got = []

    def receive():
        conn, _ = srv.accept()
        with conn:
            got.append(sum(len(b) for b in iter(lambda: conn.recv(1 << 16), b"")))

    t = threading.Thread(target=receive)
    t.start()
    with socket.create_connection(srv.getsockname()) as c:
        c.sendall(b"x" * (1 << 20))
    t.join(30)
    srv.close()
    after = link_bytes("lo")
    assert got == [1 << 20]
    assert after[0] - before[0] >= 1 << 20 and after[1] - before[1] >= 1 << 20


def test_unknown_interface_is_none():
    assert link_bytes("no-such-if0") is None


PROBE = """
import os
from fp8comm.distributed import link_bytes, link_ifname
print(link_bytes("eth0"), link_bytes("d0") is not None, link_ifname())
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"), reason="needs root")
def test_reads_the_namespace_of_the_process_not_of_sysfs():
    # A fresh network namespace holds only lo and the veth pair d0-d1; /sys/class/net still lists the host's interfaces
    # (sysfs belongs to the namespace that mounted it), which is where a sysfs reader would look.
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", FP8COMM_LINK_IFNAME="")
    script = f"ip link add d0 type veth peer name d1 && ip link set d0 up && exec {sys.executable} -c '{PROBE}'"
    out = subprocess.run(["unshare", "--net", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "True", "None"], out.stdout  # no eth0 here: not measured, not the host's
    env["FP8COMM_LINK_IFNAME"] = "d0"
    out = subprocess.run(["unshare", "--net", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "d0"
