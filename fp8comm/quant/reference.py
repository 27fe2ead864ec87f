"""The pure-torch reference quantizer: it defines the bits every fast path must reproduce.

All arithmetic is fp32 and correctly rounded: block amax over finite |x|, scale (see scaling.py), y = x / scale,
clamp to the format max, round onto the FP8 grid (nearest-even, or stochastic from a counter-based hash), cast.
Non-finite inputs are never clamped: E5M2 keeps +-inf (0x7C/0xFC); other inf/NaN become NaN (0x7F).
"""

from __future__ import annotations

import torch

from .formats import Fp8Format
from .scaling import Scaling, scale_from_amax

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


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
    """Exponent of the FP8 grid spacing around |y| = a (fp32, finite, >= 0), read from the fp32 bits."""
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    return torch.clamp(e - fmt.mantissa_bits, min=fmt.min_subnormal_exp)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as fp32 for int32 e in the normal range [-126, 127], built from the bits (exact)."""
    return ((e + 127) << 23).view(torch.float32)


def round_to_grid(y: torch.Tensor, fmt: Fp8Format, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Round finite fp32 y (already within +-fmt.max) onto the FP8 grid: nearest-even, or stochastic given uniforms.

    Stochastic: round up in magnitude when u < frac, so E[result] = y (to 2**-24 of the spacing).
    """
    a = y.abs()
    sp = grid_exponent(a, fmt)
    r = a * pow2(-sp)  # exact: a power-of-two rescale into [0, 2**(mantissa_bits+1))
    if uniform is None:
        q = torch.round(r)  # half to even
    else:
        i = torch.floor(r)
        q = i + (uniform < (r - i)).to(torch.float32)
    return torch.copysign(q * pow2(sp), y)


def blocks_view(t: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """[M, K] -> [mb, br, kb, bc] (zero-padded to whole blocks) so per-block scales broadcast without copies."""
    m, k = t.shape
    br, bc = scaling.block_shape(m, k)
    mb, kb = scaling.scale_shape(m, k)
    if mb * br != m or kb * bc != k:
        t = torch.nn.functional.pad(t, (0, kb * bc - k, 0, mb * br - m))
    return t.reshape(mb, br, kb, bc)


def unblock(t: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of blocks_view: [mb, br, kb, bc] -> [M, K] (crops the padding)."""
    mb, br, kb, bc = t.shape
    return t.reshape(mb * br, kb * bc)[:m, :k]


def block_amax(x2: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """amax of |x| over the finite values of each block of the [M, K] view -> fp32 [mb, kb]."""
    m, k = x2.shape
    mb, kb = scaling.scale_shape(m, k)
    if x2.numel() == 0:
        return torch.zeros(mb, kb, dtype=torch.float32, device=x2.device)
    a = x2.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype))
    return blocks_view(a, scaling).amax(dim=(1, 3))


def expand_scale(scale: torch.Tensor, m: int, k: int, scaling: Scaling) -> torch.Tensor:
    """Broadcast [mb, kb] block scales to the [M, K] elements they cover (a materialised copy: for reports)."""
    br, bc = scaling.block_shape(m, k)
    return scale.repeat_interleave(br, 0)[:m].repeat_interleave(bc, 1)[:, :k]


def encode(
    x2: torch.Tensor,
    scale: torch.Tensor,
    scaling: Scaling,
    fmt: Fp8Format,
    rounding: str,
    seed: int,
    index_base: int = 0,
) -> torch.Tensor:
    """FP8 codes (uint8 [M, K]) of x2 / block scale; `index_base` offsets the stochastic-rounding counter."""
    m, k = x2.shape
    x = blocks_view(x2.float(), scaling)
    y = torch.clamp(x / scale.float()[:, None, :, None], -fmt.max, fmt.max)
    finite = torch.isfinite(x)
    u = None
    if rounding == "stochastic":
        mb, br, kb, bc = x.shape
        rows = torch.arange(mb * br, dtype=torch.int64, device=x.device).reshape(mb, br, 1, 1)
        cols = torch.arange(kb * bc, dtype=torch.int64, device=x.device).reshape(1, 1, kb, bc)
        u = uniform_from_index(index_base + rows * k + cols, seed)
    y = round_to_grid(torch.where(finite, y, 0.0), fmt, u)
    # Non-finite inputs bypass clamp and rounding: E5M2 keeps +-inf; every other non-finite input becomes the NaN
    # code 0x7F (E4M3 has no inf; NaN signs are not kept, compilers do not preserve them).
    nan = float("nan")
    special = torch.where(torch.isnan(x), nan, x) if fmt.has_inf else nan
    y = torch.where(finite, y, special)
    return unblock(y.to(fmt.dtype).view(torch.uint8), m, k)


def quantize_2d(
    x2: torch.Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    rounding: str = "nearest",
    seed: int = 0,
    scale: torch.Tensor | None = None,
    index_base: int = 0,
):
    """Quantize an [M, K] view -> (uint8 codes [M, K], fp32 scales [mb, kb], fp32 block amax [mb, kb])."""
    amax = block_amax(x2, scaling)
    if scale is None:
        scale = scale_from_amax(amax, fmt, scaling)
    return encode(x2, scale, scaling, fmt, rounding, seed, index_base), scale, amax


def saturation_limit(fmt: Fp8Format) -> float:
    """|x / scale| above this cannot round to the format's max: max + half the grid spacing at max (E4M3 464,
    E5M2 65536 - 4096 / 2 ... = 57344 * 1.125). Amax scaling never exceeds it; a fixed or delayed scale can."""
    return fmt.max * (1.0 + 2.0 ** -(fmt.mantissa_bits + 1))


def fit_counts(
    x2: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor, scaling: Scaling, fmt: Fp8Format
) -> torch.Tensor:
    """int64 [saturated, underflow, nonfinite] of one quantization (the numerics guard's counts).

    saturated: finite x with |x| > scale * saturation_limit (fp32 product); underflow: finite non-zero x whose code
    is +-0; nonfinite: inf/NaN x. Every backend counts exactly these (tested against this function)."""
    m, k = x2.shape
    x = x2.float()
    finite = torch.isfinite(x)
    s = unblock(blocks_view(torch.ones_like(x), scaling) * scale.float()[:, None, :, None], m, k)
    sat = finite & (x.abs() > s * saturation_limit(fmt))
    under = finite & (x != 0) & ((codes.view(torch.uint8) & 0x7F) == 0)
    return torch.stack([sat.sum(), under.sum(), (~finite).sum()]).to(torch.int64)


def decode(codes: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """uint8 FP8 codes -> fp32 values (exact)."""
    return codes.view(fmt.dtype).to(torch.float32)


def dequantize_2d(codes: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, scaling: Scaling) -> torch.Tensor:
    """uint8 codes [M, K] and fp32 block scales -> fp32 [M, K] (code value * scale; inf/NaN stay non-finite)."""
    m, k = codes.shape
    return unblock(blocks_view(decode(codes, fmt), scaling) * scale.float()[:, None, :, None], m, k)
