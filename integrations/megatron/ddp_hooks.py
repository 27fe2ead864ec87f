"""DDP hooks: FP8 gradient reduce-scatter and FP8 parameter all-gather for Megatron's bucket groups.

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
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.distributed as dist

from fp8comm import comm as fcomm

from . import error_feedback, guard
from .config import Fp8CommMegatronConfig, Fp8CommMegatronError, count
from .installation import installed

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


def hierarchical_groups(group):
    """fp8comm node groups for a Megatron group (a strided DP group has fewer members per node than the node)."""
    key = id(group)
    cache = installed().node_groups
    if key in cache:
        return cache[key]
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if not lws:
        raise Fp8CommMegatronError("fp8comm: --fp8comm-hierarchical needs LOCAL_WORLD_SIZE (set by torchrun)")
    ranks = dist.get_process_group_ranks(group)
    nodes = [r // int(lws) for r in ranks]
    per_node = {n: nodes.count(n) for n in nodes}
    local = per_node[nodes[0]]
    if len(set(per_node.values())) != 1 or nodes != sorted(nodes):
        raise Fp8CommMegatronError(
            f"fp8comm: hierarchical mode needs every node to hold the same number of "
            f"consecutive members of the group; group ranks {ranks} with "
            f"LOCAL_WORLD_SIZE={lws} give per-node counts {per_node}"
        )
    hg = fcomm.node_groups(group, local_size=local)
    cache[key] = hg
    return hg


def _options(cfg: Fp8CommMegatronConfig, kind: str, t: torch.Tensor, group) -> dict:
    kw = {"config": cfg.wire(kind, _check(cfg, kind, t, group))}
    if cfg.hierarchical:
        kw["hierarchical"] = hierarchical_groups(group)
    return kw


def make_reduce_scatter(orig, cfg: Fp8CommMegatronConfig):
    """FP8 counterpart of torch's reduce_scatter_tensor and Megatron's reduce_scatter_with_fp32_accumulation.

    Same call signature; each rank quantizes its bucket with its own 1xB block scales, one all_to_all of bytes,
    the receiver dequantizes every contribution and sums in fp32 (SUM or AVG) into the output shard. The async
    handle finishes (accumulates and writes the shard) in wait(), like the fp32-accumulation variant's handle.
    With cfg.error_feedback the bucket's residual (keyed by its gradient buffer, `input`) is added before
    quantizing and replaced by this call's quantization error (error_feedback.py).
    """

    def fp8comm_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if _size(group) == 1:  # nothing crosses a link: quantizing would only lose precision
            count("grad_reduce_scatter", "passthrough_calls")
            return orig(output, input, op=op, group=group, async_op=async_op)

        wire, bucket = guard.route("grad", input)
        if wire == "bf16":  # the numerics guard sends this bucket through Megatron's own collective for now
            return orig(output, input, op=op, group=group, async_op=async_op)
        ef = error_feedback.for_bucket(input) if cfg.error_feedback else None

        def start():
            count("grad_reduce_scatter", "fp8_calls")
            count("grad_reduce_scatter", "elements", input.numel())
            return fcomm.reduce_scatter_into(
                output,
                input,
                group,
                op,
                async_op=True,
                error_feedback=ef,
                guard=bucket,
                **_options(cfg, "grad", input, group),
            )

        return _issue(start, async_op)

    fp8comm_reduce_scatter.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_reduce_scatter


def make_all_gather(orig, cfg: Fp8CommMegatronConfig):
    """FP8 counterpart of all_gather_into_tensor for the distributed optimizer's parameter buffers.

    Every rank, the owner included, decodes the same bytes, so replicas stay bit-identical. Refuses fp32 param
    buffers: there the distributed optimizer's fp32 master weights ARE the local shard of that buffer, and
    writing a dequantized gather into it would corrupt them every step.
    """

    def fp8comm_all_gather(output, input, group=None, async_op=False):
        if output.dtype == torch.float32:
            raise Fp8CommMegatronError(
                "fp8comm: FP8 param all-gather on an fp32 parameter buffer would overwrite the distributed "
                "optimizer's fp32 master weights (they share that buffer) with FP8-rounded values; train with "
                "bf16/fp16 params (--bf16/--fp16, Float16Module) or turn --fp8comm-param-gather off"
            )
        if _size(group) == 1:
            count("param_all_gather", "passthrough_calls")
            return orig(output, input, group=group, async_op=async_op)
        wire, bucket = guard.route("param", output)  # output: the bucket's persistent parameter buffer
        if wire == "bf16":
            return orig(output, input, group=group, async_op=async_op)

        def start():
            count("param_all_gather", "fp8_calls")
            count("param_all_gather", "elements", input.numel())
            return fcomm.all_gather_into(
                output, input, group, async_op=True, guard=bucket, **_options(cfg, "param", input, group)
            )

        return _issue(start, async_op)

    fp8comm_all_gather.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_all_gather
