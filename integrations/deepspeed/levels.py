"""Two-level (hierarchical) collectives for an fp8comm engine: which groups, decided and prepared at build.

Every DeepSpeed group the hooks issue collectives on (ZeRO-1/2: the DP group of every param group; ZeRO-3: the DP
group, each parameter's partition group, the hpZ secondary group, and the world for qgZ) is decided by
fp8comm.comm.topology once, at engine build, on every rank in one order (creating groups is collective over the
whole world): two-level when it spans nodes with more than one member on each, flat otherwise, one log line per
group. The hooks look their group up here and never create one; the MoE all-to-all stays flat (ZeRO-1/2's
unbalanced buckets take the two-level all-to-all to the owners, grad_reduce.py; the 4-bit weight-update gather takes
the DP group's node groups, updates.py).

Error feedback: the engine keeps one residual per parameter; a two-level reduce-scatter keeps the residual of its
cross-node phase only (the node-summed chunks of my rail, [nodes, L]), which rail_window() names in the send
buffer's layout [group, L] for Residuals.assemble (the other local ranks' chunks: zero here, theirs to keep).
"""

from __future__ import annotations

from fp8comm.comm import HierarchicalGroups
from fp8comm.comm import topology as topo

HOLDER = "deepspeed"  # the fp8comm.comm.node_groups holder (released by uninstall(): fp8comm.comm.teardown)
FLAT_NOTE = "MoE all-to-all stays flat"


def _ranks(group) -> tuple[int, ...] | None:
    if group is None:
        return topo.group_ranks(None)
    try:
        return topo.group_ranks(group)
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return None


def comm_groups(engine) -> list[tuple[int, ...]]:
    """Global ranks of every group this rank's engine may issue an fp8comm collective on."""
    opt = engine.optimizer
    found: list = [getattr(opt, "dp_process_group", None)]
    found += list(getattr(opt, "real_dp_process_group", None) or [])
    if engine.zero_optimization_stage() == 3:
        found.append(None)  # qgZ reduces over the world
        for p in engine.module.parameters():
            found.append(getattr(p, "ds_process_group", None))
            found.append(getattr(p, "ds_zero_param_process_group", None))
    out = []
    for g in found:
        r = _ranks(g)
        if r is not None and r not in out:
            out.append(r)
    return out


def prepare(engine, enabled: bool) -> dict[tuple[int, ...], topo.Split]:
    """{ranks: Split} for the union of every rank's groups (collective over the world, every rank at build)."""
    _, plan = topo.prepare(comm_groups(engine), holder=HOLDER, enabled=enabled)
    return plan


def groups_for(splits: dict, group, warned: set) -> HierarchicalGroups | None:
    """The node groups of `group` (None: it runs flat). A group not seen at build runs flat, with one warning."""
    if not splits:
        return None
    ranks = _ranks(group)
    s = splits.get(ranks) if ranks is not None else None
    if s is None:
        if ranks not in warned:
            warned.add(ranks)
            from .patching import log

            log.warning(
                f"fp8comm: a collective over ranks {list(ranks) if ranks else ranks} runs flat: that group was not "
                "among the engine's groups at build, and node groups cannot be created by its members alone"
            )
        return None
    return s.groups


def signature(splits: dict) -> list:
    """What the residual layout depends on: the two-level groups and their node size (empty: all flat)."""
    return sorted([list(s.ranks), s.local] for s in splits.values() if s.two_level)


def rail_window(total: int, hg: HierarchicalGroups | None) -> list[tuple[int, int, int]] | None:
    """The send-buffer ranges a two-level reduce-scatter's residual covers, for Residuals.assemble: my local
    index's chunk of every node ([nodes, local, L] layout), packed node after node; None when flat (all of it).
    The other local ranks' chunks are theirs: their error is made (and kept) on their rails."""
    if hg is None:
        return None
    chunk = total // (hg.nodes * hg.local)
    starts = [(m * hg.local + hg.local_rank) * chunk for m in range(hg.nodes)]
    return [(s, s + chunk, m * chunk) for m, s in enumerate(starts)]


def describe(splits: dict) -> list[str]:
    return [f"fp8comm: {s.describe()}" for s in splits.values()]
