"""The pure-torch reference quantizer: it defines the bits every fast path must reproduce.

All arithmetic is fp32 and correctly rounded: block amax over finite |x|, scale (see scaling.py), y = x / scale,
clamp to the format max, round onto the FP8 grid (nearest-even, or stochastic from a counter-based hash), cast.
Non-finite inputs are never clamped: inf/NaN become the format's inf/NaN codes (E4M3 has no inf: NaN).
"""
from __future__ import annotations

import torch

from .formats import Fp8Format
from .scaling import Scaling, scale_from_amax

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
NAN_E4M3 = 0x7F
POS_INF_E5M2, NEG_INF_E5M2, NAN_E5M2 = 0x7C, 0xFC, 0x7F


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def mix32(x):
    """A 32-bit integer hash (lowbias32) on int64 tensors holding uint32 values (or on Python ints)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@torch.compiler.disable  # a host-side integer: keep it out of compiled graphs
def seed_key(seed: int) -> int:
    """The per-call hash key derived from a user seed (a Python int, same formula as the kernels)."""
    return mix32((int(seed) ^ GOLDEN) & M32)


def uniform_from_index(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Uniform fp32 in [0, 1) with 24 random bits, a pure function of (seed, element index)."""
    h = mix32((index & M32) ^ seed_key(seed))
    return (h >> 8).to(torch.float32) * (2.0**-24)


def grid_exponent(a: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Exponent of the FP8 grid spacing around |y| = a (fp32, finite, >= 0)."""
    e = torch.frexp(a)[1].to(torch.int32) - 1  # a = m * 2**(e+1), m in [0.5, 1); a == 0 gives any spacing
    e = torch.clamp(e, min=-126)
    return torch.clamp(e - fmt.mantissa_bits, min=fmt.min_subnormal_exp)


def round_to_grid(y: torch.Tensor, fmt: Fp8Format, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Round finite fp32 y (already within +-fmt.max) onto the FP8 grid: nearest-even, or stochastic given uniforms.

    Stochastic: round up in magnitude when u < frac, so E[result] = y (to 2**-24 of the spacing).
    """
    a = y.abs()
    sp = grid_exponent(a, fmt)
    r = torch.ldexp(a, -sp)  # exact: a power-of-two rescale
    if uniform is None:
        q = torch.round(r)  # half to even
    else:
        i = torch.floor(r)
        q = i + (uniform < (r - i)).to(torch.float32)
    return torch.copysign(torch.ldexp(q, sp), y)


def block_amax(x2: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """amax of |x| over the finite values of each block of the [M, K] view -> fp32 [mb, kb]."""
    m, k = x2.shape
    br, bc = scaling.block_shape(m, k)
    mb, kb = scaling.scale_shape(m, k)
    a = x2.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype))
    if mb * br != m or kb * bc != k:
        a = torch.nn.functional.pad(a, (0, kb * bc - k, 0, mb * br - m))
    if a.numel() == 0:
        return torch.zeros(mb, kb, dtype=torch.float32, device=x2.device)
    return a.reshape(mb, br, kb, bc).amax(dim=(1, 3))


def expand_scale(scale: torch.Tensor, m: int, k: int, scaling: Scaling) -> torch.Tensor:
    """Broadcast [mb, kb] block scales to the [M, K] elements they cover."""
    br, bc = scaling.block_shape(m, k)
    return scale.repeat_interleave(br, 0)[:m].repeat_interleave(bc, 1)[:, :k]


def encode(x2: torch.Tensor, scale_full: torch.Tensor, fmt: Fp8Format, rounding: str, seed: int,
           index_base: int = 0) -> torch.Tensor:
    """FP8 codes (uint8) of x2 [M, K] divided by per-element scales; `index_base` offsets the SR counter."""
    x = x2.float()
    y = torch.clamp(x / scale_full, -fmt.max, fmt.max)
    finite = torch.isfinite(x)
    y = torch.where(finite, y, torch.zeros((), dtype=y.dtype))
    u = None
    if rounding == "stochastic":
        m, k = x.shape
        idx = index_base + torch.arange(m * k, dtype=torch.int64, device=x.device).reshape(m, k)
        u = uniform_from_index(idx, seed)
    codes = round_to_grid(y, fmt, u).to(fmt.dtype).view(torch.uint8)
    if fmt.has_inf:
        special = torch.where(x > 0, POS_INF_E5M2, NEG_INF_E5M2)
        special = torch.where(torch.isnan(x), NAN_E5M2, special)
    else:
        special = torch.where(torch.signbit(x), NAN_E4M3 | 0x80, NAN_E4M3)
        special = torch.where(torch.isnan(x), NAN_E4M3, special)
    return torch.where(finite, codes, special.to(torch.uint8))


def quantize_2d(x2: torch.Tensor, fmt: Fp8Format, scaling: Scaling, rounding: str = "nearest", seed: int = 0,
                scale: torch.Tensor | None = None, index_base: int = 0):
    """Quantize an [M, K] view -> (uint8 codes [M, K], fp32 scales [mb, kb], fp32 block amax [mb, kb])."""
    m, k = x2.shape
    amax = block_amax(x2, scaling)
    if scale is None:
        scale = scale_from_amax(amax, fmt, scaling)
    codes = encode(x2, expand_scale(scale, m, k, scaling), fmt, rounding, seed, index_base)
    return codes, scale, amax


def decode(codes: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """uint8 FP8 codes -> fp32 values (exact)."""
    return codes.view(fmt.dtype).to(torch.float32)


def dequantize_2d(codes: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, scaling: Scaling) -> torch.Tensor:
    """uint8 codes [M, K] and fp32 block scales -> fp32 [M, K] (code value * scale; inf/NaN stay non-finite)."""
    m, k = codes.shape
    return decode(codes, fmt) * expand_scale(scale.float(), m, k, scaling)
