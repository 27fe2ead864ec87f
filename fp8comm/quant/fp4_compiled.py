"""torch.compile CPU path for 4-bit quantization: fp4.encode_2d / decode_2d compiled by inductor (as backend_compiled
does for FP8); bit-exact with the reference by test (tests/unit/test_fp4.py). Graphs are built on first use.
"""

from __future__ import annotations

from functools import cache

import torch

from . import fp4


@cache
def _encode():
    return torch.compile(fp4.encode_2d)


@cache
def _decode():
    return torch.compile(fp4.decode_2d)


def encode_2d(x2, fmt, key=None, index_base=0, tensor_amax=None, row_scales=False):
    """fp4.encode_2d, compiled (same arguments, same bits)."""
    return _encode()(x2, fmt, key, index_base, tensor_amax, row_scales)


def decode_2d(packed, sbytes, tscale, fmt):
    """fp4.decode_2d, compiled (same bits; NaN payloads aside)."""
    return _decode()(packed, sbytes, tscale, fmt)
