"""Fp8Tensor: FP8 codes plus block scales, enough to dequantize or to pack into one wire buffer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import Fp8CommError
from .dispatch import resolve_backend
from .formats import Fp8Format, get_format
from .layout import align, decode_scales, encode_scales, view_2d
from .scaling import Scaling


@dataclass(repr=False)
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

    def __repr__(self) -> str:
        return (
            f"Fp8Tensor(shape={tuple(self.shape)}, fmt={self.fmt.name}, scaling={self.scaling.describe()}, "
            f"dtype={self.dtype}, device={self.data.device})"
        )

    def codes_2d(self) -> torch.Tensor:
        return self.data.view(torch.uint8).reshape(view_2d(self.shape))

    def dequantize(self, dtype: torch.dtype | None = torch.float32, backend: str = "auto") -> torch.Tensor:
        """data * scale in `dtype` (None: the original dtype), shaped like the quantized tensor."""
        dtype = self.dtype if dtype is None else dtype
        m, k = view_2d(self.shape)
        if tuple(self.scale.shape) != self.scaling.scale_shape(m, k):
            raise Fp8CommError(
                f"Fp8Tensor scale has shape {tuple(self.scale.shape)}, expected "
                f"{self.scaling.scale_shape(m, k)} for {self.scaling.describe()} blocks of shape "
                f"{tuple(self.shape)}"
            )
        b = resolve_backend(backend, self.data.device, self.data.numel())
        return b.dequantize_2d(self.codes_2d(), self.scale, self.fmt, self.scaling, dtype).reshape(self.shape)

    def scale_e8m0(self) -> torch.Tensor:
        """The scales as torch.float8_e8m0fnu (only for power-of-two encodings)."""
        if self.scaling.encoding == "fp32":
            raise Fp8CommError("fp32-encoded scales are not powers of two; E8M0 needs pow2 or e8m0 encoding")
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
            raise Fp8CommError(f"pack buffer must be uint8 with >= {self.packed_size()} bytes")
        buf[:n] = self.data.reshape(-1).view(torch.uint8)
        off = align(n)
        buf[off : off + ns * self.scaling.scale_bytes] = encode_scales(self.scale.reshape(-1), self.scaling)
        return buf

    @classmethod
    def unpack(cls, buf: torch.Tensor, shape, dtype: torch.dtype, fmt, scaling: Scaling) -> Fp8Tensor:
        """Inverse of pack(): `shape`, `dtype`, `fmt` and `scaling` travel out of band (both sides know them)."""
        fmt = get_format(fmt)
        shape = torch.Size(shape)
        m, k = view_2d(shape)
        mb, kb = scaling.scale_shape(m, k)
        n = shape.numel()
        need = align(n) + align(mb * kb * scaling.scale_bytes)
        if buf.dtype != torch.uint8 or buf.numel() < need:
            raise Fp8CommError(f"unpack buffer must be uint8 with >= {need} bytes, got {buf.dtype} x {buf.numel()}")
        data = buf[:n].view(fmt.dtype).reshape(shape)
        off = align(n)
        scale = decode_scales(buf[off : off + mb * kb * scaling.scale_bytes], scaling).reshape(mb, kb)
        return cls(data, scale, fmt, scaling, dtype)
