"""Compact error-feedback residuals: the pure-torch reference that defines their bits (encode / decode).

An error-feedback residual (fp8comm.comm.ErrorFeedback) is this rank's quantization error of what it sent, kept
until the next call. Kept in fp32 it costs 4 bytes per gradient element on the sender; the compact form stores
one FP8 code per element plus scales, at most about 1 byte per element:

  "fp8" (the option value, comm.config.RESIDUAL_DTYPES): E5M2 codes, one power-of-two fp32 scale per residual
  tensor (amax-scaled: the smallest 2**E with amax / 2**E <= 57344), nearest-even rounding:
  n + 4 bytes for n elements (1.0000 B per element for any real bucket). Chosen by launch/fp4_loss.py
  (docs/collectives.md, "Compact residuals").

Other layouts the loss study compares (RESIDUAL_FORMATS): E4M3 with one tensor scale (n + 4 bytes), E4M3 with
one E8M0 byte per 128 elements (n + ceil(n / 128) bytes: 1.0078 B per element, over the 1-byte budget).

The bits are the FP8 reference quantizer's (reference.quantize_2d on the flat residual viewed as [1, n]): amax over
the finite values, scale, clamp to the format's max, round to nearest even, cast. Non-finite values are never
clamped away: E5M2 keeps +-inf, every other non-finite value (and any inf in E4M3) becomes NaN, and decode returns
them non-finite. (The error-feedback update itself zeroes non-finite residual entries before they are stored, as
the fp32 residual does: a step that overflowed must not poison later ones; its inf/NaN reach the engine through the
wire, not through the residual.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import Fp8CommError
from .formats import E4M3, E5M2, Fp8Format
from .layout import decode_scales, encode_scales
from .reference import dequantize_2d, quantize_2d
from .scaling import BlockScaling, Scaling, TensorScaling, scale_from_amax


@dataclass(frozen=True)
class ResidualFormat:
    """One compact residual layout: FP8 codes of `fmt`, scaled per tensor (block None: one power-of-two fp32
    scale) or per `block` consecutive elements (one E8M0 byte each)."""

    name: str
    fmt: Fp8Format
    block: int | None = None

    @property
    def scaling(self) -> Scaling:
        return TensorScaling("pow2") if self.block is None else BlockScaling(self.block, encoding="e8m0")

    def scale_bytes(self, n: int) -> int:
        """Bytes of the scales of an n-element residual."""
        return 4 if self.block is None else -(-n // self.block)

    def nbytes(self, n: int) -> int:
        """Bytes an n-element residual occupies: one code per element plus its scales."""
        return n + self.scale_bytes(n)

    def describe(self) -> str:
        scale = "one power-of-two fp32 scale per tensor" if self.block is None else f"1x{self.block} E8M0 scales"
        return f"{self.fmt.name} codes, {scale}"


COMPACT = ResidualFormat("fp8", E5M2)  # the option value "fp8"
RESIDUAL_FORMATS = {
    "fp8": COMPACT,
    "e5m2": ResidualFormat("e5m2", E5M2),  # candidate (a), the same bits as "fp8"
    "e4m3": ResidualFormat("e4m3", E4M3),
    "e4m3-b128": ResidualFormat("e4m3-b128", E4M3, 128),  # candidate (b): 1.0078 B per element
}


def get_residual_format(f: str | ResidualFormat) -> ResidualFormat:
    if isinstance(f, ResidualFormat):
        return f
    if f in RESIDUAL_FORMATS:
        return RESIDUAL_FORMATS[f]
    raise Fp8CommError(f"unknown compact residual format {f!r}; valid: {', '.join(RESIDUAL_FORMATS)}")


def encode_residual(r: torch.Tensor, f: ResidualFormat = COMPACT) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat residual (any float dtype, n elements) -> (codes uint8 [n], scale bytes uint8 [f.scale_bytes(n)])."""
    if r.dim() != 1 or not r.is_floating_point():
        raise Fp8CommError(f"a residual to encode is a flat float tensor, got {r.dtype} of shape {tuple(r.shape)}")
    if f.block is None and r.numel():
        return _encode_tensor_scaled(r, f)
    return encode_residual_reference(r, f)


def encode_residual_reference(r: torch.Tensor, f: ResidualFormat = COMPACT) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_residual by the FP8 reference quantizer (every layout): the bits every faster path must give."""
    x2 = r.float().view(1, -1)
    codes, scale, _ = quantize_2d(x2, f.fmt, f.scaling)
    return codes.view(-1), encode_scales(scale.view(-1), f.scaling).view(-1)


def _encode_tensor_scaled(r: torch.Tensor, f: ResidualFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor scale: the reference's bits in a few passes (it rounds onto the grid by hand in many): torch's
    cast to the FP8 dtype rounds |x / scale| <= max to nearest even onto the same grid (tested against the
    reference, subnormal codes, signed zeros and non-finite values included); non-finite values as the reference
    treats them (E5M2 keeps +-inf, any other non-finite value becomes the NaN code)."""
    x = r.float()
    a = x.abs()
    m = a.max()
    # The max is finite iff every value is. On CPU reading it costs nothing and lets the all-finite case skip the
    # masking passes; on a GPU that read would be a host sync per call, so there the masking always runs (a no-op
    # on finite values: the same bits).
    finite = x.device.type == "cpu" and bool(torch.isfinite(m))
    if not finite:
        a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype))
        m = a.max()
    scale = scale_from_amax(m.view(1, 1), f.fmt, f.scaling)
    y = torch.div(x, scale.view(()))
    y.clamp_(-f.fmt.max, f.fmt.max)
    if not finite:
        nan = float("nan")
        special = torch.where(torch.isnan(x), nan, x) if f.fmt.has_inf else torch.full_like(x, nan)
        y = torch.where(torch.isfinite(x), y, special)
    codes = y.to(f.fmt.dtype).view(torch.uint8)
    return codes, encode_scales(scale.view(-1), f.scaling).view(-1)


def decode_residual(
    codes: torch.Tensor, scales: torch.Tensor, f: ResidualFormat = COMPACT, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of encode_residual: fp32 [n] (into `out` when given); non-finite codes decode non-finite."""
    n = codes.numel()
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.numel() != f.scale_bytes(n):
        raise Fp8CommError(
            f"a {f.name} residual of {n} elements is uint8 codes plus {f.scale_bytes(n)} uint8 scale bytes, got "
            f"{codes.dtype} codes and {scales.numel()} {scales.dtype} scale bytes"
        )
    scale = decode_scales(scales.contiguous(), f.scaling).view(1, -1)
    if f.block is None and (out is None or out.dtype == torch.float32):  # code value * scale, in two passes
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=codes.device)
        out.copy_(codes.view(f.fmt.dtype))
        return out.mul_(scale.view(()))
    deq = dequantize_2d(codes.view(1, -1), scale, f.fmt, f.scaling).view(-1)
    if out is None:
        return deq
    return out.copy_(deq)
