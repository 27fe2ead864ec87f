"""MoE hook: FP8 token dispatch for deepspeed.moe (sharded_moe._AllToAll inside MOELayer.forward).

MOELayer.forward calls the same autograd all-to-all twice: first to dispatch tokens [E, C, M] to the experts'
ranks, then to send expert outputs back (combine). The forward dispatcher numbers the calls of MoE layers tagged
by an fp8comm engine, so the first one uses fp8comm.comm.all_to_all with FP8 (1 x block_size scales per token row)
and the second keeps DeepSpeed's own all-to-all unless "combine" asks for bf16/fp8. The backward of each
direction sends gradients back with the "grad" wire ("native": the model dtype, as DeepSpeed does). Layers of
other engines run DeepSpeed's own all-to-all.
"""

from __future__ import annotations

import contextvars

import torch
import torch.distributed as dist

import fp8comm.comm as fc

from .compat import MOE
from .patching import PASSTHROUGH, owner, tag, totals

# Per-forward [call count, EngineState]; None outside a tagged MOELayer.forward (then DeepSpeed's own op runs).
_calls: contextvars.ContextVar = contextvars.ContextVar("fp8comm_moe_calls", default=None)


def install(patcher, role: str) -> None:
    if role != "moe":
        return
    orig_a2a = patcher.original(MOE, "_AllToAll")
    patcher.set(MOE, "MOELayer.forward", _counting_forward)
    patcher.set(MOE, "_AllToAll", lambda orig: _make_all_to_all(orig_a2a))


def attach(es, module) -> None:
    """Tag the engine's MoE layers; each gets its guard key "moe.<i>" (i: its index in module order)."""
    for m in module.modules():
        if type(m).__name__ == "MOELayer":
            tag(es, m)
            es.moe_keys[id(m)] = f"moe.{len(es.moe_keys)}"


def _counting_forward(orig):
    def forward(self, *input, **kwargs):
        es = owner(self)
        if es is None or not es.cfg.moe.enabled:
            PASSTHROUGH.hit("moe.layer")
            return orig(self, *input, **kwargs)
        token = _calls.set([0, es, es.moe_keys.get(id(self), "moe")])
        try:
            return orig(self, *input, **kwargs)
        finally:
            _calls.reset(token)

    forward.__wrapped__ = orig
    return forward


class _Mark(torch.autograd.Function):
    """Identity whose backward brackets the fp8comm all-to-all's backward: bytes attributed to one engine."""

    @staticmethod
    def forward(ctx, x, box, start: bool, es, fp8: bool):
        ctx.box, ctx.start, ctx.es, ctx.fp8 = box, start, es, fp8
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        now = totals(("all_to_all.backward",))
        if ctx.start:  # the output side: runs before the all-to-all's backward
            ctx.box[0] = now
        elif ctx.box[0] is not None:
            (w0, d0, c0), (w1, d1, c1) = ctx.box[0], now
            if c1 > c0:
                ctx.es.acct.add("moe.backward", w1 - w0, d1 - d0, ctx.fp8)
        return g, None, None, None, None


def _make_all_to_all(orig_cls):
    class _AllToAll:
        """Stands in for sharded_moe._AllToAll: `_AllToAll.apply(group, input)` like the autograd Function."""

        original = orig_cls

        @staticmethod
        def apply(group, input):
            counter = _calls.get()
            if counter is None:
                PASSTHROUGH.hit("moe.all_to_all")
                return orig_cls.apply(group, input)
            es = counter[1]
            cfg = es.cfg.moe
            phase = "moe.dispatch" if counter[0] == 0 else "moe.combine"
            counter[0] += 1
            wire = "fp8" if phase == "moe.dispatch" else cfg.combine
            x = input.contiguous()
            world = dist.get_world_size(group)
            rows = x.numel() // x.shape[-1] if x.dim() else 0
            n = (world - 1) * (x.numel() // world) * x.element_size()  # DeepSpeed's all_to_all_single bytes
            gb = None
            if not es.cfg.measure_only and (wire == "fp8" or cfg.grad == "fp8"):
                if phase == "moe.dispatch":
                    counter.append(es.route(counter[2], x.device))  # one decision for the layer's forward
                how, gb = counter[3]
                if how == "bf16":  # the guard: DeepSpeed's own all-to-all both ways for this layer
                    es.acct.add(phase, n, n, False)
                    return orig_cls.apply(group, input)
            if es.cfg.measure_only or (wire == "native" and cfg.grad == "native"):
                es.acct.add(phase, n, n, False)
                return orig_cls.apply(group, input)
            tokens = x.view(rows, x.shape[-1])
            box = [None]
            track = tokens.requires_grad and torch.is_grad_enabled()
            if track:
                tokens = _Mark.apply(tokens, box, False, es, cfg.grad == "fp8")
            with es.acct.fp8(phase, fp8=wire == "fp8"):
                out = fc.all_to_all(
                    tokens,
                    None,
                    None,
                    group,
                    wire=wire,
                    grad_wire=cfg.grad,
                    config=cfg.wire(es.cfg.check),
                    guard=gb,  # counts what this call packs in FP8 (forward on the fp8 wire, backward on fp8 grads)
                )
            if track:
                out = _Mark.apply(out, box, True, es, cfg.grad == "fp8")
            return out.view(x.shape)

    return _AllToAll
