"""Public quantize/dequantize and the choice of backend (reference torch, torch.compile, Triton)."""
from __future__ import annotations

import logging
import os

import torch

from .formats import Fp8Format, get_format
from .scaling import Scaling, check_scale, get_scaling
from .tensor import Fp8Tensor, view_2d

log = logging.getLogger("fp8comm.quant")

BACKENDS = ("reference", "compiled", "triton")
ROUNDINGS = ("nearest", "stochastic")
FLOAT8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                 torch.float8_e8m0fnu}
# Below this many elements the compile path is not worth its per-shape compile time on CPU.
COMPILE_MIN_NUMEL = 1 << 20


def check_input(x: torch.Tensor, what: str = "quantize") -> None:
    """Clear errors for inputs that cannot be quantized."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(x).__name__}")
    if x.dtype in FLOAT8_DTYPES:
        raise TypeError(f"{what}: input is already {x.dtype}; pass the high-precision tensor (or dequantize first)")
    if x.is_complex() or not x.is_floating_point():
        raise TypeError(f"{what} needs a floating-point tensor (float32, bfloat16, float16), got {x.dtype}")


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(name: str, device: torch.device, numel: int | None = None):
    """Return the backend module for `name`; 'auto' picks Triton on CUDA, compiled torch for big CPU tensors."""
    if name == "auto":
        if device.type == "cuda" and triton_available(device):
            name = "triton"
        elif device.type == "cpu" and numel is not None and numel >= COMPILE_MIN_NUMEL:
            name = "compiled"
        else:
            name = "reference"
    if name == "reference":
        from . import backend_reference as b
    elif name == "compiled":
        from . import backend_compiled as b
    elif name == "triton":
        if not triton_available(device):
            raise RuntimeError(f"backend 'triton' needs a CUDA tensor or TRITON_INTERPRET=1 (tensor on {device})")
        from . import backend_triton as b
    else:
        raise ValueError(f"unknown backend {name!r}; valid: auto, {', '.join(BACKENDS)}")
    return b


def _scaling_from(block_size, scaling) -> Scaling:
    if scaling is not None:
        return get_scaling(scaling)
    if block_size is None:
        return Scaling(None, None)
    if isinstance(block_size, tuple) and len(block_size) == 2:
        return Scaling(block_size[0], block_size[1])
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        return Scaling(1, block_size)
    raise ValueError(f"invalid block_size {block_size!r}; expected a positive int, (rows, cols), or None (per tensor)")


def quantize(x: torch.Tensor, fmt: str | Fp8Format = "e4m3", block_size: int | tuple[int, int] | None = 128, *,
             scaling: Scaling | str | None = None, scale: torch.Tensor | float | None = None,
             rounding: str = "nearest", seed: int = 0, backend: str = "auto") -> Fp8Tensor:
    """Quantize `x` to FP8 with one scale per 1 x `block_size` block along the last dim (None: per tensor).

    `scaling` (a Scaling or preset name) overrides block_size; `scale` fixes the dequant scales (constant/delayed).
    """
    check_input(x)
    fmt = get_format(fmt)
    sc = _scaling_from(block_size, scaling)
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    m, k = view_2d(x.shape)
    if scale is not None:
        scale = check_scale(scale, sc.scale_shape(m, k), sc).to(x.device)
    x2 = x.reshape(m, k)
    b = resolve_backend(backend, x.device, x.numel())
    codes, s, amax = b.quantize_2d(x2, fmt, sc, rounding, int(seed), scale)
    # row-major codes whatever x's strides (a transposed x gives transposed codes on the torch paths): GEMMs and
    # the wire take them as they are, and a 1-byte copy here is cheaper than one of x
    return Fp8Tensor(codes.contiguous().view(fmt.dtype).reshape(x.shape), s, fmt, sc, x.dtype, amax)


def quantize_with_transpose(x: torch.Tensor, fmt: str | Fp8Format = "e4m3", *, scaling: Scaling | str | None = None,
                            scale: torch.Tensor | float | None = None, rounding: str = "nearest", seed: int = 0,
                            backend: str = "auto") -> tuple[Fp8Tensor, Fp8Tensor]:
    """(q, q_t): 2-D `x` [M, K] quantized as quantize() does, and x^T [K, M] as a contiguous FP8 operand (what a
    GEMM contracting over M takes). Transpose-invariant scaling (per tensor, square blocks): q_t is the same codes
    transposed. Rows and 1xB blocks: q_t is quantize(x.t()), with its own scales along M. On Triton, per tensor and
    1xB (B <= 128) write both layouts from one read of x."""
    check_input(x, "quantize_with_transpose")
    if x.dim() != 2:
        raise ValueError(f"quantize_with_transpose needs a 2-D tensor, got shape {tuple(x.shape)}")
    fmt = get_format(fmt)
    sc = _scaling_from(None, scaling)
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    m, k = x.shape
    invariant = sc.rows == sc.cols
    if scale is not None:
        if not invariant:
            raise ValueError(f"caller scales need transpose-invariant scaling (per tensor or square blocks): x^T "
                             f"under {sc.describe()} blocks has other blocks; pass scale=None")
        scale = check_scale(scale, sc.scale_shape(m, k), sc).to(x.device)
    b = resolve_backend(backend, x.device, x.numel())
    if not invariant:
        if hasattr(b, "rowcol_supported") and b.rowcol_supported(sc):
            (c, s, a), (c_t, s_t, a_t) = b.quantize_2d_rowcol(x, fmt, sc, rounding, int(seed))
            return (Fp8Tensor(c.view(fmt.dtype), s, fmt, sc, x.dtype, a),
                    Fp8Tensor(c_t.view(fmt.dtype), s_t, fmt, sc, x.dtype, a_t))
        return (quantize(x, fmt, scaling=sc, rounding=rounding, seed=seed, backend=backend),
                quantize(x.t(), fmt, scaling=sc, rounding=rounding, seed=seed, backend=backend))
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
        raise TypeError(f"dequantize needs an Fp8Tensor, got {type(q).__name__}")
    dtype = q.dtype if dtype is None else dtype
    m, k = view_2d(q.shape)
    if tuple(q.scale.shape) != q.scaling.scale_shape(m, k):
        raise ValueError(f"Fp8Tensor scale has shape {tuple(q.scale.shape)}, expected "
                         f"{q.scaling.scale_shape(m, k)} for {q.scaling.describe()} blocks of shape {tuple(q.shape)}")
    b = resolve_backend(backend, q.data.device, q.data.numel())
    return b.dequantize_2d(q.codes_2d(), q.scale, q.fmt, q.scaling, dtype).reshape(q.shape)
