"""DDP hooks: FP8/4-bit gradient reduce-scatter or all-reduce, and the FP8 parameter all-gather or 4-bit
weight-update all-gather (replica_update.py) for Megatron's bucket groups.

Megatron's _ParamAndGradBucketGroup issues both collectives through module-level names of param_and_grad_buffer
(`dist_reduce_scatter_func`, `dist_all_gather_func`, and `reduce_scatter_with_fp32_accumulation`, which its
__init__ swaps in by name) inside `_coalescing_manager` blocks, and keeps the manager as the async handle.

That manager is the hazard: it DEFERS all_gather_into_tensor / reduce_scatter_tensor until the block exits (an
FP8 call made inside would get an unusable work object, and dequantizing inline would read empty buffers), and
its wait() never calls a custom handle's wait(). So the patched `_coalescing_manager` opens a batch: the FP8
functions only record their call inside the block; when the block exits (after Megatron's own coalesced ops were
issued) the batch starts them in call order, and the object Megatron keeps as its handle waits the real manager
and then every FP8 handle, whose wait() is where fp8comm dequantizes / accumulates in fp32 and writes the output.
Synchronous blocks (overlap off) wait before the block returns, exactly like the original.

Plain DDP (no distributed optimizer) all-reduces each bucket with a direct `torch.distributed.all_reduce` inside
the same block; the wrapped `start_grad_sync` takes exactly those calls (make_start_grad_sync). Two-level
(hierarchical) mode, the default: node groups are created at install for every data-parallel group of the job that
can be split (prepare_node_groups; fp8comm.comm.topology decides) and held under HOLDER: uninstall() releases that
hold only, so node groups the caller prepared for the same ranks stay.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
import torch.distributed as dist

from fp8comm import comm as fcomm
from fp8comm.comm.planned import Choice, keeps_feedback
from fp8comm.comm.planner import NATIVE, Option

from . import error_feedback, guard, planning, replica_update
from .config import Fp8CommMegatronConfig, Fp8CommMegatronError, count
from .installation import hierarchical_groups, installed

HOLDER = "megatron"  # fp8comm.comm.node_groups holder of the node groups install() prepares

_tls = threading.local()


def _batches() -> list:
    if not hasattr(_tls, "batches"):
        _tls.batches = []
    return _tls.batches


class _Deferred:
    """An FP8 collective recorded inside a coalescing block; started when the block exits, finished in wait()."""

    def __init__(self, start):
        self._start = start
        self._handle = None

    def launch(self) -> None:
        if self._handle is None:
            self._handle = self._start()

    def wait(self, timeout=None):
        self.launch()  # a no-op once the batch started it; covers a handle waited without a block exit
        return self._handle.wait()

    def is_completed(self) -> bool:
        return self._handle is not None and self._handle.is_completed()


class _Batch:
    """What the patched _coalescing_manager yields: Megatron's async handle for the whole block."""

    def __init__(self) -> None:
        self.real = None  # torch's _CoalescingManager for ops that are not ours (e.g. all-reduces)
        self.items: list[_Deferred] = []

    def wait(self, timeout=None) -> None:
        if self.real is not None:
            self.real.wait()
        for d in self.items:
            d.wait()

    def is_completed(self) -> bool:
        return all(d.is_completed() for d in self.items)


def make_coalescing_manager(orig):
    """A drop-in for torch.distributed._coalescing_manager that starts fp8comm calls after the block."""

    @contextlib.contextmanager
    def fp8comm_coalescing_manager(group=None, device=None, async_ops=False):
        batch = _Batch()
        stack = _batches()
        stack.append(batch)
        try:
            with orig(group, device=device, async_ops=async_ops) as real:
                batch.real = real
                yield batch
        finally:
            stack.pop()
        for d in batch.items:  # same order on every rank: the order Megatron called them in
            d.launch()
        if not async_ops:
            batch.wait()

    return fp8comm_coalescing_manager


def _issue(start, async_op: bool):
    """Inside a block: record and return a deferred handle. Outside: run now with torch's return convention."""
    stack = _batches()
    if stack:
        d = _Deferred(start)
        stack[-1].items.append(d)
        return d
    h = start()
    if async_op:
        return h
    h.wait()
    return None


def _size(group) -> int:
    return dist.get_world_size(group)


def _check(cfg: Fp8CommMegatronConfig, kind: str, t: torch.Tensor, group) -> bool:
    """Run fp8comm's cross-rank metadata check per policy; every rank takes the same decision for a buffer."""
    if cfg.check != "first":
        return cfg.check == "always"
    key = (kind, t.data_ptr(), t.numel(), id(group))
    checked = installed().checked
    if key in checked:
        return False
    checked.add(key)
    return True


def _my_data_parallel_ranks() -> list[tuple[int, ...]]:
    """Rank lists of the groups Megatron's DDP reduces and gathers buckets over, as this rank sees them (dense:
    data x context parallel, full and partial; experts: expert data parallel, full and partial)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise Fp8CommMegatronError(
            "fp8comm: --fp8comm-hierarchical: call install() after parallel_state.initialize_model_parallel(): "
            "it creates the node groups of every data-parallel group, on every rank in one order"
        )
    getters = [
        (ps.get_data_parallel_group, dict(with_context_parallel=True, with_gtp_remat=False, partial_data_parallel=p))
        for p in (False, True)
    ] + [
        (ps.get_expert_data_parallel_group, dict(with_gtp_remat=False, partial_expert_data_parallel=p))
        for p in (False, True)
    ]
    out = []
    for fn, kw in getters:
        for call_kw in (kw, {}):  # {}: a release without these keywords, its default group
            try:
                g = fn(**call_kw)
            except TypeError:
                continue
            except (AssertionError, RuntimeError):  # a group this layout does not build
                g = None
            if g is not None:
                out.append(tuple(dist.get_process_group_ranks(g)))
            break
    return out


def prepare_node_groups(enabled: bool = True) -> dict:
    """{global ranks of a data-parallel group: its fp8comm.comm.topology.Split} (two-level with this rank's node
    groups, or flat with the reason), one line per group logged by install().

    Collective over the whole world (install() runs on every rank): one all_gather_object carries every rank's DP
    groups (and, the first time, its node facts: GROUP_RANK / LOCAL_WORLD_SIZE / host name), then the node groups
    of every splittable group are created in one sorted order. dist.new_group must see the same members at the
    same index on every rank; building only one's own DP group's groups, lazily, breaks that whenever there are
    several DP groups (TP, PP, CP or EP > 1)."""
    from megatron.core import parallel_state as ps

    from fp8comm.comm import topology

    if enabled and not (dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized()):
        return {}  # install() logs that every group runs flat (why_flat)
    _, plan = topology.prepare(_my_data_parallel_ranks(), holder=HOLDER, enabled=enabled)
    return plan


def why_flat() -> str:
    """Why install() prepared no node groups although two levels are on (every data-parallel group runs flat)."""
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialized at install()"
    if not ps.model_parallel_is_initialized():
        return "install() ran before parallel_state.initialize_model_parallel() (it needs the data-parallel groups)"
    return "no data-parallel group"


def _levels(cfg: Fp8CommMegatronConfig, group):
    """This group's node groups (None: flat, as install() decided, or two levels off)."""
    return hierarchical_groups(group) if cfg.hierarchical else None


def _options(cfg: Fp8CommMegatronConfig, kind: str, t: torch.Tensor, group, route=None) -> dict:
    kw: dict[str, Any] = {"config": cfg.wire(kind, _check(cfg, kind, t, group))}
    if cfg.hierarchical:  # this group's node groups, or None where install() decided it runs flat
        kw["hierarchical"] = hierarchical_groups(group)
        if route is not None and not route.choice.two_level:  # the plan runs this size class flat
            kw["hierarchical"] = None
    return kw


def _plan(cfg: Fp8CommMegatronConfig, op: str, t: torch.Tensor, group):
    """The planner's Route for this bucket collective (None: planner off); the same on every rank of the group."""
    if not cfg.planner:
        return None
    return planning.route(op, t, group, two_level=_levels(cfg, group) is not None)


def _native(orig_call, route, async_op: bool, t: torch.Tensor):
    """Megatron's own collective for a bucket the plan or the guard gives it: exactly Megatron's call, timed when
    planned (inside a coalescing block: from the call to the wait of the block's handle, after the real manager)."""
    rp = installed().planner
    if route is None or rp is None or route.choice.plan is None:
        return orig_call()
    native = Option(NATIVE)
    stack = _batches()
    if not stack and not async_op:  # synchronous: timed around the call
        with rp.timed(route.op, Choice(native, route.choice.plan), route.nbytes, route.dtype, route.shape, t.device):
            return orig_call()
    timer = planning.Timer(route, native, t.device)
    out = orig_call()
    if stack:
        stack[-1].items.append(planning.TimerStop(timer))
        return out
    if out is None:
        timer.stop()
        return out
    return planning.TimedHandle(out, timer)


def _timed_start(start, route, config, two_level: bool, t: torch.Tensor):
    """`start` whose handle also records predicted vs measured seconds from the launch to its wait (planned)."""
    if route is None or route.choice.plan is None:
        return start

    def timed():
        timer = planning.Timer(route, planning.ran(route, config, two_level), t.device)
        return planning.TimedHandle(start(), timer)

    return timed


def _grad_collective(
    hook: str, orig_call, fcomm_fn, cfg: Fp8CommMegatronConfig, output, input, op, group, async_op, plan_op: str
):
    """The gradient reduction both paths share (reduce-scatter into a shard, all-reduce in place): pass-through for
    one-rank groups, the planner's choice (Megatron's own, FP8 or 4 bits, flat or two-level), the guard's bf16 route
    (orig_call: Megatron's own collective), error feedback keyed by the bucket's gradient buffer `input`, then
    fp8comm's FP8 or 4-bit collective, issued now or at the block's exit."""
    if _size(group) == 1:  # nothing crosses a link: quantizing would only lose precision
        count(hook, "passthrough_calls")
        return orig_call()
    route = _plan(cfg, plan_op, input, group)
    if route is not None and route.native:  # the plan gives this size class Megatron's own collective
        count(hook, "native_calls")
        return _native(orig_call, route, async_op, input)
    fp4 = cfg.grad_fp4 and (route is None or route.choice.option.wire != "fp8")
    wire, bucket = guard.route("grad", input, fp4=fp4)
    if wire == "bf16":  # the numerics guard sends this bucket through Megatron's own collective for now
        return _native(orig_call, route, async_op, input)
    # Error feedback as the plan predicted it (keeps_feedback: the 4-bit recipe's residual stays off a class the plan
    # puts on FP8); a 4-bit bucket the guard demotes to FP8 keeps its residual.
    keep = keeps_feedback(route.choice if route is not None else None)
    ef = error_feedback.for_bucket(input) if cfg.error_feedback and keep else None
    opts = _options(cfg, "grad", input, group, route)
    if wire == "fp8" and cfg.grad_fp4:  # a 4-bit bucket the plan puts on FP8 or the guard demoted: E4M3 1x128 fp32
        opts["config"] = fcomm.config_for(opts["config"], "fp8")
    if not keep and opts["config"].error_feedback:
        opts["config"] = opts["config"].replace(error_feedback=False)

    def start():
        count(hook, "fp8_calls")
        count(hook, "elements", input.numel())
        return fcomm_fn(output, input, group, op, async_op=True, error_feedback=ef, guard=bucket, **opts)

    two = opts.get("hierarchical") is not None
    return _issue(_timed_start(start, route, opts["config"], two, input), async_op)


def make_reduce_scatter(orig, cfg: Fp8CommMegatronConfig):
    """FP8 (or 4-bit) counterpart of torch's reduce_scatter_tensor and Megatron's
    reduce_scatter_with_fp32_accumulation.

    Same call signature; each rank quantizes its bucket with its own block scales, one all_to_all of bytes,
    the receiver dequantizes every contribution and sums in fp32 (SUM or AVG) into the output shard. The async
    handle finishes (accumulates and writes the shard) in wait(), like the fp32-accumulation variant's handle.
    With cfg.error_feedback the bucket's residual (keyed by its gradient buffer, `input`) is added before
    quantizing and replaced by this call's quantization error (error_feedback.py).
    """

    def fp8comm_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return _grad_collective(
            "grad_reduce_scatter",
            lambda: orig(output, input, op=op, group=group, async_op=async_op),
            fcomm.reduce_scatter_into,
            cfg,
            output,
            input,
            op,
            group,
            async_op,
            "reduce_scatter",
        )

    fp8comm_reduce_scatter.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_reduce_scatter


class _Taking:
    """One start_grad_sync on the all-reduce path: the gradient buffers of its buckets and the groups it may
    reduce over (Megatron's data-parallel group, or the optimizer instance's group under force_all_reduce)."""

    def __init__(self, bucket_group) -> None:
        self.buffers = {id(b.grad_data): b.grad_data for b in bucket_group.buckets}
        self.groups = [
            g
            for g in (
                getattr(bucket_group, "data_parallel_group", None),
                getattr(bucket_group, "intra_distributed_optimizer_instance_group", None),
            )
            if g is not None
        ]

    def matches(self, tensor, group) -> bool:
        return self.buffers.get(id(tensor)) is tensor and any(group is g for g in self.groups)


def _takings() -> list[_Taking]:
    if not hasattr(_tls, "takings"):
        _tls.takings = []
    return _tls.takings


def make_start_grad_sync(orig, cfg: Fp8CommMegatronConfig):
    """Wraps _ParamAndGradBucketGroup.start_grad_sync so that its gradient all-reduce (plain DDP, or
    force_all_reduce) is fp8comm's FP8 all_reduce.

    megatron-core calls `torch.distributed.all_reduce(bucket.grad_data, ...)` directly (no module-level name to
    patch). For the duration of this one call, on this thread, torch.distributed.all_reduce answers with a
    function that takes only the all-reduce of one of THIS bucket group's gradient buffers over its own
    data-parallel group; every other call (other tensors, groups, threads) goes to the previous function
    unchanged. The distributed-optimizer path (a reduce-scatter, hooked by name) passes straight through.
    """

    def fp8comm_start_grad_sync(self, *args, **kwargs):
        force = bool(kwargs.get("force_all_reduce", args[0] if args else False))
        if self.ddp_config.use_distributed_optimizer and not force:
            return orig(self, *args, **kwargs)
        takings = _takings()
        takings.append(_Taking(self))
        prev = dist.all_reduce
        dist.all_reduce = _make_taker(prev, cfg)
        try:
            return orig(self, *args, **kwargs)
        finally:
            dist.all_reduce = prev
            takings.pop()

    fp8comm_start_grad_sync.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_start_grad_sync


def _make_taker(prev, cfg: Fp8CommMegatronConfig):
    def all_reduce(tensor, *args, **kwargs):
        takings = _takings()
        op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if not takings or not takings[-1].matches(tensor, group):
            return prev(tensor, *args, **kwargs)
        async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        return _fp8_all_reduce(prev, cfg, tensor, op, group, async_op)

    all_reduce.__wrapped__ = prev  # type: ignore[attr-defined]
    return all_reduce


def _fp8_all_reduce(orig, cfg: Fp8CommMegatronConfig, tensor, op, group, async_op: bool):
    """FP8 (or 4-bit) all-reduce of one gradient bucket, in place: a quantized reduce-scatter (each rank's own
    block scales, fp32 sum), then a quantized all-gather of each rank's reduced chunk, which every rank decodes
    from the same bytes (so replicas stay bit-identical). Error feedback covers the first quantization only (see
    docs/megatron.md)."""
    return _grad_collective(
        "grad_all_reduce",
        lambda: orig(tensor, op=op, group=group, async_op=async_op),
        fcomm.all_reduce_into,
        cfg,
        tensor,
        tensor,
        op,
        group,
        async_op,
        "all_reduce",
    )


def make_all_gather(orig, cfg: Fp8CommMegatronConfig):
    """FP8 counterpart of all_gather_into_tensor for the distributed optimizer's parameter buffers.

    Every rank, the owner included, decodes the same bytes, so replicas stay bit-identical. Refuses fp32 param
    buffers: there the distributed optimizer's fp32 master weights ARE the local shard of that buffer, and
    writing a dequantized gather into it would corrupt them every step.
    """

    def fp8comm_all_gather(output, input, group=None, async_op=False):
        if cfg.param_update:
            return _update_gather(orig, output, input, group, async_op)
        if output.dtype == torch.float32:
            if cfg.planner:  # the planner turned the gather on for bf16/fp16 buffers: an fp32 one keeps Megatron's
                count("param_all_gather", "passthrough_calls")
                return orig(output, input, group=group, async_op=async_op)
            raise Fp8CommMegatronError(
                "fp8comm: FP8 param all-gather on an fp32 parameter buffer would overwrite the distributed "
                "optimizer's fp32 master weights (they share that buffer) with FP8-rounded values; train with "
                "bf16/fp16 params (--bf16/--fp16, Float16Module) or turn --fp8comm-param-gather off"
            )
        if _size(group) == 1:
            count("param_all_gather", "passthrough_calls")
            return orig(output, input, group=group, async_op=async_op)
        call = lambda: orig(output, input, group=group, async_op=async_op)
        route = _plan(cfg, "all_gather", output, group)
        if route is not None and route.native:  # the plan gives this size class Megatron's own gather
            count("param_all_gather", "native_calls")
            return _native(call, route, async_op, output)
        wire, bucket = guard.route("param", output)  # output: the bucket's persistent parameter buffer
        if wire == "bf16":
            return _native(call, route, async_op, output)
        opts = _options(cfg, "param", input, group, route)

        def start():
            count("param_all_gather", "fp8_calls")
            count("param_all_gather", "elements", input.numel())
            return fcomm.all_gather_into(output, input, group, async_op=True, guard=bucket, **opts)

        two = opts.get("hierarchical") is not None
        return _issue(_timed_start(start, route, opts["config"], two, output), async_op)

    fp8comm_all_gather.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_all_gather


def _update_gather(orig, output, input, group, async_op: bool):
    """--fp8comm-param-update-format: the bucket's gather becomes replica += decoded 4-bit change (replica_update).
    fp32 buffers keep Megatron's gather: their slice IS the fp32 master (Megatron wrote it), nothing to round."""
    if output.dtype == torch.float32 or _size(group) == 1:
        count("param_update", "passthrough_calls")
        return orig(output, input, group=group, async_op=async_op)
    return _issue(lambda: replica_update.gather(output, input, group), async_op)
