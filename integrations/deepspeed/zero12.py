"""ZeRO-1/2 hooks: gradient reduction to the owner of each slice (FP8 or 4 bits: grad_reduce.py), and the
post-step weight gather (FP8 values, or 4-bit changes of the replica).

Weights: `all_gather_dp_groups` (after every optimizer step and after loading a checkpoint) gathers each rank's
updated bit16 partition into the flat model weights; the dispatcher routes on a tag on the engine's flat buffers
and uses fp8comm.comm.all_gather_into. The fp32 master partition is a separate tensor (checked after the build).
With weights.update_fmt, one fp8comm.comm.ReplicaUpdate per flat group sends each rank's change (fp32 master minus
its slice of the replica) in 4 bits and every rank applies the same decoded change to every slice: DeepSpeed's
write of bf16(master) into the owner's slice is undone first (the slice is kept before the step), so replicas stay
bit-identical. Inside a step the gather is started, not waited (OVERLAP_UPDATES): the change is quantized and on
the wire when the step returns, and is decoded and applied at the first forward use of the group's parameters (a
forward pre-hook on the modules owning them); a state_dict, a checkpoint save or load, the next step and detach()
wait what is still in flight first. A gather outside a step (checkpoint load, refresh) is a full one, waited at
once; a checkpoint carries each rank's slice of the replica so a resume restores the replica exactly. The numerics
guard watches each group's updates as bucket "update<g>" (4 bits -> FP8 -> a full gather in the replica's dtype).
"""

from __future__ import annotations

import torch.distributed as dist

import fp8comm.comm as fc
from fp8comm.errors import Fp8CommRuntimeError

from . import grad_reduce, planning, updates
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
    upd = es.cfg.weights.update_wire(es.cfg.check) if es.cfg.weights.enabled else None
    if upd is not None:
        es.updates = [fc.ReplicaUpdate(upd) for _ in opt.bit16_groups_flat]
        wrap_method(es, opt, "step", lambda orig: updates._stash_step(es, opt, orig))  # looked up late: tests patch it
        updates._attach_updates(es, engine)
    if es.cfg.gradients.enabled:
        layout: dict = {}
        wrap_method(es, opt, "average_tensor", lambda orig: grad_reduce.bucket_layout(es, opt, orig, layout))
        wrap_method(es, opt, "allreduce_and_scatter", lambda orig: grad_reduce.grad_reduce(es, opt, orig, layout))
        wrap_method(es, opt, "reduce_ipg_grads", lambda orig: grad_reduce.end_of_backward(es, orig))
        wrap_method(es, opt, "step", lambda orig: grad_reduce.flush_before_step(es, orig))


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
    if es.updates is not None:
        return updates._update_gather(es, groups_flat, partitioned_param_groups, dp_process_group)
    # One decision for the step's gather (DeepSpeed gathers every parameter group in one call): the plan at the
    # groups' total bytes, on the first group (every parameter group shares the DP layout), then the guard.
    dev, dtype = groups_flat[0].device, groups_flat[0].dtype
    nbytes = sum(f.numel() for f in groups_flat) * dtype.itemsize
    d = planning.decide(
        es, "weights", dev, False, op="all_gather", nbytes=nbytes, dtype=dtype, group=dp_process_group[0]
    )
    how, gb = d.how, d.guard
    if how == "bf16":  # the plan or the guard: DeepSpeed's own gather in the weights' dtype
        _count_native(es, partitioned_param_groups, dp_process_group)
        with planning.timed(es, d, "all_gather", nbytes, dtype, dev):
            return orig(
                groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor, allgather_bucket_size
            )
    with planning.timed(es, d, "all_gather", nbytes, dtype, dev):
        _quantized_gather(es, groups_flat, partitioned_param_groups, dp_process_group, d, gb)


def _quantized_gather(es, groups_flat, partitioned_param_groups, dp_process_group, d, gb) -> None:
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
            hg = es.hier(pg) if d.choice is None or d.choice.two_level else None
            fc.all_gather_into(flat, src, pg, config=wcfg, guard=gb, hierarchical=hg)
