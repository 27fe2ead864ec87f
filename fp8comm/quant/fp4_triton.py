"""Triton kernels for 4-bit quantization (MXFP4, NVFP4), bit-exact with fp4.encode_2d / decode_2d.

One pass per tile of [R rows, NB blocks, B/2 element pairs]: block amax, scale, round onto the E2M1 grid and pack
two codes per byte (element 2j low nibble). Every float step is exact or correctly rounded fp32 (division by the
E4M3 block scale is div_rn; power-of-two scales multiply by exact reciprocals built from exponent bits), and codes
are built from integer bit fields: no fp8/fp4 cast is used (the interpreter's are wrong; platform.md). Runs on CUDA
tensors, and on CPU tensors under TRITON_INTERPRET=1 (slow: tiles grow so that programs are few). The Hadamard
transform, when asked for, runs before the kernel (fp4.hadamard_forward), as does nothing else.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..errors import Fp8CommTypeError
from . import fp4

GPU_TILE = 4096
INTERP_TILE = 1 << 16  # the interpreter pays per program: one big tile


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _rmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _max2)


@triton.jit
def _pow2(e):
    """2**e as fp32 for int32 e in [-126, 127] (exact, from the exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mix32(h):
    """lowbias32 on uint32 (reference.mix32): uint32 multiplies wrap mod 2**32 like the reference's masking."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    return h ^ (h >> 16)


@triton.jit
def _isfinite(x):
    return (x.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _load_x(ptr, mask, IN_BF16: tl.constexpr):
    """Input as fp32; bf16 as int16 bits widened by a shift (the interpreter's bf16 conversion loses subnormals)."""
    if IN_BF16:
        return (tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pow2_exponent(amax, FM_FRAC: tl.constexpr, FK: tl.constexpr):
    """fp4.pow2_exponent: the smallest E with amax / 2**E <= limit (limit = (1 + FM_FRAC/2**23) * 2**(FK-1)), from
    the bits; a subnormal amax is renormalised by an exact int -> fp32 conversion of its fraction."""
    bits = amax.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    sub = frac.to(tl.float32).to(tl.int32, bitcast=True)
    k = tl.where(ex == 0, ((sub >> 23) & 0xFF) - 126 - 149, ex - 126)
    f = tl.where(ex == 0, sub & 0x7FFFFF, frac)
    e = k - FK + (f > FM_FRAC).to(tl.int32)
    e = tl.where(bits > 0, e, 0)
    return tl.minimum(tl.maximum(e, -126), 126)


@triton.jit
def _exp_bits(a):
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _round_e2m1(y, neg, idx, key, STOCHASTIC: tl.constexpr):
    """fp4.round_e2m1: int32 codes of finite fp32 y (|y| clamped to 6), sign bit 3 from neg."""
    a = tl.minimum(tl.abs(y), 6.0)
    sp = tl.maximum(_exp_bits(a) - 1, -1)
    r = a * _pow2(-sp)  # exact, in [0, 4)
    i = r.to(tl.int32)  # r >= 0: truncation is floor
    frac = r - i.to(tl.float32)
    if STOCHASTIC:
        u = (_mix32(idx ^ key) >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        q = i + (u < frac).to(tl.int32)
    else:
        q = i + ((frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))).to(tl.int32)
    return (((sp + 1) << 1) + q) | (neg.to(tl.int32) << 3)


@triton.jit
def _e2m1_value(c):
    """E2M1 code (int32, 0..15) -> fp32 (exact)."""
    mag = c & 7
    ex = mag >> 1
    man = mag & 1
    bits = tl.where(ex == 0, man * 0x3F000000, ((ex + 126) << 23) | (man << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def fp4_amax_kernel(x_ptr, amax_bits_ptr, N, BLOCK: tl.constexpr, IN_BF16: tl.constexpr):
    """amax of the finite |x| of a flat tensor, merged by an integer atomic max (exact, order-free; starts at +0)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _load_x(x_ptr + offs, offs < N, IN_BF16)
    m = _rmax(tl.where(_isfinite(x), tl.abs(x), 0.0), 0)
    tl.atomic_max(amax_bits_ptr, m.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["index_base", "key"])
def fp4_quant_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    tamax_ptr,
    M,
    K,
    index_base,
    key,
    R: tl.constexpr,
    NB: tl.constexpr,
    B: tl.constexpr,
    HB: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr,
    FM6: tl.constexpr,
    FK6: tl.constexpr,
    FMT: tl.constexpr,
    FKT: tl.constexpr,
):
    """Fused 4-bit quantize + pack of an [M, K] tile (K a multiple of B): packed codes [M, K/2] and scale bytes
    [M, K/B] (E8M0, or E4M3 relative to the tensor scale 2**G from the tensor amax at tamax_ptr)."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    kb = K // B
    rows = pid0 * R + tl.arange(0, R)
    blk = pid1 * NB + tl.arange(0, NB)
    j = tl.arange(0, HB)
    bmask = (rows < M)[:, None] & (blk < kb)[None, :]
    mask = bmask[:, :, None]
    rows64 = rows.to(tl.int64)
    col = blk[None, :, None] * B + 2 * j[None, None, :]  # even element of each pair
    xp = x_ptr + (rows64 * K)[:, None, None] + col
    xe = _load_x(xp, mask, IN_BF16)
    xo = _load_x(xp + 1, mask, IN_BF16)
    fe = _isfinite(xe)
    fo = _isfinite(xo)
    amax = tl.maximum(_rmax(tl.where(fe, tl.abs(xe), 0.0), 2), _rmax(tl.where(fo, tl.abs(xo), 0.0), 2))  # [R, NB]
    nonfin = (fe == 0).to(tl.int32) + (fo == 0).to(tl.int32)
    bad = _rmax(nonfin, 2) > 0
    xe = tl.where(fe, xe, 0.0)  # non-finite lanes get code 0; their block's NaN scale marks them
    xo = tl.where(fo, xo, 0.0)
    if TWO_LEVEL:
        g = _pow2_exponent(tl.load(tamax_ptr), FMT, FKT)
        rg = _pow2(-g)
        a = amax * rg
        r = tl.minimum(tl.math.div_rn(a, tl.full(a.shape, 6.0, tl.float32)), 448.0)
        sp = tl.maximum(_exp_bits(r) - 3, -9)
        t = r * _pow2(-sp)
        q = t.to(tl.int32)
        q = q + (q.to(tl.float32) < t).to(tl.int32)  # ceil
        s = q.to(tl.float32) * _pow2(sp)
        q = q + ((s * 6.0 < a) & (r < 448.0)).to(tl.int32)
        s = q.to(tl.float32) * _pow2(sp)
        sbyte = tl.where(bad, 0x7F, ((sp + 9) << 3) + q)
        div = tl.where(s > 0, s, 1.0)[:, :, None]
        div = tl.broadcast_to(div, xe.shape)
        ye = tl.math.div_rn(xe * rg, div)
        yo = tl.math.div_rn(xo * rg, div)
    else:
        e = _pow2_exponent(amax, FM6, FK6)
        sbyte = tl.where(bad, 255, e + 127)
        rs = _pow2(-e)[:, :, None]
        ye = xe * rs
        yo = xo * rs
    idx_e = None
    idx_o = None
    if STOCHASTIC:  # the counter is the element's flat index in [M, K] (+ index_base), mod 2**32, as for FP8
        idx_e = index_base.to(tl.uint32, bitcast=True) + rows.to(tl.uint32)[:, None, None] * K + col.to(tl.uint32)
        idx_o = idx_e + 1
        key = key.to(tl.uint32, bitcast=True)
    ce = _round_e2m1(ye, xe.to(tl.int32, bitcast=True) < 0, idx_e, key, STOCHASTIC)
    co = _round_e2m1(yo, xo.to(tl.int32, bitcast=True) < 0, idx_o, key, STOCHASTIC)
    packed = (ce | (co << 4)).to(tl.uint8)
    tl.store(codes_ptr + (rows64 * (K // 2))[:, None, None] + blk[None, :, None] * HB + j[None, None, :], packed, mask)
    tl.store(scale_ptr + (rows64 * kb)[:, None] + blk[None, :], sbyte.to(tl.uint8), bmask)


@triton.jit
def fp4_dequant_kernel(
    codes_ptr,
    scale_ptr,
    tscale_ptr,
    out_ptr,
    M,
    K,
    R: tl.constexpr,
    NB: tl.constexpr,
    B: tl.constexpr,
    HB: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
):
    """fp4.decode_2d: fp32 out [M, K] = value * E8M0 scale, or (value * E4M3 block scale) * tensor scale; a NaN
    scale byte (E8M0 255, E4M3 0x7F) makes its block NaN."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    kb = K // B
    rows = pid0 * R + tl.arange(0, R)
    blk = pid1 * NB + tl.arange(0, NB)
    j = tl.arange(0, HB)
    bmask = (rows < M)[:, None] & (blk < kb)[None, :]
    mask = bmask[:, :, None]
    rows64 = rows.to(tl.int64)
    p = tl.load(codes_ptr + (rows64 * (K // 2))[:, None, None] + blk[None, :, None] * HB + j[None, None, :], mask, 0)
    p = p.to(tl.int32)
    b = tl.load(scale_ptr + (rows64 * kb)[:, None] + blk[None, :], bmask, 0).to(tl.int32)
    if TWO_LEVEL:
        mag = b & 0x7F
        ex = mag >> 3
        man = mag & 7
        bits = tl.where(ex == 0, (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True), (ex + 120) << 23)
        bits = tl.where(ex == 0, bits, bits | (man << 20))
        bits = tl.where(mag == 0x7F, 0x7FC00000, bits) | ((b & 0x80) << 24)
        s = bits.to(tl.float32, bitcast=True)[:, :, None]
        ts = tl.load(tscale_ptr)
        ve = (_e2m1_value(p & 15) * s) * ts
        vo = (_e2m1_value(p >> 4) * s) * ts
    else:
        bits = tl.where(b == 0, 0x00400000, b << 23)  # OCP MX: byte 0 is 2**-127, 255 is NaN
        bits = tl.where(b == 255, 0x7FC00000, bits)
        s = bits.to(tl.float32, bitcast=True)[:, :, None]
        ve = _e2m1_value(p & 15) * s
        vo = _e2m1_value(p >> 4) * s
    col = blk[None, :, None] * B + 2 * j[None, None, :]
    dst = out_ptr + (rows64 * K)[:, None, None] + col
    tl.store(dst, ve, mask)
    tl.store(dst + 1, vo, mask)


# --------------------------------------------------------------------------------------------------- launchers
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _frexp_consts(limit: float) -> tuple[int, int]:
    """(fraction field of 2*m, k) for limit = m * 2**k, m in [0.5, 1): what _pow2_exponent compares against."""
    m, k = math.frexp(limit)
    return int((2 * m - 1) * 2**23), k


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _tiles(m: int, kb: int, block: int) -> tuple[int, int, tuple[int, int]]:
    tile = INTERP_TILE if _interpreting() else GPU_TILE
    nb = max(1, min(_p2(kb), tile // block))
    r = max(1, min(_p2(m), tile // (nb * block)))
    return r, nb, (-(-m // r), -(-kb // nb))


def _check_input(x2: torch.Tensor) -> torch.Tensor:
    if x2.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Fp8CommTypeError(f"fp4 triton kernel: float32, bfloat16 or float16 input, got {x2.dtype}")
    return x2.contiguous()


def tensor_amax(x2: torch.Tensor) -> torch.Tensor:
    """fp32 [1]: amax of the finite |x| (one atomic-max kernel)."""
    x2 = _check_input(x2)
    bits = torch.zeros(1, dtype=torch.int32, device=x2.device)
    n = x2.numel()
    if n:
        blk = min(_p2(n), INTERP_TILE if _interpreting() else 4096)
        xin = x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2
        fp4_amax_kernel[(-(-n // blk),)](xin, bits, n, BLOCK=blk, IN_BF16=x2.dtype == torch.bfloat16)
    return bits.view(torch.float32)


def encode_2d(x2, fmt, seed=None, index_base=0, tensor_amax_=None):
    """fp4.encode_2d on the kernel: seed None = nearest rounding, else stochastic with that seed."""
    x2 = _check_input(x2)
    m, k = x2.shape
    bsz = fmt.block
    kb = k // bsz
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=x2.device)
    sbytes = torch.empty(m, kb, dtype=torch.uint8, device=x2.device)
    if fmt.two_level:
        ta = tensor_amax(x2) if tensor_amax_ is None else tensor_amax_.float().reshape(1).to(x2.device).contiguous()
        ts = fp4.pow2(fp4.pow2_exponent(ta, fp4.NV_TENSOR_MAX))
    else:
        ta = torch.zeros(1, dtype=torch.float32, device=x2.device)
        ts = torch.ones(1, dtype=torch.float32, device=x2.device)
    if m and k:
        r, nb, grid = _tiles(m, kb, bsz)
        fm6, fk6 = _frexp_consts(fp4.E2M1_MAX)
        fmt_, fkt = _frexp_consts(fp4.NV_TENSOR_MAX)
        key = 0 if seed is None else _i32(fp4.seed_key(seed))
        xin = x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2
        fp4_quant_kernel[grid](
            xin,
            codes,
            sbytes,
            ta,
            m,
            k,
            _i32(index_base),
            key,
            R=r,
            NB=nb,
            B=bsz,
            HB=bsz // 2,
            TWO_LEVEL=fmt.two_level,
            STOCHASTIC=seed is not None,
            IN_BF16=x2.dtype == torch.bfloat16,
            FM6=fm6,
            FK6=fk6,
            FMT=fmt_,
            FKT=fkt,
        )
    return codes, sbytes, ts


def decode_2d(packed, sbytes, tscale, fmt):
    """fp4.decode_2d on the kernel (fp32 out)."""
    m, kh = packed.shape
    k = 2 * kh
    out = torch.empty(m, k, dtype=torch.float32, device=packed.device)
    if m and k:
        r, nb, grid = _tiles(m, k // fmt.block, fmt.block)
        fp4_dequant_kernel[grid](
            packed.contiguous(),
            sbytes.contiguous(),
            tscale.float().reshape(1).contiguous(),
            out,
            m,
            k,
            R=r,
            NB=nb,
            B=fmt.block,
            HB=fmt.block // 2,
            TWO_LEVEL=fmt.two_level,
        )
    return out
