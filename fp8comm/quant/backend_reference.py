"""Reference backend: the pure-torch bits (reference.py) applied chunk by chunk. Loops over chunks, never blocks."""

from __future__ import annotations

import torch

from . import reference as ref
from .formats import Fp8Format
from .layout import ChunkLayout, decode_scales, encode_scales

name = "reference"
quantize_2d = ref.quantize_2d


def dequantize_2d(codes, scale, fmt, scaling, out_dtype):
    return ref.dequantize_2d(codes, scale, fmt, scaling).to(out_dtype)


def pack_chunks(
    x2: torch.Tensor,
    layout: ChunkLayout,
    fmt: Fp8Format,
    rounding: str,
    seed: int,
    out: torch.Tensor,
    counters: torch.Tensor | None = None,
    quantize_fn=ref.quantize_2d,
) -> torch.Tensor:
    k = layout.k
    for c, rows in enumerate(layout.rows):
        o, r0 = layout.offsets[c], layout.row_starts[c]
        codes, scale, _ = quantize_fn(x2[r0 : r0 + rows], fmt, layout.scaling, rounding, seed, index_base=r0 * k)
        if counters is not None:
            counters += ref.fit_counts(x2[r0 : r0 + rows], scale, codes, layout.scaling, fmt).to(counters.device)
        pb = layout.payload_bytes(c)
        out[o : o + rows * k] = codes.reshape(-1)
        out[o + rows * k : o + pb] = 0
        sb = encode_scales(scale.reshape(-1), layout.scaling)
        out[o + pb : o + pb + sb.numel()] = sb
        out[o + pb + sb.numel() : o + layout.chunk_bytes[c]] = 0
    return out


def _chunk(buf: torch.Tensor, layout: ChunkLayout, fmt: Fp8Format, c: int, dequantize_fn) -> torch.Tensor:
    rows, k, o = layout.rows[c], layout.k, layout.offsets[c]
    codes = buf[o : o + rows * k].reshape(rows, k)
    pb = layout.payload_bytes(c)
    nsb = rows * layout.kb * layout.scaling.scale_bytes
    scale = decode_scales(buf[o + pb : o + pb + nsb], layout.scaling).reshape(rows, layout.kb)
    return dequantize_fn(codes, scale, fmt, layout.scaling)


def unpack_chunks(buf, layout, fmt, out, dequantize_fn=ref.dequantize_2d):
    for c, rows in enumerate(layout.rows):
        r0 = layout.row_starts[c]
        out[r0 : r0 + rows] = _chunk(buf, layout, fmt, c, dequantize_fn).to(out.dtype)
    return out


def unpack_sum(buf, layout, fmt, out, dequantize_fn=ref.dequantize_2d):
    out.zero_()
    for c in range(len(layout.rows)):
        out += _chunk(buf, layout, fmt, c, dequantize_fn)
    return out
