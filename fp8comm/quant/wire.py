"""The packed wire format: rows of an [M, K] tensor cut into destination chunks, each ONE contiguous uint8 section.

Chunk c holds rows[c] consecutive rows: FP8 payload (rows x K bytes), then their 1xB block scales (4 bytes, or one
E8M0 byte, each), both sections 16-byte aligned. Reduce-scatter and all-gather use a flat buffer viewed as
[chunks, L]; MoE dispatch uses tokens [T, H] with one chunk per destination rank.
"""

from __future__ import annotations

import torch

from ..errors import Fp8CommError
from .dispatch import resolve_backend
from .formats import Fp8Format
from .layout import ChunkLayout, Chunks, decode_scales, layout_of

__all__ = ["ChunkLayout", "layout_of", "pack_chunks", "unpack_chunks", "unpack_sum", "unpack_codes"]


def pack_chunks(
    x2: torch.Tensor,
    layout: ChunkLayout,
    fmt: Fp8Format,
    rounding: str = "nearest",
    seed: int = 0,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x2 [M, K] (M = layout.total_rows) and write every chunk into one uint8 buffer (fused on GPU).

    counters: an int64 [3] tensor on x2's device; the kernels add [saturated, underflow, nonfinite] into it
    (reference.fit_counts defines them; the numerics guard reads them)."""
    if x2.dim() != 2 or tuple(x2.shape) != (layout.total_rows, layout.k):
        raise Fp8CommError(f"pack_chunks: input shape {tuple(x2.shape)} != layout {(layout.total_rows, layout.k)}")
    if out is None:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=x2.device)
    elif out.dtype != torch.uint8 or out.numel() < layout.total_bytes or not out.is_contiguous():
        raise Fp8CommError(f"pack_chunks: out must be contiguous uint8 with >= {layout.total_bytes} bytes")
    if counters is not None and (
        counters.dtype != torch.int64 or tuple(counters.shape) != (3,) or counters.device != x2.device
    ):
        raise Fp8CommError(
            f"pack_chunks: counters must be int64 [3] on {x2.device}, got {counters.dtype} "
            f"{tuple(counters.shape)} on {counters.device}"
        )
    return resolve_backend(backend, x2.device, x2.numel()).pack_chunks(x2, layout, fmt, rounding, seed, out, counters)


def unpack_chunks(
    buf: torch.Tensor,
    layout: ChunkLayout,
    fmt: Fp8Format,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Dequantize every chunk of `buf` back into one [M, K] tensor of `dtype`."""
    _check_buf(buf, layout)
    if out is None:
        out = torch.empty(layout.total_rows, layout.k, dtype=dtype, device=buf.device)
    return resolve_backend(backend, buf.device, buf.numel()).unpack_chunks(buf, layout, fmt, out)


def unpack_sum(
    buf: torch.Tensor, layout: ChunkLayout, fmt: Fp8Format, out: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Dequantize N equal chunks and sum them in fp32, in chunk order (the receive side of a reduce-scatter)."""
    _check_buf(buf, layout)
    if len(set(layout.rows)) > 1:
        raise Fp8CommError(f"unpack_sum needs equal chunks, got rows {layout.rows}")
    rows = layout.rows[0] if layout.rows else 0
    if out is None:
        out = torch.empty(rows, layout.k, dtype=torch.float32, device=buf.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, layout.k):
        raise Fp8CommError(f"unpack_sum: out must be fp32 {(rows, layout.k)}")
    return resolve_backend(backend, buf.device, buf.numel()).unpack_sum(buf, layout, fmt, out)


def unpack_codes(buf: torch.Tensor, layout: ChunkLayout, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The FP8-out receive side: copy every chunk's codes into `codes` (uint8 [M, K]) and its decoded fp32 scales
    into `scales` ([M, kb]); nothing is dequantized. Outputs may be strided views (one piece of a bigger tensor)."""
    _check_buf(buf, layout)
    m, k, kb = layout.total_rows, layout.k, layout.kb
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (m, k):
        raise Fp8CommError(f"unpack_codes: codes must be uint8 {(m, k)}, got {codes.dtype} {tuple(codes.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (m, kb):
        raise Fp8CommError(f"unpack_codes: scales must be fp32 {(m, kb)}, got {scales.dtype} {tuple(scales.shape)}")
    for c, rows in enumerate(layout.rows):
        if not rows:
            continue
        o, r0, pb = layout.offsets[c], layout.row_starts[c], layout.payload_bytes(c)
        codes[r0 : r0 + rows] = buf[o : o + rows * k].view(rows, k)
        nsb = rows * kb * layout.scaling.scale_bytes
        scales[r0 : r0 + rows] = decode_scales(buf[o + pb : o + pb + nsb], layout.scaling).view(rows, kb)


def _check_buf(buf: torch.Tensor, layout: Chunks) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < layout.total_bytes:
        raise Fp8CommError(
            f"wire buffer must be 1-D uint8 with >= {layout.total_bytes} bytes, got {buf.dtype} {tuple(buf.shape)}"
        )
