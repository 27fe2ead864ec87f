"""MoE hook: FP8 token dispatch in MoEAlltoAllTokenDispatcher (probs and combine untouched).

token_dispatch() sends the permuted tokens and then the permuted probs through the same module-level `all_to_all`
(imported by name from tensor_parallel.mappings), and token_combine() sends expert outputs back through it too. The
patched token_dispatch marks the exact tokens tensor it was given; the patched `all_to_all` sends that one tensor
with fp8comm (1xB scales per token, autograd: gradients go back in bf16 by default) and passes everything else
(probs, combine, any other caller) to Megatron's own all_to_all unchanged.
"""
from __future__ import annotations

import threading

import torch

from fp8comm import comm as fcomm

from .config import Fp8commConfig, count

_tls = threading.local()
_checked: set = set()


def reset_state() -> None:
    _checked.clear()


def make_token_dispatch(orig):
    def fp8comm_token_dispatch(self, permutated_local_input_tokens, permuted_probs, *args, **kwargs):
        prev = getattr(_tls, "tokens", None)
        _tls.tokens = permutated_local_input_tokens
        try:
            return orig(self, permutated_local_input_tokens, permuted_probs, *args, **kwargs)
        finally:
            _tls.tokens = prev

    fp8comm_token_dispatch.__wrapped__ = orig
    return fp8comm_token_dispatch


def make_all_to_all(orig, cfg: Fp8commConfig):
    def fp8comm_all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, **kwargs):
        if getattr(_tls, "tokens", None) is not input_:
            return orig(group, input_, output_split_sizes_, input_split_sizes, **kwargs)
        _tls.tokens = None  # the tokens go once; the probs that follow take Megatron's path
        if group.size() == 1:  # EP=1: Megatron's all_to_all is an identity, nothing to quantize
            count("moe_dispatch", "passthrough_calls")
            return orig(group, input_, output_split_sizes_, input_split_sizes, **kwargs)
        count("moe_dispatch", "fp8_calls")
        count("moe_dispatch", "elements", input_.numel())
        if cfg.check == "first":
            check = id(group) not in _checked
            _checked.add(id(group))
        else:
            check = cfg.check == "always"
        return fcomm.all_to_all(input_.contiguous(), _host(output_split_sizes_), _host(input_split_sizes), group,
                                wire="fp8", grad_wire=cfg.moe_grad_wire, check=check, **cfg.wire_kwargs("moe"))

    fp8comm_all_to_all.__wrapped__ = orig
    return fp8comm_all_to_all


def _host(splits):
    """Split sizes as a host list (Megatron passes numpy arrays, lists, or None for equal splits)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]
