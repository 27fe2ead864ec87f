"""Fp8Linear: a drop-in nn.Linear whose three GEMMs run in FP8 with fp32 accumulation.

forward  y  = x . W^T    (input  x [M, K], weight W [N, K]; contraction over K)
dgrad    dx = dy . W     (grad  dy [M, N], W^T [K, N];      contraction over N)
wgrad    dW = dy^T . x   (dy^T [N, M], x^T [K, M];          contraction over the M tokens)

Each operand is quantized along its GEMM's contraction dim with its role's config (recipes.py). Per-tensor
scales and 128x128 weight blocks are transpose-invariant, so the same codes serve both orientations; rows,
1x128 and 1x32 blocks are not, so the transposed operand is quantized separately (DeepSeek-V3 quantizes x and dy
along the token dim for wgrad). The quantized weight is cached and recomputed only when the weight changes (its
version counter moves: an optimizer step or a load), i.e. once per optimizer step, not once per micro-batch.

Under ZeRO-3 / FSDP the full weight exists only while the engine holds it gathered, and a cache of its FP8 copy
would keep ~2 bytes per parameter of the whole model on every GPU (and the engine's re-gather may reuse storage
and version counter, so the cache key could repeat after an optimizer step). weight_cache="gathered" keeps
nothing: the forward quantizes the gathered weight, the backward quantizes it again from the engine's re-gather.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import Fp8CommError, Fp8CommTypeError
from ..quant import Fp8Tensor, quantize, quantize_with_transpose, scale_from_amax
from ..quant.formats import get_format
from . import backends
from .recipes import ROLES, Fp8Recipe, get_recipe


def _push_history(hist: torch.Tensor, amax: torch.Tensor) -> None:
    """Shift the amax history by one and put the newest amax (of the finite values) first, without a host sync."""
    a = amax.detach().float().reshape(-1)
    a = a.max().reshape(1) if a.numel() else torch.zeros(1, device=hist.device)
    hist.copy_(torch.cat([a.to(hist.device), hist[:-1]]))


WEIGHT_CACHES = ("step", "gathered")


class _Fp8LinearFn(torch.autograd.Function):
    """Autograd for the three FP8 GEMMs; `layer` supplies quantization and `wq` the FP8 weight.

    keep_wq=False (weight_cache "gathered"): the FP8 weight is not kept for the backward, which quantizes the
    layer's weight again (the engine has gathered it again by then)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, layer, wq, keep_wq):
        with torch.autocast(x2.device.type, enabled=False):
            # keep x in FP8 for wgrad, laid out for it (contraction over tokens): with transpose-invariant
            # scaling the same codes, transposed in the quantizing pass; else x quantized along the token dim
            xq, xq_t = layer._quantize_pair(x2, "input", ctx.needs_input_grad[1])
            y = backends.gemm(xq, wq, x2.dtype, layer.backend)
            if bias is not None:
                y = y + bias.to(y.dtype)
            ctx.layer, ctx.wq, ctx.x_dtype, ctx.w_dtype = layer, wq if keep_wq else None, x2.dtype, weight.dtype
            ctx.has_bias = bias is not None
            ctx.xq_t = xq_t
        return y

    @staticmethod
    def backward(ctx, dy):
        layer = ctx.layer
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.contiguous()
            dyq, dyq_t = layer._quantize_pair(dy, "grad", ctx.needs_input_grad[1])
            if ctx.needs_input_grad[0]:
                wq_t = layer._weight_dgrad(ctx.wq) if ctx.wq is not None else layer._quantize_weight_t()
                dx = backends.gemm(dyq, wq_t, ctx.x_dtype, layer.backend)
            if ctx.needs_input_grad[1]:
                dw = backends.gemm(dyq_t, ctx.xq_t, ctx.w_dtype, layer.backend)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy.float().sum(0).to(ctx.w_dtype)
        ctx.xq_t = ctx.wq = None
        return dx, dw, db, None, None, None


class Fp8Linear(nn.Linear):
    """nn.Linear with FP8 forward, dgrad and wgrad GEMMs (fp32 accumulation) under `recipe`.

    State dict: the same `weight`/`bias` keys as nn.Linear; delayed recipes add `{input,weight,grad}_amax_history`
    (a plain checkpoint loads into it; use strip_fp8_state() to load its checkpoint into a plain nn.Linear).
    `backend`: auto | emulation | scaled_mm | triton (see backends.py); `quant_backend` goes to fp8comm.quantize.
    `weight_cache`: "step" keeps the FP8 weight until the weight changes (plain DDP, ZeRO-1/2, Megatron);
    "gathered" keeps no FP8 copy beyond the GEMM that uses it (ZeRO-3, FSDP: see the module docstring).
    Output dtype is the input's (under autocast, the autocast dtype, like nn.Linear).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: str | Fp8Recipe = "blockwise",
        backend: str = "auto",
        quant_backend: str = "auto",
        weight_cache: str = "step",
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe, backend, quant_backend, weight_cache)

    def _setup(self, recipe, backend: str, quant_backend: str, weight_cache: str = "step") -> None:
        if backend not in backends.BACKENDS:
            raise Fp8CommError(f"unknown GEMM backend {backend!r}; valid: {', '.join(backends.BACKENDS)}")
        self.recipe = get_recipe(recipe)
        self.backend = backend
        self.quant_backend = quant_backend
        self.weight_cache = weight_cache
        self.telemetry: Any = None  # a telemetry.Telemetry, set by Telemetry.attach
        self.fp8_name = ""
        self.weight_quantizations = 0  # how often the weight was quantized (once per optimizer step)
        self._wcache: tuple | None = None
        self._quantize_hooks: OrderedDict[int, Callable] = OrderedDict()  # weakref-able, as RemovableHandle needs
        self._ready = {r: False for r in ROLES}  # delayed: the history holds an amax (else use current scaling)
        dev = self.weight.device
        for r in ROLES:
            if self.recipe.role(r).source == "delayed":
                self.register_buffer(
                    f"{r}_amax_history", torch.zeros(self.recipe.history_len, dtype=torch.float32, device=dev)
                )

    @classmethod
    def from_linear(
        cls,
        lin: nn.Linear,
        recipe: str | Fp8Recipe = "blockwise",
        backend: str = "auto",
        quant_backend: str = "auto",
        weight_cache: str = "step",
    ) -> Fp8Linear:
        """An Fp8Linear sharing `lin`'s Parameters (optimizer state and tied weights stay valid)."""
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta", recipe="tensorwise")
        new.weight, new.bias = lin.weight, lin.bias
        new._setup(recipe, backend, quant_backend, weight_cache)
        new.train(lin.training)
        return new

    @property
    def weight_cache(self) -> str:
        return self._weight_cache

    @weight_cache.setter
    def weight_cache(self, policy: str) -> None:
        if policy not in WEIGHT_CACHES:
            raise Fp8CommError(
                f"unknown weight_cache {policy!r}; valid: {', '.join(WEIGHT_CACHES)} ('gathered' "
                "under ZeRO-3 / FSDP, where the full weight exists only while the engine gathers it)"
            )
        self._weight_cache = policy
        self._wcache = None

    def extra_repr(self) -> str:
        cache = "" if self.weight_cache == "step" else f", weight_cache={self.weight_cache}"
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}{cache}"

    # ------------------------------------------------------------------------------------------ quantization
    def _scale_for(self, role: str) -> torch.Tensor | None:
        cfg = self.recipe.role(role)
        dev = self.weight.device
        if cfg.source == "none":
            return torch.ones(1, 1, device=dev)
        if cfg.source == "constant":
            return torch.full((1, 1), 2.0**-self.recipe.constant_bias, device=dev)
        if cfg.source == "delayed" and self._ready[role]:
            h = getattr(self, f"{role}_amax_history")
            amax = h.max() if self.recipe.amax_reduce == "max" else h[0]
            return scale_from_amax(amax.reshape(1, 1), get_format(cfg.fmt), cfg.scaling)
        return None  # current scaling

    def _quantize(self, t: torch.Tensor, role: str, primary: bool = True, with_transpose: bool = False):
        """Quantize a 2-D GEMM operand of `role` along its last (contraction) dim; `primary` marks the tensor's
        first quantization in this step (delayed history and telemetry are updated once per tensor).
        with_transpose: return (q, q^T as a contiguous operand), see quantize_with_transpose."""
        cfg = self.recipe.role(role)
        # one global state (no grad, no autocast) for every call: compiled quantizers would recompile per state
        with torch.no_grad(), torch.autocast(t.device.type, enabled=False):
            if with_transpose:
                q, q_t = quantize_with_transpose(
                    t.detach(), cfg.fmt, scaling=cfg.scaling, scale=self._scale_for(role), backend=self.quant_backend
                )
            else:
                q = quantize(
                    t.detach(), cfg.fmt, scaling=cfg.scaling, scale=self._scale_for(role), backend=self.quant_backend
                )
        if primary and cfg.source == "delayed" and t.numel():
            _push_history(getattr(self, f"{role}_amax_history"), cast(torch.Tensor, q.amax))  # quantize sets it
            self._ready[role] = True
        tel = self.telemetry
        if primary and tel is not None and not torch.compiler.is_compiling() and tel.active(role):
            tel.record(self.fp8_name, role, t, q)
        for hook in list(self._quantize_hooks.values()):
            hook(self, role, primary, q)
            if with_transpose:  # the transposed operand, as a separate non-primary quantization would be
                hook(self, role, False, q_t)
        return (q, q_t) if with_transpose else q

    def register_quantize_hook(self, hook: Callable) -> RemovableHandle:
        """hook(layer, role, primary, q) after every quantization of an operand (q: the Fp8Tensor; primary: the
        tensor's first quantization this step). Returns a handle whose remove() unregisters it (as torch hooks)."""
        handle = RemovableHandle(self._quantize_hooks)
        self._quantize_hooks[handle.id] = hook
        return handle

    def cached_weight(self) -> tuple[Fp8Tensor, Fp8Tensor | None] | None:
        """(W, W^T for dgrad or None) as cached for the current weight (weight_cache "step"), or None."""
        return None if self._wcache is None else (self._wcache[1], self._wcache[2])

    @property
    def delayed_ready(self) -> dict[str, bool]:
        """Per role: whether delayed scaling has an amax history to use (else the next step uses current scaling)."""
        return dict(self._ready)

    def _quantize_pair(self, t: torch.Tensor, role: str, transposed: bool) -> tuple[Fp8Tensor, Fp8Tensor | None]:
        """(t quantized, t^T as a contiguous FP8 operand, or None when not `transposed`): the same codes for
        transpose-invariant scaling, else t^T quantized along the other dim; fused where the backend can (GEMM
        kernels take only row-major A and column-major B, so a transposed view would be copied before every GEMM)."""
        if not transposed:
            return self._quantize(t, role), None
        return self._quantize(t, role, with_transpose=True)

    def _quantize_weight(self) -> tuple[Fp8Tensor, Fp8Tensor | None]:
        """(W, W^T for dgrad, or None under no_grad, where no dgrad follows)."""
        self.weight_quantizations += 1
        w = self.weight.detach()
        if torch.is_grad_enabled():
            return self._quantize(w, "weight", with_transpose=True)
        return self._quantize(w, "weight"), None

    def _weight_fwd(self) -> Fp8Tensor:
        """The FP8 weight for the forward GEMM, cached until the weight changes (eager mode, weight_cache "step")."""
        w = self.weight
        if torch.compiler.is_compiling():  # traced graphs cannot read the version counter: quantize inline
            return self._quantize(w.detach(), "weight")
        if self.weight_cache == "gathered":
            self.weight_quantizations += 1
            return self._quantize(w.detach(), "weight")
        key = (w._version, w.data_ptr(), w.dtype, w.device, w.shape)
        if self._wcache is None or self._wcache[0] != key:
            self._wcache = (key, *self._quantize_weight())
        return self._wcache[1]

    def _weight_dgrad(self, wq: Fp8Tensor) -> Fp8Tensor:
        """W^T [K, N] for dgrad, cached with W: the same codes transposed (contiguous) for transpose-invariant
        scaling, else W quantized along N. Made here only when the cached W came from a no-grad forward."""
        c = self._wcache
        if c is not None and c[1] is wq and c[2] is not None:
            return c[2]
        cached = c is not None and c[1] is wq
        if self.recipe.weight.transpose_invariant:
            wq_t = backends.transpose(wq, contiguous=cached)  # compiled graphs: a view, as it is used once
        else:
            wq_t = self._quantize(self.weight.detach().t(), "weight", primary=False)
        if c is not None and cached:
            self._wcache = (c[0], c[1], wq_t)
        return wq_t

    def _quantize_weight_t(self) -> Fp8Tensor:
        """W^T [K, N] for dgrad from the weight as it is now (weight_cache "gathered": the engine's re-gather)."""
        w = self.weight.detach()
        if self.recipe.weight.transpose_invariant:
            return backends.transpose(self._quantize(w, "weight", primary=False), contiguous=True)
        return self._quantize(w.t(), "weight", primary=False)

    def invalidate_weight_cache(self) -> None:
        """Force re-quantization of the weight on the next forward (for out-of-band weight changes via .data)."""
        self._wcache = None

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise Fp8CommError(f"Fp8Linear expects input with last dim {self.in_features}, got {tuple(x.shape)}")
        if not x.is_floating_point() or x.dtype.itemsize == 1:
            raise Fp8CommTypeError(f"Fp8Linear needs a float32/bfloat16/float16 input, got {x.dtype}")
        if torch.is_autocast_enabled(x.device.type):  # behave like nn.Linear under autocast
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        keep = self.weight_cache == "step" or torch.compiler.is_compiling()
        y = _Fp8LinearFn.apply(x2, self.weight, self.bias, self, self._weight_fwd(), keep)
        return y.reshape(*lead, self.out_features)

    # ---------------------------------------------------------------------------------------------- state dict
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for r in ROLES:
            key = f"{prefix}{r}_amax_history"
            if hasattr(self, f"{r}_amax_history"):
                if key in missing_keys:  # a plain nn.Linear checkpoint: start with current scaling
                    missing_keys.remove(key)
                    getattr(self, f"{r}_amax_history").zero_()
                self._ready[r] = bool(getattr(self, f"{r}_amax_history").max() > 0)
        self._wcache = None


FP8_STATE_SUFFIXES = tuple(f"{r}_amax_history" for r in ROLES)


def strip_fp8_state(state_dict: dict) -> dict:
    """A copy of `state_dict` without Fp8Linear's scaling state: loadable into the plain (unconverted) model."""
    return {k: v for k, v in state_dict.items() if not k.endswith(FP8_STATE_SUFFIXES)}
