"""MoE hook: FP8 token dispatch for deepspeed.moe (sharded_moe._AllToAll inside MOELayer.forward).

MOELayer.forward calls the same autograd all-to-all twice: first to dispatch tokens [E, C, M] to the experts'
ranks, then to send expert outputs back (combine). The forward is wrapped to number the calls, so the first one
uses fp8comm.comm.all_to_all with FP8 (1 x block_size scales per token row) and the second keeps DeepSpeed's own
all-to-all unless "combine" asks for bf16/fp8. The backward of each direction sends gradients back with the
"grad" wire ("native": the model dtype, as DeepSpeed does).
"""
from __future__ import annotations

import contextvars

import torch.distributed as dist

import fp8comm.comm as fc

from .compat import MOE

# Per-forward counter of all-to-all calls; None outside MOELayer.forward (then DeepSpeed's own op runs).
_calls: contextvars.ContextVar = contextvars.ContextVar("fp8comm_moe_calls", default=None)


def install(patcher, state) -> None:
    if not state.cfg.moe.enabled:
        return
    orig_a2a = patcher.original(MOE, "_AllToAll")
    patcher.set(MOE, "MOELayer.forward", _counting_forward)
    patcher.set(MOE, "_AllToAll", lambda orig: _make_all_to_all(state, orig_a2a))


def _counting_forward(orig):
    def forward(self, *input, **kwargs):
        token = _calls.set([0])
        try:
            return orig(self, *input, **kwargs)
        finally:
            _calls.reset(token)

    forward.__wrapped__ = orig
    return forward


def _make_all_to_all(state, orig_cls):
    cfg = state.cfg.moe
    wcfg = cfg.wire(state.cfg.check)

    class _AllToAll:
        """Stands in for sharded_moe._AllToAll: `_AllToAll.apply(group, input)` like the autograd Function."""

        original = orig_cls

        @staticmethod
        def apply(group, input):
            counter = _calls.get()
            if counter is None:
                return orig_cls.apply(group, input)
            phase = "moe.dispatch" if counter[0] == 0 else "moe.combine"
            counter[0] += 1
            wire = "fp8" if phase == "moe.dispatch" else cfg.combine
            x = input.contiguous()
            world = dist.get_world_size(group)
            rows = x.numel() // x.shape[-1] if x.dim() else 0
            n = (world - 1) * (x.numel() // world) * x.element_size()  # DeepSpeed's all_to_all_single bytes
            if state.cfg.measure_only or (wire == "native" and cfg.grad == "native"):
                state.acct.add(phase, n, n, False)
                return orig_cls.apply(group, input)
            tokens = x.view(rows, x.shape[-1])
            with state.acct.fp8(phase):
                out = fc.all_to_all(tokens, None, None, group, wire=wire, grad_wire=cfg.grad, config=wcfg)
            return out.view(x.shape)

    return _AllToAll
