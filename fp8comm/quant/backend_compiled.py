"""torch.compile fast path for CPU: the reference functions compiled by inductor; bit-exact by test.

The wire functions (pack_chunks / unpack_chunks / unpack_sum) run ONE fused graph per chunk that reads the input
once and writes straight into the destination: quantize writes codes and encoded scales into their places in the
send buffer (no intermediate codes/scales tensors, no copies), dequantize writes into the caller's output (which may
be a strided view, e.g. one pipeline piece of a bigger output), unpack_sum sums every chunk in chunk order in one
pass (the measured speedup over the unfused graphs: docs/benchmarks.md). Stochastic rounding keeps the unfused
path (its seed changes every call).
"""

from __future__ import annotations

import torch

from . import backend_reference as _ref
from . import reference as ref
from .layout import decode_e8m0
from .scaling import scale_from_amax

name = "compiled"

# Each (format, scaling, rounding, shape) is its own graph; the default limit of 8 would silently send later
# variants to eager mode (same bits, but no longer the fast path).
_cfg = torch._dynamo.config
_key = "recompile_limit" if hasattr(_cfg, "recompile_limit") else "cache_size_limit"  # renamed across versions
setattr(_cfg, _key, max(getattr(_cfg, _key), 64))


def encode_nearest(x2: torch.Tensor, scale: torch.Tensor, scaling, fmt) -> torch.Tensor:
    """ref.encode(rounding="nearest") with one fp32 -> FP8 cast in place of round_to_grid + cast: the same bits, as
    FP8-typed codes [M, K] (callers view them as uint8 outside compiled graphs).

    The cast rounds to nearest-even onto the same grid; clamping to +-max first keeps it off its saturating /
    NaN-on-overflow edge. Checked over every fp32 of magnitude < 1.5 x max, both signs, both formats (launch/
    check_cast.py); tests/unit/test_wire_compiled.py checks every grid midpoint and its neighbours. ~1.4x faster.
    """
    m, k = x2.shape
    x = ref.blocks_view(x2.float(), scaling)
    y = torch.clamp(x / scale.float()[:, None, :, None], -fmt.max, fmt.max)
    finite = torch.isfinite(x)
    special = torch.where(torch.isnan(x), float("nan"), x) if fmt.has_inf else float("nan")
    y = torch.where(finite, y, special)
    return ref.unblock(y.to(fmt.dtype), m, k)  # FP8-typed; callers view it as uint8 outside the graph


_encode = torch.compile(ref.encode)
encode_nearest_compiled = torch.compile(encode_nearest)
_amax = torch.compile(ref.block_amax)
_dequant = torch.compile(ref.dequantize_2d)


def quantize_2d(x2, fmt, scaling, rounding="nearest", seed=0, scale=None, index_base=0):
    amax = _amax(x2, scaling)
    if scale is None:
        scale = scale_from_amax(amax, fmt, scaling)
    if rounding == "nearest":
        codes = encode_nearest_compiled(x2, scale, scaling, fmt).view(torch.uint8)
    else:
        codes = _encode(x2, scale, scaling, fmt, rounding, seed, index_base)
    return codes, scale, amax


def dequantize_2d(codes, scale, fmt, scaling, out_dtype):
    return _dequant(codes, scale, fmt, scaling).to(out_dtype)


# ------------------------------------------------------------------------------------------- fused wire graphs
def _scale_bits(s: torch.Tensor, scaling) -> torch.Tensor:
    """fp32 scales -> what the wire holds (same as tensor.encode_scales): fp32 as is, or the E8M0 exponent byte."""
    if scaling.encoding == "e8m0":
        return ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return s


def _scale_values(b: torch.Tensor, scaling) -> torch.Tensor:
    """Inverse of _scale_bits (layout.decode_scales): fp32 scales from an fp32 view or E8M0 bytes (OCP MX: byte 0
    is 2**-127, 255 is NaN)."""
    if scaling.encoding == "e8m0":
        return decode_e8m0(b)
    return b


def _quant_into(x2, fmt, scaling, codes_out):
    """Write the codes into codes_out (an FP8-typed view of the send buffer); return the scales' wire values. (A
    second mutated view of the same buffer, of another dtype, is beyond aot_autograd; the scales are 1/B of it.)"""
    amax = ref.block_amax(x2, scaling)
    s = scale_from_amax(amax, fmt, scaling)
    codes_out.copy_(encode_nearest(x2, s, scaling, fmt))
    return _scale_bits(s, scaling)


def _quant_into_counted(x2, fmt, scaling, codes_out):
    """_quant_into plus reference.fit_counts of the same quantization, in the same graph: (scale bits, counts)."""
    amax = ref.block_amax(x2, scaling)
    s = scale_from_amax(amax, fmt, scaling)
    q = encode_nearest(x2, s, scaling, fmt)
    codes_out.copy_(q)
    xb = ref.blocks_view(x2.float(), scaling)
    finite = torch.isfinite(xb)
    sat = finite & (xb.abs() > s[:, None, :, None] * ref.saturation_limit(fmt))
    under = finite & (xb != 0) & (ref.blocks_view(q.to(torch.float32), scaling) == 0)
    counts = torch.stack([sat.sum(), under.sum(), (~finite).sum()]).to(torch.int64)
    return _scale_bits(s, scaling), counts


def _dequant_rows(codes, scale, fmt, scaling):
    """ref.dequantize_2d for 1xB blocks with each scale broadcast along its block: the same fp32 products. (The
    padded blocks view of the reference, copied into an output inside the graph, lost the partial last block.)
    codes: FP8-typed (viewed outside the graph: an in-graph uint8 -> FP8 view cost twice the rest of the dequantize)."""
    m, k = codes.shape
    bc = scaling.block_shape(m, k)[1]
    s = scale.float()[:, :, None].expand(m, scale.shape[1], bc).reshape(m, scale.shape[1] * bc)[:, :k]
    return codes.to(torch.float32) * s


def _deq_into(codes, sbytes, fmt, scaling, out):
    out.copy_(_dequant_rows(codes, _scale_values(sbytes, scaling), fmt, scaling).to(out.dtype))


def _sum_into(codes3, sbytes3, fmt, scaling, out):
    # Same order and arithmetic as the reference (zeros, then += chunk 0, 1, ...). The reference sum can never be
    # -0 (it starts at +0 and round-to-nearest gives +0 for exact zero sums); inductor compiles with
    # -fno-signed-zeros, so the sign of zero is restored on the integer bits, where that flag does not apply.
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for c in range(codes3.shape[0]):
        acc = acc + _dequant_rows(codes3[c], _scale_values(sbytes3[c], scaling), fmt, scaling)
    bits = acc.view(torch.int32)
    out.copy_(torch.where(bits == -(2**31), torch.zeros_like(bits), bits).view(torch.float32))


_quant_into_c = torch.compile(_quant_into)
_quant_into_counted_c = torch.compile(_quant_into_counted)
_deq_into_c = torch.compile(_deq_into)
_sum_into_c = torch.compile(_sum_into)


def _scale_view(buf: torch.Tensor, off: int, rows: int, kb: int, scaling) -> torch.Tensor:
    """The scale section of one chunk as [rows, kb] fp32 (4-byte scales; offsets are 16-byte aligned) or E8M0 bytes.
    Made outside the graphs, like the FP8-typed code views: in-graph dtype views cost more than the math."""
    n = rows * kb * scaling.scale_bytes
    b = buf[off : off + n]
    return (b if scaling.encoding == "e8m0" else b.view(torch.float32)).view(rows, kb)


def _split(layout) -> tuple[int, int]:
    """(columns in whole blocks, whole blocks): the graphs take whole blocks only; a partial last block (< B
    columns) goes through the reference. (Inductor in torch 2.13 on CPU computed garbage for the columns past the
    last multiple of 256 of a broadcast-scaled 320-wide row; whole 1xB blocks are what every big buffer has.)"""
    bc = layout.block
    kf = layout.k - layout.k % bc
    return kf, kf // bc


def pack_chunks(x2, layout, fmt, rounding, seed, out, counters=None):
    """Quantize straight into the send buffer: codes and encoded scales land in their wire places (one pass);
    with `counters`, the guard's counts come out of the same graph."""
    if rounding != "nearest":
        return _ref.pack_chunks(x2, layout, fmt, rounding, seed, out, counters, quantize_fn=quantize_2d)
    k, kb, sc = layout.k, layout.kb, layout.scaling
    kf, kbf = _split(layout)
    for c, rows in enumerate(layout.rows):
        o, r0, pb = layout.offsets[c], layout.row_starts[c], layout.payload_bytes(c)
        nsb = rows * kb * sc.scale_bytes
        if rows and k:
            x = x2[r0 : r0 + rows]
            codes = out[o : o + rows * k].view(rows, k)
            sbytes = _scale_view(out, o + pb, rows, kb, sc)
            if kf and counters is None:
                sbytes[:, :kbf] = _quant_into_c(x[:, :kf], fmt, sc, codes[:, :kf].view(fmt.dtype))
            elif kf:
                sbytes[:, :kbf], n = _quant_into_counted_c(x[:, :kf], fmt, sc, codes[:, :kf].view(fmt.dtype))
                counters += n
            if kf < k:
                tc, ts, _ = ref.quantize_2d(x[:, kf:], fmt, sc)
                codes[:, kf:] = tc
                sbytes[:, kbf:] = _scale_bits(ts, sc).view(rows, kb - kbf)
                if counters is not None:
                    counters += ref.fit_counts(x[:, kf:], ts, tc, sc, fmt)
        out[o + rows * k : o + pb] = 0
        out[o + pb + nsb : o + layout.chunk_bytes[c]] = 0
    return out


def unpack_chunks(buf, layout, fmt, out):
    k, kb, sc = layout.k, layout.kb, layout.scaling
    kf, kbf = _split(layout)
    for c, rows in enumerate(layout.rows):
        if not rows or not k:
            continue
        o, r0 = layout.offsets[c], layout.row_starts[c]
        codes = buf[o : o + rows * k].view(rows, k)
        sv = _scale_view(buf, o + layout.payload_bytes(c), rows, kb, sc)
        dst = out[r0 : r0 + rows]
        if kf:
            _deq_into_c(codes[:, :kf].view(fmt.dtype), sv[:, :kbf], fmt, sc, dst[:, :kf])
        if kf < k:
            dst[:, kf:] = ref.dequantize_2d(codes[:, kf:], _scale_values(sv[:, kbf:], sc), fmt, sc).to(out.dtype)
    return out


def unpack_sum(buf, layout, fmt, out):
    n, k, kb, sc = len(layout.rows), layout.k, layout.kb, layout.scaling
    rows = layout.rows[0] if n else 0
    if not n or not rows or not k:
        return out.zero_()
    kf, kbf = _split(layout)
    cb, pb = layout.chunk_bytes[0], layout.payload_bytes(0)
    chunks = buf[: n * cb].view(n, cb)
    codes3 = chunks[:, : rows * k].view(n, rows, k)
    sb = chunks[:, pb : pb + rows * kb * sc.scale_bytes]
    sbytes3 = (sb if sc.encoding == "e8m0" else sb.view(torch.float32)).view(n, rows, kb)
    if kf:
        _sum_into_c(codes3[:, :, :kf].view(fmt.dtype), sbytes3[:, :, :kbf], fmt, sc, out[:, :kf])
    if kf < k:
        tail = torch.zeros(rows, k - kf)
        for c in range(n):
            tail += ref.dequantize_2d(codes3[c, :, kf:], _scale_values(sbytes3[c, :, kbf:], sc), fmt, sc)
        out[:, kf:] = tail
    return out
