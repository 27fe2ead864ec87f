"""ZeRO-1/2 hooks: FP8 gradient reduction to the owner of each slice, and the FP8 post-step weight all-gather.

Gradients: DeepSpeed's `average_tensor` splits the reduce bucket into slices, each owned by one rank's optimizer
partition, and hands them to `allreduce_and_scatter`, which all-reduces the whole bucket and lets each owner copy
its slices. The hook keeps that contract but moves each slice only to its owner: slices are grouped per owner
into rows of `block_size` elements (each slice on rows of its own), ONE fp8comm.comm.all_to_all (1 x block_size
scales per row, payload and scales in one byte buffer) delivers every sender's copy of my slices, and I sum them
in fp32. That is a
reduce-scatter with uneven, owner-defined chunks; inf/NaN in any block arrives as inf/NaN, so DeepSpeed's
overflow check still fires. Slices several ranks consume (Muon) keep DeepSpeed's own all-reduce.

Weights: `all_gather_dp_groups` (after every optimizer step and after loading a checkpoint) gathers each rank's
updated bit16 partition into the flat model weights; the hook does it with fp8comm.comm.all_gather_into. The
fp32 master partition is a separate tensor (checked after the engine is built), so the lossy copy only ever
lands in the model weights, which every rank, the owner included, decodes from the same bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import fp8comm.comm as fc

from .compat import S12
from fp8comm.errors import Fp8CommRuntimeError


def install(patcher, state) -> None:
    if state.cfg.gradients.enabled:
        patcher.set(S12, "DeepSpeedZeroOptimizer.allreduce_and_scatter", lambda orig: _grad_reduce(state, orig))
    if state.cfg.weights.enabled:
        patcher.set(S12, "all_gather_dp_groups", lambda orig: _param_gather(state, orig))


def _owner(ranks) -> int | None:
    if isinstance(ranks, int):
        return ranks
    if isinstance(ranks, frozenset) and len(ranks) == 1:
        return next(iter(ranks))
    return None


def _grad_reduce(state, orig):
    wire = state.cfg.gradients
    wcfg = wire.wire(state.cfg.check)
    H = wire.block_size

    def allreduce_and_scatter(self, bucket, communication_data_type, numel_per_bucket=500000000, log=None,
                              divide=True, process_group=None):
        pg = self.dp_process_group if process_group is None else process_group
        me, world = dist.get_rank(group=pg), dist.get_world_size(group=pg)
        items = [(b[0], b[1], b[2] if len(b) > 2 else None) for b in bucket]
        shared = [b for b, it in zip(bucket, items) if _owner(it[0]) is None]
        owned_raw = [b for b, it in zip(bucket, items) if _owner(it[0]) is not None]
        owned = [it for it in items if _owner(it[0]) is not None]
        if shared:  # consumed by several ranks: DeepSpeed's own all-reduce
            orig(self, shared, communication_data_type, numel_per_bucket, log, divide, process_group)
        if not owned:
            return
        comm_dtype = communication_data_type
        if self.sequence_parallel_size > 1:  # DeepSpeed reduces in fp32 then (allreduce_bucket)
            comm_dtype = torch.float32
        n_total = sum(t.numel() for _, t, _ in owned)
        itemsize = comm_dtype.itemsize
        # DeepSpeed's own path all-reduces the whole bucket: a ring moves 2 (world-1)/world of it per rank.
        baseline = 2 * (world - 1) * n_total * itemsize // world
        state.acct.hit("zero12.grad_reduce")
        if state.cfg.measure_only or world == 1:
            if world > 1:
                state.acct.add("gradients", baseline, baseline, False)
            return orig(self, owned_raw, communication_data_type, numel_per_bucket, log, divide, process_group)
        scale = None
        if divide and self.gradient_average:  # same factor allreduce_bucket would divide by
            scale = float(self.sequence_parallel_size) / world
        per_owner = [[] for _ in range(world)]
        for ranks, t, out in owned:
            per_owner[_owner(ranks)].append((t, out))
        # Each slice starts on a row of its own: a block never mixes two parameters (see zero3.py for why).
        rows = [sum(-(-t.numel() // H) for t, _ in s) for s in per_owner]
        send = torch.zeros(sum(rows), H, dtype=comm_dtype, device=owned[0][1].device)
        flat, row0 = send.view(-1), 0
        for s in per_owner:
            for t, _ in s:
                flat[row0 * H:row0 * H + t.numel()].copy_(t.reshape(-1))
                row0 += -(-t.numel() // H)
        with state.acct.fp8("gradients", baseline=baseline), torch.no_grad():
            recv = fc.all_to_all(send, [rows[me]] * world, rows, pg, wire="fp8", config=wcfg)
        acc = recv.view(world, rows[me] * H).float().sum(0)
        if scale is not None:
            acc.mul_(scale)
        off = 0
        for t, out in per_owner[me]:
            part = acc[off:off + t.numel()].view_as(t)
            self._add_to_grad_partition_buffer(out, part)  # fp32 sum straight into DeepSpeed's fp32 partition
            t.copy_(part)
            off += -(-t.numel() // H) * H

    return allreduce_and_scatter


def _param_gather(state, orig):
    wcfg = state.cfg.weights.wire(state.cfg.check)

    def all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                             allgather_bucket_size):
        if state.cfg.measure_only:
            for parts, pg in zip(partitioned_param_groups, dp_process_group):
                world = dist.get_world_size(group=pg)
                if world > 1:
                    me = dist.get_rank(group=pg)
                    n = (world - 1) * parts[me].numel() * parts[me].element_size()
                    state.acct.add("weights", n, n, False)
            return orig(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                        allgather_bucket_size)
        for flat, parts, pg in zip(groups_flat, partitioned_param_groups, dp_process_group):
            me, world = dist.get_rank(group=pg), dist.get_world_size(group=pg)
            if world == 1:
                continue  # nothing to gather (DeepSpeed skips it too)
            src = parts[me]
            if flat.numel() != world * src.numel():
                raise Fp8CommRuntimeError(f"fp8comm ZeRO-1/2 weight gather: flat group has {flat.numel()} elements, "
                                   f"expected world ({world}) x partition ({src.numel()})")
            state.check_not_master(flat, "ZeRO-1/2 weight all-gather")
            with state.acct.fp8("weights"):
                fc.all_gather_into(flat, src, pg, config=wcfg)

    return all_gather_dp_groups
