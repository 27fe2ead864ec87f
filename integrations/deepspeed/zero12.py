"""ZeRO-1/2 hooks: FP8 gradient reduction to the owner of each slice, and the FP8 post-step weight all-gather.

Gradients (wrapped per optimizer instance, so only fp8comm engines are touched): DeepSpeed's `average_tensor`
splits the reduce bucket into slices, each owned by one rank's optimizer partition, and hands them to
`allreduce_and_scatter`, which all-reduces the whole bucket and lets each owner copy its slices. The hook keeps
that contract but moves each slice only to its owner: every slice is cut at parameter boundaries (DeepSpeed merges
neighbouring slices of one owner, differently on the owner and on the other ranks), each parameter's piece starts
on a row of `block_size` elements of its own, ONE fp8comm.comm.all_to_all (1 x block_size scales per row) delivers
every sender's copy of my pieces as FP8 codes + scales, and I decode each contribution straight into fp32 and sum
them in fp32 in rank order (the sum DeepSpeed's fp32 gradient partition receives; a bf16 decode would round each
contribution first). inf/NaN in any block arrives as inf/NaN, so DeepSpeed's overflow check still fires. Slices
several ranks consume (Muon) keep DeepSpeed's own all-reduce (counted). With error feedback each parameter's
residual (residuals.py) is assembled into the send layout and scattered back after the call.

Weights: `all_gather_dp_groups` (after every optimizer step and after loading a checkpoint) gathers each rank's
updated bit16 partition into the flat model weights; the dispatcher routes on a tag on the engine's flat buffers
and uses fp8comm.comm.all_gather_into. The fp32 master partition is a separate tensor (checked after the build).
"""

from __future__ import annotations

import bisect
import functools

import torch
import torch.distributed as dist

import fp8comm.comm as fc
from fp8comm.errors import Fp8CommRuntimeError, Fp8CommStateError

from .compat import S12
from .patching import PASSTHROUGH, owner, tag, wrap_method


def install(patcher, role: str) -> None:
    """The process-wide dispatcher of `role` (the gradient hook is per optimizer instance: attach())."""
    if role == "weights":
        patcher.set(S12, "all_gather_dp_groups", _dispatch_param_gather)


def attach(es, engine) -> None:
    """Tag this engine's flat weight buffers and wrap its optimizer's gradient reduction."""
    opt = engine.optimizer
    if es.cfg.weights.enabled:
        for flat in opt.bit16_groups_flat:
            tag(es, flat)
    if es.cfg.gradients.enabled:
        layout: dict = {}
        wrap_method(es, opt, "average_tensor", lambda orig: _bucket_layout(es, opt, orig, layout))
        wrap_method(es, opt, "allreduce_and_scatter", lambda orig: _grad_reduce(es, opt, orig, layout))


def _owner(ranks) -> int | None:
    if isinstance(ranks, int):
        return ranks
    if isinstance(ranks, frozenset) and len(ranks) == 1:
        return next(iter(ranks))
    return None


def _bucket_layout(es, opt, orig, layout: dict):
    """average_tensor(tensor, dtype): remember which parameters the flat bucket holds, in order (names, sizes)."""

    @functools.wraps(orig)
    def average_tensor(tensor, communication_data_type):
        bucket = opt.ipg_buckets[communication_data_type]
        params = [opt.bit16_groups[g][i] for g, i, _ in bucket.params]
        starts, n = [], 0
        for p in params:
            starts.append(n)
            n += p.numel()
        layout["cur"] = (tensor, starts, [(es.name_of(p), p.numel()) for p in params])
        try:
            return orig(tensor, communication_data_type)
        finally:
            layout.pop("cur", None)

    return average_tensor


def _segments(t: torch.Tensor, cur) -> list[tuple[int, int, str | None, int, int]]:
    """[(offset in t, length, parameter name, its numel, offset in the parameter)] covering slice t."""
    if cur is None:
        return [(0, t.numel(), None, 0, 0)]
    base, starts, params = cur
    off = (t.data_ptr() - base.data_ptr()) // t.element_size()
    if t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or off < 0 or off + t.numel() > base.numel():
        return [(0, t.numel(), None, 0, 0)]
    out, i, pos, end = [], bisect.bisect_right(starts, off) - 1, off, off + t.numel()
    while pos < end and i < len(params):
        pend = starts[i] + params[i][1]
        n = min(end, pend) - pos
        if n > 0:
            out.append((pos - off, n, params[i][0], params[i][1], pos - starts[i]))
        pos += max(n, 0)
        i += 1
    return out


def _grad_reduce(es, opt, orig, layout: dict):
    cfg = es.cfg.gradients
    wcfg = cfg.wire(es.cfg.check)
    H = cfg.block_size

    @functools.wraps(orig)
    def allreduce_and_scatter(
        bucket, communication_data_type, numel_per_bucket=500000000, log=None, divide=True, process_group=None
    ):
        pg = opt.dp_process_group if process_group is None else process_group
        me, world = dist.get_rank(group=pg), dist.get_world_size(group=pg)
        items = [(b[0], b[1], b[2] if len(b) > 2 else None) for b in bucket]
        shared = [b for b, it in zip(bucket, items) if _owner(it[0]) is None]
        owned_raw = [b for b, it in zip(bucket, items) if _owner(it[0]) is not None]
        owned = [it for it in items if _owner(it[0]) is not None]
        comm_dtype = communication_data_type
        if opt.sequence_parallel_size > 1:  # DeepSpeed reduces in fp32 then (allreduce_bucket)
            comm_dtype = torch.float32
        itemsize = comm_dtype.itemsize
        if shared:  # consumed by several ranks: DeepSpeed's own all-reduce, counted as such
            n = 2 * (world - 1) * sum(b[1].numel() for b in shared) * itemsize // world
            es.acct.add("gradients", n, n, False)
            es.acct.hit("zero12.grad_reduce.shared_allreduce")
            orig(shared, communication_data_type, numel_per_bucket, log, divide, process_group)
        if not owned:
            return
        n_total = sum(t.numel() for _, t, _ in owned)
        # DeepSpeed's own path all-reduces the whole bucket: a ring moves 2 (world-1)/world of it per rank.
        baseline = 2 * (world - 1) * n_total * itemsize // world
        es.acct.hit("zero12.grad_reduce")
        how, gb = ("fp8", None) if es.cfg.measure_only or world == 1 else es.route("gradients", owned[0][1].device)
        if es.cfg.measure_only or world == 1 or how == "bf16":  # guard fallback: residuals kept for the next FP8 step
            if world > 1:
                es.acct.add("gradients", baseline, baseline, False)
            return orig(owned_raw, communication_data_type, numel_per_bucket, log, divide, process_group)
        scale = None
        if divide and opt.gradient_average:  # same factor allreduce_bucket would divide by
            scale = float(opt.sequence_parallel_size) / world
        cur = layout.get("cur")
        # Per owner: (item, its pieces); each piece (one parameter's part of a slice) starts on a row of its own,
        # so the layout is the same on every rank and a block never mixes two parameters.
        per_owner = [[] for _ in range(world)]
        for ranks, t, out in owned:
            per_owner[_owner(ranks)].append((t, out, _segments(t, cur)))
        if cur is None:
            es.acct.hit("zero12.grad_reduce.unsegmented")
            if es.residuals is not None:
                raise Fp8CommStateError(
                    "fp8comm ZeRO-1/2 error feedback: allreduce_and_scatter was called outside "
                    "average_tensor, so its slices cannot be keyed by parameter"
                )
        rows = [sum(-(-n // H) for _, _, segs in s for _, n, *_ in segs) for s in per_owner]
        send = torch.zeros(sum(rows), H, dtype=comm_dtype, device=owned[0][1].device)
        flat, row0, pieces = send.view(-1), 0, []
        for s in per_owner:
            for t, _, segs in s:
                v = t.reshape(-1)
                for a, n, name, numel, poff in segs:
                    flat[row0 * H : row0 * H + n].copy_(v[a : a + n])
                    pieces.append((name, numel, poff, row0 * H, n))
                    row0 += -(-n // H)
        ef = None if es.residuals is None else es.residuals.assemble(pieces, send.numel(), send.device)
        with es.acct.fp8("gradients", baseline=baseline), torch.no_grad():
            q = fc.all_to_all(
                send, [rows[me]] * world, rows, pg, wire="fp8", fp8_out=True, config=wcfg, error_feedback=ef, guard=gb
            )
        if ef is not None:
            es.residuals.scatter(ef, pieces, send.numel())
        # Every sender's contribution decoded straight into fp32, summed in fp32 in rank order.
        dec = q.dequantize(torch.float32).view(world, rows[me] * H)
        acc = dec[0].clone()
        for r in range(1, world):
            acc += dec[r]
        if scale is not None:
            acc.mul_(scale)
        off = 0
        for t, out, segs in per_owner[me]:
            v = t.view(-1)
            ov = None if out is None else out.view(-1)
            for a, n, *_ in segs:
                part = acc[off : off + n]
                if ov is not None:  # the fp32 sum straight into DeepSpeed's fp32 gradient partition
                    opt._add_to_grad_partition_buffer(ov[a : a + n], part)
                v[a : a + n].copy_(part)
                off += -(-n // H) * H

    return allreduce_and_scatter


def _dispatch_param_gather(orig):
    """all_gather_dp_groups: FP8 for the flat buffers of an fp8comm engine with weights on, DeepSpeed's otherwise."""

    def all_gather_dp_groups(
        groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor, allgather_bucket_size
    ):
        es = owner(groups_flat[0]) if len(groups_flat) else None
        if es is None or not es.cfg.weights.enabled:
            PASSTHROUGH.hit("zero12.param_gather")
            return orig(
                groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor, allgather_bucket_size
            )
        return _param_gather(
            es,
            orig,
            groups_flat,
            partitioned_param_groups,
            dp_process_group,
            start_alignment_factor,
            allgather_bucket_size,
        )

    return all_gather_dp_groups


def _count_native(es, partitioned_param_groups, dp_process_group) -> None:
    """Count DeepSpeed's own gather of the partitions (measure mode, guard fallback)."""
    for parts, pg in zip(partitioned_param_groups, dp_process_group):
        world = dist.get_world_size(group=pg)
        if world > 1:
            me = dist.get_rank(group=pg)
            n = (world - 1) * parts[me].numel() * parts[me].element_size()
            es.acct.add("weights", n, n, False)


def _param_gather(
    es, orig, groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor, allgather_bucket_size
):
    if es.cfg.measure_only:
        _count_native(es, partitioned_param_groups, dp_process_group)
        return orig(
            groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor, allgather_bucket_size
        )
    how, gb = es.route("weights", groups_flat[0].device)
    if how == "bf16":  # the guard: DeepSpeed's own gather in the weights' dtype
        _count_native(es, partitioned_param_groups, dp_process_group)
        return orig(
            groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor, allgather_bucket_size
        )
    wcfg = es.cfg.weights.wire(es.cfg.check)
    for flat, parts, pg in zip(groups_flat, partitioned_param_groups, dp_process_group):
        me, world = dist.get_rank(group=pg), dist.get_world_size(group=pg)
        if world == 1:
            continue  # nothing to gather (DeepSpeed skips it too)
        src = parts[me]
        if flat.numel() != world * src.numel():
            raise Fp8CommRuntimeError(
                f"fp8comm ZeRO-1/2 weight gather: flat group has {flat.numel()} elements, "
                f"expected world ({world}) x partition ({src.numel()})"
            )
        es.check_not_master(flat, "ZeRO-1/2 weight all-gather")
        with es.acct.fp8("weights"):
            fc.all_gather_into(flat, src, pg, config=wcfg, guard=gb)
