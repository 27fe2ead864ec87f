"""Hierarchical mode: reduce inside a node at high precision (fp32), FP8 only across nodes.

Ranks n*local .. n*local+local-1 of the group form node n (torchrun's layout). `intra` holds my node's ranks,
`inter` the ranks with my local index on every node. reduce-scatter: intra-node fp32 reduce-scatter of the chunks
grouped by local index, then an FP8 reduce-scatter across nodes. all-gather: FP8 all-gather across nodes, then the
same bytes all-gathered inside the node (cheaper than high precision, and every rank decodes identical bytes).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import Fp8CommError


@dataclass(frozen=True)
class HierarchicalGroups:
    """My node's group (`intra`) and my cross-node group (`inter`) inside a parent group of nodes x local ranks."""

    intra: object
    inter: object
    nodes: int
    local: int
    node: int
    local_rank: int


CALLER = "caller"  # the holder of node_groups() calls that name none
LIBRARY = "fp8comm"  # the holder of the world's node groups that a hierarchical=True call created


# Node groups are held, never owned alone: a caller, an adapter (Megatron's hooks), the library. A holder releases
# its hold; the groups are destroyed when the last one does. fp8comm.shutdown() releases every holder.
@dataclass(eq=False)
class _Entry:
    groups: list  # every dist.new_group result, in creation order (NON_GROUP_MEMBER where I am not a member)
    mine: HierarchicalGroups | None  # None on ranks outside the parent group
    holders: set[str]


_CACHE: dict[tuple, _Entry] = {}  # (global ranks of the parent group, node size) -> its node groups
# id -> HierarchicalGroups whose groups were destroyed (by identity: a user's may hold unhashable stand-ins)
_RELEASED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def node_groups(
    group=None,
    local_size: int | None = None,
    ranks: list[int] | None = None,
    *,
    holder: str = CALLER,
    nodes: list[int] | None = None,
) -> HierarchicalGroups | None:
    """Node-local and cross-node subgroups of `group` (local size from LOCAL_WORLD_SIZE); cached per group and
    held by `holder` until release_node_groups(holder) (or fp8comm.shutdown()) on every rank.

    Without `nodes`, members ranks[n*local + i] form node n. `nodes` names each member's node explicitly (one id
    per member, in group rank order; fp8comm.comm.topology derives it): a strided group (Megatron's DP inside TP,
    ranks 0, 2, 4, 6 on nodes 0, 0, 1, 1) gets intra = the members on my node, inter = the members with my local
    index on every node. Every node must hold the same number of members, consecutive in group rank order (the
    two-level phases address chunk node*local + i); topology.split() says "flat" for groups that do not.

    Collective over the WHOLE world, like dist.new_group: every process creates every node group in the same order
    (gloo groups built by members only deadlock once earlier groups differ in membership). For the world group the
    first hierarchical call does this; for a subgroup, call node_groups(group, ranks=its global ranks) on every
    rank first. A holder holds a set once however often it asks. Returns None on ranks outside `group`.
    """
    if not isinstance(holder, str) or not holder:
        raise Fp8CommError(f"node_groups: holder must be a non-empty string, got {holder!r}")
    if nodes is not None:
        if ranks is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        local_size = _local_from_nodes(list(ranks), nodes, local_size)
    entry = _entry(group, local_size, ranks)
    entry.holders.add(holder)
    return entry.mine


def _local_from_nodes(ranks: list[int], nodes, local_size: int | None) -> int:
    """Members per node from an explicit node per member; refuses layouts the two-level phases cannot address."""
    nodes = [int(n) for n in nodes]
    if len(nodes) != len(ranks):
        raise Fp8CommError(f"node_groups: nodes has {len(nodes)} entries for a group of {len(ranks)} ranks")
    runs = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
    count = {n: nodes.count(n) for n in runs}
    if len(runs) != len(count) or len(set(count.values())) != 1:
        raise Fp8CommError(
            f"node_groups: every node must hold the same number of the group's members, consecutive in group rank "
            f"order; ranks {ranks} on nodes {nodes}"
        )
    local = next(iter(count.values()))
    if local_size is not None and local_size != local:
        raise Fp8CommError(f"node_groups: local_size={local_size} but nodes gives {local} members per node")
    return local


def _entry(group, local_size: int | None, ranks: list[int] | None) -> _Entry:
    """The cached node groups of the parent group, created (collective over the world) when missing."""
    if not dist.is_available() or not dist.is_initialized():
        raise Fp8CommError("torch.distributed is not initialized; call dist.init_process_group first")
    if local_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise Fp8CommError(
                "hierarchical=True needs LOCAL_WORLD_SIZE (set by torchrun) or explicit "
                "HierarchicalGroups / node_groups(local_size=...)"
            )
        local_size = int(env)
    if ranks is None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    ranks = [int(r) for r in ranks]
    world = len(ranks)
    if local_size <= 0 or world % local_size:
        raise Fp8CommError(f"hierarchical mode: group size {world} is not a multiple of the node size {local_size}")
    key = (tuple(ranks), local_size)
    if key not in _CACHE:
        nodes = world // local_size
        intra = [dist.new_group([ranks[n * local_size + i] for i in range(local_size)]) for n in range(nodes)]
        inter = [dist.new_group([ranks[n * local_size + i] for n in range(nodes)]) for i in range(local_size)]
        me = dist.get_rank()
        mine = None
        if me in ranks:
            node, lr = divmod(ranks.index(me), local_size)
            mine = HierarchicalGroups(intra[node], inter[lr], nodes, local_size, node, lr)
        _CACHE[key] = _Entry(intra + inter, mine, set())
    return _CACHE[key]


def release_node_groups(holder: str = CALLER) -> int:
    """Drop `holder`'s hold on every node-group set it took; destroys the sets no one holds any more and returns
    how many. Call it on every rank in the same order (destroying a group must happen alike everywhere).

    Other holders' sets stay usable: an adapter's teardown releases its own holder, never the caller's."""
    return _release(lambda e: e.holders.discard(holder))


def release_all_node_groups() -> int:
    """Drop every holder's hold and destroy every node group fp8comm made (fp8comm.shutdown())."""
    return _release(lambda e: e.holders.clear())


def _release(drop) -> int:
    destroyed = 0
    # Newest first, as torch destroys the world's groups; creation order is the same on every rank, so is this.
    for key, entry in reversed(list(_CACHE.items())):
        drop(entry)
        if entry.holders:
            continue
        del _CACHE[key]
        if entry.mine is not None:
            _RELEASED[id(entry.mine)] = entry.mine
        for pg in reversed(entry.groups):
            destroy_group(pg)
        destroyed += 1
    return destroyed


def destroy_group(pg) -> None:
    """dist.destroy_process_group(pg) for a group of ours still registered (a member's group, the world alive)."""
    if not isinstance(pg, dist.ProcessGroup) or not dist.is_initialized():
        return  # NON_GROUP_MEMBER; or the world is gone, and every group with it
    try:
        dist.destroy_process_group(pg)
    except ValueError:  # "Invalid process group specified": destroyed already (the world destroyed, re-initialized)
        pass


def precheck(hierarchical, group) -> tuple[int, tuple[str, str] | None]:
    """(node size, problem) for the metadata check; creates no group, so ranks that disagree cannot deadlock."""
    if hierarchical is None or hierarchical is False:
        return 0, None
    if isinstance(hierarchical, HierarchicalGroups):
        if _RELEASED.get(id(hierarchical)) is hierarchical:
            return 0, (
                "option",
                "hierarchical: these node groups were released and destroyed (release_node_groups(), an adapter's "
                "teardown or fp8comm.shutdown()); prepare them again with fp8comm.comm.node_groups(...) on every rank",
            )
        return hierarchical.local, None
    if hierarchical is not True:
        return 0, ("option", f"hierarchical must be None/False, True or HierarchicalGroups, got {hierarchical!r}")
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        return 0, (
            "option",
            "hierarchical=True needs LOCAL_WORLD_SIZE (set by torchrun) or a HierarchicalGroups "
            "from node_groups(local_size=...)",
        )
    local = int(env)
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        ranks = tuple(dist.get_process_group_ranks(group))
        if (ranks, local) not in _CACHE:
            # Creating groups is collective over the whole world; members alone would deadlock.
            return 0, (
                "option",
                "hierarchical=True on a subgroup: call fp8comm.comm.node_groups(group, ranks=...) "
                "on every rank of the world first, or pass hierarchical=<HierarchicalGroups>",
            )
    return local, None


def resolve_groups(hierarchical, group) -> HierarchicalGroups | None:
    """The groups for a call that passed the metadata check (precheck refused destroyed ones): the cached set of
    `group`, whoever holds it, else the world's, created now and held by the library."""
    if hierarchical is None or hierarchical is False:
        return None
    if isinstance(hierarchical, HierarchicalGroups):
        return hierarchical
    entry = _entry(group, None, None)
    if not entry.holders:  # created just now: every rank is in this world-wide call (precheck refused subgroups)
        entry.holders.add(LIBRARY)
    return entry.mine
