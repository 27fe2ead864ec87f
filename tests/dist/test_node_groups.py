"""Node groups are held by their holders and destroyed by the last one (issue 27, item 3); DTensor cache clearing.

One process plays rank 0 of an 8-rank world on torch's fake backend (no communication, but real process groups
registered with torch.distributed), laid out as 4 nodes x 2 ranks (LOCAL_WORLD_SIZE=2). The subgroup is ranks 0-3.
One test runs a fresh one-rank gloo interpreter instead, to see a real backend's threads stop.
What these tests pin down:
- an adapter's teardown (fsdp2.disable, Megatron and DeepSpeed uninstall) releases its own node groups only: the
  ones a caller prepared stay, and a hierarchical call on the subgroup still works;
- prepare/release cycles leave as many groups registered as before (the old shutdown() dropped fp8comm's
  references and left torch's registry growing by 2 groups per cycle here);
- the last holder's release destroys the groups; using them afterwards is a clear error;
- clear_dtensor_caches() warns once when a private torch name it relies on is gone.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fp8comm.comm as fc
from fp8comm.comm import api
from fp8comm.errors import Fp8CommError

WORLD, LOCAL, SUB = 8, 2, [0, 1, 2, 3]
ROOT = Path(__file__).resolve().parents[2]


def registered() -> int:
    """Process groups torch.distributed holds in its registry (private: torch has no public count)."""
    return len(dist.distributed_c10d._world.pg_map)


@pytest.fixture
def world(monkeypatch):
    """Rank 0 of an 8-rank fake world; everything fp8comm made is destroyed with it afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(LOCAL))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield dist.new_group(SUB)
    finally:
        fc.shutdown()
        dist.destroy_process_group()


def _fsdp2_teardown() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fp8comm.integrations.fsdp2 as f2

    model = torch.nn.Linear(16, 16)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    f2.enable(model)
    assert f2.disable(model)


def _megatron_teardown() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import fp8comm.integrations.megatron as fm

    fm.uninstall()


def _deepspeed_teardown() -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    import fp8comm.integrations.deepspeed as fds

    fds.uninstall()


@pytest.mark.parametrize(
    "teardown", [_fsdp2_teardown, _megatron_teardown, _deepspeed_teardown], ids=lambda f: f.__name__[1:]
)
def test_adapter_teardown_keeps_the_callers_node_groups(world, teardown):
    """The old adapters called the process-wide shutdown(): the caller's next hierarchical call on its subgroup
    was refused ("call node_groups(group, ranks=...) first")."""
    hg = fc.node_groups(world, ranks=SUB)
    before = registered()
    teardown()
    assert fc.node_groups(world, ranks=SUB) is hg, "the caller's node groups were dropped by the adapter"
    x = torch.randn(len(SUB) * 256)
    assert fc.reduce_scatter(x, world, hierarchical=True).shape == (256,)  # refused before the fix
    assert fc.all_gather(torch.randn(256), world, hierarchical=hg).shape == (len(SUB) * 256,)
    assert registered() == before, "the teardown destroyed or created process groups"


def test_megatron_uninstall_releases_only_its_hold_on_shared_node_groups(world, monkeypatch):
    """install(hierarchical=True) takes the node groups of every data-parallel group; the caller prepared the same
    ranks first, so both hold one set (no second set of groups). uninstall() leaves it to the caller, whose
    release then destroys it. Megatron's parallel state is mocked: PP=2 gives DP groups 0-3 and 4-7."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    import fp8comm.integrations.megatron as fm
    from fp8comm.integrations.megatron import ddp_hooks

    dp = world
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda *a, **k: dp)
    monkeypatch.setattr(ps, "get_expert_data_parallel_group", lambda *a, **k: dp)

    def all_gather_object(out, obj):  # the fake backend moves no bytes: every rank's node facts and DP groups
        for r in range(WORLD):
            out[r] = ((str(r // LOCAL), str(LOCAL), "h"), [tuple(SUB) if r < 4 else (4, 5, 6, 7)])

    from fp8comm.comm import topology

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(topology, "_TABLE", None)
    base = registered()
    hg = fc.node_groups(dp, ranks=SUB)
    mine = registered() - base  # rank 0's intra-node group and cross-node group
    assert mine == 2
    try:
        fm.install(
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
            grad_reduce=True,
            hierarchical=True,
        )
        assert ddp_hooks.hierarchical_groups(dp) is hg, "Megatron made a second set of groups for the same ranks"
    finally:
        fm.uninstall()
    assert registered() == base + mine
    assert fc.reduce_scatter(torch.randn(4 * 256), dp, hierarchical=True).shape == (256,)
    assert fc.release_node_groups() == 1
    assert registered() == base, "the last holder's release left the groups registered"


@pytest.mark.parametrize("how", ["shutdown", "release_node_groups", "lazy world groups, shutdown"])
def test_prepare_release_cycles_do_not_grow_the_registered_groups(world, how):
    """Old code: shutdown() forgot the node groups without destroying them, 2 more registered groups per cycle."""
    base = registered()
    for _ in range(3):
        if how.startswith("lazy"):
            fc.all_reduce(torch.randn(WORLD * 64), hierarchical=True)  # creates the world's node groups
        else:
            fc.node_groups(local_size=4)
        assert registered() == base + 2
        if how == "release_node_groups":
            assert fc.release_node_groups() == 1
        else:
            fc.shutdown()
        assert registered() == base, f"{how} left {registered() - base} process groups registered"


@pytest.mark.dist
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_shutdown_stops_the_gloo_threads_of_node_groups_while_the_world_lives():
    """On a real backend: a gloo group's threads stop when the group is destroyed and freed. Old shutdown() only
    forgot the node groups, so their threads ran until destroy_process_group() of the world (6 more here)."""
    body = """
        import json, os, time, torch, torch.distributed as dist

        def gloo_threads(want=None, wait=5.0):
            # torch names them pt_gloo_runloop / gloo_tcp_loop; a joined thread can stay listed for a moment
            end = time.monotonic() + wait
            while True:
                names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
                n = sum(name.startswith(("pt_gloo", "gloo")) for name in names)
                if want is None or n == want or time.monotonic() > end:
                    return n
                time.sleep(0.05)

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        import fp8comm.comm as fc

        base = gloo_threads()
        fc.all_reduce(torch.randn(512), hierarchical=fc.node_groups(local_size=1))
        up = gloo_threads()
        fc.shutdown()
        after = gloo_threads(want=base)
        dist.destroy_process_group()
        print(json.dumps({"base": base, "up": up, "after": after}))
        """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["up"] > got["base"], f"the node groups started no gloo threads to count: {got}"
    assert got["after"] == got["base"], f"gloo threads of destroyed node groups still running: {got}"


def test_the_last_holder_destroys_the_groups(world):
    """Two holders of one set: the first release keeps it working, the last destroys both of rank 0's groups;
    the released HierarchicalGroups is then refused, before any bytes move, saying what happened to it."""
    registry = dist.distributed_c10d._world.pg_map
    hg = fc.node_groups(world, ranks=SUB, holder="megatron")
    assert fc.node_groups(world, ranks=SUB) is hg  # the caller now holds the same set: no new groups
    x = torch.randn(len(SUB) * 256)
    assert fc.release_node_groups("megatron") == 0
    assert hg.intra in registry and hg.inter in registry
    assert fc.reduce_scatter(x, world, hierarchical=hg).shape == (256,)
    assert fc.release_node_groups() == 1 and fc.release_node_groups() == 0
    assert hg.intra not in registry and hg.inter not in registry
    with pytest.raises(Fp8CommError, match="released and destroyed"):
        fc.reduce_scatter(x, world, hierarchical=hg)
    with pytest.raises(Fp8CommError, match="subgroup: call fp8comm.comm.node_groups"):
        fc.reduce_scatter(x, world, hierarchical=True)  # nothing cached for the subgroup any more
    with pytest.raises(Fp8CommError, match="teardown"):
        fc.teardown("caller")  # an adapter cannot release the caller's hold


def test_clear_dtensor_caches_warns_once_for_a_missing_torch_name(monkeypatch):
    """Old code looked the private names up defensively and, when one was gone, silently cleared nothing there.
    Through fp8comm.shutdown(), which runs clear_dtensor_caches() once DTensor is loaded."""
    importlib.import_module("torch.distributed.tensor")
    monkeypatch.setattr(api, "_WARNED_MISSING", set(), raising=False)  # what earlier calls in this process warned
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fc.shutdown()
    assert [str(w.message) for w in got] == [], "this torch has every name: nothing to warn about"
    redistribute = importlib.import_module("torch.distributed.tensor._redistribute")
    monkeypatch.delattr(redistribute, "_planner_cache")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fc.shutdown()
        fc.shutdown()
    assert len(got) == 1, [str(w.message) for w in got]
    assert issubclass(got[0].category, RuntimeWarning)
    assert "torch.distributed.tensor._redistribute._planner_cache" in str(got[0].message)


# ------------------------------------------------------------------------ topology: the engines' default split
def test_split_decides_two_level_or_flat_with_the_reason():
    """fp8comm.comm.topology.split: pure, from the gathered table (so every rank decides alike)."""
    from fp8comm.comm import topology as topo

    t = topo.table_from([(str(r // 4), "4", "same-host") for r in range(8)])  # torchrun: 2 nodes x 4
    assert t.source == topo.TORCHRUN and t.nodes == (0, 0, 0, 0, 1, 1, 1, 1)
    s = topo.split(range(8), t)
    assert (s.two_level, s.local) == (True, 4), s
    s = topo.split([0, 2, 4, 6], t)  # strided (DP inside TP=2): 2 per node, still node-major
    assert (s.two_level, s.local, s.nodes) == (True, 2, (0, 0, 1, 1)), s
    assert "one member per node" in topo.split([0, 4], t).reason
    assert "all members on one node" in topo.split([0, 1, 2, 3], t).reason
    assert "uneven members per node {0: 2, 1: 1}" in topo.split([0, 1, 4], t).reason
    hosts = topo.table_from([(None, None, h) for h in ["a", "b", "a", "b"]])  # cyclic placement, no torchrun
    assert hosts.source == topo.HOSTS and hosts.nodes == (0, 1, 0, 1)
    assert "not consecutive" in topo.split(range(4), hosts).reason
    layout = topo.table_from([(None, "2", "h")] * 4)  # LOCAL_WORLD_SIZE alone: node-major ranks
    assert layout.source == topo.LAYOUT and layout.nodes == (0, 0, 1, 1)
    assert (
        topo.split(range(4), layout)
        .describe()
        .endswith("two-level (2 nodes x 2 ranks; 2 node(s) from LOCAL_WORLD_SIZE (node-major ranks))")
    )


def test_node_groups_with_an_explicit_node_per_member(world):
    """Strided members: intra = my node's members, inter = my local index across nodes; one set per ranks."""
    ranks, nodes = [0, 2, 4, 6], [0, 0, 1, 1]
    with pytest.raises(Fp8CommError, match="consecutive in group rank order"):
        fc.node_groups(ranks=ranks, nodes=[0, 1, 0, 1])
    with pytest.raises(Fp8CommError, match="local_size=4 but nodes gives 2"):
        fc.node_groups(ranks=ranks, nodes=nodes, local_size=4)
    base = registered()
    hg = fc.node_groups(ranks=ranks, nodes=nodes, holder="t")
    assert (hg.nodes, hg.local, hg.node, hg.local_rank) == (2, 2, 0, 0)
    assert registered() == base + 2  # rank 0's intra [0, 2] and inter [0, 4]
    assert fc.node_groups(ranks=ranks, local_size=2, holder="t") is hg  # the same set as the node-major form
    assert fc.release_node_groups("t") == 1


def test_prepare_gathers_once_and_turned_off_moves_nothing(world, monkeypatch):
    from fp8comm.comm import topology as topo

    calls = []

    def all_gather_object(out, obj):  # the fake backend moves no bytes: every rank's facts and groups
        calls.append(obj)
        for r in range(WORLD):
            out[r] = ((str(r // LOCAL), str(LOCAL), "h"), [tuple(SUB) if r < 4 else (4, 5, 6, 7)])

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    topo.forget()
    _, off = topo.prepare([SUB], holder="t", enabled=False)
    assert not calls and off[tuple(SUB)].reason == "two levels turned off"
    table, plan = topo.prepare([SUB], holder="t")
    assert len(calls) == 1 and calls[0][0] is not None and table.source == topo.TORCHRUN
    assert sorted(plan) == [(0, 1, 2, 3), (4, 5, 6, 7)] and all(s.two_level for s in plan.values())
    assert plan[(0, 1, 2, 3)].groups is not None and plan[(4, 5, 6, 7)].groups is None  # not a member
    topo.prepare([SUB], holder="t")
    assert calls[1][0] is None, "the node facts were gathered twice"
    fc.release_node_groups("t")
    topo.forget()
