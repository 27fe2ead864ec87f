"""DeepSpeed ZeRO-1/2 with weights.update_fmt: each step's weight CHANGE of the bit16 replica travels in 4 bits
(fp8comm.comm.ReplicaUpdate, one per flat parameter group), gathered from inside the optimizer step and waited at
the first forward use of the group's parameters; the replicas' exact state for checkpoints.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fp8comm.errors import Fp8CommRuntimeError, Fp8CommStateError

from .patching import wrap_method

# ------------------------------------------------------------------------------------ 4-bit weight updates
# With weights.update_fmt: start each flat group's update gather inside the optimizer step (where DeepSpeed gathers)
# without waiting, and wait it at the first forward use of that group's parameters (False: the gather finishes
# inside the step, as before; the tests compare the two bit for bit).
OVERLAP_UPDATES = True


def _own_partitions(opt) -> list[tuple[int, torch.Tensor]]:
    """(group rank, this rank's bit16 partition: a view into the flat replica) per parameter group."""
    out = []
    for g, parts in enumerate(opt.parallel_partitioned_bit16_groups):
        me = dist.get_rank(group=opt.real_dp_process_group[g])
        out.append((me, parts[me]))
    return out


def _attach_updates(es, engine) -> None:
    """Where the replica is read, the update gathers still in flight are waited first: a forward pre-hook on every
    module owning parameters of a flat group (its groups, in the forward's order), a state_dict pre-hook on the
    same modules (every group), and the engine's save_checkpoint / load_checkpoint (every group); the next step
    waits what no forward took (_stash_step). detach() waits them too (the weights get their update)."""
    opt = engine.optimizer
    es.z12_pending = [None] * len(opt.bit16_groups_flat)
    group_of = {id(p): g for g, params in enumerate(opt.bit16_groups) for p in params}
    for m in engine.module.modules():
        gs = tuple(sorted({group_of[id(p)] for p in m.parameters(recurse=False) if id(p) in group_of}))
        if gs:
            es.handles.append(m.register_forward_pre_hook(functools.partial(_wait_in_forward, es, gs)))
            es.handles.append(m.register_state_dict_pre_hook(lambda *_: finish_updates(es, "state_dict")))
    for name in ("save_checkpoint", "load_checkpoint"):
        wrap_method(es, engine, name, functools.partial(_finish_before, es, name))
    es.undo.append(lambda: finish_updates(es, "detach"))


def _wait_in_forward(es, groups: tuple[int, ...], module, inputs) -> None:
    pending = es.z12_pending
    for g in groups:
        h = pending[g]
        if h is not None:
            pending[g] = None
            h.wait()
            es.acct.hit("zero12.param_update.waited_in_forward")


def finish_updates(es, where: str = "") -> int:
    """Wait every update gather still in flight (group order: the same on every rank); returns how many."""
    pending = getattr(es, "z12_pending", None) or []
    n = 0
    for g, h in enumerate(pending):
        if h is not None:
            pending[g] = None
            h.wait()
            n += 1
    if n and where:
        es.acct.hit(f"zero12.param_update.waited_at_{where}", n)
    return n


def _finish_before(es, name: str, orig):
    @functools.wraps(orig)
    def call(*a, **k):
        finish_updates(es, name.split("_")[0])
        return orig(*a, **k)

    return call


def _stash_step(es, opt, orig):
    """step(): keep this rank's slice of each replica as it was before DeepSpeed overwrites it with bf16(master).

    With update_fmt the replica changes only by the gathered update (every rank applies the same decoded change to
    every slice, the owner's included); DeepSpeed's own write of the owner's slice is undone before the gather. A
    gather of the last step that no forward waited (a step without a forward) is finished first."""

    @functools.wraps(orig)
    def step(*a, **k):
        finish_updates(es, "step")
        stash = es.__dict__.setdefault("z12_stash", [])
        with torch.no_grad():
            for g, (_, part) in enumerate(_own_partitions(opt)):
                if g == len(stash) or stash[g].numel() != part.numel():
                    stash[g:] = [torch.empty_like(part)]
                stash[g].copy_(part)
        es.z12_in_step = True
        try:
            return orig(*a, **k)
        finally:
            es.z12_in_step = False

    return step


@torch.no_grad()  # DeepSpeed's partitions are views made under no_grad: in-place writes need it too
def _update_gather(es, groups_flat, partitioned_param_groups, dp_process_group) -> None:
    """The weight gather as ReplicaUpdate: each rank's fp32 master partition against its slice of the replica.

    Inside a step the owner's slice is first restored to the replica (DeepSpeed wrote bf16(master) into it), and
    (OVERLAP_UPDATES) the gather is started, not waited: the change is quantized and on the wire when the step
    returns, decoded and applied at the first forward use of the group (_wait_in_forward), the same bits as the
    synchronous call. Outside a step (a checkpoint load, refresh) DeepSpeed rewrote the replica from the master:
    the gather is a full one, waited here. The numerics guard watches each group as bucket "update<g>": 4 bits,
    FP8 when demoted, a full gather in the replica's dtype while it falls back."""
    opt = es.engine.optimizer
    masters = opt.single_partition_of_fp32_groups
    in_step = getattr(es, "z12_in_step", False)
    pending = es.__dict__.setdefault("z12_pending", [None] * len(groups_flat))
    for g, (flat, parts, pg) in enumerate(zip(groups_flat, partitioned_param_groups, dp_process_group)):
        me, world = dist.get_rank(group=pg), dist.get_world_size(group=pg)
        if world == 1:
            continue
        src, ru = parts[me], es.updates[g]
        if flat.numel() != world * src.numel() or masters[g].numel() != src.numel():
            raise Fp8CommRuntimeError(
                f"fp8comm ZeRO-1/2 weight update: flat group has {flat.numel()} elements, partition "
                f"{src.numel()}, fp32 master {masters[g].numel()}; expected world ({world}) x partition = flat"
            )
        es.check_not_master(flat, "ZeRO-1/2 weight update")
        if pending[g] is not None and not in_step:  # DeepSpeed rewrote the replica: the change in flight is stale
            pending[g] = None  # (ru.reset() below drops it)
        cfg, gb = None, None
        if es.guard is not None:
            key = f"update{g}"
            es.guard.bucket(key, flat.device, fp4=True)  # registered before route() asks for it (every rank)
            how, gb = es.route(key, flat.device, fp4=True)
            if how == "bf16":  # the guard's fallback: the values themselves, in the replica's dtype
                ru.reset()
            elif how == "fp8":
                cfg = es.wire_config(ru.config, "fp8")
        if in_step and ru.primed:
            src.copy_(es.z12_stash[g])
        elif ru.primed:
            ru.reset()
        change = ru.primed
        # two levels where the DP group spans nodes (the quantized change crosses the nodes once; inside the node
        # the same bytes, decoded alike on every rank: the flat gather's bits); the node-local phase of an
        # overlapped gather runs in its wait, which every rank reaches in the same order (forward, then group order)
        hier = es.hier(pg)
        kw = {k: v for k, v in (("config", cfg), ("guard", gb), ("hierarchical", hier)) if v is not None}
        if in_step and OVERLAP_UPDATES:
            pending[g] = ru.gather(flat, masters[g], pg, async_op=True, **kw)
            es.acct.hit("zero12.param_update.started_in_step")
        else:
            ru.gather(flat, masters[g], pg, **kw)
        es.acct.add("weights", ru.last_wire_bytes, ru.last_dtype_bytes, change)
        es.acct.hit("zero12.param_update." + ("change" if change else "full"))


def replica_state(es) -> list[dict]:
    """Per flat group: the ReplicaUpdate state and this rank's slice of the replica (a resume restores it exactly:
    the replica is not bf16(master) but what the gathered changes made of it)."""
    opt = es.engine.optimizer
    return [
        # a checkpoint save (once per save, not per step): the device copy to host is what a saved slice needs
        {"update": ru.state_dict(), "own": part.detach().clone().cpu()}
        for ru, (_, part) in zip(es.updates, _own_partitions(opt))
    ]


@torch.no_grad()
def load_replica_state(es, state: list[dict]) -> None:
    """Put every rank's saved slice back and gather them in the replica's dtype: the replica as it was saved."""
    opt = es.engine.optimizer
    own = _own_partitions(opt)
    if len(state) != len(own) or any(s["own"].numel() != p.numel() for s, (_, p) in zip(state, own)):
        raise Fp8CommStateError(
            "fp8comm weight updates: the checkpoint's replica slices "
            f"{[s['own'].numel() for s in state]} do not match this engine's partitions {[p.numel() for _, p in own]}"
        )
    for g, (s, (_, part)) in enumerate(zip(state, own)):
        part.copy_(s["own"].to(part.device))
        pg = opt.real_dp_process_group[g]
        if dist.get_world_size(group=pg) > 1:
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            fn(opt.bit16_groups_flat[g], part.clone(), group=pg)
        es.updates[g].load_state_dict(s["update"])
    es.acct.hit("checkpoint.replica_restored")
