"""torch.compile fast path for CPU: the reference functions compiled by inductor; bit-exact by test."""
from __future__ import annotations

import torch

from . import backend_reference as _ref
from . import reference as ref

name = "compiled"

# Each (format, scaling, rounding, shape) is its own graph; the default limit of 8 would silently send later
# variants to eager mode (same bits, but no longer the fast path).
_cfg = torch._dynamo.config
_key = "recompile_limit" if hasattr(_cfg, "recompile_limit") else "cache_size_limit"  # renamed across versions
setattr(_cfg, _key, max(getattr(_cfg, _key), 64))

_encode = torch.compile(ref.encode)
_amax = torch.compile(ref.block_amax)
_dequant = torch.compile(ref.dequantize_2d)


def quantize_2d(x2, fmt, scaling, rounding="nearest", seed=0, scale=None, index_base=0):
    from .scaling import scale_from_amax

    amax = _amax(x2, scaling)
    if scale is None:
        scale = scale_from_amax(amax, fmt, scaling)
    codes = _encode(x2, scale, scaling, fmt, rounding, seed, index_base)
    return codes, scale, amax


def dequantize_2d(codes, scale, fmt, scaling, out_dtype):
    return _dequant(codes, scale, fmt, scaling).to(out_dtype)


def pack_chunks(x2, layout, fmt, rounding, seed, out):
    """Per-chunk work is the compiled quantizer; byte placement is shared with the reference."""
    return _ref.pack_chunks(x2, layout, fmt, rounding, seed, out, quantize_fn=quantize_2d)


def unpack_chunks(buf, layout, fmt, out):
    return _ref.unpack_chunks(buf, layout, fmt, out, dequantize_fn=_dequant)


def unpack_sum(buf, layout, fmt, out):
    return _ref.unpack_sum(buf, layout, fmt, out, dequantize_fn=_dequant)
