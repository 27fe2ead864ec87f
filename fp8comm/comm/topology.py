"""Which node every rank is on, and whether a group's collectives can run in two levels (the adapters' default).

Nodes, in this order of preference (from one table that every rank gathered, so every rank decides alike):
1. torchrun's GROUP_RANK (the node's index) on every rank;
2. LOCAL_WORLD_SIZE alone on every rank (same value): torchrun's node-major layout, rank r on node r // L;
3. the host names (socket.gethostname()), numbered in order of first appearance.
A simulated cluster (network namespaces) gives every node the same host name, so there only 1./2. can work.

A group runs two-level when it spans more than one node, holds the same number (> 1) of its members on every node,
and its members are consecutive per node in the group's rank order (node-major: what fp8comm.comm's two-level
phases need). Anything else runs flat, with the reason (Split.reason).

prepare(rank_lists, holder=...) is collective over the WHOLE world: one all_gather_object carries every rank's
node facts (gathered once per world, then cached) and its groups; node groups are then created for the union of
everyone's groups in one sorted order, so dist.new_group sees the same members at the same index on every rank.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch.distributed as dist

from ..errors import Fp8CommError
from .hierarchical import HierarchicalGroups, node_groups

TORCHRUN = "GROUP_RANK"
LAYOUT = "LOCAL_WORLD_SIZE"
HOSTS = "host names"


@dataclass(frozen=True)
class NodeTable:
    """Node index of every global rank, and where it came from (TORCHRUN, LAYOUT or HOSTS)."""

    nodes: tuple[int, ...]
    source: str

    @property
    def count(self) -> int:
        return len(set(self.nodes))

    def describe(self) -> str:
        how = {
            TORCHRUN: "torchrun's GROUP_RANK",
            LAYOUT: "LOCAL_WORLD_SIZE (node-major ranks)",
            HOSTS: "host names",
        }[self.source]
        return f"{self.count} node(s) from {how}"


@dataclass(frozen=True)
class Split:
    """The decision for one group: two-level (local > 0 members per node) or flat, with the reason; `groups` is this
    rank's HierarchicalGroups after prepare() (None when flat or when this rank is not a member)."""

    ranks: tuple[int, ...]
    nodes: tuple[int, ...]  # node index of each member, in the group's rank order
    local: int  # members per node when two-level, 0 when flat
    reason: str
    source: str = ""
    groups: HierarchicalGroups | None = None

    @property
    def two_level(self) -> bool:
        return self.local > 0

    def describe(self) -> str:
        """One log line's worth: which mode and why."""
        head = f"group of {len(self.ranks)} ranks {_short(self.ranks)}"
        if self.two_level:
            return f"{head}: two-level ({len(self.ranks) // self.local} nodes x {self.local} ranks; {self.reason})"
        return f"{head}: flat ({self.reason})"


def _short(ranks: Sequence[int]) -> str:
    r = list(ranks)
    return str(r) if len(r) <= 8 else f"[{', '.join(map(str, r[:4]))}, ..., {r[-1]}]"


def _local_facts() -> tuple[str | None, str | None, str]:
    return os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_WORLD_SIZE"), socket.gethostname()


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def table_from(facts: Sequence[tuple]) -> NodeTable:
    """The node table from every rank's (GROUP_RANK, LOCAL_WORLD_SIZE, host name), in global rank order."""
    groups = [_int(f[0]) for f in facts]
    locals_ = [_int(f[1]) for f in facts]
    if all(g is not None for g in groups):
        return NodeTable(tuple(int(g) for g in groups if g is not None), TORCHRUN)
    if all(v is not None and v > 0 for v in locals_) and len(set(locals_)) == 1:
        lws = int(locals_[0] or 1)
        if len(facts) % lws == 0:
            return NodeTable(tuple(r // lws for r in range(len(facts))), LAYOUT)
    index: dict[str, int] = {}
    return NodeTable(tuple(index.setdefault(str(f[2]), len(index)) for f in facts), HOSTS)


# (world group, its table): the table is gathered once per world (a re-initialized world gathers again).
_TABLE: tuple[weakref.ReferenceType | None, int, NodeTable] | None = None


def _world_key():
    w = dist.group.WORLD
    try:
        return weakref.ref(w), id(w)
    except TypeError:
        return None, id(w)


def _cached() -> NodeTable | None:
    if _TABLE is None:
        return None
    ref, ident, table = _TABLE
    w = dist.group.WORLD
    if id(w) != ident or (ref is not None and ref() is not w):
        return None
    return table


def _remember(table: NodeTable) -> None:
    global _TABLE
    ref, ident = _world_key()
    _TABLE = (ref, ident, table)


def forget() -> None:
    """Drop the cached node table (the next node_table()/prepare() gathers again)."""
    global _TABLE
    _TABLE = None


def _gather(payload) -> tuple[NodeTable, list]:
    """One all_gather_object over the world: every rank's payload, plus the node table (built on first use)."""
    if not dist.is_available() or not dist.is_initialized():
        raise Fp8CommError("torch.distributed is not initialized; call dist.init_process_group first")
    table = _cached()
    mine = (None if table is not None else _local_facts(), payload)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if table is None:
        table = table_from([e[0] for e in everyone])
        _remember(table)
    return table, [e[1] for e in everyone]


def node_table() -> NodeTable:
    """The node of every global rank; collective over the world the first time (one all_gather_object), cached."""
    table = _cached()
    return table if table is not None else _gather(None)[0]


def split(ranks: Sequence[int], table: NodeTable) -> Split:
    """Two-level or flat for the group whose global ranks, in group rank order, are `ranks` (no communication)."""
    ranks = tuple(int(r) for r in ranks)
    if any(r < 0 or r >= len(table.nodes) for r in ranks):
        raise Fp8CommError(f"group ranks {list(ranks)} are not all ranks of the {len(table.nodes)}-rank world")
    nodes = tuple(table.nodes[r] for r in ranks)
    src = table.describe()
    count: dict[int, int] = {}
    for n in nodes:
        count[n] = count.get(n, 0) + 1
    flat = lambda why: Split(ranks, nodes, 0, why, table.source)
    if len(ranks) < 2:
        return flat("one rank: nothing to move")
    if len(count) == 1:
        return flat(f"all members on one node; {src}")
    per = set(count.values())
    if per == {1}:
        return flat(f"one member per node, nothing to sum inside a node; {src}")
    if len(per) > 1:
        return flat(f"uneven members per node {dict(sorted(count.items()))}; {src}")
    runs = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
    if len(runs) != len(count):
        return flat(f"members of a node are not consecutive in the group's rank order (nodes {list(nodes)}); {src}")
    return Split(ranks, nodes, per.pop(), src, table.source)


def prepare(
    rank_lists: Iterable[Sequence[int]], *, holder: str, enabled: bool = True
) -> tuple[NodeTable, dict[tuple[int, ...], Split]]:
    """Decide every group of every rank and create the node groups of those that run two-level.

    Collective over the WHOLE world: every rank calls it, in the same place, with the rank lists of the groups it
    will issue collectives on (global ranks, group rank order). Returns the node table and {ranks: Split} for the
    union of everyone's groups (identical on every rank but for `groups`, which is this rank's own). With
    enabled=False nothing is gathered or created: this rank's groups, all flat ("two levels turned off")."""
    mine = sorted({tuple(int(r) for r in rl) for rl in rank_lists})
    if not enabled:  # nothing to create, so nothing to agree on: no communication
        return _cached() or NodeTable((), ""), {r: Split(r, (), 0, "two levels turned off") for r in mine}
    table, everyone = _gather(mine)
    out: dict[tuple[int, ...], Split] = {}
    for ranks in sorted({tuple(rl) for lists in everyone for rl in lists}):
        s = split(ranks, table)
        if s.two_level:
            s = replace(s, groups=node_groups(ranks=list(ranks), nodes=list(s.nodes), holder=holder))
        out[ranks] = s
    return table, out


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of `group` in group rank order (the world for None)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(int(r) for r in dist.get_process_group_ranks(group))
