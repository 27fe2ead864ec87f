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

import torch
import triton
import triton.language as tl

from ..errors import Fp8CommTypeError
from . import fp4
from .triton_launch import _i32, _interpreting, _p2, chunk_tables, launch

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
def _block_scale(b, TWO_LEVEL: tl.constexpr):
    """Scale byte (int32) -> fp32: E4M3 (NVFP4; 0x7F/0xFF NaN) or E8M0 (MXFP4; OCP MX: 0 is 2**-127, 255 NaN)."""
    if TWO_LEVEL:
        mag = b & 0x7F
        ex = mag >> 3
        man = mag & 7
        bits = tl.where(ex == 0, (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True), (ex + 120) << 23)
        bits = tl.where(ex == 0, bits, bits | (man << 20))
        bits = tl.where(mag == 0x7F, 0x7FC00000, bits) | ((b & 0x80) << 24)
    else:
        bits = tl.where(b == 0, 0x00400000, b << 23)
        bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp4_amax_kernel(x_ptr, amax_bits_ptr, N, BLOCK: tl.constexpr, IN_BF16: tl.constexpr):
    """amax of the finite |x| of a flat tensor, merged by an integer atomic max (exact, order-free; starts at +0)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _load_x(x_ptr + offs, offs < N, IN_BF16)
    m = _rmax(tl.where(_isfinite(x), tl.abs(x), 0.0), 0)
    tl.atomic_max(amax_bits_ptr, m.to(tl.int32, bitcast=True))


@triton.jit
def _row_chunk(rows, rmask, starts_ptr, offs_ptr, pbytes_ptr, nchunks, R: tl.constexpr):
    """Each row's place in a wire buffer (chunk tables of triton_launch.chunk_tables): (row within its chunk, the
    chunk's byte offset, its payload bytes, its rows), int64 [R]. The chunk is the last one starting at or before
    the row (a zero-row chunk shares its successor's start, so it is never picked)."""
    c = tl.full([R], 0, tl.int32)
    for t in range(1, nchunks):
        c += (tl.load(starts_ptr + t) <= rows).to(tl.int32)
    st = tl.load(starts_ptr + c, mask=rmask, other=0)
    cb = tl.load(offs_ptr + c, mask=rmask, other=0)
    pb = tl.load(pbytes_ptr + c, mask=rmask, other=0)
    nrow = (tl.load(starts_ptr + c + 1, mask=rmask, other=0) - st).to(tl.int64)
    return (rows - st).to(tl.int64), cb, pb, nrow


@triton.jit(do_not_specialize=["index_base", "key"])
def fp4_quant_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    tamax_ptr,
    starts_ptr,
    offs_ptr,
    pbytes_ptr,
    nchunks,
    M,
    K,
    index_base,
    key,
    WIRE: tl.constexpr,
    R: tl.constexpr,
    NB: tl.constexpr,
    B: tl.constexpr,
    HB: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    TA_ROWS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr,
    FM6: tl.constexpr,
    FK6: tl.constexpr,
    FMT: tl.constexpr,
    FKT: tl.constexpr,
):
    """Fused 4-bit quantize + pack of an [M, K] tile (K a multiple of B): packed codes [M, K/2] and scale bytes
    [M, K/B] (E8M0, or E4M3 relative to the tensor scale 2**G from the tensor amax at tamax_ptr: one, or one per
    row with TA_ROWS). WIRE: straight into the chunk sections of a wire buffer (codes_ptr; chunk tables as the wire
    kernel's), NVFP4's tensor scale written by the chunk's first row."""
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
        if TA_ROWS:
            g = _pow2_exponent(tl.load(tamax_ptr + rows, mask=rows < M, other=0.0), FMT, FKT)[:, None]
            rg = _pow2(-g)  # [R, 1] over the blocks
            rgx = rg[:, :, None]  # [R, 1, 1] over the elements
        else:
            g = _pow2_exponent(tl.load(tamax_ptr), FMT, FKT)
            rg = _pow2(-g)
            rgx = rg
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
        ye = tl.math.div_rn(xe * rgx, div)
        yo = tl.math.div_rn(xo * rgx, div)
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
    if WIRE:  # the row's chunk: its sections' byte offsets in the buffer
        rmask = rows < M
        lr, cb, pb, nrow = _row_chunk(rows, rmask, starts_ptr, offs_ptr, pbytes_ptr, nchunks, R)
        cbase = cb + lr * (K // 2)
        sbase = cb + pb + lr * kb
        send = cb + pb + (nrow * kb + 15) // 16 * 16  # end of the 16-byte-aligned scale section
        if pid1 == 0:  # the chunk's last row zeroes its sections' alignment bytes: no stale memory on the wire
            z = tl.arange(0, 16)
            last = (rmask & (lr == nrow - 1))[:, None]
            zero = tl.full([R, 16], 0, tl.uint8)
            pend = (cb + nrow * (K // 2))[:, None] + z[None, :]
            tl.store(codes_ptr + pend, zero, last & (pend < (cb + pb)[:, None]))
            tend = (cb + pb + nrow * kb)[:, None] + z[None, :]
            tl.store(codes_ptr + tend, zero, last & (tend < send[:, None]))
            if TWO_LEVEL:  # the chunk's fp32 tensor scale (little-endian) and its 12 alignment bytes
                tbits = _pow2(tl.reshape(g, (R,))).to(tl.int32, bitcast=True)
                first = rmask & (lr == 0)
                for i in tl.static_range(4):
                    tl.store(codes_ptr + send + i, ((tbits >> (8 * i)) & 0xFF).to(tl.uint8), first)
                tpad = send[:, None] + 4 + z[None, :]
                tl.store(codes_ptr + tpad, zero, first[:, None] & (z < 12)[None, :])
    else:
        cbase = rows64 * (K // 2)
        sbase = rows64 * kb
    tl.store(codes_ptr + cbase[:, None, None] + blk[None, :, None] * HB + j[None, None, :], packed, mask)
    tl.store(scale_ptr + sbase[:, None] + blk[None, :], sbyte.to(tl.uint8), bmask)


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
    s = _block_scale(b, TWO_LEVEL)[:, :, None]
    if TWO_LEVEL:
        ts = tl.load(tscale_ptr)
        ve = (_e2m1_value(p & 15) * s) * ts
        vo = (_e2m1_value(p >> 4) * s) * ts
    else:
        ve = _e2m1_value(p & 15) * s
        vo = _e2m1_value(p >> 4) * s
    col = blk[None, :, None] * B + 2 * j[None, None, :]
    dst = out_ptr + (rows64 * K)[:, None, None] + col
    tl.store(dst, ve, mask)
    tl.store(dst + 1, vo, mask)


@triton.jit
def _wire_chunk(buf_ptr, cb, pb, nrow, lr, jb, rmask, bmask, KH, KB, HB: tl.constexpr, TWO_LEVEL: tl.constexpr):
    """(even, odd) element values [R, BH] of code bytes jb of rows lr of the chunk at byte cb (int64 [R]): payload
    at cb, scale bytes at cb + pb, NVFP4's fp32 tensor scale after the 16-byte-aligned scale section."""
    p = tl.load(buf_ptr + (cb + lr * KH)[:, None] + jb[None, :], bmask, 0).to(tl.int32)
    b = tl.load(buf_ptr + (cb + pb + lr * KB)[:, None] + (jb // HB)[None, :], bmask, 0).to(tl.int32)
    s = _block_scale(b, TWO_LEVEL)
    if TWO_LEVEL:
        to = cb + pb + (nrow * KB + 15) // 16 * 16
        bits = tl.load(buf_ptr + to, rmask, 0).to(tl.int32)
        for i in tl.static_range(1, 4):  # little-endian fp32 from its bytes (the buffer is uint8)
            bits = bits | (tl.load(buf_ptr + to + i, rmask, 0).to(tl.int32) << (8 * i))
        ts = bits.to(tl.float32, bitcast=True)[:, None]
        return (_e2m1_value(p & 15) * s) * ts, (_e2m1_value(p >> 4) * s) * ts
    return _e2m1_value(p & 15) * s, _e2m1_value(p >> 4) * s


@triton.jit
def fp4_wire_kernel(
    buf_ptr,
    out_ptr,
    x_ptr,
    starts_ptr,
    offs_ptr,
    pbytes_ptr,
    nchunks,
    chunk_stride,
    M,
    K,
    L,
    out_stride,
    x_stride,
    R: tl.constexpr,
    BH: tl.constexpr,
    HB: tl.constexpr,
    B: tl.constexpr,
    MODE: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    """Straight from a 4-bit wire buffer, one pass: MODE 0 every chunk decoded into fp32 out[:, :L]; MODE 1
    `nchunks` equal chunks (chunk_stride bytes apart, M rows each) decoded and summed in fp32 in chunk order into
    out [M, K]; MODE 2 error feedback's out = x - decoded over [:, :L] (x fp32 or bf16), non-finite differences
    0. No FMA."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    KH = K // 2
    KB = K // B
    rows = pid0 * R + tl.arange(0, R)
    jb = pid1 * BH + tl.arange(0, BH)  # code bytes of the row: elements 2jb (low nibble) and 2jb + 1
    rmask = rows < M
    bmask = rmask[:, None] & (jb < KH)[None, :]
    rows64 = rows.to(tl.int64)
    if MODE == 1:
        lr = rows64
        cb = tl.full([R], 0, tl.int64)
        pb = cb + tl.load(pbytes_ptr)
        nrow = cb + M
        ve, vo = _wire_chunk(buf_ptr, cb, pb, nrow, lr, jb, rmask, bmask, KH, KB, HB, TWO_LEVEL)
        for _ci in range(1, nchunks):  # in chunk order from chunk 0's values, as the reference's copy then adds
            cb = cb + chunk_stride
            qe, qo = _wire_chunk(buf_ptr, cb, pb, nrow, lr, jb, rmask, bmask, KH, KB, HB, TWO_LEVEL)
            ve = ve + qe
            vo = vo + qo
    else:
        lr, cb, pb, nrow = _row_chunk(rows, rmask, starts_ptr, offs_ptr, pbytes_ptr, nchunks, R)
        ve, vo = _wire_chunk(buf_ptr, cb, pb, nrow, lr, jb, rmask, bmask, KH, KB, HB, TWO_LEVEL)
    # interleaved: contiguous columns, one coalesced store (tl.interleave itself is a @jit library function that
    # the interpreter refuses to call, Triton 3.9; join + reshape is the same on both)
    v = tl.reshape(tl.join(ve, vo), (R, 2 * BH))
    col = pid1 * (2 * BH) + tl.arange(0, 2 * BH)
    mask = rmask[:, None] & (col < L)[None, :]
    if MODE == 2:
        d = _load_x(x_ptr + (rows64 * x_stride)[:, None] + col[None, :], mask, IN_BF16) - v
        v = tl.where(_isfinite(d), d, 0.0)
    tl.store(out_ptr + (rows64 * out_stride)[:, None] + col[None, :], v, mask)


# --------------------------------------------------------------------------------------------------- launchers
def _frexp_consts(limit: float) -> tuple[int, int]:
    """(fraction field of 2*m, k) for limit = m * 2**k, m in [0.5, 1): what _pow2_exponent compares against."""
    m, k = math.frexp(limit)
    return int((2 * m - 1) * 2**23), k


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
    """fp4.encode_2d on the kernel: seed None = nearest rounding, else stochastic with that seed; NVFP4's
    tensor_amax_ [1] or [M] (one second-level scale per row, returned with its shape)."""
    x2 = _check_input(x2)
    m, k = x2.shape
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=x2.device)
    sbytes = torch.empty(m, k // fmt.block, dtype=torch.uint8, device=x2.device)
    if fmt.two_level:
        ta = tensor_amax(x2) if tensor_amax_ is None else tensor_amax_.float().reshape(-1).to(x2.device).contiguous()
        ts = fp4.pow2(fp4.pow2_exponent(ta, fp4.NV_TENSOR_MAX))
    else:
        ta = torch.zeros(1, dtype=torch.float32, device=x2.device)
        ts = torch.ones(1, dtype=torch.float32, device=x2.device)
    _quantize(x2, fmt, seed, index_base, ta, codes, sbytes, None)
    return codes, sbytes, ts


def encode_wire(x2, layout, seed, row_amax, out) -> None:
    """x2 [M, K] quantized straight into the chunk sections of the wire buffer `out` in one launch, alignment
    bytes zeroed (not those of a zero-row chunk); NVFP4: row_amax [M] gives each row its chunk's second-level
    scale, written once per chunk."""
    x2 = _check_input(x2)
    fmt = layout.fmt
    ta = row_amax.float().contiguous() if fmt.two_level else torch.zeros(1, dtype=torch.float32, device=x2.device)
    _quantize(x2, fmt, seed, 0, ta, out, out, chunk_tables(layout, out.device))


def _quantize(x2, fmt, seed, index_base, ta, codes, sbytes, tables) -> None:
    m, k = x2.shape
    if ta.numel() not in (1, m):
        raise Fp8CommTypeError(f"fp4 triton kernel: tensor amax of {ta.numel()} values for {m} rows")
    if not (m and k):
        return
    bsz = fmt.block
    r, nb, grid = _tiles(m, k // bsz, bsz)
    fm6, fk6 = _frexp_consts(fp4.E2M1_MAX)
    fmt_, fkt = _frexp_consts(fp4.NV_TENSOR_MAX)
    key = 0 if seed is None else _i32(fp4.seed_key(seed))
    starts, offs, pbytes = tables if tables is not None else (ta, ta, ta)
    launch(
        fp4_quant_kernel,
        grid,
        x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2,
        codes,
        sbytes,
        ta,
        starts,
        offs,
        pbytes,
        starts.numel() - 1 if tables is not None else 1,
        m,
        k,
        _i32(index_base),
        key,
        WIRE=tables is not None,
        R=r,
        NB=nb,
        B=bsz,
        HB=bsz // 2,
        TWO_LEVEL=fmt.two_level,
        TA_ROWS=fmt.two_level and (ta.numel() > 1 or tables is not None),
        STOCHASTIC=seed is not None,
        IN_BF16=x2.dtype == torch.bfloat16,
        FM6=fm6,
        FK6=fk6,
        FMT=fmt_,
        FKT=fkt,
        writes=(codes,) if codes is sbytes else (codes, sbytes),
    )


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


def _wire_tiles(m: int, kh: int) -> tuple[int, int, tuple[int, int]]:
    """(rows per program, code bytes per program, grid) for the wire kernel: GPU tiles of 2048 code bytes."""
    tile = INTERP_TILE if _interpreting() else 2048
    bh = min(_p2(kh), tile)
    r = max(1, min(_p2(m), tile // bh))
    grid = (-(-m // r), -(-kh // bh))
    if grid[1] > 65535:
        raise Fp8CommTypeError(f"fp4 triton wire kernel: rows of {2 * kh} elements are too long; split the row")
    return r, bh, grid


def wire(buf: torch.Tensor, layout, out: torch.Tensor, mode: str, x: torch.Tensor | None = None) -> torch.Tensor:
    """One launch from the wire buffer `buf` (no Hadamard transform): mode "unpack" decodes every chunk into fp32
    out [M, L <= K]; "sum" sums the equal chunks into fp32 out [rows, K]; "residual" writes fp32 out = x - decoded
    (x fp32 or bf16 [M, L])."""
    fmt, k = layout.fmt, layout.k
    n = len(layout.rows)
    if mode == "sum":
        m, width = layout.rows[0], k
    else:
        m, width = layout.total_rows, out.shape[1]
    if not m or not k:
        return out
    o = out if out.stride(1) == 1 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    xs = o if x is None else x if x.stride(1) == 1 else x.contiguous()
    bf16 = xs.dtype == torch.bfloat16
    starts, offs, pbytes = chunk_tables(layout, buf.device)
    r, bh, grid = _wire_tiles(m, k // 2)
    launch(
        fp4_wire_kernel,
        grid,
        buf,
        o,
        xs.view(torch.int16) if bf16 else xs,
        starts,
        offs,
        pbytes,
        n,
        layout.chunk_bytes[0] if mode == "sum" else 0,
        m,
        k,
        width,
        o.stride(0),
        xs.stride(0),
        writes=(o,),
        num_warps=4,
        R=r,
        BH=bh,
        HB=fmt.block // 2,
        B=fmt.block,
        MODE={"unpack": 0, "sum": 1, "residual": 2}[mode],
        TWO_LEVEL=fmt.two_level,
        IN_BF16=bf16,
    )
    if o is not out:
        out.copy_(o)
    return out
