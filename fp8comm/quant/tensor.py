"""Fp8Tensor: FP8 codes plus block scales, enough to dequantize or to pack into one wire buffer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Fp8Format, get_format
from .scaling import Scaling

ALIGN = 16


def align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def view_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The [M, K] view every layout is defined on: K is the last dim, M the product of the others (0-d: 1x1)."""
    if len(shape) == 0:
        return 1, 1
    k = shape[-1]
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, k


@dataclass
class Fp8Tensor:
    """FP8 `data` (torch float8, the input's shape) with fp32 `scale` per block of the [M, K] view.

    `dequantize()` gives back data * scale in the original dtype; `pack()` writes payload then scales into one
    16-byte-aligned uint8 buffer, `Fp8Tensor.unpack()` reads it back.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: Fp8Format
    scaling: Scaling
    dtype: torch.dtype
    amax: torch.Tensor | None = None  # fp32 [mb, kb]: block amax of the finite input values

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def codes_2d(self) -> torch.Tensor:
        return self.data.view(torch.uint8).reshape(view_2d(self.shape))

    def dequantize(self, dtype: torch.dtype | None = torch.float32, backend: str = "auto") -> torch.Tensor:
        from .api import dequantize

        return dequantize(self, dtype=dtype, backend=backend)

    def scale_e8m0(self) -> torch.Tensor:
        """The scales as torch.float8_e8m0fnu (only for power-of-two encodings)."""
        if self.scaling.encoding == "fp32":
            raise ValueError("fp32-encoded scales are not powers of two; E8M0 needs pow2 or e8m0 encoding")
        return self.scale.to(torch.float8_e8m0fnu)

    def nonfinite_count(self) -> int:
        """Number of elements whose code is inf or NaN (they dequantize to non-finite)."""
        return int((~torch.isfinite(self.data.float())).sum())

    def nbytes(self) -> int:
        """Bytes of payload plus scales as packed (without alignment padding)."""
        return self.data.numel() + self.scale.numel() * self.scaling.scale_bytes

    def packed_size(self) -> int:
        return align(self.data.numel()) + align(self.scale.numel() * self.scaling.scale_bytes)

    def pack(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Payload (codes) then scales (fp32 bytes, or one E8M0 byte each), each section 16-byte aligned."""
        n, ns = self.data.numel(), self.scale.numel()
        buf = out if out is not None else torch.zeros(self.packed_size(), dtype=torch.uint8, device=self.data.device)
        if buf.dtype != torch.uint8 or buf.numel() < self.packed_size():
            raise ValueError(f"pack buffer must be uint8 with >= {self.packed_size()} bytes")
        buf[:n] = self.data.reshape(-1).view(torch.uint8)
        off = align(n)
        buf[off:off + ns * self.scaling.scale_bytes] = encode_scales(self.scale.reshape(-1), self.scaling)
        return buf

    @classmethod
    def unpack(cls, buf: torch.Tensor, shape, dtype: torch.dtype, fmt, scaling: Scaling) -> "Fp8Tensor":
        """Inverse of pack(): `shape`, `dtype`, `fmt` and `scaling` travel out of band (both sides know them)."""
        fmt = get_format(fmt)
        shape = torch.Size(shape)
        m, k = view_2d(shape)
        mb, kb = scaling.scale_shape(m, k)
        n = shape.numel()
        need = align(n) + align(mb * kb * scaling.scale_bytes)
        if buf.dtype != torch.uint8 or buf.numel() < need:
            raise ValueError(f"unpack buffer must be uint8 with >= {need} bytes, got {buf.dtype} x {buf.numel()}")
        data = buf[:n].view(fmt.dtype).reshape(shape)
        off = align(n)
        scale = decode_scales(buf[off:off + mb * kb * scaling.scale_bytes], scaling).reshape(mb, kb)
        return cls(data, scale, fmt, scaling, dtype)


def encode_scales(scale: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """fp32 scales -> wire bytes: 4 bytes each, or the E8M0 biased exponent (one byte) for e8m0."""
    scale = scale.float().contiguous()
    if scaling.encoding == "e8m0":
        return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return scale.view(torch.uint8)


def decode_scales(b: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    if scaling.encoding == "e8m0":
        return (b.to(torch.int32) << 23).view(torch.float32)
    return b.contiguous().view(torch.float32)
