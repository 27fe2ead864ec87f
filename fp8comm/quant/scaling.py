"""Scaling recipes: where the scales live (block layout) and how each scale is computed and encoded.

Every scale is a *dequantization* multiplier: x ~= fp8_code * scale.  Current scaling derives it from the amax of
the finite values in the block; delayed and constant scaling hand a fixed scale to `quantize(..., scale=...)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import Fp8CommError, Fp8CommTypeError
from .formats import E8M0_MAX_EXP, E8M0_MIN_EXP, Fp8Format, div_exact

ENCODINGS = ("fp32", "pow2", "e8m0")
"""fp32: exact amax/max scale. pow2: a power of two (with `margin`), stored as fp32. e8m0: a power of two, one byte."""


@dataclass(frozen=True)
class Scaling:
    """Scales over blocks of `rows` x `cols` elements of the [M, K] view (K = last dim); None = the whole extent.

    `encoding` picks the scale values (see ENCODINGS); `margin` divides the scale's headroom by 2**margin more
    (the seed paper's FP8-AMAX margin; for fp32 scales it multiplies the scale by 2**margin).
    """

    rows: int | None = 1
    cols: int | None = 128
    encoding: str = "fp32"
    margin: int = 0

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise Fp8CommError(f"invalid block size: {name}={v!r}; expected a positive int or None (whole extent)")
        if self.encoding not in ENCODINGS:
            raise Fp8CommError(f"unknown scale encoding {self.encoding!r}; valid: {', '.join(ENCODINGS)}")
        if not isinstance(self.margin, int) or abs(self.margin) > 64:
            raise Fp8CommError(f"invalid margin {self.margin!r}; expected an int in [-64, 64]")

    @property
    def scale_bytes(self) -> int:
        """Bytes per scale on the wire."""
        return 1 if self.encoding == "e8m0" else 4

    def block_shape(self, m: int, k: int) -> tuple[int, int]:
        """The concrete block extents for an [m, k] view (whole extents become the view's size, at least 1)."""
        return (self.rows if self.rows is not None else max(m, 1), self.cols if self.cols is not None else max(k, 1))

    def scale_shape(self, m: int, k: int) -> tuple[int, int]:
        br, bc = self.block_shape(m, k)
        return (-(-m // br) if self.rows is not None else 1, -(-k // bc) if self.cols is not None else 1)

    def describe(self) -> str:
        r = "M" if self.rows is None else self.rows
        c = "K" if self.cols is None else self.cols
        m = f", margin {self.margin}" if self.margin else ""
        return f"{r}x{c} {self.encoding}{m}"


def TensorScaling(encoding: str = "fp32", margin: int = 0) -> Scaling:
    """One scale for the whole tensor (current scaling; pow2 + margin is the seed paper's FP8-AMAX)."""
    return Scaling(None, None, encoding, margin)


def RowScaling(encoding: str = "fp32", margin: int = 0) -> Scaling:
    """One scale per row of the [M, K] view."""
    return Scaling(1, None, encoding, margin)


def BlockScaling(cols: int = 128, rows: int = 1, encoding: str = "fp32", margin: int = 0) -> Scaling:
    """One scale per `rows` x `cols` block: 1x128 for activations/gradients, 128x128 for weights."""
    return Scaling(rows, cols, encoding, margin)


def MXScaling() -> Scaling:
    """MXFP8: 1x32 blocks with E8M0 scales, rounded so the block max never overflows."""
    return Scaling(1, 32, "e8m0", 0)


PRESETS = {
    "tensor": TensorScaling(),
    "tensor_pow2": TensorScaling("pow2"),
    "fp8_amax": TensorScaling("pow2", margin=0),
    "row": RowScaling(),
    "block": BlockScaling(128),
    "block2d": BlockScaling(128, 128),
    "block_e8m0": BlockScaling(128, encoding="e8m0"),
    "mxfp8": MXScaling(),
}


def get_scaling(s: str | Scaling) -> Scaling:
    if isinstance(s, Scaling):
        return s
    if isinstance(s, str) and s in PRESETS:
        return PRESETS[s]
    raise Fp8CommError(f"unknown scaling {s!r}; valid presets: {', '.join(PRESETS)} (or a Scaling object)")


def pow2_scale_exponent(amax: torch.Tensor, fmt: Fp8Format, margin: int) -> torch.Tensor:
    """Exponent E of the power-of-two scale 2**E: the smallest with amax / 2**E <= fmt.max, plus margin.

    Exact (frexp, no log2 rounding); clamped to the E8M0 range we emit, [-126, 127]; amax == 0 gives E = 0.
    """
    m, k = torch.frexp(amax.float())
    fm, fk = math.frexp(fmt.max)
    e = k.to(torch.int32) - fk + (m > fm).to(torch.int32) + margin
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def scale_from_amax(amax: torch.Tensor, fmt: Fp8Format, scaling: Scaling) -> torch.Tensor:
    """fp32 dequantization scales from block amax (finite values only). amax == 0 gives 1.0, never 0 or inf."""
    amax = amax.float()
    if scaling.encoding == "fp32":
        s = div_exact(amax, fmt.max)
        if scaling.margin:
            s = s * (2.0**scaling.margin)
        # A normal-range floor keeps every scale a normal fp32 number (GPU flush-to-zero would change bits).
        s = torch.clamp(s, min=2.0**E8M0_MIN_EXP, max=2.0**E8M0_MAX_EXP)
        return torch.where(amax > 0, s, torch.ones_like(s))
    return torch.ldexp(torch.ones_like(amax), pow2_scale_exponent(amax, fmt, scaling.margin))


def check_scale(scale: torch.Tensor | float, expected_shape: tuple[int, int], scaling: Scaling) -> torch.Tensor:
    """Validate a caller-supplied scale tensor (constant/delayed scaling) and return it as fp32 [mb, kb].

    Shape and dtype are always checked. Values (finite, > 0, powers of two for pow2/e8m0) are checked for host
    scales only: reading a device tensor's values would be a host-device sync on every quantize (Fp8Linear's
    delayed and constant scales live on the device and are finite powers of two by construction)."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale), dtype=torch.float32)
    if not scale.is_floating_point():
        raise Fp8CommTypeError(f"scale must be a floating tensor, got {scale.dtype}")
    s = scale.float()
    if s.numel() == 1 and expected_shape == (1, 1):
        s = s.reshape(1, 1)
    if tuple(s.shape) != tuple(expected_shape):
        raise Fp8CommError(
            f"scale tensor has shape {tuple(scale.shape)}, expected {tuple(expected_shape)} for {scaling.describe()} "
            "blocks of this input"
        )
    if s.device.type != "cpu":
        return s
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise Fp8CommError("scale must be finite and > 0 everywhere")
    if scaling.encoding != "fp32":
        _, e = torch.frexp(s)
        if not bool((torch.ldexp(torch.ones_like(s), e - 1) == s).all()):
            raise Fp8CommError(f"{scaling.encoding} scaling needs power-of-two scales")
    return s


@dataclass
class DelayedScaling:
    """Per-tensor delayed scaling: the scale comes from a history of past amax values (torchao/TE style).

    Call `scale(fmt)` before quantizing and `update(q.amax)` after; `state_dict()` round-trips the history.
    """

    history_len: int = 16
    reduce: str = "max"  # "max" over the history, or "most_recent"
    margin: int = 0
    encoding: str = "fp32"
    history: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise Fp8CommError(f"history_len must be >= 1, got {self.history_len}")
        if self.reduce not in ("max", "most_recent"):
            raise Fp8CommError(f"unknown amax reduction {self.reduce!r}; valid: max, most_recent")
        if self.history is None:
            self.history = torch.zeros(self.history_len, dtype=torch.float32)

    @property
    def scaling(self) -> Scaling:
        return TensorScaling(self.encoding, self.margin)

    def amax(self) -> torch.Tensor:
        return self.history.max() if self.reduce == "max" else self.history[0]

    def scale(self, fmt: Fp8Format) -> torch.Tensor:
        """The scale to quantize with now (1.0 before any amax was recorded)."""
        return scale_from_amax(self.amax().reshape(1, 1), fmt, self.scaling)

    def update(self, amax: torch.Tensor) -> None:
        """Push the amax just observed (non-finite amax values are not recorded)."""
        a = amax.detach().float().reshape(-1).max().to(self.history.device)
        # no host read of the value (a device sync): a non-finite amax leaves the history as it was
        pushed = torch.cat([a.reshape(1), self.history[:-1]])
        self.history = torch.where(torch.isfinite(a), pushed, self.history)

    def state_dict(self) -> dict:
        return {"history": self.history.clone(), "history_len": self.history_len, "reduce": self.reduce}

    def load_state_dict(self, sd: dict) -> None:
        h = sd["history"]
        if h.numel() != self.history_len:
            raise Fp8CommError(f"amax history has {h.numel()} entries, this DelayedScaling keeps {self.history_len}")
        self.history = h.clone().float()
