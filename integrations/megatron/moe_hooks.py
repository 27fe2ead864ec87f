"""MoE hooks: FP8 token dispatch and an FP8/bf16 combine in Megatron's alltoall and allgather token dispatchers.

alltoall: token_dispatch() sends the tokens, then the probs, and token_combine() sends expert outputs back, all
through the module-level `all_to_all` (tensor_parallel.mappings). The patched methods mark the exact tensor they
were given; the patched `all_to_all` sends that one tensor with fp8comm.comm.all_to_all (1xB scales per token,
autograd; gradients go back on cfg.moe_grad_wire) and passes everything else (probs, other callers) through.
allgather: token_dispatch() gathers routing map, probs and tokens with `gather_from_sequence_parallel_region`
over the TP x EP group; the marked tokens take an FP8 all-gather (backward: reduce-scatter, fp32 accumulation on
the fp8 grad wire). token_combine() reduce-scatters expert outputs with `reduce_scatter_to_sequence_parallel_region`:
with moe_combine=fp8 an FP8 reduce-scatter with fp32 accumulation (backward: all-gather on the grad wire).
flex (DeepEP / HybridEP fused CUDA kernels) is not hooked: install refuses it, and its token_dispatch raises if
the dispatcher type was unknown at install.
"""

from __future__ import annotations

import math
import threading

import torch

from fp8comm import comm as fcomm

from . import guard
from .config import HOOKED_DISPATCHERS, Fp8CommMegatronConfig, Fp8CommMegatronError, count
from .installation import installed

_tls = threading.local()


def reset_marks() -> None:
    for name in ("tokens", "combine", "ag_tokens", "ag_combine"):
        setattr(_tls, name, None)


def _check(cfg: Fp8CommMegatronConfig, key) -> bool:
    """Metadata check per policy: "first" = the first call per (kind, group)."""
    if cfg.check != "first":
        return cfg.check == "always"
    checked = installed().checked
    if key in checked:
        return False
    checked.add(key)
    return True


def _marking(orig, slot: str, pick):
    """Wrap a dispatcher method so that `pick(args)` (what it will send) is marked in _tls.<slot>, with the
    dispatcher (one per MoE layer: the numerics guard's bucket)."""

    def fp8comm_marked(self, *args, **kwargs):
        prev = getattr(_tls, slot, None)
        setattr(_tls, slot, (pick(self, args, kwargs), self))
        try:
            return orig(self, *args, **kwargs)
        finally:
            setattr(_tls, slot, prev)

    fp8comm_marked.__wrapped__ = orig  # type: ignore[attr-defined]
    fp8comm_marked.__name__ = getattr(orig, "__name__", "fp8comm_marked")
    return fp8comm_marked


def _first_arg(name):
    return lambda self, args, kwargs: args[0] if args else kwargs.get(name)


def _take(slot: str, obj):
    """The dispatcher that marked `obj` in _tls.<slot> (the mark is used up), or None when `obj` is not marked."""
    mark = getattr(_tls, slot, None)
    if mark is None or mark[0] is not obj:
        return None
    setattr(_tls, slot, None)
    return mark[1]


# ------------------------------------------------------------------------------------------------ alltoall
def make_token_dispatch(orig):
    """MoEAlltoAllTokenDispatcher.token_dispatch that marks its tokens for the FP8 all_to_all."""
    return _marking(orig, "tokens", _first_arg("permutated_local_input_tokens"))


def make_token_combine(orig):
    """MoEAlltoAllTokenDispatcher.token_combine that marks the expert outputs it sends back."""
    return _marking(orig, "combine", _first_arg("hidden_states"))


def make_all_to_all(orig, cfg: Fp8CommMegatronConfig):
    """Megatron's all_to_all(group, input_, output_splits, input_splits) with the marked tensors via fp8comm."""

    def fp8comm_all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, **kwargs):
        # the tokens go once; the probs that follow (and other callers) take Megatron's path
        layer = _take("tokens", input_) if cfg.moe_dispatch else None
        if layer is not None:
            hook, wire = "moe_dispatch", "fp8"
        else:
            layer = _take("combine", input_) if cfg.moe_combine != "native" else None
            if layer is None:
                return orig(group, input_, output_split_sizes_, input_split_sizes, **kwargs)
            hook, wire = "moe_combine", cfg.moe_combine
        if group.size() == 1:  # EP=1: Megatron's all_to_all is an identity, nothing to quantize
            count(hook, "passthrough_calls")
            return orig(group, input_, output_split_sizes_, input_split_sizes, **kwargs)
        route, bucket = guard.route("moe", layer, input_.device)
        if route == "bf16":  # the guard: Megatron's own all-to-all (both ways) for this layer, for now
            return orig(group, input_, output_split_sizes_, input_split_sizes, **kwargs)
        count(hook, "fp8_calls" if wire == "fp8" else "bf16_calls")
        count(hook, "elements", input_.numel())
        return fcomm.all_to_all(
            input_.contiguous(),
            _host(output_split_sizes_),
            _host(input_split_sizes),
            group,
            wire=wire,
            grad_wire=cfg.moe_grad_wire,
            config=cfg.wire("moe", _check(cfg, (hook, id(group)))),
            guard=bucket,
        )

    fp8comm_all_to_all.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_all_to_all


def _host(splits):
    """Split sizes as a host list (Megatron passes numpy arrays, lists, or None for equal splits)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]


# ------------------------------------------------------------------------------------------------ allgather
def make_ag_token_dispatch(orig):
    """MoEAllGatherTokenDispatcher.token_dispatch that marks the hidden states (not routing map or probs)."""
    return _marking(orig, "ag_tokens", _first_arg("hidden_states"))


def make_ag_token_combine(orig):
    """MoEAllGatherTokenDispatcher.token_combine: its one reduce-scatter (of expert outputs) is the combine."""
    return _marking(orig, "ag_combine", lambda self, args, kwargs: self.tp_ep_group)


def _token_block(cfg: Fp8CommMegatronConfig, hidden: int) -> int:
    """Flat 1xB blocks that never straddle two tokens: B = gcd(hidden, block_size) (= block_size when it divides)."""
    return math.gcd(hidden, cfg.block_size)


def _grad_wire_reduce_scatter(g: torch.Tensor, group, cfg: Fp8CommMegatronConfig, orig_rs, bucket) -> torch.Tensor:
    """Sum over `group` of g [W*T, H], this rank's T rows, on cfg.moe_grad_wire (fp8: fp32 accumulation)."""
    if cfg.moe_grad_wire == "fp8":
        wire = cfg.wire("grad", _check(cfg, ("moe_grad_rs", id(group))), _token_block(cfg, g.shape[-1]))
        return fcomm.reduce_scatter(
            g.contiguous(), group, "sum", config=wire.replace(rounding="nearest", error_feedback=False), guard=bucket
        )
    if cfg.moe_grad_wire == "bf16" and g.dtype != torch.bfloat16:
        return orig_rs(g.to(torch.bfloat16), group).to(g.dtype)
    return orig_rs(g, group)


def _grad_wire_all_gather(g: torch.Tensor, group, cfg: Fp8CommMegatronConfig, orig_ag, bucket) -> torch.Tensor:
    """Concatenation over `group` of g [T, H] on cfg.moe_grad_wire."""
    if cfg.moe_grad_wire == "fp8":
        wire = cfg.wire("grad", _check(cfg, ("moe_grad_ag", id(group))), _token_block(cfg, g.shape[-1]))
        return fcomm.all_gather(
            g.contiguous(), group, config=wire.replace(rounding="nearest", error_feedback=False), guard=bucket
        )
    if cfg.moe_grad_wire == "bf16" and g.dtype != torch.bfloat16:
        return orig_ag(g.to(torch.bfloat16), group).to(g.dtype)
    return orig_ag(g, group)


class _Fp8GatherTokens(torch.autograd.Function):
    """Forward: FP8 all-gather of tokens along dim 0. Backward: reduce-scatter of their gradient (grad wire)."""

    @staticmethod
    def forward(ctx, x, group, cfg, orig_rs, check, bucket):
        ctx.group, ctx.cfg, ctx.orig_rs, ctx.bucket = group, cfg, orig_rs, bucket
        wire = cfg.wire("moe", check, _token_block(cfg, x.shape[-1]))
        return fcomm.all_gather(x.contiguous(), group, config=wire, guard=bucket)

    @staticmethod
    def backward(ctx, g):
        return _grad_wire_reduce_scatter(g, ctx.group, ctx.cfg, ctx.orig_rs, ctx.bucket), None, None, None, None, None


class _Fp8ReduceScatterTokens(torch.autograd.Function):
    """Forward: FP8 reduce-scatter (fp32 accumulation) along dim 0. Backward: all-gather (grad wire)."""

    @staticmethod
    def forward(ctx, x, group, cfg, orig_ag, check, bucket):
        ctx.group, ctx.cfg, ctx.orig_ag, ctx.bucket = group, cfg, orig_ag, bucket
        wire = cfg.wire("moe", check, _token_block(cfg, x.shape[-1]))
        return fcomm.reduce_scatter(x.contiguous(), group, "sum", config=wire, guard=bucket)

    @staticmethod
    def backward(ctx, g):
        return _grad_wire_all_gather(g, ctx.group, ctx.cfg, ctx.orig_ag, ctx.bucket), None, None, None, None, None


def _megatron_rs(g, group):
    from megatron.core.tensor_parallel.mappings import _reduce_scatter_along_first_dim

    return _reduce_scatter_along_first_dim(g, group)


def _megatron_ag(g, group):
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

    return _gather_along_first_dim(g, group)


def make_gather_from_sequence_parallel_region(orig, cfg: Fp8CommMegatronConfig):
    """Megatron's gather_from_sequence_parallel_region with the marked dispatch tokens as an FP8 all-gather."""

    def fp8comm_gather_from_sequence_parallel_region(
        input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None, use_global_buffer=False
    ):
        if not tensor_parallel_output_grad or output_split_sizes is not None or group is None:
            return orig(input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        layer = _take("ag_tokens", input_)
        if layer is None:
            return orig(input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        if group.size() == 1:
            count("moe_dispatch", "passthrough_calls")
            return orig(input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        route, bucket = guard.route("moe", layer, input_.device)
        if route == "bf16":  # the guard: Megatron's own gather (and its backward) for this layer, for now
            return orig(input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        count("moe_dispatch", "fp8_calls")
        count("moe_dispatch", "elements", input_.numel())
        check = _check(cfg, ("moe_dispatch", id(group)))
        return _Fp8GatherTokens.apply(input_, group, cfg, _megatron_rs, check, bucket)

    fp8comm_gather_from_sequence_parallel_region.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_gather_from_sequence_parallel_region


def make_reduce_scatter_to_sequence_parallel_region(orig, cfg: Fp8CommMegatronConfig):
    """Megatron's reduce_scatter_to_sequence_parallel_region with the combine on cfg.moe_combine's wire."""

    def fp8comm_reduce_scatter_to_sequence_parallel_region(
        input_, group=None, input_split_sizes=None, use_global_buffer=False
    ):
        layer = _take("ag_combine", group) if group is not None and input_split_sizes is None else None
        if layer is None:
            return orig(input_, group, input_split_sizes, use_global_buffer)
        if group.size() == 1:
            count("moe_combine", "passthrough_calls")
            return orig(input_, group, input_split_sizes, use_global_buffer)
        route, bucket = guard.route("moe", layer, input_.device)
        if route == "bf16":  # the guard: Megatron's own reduce-scatter for this layer, for now
            return orig(input_, group, input_split_sizes, use_global_buffer)
        count("moe_combine", "elements", input_.numel())
        if cfg.moe_combine == "bf16":  # Megatron's reduce-scatter on a bf16 wire (summed in bf16 by the backend)
            count("moe_combine", "bf16_calls")
            return orig(input_.to(torch.bfloat16), group, None, False).to(input_.dtype)
        count("moe_combine", "fp8_calls")
        check = _check(cfg, ("moe_combine", id(group)))
        return _Fp8ReduceScatterTokens.apply(input_, group, cfg, _megatron_ag, check, bucket)

    fp8comm_reduce_scatter_to_sequence_parallel_region.__wrapped__ = orig  # type: ignore[attr-defined]
    return fp8comm_reduce_scatter_to_sequence_parallel_region


# ------------------------------------------------------------------------------------------------ flex
def make_flex_refusal(orig):
    """MoEFlexTokenDispatcher.token_dispatch that refuses to run unhooked (install could not see the type)."""

    def fp8comm_flex_token_dispatch(self, *args, **kwargs):
        raise Fp8CommMegatronError(
            "fp8comm: --fp8comm-moe-dispatch/--fp8comm-moe-combine with --moe-token-dispatcher-type flex: the flex "
            "dispatcher runs DeepEP/HybridEP fused kernels, which fp8comm does not hook (and which need CUDA); "
            f"supported dispatchers: {', '.join(HOOKED_DISPATCHERS)}. Turn the fp8comm MoE flags off for flex."
        )

    fp8comm_flex_token_dispatch.__wrapped__ = orig
    return fp8comm_flex_token_dispatch
