"""Triton block-scaled FP8 GEMM: out = a @ b.T with fp32 promotion of each K block (DeepSeek-V3 style).

One kernel covers every scale layout through strides: a scale is read at [row // ROWS_PER_SCALE, k_block] of its
operand, with stride 0 along a dimension where the scale does not vary (per tensor, per row). The K tile equals
the scale block along K (128 for blockwise, 32 for MX), so each tile's partial product is scaled by exactly one
scale per row of a and per row of b before it joins the fp32 accumulator. Runs on CUDA, or on CPU tensors under
TRITON_INTERPRET=1 (slowly: tests use small shapes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..errors import Fp8CommError, Fp8CommNotImplementedError
from ..quant import Fp8Tensor
from .operands import check_operands, row_scales

# Tile configs on CUDA by K tile: >= 64 (per-tensor, rows, 128-blocks) and < 64 (MX 1x32). From a sweep of 16
# configs at 8192^3 (launch/profile_fp8linear.py --sweep-gemm; the table and its date: docs/benchmarks.md, GEMMs).
GPU_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)
GPU_CONFIG_SMALL_K = dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3)


@triton.jit
def _block_scaled_gemm(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_sam,
    stride_sak,
    stride_sbn,
    stride_sbk,
    SA_ROWS: tl.constexpr,
    SB_ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grouped order: GROUP_M row tiles sweep the column tiles together, so their a and b tiles are reused from L2
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    # row offsets in int64, once per tile: rm * stride_am passes 2^31 at 131k tokens x 16k features
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        mask_k = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # mixed e4m3 x e5m2: every FP8 value is exact in fp16 (E5M2 is its top byte): products stay exact
            part = tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
        else:
            part = tl.dot(a, b, out_dtype=tl.float32)
        sa = tl.load(sa_ptr + (rm // SA_ROWS) * stride_sam + kb * stride_sak, mask=mask_m, other=1.0)
        sb = tl.load(sb_ptr + (rn // SB_ROWS) * stride_sbn + kb * stride_sbk, mask=mask_n, other=1.0)
        acc += part * sa[:, None] * sb[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _scale_args(q: Fp8Tensor, kblock: int) -> tuple[torch.Tensor, int, int, int]:
    """(scale tensor, stride over row groups, stride over K tiles, rows per scale) for the kernel."""
    r, k = q.shape
    br, bc = q.scaling.block_shape(r, k)
    s = q.scale.float()
    if bc % kblock and bc < k:
        raise Fp8CommError(f"scale block {bc} along K is not a multiple of the K tile {kblock}")
    # a scale column covers bc // kblock K tiles; stride 0 when one scale spans all of K
    s_k = 0 if s.shape[1] == 1 else s.stride(1)
    if s_k and bc != kblock:
        s = s.repeat_interleave(bc // kblock, 1).contiguous()
        s_k = s.stride(1)
    s_r = 0 if s.shape[0] == 1 else s.stride(0)
    return s, s_r, s_k, (1 if s.shape[0] == 1 else br)


def triton_gemm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    out_dtype: torch.dtype = torch.float32,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """a @ b.T for FP8 operands with any scale layout whose K blocks are multiples of 16 (or span all of K)."""
    check_operands(a, b)
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.data.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _, ca = row_scales(a)
    _, cb = row_scales(b)
    kblock = min(min(ca, k), min(cb, k))
    if ca >= k and cb >= k:  # scales constant along K: any tile works
        kblock = 128
    if kblock < 16 or (kblock & (kblock - 1)):
        raise Fp8CommNotImplementedError(f"Triton GEMM needs power-of-two K blocks >= 16, got {kblock}")
    sa, sa_r, sa_k, ra = _scale_args(a, kblock)
    sb, sb_r, sb_k, rb = _scale_args(b, kblock)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = (
        dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8) if interp else dict(GPU_CONFIG if kblock >= 64 else GPU_CONFIG_SMALL_K)
    )
    if block_m:
        cfg["BLOCK_M"] = block_m
    if block_n:
        cfg["BLOCK_N"] = block_n
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _block_scaled_gemm[grid](
        a.data,
        b.data,
        out,
        sa,
        sb,
        m,
        n,
        k,
        a.data.stride(0),
        a.data.stride(1),
        b.data.stride(0),
        b.data.stride(1),
        out.stride(0),
        out.stride(1),
        sa_r,
        sa_k,
        sb_r,
        sb_k,
        SA_ROWS=ra,
        SB_ROWS=rb,
        UPCAST=a.fmt.name != b.fmt.name,
        BLOCK_K=kblock,
        **cfg,
    )
    torch.autograd.graph.increment_version(out)  # an out-of-band write: bump the version as a torch op would
    return out
