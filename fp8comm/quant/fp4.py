"""4-bit E2M1 quantization (MXFP4, NVFP4): the pure-torch reference that defines the bits (docs/fp4.md).

x [..., K] -> codes uint8 [..., K/2] (element 2j in the low nibble of byte j), one scale byte per block and (NVFP4)
one fp32 tensor scale; the compiled and Triton paths (fp4_compiled.py, fp4_triton.py) reproduce it bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import Fp8CommError, Fp8CommTypeError
from .formats import div_exact
from .layout import decode_e8m0
from .reference import M32, mix32, pow2, seed_key

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> magnitude; bit 3 is the sign
E4M3_MAX = 448.0
NV_TENSOR_MAX = E2M1_MAX * E4M3_MAX  # 2688: |x| / tensor_scale never exceeds it (so block scales fit E4M3)
E8M0_NAN = 0xFF  # OCP MX: the NaN scale byte
E4M3_NAN = 0x7F
MX_MIN_EXP, MX_MAX_EXP = -126, 126  # scales stay normal fp32 numbers and 2**-E stays normal too
ROUNDINGS = ("nearest", "stochastic")
HADAMARD_SIZES = (16, 32)
HADAMARD_SALT = 0x5EED4AD1  # separates the sign stream from the stochastic-rounding stream of the same seed


@dataclass(frozen=True)
class Fp4Format:
    """A 4-bit block format: E2M1 elements in 1 x `block` blocks with one `scale` byte ("e8m0" or "e4m3") each;
    "e4m3" block scales are relative to one power-of-two fp32 tensor scale (NVFP4's second level)."""

    name: str
    block: int
    scale: str

    @property
    def two_level(self) -> bool:
        return self.scale == "e4m3"

    def __str__(self) -> str:
        return self.name


MXFP4 = Fp4Format("mxfp4", 32, "e8m0")
NVFP4 = Fp4Format("nvfp4", 16, "e4m3")
FP4_FORMATS = {"mxfp4": MXFP4, "nvfp4": NVFP4}


def get_fp4_format(fmt: str | Fp4Format) -> Fp4Format:
    """The 4-bit format named by `fmt` ("mxfp4" or "nvfp4", or a format itself)."""
    if isinstance(fmt, Fp4Format):
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FP4_FORMATS:
        return FP4_FORMATS[fmt.lower()]
    raise Fp8CommError(f"unknown 4-bit format {fmt!r}; valid: {', '.join(FP4_FORMATS)}")


@dataclass(frozen=True)
class Fp4Tensor:
    """A quantized tensor: codes uint8 [M, K/2], scale bytes uint8 [M, K/block], fp32 tensor scale (shape [1]; 1.0
    for MXFP4), and what dequantize needs to restore the input's shape, dtype and (optional) Hadamard transform."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    fmt: Fp4Format
    shape: torch.Size
    dtype: torch.dtype
    hadamard: int = 0
    hadamard_seed: int = 0


# ------------------------------------------------------------------------------------------------ validation
def check_args(x: torch.Tensor, fmt: Fp4Format, rounding: str, hadamard: int) -> tuple[int, int]:
    """Validate a quantize call before anything runs; return the [M, K] view's (M, K)."""
    if not isinstance(x, torch.Tensor):
        raise Fp8CommTypeError(f"expected a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Fp8CommTypeError(f"4-bit quantization takes float32, bfloat16 or float16 input, got {x.dtype}")
    if rounding not in ROUNDINGS:
        raise Fp8CommError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if x.dim() == 0:
        raise Fp8CommError("4-bit quantization needs at least one dimension (blocks run along the last)")
    k = x.shape[-1]
    if k % fmt.block:
        raise Fp8CommError(
            f"{fmt.name}: the last dimension ({k}) must be a multiple of the block size {fmt.block}; pad it with zeros "
            "(zeros change no block scale)"
        )
    if hadamard and (hadamard not in HADAMARD_SIZES or fmt.block % hadamard):
        raise Fp8CommError(
            f"hadamard={hadamard!r} for {fmt.name}: the transform block must be 16 or 32 and lie inside one "
            f"{fmt.block}-element quantization block (valid: "
            f"{', '.join(str(n) for n in HADAMARD_SIZES if fmt.block % n == 0)}, or 0 for none)"
        )
    m = x.numel() // k if k else 0
    return m, k


def _check_tensor_amax(a: torch.Tensor | float, fmt: Fp4Format) -> torch.Tensor:
    """A caller's NVFP4 tensor amax as fp32 [1]; its value (finite, >= 0) is checked for host tensors only (reading
    a device value would be a sync)."""
    if not fmt.two_level:
        raise Fp8CommError(f"tensor_amax is NVFP4's second-level scale; {fmt.name} has none")
    t = a if isinstance(a, torch.Tensor) else torch.tensor(float(a))
    if t.numel() != 1 or not t.is_floating_point():
        raise Fp8CommTypeError(f"tensor_amax must be one floating-point value, got {t.dtype}{tuple(t.shape)}")
    t = t.float().reshape(1)
    if t.device.type == "cpu" and not (bool(torch.isfinite(t).all()) and float(t) >= 0):
        raise Fp8CommError(f"tensor_amax must be finite and >= 0, got {float(t)}")
    return t


# ------------------------------------------------------------------------------------------- Hadamard transform
def hadamard_signs(n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random +-1.0 (fp32 [n]) for the n positions of a transform block: bit 31 of lowbias32(position ^ key), the
    key derived from `seed` alone (never the rank), so every rank and the receiver draw the same signs."""
    key = seed_key((int(seed) ^ HADAMARD_SALT) & M32)
    h = mix32((torch.arange(n, dtype=torch.int64) & M32) ^ key)
    return (1.0 - 2.0 * (h >> 31).to(torch.float32)).to(device)


def _wht(x: torch.Tensor, n: int) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard (Sylvester order) on every n-block of the last dim: log2(n) add/sub stages."""
    shape = x.shape
    h = 1
    while h < n:
        v = x.reshape(-1, n // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return x.reshape(shape)


def hadamard_scales(n: int) -> tuple[float, float]:
    """(forward, inverse) power-of-two factors with product 1/n: 2**-floor(log2(n)/2) and 2**-ceil(log2(n)/2)
    (1/4 and 1/4 for n=16, orthonormal; 1/4 and 1/8 for n=32). Powers of two keep the scaling exact."""
    lg = int(math.log2(n))
    return 2.0 ** -(lg // 2), 2.0 ** -(lg - lg // 2)


def hadamard_forward(x2: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """fp32 y = c_f * H (D x) on every n-element block of the last dim (D: the seed's random signs)."""
    d = hadamard_signs(n, seed, x2.device)
    x = x2.float()
    return _wht((x.reshape(-1, n) * d).reshape(x.shape), n) * hadamard_scales(n)[0]


def hadamard_inverse(y2: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """fp32 x = c_i * D (H y): the inverse of hadamard_forward (exact in real arithmetic; fp32 bound in docs/fp4.md:
    |error_j| <= 2 log2(n) 2**-24 (1 + 2**-20) * sum over the block of |x_i|)."""
    d = hadamard_signs(n, seed, y2.device)
    y = y2.float()
    z = _wht(y, n) * hadamard_scales(n)[1]
    return (z.reshape(-1, n) * d).reshape(y.shape)


def hadamard_error_bound(x2: torch.Tensor, n: int) -> torch.Tensor:
    """Per-element bound on |hadamard_inverse(hadamard_forward(x)) - x| in fp32 (no overflow or underflow)."""
    g = 2 * math.log2(n) * 2.0**-24 * (1 + 2.0**-20)
    s = x2.double().abs().reshape(-1, n).sum(-1, keepdim=True)
    return (g * s).expand(-1, n).reshape(x2.shape)


# ------------------------------------------------------------------------------------------------ scale rules
def pow2_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest int32 E with amax / 2**E <= limit (exact, frexp; no log2 rounding); 0 where amax == 0; clamped to
    [MX_MIN_EXP, MX_MAX_EXP] (amax <= fp32 max never needs more than 2**126 for limit >= 6)."""
    m, k = torch.frexp(amax.float())
    fm, fk = math.frexp(limit)
    e = k.to(torch.int32) - fk + (m > fm).to(torch.int32)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return e.clamp(MX_MIN_EXP, MX_MAX_EXP)


def _exp_bits(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of fp32 a > 0 from its exponent field (-127 for zero and subnormals), int32."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def e4m3_ceil(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 block scale for a = block amax / tensor scale (fp32, 0 <= a): the smallest E4M3 value s with 6 s >= a,
    capped at 448; (s fp32, its E4M3 code int32). a == 0 gives s = 0 (code 0)."""
    r = torch.clamp(div_exact(a, E2M1_MAX), max=E4M3_MAX)
    sp = torch.clamp(_exp_bits(r) - 3, min=-9)  # E4M3 grid spacing around r (subnormal spacing 2**-9)
    t = r * pow2(-sp)  # exact: a power-of-two rescale into [0, 16)
    q = torch.ceil(t)
    # ceil(fl(a / 6)) is the answer unless fl(a / 6) < a / 6 lands on the grid; for normal a that cannot happen
    # (an ulp of 6 s, divided by 6, exceeds half an ulp of s), but a / 6 underflows to 0 for a <= 3 * 2**-149:
    # check 6 s >= a exactly (6 s has at most 6 significant bits) and take the next grid value if not.
    s = q * pow2(sp)
    q = q + ((s * E2M1_MAX < a) & (r < E4M3_MAX)).to(q.dtype)
    s = q * pow2(sp)
    qi = q.to(torch.int32)
    code = ((sp + 9) << 3) + qi  # codes are monotonic: binade offset + multiple of the spacing (q = 16 carries)
    return s, code


def decode_e4m3(b: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8) -> fp32 (exact; 0x7F/0xFF are NaN)."""
    return b.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


# ------------------------------------------------------------------------------------------------ element grid
def round_e2m1(y: torch.Tensor, neg: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes (int32, sign in bit 3 from `neg`) of finite fp32 y: |y| clamped to 6, rounded on the grid in fp32
    (nearest-even, or up in magnitude when uniform < frac), encoded as binade offset + multiple of the spacing."""
    a = torch.clamp(y.abs(), max=E2M1_MAX)
    sp = torch.clamp(_exp_bits(a) - 1, min=-1)  # spacing 2**sp: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    r = a * pow2(-sp)  # exact, in [0, 4)
    if uniform is None:
        q = torch.round(r)  # half to even
    else:
        i = torch.floor(r)
        q = i + (uniform < (r - i)).to(torch.float32)
    return (((sp + 1) << 1) + q.to(torch.int32)) | (neg.to(torch.int32) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """int/uint8 E2M1 codes (0..15) -> fp32 values (exact; code 8 is -0.0)."""
    c = codes.to(torch.int32)
    mag = c & 7
    ex = mag >> 1
    man = mag & 1
    bits = torch.where(ex == 0, man * 0x3F000000, ((ex + 126) << 23) | (man << 22))
    return (bits | ((c & 8) << 28)).view(torch.float32)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int codes [..., K] (0..15) -> uint8 [..., K/2]: element 2j in bits 0-3 of byte j, element 2j+1 in bits 4-7."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 [..., K/2] -> int32 codes [..., K]."""
    p = packed.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def uniforms(m: int, k: int, key: torch.Tensor, index_base: int, device) -> torch.Tensor:
    """Stochastic-rounding uniforms for an [M, K] view: the FP8 path's counter hash of (key, flat index + base)."""
    rows = torch.arange(m, dtype=torch.int64, device=device).reshape(m, 1)
    cols = torch.arange(k, dtype=torch.int64, device=device).reshape(1, k)
    h = mix32(((index_base + rows * k + cols) & M32) ^ key)
    return (h >> 8).to(torch.float32) * (2.0**-24)


# ------------------------------------------------------------------------------------------------ the core
def encode_2d(
    x2: torch.Tensor,
    fmt: Fp4Format,
    key: torch.Tensor | None = None,
    index_base: int = 0,
    tensor_amax: torch.Tensor | None = None,
    row_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, K] (K a multiple of fmt.block) -> (packed codes uint8 [M, K/2], scale bytes uint8 [M, K/B], fp32 [1]).

    key: None for nearest rounding, else an int64 0-dim tensor (seed_key of the seed) for stochastic rounding.
    tensor_amax (NVFP4): the finite amax the tensor scale is taken from (default: this input's); [1], or [M] for
    one second-level scale per row (the wire's per-chunk scales in one call); the tensor scale returned has its
    shape. row_scales=True (NVFP4, no tensor_amax): each row's scale from its own finite amax ([M] returned)."""
    m, k = x2.shape
    bsz = fmt.block
    x = x2.float().reshape(m, k // bsz, bsz)
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), 0.0).amax(dim=-1, keepdim=True) if x.numel() else x.new_zeros(m, 0, 1)
    bad = (~finite).any(dim=-1, keepdim=True) if x.numel() else torch.zeros_like(amax, dtype=torch.bool)
    xf = torch.where(finite, x, 0.0)  # non-finite lanes get code 0; their block's NaN scale marks them
    if fmt.two_level:
        if tensor_amax is not None:
            ta = tensor_amax.float()
        elif row_scales:
            ta = amax.amax(dim=(1, 2)) if amax.numel() else amax.new_zeros(m)
        else:
            ta = amax.amax() if amax.numel() else amax.new_zeros(())
        ta = ta.reshape(-1)
        g = pow2_exponent(ta, NV_TENSOR_MAX).reshape(-1, 1, 1)  # [1] or [M] scales, broadcast over the rows
        s_b, sc = e4m3_ceil(amax * pow2(-g))
        y = xf * pow2(-g) / torch.where(s_b > 0, s_b, 1.0)  # exact rescale, then one correctly rounded division
        sbytes = torch.where(bad, E4M3_NAN, sc)
        tscale = pow2(g).reshape(-1)
    else:
        e = pow2_exponent(amax, E2M1_MAX)
        y = xf * pow2(-e)  # exact: a power-of-two rescale (scales are normal, 2**-E too)
        sbytes = torch.where(bad, E8M0_NAN, e + 127)
        tscale = torch.ones(1, dtype=torch.float32, device=x.device)
    u = None if key is None else uniforms(m, k, key, index_base, x.device).reshape(x.shape)
    neg = xf.view(torch.int32) < 0  # the sign bit: -0.0 keeps its sign
    codes = round_e2m1(y, neg, u).reshape(m, k)
    return pack_nibbles(codes), sbytes.reshape(m, k // bsz).to(torch.uint8), tscale


def decode_2d(packed: torch.Tensor, sbytes: torch.Tensor, tscale: torch.Tensor, fmt: Fp4Format) -> torch.Tensor:
    """Inverse of encode_2d: fp32 [M, K] = value * scale (MXFP4), (value * block scale) * tensor scale (NVFP4); a
    NaN scale byte makes its whole block NaN."""
    m, kh = packed.shape
    k = 2 * kh
    v = e2m1_values(unpack_nibbles(packed)).reshape(m, k // fmt.block, fmt.block)
    if fmt.two_level:
        s = decode_e4m3(sbytes).reshape(m, k // fmt.block, 1)
        out = (v * s) * tscale.float().reshape(-1, 1, 1)  # v * s is exact; one rounding ([1] or per-row [M])
    else:
        out = v * decode_e8m0(sbytes).reshape(m, k // fmt.block, 1)  # exact unless it overflows
    return out.reshape(m, k)


def scale_values(q: Fp4Tensor) -> torch.Tensor:
    """The effective fp32 block scales S (x ~= value * S) of a quantized tensor, [M, K/B] (for error bounds)."""
    if q.fmt.two_level:
        return decode_e4m3(q.scales) * q.tensor_scale.float()
    return decode_e8m0(q.scales)
