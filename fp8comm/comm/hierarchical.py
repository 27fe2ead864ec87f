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

import torch
import torch.distributed as dist

from ..errors import Fp8CommError
from ..quant.wire import layout_of, unpack_chunks
from .core import Call, all_gather_bytes, quantize_input, rs_phase
from .feedback import ErrorFeedback


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
    group=None, local_size: int | None = None, ranks: list[int] | None = None, *, holder: str = CALLER
) -> HierarchicalGroups | None:
    """Node-local and cross-node subgroups of `group` (local size from LOCAL_WORLD_SIZE); cached per group and
    held by `holder` until release_node_groups(holder) (or fp8comm.shutdown()) on every rank.

    Collective over the WHOLE world, like dist.new_group: every process creates every node group in the same order
    (gloo groups built by members only deadlock once earlier groups differ in membership). For the world group the
    first hierarchical call does this; for a subgroup, call node_groups(group, ranks=its global ranks) on every
    rank first. A holder holds a set once however often it asks. Returns None on ranks outside `group`.
    """
    if not isinstance(holder, str) or not holder:
        raise Fp8CommError(f"node_groups: holder must be a non-empty string, got {holder!r}")
    entry = _entry(group, local_size, ranks)
    entry.holders.add(holder)
    return entry.mine


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
            _destroy(pg)
        destroyed += 1
    return destroyed


def _destroy(pg) -> None:
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


def hier_rs_phase(
    call: Call,
    hg: HierarchicalGroups,
    x: torch.Tensor,
    L: int,
    ef: ErrorFeedback | None,
    stats_dtype: torch.dtype,
    calls: int = 1,
):
    """Intra-node fp32 reduce-scatter now, then start the FP8 cross-node phase: (work, finish -> fp32 [L])."""
    dev, nn, lc = x.device, hg.nodes, hg.local
    total = call.world * L
    xin = quantize_input(call, x, total, None, dtype=torch.float32)
    # Chunk g = node*local + lr goes to global rank g; group the chunks by local index for the node-local step.
    perm = call.lease.take(total, torch.float32, dev)
    perm.view(lc, nn, L).copy_(xin.view(nn, lc, L).transpose(0, 1))
    part = call.lease.take(nn * L, torch.float32, dev)
    if lc > 1:
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(part, perm, op=dist.ReduceOp.SUM, group=hg.intra)
        call.record(call.op + ".intra", (lc - 1) * nn * L * 4, (lc - 1) * nn * L * 4, 0, calls=calls)
    else:
        part.copy_(perm)
    return rs_phase(call, part, L, hg.inter, nn, ef, call.op, stats_dtype, calls)


def hier_ag_phase(
    call: Call, hg: HierarchicalGroups, src: torch.Tensor, dest: torch.Tensor, stats_dtype: torch.dtype, calls: int = 1
):
    """FP8 cross-node all-gather now, start the node-local gather of the same bytes: (work, finish -> dest)."""
    spec, dev, n, nn, lc = call.spec, src.device, src.numel(), hg.nodes, hg.local
    one = layout_of((1,), n, spec.scaling)
    cb = one.total_bytes
    send = call.lease.take(cb, torch.uint8, dev)
    call.pack(src.reshape(1, n), one, send, call.kernel(dev, n))
    node_bytes = call.lease.take(nn * cb, torch.uint8, dev)
    all_gather_bytes(node_bytes, send, hg.inter, async_op=False)
    itemsize = stats_dtype.itemsize
    call.record(call.op, (nn - 1) * cb, (nn - 1) * n * itemsize, n, calls=calls)
    allb = call.lease.take(lc * nn * cb, torch.uint8, dev)
    work = all_gather_bytes(allb, node_bytes, hg.intra, async_op=True)
    call.record(call.op + ".intra", (lc - 1) * nn * cb, (lc - 1) * nn * n * itemsize, 0, calls=calls)

    def finish() -> torch.Tensor:
        # Bytes arrive as [local, node, chunk]; global rank order is node-major.
        ordered = call.lease.take(lc * nn * cb, torch.uint8, dev)
        ordered.view(nn, lc, cb).copy_(allb.view(lc, nn, cb).transpose(0, 1))
        layout = one.with_rows((1,) * call.world)
        unpack_chunks(ordered, layout, spec.fmt, dest.dtype, out=dest, backend=call.kernel(dev, call.world * n))
        return dest

    return work, finish
