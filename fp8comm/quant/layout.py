"""Byte layout of FP8 data: the [M, K] view, 16-byte alignment, wire chunks and the wire encoding of scales.

Pure shape and byte arithmetic shared by every backend and by Fp8Tensor; nothing here runs a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import accumulate

import torch

from ..errors import Fp8CommError
from .scaling import Scaling

ALIGN = 16


def align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def starts(sizes) -> tuple[int, ...]:
    """Where each of consecutive sections of these sizes starts (the exclusive prefix sums)."""
    return tuple(accumulate(sizes, initial=0))[:-1]


def view_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The [M, K] view every layout is defined on: K is the last dim, M the product of the others (0-d: 1x1)."""
    if len(shape) == 0:
        return 1, 1
    k = shape[-1]
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, k


def encode_scales(scale: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """fp32 scales -> wire bytes: 4 bytes each, or the E8M0 biased exponent (one byte) for e8m0."""
    scale = scale.float().contiguous()
    if scaling.encoding == "e8m0":
        return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return scale.view(torch.uint8)


# The two E8M0 bytes that are not an fp32 normal exponent (OCP MX spec): 0 is 2**-127, an fp32 subnormal, and
# 255 is NaN. fp8comm never emits either (scales lie in [2**-126, 2**127]); other producers do (TE and torchao
# write 0 for all-zero or tiny blocks, torchao 255 for non-finite ones).
E8M0_MIN_BITS = 0x00400000  # fp32 bits of 2**-127
E8M0_NAN_BITS = 0x7FC00000  # fp32 bits of the quiet NaN that byte 255 decodes to


def decode_e8m0(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> fp32 per the OCP MX spec: 2**(b - 127), byte 0 -> 2**-127, byte 255 -> NaN."""
    b = b.to(torch.int32)
    bits = torch.where(b == 0, E8M0_MIN_BITS, b << 23)
    return torch.where(b == 255, E8M0_NAN_BITS, bits).view(torch.float32)


def decode_scales(b: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """Inverse of encode_scales: wire bytes -> fp32 scales (E8M0 bytes per decode_e8m0)."""
    if scaling.encoding == "e8m0":
        return decode_e8m0(b)
    return b.contiguous().view(torch.float32)


class Chunks:
    """Where the chunks of a wire layout start, from its `rows` per chunk and `chunk_bytes` (shared by the FP8 and
    4-bit layouts)."""

    rows: tuple[int, ...]
    k: int

    @property
    def chunk_bytes(self) -> tuple[int, ...]:
        raise NotImplementedError  # each layout says what its chunks hold

    def payload_bytes(self, c: int) -> int:
        raise NotImplementedError  # chunk c's codes section, aligned: its scales follow (the Triton chunk tables)

    @property
    def kb(self) -> int:
        raise NotImplementedError  # scale blocks per row

    def with_rows(self, rows) -> Chunks:
        raise NotImplementedError  # the same layout for other chunk rows

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return starts(self.chunk_bytes)

    @cached_property
    def row_starts(self) -> tuple[int, ...]:
        return starts(self.rows)

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(self.chunk_bytes)


@dataclass(frozen=True)
class ChunkLayout(Chunks):
    """Byte layout of `rows` (a row count per chunk) of width `k`, blocked 1 x scaling.cols along k."""

    rows: tuple[int, ...]
    k: int
    scaling: Scaling

    def __post_init__(self) -> None:
        if self.scaling.rows != 1:
            raise Fp8CommError(f"wire chunks need 1xB blocks (rows=1), got {self.scaling.describe()}")
        if any(r < 0 for r in self.rows):
            raise Fp8CommError(f"chunk row counts must be >= 0, got {self.rows}")

    @property
    def block(self) -> int:
        return self.scaling.cols if self.scaling.cols is not None else max(self.k, 1)

    @property
    def kb(self) -> int:
        """Scales per row."""
        return -(-self.k // self.block) if self.k else 0

    def payload_bytes(self, c: int) -> int:
        return align(self.rows[c] * self.k)

    def scale_bytes(self, c: int) -> int:
        return align(self.rows[c] * self.kb * self.scaling.scale_bytes)

    @cached_property
    def chunk_bytes(self) -> tuple[int, ...]:
        return tuple(self.payload_bytes(c) + self.scale_bytes(c) for c in range(len(self.rows)))

    def chunk(self, c: int) -> ChunkLayout:
        """Chunk c alone: its bytes are the same as at offsets[c] here (every chunk is aligned on its own)."""
        return layout_of((self.rows[c],), self.k, self.scaling)

    def with_rows(self, rows) -> ChunkLayout:
        return layout_of(tuple(int(r) for r in rows), self.k, self.scaling)


@lru_cache(maxsize=4096)
def layout_of(rows: tuple[int, ...], k: int, scaling: Scaling) -> ChunkLayout:
    """ChunkLayout(rows, k, scaling), shared per process: steady-state calls repeat their layouts, and a shared
    one keeps its computed offsets (host time per call matters next to a GPU collective's ~30 us)."""
    return ChunkLayout(rows, k, scaling)
