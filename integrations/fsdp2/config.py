"""enable()'s options: one frozen config per direction (weights, gradients), validated before anything is installed.

    enable(model)                                              # both directions, E4M3, 1x128 fp32 scales
    enable(model, weights=False)                               # gradients only
    enable(model, gradients={"fmt": "e5m2", "rounding": "stochastic", "error_feedback": True}, check=False)
    enable(model, gradients={"fmt": "mxfp4", "hadamard": 32})   # 4-bit gradients (weights stay FP8)
    enable(model, hierarchical=False)                          # flat collectives (default: two levels per group)
    enable(model, planner=True)                                # FSDP2's own / FP8 per size class, from a calibration
    enable(model, planner={"allow_4bit": True})  # + 4-bit grads (the recipe's residual memory allowed by it)

A direction is True/False or a dict of the keys below; an unknown key or bad value is an Fp8CommFsdp2Error that names
the key and lists what is valid (with a "did you mean" for typos).
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, fields

from fp8comm.comm import (
    FORMATS,
    RESIDUAL_ALIASES,
    RESIDUAL_DTYPES,
    ROUNDINGS,
    SCALE_ENCODINGS,
    WireConfig,
    residual_dtype_name,
)
from fp8comm.comm.config import FP4_WIRE_FORMATS, FP8_FORMATS, HADAMARD
from fp8comm.comm.planned import PlannerSettings, parse_settings
from fp8comm.errors import Fp8CommConfigError


class Fp8CommFsdp2Error(Fp8CommConfigError):
    """enable()/disable() cannot honour a request (bad option, unsupported module, reduce op or dtype); raised
    before any hook is installed and, inside a hook, before any bytes move."""


@dataclass(frozen=True)
class WeightWire:
    """FP8 all-gather of the flat parameter shards: format and 1 x block_size block scales (always nearest)."""

    enabled: bool = True
    fmt: str = "e4m3"
    scaling: str = "fp32"
    block_size: int = 128

    def wire(self, check: bool | None) -> WireConfig:
        """The fp8comm.comm WireConfig of the weight all-gather (check: enable()'s metadata-check setting)."""
        return WireConfig(fmt=self.fmt, scaling=self.scaling, block_size=self.block_size, check=check)

    @property
    def wire_block(self) -> int:
        """Elements per scale on the wire: block_size, or the 4-bit format's own block (32 mxfp4, 16 nvfp4)."""
        return self.wire(None).spec.scaling.cols or self.block_size

    def describe(self) -> str:
        if not self.enabled:
            return "off (FSDP2's own)"
        if self.fmt in FP4_WIRE_FORMATS:
            return self.wire(None).describe()
        return f"{self.fmt} 1x{self.block_size} {self.scaling} scales"


@dataclass(frozen=True)
class GradientWire(WeightWire):
    """FP8 reduce-scatter of the flat gradients (fp32 accumulation on the receiver), plus gradient-only options."""

    rounding: str = "nearest"
    hadamard: int = 0  # 4-bit formats: block Hadamard transform of 16 or 32 elements before quantizing
    error_feedback: bool = False  # one fp8comm ErrorFeedback per FSDP module (its residual has the padded size)
    # float32, bfloat16 (half the residual memory) or fp8 (a quarter: E5M2 codes + one scale per group); the
    # aliases fp32 / bf16 are accepted (the spellings of DeepSpeed's and Megatron's options before 0.6)
    residual_dtype: str = "float32"
    # Error feedback keeps a residual of each module's WHOLE (unsharded) gradient on every rank, against FSDP2's
    # promise of 1/world of the gradients per rank: enable() refuses it unless this says the memory is accepted.
    allow_unpartitioned_residuals: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "residual_dtype", residual_dtype_name(self.residual_dtype))  # aliases: one name

    def wire(self, check: bool | None) -> WireConfig:
        """The fp8comm.comm WireConfig of the gradient reduce-scatter (check: enable()'s metadata-check setting)."""
        return WireConfig(
            fmt=self.fmt,
            scaling=self.scaling,
            block_size=self.block_size,
            rounding=self.rounding,
            hadamard=self.hadamard,
            check=check,
            error_feedback=self.error_feedback,
            residual_dtype=self.residual_dtype,
        )

    def describe(self) -> str:
        if not self.enabled:
            return "off (FSDP2's own)"
        if self.fmt in FP4_WIRE_FORMATS:
            return self.wire(None).describe() + ", fp32 accumulation"
        extra = (", stochastic rounding" if self.rounding == "stochastic" else "") + (
            f", error feedback ({self.residual_dtype} residuals)" if self.error_feedback else ""
        )
        return super().describe() + ", fp32 accumulation" + extra


@dataclass(frozen=True)
class Fp8CommFsdp2Config:
    """Everything enable() installs. check: the fp8comm metadata check (None: library default, True: every call,
    False: never). align_blocks: each parameter's shard starts a new block on the wire (see docs/fsdp2.md)."""

    weights: WeightWire = field(default_factory=WeightWire)
    gradients: GradientWire = field(default_factory=GradientWire)
    check: bool | None = None
    align_blocks: bool = True
    # two levels (same bytes / fp32 inside a node, FP8 or 4-bit across nodes) for every shard group that spans
    # nodes with more than one member on each (fp8comm.comm.topology decides; others run flat); False: flat
    hierarchical: bool = True
    # the planner (enable(planner=...)): per collective size class FSDP2's own collective, FP8 or (allow_4bit) the
    # 4-bit gradient recipe, flat or two-level, from a calibration; None: the fixed formats above
    planner: PlannerSettings | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def planned_wires(self) -> dict[str, str]:
        """With the planner: per direction, what it may choose ("" for a direction that is off)."""
        if self.planner is None:
            return {}
        own = "FSDP2's own"
        fp8 = "e4m3 1x128 fp32 scales"
        g = self.gradients
        grads = f"{own}, {fp8} or mxfp4 + error feedback ({g.residual_dtype} residuals)" if g.fmt == "mxfp4" else None
        return {
            "weights": f"planned per size class: {own} or {fp8}" if self.weights.enabled else "",
            "gradients": (f"planned per size class: {grads or f'{own} or {fp8}'}, fp32 accumulation")
            if g.enabled
            else "",
        }


def _pow2(v) -> str | None:
    return None if v >= 16 and v & (v - 1) == 0 else "must be a power of two >= 16"


# key -> (type, allowed values or None, extra check or None)
def _weights_fp8(v) -> str | None:
    if v in FP4_WIRE_FORMATS:
        return (
            "is a 4-bit format: FSDP2 keeps no weight replica between steps to send changes against, so its weights "
            f"travel in FP8 ({', '.join(FP8_FORMATS)}); 4 bits apply to gradients"
        )
    return None


_WEIGHT_KEYS = {
    "enabled": (bool, None, None),
    "fmt": (str, FORMATS, _weights_fp8),
    "scaling": (str, SCALE_ENCODINGS, None),
    "block_size": (int, None, _pow2),
}
_GRAD_KEYS = {
    **_WEIGHT_KEYS,
    "fmt": (str, FORMATS, None),
    "hadamard": (int, HADAMARD, None),
    "rounding": (str, ROUNDINGS, None),
    "error_feedback": (bool, None, None),
    "residual_dtype": (str, (*RESIDUAL_DTYPES, *RESIDUAL_ALIASES), None),
    "allow_unpartitioned_residuals": (bool, None, None),
}


def _did_you_mean(key: str, valid) -> str:
    hint = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _check_value(path: str, v, spec) -> None:
    typ, allowed, extra = spec
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise Fp8CommFsdp2Error(f"{path} must be {typ.__name__}, got {v!r}")
    if allowed is not None and v not in allowed:
        raise Fp8CommFsdp2Error(f"{path} = {v!r} is not valid; valid: {', '.join(map(repr, allowed))}")
    if extra is not None and (msg := extra(v)):
        raise Fp8CommFsdp2Error(f"{path} = {v!r} {msg}")


def _direction(name: str, raw, schema: dict, cls):
    if isinstance(raw, cls):
        return raw
    if isinstance(raw, bool):
        return cls(enabled=raw)
    if not isinstance(raw, dict):
        raise Fp8CommFsdp2Error(f"{name} must be True/False, a dict or a {cls.__name__}, got {raw!r}")
    for k, v in raw.items():
        if k not in schema:
            raise Fp8CommFsdp2Error(f"unknown key {name}[{k!r}]{_did_you_mean(k, schema)}; valid: {', '.join(schema)}")
        _check_value(f"{name}[{k!r}]", v, schema[k])
    return cls(**raw)


# Keys of a direction's dict that set no format: allowed next to the planner (which chooses the format). The
# user's error feedback rides on the FP8 the plan chooses (Policy.fp8_feedback); with allow_4bit it is the recipe's.
_PLANNER_FREE_KEYS = {
    "weights": ("enabled",),
    "gradients": ("enabled", "error_feedback", "residual_dtype", "allow_unpartitioned_residuals"),
}


def _planner_settings(value) -> PlannerSettings | None:
    """The planner option (fp8comm.comm.planned's settings; FSDP2 carries 4-bit gradients, so allow_4bit is valid)."""
    try:
        return parse_settings(value, "planner")
    except Fp8CommConfigError as e:
        raise Fp8CommFsdp2Error(str(e)) from None


def _planned_directions(
    options: dict, settings: PlannerSettings, weights: WeightWire, gradients: GradientWire
) -> tuple[WeightWire, GradientWire]:
    """The directions' base configs under the planner; an explicit format next to it is an error naming both."""
    given = options.get("planner")
    for name, what in (("weights", "weight all-gather"), ("gradients", "gradient reduce-scatter")):
        raw = options.get(name, True)
        if isinstance(raw, bool):
            continue
        free = _PLANNER_FREE_KEYS[name]
        keys = [k for k in raw if k not in free] if isinstance(raw, dict) else [type(raw).__name__]
        if keys:
            raise Fp8CommFsdp2Error(
                f"planner={given!r} and {name}={raw!r} both set the {what}'s format: the planner chooses it per "
                f"size class (FSDP2's own, FP8{' or 4 bits' if name == 'gradients' else ''}); drop {name}'s "
                f"{', '.join(map(repr, keys))} or the planner (next to the planner {name} takes True/False"
                + (f" or a dict of {', '.join(map(repr, free))})" if len(free) > 1 else ")")
            )
    if settings.allow_4bit and not gradients.enabled:
        raise Fp8CommFsdp2Error(
            f"planner={given!r} allows 4-bit gradients but gradients=False keeps FSDP2's own reduce-scatter: drop "
            "allow_4bit or turn gradients on"
        )
    raw = options.get("gradients", True)
    if settings.allow_4bit and isinstance(raw, dict) and raw.get("error_feedback") is False:
        raise Fp8CommFsdp2Error(
            f"planner={given!r} allows 4-bit gradients, whose validated recipe is mxfp4 WITH error feedback, but "
            f"gradients={raw!r} turns error feedback off: drop one of them"
        )
    if settings.allow_4bit and isinstance(raw, dict) and raw.get("allow_unpartitioned_residuals") is False:
        raise Fp8CommFsdp2Error(
            f"planner={given!r} allows 4-bit gradients, whose validated recipe (mxfp4 with error feedback) keeps a "
            f"residual of every FSDP2 module's WHOLE gradient on every rank, but gradients={raw!r} refuses that "
            "memory: drop allow_4bit, or allow_unpartitioned_residuals (the planner sets it with allow_4bit)"
        )
    w = WeightWire(enabled=weights.enabled)  # FSDP2 keeps no weight replicas: weights travel in FP8 at most
    g = GradientWire(
        enabled=gradients.enabled,
        # allow_4bit: the validated recipe (mxfp4 with error feedback, nearest rounding); buckets planned on FP8 take
        # fp8comm.comm.config_for(this, "fp8"), with error feedback only where the user asked for it (keeps_feedback)
        fmt="mxfp4" if settings.allow_4bit else "e4m3",
        error_feedback=settings.allow_4bit or gradients.error_feedback,
        residual_dtype=gradients.residual_dtype,
        # the recipe's memory option, set by the planner with allow_4bit (its plan lines say so)
        allow_unpartitioned_residuals=gradients.allow_unpartitioned_residuals or settings.allow_4bit,
    )
    return w, g


def parse(**options) -> Fp8CommFsdp2Config:
    """The validated config for enable(model, **options); raises Fp8CommFsdp2Error naming the first bad option."""
    valid = [f.name for f in fields(Fp8CommFsdp2Config)]
    for k in options:
        if k not in valid:
            raise Fp8CommFsdp2Error(f"unknown option {k!r}{_did_you_mean(k, valid)}; valid: {', '.join(valid)}")
    check = options.get("check")
    if check is not None and not isinstance(check, bool):
        raise Fp8CommFsdp2Error(f"check must be None, True or False, got {check!r}")
    align = options.get("align_blocks", True)
    if not isinstance(align, bool):
        raise Fp8CommFsdp2Error(f"align_blocks must be True or False, got {align!r}")
    hierarchical = options.get("hierarchical", True)
    if not isinstance(hierarchical, bool):
        raise Fp8CommFsdp2Error(f"hierarchical must be True or False, got {hierarchical!r}")
    planner = _planner_settings(options.get("planner"))
    weights = _direction("weights", options.get("weights", True), _WEIGHT_KEYS, WeightWire)
    gradients = _direction("gradients", options.get("gradients", True), _GRAD_KEYS, GradientWire)
    if planner is not None:
        weights, gradients = _planned_directions(options, planner, weights, gradients)
    cfg = Fp8CommFsdp2Config(
        weights=weights,
        gradients=gradients,
        check=check,
        align_blocks=align,
        hierarchical=hierarchical,
        planner=planner,
    )
    try:  # the combination (a 4-bit format's block and scales, hadamard only with 4 bits) is WireConfig's to judge
        cfg.gradients.wire(check)
    except Fp8CommConfigError as e:
        raise Fp8CommFsdp2Error(f"gradients: {e}") from None
    if not (cfg.weights.enabled or cfg.gradients.enabled):
        raise Fp8CommFsdp2Error(
            "weights and gradients are both off: nothing to enable (call disable() to restore FSDP2's own collectives)"
        )
    return cfg


def defaults() -> dict:
    """Every option with its default (docs and tests use this, so the two never drift apart)."""
    return Fp8CommFsdp2Config().as_dict()
