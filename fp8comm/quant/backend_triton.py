"""Triton backend: backend_reference's interface on the fused kernels of triton_kernels.py, bit-exact with it.

Runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (slow: there tiles grow so programs are few).
NaN payload bits of float outputs are whatever the hardware's fp32 multiply/add give (x86 keeps the operand's,
CUDA returns the canonical NaN); which elements are NaN, and every other bit, match the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from ..errors import Fp8CommError, Fp8CommTypeError
from . import reference as ref
from . import triton_kernels as tk
from .formats import Fp8Format
from .layout import ChunkLayout
from .scaling import Scaling, scale_from_amax
from .triton_launch import (  # noqa: F401 (LAUNCHED, _TABLES: read through this module by tools and tests)
    _TABLES,
    LAUNCHED,
    _cdiv,
    _i32,
    _interpreting,
    _p2,
    _p2_floor,
    chunk_tables,
    launch,
)

name = "triton"

# CUDA: ~4K elements per program (8 KiB of bf16) gives memory-bound kernels many programs in flight; blocks of up
# to GPU_FIT elements (128x128) are reduced inside one program, larger ones take the two-pass path.
GPU_TILE = 4096
GPU_FIT = 16384
GPU_WARPS = None  # None: from the tile size (see _Plan.num_warps); launch/device_check.py sweeps it
# The interpreter pays per program, not per element: one big tile. Tests lower INTERP_FIT to reach the two-pass path.
INTERP_TILE = 1 << 16
INTERP_FIT = 1 << 16
# quantize_2d_t (per tensor, codes + transposed codes): rows x cols of x per program, and warps. (32, 128) x 4 was
# the fastest of 12 tiles in launch/profile_fp8linear.py --sweep (docs/benchmarks.md, GEMMs)
GPU_T_TILE = (32, 128)
GPU_T_WARPS = 4
ROWCOL_MAX_BLOCK = 128  # quantize_2d_rowcol: one B x B tile per program
MAX_GRID_1 = 65535  # CUDA's limit on grid dimension 1

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _hw(device: torch.device) -> bool:
    """Use the hardware fp8 conversions (compiled, sm_90+): single-rounding RTNE fp32->fp8, exact fp8->fp32.
    Verified bit-exact on an H200; sm_89 has a double-rounding report (platform.md), so it keeps the integer path
    that the interpreter uses (the interpreter's own fp8 casts are wrong)."""
    if _interpreting() or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@dataclass(frozen=True)
class _Plan:
    """Tile geometry for an [m, k] view with br x bc blocks: see triton_kernels' module docstring."""

    fit: bool
    rows2d: bool
    rstep: int
    seg: int
    r: int
    nb: int
    segw: int
    grid: tuple

    def meta(self) -> dict:
        return dict(
            RSTEP=self.rstep, SEG=self.seg, R=self.r, NB=self.nb, SEGW=self.segw, ROWS2D=self.rows2d, FIT=self.fit
        )

    @property
    def num_warps(self) -> int:
        if GPU_WARPS and not _interpreting():
            return GPU_WARPS
        return min(8, max(1, self.r * self.nb * self.segw // 1024))


def _limits() -> tuple[int, int]:
    return (INTERP_TILE, INTERP_FIT) if _interpreting() else (GPU_TILE, GPU_FIT)


def plan(m: int, k: int, br: int, bc: int) -> _Plan:
    # host time per launch matters for small collectives: plans are cached (the limits are part of the key)
    return _plan_cached(m, k, br, bc, *_limits())


@lru_cache(maxsize=1024)
def _plan_cached(m: int, k: int, br: int, bc: int, tile: int, fit_limit: int) -> _Plan:
    if k >= 1 << 31:  # column indices inside a row are int32 (row and byte offsets are int64)
        raise Fp8CommError(f"triton backend: rows of {k} elements (>= 2^31) are not supported; split the row")
    if _p2(br) * _p2(bc) <= fit_limit:
        seg, segw = bc, _p2(bc)
        nseg = _cdiv(k, seg)
        if br > 1:  # one block-row per program
            r, rstep = _p2(br), br
            nb = max(1, min(_p2(nseg), _p2_floor(tile // (r * segw))))
        else:
            nb = max(1, min(_p2(nseg), _p2_floor(tile // segw)))
            r = max(1, min(_p2(m), _p2_floor(tile // (nb * segw))))
            rstep = r
        fit, rows2d = True, br > 1
    else:  # blocks larger than a tile: amax from amax_kernel, the tile is just a window
        segw = min(_p2(k), tile)
        seg, nseg, nb, fit, rows2d = segw, _cdiv(k, segw), 1, False, False
        r = rstep = max(1, min(_p2(m), tile // segw))
    while _cdiv(nseg, nb) > MAX_GRID_1:
        nb *= 2
    return _Plan(fit, rows2d, rstep, seg, r, nb, segw, (_cdiv(m, rstep), _cdiv(nseg, nb)))


@lru_cache(maxsize=256)
def _quant_meta(fmt: Fp8Format, scaling: Scaling, rounding: str) -> dict:
    fm, fk = math.frexp(fmt.max)
    return dict(
        FMAX=float(fmt.max),
        MBITS=fmt.mantissa_bits,
        MIN_SUB=fmt.min_subnormal_exp,
        HAS_INF=fmt.has_inf,
        STOCHASTIC=rounding == "stochastic",
        POW2=scaling.encoding != "fp32",
        MARGIN=scaling.margin,
        MARGIN_MUL=float(2.0**scaling.margin),
        FM_FRAC=int((2 * fm - 1) * 2**23),
        FK=fk,
    )


def decode_meta(fmt: Fp8Format, device: torch.device) -> dict:
    return dict(_fmt_meta(fmt), HW=_hw(device))


@lru_cache(maxsize=16)
def _fmt_meta(fmt: Fp8Format) -> dict:
    return dict(
        MBITS=fmt.mantissa_bits,
        BIAS=1 - fmt.min_normal_exp,
        MIN_SUB_MUL=float(2.0**fmt.min_subnormal_exp),
        HAS_INF=fmt.has_inf,
    )


def _as_input(x2: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(contiguous kernel input, IN_BF16): under the interpreter bf16 travels as its int16 bits (its bf16 upcast
    loses subnormals); fp32/fp16 (and bf16 when compiled) load natively, exactly; others go through .float()."""
    x = x2 if x2.dtype in (torch.float32, torch.bfloat16, torch.float16) else x2.float()
    x = x.contiguous()
    if x.dtype == torch.bfloat16 and _interpreting():
        return x.view(torch.int16), True
    return x, False


def _out_target(out: torch.Tensor):
    """(contiguous tensor the kernel writes, its view for the kernel, OUT_BF16)."""
    if out.dtype not in _OUT_DTYPES:
        raise Fp8CommTypeError(f"triton backend: output dtype must be one of {_OUT_DTYPES}, got {out.dtype}")
    o = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    # the interpreter's fp32->bf16 cast truncates: there the kernel rounds in integers and stores int16 bits
    bf16 = o.dtype == torch.bfloat16 and _interpreting()
    return o, (o.view(torch.int16) if bf16 else o), bf16


def _amax_big(x: torch.Tensor, bf16: bool, amax: torch.Tensor, m: int, k: int, br: int, bc: int) -> None:
    """Block amax for blocks larger than a tile, into zero-initialised fp32 amax [mb, kb]."""
    tile, _ = _limits()
    mb, kb = amax.shape
    tc = min(_p2(bc), tile)
    tr = max(1, min(_p2(br), tile // tc))
    # a single block-row or block-column never needs sub-tiles beyond the tensor's edge
    nsr = _cdiv(min(br, m) if mb == 1 else br, tr)
    nsc = _cdiv(min(bc, k) if kb == 1 else bc, tc)
    if kb * nsc > MAX_GRID_1:
        raise Fp8CommError(
            f"triton backend: {kb * nsc} column tiles exceed CUDA's grid limit; use the reference backend"
        )
    launch(
        tk.amax_kernel,
        (mb * nsr, kb * nsc),
        x,
        amax.view(torch.int32),
        m,
        k,
        br,
        bc,
        kb,
        nsr,
        nsc,
        TR=tr,
        TC=tc,
        IN_BF16=bf16,
        writes=(amax,),
        num_warps=min(8, max(1, tr * tc // 1024)),
    )


def quantize_2d(
    x2: torch.Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    rounding: str = "nearest",
    seed: int = 0,
    scale: torch.Tensor | None = None,
    index_base: int = 0,
):
    """reference.quantize_2d: (uint8 codes [M, K], fp32 scales [mb, kb], fp32 block amax [mb, kb])."""
    if scaling.rows is None and scaling.cols is None:  # one scale: a plain elementwise pass after the amax
        codes, _, s, amax = quantize_2d_t(x2, fmt, scaling, rounding, seed, scale, index_base, transposed=False)
        return codes, s, amax
    m, k = x2.shape
    br, bc = scaling.block_shape(m, k)
    mb, kb = scaling.scale_shape(m, k)
    dev = x2.device
    codes = torch.empty(m, k, dtype=torch.uint8, device=dev)
    amax = torch.zeros(mb, kb, dtype=torch.float32, device=dev)
    if m == 0 or k == 0:
        return codes, (scale if scale is not None else scale_from_amax(amax, fmt, scaling)), amax
    x, bf16 = _as_input(x2)
    given = scale is not None
    s_out = (
        scale.to(dev, torch.float32).contiguous()
        if scale is not None
        else torch.empty(mb, kb, dtype=torch.float32, device=dev)
    )
    p = plan(m, k, br, bc)
    if not p.fit:
        _amax_big(x, bf16, amax, m, k, br, bc)
    key = ref.seed_key(seed) if rounding == "stochastic" else 0
    launch(
        tk.quant_kernel,
        p.grid,
        x,
        codes,
        s_out,
        amax,
        codes,
        codes,
        codes,
        0,
        m,
        k,
        br,
        bc,
        kb,
        _i32(index_base),
        _i32(key),
        codes,
        SCALE_GIVEN=given,
        PACK=False,
        SCALE_BYTES=4,
        NCH_STEPS=0,
        K16=k % 16 == 0,
        PADC=1,
        IN_BF16=bf16,
        HW=_hw(dev),
        writes=(codes, amax) if given else (codes, amax, s_out),
        num_warps=p.num_warps,
        **p.meta(),
        **_quant_meta(fmt, scaling, rounding),
    )
    return codes, (scale if given else s_out), amax


def quantize_2d_t(
    x2: torch.Tensor,
    fmt: Fp8Format,
    scaling: Scaling,
    rounding: str = "nearest",
    seed: int = 0,
    scale: torch.Tensor | None = None,
    index_base: int = 0,
    transposed: bool = True,
):
    """Per-tensor quantize_2d plus the codes transposed, in one pass over x: (codes [M, K], codes^T [K, M]
    contiguous (codes again when not `transposed`), fp32 scale [1, 1], fp32 amax [1, 1]). The tensor amax is
    one read of x before it."""
    if scaling.rows is not None or scaling.cols is not None:
        raise Fp8CommError(f"quantize_2d_t is per tensor only, got {scaling.describe()} blocks")
    m, k = x2.shape
    dev = x2.device
    codes = torch.empty(m, k, dtype=torch.uint8, device=dev)
    codes_t = torch.empty(k, m, dtype=torch.uint8, device=dev) if transposed else codes
    amax = torch.zeros(1, 1, dtype=torch.float32, device=dev)
    if m == 0 or k == 0:
        return codes, codes_t, (scale if scale is not None else scale_from_amax(amax, fmt, scaling)), amax
    x, bf16 = _as_input(x2)
    given = scale is not None
    s_out = (
        scale.to(dev, torch.float32).contiguous()
        if scale is not None
        else torch.empty(1, 1, dtype=torch.float32, device=dev)
    )
    _amax_big(x, bf16, amax, m, k, m, k)
    if _interpreting():  # the interpreter pays per program: one tile of up to INTERP_TILE elements
        bk = min(_p2(k), INTERP_TILE)
        bm = max(1, min(_p2(m), INTERP_TILE // bk))
        warps = 4
    else:
        bm, bk = GPU_T_TILE
        warps = GPU_T_WARPS
    if _cdiv(k, bk) > MAX_GRID_1:
        raise Fp8CommError(f"triton backend: {k} columns need {_cdiv(k, bk)} column tiles, over CUDA's grid limit")
    key = ref.seed_key(seed) if rounding == "stochastic" else 0
    launch(
        tk.quant_tensor_t_kernel,
        (_cdiv(m, bm), _cdiv(k, bk)),
        x,
        codes,
        codes_t,
        s_out,
        amax,
        m,
        k,
        _i32(index_base),
        _i32(key),
        BM=bm,
        BK=bk,
        SCALE_GIVEN=given,
        WRITE_T=transposed,
        IN_BF16=bf16,
        HW=_hw(dev),
        writes=(codes, codes_t) if given else (codes, codes_t, s_out),
        num_warps=warps,
        **_quant_meta(fmt, scaling, rounding),
    )
    return codes, codes_t, (scale if given else s_out), amax


def rowcol_supported(scaling: Scaling) -> bool:
    """quantize_2d_rowcol takes 1xB blocks, B a power of two in [16, ROWCOL_MAX_BLOCK]."""
    b = scaling.cols
    return scaling.rows == 1 and b is not None and 16 <= b <= ROWCOL_MAX_BLOCK and not b & (b - 1)


def quantize_2d_rowcol(x2: torch.Tensor, fmt: Fp8Format, scaling: Scaling, rounding: str = "nearest", seed: int = 0):
    """quantize_2d(x2) and quantize_2d(x2.t()) with 1 x B blocks (B = scaling.cols <= ROWCOL_MAX_BLOCK, power of
    two), both from one read of x2: (codes, scale, amax) of x2 [M, K], then of x2^T [K, M] (contiguous)."""
    if not rowcol_supported(scaling):
        raise Fp8CommError(
            f"quantize_2d_rowcol takes 1xB blocks, B a power of two in [16, {ROWCOL_MAX_BLOCK}], "
            f"got {scaling.describe()}"
        )
    m, k = x2.shape
    b = scaling.cols
    assert b is not None  # rowcol_supported
    kb, mb = _cdiv(k, b), _cdiv(m, b)
    dev = x2.device
    codes = torch.empty(m, k, dtype=torch.uint8, device=dev)
    codes_t = torch.empty(k, m, dtype=torch.uint8, device=dev)
    s, a = (torch.empty(m, kb, dtype=torch.float32, device=dev) for _ in range(2))
    s_t, a_t = (torch.empty(k, mb, dtype=torch.float32, device=dev) for _ in range(2))
    if m and k:
        x, bf16 = _as_input(x2)
        key = ref.seed_key(seed) if rounding == "stochastic" else 0
        launch(
            tk.quant_rowcol_kernel,
            (mb, kb),
            x,
            codes,
            codes_t,
            s,
            s_t,
            a,
            a_t,
            m,
            k,
            kb,
            mb,
            _i32(key),
            B=b,
            IN_BF16=bf16,
            HW=_hw(dev),
            writes=(codes, codes_t, s, a, s_t, a_t),
            num_warps=min(8, max(1, b * b // 2048)),
            **_quant_meta(fmt, scaling, rounding),
        )
    return (codes, s, a), (codes_t, s_t, a_t)


def dequantize_2d(
    codes: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, scaling: Scaling, out_dtype: torch.dtype
) -> torch.Tensor:
    """reference.dequantize_2d(...).to(out_dtype): codes [M, K] times their block scales."""
    m, k = codes.shape
    out = torch.empty(m, k, dtype=out_dtype, device=codes.device)
    if m == 0 or k == 0:
        return out
    br, bc = scaling.block_shape(m, k)
    _, kb = scaling.scale_shape(m, k)
    c = (codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)).contiguous()
    s = scale.to(codes.device, torch.float32).contiguous()
    o, ov, bf16 = _out_target(out)
    p = plan(m, k, br, bc)
    launch(
        tk.dequant_kernel,
        p.grid,
        c,
        s,
        ov,
        c,
        c,
        c,
        0,
        0,
        m,
        k,
        br,
        bc,
        kb,
        c,
        0,
        0,
        MODE=0,
        SCALE_BYTES=4,
        NCH_STEPS=0,
        K16=k % 16 == 0,
        OUT_BF16=bf16,
        writes=(o,),
        num_warps=p.num_warps,
        **p.meta(),
        **decode_meta(fmt, c.device),
    )
    return o


def pack_chunks(
    x2: torch.Tensor,
    layout: ChunkLayout,
    fmt: Fp8Format,
    rounding: str,
    seed: int,
    out: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch: block amax, scale, rounding, payload + wire scales + zeroed padding into `out` (1xB blocks).
    Blocks wider than a tile (cols=None on very wide rows) add one amax launch before it. counters: the guard's
    counts are added by the same launch (three atomics per program)."""
    m, k = layout.total_rows, layout.k
    if layout.total_bytes == 0:
        return out
    x, bf16 = _as_input(x2)
    dev = x.device
    starts, offs, pbytes = chunk_tables(layout, dev)
    n, bc, kb = len(layout.rows), layout.block, layout.kb
    p = plan(m, k, 1, bc)
    amax = starts
    if not p.fit:
        amax = torch.zeros(m, kb, dtype=torch.float32, device=dev)
        _amax_big(x, bf16, amax, m, k, 1, bc)
    key = ref.seed_key(seed) if rounding == "stochastic" else 0
    launch(
        tk.quant_kernel,
        p.grid,
        x,
        out,
        starts,
        amax,
        starts,
        offs,
        pbytes,
        n,
        m,
        k,
        1,
        bc,
        kb,
        0,
        _i32(key),
        counters if counters is not None else starts,
        COUNT=counters is not None,
        SAT_LIMIT=ref.saturation_limit(fmt),
        SCALE_GIVEN=False,
        PACK=True,
        SCALE_BYTES=layout.scaling.scale_bytes,
        NCH_STEPS=(n - 1).bit_length(),
        K16=k % 16 == 0,
        PADC=min(_p2(n), 64),
        IN_BF16=bf16,
        HW=_hw(dev),
        writes=(out,) if counters is None else (out, counters),
        num_warps=p.num_warps,
        **p.meta(),
        **_quant_meta(fmt, layout.scaling, rounding),
    )
    return out


def unpack_chunks(buf: torch.Tensor, layout: ChunkLayout, fmt: Fp8Format, out: torch.Tensor) -> torch.Tensor:
    """Dequantize every chunk of the wire buffer into out [M, K] (out's dtype)."""
    m, k = layout.total_rows, layout.k
    if m == 0 or k == 0:
        return out
    o, ov, bf16 = _out_target(out)
    _decode_chunks(buf, layout, fmt, o, ov, 1, out_bf16=bf16)
    if o is not out:
        out.copy_(o)
    return out


def residual_chunks(
    buf: torch.Tensor, layout: ChunkLayout, fmt: Fp8Format, x: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Error feedback's residual in one launch from the wire buffer: fp32 out [M, K] = x - every chunk decoded,
    non-finite differences 0 (x fp32 or bf16 [M, K]; rows of either may be strided, columns contiguous)."""
    m, k = layout.total_rows, layout.k
    if x.shape != (m, k) or out.shape != (m, k) or out.dtype != torch.float32:
        raise Fp8CommError(f"residual_chunks: x {tuple(x.shape)}, out {tuple(out.shape)} {out.dtype} vs {(m, k)} fp32")
    if m == 0 or k == 0:
        return out
    o = out if out.stride(1) == 1 else torch.empty(m, k, dtype=torch.float32, device=out.device)
    xs = x if x.stride(1) == 1 else x.contiguous()
    bf16 = xs.dtype == torch.bfloat16
    _decode_chunks(buf, layout, fmt, o, o, 3, xs.view(torch.int16) if bf16 else xs, xs.stride(0), in_bf16=bf16)
    if o is not out:
        out.copy_(o)
    return out


def _decode_chunks(buf, layout, fmt, o, ov, mode: int, x=None, x_stride=0, out_bf16=False, in_bf16=False) -> None:
    """dequant_kernel over every chunk of `buf` (MODE 1: decode into ov; MODE 3: the residual against x)."""
    m, k = layout.total_rows, layout.k
    starts, offs, pbytes = chunk_tables(layout, buf.device)
    n = len(layout.rows)
    p = plan(m, k, 1, layout.block)
    launch(
        tk.dequant_kernel,
        p.grid,
        buf,
        buf,
        ov,
        starts,
        offs,
        pbytes,
        n,
        0,
        m,
        k,
        1,
        layout.block,
        layout.kb,
        buf if x is None else x,
        x_stride,
        o.stride(0),
        MODE=mode,
        SCALE_BYTES=layout.scaling.scale_bytes,
        NCH_STEPS=(n - 1).bit_length(),
        K16=k % 16 == 0,
        writes=(o,),
        num_warps=p.num_warps,
        OUT_BF16=out_bf16,
        IN_BF16=in_bf16,
        **p.meta(),
        **decode_meta(fmt, buf.device),
    )


def unpack_sum(buf: torch.Tensor, layout: ChunkLayout, fmt: Fp8Format, out: torch.Tensor) -> torch.Tensor:
    """Sum of the dequantized equal chunks in fp32, chunk 0 first, from +0.0 (no FMA): fp32 out [rows, K]."""
    n, k = len(layout.rows), layout.k
    rows = layout.rows[0] if n else 0
    if n == 0 or rows == 0 or k == 0:
        return out.zero_()
    _, _, pbytes = chunk_tables(layout, buf.device)
    o, ov, _ = _out_target(out)
    p = plan(rows, k, 1, layout.block)
    launch(
        tk.dequant_kernel,
        p.grid,
        buf,
        buf,
        ov,
        pbytes,
        pbytes,
        pbytes,
        n,
        layout.chunk_bytes[0],
        rows,
        k,
        1,
        layout.block,
        layout.kb,
        buf,
        0,
        0,
        MODE=2,
        SCALE_BYTES=layout.scaling.scale_bytes,
        NCH_STEPS=0,
        K16=k % 16 == 0,
        OUT_BF16=False,
        writes=(o,),
        num_warps=p.num_warps,
        **p.meta(),
        **decode_meta(fmt, buf.device),
    )
    if o is not out:
        out.copy_(o)
    return out
