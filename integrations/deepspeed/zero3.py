"""ZeRO-3 hooks: FP8 parameter all-gather and FP8 gradient reduce-scatter (plain and ZeRO++ qgZ paths).

Parameters: every fetch of an fp8comm engine's parameters (`all_gather_coalesced` -> `_dist_allgather_fn`, also over
the hpZ secondary group) becomes fp8comm.comm.all_gather_into, async: DeepSpeed's handle calls wait(), where the
bytes are dequantized. The dispatcher knows the engine from the per-parameter wrapper of `all_gather_coalesced`
(which also tells it the shards' boundaries); a fetch of any other parameter runs DeepSpeed's original. The
gathered copy is a fresh buffer, never the fp32 master partition (checked per call). Exact gathers DeepSpeed does
elsewhere (GatheredParameters, persistent parameters after a step, checkpoints) are left alone.

Gradients: `reduce_scatter_coalesced` (and qgZ's `all_to_all_quant_reduce`, replaced on any node count) keep their
contract - this rank's ceil(numel / world) slice of each tensor, averaged - but move FP8 with per-block scales and
sum in fp32 (one fp8comm.comm.reduce_scatter_into per bucket). The engine comes from a per-instance wrapper of its
optimizer's `__avg_scatter_grads`, which also names the parameters (error feedback keys residuals by them).

Blocks never straddle two tensors: each tensor's shard is padded to a whole number of blocks on the wire. A
block's scale then depends only on that tensor's values, not on which tensors DeepSpeed happened to bucket
together (the first step after building an engine buckets differently from later steps, so without this a run
resumed from a checkpoint would not repeat the uninterrupted run bit for bit), and a small bias never shares a
scale with a large weight. The padding costs up to block_size - 1 elements per shard, visible in hook_stats().
"""

from __future__ import annotations

import contextvars
import functools
import math

import torch
import torch.distributed as dist

import fp8comm.comm as fc
from fp8comm.errors import Fp8CommStateError, Fp8CommTypeError

from . import levels, planning
from .compat import PP, S3
from .patching import PASSTHROUGH, wrap_method

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# (EngineState, parameters) of the all_gather_coalesced call in progress (set by the per-parameter wrapper below).
_current: contextvars.ContextVar = contextvars.ContextVar("fp8comm_zero3_params", default=None)
# (EngineState, parameters) of the gradient reduction in progress (set by the optimizer-instance wrapper).
_reducing: contextvars.ContextVar = contextvars.ContextVar("fp8comm_zero3_reduce", default=None)
AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def install(patcher, role: str) -> None:
    """The process-wide dispatchers of `role`; attach() connects one engine to them."""
    if role == "weights":
        patcher.set(PP, "_dist_allgather_fn", _param_gather)
    if role == "gradients":
        patcher.set(S3, "reduce_scatter_coalesced", lambda orig: _grad_reduce(orig, "plain"))
        patcher.set(S3, "all_to_all_quant_reduce", lambda orig: _grad_reduce(orig, "qgz"))


def attach(es, engine) -> None:
    if es.cfg.weights.enabled:
        wrap_params(es, engine.module)
    if es.cfg.gradients.enabled:
        opt = engine.optimizer

        def make(orig):
            @functools.wraps(orig)
            def avg_scatter_grads(params_to_reduce, communication_data_type):
                token = _reducing.set((es, list(params_to_reduce)))
                try:
                    return orig(params_to_reduce, communication_data_type)
                finally:
                    _reducing.reset(token)

            return avg_scatter_grads

        wrap_method(es, opt, AVG_SCATTER, make)


def wrap_params(es, module) -> None:
    """Let the gather dispatcher see which engine and parameters a coalesced fetch holds (the shards' boundaries).

    DeepSpeed attaches `all_gather_coalesced` to every ZeRO-3 parameter; the wrapper records the call's list."""
    for p in module.parameters():
        fn = getattr(p, "all_gather_coalesced", None)
        if fn is None:
            continue
        if getattr(fn, "_fp8comm_hook", False):
            raise Fp8CommStateError("fp8comm: a ZeRO-3 parameter is already wired to another fp8comm engine")

        def wrapped(params, *a, _fn=fn, **k):
            token = _current.set((es, list(params)))
            try:
                return _fn(params, *a, **k)
            finally:
                _current.reset(token)

        setattr(wrapped, "_fp8comm_hook", True)  # noqa: B010
        p.all_gather_coalesced = wrapped
        es.undo.append(lambda p=p, fn=fn: setattr(p, "all_gather_coalesced", fn))


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _shard_sizes(input_tensor: torch.Tensor, params) -> tuple[list[int] | None, bool]:
    """(sizes of the parameter shards concatenated in `input_tensor` as DeepSpeed lays them out, or None;
    whether they are hpZ secondary shards)."""
    from deepspeed.runtime.zero.partition_parameters import get_allgather_dtype

    if not params:
        return None, False
    ps = sorted((p for p in params if get_allgather_dtype(p, p.ds_tensor) == input_tensor.dtype), key=lambda p: p.ds_id)
    if not ps:
        return None, False
    sec = ps[0].ds_secondary_tensor is not None
    sizes = [p.ds_tensor.ds_numel * (p.ds_secondary_tensor_num_of_groups if sec else 1) for p in ps]
    return (sizes if sum(sizes) == input_tensor.numel() else None), sec


class _UnpadHandle:
    """Async handle: wait() finishes the FP8 gather, then moves each shard from its padded slot to DeepSpeed's."""

    def __init__(self, inner, padded: torch.Tensor, output: torch.Tensor, spans: list, world: int) -> None:
        self._inner, self._padded, self._out, self._spans, self._world = inner, padded, output, spans, world
        self._done = False

    def wait(self, *args, **kwargs):
        if not self._done:
            if self._padded.is_cuda:
                # allocated on the issuing stream, decoded and copied on this one (DeepSpeed may wait on another
                # stream than it issued on): without this, freeing it lets the allocator hand the memory out on
                # the issuing stream while the decode and copy queued here have not run yet
                self._padded.record_stream(torch.cuda.current_stream(self._padded.device))
            self._inner.wait()
            src = self._padded.view(self._world, -1)
            dst = self._out.view(self._world, -1)
            for off, poff, n in self._spans:
                dst[:, off : off + n].copy_(src[:, poff : poff + n])
            self._done = True
        return self._out

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()


def _spans(sizes: list[int], block: int) -> tuple[list, int]:
    """[(offset, padded offset, size)] and the padded total, each size rounded up to whole blocks."""
    spans, off, poff = [], 0, 0
    for n in sizes:
        spans.append((off, poff, n))
        off += n
        poff += -(-n // block) * block
    return spans, poff


def _param_gather(orig):
    """The dispatcher: FP8 for fetches of an fp8comm engine's parameters, DeepSpeed's function for anything else
    (other engines, dtypes it does not quantize such as qwZ's int8 codes and scales)."""

    def _dist_allgather_fn(input_tensor, output_tensor, group=None):
        cur = _current.get()
        es, params = cur if cur is not None else (None, None)
        if es is None or not es.attached:
            PASSTHROUGH.hit("zero3.param_gather")
            return orig(input_tensor, output_tensor, group)
        _, world = _world(group)
        n = input_tensor.numel() * input_tensor.element_size()
        if input_tensor.dtype not in _FLOATS or output_tensor.dtype != input_tensor.dtype:
            es.acct.add("weights", (world - 1) * n, (world - 1) * n, False)
            es.acct.hit("zero3.param_gather.native_dtype")
            return orig(input_tensor, output_tensor, group)
        if es.cfg.measure_only:
            es.acct.add("weights", (world - 1) * n, (world - 1) * n, False)
            return orig(input_tensor, output_tensor, group)
        wire = es.cfg.weights
        gathered = world * n
        d = planning.decide(
            es,
            "weights",
            input_tensor.device,
            False,
            op="all_gather",
            nbytes=gathered,
            dtype=input_tensor.dtype,
            group=group,
        )
        how, gb = d.how, d.guard
        if how == "bf16":  # the plan or the guard: DeepSpeed's own gather in the parameters' dtype
            es.acct.add("weights", (world - 1) * n, (world - 1) * n, False)
            h = orig(input_tensor, output_tensor, group)
            return planning.handle(h, es, d, "all_gather", gathered, input_tensor.dtype, input_tensor.device)
        es.check_not_master(output_tensor, "ZeRO-3 parameter all-gather")
        sizes, secondary = _shard_sizes(input_tensor, params)
        if secondary:
            es.acct.hit("zero3.param_gather.hpz_secondary")
        if sizes is None:
            es.acct.hit("zero3.param_gather.unaligned")
            sizes = [input_tensor.numel()]
        spans, total = _spans(sizes, wire.block_size)
        baseline = (world - 1) * n  # DeepSpeed's all-gather of the unpadded shards
        wcfg = wire.wire(es.cfg.check)
        hg = d.hier  # two levels where the group spans nodes and the plan (if on) says so
        with es.acct.fp8("weights", baseline=baseline):
            if total == input_tensor.numel():
                h = fc.all_gather_into(
                    output_tensor, input_tensor, group, async_op=True, config=wcfg, guard=gb, hierarchical=hg
                )
                return planning.handle(h, es, d, "all_gather", gathered, input_tensor.dtype, input_tensor.device)
            pin = torch.zeros(total, dtype=input_tensor.dtype, device=input_tensor.device)
            for off, poff, k in spans:
                pin[poff : poff + k].copy_(input_tensor[off : off + k])
            pout = torch.empty(world * total, dtype=input_tensor.dtype, device=input_tensor.device)
            h = fc.all_gather_into(pout, pin, group, async_op=True, config=wcfg, guard=gb, hierarchical=hg)
        h = _UnpadHandle(h, pout, output_tensor, spans, world)
        return planning.handle(h, es, d, "all_gather", gathered, input_tensor.dtype, input_tensor.device)

    return _dist_allgather_fn


def _grad_reduce(orig, path: str):
    """The dispatcher: FP8 reduce-scatter inside an fp8comm engine's __avg_scatter_grads, DeepSpeed's otherwise."""

    def fp8_reduce(tensors, group=None):
        cur = _reducing.get()
        if cur is None or not cur[0].attached:
            PASSTHROUGH.hit(f"zero3.grad_reduce.{path}")
            return orig(tensors, group)
        es, params = cur
        wire = es.cfg.gradients
        B = wire.block_size
        # qgZ's second argument is its dict of all-to-all groups; it reduces over the whole world (so do we).
        pg = None if path == "qgz" else group
        rank, world = _world(pg)
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _FLOATS:
            raise Fp8CommTypeError(f"fp8comm ZeRO-3 gradient hook: expected one float dtype per bucket, got {dtypes}")
        dtype = next(iter(dtypes))
        chunks = [math.ceil(t.numel() / world) for t in tensors]
        itemsize = tensors[0].element_size()
        baseline = (world - 1) * sum(chunks) * itemsize  # DeepSpeed's reduce-scatter of the unpadded layout
        es.acct.hit(f"zero3.grad_reduce.{path}")
        nbytes = world * sum(chunks) * itemsize
        if es.cfg.measure_only:
            d = planning.Decision("fp8", None, None, None)
        else:
            d = planning.decide(
                es,
                "gradients",
                tensors[0].device,
                wire.is_fp4,
                op="reduce_scatter",
                nbytes=nbytes,
                dtype=dtype,
                group=pg,
            )
        how, gb = d.how, d.guard
        if es.cfg.measure_only or how == "bf16":  # plan or guard fallback: residuals kept for the next FP8 step
            es.acct.add("gradients", baseline, baseline, False)
            with planning.timed(es, d, "reduce_scatter", nbytes, dtype, tensors[0].device):
                return orig(tensors, group)
        spans, L = _spans(chunks, B)
        # Row r of [world, L] holds rank r's slice of every tensor (DeepSpeed's interleaving), each slice in
        # whole blocks of its own.
        flat = torch.zeros(world, L, dtype=dtype, device=tensors[0].device)
        pieces = []
        for i, (t, (_, poff, c)) in enumerate(zip(tensors, spans)):
            v = t.reshape(-1)
            n = v.numel()
            full = n // c if c else 0
            if full:
                flat[:full, poff : poff + c].copy_(v[: full * c].view(full, c))
            if full < world and n > full * c:
                flat[full, poff : poff + n - full * c].copy_(v[full * c :])
            if es.residuals is not None:
                if len(params) != len(tensors):
                    raise Fp8CommStateError(
                        f"fp8comm ZeRO-3 error feedback: {len(tensors)} gradients for "
                        f"{len(params)} parameters; cannot key residuals"
                    )
                name = es.name_of(params[i])
                pieces += [(name, n, r * c, r * L + poff, min(c, n - r * c)) for r in range(world) if n > r * c]
        out = torch.empty(L, dtype=dtype, device=flat.device)
        ef = None
        hg = d.hier  # two levels where the group spans nodes and the plan (if on) says so (fp32 sums inside a node)
        window = levels.rail_window(flat.numel(), hg)  # two levels: the residual of my rail's chunks only
        if es.residuals is not None and planning.feedback(d):
            ef = es.residuals.assemble(pieces, flat.numel(), flat.device, window)
        with (
            es.acct.fp8("gradients", baseline=baseline),
            planning.timed(es, d, "reduce_scatter", nbytes, dtype, flat.device),
        ):
            fc.reduce_scatter_into(
                out,
                flat.view(-1),
                pg,
                op="avg",
                config=planning.call_config(es, wire.wire(es.cfg.check), d),  # 4 bits, or FP8 (plan or guard)
                error_feedback=ef,
                guard=gb,
                hierarchical=hg,
            )
        if ef is not None:
            es.residuals.scatter(ef, pieces, flat.numel(), window)
        result = []
        for t, (_, poff, c) in zip(tensors, spans):
            mine = max(0, min(c, t.numel() - rank * c))
            result.append(out.narrow(0, poff, mine))
        return result

    fp8_reduce.__name__ = "reduce_scatter_coalesced" if path == "plain" else "all_to_all_quant_reduce"
    return fp8_reduce
