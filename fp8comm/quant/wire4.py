"""The 4-bit wire format: rows of an [M, K] tensor cut into destination chunks, each ONE contiguous uint8 section.

Chunk c holds rows[c] rows of K elements (K a multiple of the format's block; callers zero-pad) as: E2M1 codes
(rows x K/2 bytes, element 2j in the low nibble), then one scale byte per 1 x B block (E8M0 for MXFP4, E4M3 for
NVFP4), then for NVFP4 the chunk's fp32 power-of-two tensor scale; each section 16-byte aligned (docs/fp4.md).
The chunk is the scope of NVFP4's second-level scale: every destination gets one computed over its own chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from ..errors import Fp8CommError, Fp8CommRuntimeError
from . import fp4_native
from .dispatch import COMPILE_MIN_NUMEL, triton_available
from .dispatch import backend_problem as dispatch_problem
from .fp4 import Fp4Format, decode_2d, encode_2d, hadamard_forward, hadamard_inverse, unpack_nibbles
from .layout import Chunks, align
from .reference import seed_key
from .toolchain import compiled_cpu_problem, step_down
from .wire import _check_buf

__all__ = [
    "Fp4Layout",
    "fp4_layout",
    "pack_fp4",
    "unpack_fp4",
    "unpack_fp4_sum",
    "residual_fp4",
    "fp4_backend",
    "backend_problem",
]


@dataclass(frozen=True)
class Fp4Layout(Chunks):
    """Byte layout of `rows` (rows per chunk) of width `k` (a multiple of fmt.block) in 4-bit format `fmt`."""

    rows: tuple[int, ...]
    k: int
    fmt: Fp4Format

    def __post_init__(self) -> None:
        if self.k % self.fmt.block:
            raise Fp8CommError(f"{self.fmt.name} wire rows need a multiple of {self.fmt.block} elements, got {self.k}")
        if any(r < 0 for r in self.rows):
            raise Fp8CommError(f"chunk row counts must be >= 0, got {self.rows}")

    @property
    def kb(self) -> int:
        """Scale bytes per row."""
        return self.k // self.fmt.block

    def payload_bytes(self, c: int) -> int:
        return align(self.rows[c] * self.k // 2)

    def scale_bytes(self, c: int) -> int:
        return align(self.rows[c] * self.kb)

    @property
    def tensor_scale_bytes(self) -> int:
        return 16 if self.fmt.two_level else 0  # one fp32, section aligned like the others

    @cached_property
    def chunk_bytes(self) -> tuple[int, ...]:
        return tuple(
            self.payload_bytes(c) + self.scale_bytes(c) + self.tensor_scale_bytes for c in range(len(self.rows))
        )

    def with_rows(self, rows) -> Fp4Layout:
        return fp4_layout(tuple(int(r) for r in rows), self.k, self.fmt)

    def sections(self, buf: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Chunk c's (codes uint8 [rows, K/2], scale bytes uint8 [rows, K/B], fp32 tensor scale [1] or None)."""
        rows, o = self.rows[c], self.offsets[c]
        pb, sb = self.payload_bytes(c), self.scale_bytes(c)
        codes = buf[o : o + rows * self.k // 2].view(rows, self.k // 2)
        scales = buf[o + pb : o + pb + rows * self.kb].view(rows, self.kb)
        ts = buf[o + pb + sb : o + pb + sb + 4].view(torch.float32) if self.fmt.two_level else None
        return codes, scales, ts


@lru_cache(maxsize=1024)
def fp4_layout(rows: tuple[int, ...], k: int, fmt: Fp4Format) -> Fp4Layout:
    """Fp4Layout(rows, k, fmt), shared per process (steady-state calls repeat their layouts)."""
    return Fp4Layout(rows, k, fmt)


def fp4_backend(name: str, device: torch.device, numel: int) -> str:
    """The 4-bit kernels for a call: 'auto' is Triton on CUDA, the native kernels on CPU (where they do not load:
    the compiled reference for big buffers if inductor has a compiler, else the reference, with one warning naming
    the cause); every choice gives the same bits (tests/unit/test_fp4.py). An explicit backend that cannot run
    raises."""
    if name == "auto":
        if device.type == "cuda" and triton_available(device):
            return "triton"
        if device.type != "cpu":
            return "reference"
        if fp4_native.available():
            return "native"
        cause = f"the native 4-bit CPU kernels are unavailable: {fp4_native.problem()}"
        if numel < COMPILE_MIN_NUMEL:
            chosen = "reference"
        elif (problem := compiled_cpu_problem(device)) is None:
            chosen = "compiled"
        else:
            chosen, cause = "reference", f"{cause}; and {problem}"
        step_down(cause, f"'{chosen}' for 4 bits")
        return chosen
    problem = backend_problem(name, device)
    if problem is not None:
        raise Fp8CommRuntimeError(problem)
    return name


def backend_problem(name: str, device: torch.device) -> str | None:
    """Why an explicit backend cannot run for tensors on `device` (None: it can, or 'auto'): 'native' here, the
    backends FP8 shares in dispatch.backend_problem."""
    if name != "native":
        return dispatch_problem(name, device)
    if device.type != "cpu":
        return f"backend 'native' runs on CPU tensors (tensor on {device})"
    return None if fp4_native.available() else f"4-bit backend 'native' is unavailable: {fp4_native.problem()}"


def _encode(x2, fmt: Fp4Format, seed: int | None, index_base: int, backend: str, tensor_amax=None, rows=False):
    if backend == "triton":
        from . import fp4_triton

        return fp4_triton.encode_2d(x2, fmt, seed, index_base, tensor_amax)
    key = None if seed is None else torch.tensor(seed_key(seed), dtype=torch.int64, device=x2.device)
    if backend == "compiled":
        from . import fp4_compiled

        return fp4_compiled.encode_2d(x2, fmt, key, index_base, tensor_amax, rows)
    return encode_2d(x2, fmt, key, index_base, tensor_amax, rows)


def _decode(codes, scales, ts, fmt: Fp4Format, backend: str) -> torch.Tensor:
    if ts is None:
        ts = torch.ones(1, dtype=torch.float32, device=codes.device)
    if backend == "native":  # (Triton decodes the wire buffer in place: _decode_all)
        return fp4_native.decode_2d(codes, scales, ts, fmt)
    if backend == "compiled":
        from . import fp4_compiled

        return fp4_compiled.decode_2d(codes, scales, ts, fmt)
    return decode_2d(codes, scales, ts, fmt)


def _chunk_amax_rows(y: torch.Tensor, layout: Fp4Layout) -> torch.Tensor:
    """NVFP4's per-chunk second-level scope as one value per row: each row gets its chunk's finite amax (chunks
    of several rows; one-row chunks: each row's own)."""
    a = torch.where(torch.isfinite(y), y.abs(), 0.0).amax(dim=1) if y.numel() else y.new_zeros(y.shape[0])
    if all(r <= 1 for r in layout.rows):
        return a
    out = torch.empty_like(a)
    for r0, rows in zip(layout.row_starts, layout.rows):
        if rows:
            out[r0 : r0 + rows] = a[r0 : r0 + rows].amax()
    return out


def pack_fp4(
    x2: torch.Tensor,
    layout: Fp4Layout,
    rounding: str = "nearest",
    seed: int = 0,
    hadamard: int = 0,
    hadamard_seed: int = 0,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize x2 [M, K] (M = layout.total_rows) chunk by chunk into one uint8 buffer laid out as `layout`.

    hadamard=16|32: the random block Hadamard transform (signs from hadamard_seed, the same on every rank) first.
    Stochastic rounding draws from (seed, the element's flat index in x2), whatever the chunking.
    counters (int64 [3]): adds [0, elements flushed to zero, non-finite elements]: the 4-bit guard's measures
    (an E2M1 block never saturates; a finite non-zero element whose code is +-0 counts as flushed)."""
    if x2.dim() != 2 or tuple(x2.shape) != (layout.total_rows, layout.k):
        raise Fp8CommError(f"pack_fp4: input shape {tuple(x2.shape)} != layout {(layout.total_rows, layout.k)}")
    if out is None:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=x2.device)
    elif out.dtype != torch.uint8 or out.numel() < layout.total_bytes or not out.is_contiguous():
        raise Fp8CommError(f"pack_fp4: out must be contiguous uint8 with >= {layout.total_bytes} bytes")
    be = fp4_backend(backend, x2.device, x2.numel())
    y = hadamard_forward(x2, hadamard, hadamard_seed) if hadamard else x2
    sr = None if rounding == "nearest" else int(seed)
    fmt = layout.fmt
    _zero_empty_chunks(out, layout)
    if be == "native":  # straight into each chunk's sections
        _pack_native(y, layout, sr, out, counters)
        return out
    if be == "triton":  # one launch straight into every chunk's sections
        from . import fp4_triton

        fp4_triton.encode_wire(y, layout, sr, _chunk_amax_rows(y, layout) if fmt.two_level else None, out)
        if counters is not None and layout.total_rows:
            live = [layout.sections(out, c)[0] for c, n in enumerate(layout.rows) if n]
            counters += _counts(y, torch.cat(live) if len(live) > 1 else live[0])
        return out
    # one call for every chunk (a per-row NVFP4 scope), then each chunk's rows copied into its section
    one_row = all(r <= 1 for r in layout.rows)  # the collectives' chunks: the encoder scales each row
    ta = _chunk_amax_rows(y, layout) if fmt.two_level and not one_row else None
    q, sb, t = _encode(y, fmt, sr, 0, be, ta, fmt.two_level and one_row)
    parts = [
        (c, (q[r0 : r0 + n], sb[r0 : r0 + n], t[r0 : r0 + 1] if fmt.two_level else None))
        for c, (r0, n) in enumerate(zip(layout.row_starts, layout.rows))
        if n
    ]
    for c, (qc, sc, tc) in parts:
        codes, scales, ts = layout.sections(out, c)
        codes.copy_(qc)
        scales.copy_(sc)
        if ts is not None and tc is not None:
            ts.copy_(tc.reshape(1))
        _zero_padding(out, layout, c)
    if counters is not None:
        q_all = torch.cat([p[1][0] for p in parts]) if len(parts) != 1 else parts[0][1][0]
        rows = [layout.rows[c] for c, _ in parts]
        y_rows = y if sum(rows) == y.shape[0] else y[: sum(rows)]
        counters += _counts(y_rows, q_all)
    return out


def _pack_native(y: torch.Tensor, layout: Fp4Layout, sr: int | None, out: torch.Tensor, counters) -> None:
    """pack_fp4 on the native kernels: each chunk encoded in place (NVFP4: one scale per row, each row given its
    chunk's amax unless chunks are single rows)."""
    k, fmt = layout.k, layout.fmt
    one_row = all(r <= 1 for r in layout.rows)
    ta = _chunk_amax_rows(y, layout) if fmt.two_level and not one_row else None
    key = None if sr is None else seed_key(sr)
    for c, (r0, n) in enumerate(zip(layout.row_starts, layout.rows)):
        if not n:
            continue
        codes, scales, ts = layout.sections(out, c)
        t = torch.empty(n, dtype=torch.float32) if ts is not None else None
        tac = None if ta is None else ta[r0 : r0 + n]
        fp4_native.encode_into(y[r0 : r0 + n], fmt, codes, scales, t, key, r0 * k, tac, counters)
        if ts is not None and t is not None:
            ts.copy_(t[:1])
        _zero_padding(out, layout, c)


def _zero_empty_chunks(out: torch.Tensor, layout: Fp4Layout) -> None:
    """A chunk of 0 rows still owns its NVFP4 tensor-scale section, which no encoder writes: send it as zeros."""
    for c, n in enumerate(layout.rows):
        if not n and layout.chunk_bytes[c]:
            out[layout.offsets[c] : layout.offsets[c] + layout.chunk_bytes[c]].zero_()


def _zero_padding(out: torch.Tensor, layout: Fp4Layout, c: int) -> None:
    """Zero the alignment bytes after each section of chunk c: the wire carries no uninitialized memory, and the
    same input gives the same bytes on every backend."""
    rows, o = layout.rows[c], layout.offsets[c]
    pb, sb = layout.payload_bytes(c), layout.scale_bytes(c)
    ends = [(o + rows * layout.k // 2, o + pb), (o + pb + rows * layout.kb, o + pb + sb)]
    if layout.fmt.two_level:
        ends.append((o + pb + sb + 4, o + pb + sb + layout.tensor_scale_bytes))
    for a, b in ends:
        if b > a:
            out[a:b].zero_()


def _counts(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """[0, finite non-zero elements encoded as +-0, non-finite elements] of one quantized chunk (int64 [3])."""
    fin = torch.isfinite(x)
    zero = (unpack_nibbles(packed) & 7) == 0
    flushed = (fin & (x != 0) & zero.view(x.shape)).sum()
    nonfinite = (~fin).sum()
    return torch.stack((torch.zeros_like(flushed), flushed, nonfinite)).to(torch.int64)


def _decode_all(buf: torch.Tensor, layout: Fp4Layout, backend: str) -> torch.Tensor:
    """Every chunk decoded, fp32 [M, K]: sections gathered into one [M, K/2] + [M, K/B] (+ per-row tensor scale)
    and decoded in one call (Triton: one launch reading the wire buffer in place)."""
    m, fmt = layout.total_rows, layout.fmt
    if backend == "triton":  # one launch straight from the wire sections
        from . import fp4_triton

        out = torch.empty(m, layout.k, dtype=torch.float32, device=buf.device)
        return fp4_triton.wire(buf, layout, out, "unpack")
    live = [(c, r0, n) for c, (r0, n) in enumerate(zip(layout.row_starts, layout.rows)) if n]
    if len(live) == 1:
        out = torch.empty(m, layout.k, dtype=torch.float32, device=buf.device)
        for c, r0, n in live:
            out[r0 : r0 + n] = _decode(*layout.sections(buf, c), fmt, backend)
        return out
    codes = torch.empty(m, layout.k // 2, dtype=torch.uint8, device=buf.device)
    scales = torch.empty(m, layout.kb, dtype=torch.uint8, device=buf.device)
    ts = torch.empty(m, dtype=torch.float32, device=buf.device) if fmt.two_level else None
    for c, r0, n in live:
        cc, ss, tt = layout.sections(buf, c)
        codes[r0 : r0 + n] = cc
        scales[r0 : r0 + n] = ss
        if ts is not None and tt is not None:
            ts[r0 : r0 + n] = tt
    return _decode(codes, scales, ts, fmt, backend)


def unpack_fp4(
    buf: torch.Tensor,
    layout: Fp4Layout,
    hadamard: int = 0,
    hadamard_seed: int = 0,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode every chunk of `buf` into fp32 [M, K] (the Hadamard transform inverted per row block); an `out` of
    [M, L], L <= K, receives the first L columns of each row (the padding stays behind)."""
    _check_buf(buf, layout)
    if out is None:
        out = torch.empty(layout.total_rows, layout.k, dtype=torch.float32, device=buf.device)
    elif out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != layout.total_rows or out.shape[1] > layout.k:
        raise Fp8CommError(f"unpack_fp4: out must be fp32 [{layout.total_rows}, <= {layout.k}]")
    be = fp4_backend(backend, buf.device, layout.total_rows * layout.k)
    if be == "native" and not hadamard:  # each chunk straight into its rows of out
        for c, (r0, n) in enumerate(zip(layout.row_starts, layout.rows)):
            if n:
                fp4_native.decode([layout.sections(buf, c)], layout.fmt, out[r0 : r0 + n])
    elif be == "triton" and not hadamard:  # one launch into out's columns
        from . import fp4_triton

        fp4_triton.wire(buf, layout, out, "unpack")
    elif layout.total_rows:
        v = _decode_all(buf, layout, be)
        out.copy_((hadamard_inverse(v, hadamard, hadamard_seed) if hadamard else v)[:, : out.shape[1]])
    return out


def unpack_fp4_add(buf: torch.Tensor, layout: Fp4Layout, out: torch.Tensor) -> bool:
    """out (bf16 [M, L], L <= K) += every chunk of `buf` decoded, on the native kernels in one pass per chunk (the
    bits of unpack_fp4 then the fp32 add rounded once); False, with out untouched, where they cannot (not CPU, not
    loaded, another dtype): the caller decodes and adds."""
    if out.dtype != torch.bfloat16 or out.device.type != "cpu" or not fp4_native.available():
        return False
    _check_buf(buf, layout)
    if out.dim() != 2 or out.shape[0] != layout.total_rows or out.shape[1] > layout.k:
        raise Fp8CommError(f"unpack_fp4_add: out must be [{layout.total_rows}, <= {layout.k}]")
    for c, (r0, n) in enumerate(zip(layout.row_starts, layout.rows)):
        if n:
            fp4_native.decode_add(layout.sections(buf, c), layout.fmt, out[r0 : r0 + n])
    return True


def unpack_fp4_sum(
    buf: torch.Tensor,
    layout: Fp4Layout,
    hadamard: int = 0,
    hadamard_seed: int = 0,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode N equal chunks and sum them in fp32 in chunk order, then invert the Hadamard transform once on the
    sum (the transform is linear: one inverse instead of N); the reduce-scatter's receive side."""
    _check_buf(buf, layout)
    if len(set(layout.rows)) > 1:
        raise Fp8CommError(f"unpack_fp4_sum needs equal chunks, got rows {layout.rows}")
    rows = layout.rows[0] if layout.rows else 0
    if out is None:
        out = torch.empty(rows, layout.k, dtype=torch.float32, device=buf.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, layout.k):
        raise Fp8CommError(f"unpack_fp4_sum: out must be fp32 {(rows, layout.k)}")
    be = fp4_backend(backend, buf.device, layout.total_rows * layout.k)
    if not rows:
        return out
    if be == "native":  # decoded and summed in one pass, in chunk order
        fp4_native.decode([layout.sections(buf, c) for c in range(len(layout.rows))], layout.fmt, out, "sum")
    elif be == "triton":  # the same, in one launch
        from . import fp4_triton

        fp4_triton.wire(buf, layout, out, "sum")
    else:
        v = _decode_all(buf, layout, be).view(len(layout.rows), rows, layout.k)
        out.copy_(v[0])
        for c in range(1, len(layout.rows)):
            out.add_(v[c])
    if hadamard:
        out.copy_(hadamard_inverse(out, hadamard, hadamard_seed))
    return out


def residual_fp4(
    buf: torch.Tensor, layout: Fp4Layout, x: torch.Tensor, out: torch.Tensor, backend: str = "native"
) -> torch.Tensor:
    """Error feedback's residual in one pass (native or Triton kernels, no transform): out = x - decoded, over the
    first L = x.shape[1] columns of each row, non-finite differences 0; out fp32 [M, L], L <= K, x fp32 (Triton:
    or bf16). The same bits as unpack_fp4 followed by the subtraction in torch."""
    _check_buf(buf, layout)
    if x.shape != out.shape or x.shape[0] != layout.total_rows or x.shape[1] > layout.k:
        raise Fp8CommError(f"residual_fp4: x {tuple(x.shape)} and out {tuple(out.shape)} vs layout rows of {layout.k}")
    if backend == "triton":
        from . import fp4_triton

        return fp4_triton.wire(buf, layout, out, "residual", x)
    for c, (r0, n) in enumerate(zip(layout.row_starts, layout.rows)):
        if n:
            fp4_native.decode([layout.sections(buf, c)], layout.fmt, out[r0 : r0 + n], "residual", x[r0 : r0 + n])
    return out
