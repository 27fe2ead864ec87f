"""4-bit weight updates for Megatron's distributed optimizer: the parameter all-gather sends changes, not values.

Megatron writes the owner's shard of each bucket's bf16 parameter buffer from the fp32 master
(`DistributedOptimizer._copy_main_params_to_model_params`) and then all-gathers the buffer (`dist_all_gather_func`).
With --fp8comm-param-update-format the copy writes the master into a per-bucket fp32 staging shard instead, and the
gather becomes one fp8comm `ReplicaUpdate` per bucket: every rank sends q4(staging - its replica slice) and every
rank, the owner too, adds the decoded change to its replica. Replicas stay bit-identical; the owner's quantization
error stays in (master - replica) and goes out with the next change. The first gather of each bucket sends the
values in the buffer's dtype (exactly Megatron's gather), so replicas start equal.

State per bucket (keyed by the identity of `bucket.param_data`, as error feedback keys by `grad_data`): the
ReplicaUpdate (its `primed` flag is what a checkpoint needs, state_dict / load_state_dict) and the staging shard
(4 bytes per element of this rank's 1/DP of the bucket; its padding stays zero).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from fp8comm import comm as fcomm
from fp8comm.comm import ReplicaUpdate

from . import guard
from .config import Fp8CommMegatronError, count
from .installation import current, hierarchical_groups, installed

FORMAT = "fp8comm.megatron.replica_update/1"
# With overlap_param_gather, start every bucket's update gather right after the optimizer step (False: when
# Megatron's forward asks for the bucket, as before; the tests compare the two bit for bit).
START_AFTER_STEP = True


@dataclass(eq=False)
class BucketReplica:
    """One parameter bucket's 4-bit update state: the ReplicaUpdate and this rank's fp32 staging shard."""

    ru: ReplicaUpdate
    shard: torch.Tensor | None = None  # fp32 [numel / DP]: the master values of this rank's slice; None: unstaged
    pending: Any = None  # a gather started right after the optimizer step, until Megatron's own call takes it


def for_bucket(param_data: torch.Tensor) -> BucketReplica:
    """The state of the bucket whose parameter buffer is `param_data` (created on first use, unprimed)."""
    inst = installed()
    entry = inst.replicas.get(id(param_data))
    if entry is not None and entry[0]() is param_data:
        return entry[1]
    cfg = inst.cfg
    state = BucketReplica(ReplicaUpdate(config=cfg.wire("update")))
    inst.replicas[id(param_data)] = (weakref.ref(param_data), state)
    return state


def staging(param_data: torch.Tensor, dp_size: int, dp_rank: int) -> torch.Tensor:
    """This rank's fp32 staging shard of a bucket, created from the replica's own slice (padding included)."""
    state = for_bucket(param_data)
    n = param_data.numel() // dp_size
    if state.pending is not None:  # a gather started after the last step that no forward took: finish it first
        state.pending.wait()
        state.pending = None
    if state.shard is None or state.shard.numel() != n:
        state.shard = param_data.detach().view(-1)[dp_rank * n : (dp_rank + 1) * n].float().clone()
    return state.shard


def make_copy_main_params(orig):
    """Wrap DistributedOptimizer._copy_main_params_to_model_params: masters of bf16/fp16 params go to the staging
    shards (the gather applies them as changes); fp32 params keep Megatron's copy (their master IS the buffer)."""

    def fp8comm_copy_main_params_to_model_params(self):
        if getattr(self, "is_stub_optimizer", False):
            return orig(self)
        _refuse_unsupported(self)
        group = self.data_parallel_group
        dp_size, dp_rank = group.size(), group.rank()
        if dp_size == 1:  # e.g. expert buckets with EP = world: their gather passes through, so Megatron writes
            return orig(self)
        for shard_main_group, model_group in zip(self.shard_fp32_from_float16_groups, self.model_float16_groups):
            for shard_main_param, model_param in zip(shard_main_group, model_group):
                ranges = self._get_model_param_range_map(model_param)
                local, world = ranges["gbuf_local"], ranges["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
                param_data = self.buffers[gbuf_index].buckets[bucket_id].param_data
                shard = staging(param_data, dp_size, dp_rank)
                if world.start - local.start != dp_rank * shard.numel() or local.size != shard_main_param.nelement():
                    raise Fp8CommMegatronError(
                        "fp8comm: a parameter's shard range does not lie in this rank's 1/DP slice of its bucket "
                        f"(bucket offset {world.start - local.start}, expected {dp_rank * shard.numel()}); "
                        "this megatron-core lays out distributed-optimizer shards differently"
                    )
                shard[local.start : local.end].copy_(shard_main_param.view(-1))
        # fp32 params (e.g. kept in fp32 inside a bf16 model): their buffer holds the master; Megatron's own copy.
        for shard_main_group, model_group in zip(self.shard_fp32_groups, self.model_fp32_groups):
            for shard_main_param, model_param in zip(shard_main_group, model_group):
                world = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
                param_data = self.buffers[gbuf_index].buckets[bucket_id].param_data
                param_data.view(-1)[world.start : world.end].data.copy_(shard_main_param)
        count("param_update", "staged_steps")
        if self.ddp_config.overlap_param_gather and START_AFTER_STEP:
            _start_after_step(self, dp_size)

    fp8comm_copy_main_params_to_model_params.__wrapped__ = orig
    return fp8comm_copy_main_params_to_model_params


def _start_after_step(opt, dp_size: int) -> None:
    """With overlap_param_gather: start every staged bucket's update gather now, right after the optimizer step,
    in the order Megatron's forward dispatches its gathers (each chunk's bucket groups last to first, as its
    next_param_gather_bucket_group chain runs); Megatron's own call for the bucket (the forward pre-hook's
    finish_param_sync, or a forced sync) takes the started gather and waits it where it would wait its own. The
    same buckets in the same order on every rank: the collectives line up."""
    mine = {id(b.param_data) for buf in opt.buffers for b in buf.buckets}
    for chunk in getattr(opt, "model_chunks", None) or []:
        for kind in ("bucket_groups", "expert_parallel_bucket_groups"):
            for bg in reversed(getattr(chunk, kind, None) or []):
                group = bg.intra_distributed_optimizer_instance_group
                for bucket in bg.buckets:
                    pd = bucket.param_data
                    if pd is None or id(pd) not in mine or pd.dtype == torch.float32 or group.size() != dp_size:
                        continue
                    state = for_bucket(pd)
                    if state.shard is None or state.pending is not None:
                        continue
                    state.pending = _start(pd, state, group)
                    count("param_update", "started_after_step")


def _refuse_unsupported(opt) -> None:
    why = None
    if opt.ddp_config.use_megatron_fsdp:
        why = "Megatron-FSDP keeps no parameter replica"
    elif getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        why = "the precision-aware optimizer keeps the fp32 master inside the optimizer and writes the params itself"
    elif getattr(opt.ddp_config, "fp8_param_gather", False) or getattr(opt.ddp_config, "fp4_param_gather", False):
        why = "Transformer Engine quantized params (fp8/fp4_param_gather) are gathered as raw quantized storage"
    if why:
        raise Fp8CommMegatronError(f"fp8comm: --fp8comm-param-update-format cannot run here: {why}")


def make_copy_to_param_buffer(orig):
    """DistributedOptimizer._copy_main_params_to_param_buffer (MXFP8 params reusing the gradient buffer for the
    gather): that buffer is zeroed every step, so no replica persists for a change to apply to: refused."""

    def fp8comm_copy_main_params_to_param_buffer(self):
        raise Fp8CommMegatronError(
            "fp8comm: --fp8comm-param-update-format needs a persistent parameter buffer; "
            "reuse_grad_buf_for_mxfp8_param_ag (Transformer Engine MXFP8 params) gathers into the zeroed gradient "
            "buffer instead: turn one of them off"
        )

    fp8comm_copy_main_params_to_param_buffer.__wrapped__ = orig
    return fp8comm_copy_main_params_to_param_buffer


def _last_bytes(ru: ReplicaUpdate) -> tuple[int, int]:
    """(bytes this rank sent in the last gather, bytes Megatron's gather of the same elements would send)."""
    st = getattr(ru, "stats", None)
    if st is not None:
        return int(st.wire_bytes), int(st.dtype_bytes)
    return int(ru.last_wire_bytes), int(ru.last_dtype_bytes)


def _primed(ru: ReplicaUpdate) -> bool:
    return bool(ru.primed)


def gather(output: torch.Tensor, input: torch.Tensor, group):
    """The 4-bit weight-update all-gather of one bucket (output: its parameter buffer, the replica; input: this
    rank's slice of it, which Megatron would have sent). Returns a handle whose wait() finishes the update: the
    gather started right after the optimizer step when there is one (_start_after_step), else one started now."""
    state = for_bucket(output)
    if state.pending is not None:
        h, state.pending = state.pending, None
        count("param_update", "taken_after_step")
        return h
    return _start(output, state, group)


def _start(output: torch.Tensor, state: BucketReplica, group):
    """Start one bucket's update gather (async; two levels where install() prepared node groups for the group)."""
    dp_size = torch.distributed.get_world_size(group)
    dp_rank = torch.distributed.get_rank(group)
    # Unstaged (a gather before the first optimizer step, e.g. the first forward with overlap_param_gather): the
    # replica's own slice, a zero change (and on the first call, the values themselves in the buffer's dtype).
    shard = staging(output, dp_size, dp_rank)
    first = not _primed(state.ru)
    hier = hierarchical_groups(group) if installed().cfg.hierarchical else None
    # The numerics guard (--fp8comm-guard): "fp4" as configured, "fp8" (a demoted bucket: the change in E4M3 with
    # 1x128 fp32 scales), or "bf16": Megatron's own gather of the values (a full gather; the next change is taken
    # against it). Decided at the previous step's end, the same on every rank.
    wire, bucket = guard.route("update", output, fp4=True)
    if wire == "bf16":
        state.ru.reset()
        first = True
    cfg = fcomm.config_for(state.ru.config, "fp8") if wire == "fp8" else None
    h = state.ru.gather(output.view(-1), shard, group=group, async_op=True, hierarchical=hier, config=cfg, guard=bucket)
    count("param_update", "full_calls" if first else "update_calls")
    count("param_update", "elements", output.numel())
    sent, dtype = _last_bytes(state.ru)

    def record():  # first gathers (values in the buffer's dtype) apart: the 4-bit ratio is the update calls'
        count("param_update", "full_wire_bytes" if first else "wire_bytes", sent)
        count("param_update", "full_dtype_bytes" if first else "dtype_bytes", dtype)

    return _Recording(h, record)


class _Recording:
    def __init__(self, handle, after) -> None:
        self._h, self._after, self._done = handle, after, False

    def wait(self, timeout=None):
        out = self._h.wait()
        if not self._done:
            self._done = True
            self._after()
        return out

    def is_completed(self) -> bool:
        return self._done  # the replica is updated in wait() only

    def discard(self) -> None:
        self._h.discard()
        self._done = True


def _bucket_buffers(model) -> list[tuple[str, torch.Tensor]]:
    """(stable name, param_data) of every bucket of every DDP model chunk, in Megatron's order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for c, chunk in enumerate(chunks):
        for kind in ("bucket_groups", "expert_parallel_bucket_groups"):
            if not hasattr(chunk, kind):
                raise Fp8CommMegatronError(
                    f"fp8comm: replica-update state needs Megatron's DistributedDataParallel model chunks "
                    f"(with .{kind}); got {type(chunk).__name__}"
                )
            for g, group in enumerate(getattr(chunk, kind)):
                for k, bucket in enumerate(group.buckets):
                    if bucket.param_data is not None:
                        out.append((f"chunk{c}.{kind}{g}.bucket{k}", bucket.param_data))
    return out


def state_dict(model) -> dict:
    """{"format", "buckets": {name: {"primed": bool, "numel": int}}}: the same on every rank; save it with the
    model weights (the replica) and the optimizer state (the fp32 master)."""
    inst = current()
    reps = {} if inst is None else inst.replicas
    sd = {}
    for name, param_data in _bucket_buffers(model):
        entry = reps.get(id(param_data))
        if entry is not None and entry[0]() is param_data and entry[1].pending is not None:
            entry[1].pending.wait()  # the weights saved beside this must have it; Megatron's call still takes it
        primed = entry is not None and entry[0]() is param_data and _primed(entry[1].ru)
        sd[name] = {"primed": bool(primed), "numel": param_data.numel()}
    return {"format": FORMAT, "buckets": sd}


def load_state_dict(model, sd: dict) -> None:
    """Restore what state_dict() saved, for the same bucket layout, after the model weights and optimizer state
    were loaded (and without re-gathering the weights from the master: that gather would be a full one)."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise Fp8CommMegatronError(
            "fp8comm: not a replica-update state dict from replica_update_state_dict() (format "
            f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r})"
        )
    inst = current()
    if inst is None or not inst.cfg.param_update:
        raise Fp8CommMegatronError(
            "fp8comm: load_replica_update_state_dict needs an installation with --fp8comm-param-update-format "
            "(install(..., param_update_fmt=...)) first, then load"
        )
    buckets = dict(_bucket_buffers(model))
    problems = [
        f"{name}: saved for {st['numel']} elements, this bucket has "
        f"{buckets[name].numel() if name in buckets else 'no such bucket'}"
        for name, st in sd["buckets"].items()
        if name not in buckets or buckets[name].numel() != st["numel"]
    ] + [f"{name}: not in the saved state" for name in buckets if name not in sd["buckets"]]
    if problems:
        raise Fp8CommMegatronError(
            "fp8comm: replica-update state does not match this model's parameter buckets:\n  - "
            + "\n  - ".join(problems)
        )
    for name, st in sd["buckets"].items():
        state = for_bucket(buckets[name])
        if state.pending is not None:  # the weights were restored: a change in flight belongs to the old ones
            state.pending.discard()
            state.pending = None
        state.ru.load_state_dict({"primed": bool(st["primed"])})


def reset() -> None:
    """Make every bucket's next gather a full one (after the weights were re-gathered or rewritten elsewhere)."""
    inst = current()
    for ref, state in [] if inst is None else inst.replicas.values():
        if ref() is not None:
            if state.pending is not None:  # the weights were rewritten: the change in flight is dropped
                state.pending.discard()
                state.pending = None
            state.ru.reset()
            state.shard = None


def finish_all() -> None:
    """Finish every gather started after the last optimizer step (uninstall: the weights get their update)."""
    inst = current()
    for ref, state in [] if inst is None else list(inst.replicas.values()):
        if state.pending is not None:
            if ref() is not None:
                state.pending.wait()
            state.pending = None


def nbytes() -> int:
    """Bytes of staging shards held in this process (fp32: 4 per element of this rank's slice of each bucket)."""
    inst = current()
    return sum(
        s.shard.numel() * 4 for ref, s in ([] if inst is None else inst.replicas.values()) if s.shard is not None
    )
