"""FP8 element formats (OCP E4M3/E5M2) and the E8M0 scale format, looked up by name.

A format knows its torch dtype, its largest finite value and its grid (mantissa bits, smallest exponent), which is
all the quantizer needs to clamp, round and encode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import Fp8CommError


@dataclass(frozen=True)
class Fp8Format:
    """One 8-bit floating-point format: `dtype` holds its codes, `max` is its largest finite magnitude."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal_exp: int  # exponent of the smallest normal number
    has_inf: bool

    @property
    def min_subnormal_exp(self) -> int:
        """Exponent of the smallest subnormal: the spacing of the grid below the smallest normal."""
        return self.min_normal_exp - self.mantissa_bits

    @property
    def max_exp(self) -> int:
        """Exponent of the largest binade holding finite values."""
        import math

        return math.frexp(self.max)[1] - 1

    def __str__(self) -> str:
        return self.name


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -6, has_inf=False)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -14, has_inf=True)

# E8M0 holds a bare power of two 2**(b - 127); code 255 is NaN. Used for MX and power-of-two scales.
E8M0_DTYPE = torch.float8_e8m0fnu
E8M0_MIN_EXP = -126  # we never emit 2**-127 so that every scale is a normal fp32 number (no flush-to-zero hazard)
E8M0_MAX_EXP = 127

FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
FLOAT8_DTYPES = frozenset(
    {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu}
)
_ALIASES = {"e4m3fn": "e4m3", "float8_e4m3fn": "e4m3", "fp8_e4m3": "e4m3", "float8_e5m2": "e5m2", "fp8_e5m2": "e5m2"}


def get_format(fmt: str | Fp8Format | torch.dtype) -> Fp8Format:
    """Return the format named by `fmt` ("e4m3", "e5m2", a torch float8 dtype, or a format itself)."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise Fp8CommError(f"unknown FP8 format {fmt}; valid: {', '.join(FORMATS)}")
    if isinstance(fmt, str):
        key = _ALIASES.get(fmt.lower(), fmt.lower())
        if key in FORMATS:
            return FORMATS[key]
    raise Fp8CommError(f"unknown FP8 format {fmt!r}; valid: {', '.join(FORMATS)} (or their torch float8 dtypes)")


def div_exact(x: torch.Tensor, divisor: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x / divisor (into `out`, which may be x), correctly rounded on every device. CUDA turns a Python divisor into a
    multiply by its reciprocal, which can differ in the last bit (1/448, 1/3); a 0-dim tensor on x's device does not."""
    return torch.div(x, x.new_full((), divisor), out=out)
