"""WireCodec: the one interface the collectives see for every wire format; codec_for() is where a format is chosen.

A codec turns rows of a 2-D tensor into destination chunks of one uint8 buffer (`layout`, `pack`) and back
(`unpack`, `unpack_sum` in fp32 and chunk order, `residual` = x - decoded with non-finite -> 0). comm/ never asks
which format it moves: FP8 (E4M3/E5M2 with fp32, pow2 or E8M0 1xB scales) and 4-bit (MXFP4, NVFP4, optional
Hadamard transform) differ only inside their codec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .dispatch import backend_name
from .formats import Fp8Format
from .fp4 import Fp4Format
from .layout import Chunks, align, layout_of
from .scaling import Scaling
from .wire import pack_chunks, unpack_chunks, unpack_codes, unpack_sum
from .wire4 import fp4_backend, fp4_layout, pack_fp4, residual_fp4, unpack_fp4, unpack_fp4_add, unpack_fp4_sum

# take(numel, dtype, device) -> scratch the caller owns for the call (comm's Lease.take)
Scratch = Callable[[int, torch.dtype, torch.device], torch.Tensor]


_RESIDUAL_IN = (torch.float32, torch.bfloat16)  # inputs the one-pass Triton residuals widen exactly
_ONE_PASS_RESIDUAL = {"native": (torch.float32,), "triton": _RESIDUAL_IN}  # 4-bit kernel -> x dtypes it takes


def _fresh(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


class WireCodec(Protocol):
    """One wire format: rows [M, K] <-> destination chunks of one uint8 buffer; the same bits on every backend.

    K is `width(k)`: a row of k elements travels padded to whole blocks where the format needs it (zeros change no
    scale and are dropped on decode)."""

    @property
    def name(self) -> str: ...

    @property
    def bits(self) -> int:  # bits per element code: 8 (FP8) or 4 (E2M1); the numerics guard's measure depends on it
        ...

    @property
    def block(self) -> int:  # elements per scale block along K: pipelined pieces are cut at multiples of it
        ...

    @property
    def pipelines(self) -> bool:  # pieces of whole blocks keep the one-piece bits (False: a scale spans the row)
        ...

    @property
    def codes_out(self) -> bool:  # unpack_codes gives FP8 codes + fp32 scales for an FP8 GEMM consumer
        ...

    def width(self, k: int) -> int: ...

    def layout(self, rows: tuple[int, ...], k: int) -> Chunks: ...

    def kernel(self, backend: str, device: torch.device, numel: int) -> str: ...

    def pack(
        self,
        x2: torch.Tensor,
        lay: Chunks,
        out: torch.Tensor,
        *,
        rounding: str,
        seed: int,
        kernel: str,
        counters: torch.Tensor | None = None,
    ) -> None: ...

    def unpack(
        self, buf: torch.Tensor, lay: Chunks, out: torch.Tensor, *, kernel: str, scratch: Scratch = _fresh
    ) -> None: ...

    def unpack_add(
        self, buf: torch.Tensor, lay: Chunks, out: torch.Tensor, *, kernel: str, scratch: Scratch = _fresh
    ) -> None: ...  # out += decoded: the fp32 sum rounded once into out's dtype (a replica's update)

    def unpack_sum(self, buf: torch.Tensor, lay: Chunks, out: torch.Tensor, *, kernel: str) -> None: ...

    def residual(
        self,
        buf: torch.Tensor,
        lay: Chunks,
        x: torch.Tensor,
        r: torch.Tensor,
        *,
        kernel: str,
        scratch: Scratch = _fresh,
    ) -> None: ...

    def unpack_codes(self, buf: torch.Tensor, lay: Chunks, codes: torch.Tensor, scales: torch.Tensor) -> None: ...


def decode_then_add(codec, buf: torch.Tensor, lay: Chunks, out: torch.Tensor, kernel: str, scratch: Scratch) -> None:
    """out += codec's decode of buf, decoded into fp32 scratch and summed in fp32, rounded once into out's dtype:
    the bits every codec's unpack_add gives (the native 4-bit one-pass add included, tests/unit/test_fp4.py)."""
    dec = scratch(out.numel(), torch.float32, out.device).view(out.shape)
    codec.unpack(buf, lay, dec, kernel=kernel, scratch=scratch)
    if out.dtype == torch.float32:
        out.add_(dec)
    else:
        out.copy_(out.float().add_(dec))


def subtract_into(x: torch.Tensor, decoded: torch.Tensor, r: torch.Tensor) -> None:
    """r = x - decoded, computed in fp32 and rounded once into r's dtype; non-finite entries 0 (never carried)."""
    if r.dtype == torch.float32:
        torch.sub(x, decoded, out=r)
    else:
        torch.sub(x, decoded, out=decoded)
        r.copy_(decoded)
    r.masked_fill_(~torch.isfinite(r), 0.0)


@dataclass(frozen=True)
class Fp8Codec:
    """E4M3/E5M2 with 1xB block scales (fp32, pow2 or E8M0); rows never padded; codes can be handed out as FP8."""

    fmt: Fp8Format
    scaling: Scaling
    bits: int = 8
    pipelines: bool = True
    codes_out: bool = True

    @property
    def name(self) -> str:
        return self.fmt.name

    @property
    def block(self) -> int:
        return int(self.scaling.cols or 1)

    def width(self, k: int) -> int:
        return k

    def layout(self, rows: tuple[int, ...], k: int) -> Chunks:
        return layout_of(rows, k, self.scaling)

    def kernel(self, backend: str, device: torch.device, numel: int) -> str:
        return backend_name(backend, device, numel)

    def pack(self, x2, lay, out, *, rounding, seed, kernel, counters=None) -> None:
        pack_chunks(x2, lay, self.fmt, rounding, seed, out=out, backend=kernel, counters=counters)

    def unpack(self, buf, lay, out, *, kernel, scratch=_fresh) -> None:
        unpack_chunks(buf, lay, self.fmt, out.dtype, out=out, backend=kernel)

    def unpack_add(self, buf, lay, out, *, kernel, scratch=_fresh) -> None:
        decode_then_add(self, buf, lay, out, kernel, scratch)

    def unpack_sum(self, buf, lay, out, *, kernel) -> None:
        unpack_sum(buf, lay, self.fmt, out=out, backend=kernel)

    def residual(self, buf, lay, x, r, *, kernel, scratch=_fresh) -> None:
        m, w = x.shape
        if kernel == "triton" and w == lay.k and r.dtype == torch.float32 and x.dtype in _RESIDUAL_IN:
            from .backend_triton import residual_chunks

            residual_chunks(buf, lay, self.fmt, x, r)  # one pass, the bits of the decode + subtraction below
            return
        deq = scratch(m * lay.k, torch.float32, x.device).view(m, lay.k)
        unpack_chunks(buf, lay, self.fmt, torch.float32, out=deq, backend=kernel)
        subtract_into(x, deq[:, :w], r)

    def unpack_codes(self, buf, lay, codes, scales) -> None:
        unpack_codes(buf, lay, codes, scales)


@dataclass(frozen=True)
class Fp4Codec:
    """MXFP4 / NVFP4 (E2M1 two per byte, block scales; NVFP4 an fp32 scale per chunk), optionally after a block
    Hadamard transform with rank-independent signs; rows padded to whole blocks; no FP8 codes to hand out."""

    fmt: Fp4Format
    hadamard: int = 0
    hadamard_seed: int = 0
    bits: int = 4
    codes_out: bool = False

    @property
    def name(self) -> str:
        return self.fmt.name

    @property
    def block(self) -> int:
        return self.fmt.block

    @property
    def pipelines(self) -> bool:  # NVFP4's chunk scale spans the row; the transform's path is plain torch
        return not self.fmt.two_level and not self.hadamard

    def width(self, k: int) -> int:
        return align(k, self.fmt.block)

    def layout(self, rows: tuple[int, ...], k: int) -> Chunks:
        return fp4_layout(rows, k, self.fmt)

    def kernel(self, backend: str, device: torch.device, numel: int) -> str:
        return fp4_backend(backend, device, numel)

    def pack(self, x2, lay, out, *, rounding, seed, kernel, counters=None) -> None:
        pack_fp4(x2, lay, rounding, seed, self.hadamard, self.hadamard_seed, out=out, backend=kernel, counters=counters)

    def unpack(self, buf, lay, out, *, kernel, scratch=_fresh) -> None:
        if out.dtype == torch.float32:  # decoded straight into out's columns (no padded copy)
            unpack_fp4(buf, lay, self.hadamard, self.hadamard_seed, out=out, backend=kernel)
            return
        m = lay.total_rows
        dec = scratch(m * lay.k, torch.float32, buf.device).view(m, lay.k)
        unpack_fp4(buf, lay, self.hadamard, self.hadamard_seed, out=dec, backend=kernel)
        out.copy_(dec[:, : out.shape[1]])

    def unpack_add(self, buf, lay, out, *, kernel, scratch=_fresh) -> None:
        if kernel == "native" and not self.hadamard and unpack_fp4_add(buf, lay, out):
            return  # decoded and added in one pass
        decode_then_add(self, buf, lay, out, kernel, scratch)

    def unpack_sum(self, buf, lay, out, *, kernel) -> None:
        unpack_fp4_sum(buf, lay, self.hadamard, self.hadamard_seed, out=out, backend=kernel)

    def residual(self, buf, lay, x, r, *, kernel, scratch=_fresh) -> None:
        if not self.hadamard and r.dtype == torch.float32 and x.dtype in _ONE_PASS_RESIDUAL.get(kernel, ()):
            residual_fp4(buf, lay, x, r, kernel)  # one pass, the same bits as the decode + subtraction below
            return
        m, w = x.shape
        deq = scratch(m * lay.k, torch.float32, x.device).view(m, lay.k)
        unpack_fp4(buf, lay, self.hadamard, self.hadamard_seed, out=deq, backend=kernel)
        subtract_into(x, deq[:, :w], r)

    def unpack_codes(self, buf, lay, codes, scales) -> None:
        raise NotImplementedError("a 4-bit wire has no FP8 codes (refused before the call starts)")


def codec_for(fmt: Fp8Format, scaling: Scaling, fp4: Fp4Format | None, hadamard: int, hadamard_seed: int) -> WireCodec:
    """The codec of a resolved wire spec: the one place a format is chosen."""
    if fp4 is not None:
        return Fp4Codec(fp4, hadamard, hadamard_seed)
    return Fp8Codec(fmt, scaling)
