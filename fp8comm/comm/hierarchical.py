"""Hierarchical mode: reduce inside a node at high precision (fp32), FP8 only across nodes.

Ranks n*local .. n*local+local-1 of the group form node n (torchrun's layout). `intra` holds my node's ranks,
`inter` the ranks with my local index on every node. reduce-scatter: intra-node fp32 reduce-scatter of the chunks
grouped by local index, then an FP8 reduce-scatter across nodes. all-gather: FP8 all-gather across nodes, then the
same bytes all-gathered inside the node (cheaper than high precision, and every rank decodes identical bytes).
"""

from __future__ import annotations

import os
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


_CACHE: dict[tuple, HierarchicalGroups | None] = {}


def node_groups(group=None, local_size: int | None = None, ranks: list[int] | None = None):
    """Node-local and cross-node subgroups of `group` (local size from LOCAL_WORLD_SIZE); cached per group.

    Collective over the WHOLE world, like dist.new_group: every process creates every node group in the same order
    (gloo groups built by members only deadlock once earlier groups differ in membership). For the world group the
    first hierarchical call does this; for a subgroup, call node_groups(group, ranks=its global ranks) on every
    rank first. Returns None on ranks outside `group`.
    """
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
        if me not in ranks:
            _CACHE[key] = None
        else:
            node, lr = divmod(ranks.index(me), local_size)
            _CACHE[key] = HierarchicalGroups(intra[node], inter[lr], nodes, local_size, node, lr)
    return _CACHE[key]


def precheck(hierarchical, group) -> tuple[int, tuple[str, str] | None]:
    """(node size, problem) for the metadata check; creates no group, so ranks that disagree cannot deadlock."""
    if hierarchical is None or hierarchical is False:
        return 0, None
    if isinstance(hierarchical, HierarchicalGroups):
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
    """The groups for a call that passed the metadata check (creates the world's node groups on first use)."""
    if hierarchical is None or hierarchical is False:
        return None
    if isinstance(hierarchical, HierarchicalGroups):
        return hierarchical
    return node_groups(group)


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
