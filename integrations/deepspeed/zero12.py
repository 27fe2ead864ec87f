"""ZeRO-1/2 hooks: gradient reduction to the owner of each slice (FP8 or 4 bits), and the post-step weight gather
(FP8 values, or 4-bit changes of the replica).

Gradients (wrapped per optimizer instance, so only fp8comm engines are touched): DeepSpeed's `average_tensor`
splits the reduce bucket into slices, each owned by one rank's optimizer partition, and hands them to
`allreduce_and_scatter`, which all-reduces the whole bucket and lets each owner copy its slices. The hook keeps
that contract but moves each slice only to its owner: every slice is cut at parameter boundaries (DeepSpeed merges
neighbouring slices of one owner, differently on the owner and on the other ranks), each parameter's piece starts
on a row of `block_size` elements of its own, and the pieces are grouped per owner in a reused send buffer (only
the pads are zeroed). A balanced bucket (DeepSpeed's default bucket holds every parameter and partitions are
equal) pads every owner's part to the largest and goes through ONE fp8comm.comm.reduce_scatter_into with an fp32
output: pipelined, every sender's contribution decoded straight into fp32 and summed in fp32 in rank order as it
arrives. An unbalanced bucket (small buckets: mostly one owner) goes through ONE fp8comm.comm.all_to_all with each
owner's exact row count (FP8 codes + scales out, decoded one sender at a time into an fp32 sum in rank order);
that all-to-all has no 4-bit wire, so a 4-bit config sends such a bucket in FP8 when that moves fewer bytes than
its padded 4-bit reduce-scatter (plan_reduce). Either way the owner gets the fp32 sum DeepSpeed's fp32 gradient
partition receives (a bf16 decode would round each contribution first). inf/NaN in any block arrives as
inf/NaN, so DeepSpeed's overflow check still fires. Slices several ranks consume (Muon) keep DeepSpeed's own
all-reduce (counted). With error feedback each parameter's residual (residuals.py) is assembled into the send
layout and scattered back after the call.

Weights: `all_gather_dp_groups` (after every optimizer step and after loading a checkpoint) gathers each rank's
updated bit16 partition into the flat model weights; the dispatcher routes on a tag on the engine's flat buffers
and uses fp8comm.comm.all_gather_into. The fp32 master partition is a separate tensor (checked after the build).
With weights.update_fmt, one fp8comm.comm.ReplicaUpdate per flat group sends each rank's change (fp32 master minus
its slice of the replica) in 4 bits and every rank applies the same decoded change to every slice: DeepSpeed's
write of bf16(master) into the owner's slice is undone first (the slice is kept before the step), so replicas stay
bit-identical. A gather outside a step (checkpoint load, refresh) is a full one; a checkpoint carries each rank's
slice of the replica so a resume restores the replica exactly.
"""

from __future__ import annotations

import bisect
import functools

import torch
import torch.distributed as dist

import fp8comm.comm as fc
from fp8comm.comm import WireConfig
from fp8comm.errors import Fp8CommRuntimeError, Fp8CommStateError
from fp8comm.quant import Fp8Tensor

from . import levels
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
        wrap_method(es, opt, "step", lambda orig: _stash_step(es, opt, orig))
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


class _Scratch:
    """Per-engine buffers reused across steps (the padded send layout, the fp32 sums): a fresh bucket-sized
    allocation per call costs its page faults every step (measured ~60 ms per 134 MB on the 2-core CPU VM)."""

    def __init__(self) -> None:
        self.bufs: dict[tuple, torch.Tensor] = {}

    def take(self, key: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        k = (key, dtype, torch.device(device))
        b = self.bufs.get(k)
        if b is None or b.numel() < numel:
            self.bufs[k] = b = torch.empty(numel, dtype=dtype, device=device)
        return b[:numel]


# A bucket goes through one reduce-scatter when padding every owner's part to the largest costs at most this
# share of extra wire bytes over the all-to-all with each owner's exact row count (which has no 4-bit wire).
BALANCE_SLACK = 1 / 8


def bytes_per_element(cfg: WireConfig) -> float:
    """Wire bytes per element of `cfg`: codes plus block scales (NVFP4's 4-byte chunk scale left out)."""
    s = cfg.spec
    if s.fp4 is not None:
        return 0.5 + 1 / s.fp4.block
    return 1 + s.scaling.scale_bytes / (s.scaling.cols or 1)


def plan_reduce(rows: list[int], cfg: WireConfig) -> tuple[bool, WireConfig]:
    """(reduce-scatter?, the wire config) for a bucket with `rows` rows per owner under `cfg`.

    Reduce-scatter pads every owner's part to the largest; the all-to-all moves exact parts but only in FP8 (a 4-bit
    `cfg` sends such a bucket in FP8, e4m3 1x128, when that is fewer bytes than its padded 4-bit reduce-scatter).
    Decided from the bucket layout alone, which is the same on every rank, so every rank picks the same call."""
    total = sum(rows)
    a2a = fc.config_for(cfg, "fp8")
    padded = len(rows) * max(rows) * bytes_per_element(cfg) if total else 0.0
    if total and padded <= total * bytes_per_element(a2a) * (1 + BALANCE_SLACK):
        return True, cfg
    return False, a2a


def _grad_reduce(es, opt, orig, layout: dict):
    cfg = es.cfg.gradients
    wcfg = cfg.wire(es.cfg.check)
    H = cfg.block_size
    scratch = _Scratch()

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
        how, gb = (
            ("fp8", None)
            if es.cfg.measure_only or world == 1
            else es.route("gradients", owned[0][1].device, cfg.is_fp4)
        )
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
        dev = owned[0][1].device
        # Balanced bucket (the usual case: DeepSpeed's default bucket holds every parameter, and partitions are
        # equal): every owner's part padded to the largest, one reduce-scatter whose receive side decodes and sums
        # in fp32 as the bytes arrive (pipelined). Unbalanced: exact parts through one FP8 all-to-all.
        rs, call_cfg = plan_reduce(rows, es.wire_config(wcfg, how))
        part = max(rows) * H if rs else 0  # elements per owner in the reduce-scatter layout
        total = world * part if rs else sum(rows) * H
        flat = scratch.take("send", total, comm_dtype, dev)
        pieces, row0 = [], 0
        for r, s in enumerate(per_owner):
            if rs:
                row0 = r * part
            for t, _, segs in s:
                v = t.reshape(-1)
                for a, n, name, numel, poff in segs:
                    flat[row0 : row0 + n].copy_(v[a : a + n])
                    pad = -n % H
                    flat[row0 + n : row0 + n + pad].zero_()  # only the pads are zeroed, never the whole buffer
                    pieces.append((name, numel, poff, row0, n))
                    row0 += n + pad
            if rs:
                flat[row0 : (r + 1) * part].zero_()
        ef = None if es.residuals is None else es.residuals.assemble(pieces, total, dev)
        es.acct.hit("zero12.grad_reduce." + ("reduce_scatter" if rs else "all_to_all"))
        with es.acct.fp8("gradients", baseline=baseline), torch.no_grad():
            if rs:
                acc = scratch.take("acc", part, torch.float32, dev)
                # fp32 output: every sender's contribution decoded straight into fp32, summed in fp32 in rank order
                hg = es.hier(pg)  # two levels where the DP group spans nodes (fp32 sums inside a node)
                rail = levels.rail_feedback(ef, hg)
                fc.reduce_scatter_into(
                    acc, flat, pg, "sum", config=call_cfg, error_feedback=rail, guard=gb, hierarchical=hg
                )
                levels.rail_back(ef, rail, hg)
            else:  # flat on purpose: the all-to-all has no two-level mode (the summary line says so)
                q = fc.all_to_all(
                    flat.view(-1, H),
                    [rows[me]] * world,
                    rows,
                    pg,
                    wire="fp8",
                    fp8_out=True,
                    config=call_cfg,
                    error_feedback=ef,
                    guard=gb,
                )
        if ef is not None:
            es.residuals.scatter(ef, pieces, total)
        if not rs:
            acc = _decode_sum(q, world, rows[me], scratch)
        if scale is not None:
            acc.mul_(scale)
        off = 0
        for t, out, segs in per_owner[me]:
            v = t.view(-1)
            ov = None if out is None else out.view(-1)
            for a, n, *_ in segs:
                piece = acc[off : off + n]
                if ov is not None:  # the fp32 sum straight into DeepSpeed's fp32 gradient partition
                    opt._add_to_grad_partition_buffer(ov[a : a + n], piece)
                v[a : a + n].copy_(piece)
                off += -(-n // H) * H

    return allreduce_and_scatter


def _decode_sum(q: Fp8Tensor, world: int, rows: int, scratch: _Scratch) -> torch.Tensor:
    """Sum over senders of q's [world, rows] FP8 contributions, each decoded straight into fp32, in rank order.

    One sender at a time (a [world, rows, H] fp32 decode would be world times the output's memory)."""
    h = q.shape[1]
    acc = scratch.take("acc", rows * h, torch.float32, q.data.device).view(rows, h)
    for r in range(world):
        rs = slice(r * rows, (r + 1) * rows)
        d = Fp8Tensor(q.data[rs], q.scale[rs], q.fmt, q.scaling, q.dtype).dequantize(torch.float32)
        if r == 0:
            acc.copy_(d)
        else:
            acc += d
    return acc.view(-1)


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
        return _update_gather(es, groups_flat, partitioned_param_groups, dp_process_group)
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
            fc.all_gather_into(flat, src, pg, config=wcfg, guard=gb, hierarchical=es.hier(pg))


# ------------------------------------------------------------------------------------ 4-bit weight updates
def _own_partitions(opt) -> list[tuple[int, torch.Tensor]]:
    """(group rank, this rank's bit16 partition: a view into the flat replica) per parameter group."""
    out = []
    for g, parts in enumerate(opt.parallel_partitioned_bit16_groups):
        me = dist.get_rank(group=opt.real_dp_process_group[g])
        out.append((me, parts[me]))
    return out


def _stash_step(es, opt, orig):
    """step(): keep this rank's slice of each replica as it was before DeepSpeed overwrites it with bf16(master).

    With update_fmt the replica changes only by the gathered update (every rank applies the same decoded change to
    every slice, the owner's included); DeepSpeed's own write of the owner's slice is undone before the gather."""

    @functools.wraps(orig)
    def step(*a, **k):
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

    Inside a step the owner's slice is first restored to the replica (DeepSpeed wrote bf16(master) into it). Outside a
    step (a checkpoint load, refresh) DeepSpeed rewrote the replica from the master: the gather is a full one."""
    opt = es.engine.optimizer
    masters = opt.single_partition_of_fp32_groups
    in_step = getattr(es, "z12_in_step", False)
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
        if in_step and ru.primed:
            src.copy_(es.z12_stash[g])
        elif ru.primed:
            ru.reset()
        change = ru.primed
        ru.gather(flat, masters[g], pg)
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
