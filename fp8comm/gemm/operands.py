"""What the GEMM backends need to know about one FP8 operand: its scale layout, transposition and validity."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import Fp8CommError
from ..quant import Fp8Tensor, Scaling


def scale_kind(q: Fp8Tensor) -> str:
    """tensor | row | block1x128 | block128x128 | mx32 | other: the scale layout of one GEMM operand."""
    sc = q.scaling
    if sc.rows is None and sc.cols is None:
        return "tensor"
    if sc.rows == 1 and sc.cols is None:
        return "row"
    if sc.cols == 128 and sc.rows in (1, 128) and sc.encoding != "e8m0":
        return f"block{sc.rows}x128"
    if sc.cols == 32 and sc.rows == 1 and sc.encoding == "e8m0":
        return "mx32"
    return "other"


def transpose(q: Fp8Tensor, contiguous: bool = False) -> Fp8Tensor:
    """The transposed operand with the same codes (valid for transpose-invariant scaling: tensor or square blocks);
    a view, or with `contiguous` a copy laid out row-major (what _scaled_mm wants)."""
    sc = q.scaling
    if not (sc.rows is None and sc.cols is None) and sc.rows != sc.cols:
        raise Fp8CommError(f"{sc.describe()} scales are not transpose-invariant; quantize the transpose instead")
    data = q.data.t().contiguous() if contiguous else q.data.t()
    return Fp8Tensor(
        data,
        q.scale.t(),
        q.fmt,
        Scaling(sc.cols, sc.rows, sc.encoding, sc.margin),
        q.dtype,
        None if q.amax is None else q.amax.t(),
    )


def check_operands(a: Fp8Tensor, b: Fp8Tensor) -> None:
    """Clear errors for operands no backend can multiply as a @ b.T (rank, K, device, scale shapes)."""
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise Fp8CommError(f"scaled GEMM needs 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[1]:
        raise Fp8CommError(f"contraction dims differ: a {tuple(a.shape)} vs b {tuple(b.shape)} (computing a @ b.T)")
    if a.data.device != b.data.device:
        raise Fp8CommError(f"operands on different devices: {a.data.device} and {b.data.device}")
    for name, q in (("a", a), ("b", b)):
        m, k = q.shape
        if tuple(q.scale.shape) != q.scaling.scale_shape(m, k):
            raise Fp8CommError(
                f"operand {name}: scale shape {tuple(q.scale.shape)} does not match "
                f"{q.scaling.describe()} blocks of {tuple(q.shape)}"
            )


def row_scales(q: Fp8Tensor) -> tuple[torch.Tensor, int]:
    """Scales expanded to one row per operand row -> ([rows, kb] fp32, K-extent of one scale column)."""
    r, k = q.shape
    br, bc = q.scaling.block_shape(r, k)
    s = q.scale.float()
    if s.shape[0] == 1:  # one scale row (per tensor, or a single block row): broadcast
        return s.expand(r, s.shape[1]), bc
    if br > 1:
        s = s.repeat_interleave(br, 0)[:r]
    return s, bc


def pad_to(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """t [r, c] padded at the end to [rows, cols] (FP8 codes with zero bytes, +0; others with `value`)."""
    r, c = t.shape
    if r == rows and c == cols:
        return t
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:  # float8: pad the raw bytes (0x00 is +0)
        return F.pad(t.view(torch.uint8), (0, cols - c, 0, rows - r)).view(t.dtype)
    return F.pad(t, (0, cols - c, 0, rows - r), value=value)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
