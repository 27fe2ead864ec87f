"""Public quantize/dequantize and the choice of backend (reference torch, torch.compile, Triton)."""

from __future__ import annotations

import torch

from ..errors import Fp8CommError, Fp8CommTypeError
from .dispatch import resolve_backend
from .formats import FLOAT8_DTYPES, Fp8Format, get_format
from .layout import view_2d
from .scaling import Scaling, check_scale, get_scaling
from .tensor import Fp8Tensor

ROUNDINGS = ("nearest", "stochastic")


def check_input(x: torch.Tensor, what: str = "quantize") -> None:
    """Clear errors for inputs that cannot be quantized."""
    if not isinstance(x, torch.Tensor):
        raise Fp8CommTypeError(f"{what} needs a torch.Tensor, got {type(x).__name__}")
    if x.dtype in FLOAT8_DTYPES:
        raise Fp8CommTypeError(
            f"{what}: input is already {x.dtype}; pass the high-precision tensor (or dequantize first)"
        )
    if x.is_complex() or not x.is_floating_point():
        raise Fp8CommTypeError(f"{what} needs a floating-point tensor (float32, bfloat16, float16), got {x.dtype}")


def _scaling_from(block_size, scaling) -> Scaling:
    if scaling is not None:
        return get_scaling(scaling)
    if block_size is None:
        return Scaling(None, None)
    if isinstance(block_size, tuple) and len(block_size) == 2:
        return Scaling(block_size[0], block_size[1])
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        return Scaling(1, block_size)
    raise Fp8CommError(
        f"invalid block_size {block_size!r}; expected a positive int, (rows, cols), or None (per tensor)"
    )


def quantize(
    x: torch.Tensor,
    fmt: str | Fp8Format = "e4m3",
    block_size: int | tuple[int, int] | None = 128,
    *,
    scaling: Scaling | str | None = None,
    scale: torch.Tensor | float | None = None,
    rounding: str = "nearest",
    seed: int = 0,
    backend: str = "auto",
) -> Fp8Tensor:
    """Quantize `x` to FP8 with one scale per 1 x `block_size` block along the last dim (None: per tensor).

    `scaling` (a Scaling or preset name) overrides block_size; `scale` fixes the dequant scales (constant/delayed).
    """
    check_input(x)
    fmt = get_format(fmt)
    sc = _scaling_from(block_size, scaling)
    if rounding not in ROUNDINGS:
        raise Fp8CommError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    m, k = view_2d(x.shape)
    if scale is not None:
        scale = check_scale(scale, sc.scale_shape(m, k), sc).to(x.device)
    x2 = x.reshape(m, k)
    b = resolve_backend(backend, x.device, x.numel())
    codes, s, amax = b.quantize_2d(x2, fmt, sc, rounding, int(seed), scale)
    # row-major codes whatever x's strides (a transposed x gives transposed codes on the torch paths): GEMMs and
    # the wire take them as they are, and a 1-byte copy here is cheaper than one of x
    return Fp8Tensor(codes.contiguous().view(fmt.dtype).reshape(x.shape), s, fmt, sc, x.dtype, amax)


def quantize_with_transpose(
    x: torch.Tensor,
    fmt: str | Fp8Format = "e4m3",
    *,
    scaling: Scaling | str | None = None,
    scale: torch.Tensor | float | None = None,
    rounding: str = "nearest",
    seed: int = 0,
    backend: str = "auto",
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """(q, q_t): 2-D `x` [M, K] quantized as quantize() does, and x^T [K, M] as a contiguous FP8 operand (what a
    GEMM contracting over M takes). Transpose-invariant scaling (per tensor, square blocks): q_t is the same codes
    transposed. Rows and 1xB blocks: q_t is quantize(x.t()), with its own scales along M. On Triton, per tensor and
    1xB (B <= 128) write both layouts from one read of x."""
    check_input(x, "quantize_with_transpose")
    if x.dim() != 2:
        raise Fp8CommError(f"quantize_with_transpose needs a 2-D tensor, got shape {tuple(x.shape)}")
    fmt = get_format(fmt)
    sc = _scaling_from(None, scaling)
    if rounding not in ROUNDINGS:
        raise Fp8CommError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    m, k = x.shape
    invariant = sc.rows == sc.cols
    if scale is not None:
        if not invariant:
            raise Fp8CommError(
                f"caller scales need transpose-invariant scaling (per tensor or square blocks): x^T "
                f"under {sc.describe()} blocks has other blocks; pass scale=None"
            )
        scale = check_scale(scale, sc.scale_shape(m, k), sc).to(x.device)
    b = resolve_backend(backend, x.device, x.numel())
    if not invariant:
        if hasattr(b, "rowcol_supported") and b.rowcol_supported(sc):
            (c, s, a), (c_t, s_t, a_t) = b.quantize_2d_rowcol(x, fmt, sc, rounding, int(seed))
            return (
                Fp8Tensor(c.view(fmt.dtype), s, fmt, sc, x.dtype, a),
                Fp8Tensor(c_t.view(fmt.dtype), s_t, fmt, sc, x.dtype, a_t),
            )
        return (
            quantize(x, fmt, scaling=sc, rounding=rounding, seed=seed, backend=backend),
            quantize(x.t(), fmt, scaling=sc, rounding=rounding, seed=seed, backend=backend),
        )
    if sc.rows is None and hasattr(b, "quantize_2d_t"):
        codes, codes_t, s, amax = b.quantize_2d_t(x, fmt, sc, rounding, int(seed), scale)
    else:
        codes, s, amax = b.quantize_2d(x, fmt, sc, rounding, int(seed), scale)
        codes_t = codes.t().contiguous()
    q = Fp8Tensor(codes.view(fmt.dtype), s, fmt, sc, x.dtype, amax)
    q_t = Fp8Tensor(codes_t.view(fmt.dtype), s.t().contiguous(), fmt, sc, x.dtype, amax.t().contiguous())
    return q, q_t


def dequantize(q: Fp8Tensor, dtype: torch.dtype | None = torch.float32, backend: str = "auto") -> torch.Tensor:
    """data * scale in `dtype` (None: the input's original dtype), shaped like the input."""
    if not isinstance(q, Fp8Tensor):
        raise Fp8CommTypeError(f"dequantize needs an Fp8Tensor, got {type(q).__name__}")
    return q.dequantize(dtype, backend)
