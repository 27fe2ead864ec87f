"""WireConfig: one frozen, validated description of how a collective quantizes, and the lists of valid values.

Every collective, `Buffer` and the engine adapters take a WireConfig (keyword options are a convenience on top:
`all_gather(x, fmt="e5m2")` is `all_gather(x, config=WireConfig(fmt="e5m2"))`). The valid values of every field
are written here once; the adapters' configs and flags import them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from functools import cached_property, lru_cache

import torch

from ..errors import Fp8CommConfigError
from ..quant.api import ROUNDINGS
from ..quant.codec import WireCodec, codec_for
from ..quant.dispatch import BACKENDS
from ..quant.formats import E4M3, Fp8Format, get_format
from ..quant.formats import FORMATS as _FORMATS
from ..quant.fp4 import FP4_FORMATS, HADAMARD_SIZES, Fp4Format
from ..quant.residual import COMPACT
from ..quant.scaling import ENCODINGS, PRESETS, Scaling

FP8_FORMATS = tuple(_FORMATS)
FP4_WIRE_FORMATS = tuple(FP4_FORMATS)  # block and scale kind are part of the format (docs/fp4.md)
FORMATS = FP8_FORMATS + FP4_WIRE_FORMATS
HADAMARD = (0, *HADAMARD_SIZES)
SCALE_ENCODINGS = ENCODINGS  # fp32 (amax / max), pow2 (power of two as fp32), e8m0 (power of two, one byte)
KERNEL_BACKENDS = ("auto", *BACKENDS)
CHECK_POLICIES = ("first", "always", "never")
# Error-feedback residual precision: float32 (4 bytes per element), bfloat16 (2), fp8 (E5M2 codes with one
# power-of-two fp32 scale per residual tensor: n + 4 bytes, quant/residual.py). One spelling in every adapter;
# the older ones stay accepted (DeepSpeed's and Megatron's "fp32"/"bf16").
RESIDUAL_DTYPES = ("float32", "bfloat16", "fp8")
RESIDUAL_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
CHECK_ENV = "FP8COMM_CHECK"
_CHECK_ALIASES = {
    "": "first",
    "first": "first",
    "always": "always",
    "1": "always",
    "on": "always",
    "true": "always",
    "yes": "always",
    "never": "never",
    "0": "never",
    "off": "never",
    "false": "never",
    "no": "never",
}
PIPELINE_MAX_PIECES = 1024


@dataclass(frozen=True)
class WireSpec:
    """The resolved form the kernels use: FP8 format, 1xB block scaling, rounding and kernel backend; for a 4-bit
    wire `fp4` is its format (fmt and scaling then only describe it) and `hadamard` the transform block (0: none)."""

    fmt: Fp8Format
    scaling: Scaling
    rounding: str
    backend: str
    fp4: Fp4Format | None = None
    hadamard: int = 0
    hadamard_seed: int = 0

    @property
    def wire_name(self) -> str:
        return self.fp4.name if self.fp4 is not None else self.fmt.name

    @cached_property
    def codec(self) -> WireCodec:
        """The wire format's codec (quant.codec): everything comm/ does with the bits goes through it."""
        return codec_for(self.fmt, self.scaling, self.fp4, self.hadamard, self.hadamard_seed)


@dataclass(frozen=True)
class WireConfig:
    """How a collective quantizes. fmt: FP8 format; scaling: scale encoding of each 1 x block_size block (or a
    preset / Scaling with rows=1); rounding: nearest or stochastic; backend: quant kernels (auto: Triton on CUDA,
    torch.compile for big CPU buffers); check: the metadata-check policy (None: FP8COMM_CHECK, default "first");
    pipeline: pieces per call (None/"auto" from the size, False/1 one piece, n pieces); error_feedback: engines
    keep a residual per bucket (pass its ErrorFeedback state on each call), residual_dtype its precision.
    fmt="mxfp4" | "nvfp4": the 4-bit wire (docs/fp4.md); its block and scale kind are the format's, so block_size
    and scaling are ignored at their defaults and must agree otherwise; hadamard=16|32 applies the block Hadamard
    transform before quantizing (4-bit only), its random signs drawn from hadamard_seed (the same on every rank)."""

    fmt: str = "e4m3"
    scaling: str | Scaling = "fp32"
    block_size: int | None = 128
    rounding: str = "nearest"
    backend: str = "auto"
    check: str | bool | None = None  # True: "always", False: "never"
    pipeline: int = 0
    error_feedback: bool = False
    residual_dtype: str = "float32"
    hadamard: int = 0
    hadamard_seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.fmt, str) and self.fmt.lower() in FP4_WIRE_FORMATS:
            object.__setattr__(self, "fmt", self.fmt.lower())
        else:
            try:
                object.__setattr__(self, "fmt", get_format(self.fmt).name)
            except ValueError:
                raise _bad("fmt", self.fmt, FORMATS) from None
        _check_fp4_fields(self)
        if self.block_size is not None and (
            not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0
        ):
            raise Fp8CommConfigError(f"block_size must be a positive int (elements per scale), got {self.block_size!r}")
        _block_scaling(self.scaling, self.block_size)  # validates scaling (and its rows)
        if self.rounding not in ROUNDINGS:
            raise _bad("rounding", self.rounding, ROUNDINGS)
        if self.backend not in KERNEL_BACKENDS:
            raise _bad("backend", self.backend, KERNEL_BACKENDS)
        if isinstance(self.check, bool):
            object.__setattr__(self, "check", "always" if self.check else "never")
        if self.check is not None and self.check not in CHECK_POLICIES:
            raise _bad("check", self.check, ("None", "True", "False", *CHECK_POLICIES))
        object.__setattr__(self, "pipeline", _pieces(self.pipeline))
        if not isinstance(self.error_feedback, bool):
            raise Fp8CommConfigError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        object.__setattr__(self, "residual_dtype", residual_dtype_name(self.residual_dtype))

    @property
    def is_fp4(self) -> bool:
        return self.fmt in FP4_WIRE_FORMATS

    @cached_property
    def spec(self) -> WireSpec:
        if self.is_fp4:
            f = FP4_FORMATS[self.fmt]
            sc = Scaling(1, f.block, "e8m0" if f.scale == "e8m0" else "fp32")  # descriptive only
            return WireSpec(E4M3, sc, self.rounding, self.backend, f, self.hadamard, self.hadamard_seed)
        return WireSpec(
            get_format(self.fmt), _block_scaling(self.scaling, self.block_size), self.rounding, self.backend
        )

    @property
    def residual_torch_dtype(self) -> torch.dtype:
        """The residual's torch dtype (float32, bfloat16; uint8 for the compact "fp8" codes)."""
        return torch.uint8 if self.residual_dtype == "fp8" else getattr(torch, self.residual_dtype)

    def replace(self, **options) -> WireConfig:
        """A copy with some fields replaced; an unknown field name is a clear error (a typo never goes unseen)."""
        return _with(self, options)

    def describe(self) -> str:
        s = self.spec
        if s.fp4 is not None:
            out = f"{s.fp4.name} (E2M1, 1x{s.fp4.block} {s.fp4.scale.upper()} scales)"
            if s.hadamard:
                out += f", Hadamard {s.hadamard}"
        else:
            out = f"{s.fmt.name} {s.scaling.describe()} scales"
        if self.rounding == "stochastic":
            out += ", stochastic rounding"
        if self.error_feedback:
            out += f", error feedback ({self.residual_dtype} residuals)"
        return out


FIELDS = tuple(f.name for f in fields(WireConfig))


def residual_dtype_name(value) -> str:
    """The canonical residual dtype name (RESIDUAL_DTYPES) of an accepted spelling (an alias, any case, or a
    torch dtype); anything else is an error listing the accepted values."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    v = value.strip().lower() if isinstance(value, str) else value
    v = RESIDUAL_ALIASES.get(v, v)
    if v not in RESIDUAL_DTYPES:
        raise _bad("residual_dtype", value, (*RESIDUAL_DTYPES, *(f"{a} (= {c})" for a, c in RESIDUAL_ALIASES.items())))
    return v


def residual_nbytes(residual_dtype: str, numel: int) -> int:
    """Bytes of one residual of `numel` elements kept in `residual_dtype` (any accepted spelling)."""
    name = residual_dtype_name(residual_dtype)
    if name == "fp8":
        return COMPACT.nbytes(numel)
    return numel * getattr(torch, name).itemsize


def _bad(name: str, value, valid) -> Fp8CommConfigError:
    return Fp8CommConfigError(f"{name}={value!r} is not valid; valid: {', '.join(map(str, valid))}")


def _check_fp4_fields(cfg: WireConfig) -> None:
    """A 4-bit format fixes its block and scale kind: block_size / scaling may only restate them (or stay at their
    defaults); hadamard is a 4-bit option and must fit inside one block."""
    h, hs = cfg.hadamard, cfg.hadamard_seed
    if not isinstance(h, int) or isinstance(h, bool) or h not in HADAMARD:
        raise _bad("hadamard", h, HADAMARD)
    if not isinstance(hs, int) or isinstance(hs, bool) or not 0 <= hs < 2**32:
        raise Fp8CommConfigError(f"hadamard_seed must be an int in [0, 2**32), got {hs!r}")
    if cfg.fmt not in FP4_WIRE_FORMATS:
        if h:
            raise Fp8CommConfigError(
                f"hadamard={h} applies to the 4-bit formats ({', '.join(FP4_WIRE_FORMATS)}); fmt={cfg.fmt!r}"
            )
        return
    f = FP4_FORMATS[cfg.fmt]
    if cfg.block_size not in (128, f.block):
        raise Fp8CommConfigError(
            f"fmt={cfg.fmt!r} has 1x{f.block} blocks; block_size={cfg.block_size!r} disagrees (leave it at the default "
            f"or pass {f.block})"
        )
    ok_scaling = ("fp32", "e8m0") if f.scale == "e8m0" else ("fp32",)
    if not (isinstance(cfg.scaling, str) and cfg.scaling in ok_scaling):
        raise Fp8CommConfigError(
            f"fmt={cfg.fmt!r} has {f.scale.upper()} block scales (part of the format); scaling={cfg.scaling!r} "
            "disagrees (leave it at the default)"
        )
    if h and f.block % h:
        raise Fp8CommConfigError(
            f"hadamard={h} does not fit inside one {f.block}-element {cfg.fmt} block (valid: "
            f"{', '.join(str(n) for n in HADAMARD_SIZES if f.block % n == 0)}, or 0)"
        )


def _block_scaling(scaling, block_size) -> Scaling:
    """A Scaling with 1-row blocks from a scale encoding ('fp32', 'pow2', 'e8m0'), a preset name or a Scaling."""
    if isinstance(scaling, str) and scaling in ENCODINGS:
        sc = Scaling(1, block_size, scaling)
    elif isinstance(scaling, Scaling):
        sc = scaling
    elif isinstance(scaling, str) and scaling in PRESETS:
        sc = PRESETS[scaling]
    else:
        raise Fp8CommConfigError(
            f"scaling={scaling!r} is not valid; valid: a scale encoding ({', '.join(ENCODINGS)})"
            f", a preset ({', '.join(PRESETS)}) or a Scaling"
        )
    if sc.rows != 1:
        raise Fp8CommConfigError(f"collectives quantize 1xB blocks of the flat buffer (rows=1); got {sc.describe()}")
    return sc


def _pieces(v) -> int:
    """pipeline=None/'auto'/True (0: pieces from the size), False or 1 (one piece), or a piece count."""
    if v is None or v == "auto" or v is True:
        return 0
    if v is False:
        return 1
    if isinstance(v, int) and 0 <= v <= PIPELINE_MAX_PIECES:
        return v
    raise Fp8CommConfigError(
        f"pipeline must be None/'auto', False, or a piece count 1..{PIPELINE_MAX_PIECES}, got {v!r}"
    )


def _with(base: WireConfig, options: dict) -> WireConfig:
    if not options:
        return base
    bad = sorted(set(options) - set(FIELDS))
    if bad:
        raise Fp8CommConfigError(f"unknown option(s) {bad}; valid: {', '.join(FIELDS)}")
    try:
        return _with_cached(base, tuple(sorted(options.items())))
    except TypeError:  # an unhashable value: validate uncached (it raises with the field's name)
        return replace(base, **options)


@lru_cache(maxsize=512)
def _with_cached(base: WireConfig, items: tuple) -> WireConfig:
    return replace(base, **dict(items))


def resolve(config: WireConfig | None, default: WireConfig, options: dict) -> WireConfig:
    """The call's WireConfig: `config` (else the buffer's default) with keyword `options` on top."""
    if config is not None and not isinstance(config, WireConfig):
        raise Fp8CommConfigError(f"config must be a fp8comm.comm.WireConfig, got {type(config).__name__}")
    return _with(config if config is not None else default, options)


def default_check_policy() -> str:
    """The metadata-check policy for check=None: FP8COMM_CHECK=first (default), always (or 1) or never (or 0)."""
    raw = os.environ.get(CHECK_ENV, "").strip().lower()
    if raw not in _CHECK_ALIASES:
        raise Fp8CommConfigError(
            f"{CHECK_ENV}={raw!r} is not a check policy; valid: {', '.join(CHECK_POLICIES)} (or 1/0 for always/never)"
        )
    return _CHECK_ALIASES[raw]


def check_policy(check) -> str:
    """A check option as a policy: None -> the FP8COMM_CHECK default, True/False -> always/never."""
    if check is None:
        return default_check_policy()
    if check is True or check is False:
        return "always" if check else "never"
    if check in CHECK_POLICIES:
        return check
    raise _bad("check", check, ("None", "True", "False", *CHECK_POLICIES))
