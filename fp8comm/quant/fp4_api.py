"""The 4-bit API: quantize_fp4 / dequantize_fp4 on the reference, compiled or Triton backend (docs/fp4.md).

fp4.py defines the bits; this module only picks the backend, so the kernels can import the reference without a
cycle."""

from __future__ import annotations

import torch

from ..errors import Fp8CommError, Fp8CommTypeError
from .formats import FLOAT8_DTYPES
from .fp4 import (
    Fp4Format,
    Fp4Tensor,
    _check_tensor_amax,
    check_args,
    decode_2d,
    encode_2d,
    get_fp4_format,
    hadamard_forward,
    hadamard_inverse,
)
from .reference import seed_key

BACKENDS = ("reference", "compiled", "native", "triton")


def quantize_fp4(
    x: torch.Tensor,
    fmt: str | Fp4Format = "mxfp4",
    rounding: str = "nearest",
    seed: int = 0,
    index_base: int = 0,
    hadamard: int = 0,
    hadamard_seed: int = 0,
    tensor_amax: torch.Tensor | None = None,
    backend: str = "reference",
) -> Fp4Tensor:
    """Quantize x [..., K] to 4 bits in 1 x fmt.block blocks along the last dim (K a multiple of the block).

    hadamard=16|32 applies the random block Hadamard transform (signs from hadamard_seed) first; dequantize_fp4
    inverts it. Stochastic rounding draws from (seed, flat index + index_base) like the FP8 path."""
    f = get_fp4_format(fmt)
    m, k = check_args(x, f, rounding, hadamard)
    if backend not in BACKENDS:
        raise Fp8CommError(f"unknown 4-bit backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if x.dtype in FLOAT8_DTYPES:  # pragma: no cover - check_args already refuses every non-float input
        raise Fp8CommTypeError("already FP8")
    if tensor_amax is not None:
        tensor_amax = _check_tensor_amax(tensor_amax, f)
    x2 = x.reshape(m, k)
    if hadamard:
        x2 = hadamard_forward(x2, hadamard, hadamard_seed)
    key = None
    if rounding == "stochastic":
        key = torch.tensor(seed_key(seed), dtype=torch.int64, device=x.device)
    if backend == "reference":
        codes, sbytes, ts = encode_2d(x2, f, key, index_base, tensor_amax)
    elif backend == "compiled":
        from . import fp4_compiled

        codes, sbytes, ts = fp4_compiled.encode_2d(x2, f, key, index_base, tensor_amax)
    elif backend == "native":
        from . import fp4_native

        codes, sbytes, ts = fp4_native.encode_2d(x2, f, key, index_base, tensor_amax)
    else:
        from . import fp4_triton

        codes, sbytes, ts = fp4_triton.encode_2d(x2, f, seed if key is not None else None, index_base, tensor_amax)
    return Fp4Tensor(codes, sbytes, ts, f, x.shape, x.dtype, hadamard, hadamard_seed)


def dequantize_fp4(q: Fp4Tensor, out_dtype: torch.dtype | None = None, backend: str = "reference") -> torch.Tensor:
    """Values of q in its original shape (fp32 arithmetic, then out_dtype, default the input's dtype); the
    Hadamard transform, if any, is inverted in fp32 before the cast."""
    if backend not in BACKENDS:
        raise Fp8CommError(f"unknown 4-bit backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "reference":
        v = decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt)
    elif backend == "compiled":
        from . import fp4_compiled

        v = fp4_compiled.decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt)
    elif backend == "native":
        from . import fp4_native

        v = fp4_native.decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt)
    else:
        from . import fp4_triton

        v = fp4_triton.decode_2d(q.codes, q.scales, q.tensor_scale, q.fmt)
    if q.hadamard:
        v = hadamard_inverse(v, q.hadamard, q.hadamard_seed)
    return v.reshape(q.shape).to(out_dtype or q.dtype)
