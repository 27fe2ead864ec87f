"""Triton kernels for the FP8 quantizer and the packed wire format, bit-exact with quant/reference.py.

Every float step is exact or correctly rounded fp32: x / scale and amax / max use div_rn (Triton's plain `/` is
div.full.f32, ~2 ulp, on CUDA); a power-of-two scale divides by multiplying with its exact reciprocal; powers of
two come from exponent bits. Rounding onto the FP8 grid: with HW (compiled for sm_90+) nearest rounding is the
hardware's single-rounding cvt.rn.satfinite of the fp32 quotient and decoding is the exact fp8->f16->f32 cvt;
otherwise (the interpreter, whose fp32->fp8/bf16 casts are wrong, and stochastic rounding) codes and bf16 outputs
are assembled from integer bit fields. launch/device_check.py checks the HW path bit for bit on a GPU.

Tiles are [R rows, NB segments, SEGW columns]. With FIT, one segment is one 1xB block (or one block-row slice of a
2-D block when ROWS2D), so block amax is a reduction inside the tile and the whole quantization is one pass.
Without FIT (blocks larger than a tile) amax comes from `amax_kernel` and each element looks its block up.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


# The interpreter reduces with numpy only when the combine function IS triton's _elementwise_max (any other runs
# element by element in Python); our own combine is the fallback should a Triton version rename it.
_MAX_COMBINE = getattr(getattr(tl, "standard", None), "_elementwise_max", None) or _max2


@triton.jit
def _rmax(x, axis: tl.constexpr):
    """tl.max without calling triton's standard library directly: its @jit helpers are interpreted or compiled
    depending on TRITON_INTERPRET when triton was first imported, ours when this module was (tests rely on it)."""
    return tl.reduce(x, axis, _MAX_COMBINE)


@triton.jit
def _add2(a, b):
    return a + b


_SUM_COMBINE = getattr(getattr(tl, "standard", None), "_sum_combine", None) or _add2


@triton.jit
def _count3(v):
    """Number of true lanes of a 3-D boolean tile, as int64 (tl.sum without the standard library, as _rmax)."""
    return tl.reduce(tl.reduce(tl.reduce(v.to(tl.int32), 2, _SUM_COMBINE), 1, _SUM_COMBINE), 0, _SUM_COMBINE).to(
        tl.int64
    )


@triton.jit
def _pow2(e):
    """2**e as fp32 for an int32 tensor e in [-126, 127] (exact: built from the exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mix32(h):
    """lowbias32 on uint32 (reference.mix32); uint32 multiplies wrap mod 2**32 like the reference's masking."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    return h ^ (h >> 16)


@triton.jit
def _isfinite(x):
    return (x.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _recip_pow2(s):
    """1/s, exact, for s = 2**E with E in [-126, 127] (2**-127 is the one subnormal result)."""
    eb = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(eb == 254, 0x00400000, (254 - eb) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_from_amax(
    amax,
    FMAX: tl.constexpr,
    POW2: tl.constexpr,
    MARGIN: tl.constexpr,
    MARGIN_MUL: tl.constexpr,
    FM_FRAC: tl.constexpr,
    FK: tl.constexpr,
):
    """scaling.scale_from_amax for fp32 amax >= 0: amax == 0 -> 1.0; else amax/max (fp32) or 2**E (pow2/e8m0)."""
    bits = amax.to(tl.int32, bitcast=True)
    pos = bits > 0  # integer test: a subnormal amax counts as > 0 even where compares flush to zero
    if POW2:
        # frexp(amax) = m * 2**k from the bits; a subnormal amax is renormalised by an exact int->fp32 conversion
        ex = (bits >> 23) & 0xFF
        frac = bits & 0x7FFFFF
        sub = frac.to(tl.float32).to(tl.int32, bitcast=True)
        k = tl.where(ex == 0, ((sub >> 23) & 0xFF) - 126 - 149, ex - 126)
        f = tl.where(ex == 0, sub & 0x7FFFFF, frac)
        e = k - FK + (f > FM_FRAC).to(tl.int32) + MARGIN
        e = tl.where(pos, e, 0)
        s = _pow2(tl.minimum(tl.maximum(e, -126), 127))
    else:
        s = tl.math.div_rn(amax, FMAX)
        if MARGIN != 0:
            s = s * MARGIN_MUL
        s = tl.minimum(tl.maximum(s, 1.1754943508222875e-38), 1.7014118346046923e38)  # [2**-126, 2**127]
        s = tl.where(pos, s, 1.0)
    return s


@triton.jit
def _encode(
    x,
    finite,
    s,
    r,
    idx,
    key,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_SUB: tl.constexpr,
    HAS_INF: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    POW2: tl.constexpr,
    HW: tl.constexpr,
):
    """reference.encode: uint8 FP8 codes of fp32 x / s (s > 0), rounded nearest-even or stochastically.

    POW2: s is a power of two and r its exact reciprocal, so x * r is the correctly rounded x / s (one multiply
    instead of a division). HW (CUDA, sm_90+): nearest rounding by the hardware's single-rounding fp32->fp8 cvt;
    its .satfinite saturates finite overflow (and the inf of an overflowed quotient) to +-max, which is the
    reference's clamp. Otherwise the FP8 code is built from integer bit fields."""
    neg = x.to(tl.int32, bitcast=True) < 0
    xf = x if (HW and not STOCHASTIC) else tl.where(finite, x, 0.0)  # non-finite lanes are replaced below
    if POW2:
        y = xf * tl.broadcast_to(r, x.shape)
    else:
        y = tl.math.div_rn(xf, tl.broadcast_to(s, x.shape))  # operands of one shape on every Triton version
    if HW and not STOCHASTIC:
        if HAS_INF:
            code = y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            code = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        a = tl.minimum(tl.abs(y), FMAX)
        # grid spacing 2**sp around a (reference.grid_exponent); r = a / 2**sp is exact
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -126)
        sp = tl.maximum(e - MBITS, MIN_SUB)
        t = a * _pow2(-sp)
        i = t.to(tl.int32)  # t >= 0 and < 2**(MBITS+2): truncation is floor
        frac = t - i.to(tl.float32)
        if STOCHASTIC:
            u = (_mix32(idx ^ key) >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
            q = i + (u < frac).to(tl.int32)
        else:
            q = i + ((frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))).to(tl.int32)
        # codes are monotonic in magnitude: binade offset + integer multiple of the spacing (a carry of q into
        # the next binade lands on the right code, subnormals have sp == MIN_SUB)
        code = (((sp - MIN_SUB) << MBITS) + q) | (neg.to(tl.int32) << 7)
    # non-finite inputs: E5M2 keeps +-inf (0x7C/0xFC); every NaN, and E4M3's inf (it has none), is NaN 0x7F
    if HAS_INF:
        special = tl.where(x != x, 0x7F, tl.where(neg, 0xFC, 0x7C))
    else:
        special = 0x7F
    return tl.where(finite, code, special).to(tl.uint8)


@triton.jit
def _decode(
    code, MBITS: tl.constexpr, BIAS: tl.constexpr, MIN_SUB_MUL: tl.constexpr, HAS_INF: tl.constexpr, HW: tl.constexpr
):
    """FP8 codes -> fp32 (exact). HW: the hardware's fp8->f16->f32 conversions (NaN payloads are the hardware's);
    otherwise from the bit fields, with the same NaN bits as torch's CPU cast (quiet bit set, payload kept)."""
    if HW:
        if HAS_INF:
            return code.to(tl.float8e5, bitcast=True).to(tl.float32)
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    c = code.to(tl.int32)
    mag = c & 0x7F
    ex = mag >> MBITS
    man = mag & ((1 << MBITS) - 1)
    bits = ((ex - BIAS + 127) << 23) | (man << (23 - MBITS))
    sub = (man.to(tl.float32) * MIN_SUB_MUL).to(tl.int32, bitcast=True)  # exact: a small int times 2**min_sub
    bits = tl.where(ex == 0, sub, bits)
    if HAS_INF:
        special = ex == (1 << (7 - MBITS)) - 1
    else:
        special = mag == 0x7F
    spec = 0x7F800000 | (man << (23 - MBITS)) | tl.where(man != 0, 0x400000, 0)
    bits = tl.where(special, spec, bits) | ((c & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 bits, round-to-nearest-even in integers (the interpreter's bf16 cast truncates); NaN becomes
    0x7FFF, the canonical NaN of CUDA's cvt (torch's CPU conversion has no single NaN pattern to match)."""
    b = v.to(tl.uint32, bitcast=True)
    isnan = (b & 0x7FFFFFFF) > 0x7F800000
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(isnan, 0x7FFF, r)
    return r.to(tl.int16)


@triton.jit
def _load_x(ptr, mask, IN_BF16: tl.constexpr):
    """Input as fp32. bf16 arrives as int16 bits and is widened by a shift (the interpreter's bf16->fp32
    conversion loses subnormals); fp16/fp32 upcast exactly."""
    if IN_BF16:
        return (tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _coords(
    pid0, pid1, M, K, RSTEP: tl.constexpr, SEG: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, SEGW: tl.constexpr
):
    """Rows [R], segment ids [NB], columns [1, NB, SEGW], row mask [R] and element mask [R, NB, SEGW]."""
    i = tl.arange(0, R)
    row = pid0 * RSTEP + i
    rmask = row < M
    if RSTEP < R:
        rmask = rmask & (i < RSTEP)
    j = tl.arange(0, SEGW)
    seg = pid1 * NB + tl.arange(0, NB)
    col = seg[None, :, None] * SEG + j[None, None, :]
    cmask = col < K
    if SEG < SEGW:
        cmask = cmask & (j < SEG)[None, None, :]
    return row, seg, col, rmask, rmask[:, None, None] & cmask


@triton.jit
def _chunk_of(row, starts_ptr, nchunks, NCH_STEPS: tl.constexpr):
    """Index of the chunk holding each row: the last c with starts[c] <= row (binary lifting over the table;
    a zero-row chunk shares its successor's start, so it is never picked)."""
    c = tl.full(row.shape, 0, tl.int32)
    for t in tl.static_range(NCH_STEPS):
        cand = c + (1 << (NCH_STEPS - 1 - t))
        st = tl.load(starts_ptr + cand, mask=cand < nchunks, other=2147483647)
        c = tl.where(st <= row, cand, c)
    return c


@triton.jit
def _scale_from_bytes(ptr, off, mask, SCALE_BYTES: tl.constexpr):
    """Wire scale at byte offsets `off`: an E8M0 byte (the fp32 biased exponent; OCP MX: byte 0 is 2**-127, built
    from its bits since it is an fp32 subnormal, and 255 is NaN, as layout.decode_e8m0) or 4 little-endian fp32
    bytes."""
    if SCALE_BYTES == 1:
        e = tl.load(ptr + off, mask=mask, other=127).to(tl.int32)
        bits = tl.where(e == 0, 0x00400000, e << 23)
        bits = tl.where(e == 255, 0x7FC00000, bits)
    else:
        bits = tl.load(ptr + off, mask=mask, other=0).to(tl.int32)
        bits = bits | (tl.load(ptr + off + 1, mask=mask, other=0).to(tl.int32) << 8)
        bits = bits | (tl.load(ptr + off + 2, mask=mask, other=0x80).to(tl.int32) << 16)
        bits = bits | (tl.load(ptr + off + 3, mask=mask, other=0x3F).to(tl.int32) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_scale_bytes(ptr, off, s, mask, SCALE_BYTES: tl.constexpr):
    bits = s.to(tl.int32, bitcast=True)
    if SCALE_BYTES == 1:
        tl.store(ptr + off, ((bits >> 23) & 0xFF).to(tl.uint8), mask=mask)
    else:
        for b in tl.static_range(4):
            tl.store(ptr + off + b, ((bits >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def amax_kernel(
    x_ptr, amax_bits_ptr, M, K, BR, BC, KB, NSR, NSC, TR: tl.constexpr, TC: tl.constexpr, IN_BF16: tl.constexpr
):
    """Partial amax of one TR x TC sub-tile of one (large) block, merged with an integer atomic max (exact and
    order-free: non-negative fp32 values order like their bit patterns). amax must start at +0."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    mb = pid0 // NSR
    kb = pid1 // NSC
    ri = (pid0 % NSR) * TR + tl.arange(0, TR)
    ci = (pid1 % NSC) * TC + tl.arange(0, TC)
    row = mb * BR + ri
    col = kb * BC + ci
    mask = ((ri < BR) & (row < M))[:, None] & ((ci < BC) & (col < K))[None, :]
    x = _load_x(x_ptr + row.to(tl.int64)[:, None] * K + col[None, :], mask, IN_BF16)
    m = _rmax(_rmax(tl.where(_isfinite(x), tl.abs(x), 0.0), 1), 0)
    tl.atomic_max(amax_bits_ptr + mb * KB + kb, m.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["index_base", "key"])  # bitcast below needs them as i32, never constexpr 1
def quant_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    amax_ptr,
    starts_ptr,
    offs_ptr,
    pbytes_ptr,
    nchunks,
    M,
    K,
    BR,
    BC,
    KB,
    index_base,
    key,
    counters_ptr,
    RSTEP: tl.constexpr,
    SEG: tl.constexpr,
    R: tl.constexpr,
    NB: tl.constexpr,
    SEGW: tl.constexpr,
    ROWS2D: tl.constexpr,
    FIT: tl.constexpr,
    SCALE_GIVEN: tl.constexpr,
    PACK: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    NCH_STEPS: tl.constexpr,
    K16: tl.constexpr,
    PADC: tl.constexpr,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_SUB: tl.constexpr,
    HAS_INF: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    POW2: tl.constexpr,
    MARGIN: tl.constexpr,
    MARGIN_MUL: tl.constexpr,
    FM_FRAC: tl.constexpr,
    FK: tl.constexpr,
    IN_BF16: tl.constexpr,
    HW: tl.constexpr,
    COUNT: tl.constexpr = False,
    SAT_LIMIT: tl.constexpr = 0.0,
):
    """Block amax + scale + round + store in one pass. PACK=False: codes [M, K], scales and amax [MB, KB] to
    their own tensors. PACK=True (1xB blocks): codes and wire scales into the chunked uint8 buffer, plus the
    zero padding of every chunk (program (0, 0)), so the buffer matches the reference byte for byte.
    COUNT: add this tile's [saturated, underflow, nonfinite] (reference.fit_counts) into counters_ptr (int64)."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    row, seg, col, rmask, mask = _coords(pid0, pid1, M, K, RSTEP, SEG, R, NB, SEGW)
    row64 = row.to(tl.int64)
    x = _load_x(x_ptr + (row64 * K)[:, None, None] + col, mask, IN_BF16)
    finite = _isfinite(x)  # one predicate for amax and encode

    if FIT:
        amax = _rmax(tl.where(finite, tl.abs(x), 0.0), 2)  # [R, NB]
        if ROWS2D:  # one block-row per program: the block spans the tile's rows too
            amax = tl.broadcast_to(_rmax(amax, 0)[None, :], (R, NB))
            brow = tl.full([R], 0, tl.int32) + pid0
            bmask = (tl.arange(0, R) == 0)[:, None] & (seg < KB)[None, :]
        else:
            brow = row
            bmask = rmask[:, None] & (seg < KB)[None, :]
        bidx = brow[:, None].to(tl.int64) * KB + seg[None, :]
        if SCALE_GIVEN:
            s = tl.load(scale_ptr + bidx, mask=bmask, other=1.0)
        else:
            s = _scale_from_amax(amax, FMAX, POW2, MARGIN, MARGIN_MUL, FM_FRAC, FK)
        s3 = s[:, :, None]
        r3 = s3
        if POW2:  # exact reciprocal of a power of two, once per block
            r3 = _recip_pow2(s)[:, :, None]
    else:
        bidx3 = (row64 // BR)[:, None, None] * KB + col // BC
        if SCALE_GIVEN:
            s3 = tl.load(scale_ptr + bidx3, mask=mask, other=1.0)
        else:
            s3 = _scale_from_amax(
                tl.load(amax_ptr + bidx3, mask=mask, other=0.0), FMAX, POW2, MARGIN, MARGIN_MUL, FM_FRAC, FK
            )
        r3 = s3
        if POW2:
            r3 = _recip_pow2(s3)
        first = mask & ((row % BR) == 0)[:, None, None] & ((col % BC) == 0)

    idx = None
    if STOCHASTIC:  # the SR counter is the element's flat index (+ index_base), mod 2**32
        idx = index_base.to(tl.uint32, bitcast=True) + row.to(tl.uint32)[:, None, None] * K + col.to(tl.uint32)
        key = key.to(tl.uint32, bitcast=True)
    codes = _encode(x, finite, s3, r3, idx, key, FMAX, MBITS, MIN_SUB, HAS_INF, STOCHASTIC, POW2, HW)
    if COUNT:  # the numerics guard's counts, from the registers this pass already holds
        live = finite & mask
        sat = live & (tl.abs(x) > s3 * SAT_LIMIT)
        under = live & (x != 0.0) & ((codes.to(tl.int32) & 0x7F) == 0)
        nonfin = mask & (finite == 0)
        tl.atomic_add(counters_ptr, _count3(sat))
        tl.atomic_add(counters_ptr + 1, _count3(under))
        tl.atomic_add(counters_ptr + 2, _count3(nonfin))

    if PACK:
        c = _chunk_of(row, starts_ptr, nchunks, NCH_STEPS)
        lr = (row - tl.load(starts_ptr + c, mask=rmask, other=0)).to(tl.int64)
        off = tl.load(offs_ptr + c, mask=rmask, other=0)
        pay = off + lr * K
        if K16:  # chunk offsets are 16-aligned, so rows start 16-aligned when K is: lets Triton vectorize
            pay = tl.multiple_of(pay, 16)
        tl.store(out_ptr + pay[:, None, None] + col, codes, mask=mask)
        sbase = off + tl.load(pbytes_ptr + c, mask=rmask, other=0) + lr * KB * SCALE_BYTES
        if FIT:
            _store_scale_bytes(out_ptr, sbase[:, None] + seg[None, :] * SCALE_BYTES, s, bmask, SCALE_BYTES)
        else:
            _store_scale_bytes(out_ptr, sbase[:, None, None] + (col // BC) * SCALE_BYTES, s3, first, SCALE_BYTES)
        if (pid0 == 0) & (pid1 == 0):
            zero = tl.full([PADC, 16], 0, tl.uint8)
            p = tl.arange(0, 16)[None, :]
            for c0 in range(0, nchunks, PADC):
                cc = c0 + tl.arange(0, PADC)
                cm = cc < nchunks
                nrow = (tl.load(starts_ptr + cc + 1, mask=cm, other=0) - tl.load(starts_ptr + cc, mask=cm, other=0)).to(
                    tl.int64
                )
                o = tl.load(offs_ptr + cc, mask=cm, other=0)
                o_end = tl.load(offs_ptr + cc + 1, mask=cm, other=0)
                pb = tl.load(pbytes_ptr + cc, mask=cm, other=0)
                pay_end = o + nrow * K
                sc_end = o + pb + nrow * KB * SCALE_BYTES
                tl.store(out_ptr + pay_end[:, None] + p, zero, mask=cm[:, None] & (p < (o + pb - pay_end)[:, None]))
                tl.store(out_ptr + sc_end[:, None] + p, zero, mask=cm[:, None] & (p < (o_end - sc_end)[:, None]))
    else:
        tl.store(out_ptr + (row64 * K)[:, None, None] + col, codes, mask=mask)
        if FIT:
            tl.store(amax_ptr + bidx, amax, mask=bmask)
            if not SCALE_GIVEN:
                tl.store(scale_ptr + bidx, s, mask=bmask)
        elif not SCALE_GIVEN:
            tl.store(scale_ptr + bidx3, s3, mask=first)


@triton.jit
def _load_tile(x_ptr, pid_m, pid_k, M, K, BM: tl.constexpr, BK: tl.constexpr, IN_BF16: tl.constexpr):
    """Rows [BM], cols [BK], their masks, the tile mask and the fp32 tile of a row-major [M, K] input."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    rmask = rows < M
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    x = _load_x(x_ptr + (rows.to(tl.int64) * K)[:, None] + cols[None, :], mask, IN_BF16)
    return rows, cols, rmask, cmask, mask, x


@triton.jit(do_not_specialize=["index_base", "key"])
def quant_tensor_t_kernel(
    x_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    amax_ptr,
    M,
    K,
    index_base,
    key,
    BM: tl.constexpr,
    BK: tl.constexpr,
    SCALE_GIVEN: tl.constexpr,
    WRITE_T: tl.constexpr,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_SUB: tl.constexpr,
    HAS_INF: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    POW2: tl.constexpr,
    MARGIN: tl.constexpr,
    MARGIN_MUL: tl.constexpr,
    FM_FRAC: tl.constexpr,
    FK: tl.constexpr,
    IN_BF16: tl.constexpr,
    HW: tl.constexpr,
):
    """Per-tensor quantization of one BM x BK tile with the one scale (given, or from the finished tensor amax),
    storing the codes [M, K] and, with WRITE_T, the same codes transposed into out_t [K, M] (what an FP8 GEMM
    contracting over M needs) from the same registers: one read of x for both layouts."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows, cols, rmask, cmask, mask, x = _load_tile(x_ptr, pid_m, pid_k, M, K, BM, BK, IN_BF16)
    rows64 = rows.to(tl.int64)
    finite = _isfinite(x)
    one = tl.arange(0, 1)
    if SCALE_GIVEN:
        s = tl.load(scale_ptr + one)
    else:  # every program derives the scale from the amax itself: no extra launch, same fp32 bits everywhere
        s = _scale_from_amax(tl.load(amax_ptr + one), FMAX, POW2, MARGIN, MARGIN_MUL, FM_FRAC, FK)
    s2 = tl.broadcast_to(s[:, None], (BM, BK))
    r2 = s2
    if POW2:
        r2 = _recip_pow2(s2)
    idx = None
    if STOCHASTIC:  # the SR counter is the element's flat index in [M, K] (+ index_base), as in quant_kernel
        idx = index_base.to(tl.uint32, bitcast=True) + rows.to(tl.uint32)[:, None] * K + cols.to(tl.uint32)[None, :]
        key = key.to(tl.uint32, bitcast=True)
    codes = _encode(x, finite, s2, r2, idx, key, FMAX, MBITS, MIN_SUB, HAS_INF, STOCHASTIC, POW2, HW)
    tl.store(out_ptr + (rows64 * K)[:, None] + cols[None, :], codes, mask=mask)
    if WRITE_T:
        tmask = cmask[:, None] & rmask[None, :]
        tl.store(out_t_ptr + (cols.to(tl.int64) * M)[:, None] + rows[None, :], tl.trans(codes), mask=tmask)
    if not SCALE_GIVEN:
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_ptr + one, s)


@triton.jit(do_not_specialize=["key"])
def quant_rowcol_kernel(
    x_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    scale_t_ptr,
    amax_ptr,
    amax_t_ptr,
    M,
    K,
    KB,
    MB,
    key,
    B: tl.constexpr,
    FMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_SUB: tl.constexpr,
    HAS_INF: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    POW2: tl.constexpr,
    MARGIN: tl.constexpr,
    MARGIN_MUL: tl.constexpr,
    FM_FRAC: tl.constexpr,
    FK: tl.constexpr,
    IN_BF16: tl.constexpr,
    HW: tl.constexpr,
):
    """1xB blocks both ways from one B x B tile of x: x along K (codes [M, K], scales [M, KB]) and x^T along M
    (codes_t [K, M], scales [K, MB]), i.e. quantize(x) and quantize(x.t()) (DeepSeek-V3's wgrad operands) with one
    read of x. Row blocks reduce over the tile's columns, column blocks over its rows."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows, cols, rmask, cmask, mask, x = _load_tile(x_ptr, pid_m, pid_k, M, K, B, B, IN_BF16)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    finite = _isfinite(x)
    ax = tl.where(finite, tl.abs(x), 0.0)
    amax_r = _rmax(ax, 1)  # [B]: one 1xB block of x per row
    amax_c = _rmax(ax, 0)  # [B]: one 1xB block of x^T per column
    s_r = _scale_from_amax(amax_r, FMAX, POW2, MARGIN, MARGIN_MUL, FM_FRAC, FK)
    s_c = _scale_from_amax(amax_c, FMAX, POW2, MARGIN, MARGIN_MUL, FM_FRAC, FK)
    s2 = tl.broadcast_to(s_r[:, None], (B, B))
    c2 = tl.broadcast_to(s_c[None, :], (B, B))
    r2 = s2
    rc2 = c2
    if POW2:
        r2 = _recip_pow2(s2)
        rc2 = _recip_pow2(c2)
    idx = None
    idx_t = None
    if STOCHASTIC:  # each layout's SR counter is the element's flat index in that layout: x [M, K], x^T [K, M]
        idx = rows.to(tl.uint32)[:, None] * K + cols.to(tl.uint32)[None, :]
        idx_t = cols.to(tl.uint32)[None, :] * M + rows.to(tl.uint32)[:, None]
        key = key.to(tl.uint32, bitcast=True)
    codes = _encode(x, finite, s2, r2, idx, key, FMAX, MBITS, MIN_SUB, HAS_INF, STOCHASTIC, POW2, HW)
    codes_t = _encode(x, finite, c2, rc2, idx_t, key, FMAX, MBITS, MIN_SUB, HAS_INF, STOCHASTIC, POW2, HW)
    tl.store(out_ptr + (rows64 * K)[:, None] + cols[None, :], codes, mask=mask)
    tl.store(out_t_ptr + (cols64 * M)[:, None] + rows[None, :], tl.trans(codes_t), mask=cmask[:, None] & rmask[None, :])
    tl.store(scale_ptr + rows64 * KB + pid_k, s_r, mask=rmask)
    tl.store(amax_ptr + rows64 * KB + pid_k, amax_r, mask=rmask)
    tl.store(scale_t_ptr + cols64 * MB + pid_m, s_c, mask=cmask)
    tl.store(amax_t_ptr + cols64 * MB + pid_m, amax_c, mask=cmask)


@triton.jit
def dequant_kernel(
    src_ptr,
    scale_ptr,
    out_ptr,
    starts_ptr,
    offs_ptr,
    pbytes_ptr,
    nchunks,
    chunk_stride,
    M,
    K,
    BR,
    BC,
    KB,
    x_ptr,
    x_stride,
    out_stride,
    RSTEP: tl.constexpr,
    SEG: tl.constexpr,
    R: tl.constexpr,
    NB: tl.constexpr,
    SEGW: tl.constexpr,
    ROWS2D: tl.constexpr,
    FIT: tl.constexpr,
    MODE: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    NCH_STEPS: tl.constexpr,
    K16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_SUB_MUL: tl.constexpr,
    HAS_INF: tl.constexpr,
    HW: tl.constexpr,
    IN_BF16: tl.constexpr = False,
):
    """code * scale in fp32, stored as out's dtype. MODE 0: codes [M, K] + fp32 scales [MB, KB] (any block shape).
    MODE 1: every chunk of a wire buffer -> out [M, K]. MODE 2: `nchunks` equal chunks (stride chunk_stride bytes,
    M rows each, payload bytes pbytes[0]) summed in chunk order from +0.0 -> fp32 out [M, K]. MODE 3: as MODE 1,
    then error feedback's residual x - decoded (x fp32 or bf16, row stride x_stride) into fp32 out (row stride
    out_stride), non-finite differences 0. Launch without FMA contraction. Byte offsets are int64 (a packed buffer
    passes 2 GiB long before one chunk does)."""
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    row, seg, col, rmask, mask = _coords(pid0, pid1, M, K, RSTEP, SEG, R, NB, SEGW)
    row64 = row.to(tl.int64)
    if FIT:
        bmask = rmask[:, None] & (seg < KB)[None, :]
    if MODE == 0:
        code = tl.load(src_ptr + (row64 * K)[:, None, None] + col, mask=mask, other=0)
        if FIT:
            if ROWS2D:
                brow = tl.full([R], 0, tl.int64) + pid0
            else:
                brow = row64
            s = tl.load(scale_ptr + brow[:, None] * KB + seg[None, :], mask=bmask, other=1.0)[:, :, None]
        else:
            s = tl.load(scale_ptr + (row64 // BR)[:, None, None] * KB + col // BC, mask=mask, other=1.0)
        v = _decode(code, MBITS, BIAS, MIN_SUB_MUL, HAS_INF, HW) * s
    else:
        if MODE == 1 or MODE == 3:
            c = _chunk_of(row, starts_ptr, nchunks, NCH_STEPS)
            lr = (row - tl.load(starts_ptr + c, mask=rmask, other=0)).to(tl.int64)
            base = tl.load(offs_ptr + c, mask=rmask, other=0)
            pb = tl.load(pbytes_ptr + c, mask=rmask, other=0)
            n_src = 1
        else:
            lr = row64
            base = tl.full([R], 0, tl.int64)
            pb = base + tl.load(pbytes_ptr)
            n_src = nchunks
        v = tl.full([R, NB, SEGW], 0, tl.float32)  # +0.0, like the reference's out.zero_()
        cb = base  # int64, advanced by chunk_stride per chunk: ci * chunk_stride in int32 wraps past 2 GiB
        for _ci in range(0, n_src):
            pay = cb + lr * K
            if K16:
                pay = tl.multiple_of(pay, 16)
            code = tl.load(src_ptr + pay[:, None, None] + col, mask=mask, other=0)
            sbase = cb + pb + lr * KB * SCALE_BYTES
            if FIT:
                s = _scale_from_bytes(src_ptr, sbase[:, None] + seg[None, :] * SCALE_BYTES, bmask, SCALE_BYTES)[
                    :, :, None
                ]
            else:
                s = _scale_from_bytes(src_ptr, sbase[:, None, None] + (col // BC) * SCALE_BYTES, mask, SCALE_BYTES)
            q = _decode(code, MBITS, BIAS, MIN_SUB_MUL, HAS_INF, HW) * s
            if MODE != 2:
                v = q
            else:
                v = v + q
            cb = cb + chunk_stride
    if MODE == 3:
        d = _load_x(x_ptr + (row64 * x_stride)[:, None, None] + col, mask, IN_BF16) - v
        v = tl.where(_isfinite(d), d, 0.0)
        dst = out_ptr + (row64 * out_stride)[:, None, None] + col
    else:
        dst = out_ptr + (row64 * K)[:, None, None] + col
    if OUT_BF16:
        tl.store(dst, _bf16_bits(v), mask=mask)
    else:
        tl.store(dst, v, mask=mask)
