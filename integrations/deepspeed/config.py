"""The "fp8_comm" section of a DeepSpeed config: schema, defaults and validation.

DeepSpeed ignores unknown top-level keys, so nothing but this module ever checks the section: every unknown key
and bad value is an error that names the key path and lists what is valid (with a "did you mean" for typos).

    "fp8_comm": {
        "enabled": true,                      # the section's presence alone also means enabled
        "mode": "fp8",                        # "measure": hooks only count DeepSpeed's own bytes, change nothing
        "log": true,                          # the one-line summary on rank 0
        "hierarchical": true,                 # two levels where a group spans nodes with > 1 member on each
        "weights":   {"enabled": true, "fmt": "e4m3", "scaling": "fp32", "block_size": 128, "rounding": "nearest",
                      "update_fmt": null},
        "gradients": {"enabled": true, "fmt": "e4m3", "scaling": "fp32", "block_size": 128, "rounding": "nearest",
                      "hadamard": 0, "error_feedback": false, "residual_dtype": "float32",
                      "allow_unpartitioned_residuals": false},
        "moe":       {"enabled": true, "fmt": "e4m3", "scaling": "fp32", "block_size": 128, "rounding": "nearest",
                      "combine": "native", "grad": "native"},
        "gemm":      {"enabled": false, "recipe": "blockwise", "skip_first_blocks": 0, "skip_last_blocks": 0,
                      "min_features": 16, "backend": "auto", "quant_backend": "auto"},
        "guard":     {"enabled": false, "threshold": 0.001, "patience": 3, "cooldown": 50},
        "check": null,                        # cross-rank metadata check per collective; null: FP8COMM_CHECK (on)
        "planner": null                       # off; true, or {"allow_4bit": true, "calibration": FILE, "timeout_s": 30}
    }

The planner (fp8comm.comm.planned) chooses per bucket-size class, from a calibration of the links and codecs, the
fastest of DeepSpeed's own collective, FP8 or (with allow_4bit) the 4-bit recipe, flat or two-level; it turns the
weight and gradient hooks on, and is an error beside an explicit gradients.fmt or weights.update_fmt.

4 bits: "gradients": {"fmt": "mxfp4" | "nvfp4", "hadamard": 0 | 16 | 32} (the format fixes block and scale kind:
leave block_size and scaling at their defaults or give the format's own, 32 / 16);
"weights": {"update_fmt": "mxfp4" | "nvfp4"} sends each step's weight CHANGE in 4 bits (ZeRO-1/2 only, which keep
a full replica on every rank; ZeRO-3 keeps FP8 weights). Weight values and MoE tokens stay FP8.

The section is about communication: FP8 GEMMs are opt-in ("gemm" is off unless asked for; Fp8Linear blockwise
ran at 0.71x of bf16 nn.Linear on an H200, docs/benchmarks.md "GEMMs"). A sub-section may be a bare boolean: true
turns it on with its defaults ("gemm": true = the blockwise recipe), false turns it off. A sub-section written as
an object is on unless it says "enabled": false, like the section itself: "gemm": {"recipe": "rowwise"} converts
the linears, "guard": {"threshold": 0.01} runs the guard.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field

from fp8comm.comm import FORMATS, KERNEL_BACKENDS, ROUNDINGS, SCALE_ENCODINGS, WIRES, GuardPolicy, WireConfig
from fp8comm.comm.config import FP4_WIRE_FORMATS, FP8_FORMATS, RESIDUAL_ALIASES, residual_dtype_name
from fp8comm.comm.config import RESIDUAL_DTYPES as COMM_RESIDUAL_DTYPES
from fp8comm.comm.planned import PlannerSettings, parse_settings
from fp8comm.errors import Fp8CommConfigError
from fp8comm.gemm import BACKENDS as GEMM_BACKENDS
from fp8comm.gemm import RECIPES

SECTION = "fp8_comm"
MODES = ("fp8", "measure")
# MoE combine / backward wires: "native" keeps DeepSpeed's own all-to-all in the model dtype (bit-exact).
MOE_WIRES = ("native", "bf16", "fp8")
assert set(MOE_WIRES) == set(WIRES)


@dataclass(frozen=True)
class TrafficConfig:
    """How one kind of traffic is quantized: FP8 format and 1 x block_size block scales (see fp8comm.comm)."""

    enabled: bool = True
    fmt: str = "e4m3"
    scaling: str = "fp32"
    block_size: int = 128
    rounding: str = "nearest"

    def wire(self, check: bool | None) -> WireConfig:
        """The fp8comm.comm WireConfig of this traffic (check: the section's metadata-check setting)."""
        return WireConfig(
            fmt=self.fmt, scaling=self.scaling, block_size=self.block_size, rounding=self.rounding, check=check
        )

    def describe(self) -> str:
        return self.wire(None).describe()


UPDATE_FORMATS = FP4_WIRE_FORMATS  # weights.update_fmt: the 4-bit change of each step (fp8comm.comm.ReplicaUpdate)
HADAMARD_SIZES = (0, 16, 32)


@dataclass(frozen=True)
class WeightConfig(TrafficConfig):
    """Weight traffic: values in FP8; with update_fmt (ZeRO-1/2), each step's change of the replica in 4 bits."""

    update_fmt: str | None = None

    def update_wire(self, check: bool | None) -> WireConfig | None:
        """The ReplicaUpdate wire (None: the weights travel as FP8 values)."""
        if self.update_fmt is None:
            return None
        return WireConfig(fmt=self.update_fmt, rounding=self.rounding, check=check)


# gradients.residual_dtype: float32 (4 bytes per parameter), bfloat16 (2) or fp8 (E5M2 codes + one scale per
# parameter: 1 byte); the spelling every adapter shares (fp8comm.comm.RESIDUAL_DTYPES). "fp32" and "bf16", this
# section's spellings before 0.6, stay accepted.
RESIDUAL_DTYPES = (*COMM_RESIDUAL_DTYPES, *RESIDUAL_ALIASES)


@dataclass(frozen=True)
class GradientConfig(TrafficConfig):
    """Gradient traffic: optional error feedback, each rank's FP8 quantization residual re-sent on the next step.

    The residual covers this rank's whole gradient (every parameter, every owner's slice): under ZeRO-2/3 that
    undoes gradient partitioning, so those stages need allow_unpartitioned_residuals (see docs/deepspeed.md)."""

    hadamard: int = 0
    error_feedback: bool = False
    residual_dtype: str = "float32"
    allow_unpartitioned_residuals: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "residual_dtype", residual_dtype_name(self.residual_dtype))  # aliases: one name

    @property
    def is_fp4(self) -> bool:
        return self.fmt in FP4_WIRE_FORMATS

    def wire(self, check: bool | None) -> WireConfig:
        return (
            super()
            .wire(check)
            .replace(
                hadamard=self.hadamard,
                error_feedback=self.error_feedback,
                residual_dtype=self.residual_dtype,
            )
        )

    def describe(self) -> str:
        return self.wire(None).describe()


@dataclass(frozen=True)
class GuardConfig:
    """The numerics guard (fp8comm.comm.Guard): a bucket whose saturated-or-underflowed fraction stays above
    `threshold` for `patience` steps sends BF16 (DeepSpeed's own collective) for `cooldown` steps."""

    enabled: bool = False
    threshold: float = 1e-3
    patience: int = 3
    cooldown: int = 50

    def policy(self) -> GuardPolicy:
        return GuardPolicy(threshold=self.threshold, patience=self.patience, cooldown=self.cooldown)


@dataclass(frozen=True)
class MoeConfig(TrafficConfig):
    """MoE all-to-all: the dispatch is FP8; combine and the backward keep the model dtype unless asked."""

    combine: str = "native"
    grad: str = "native"


@dataclass(frozen=True)
class GemmConfig:
    """convert_to_fp8(model, recipe, ...) applied before the engine is built; off unless the section asks for it
    (the flag promises FP8 communication, and FP8 GEMMs are not faster than bf16 everywhere)."""

    enabled: bool = False
    recipe: str = "blockwise"
    skip_first_blocks: int = 0
    skip_last_blocks: int = 0
    min_features: int = 16
    backend: str = "auto"
    quant_backend: str = "auto"


@dataclass(frozen=True)
class Fp8CommDeepSpeedConfig:
    """The validated "fp8_comm" section of a DeepSpeed config (parse() builds it; defaults() lists it)."""

    enabled: bool = False
    mode: str = "fp8"
    log: bool = True
    # Weight all-gather and gradient reduce-scatter in two levels (same bytes / fp32 inside a node, FP8 or 4-bit
    # across nodes) for every group that spans nodes with more than one member on each (levels.py); false: flat.
    hierarchical: bool = True
    check: bool | None = None
    weights: WeightConfig = field(default_factory=WeightConfig)
    gradients: GradientConfig = field(default_factory=GradientConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    gemm: GemmConfig = field(default_factory=GemmConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    # The planner's settings (None: off); with it, weights and gradients are on, and gradients carry the 4-bit
    # recipe (mxfp4, error feedback, unpartitioned residuals) when 4 bits are allowed: the plan picks per bucket.
    planner: PlannerSettings | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def measure_only(self) -> bool:
        return self.mode == "measure"


# Per key: (type(s), allowed values or None, extra check or None). bool is checked before int (bool is an int).
def _positive_pow2(v) -> str | None:
    return None if v >= 16 and v & (v - 1) == 0 else "must be a power of two >= 16"


def _nonneg(v) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _positive(v) -> str | None:
    return None if v >= 1 else "must be >= 1 (steps)"


def _fraction(v) -> str | None:
    return None if 0 < v < 1 else "must be a fraction in (0, 1)"


_WIRE = {
    "enabled": (bool, None, None),
    "fmt": (str, FP8_FORMATS, None),  # weight values and MoE tokens: FP8 only (4 bits: gradients, weight updates)
    "scaling": (str, SCALE_ENCODINGS, None),
    "block_size": (int, None, _positive_pow2),
    "rounding": (str, ROUNDINGS, None),
}
_WEIGHTS = {**_WIRE, "update_fmt": ((str, type(None)), (*UPDATE_FORMATS, None), None)}
_GRAD = {
    **_WIRE,
    "fmt": (str, FORMATS, None),
    "hadamard": (int, HADAMARD_SIZES, None),
    "error_feedback": (bool, None, None),
    "residual_dtype": (str, RESIDUAL_DTYPES, None),
    "allow_unpartitioned_residuals": (bool, None, None),
}
_GUARD = {
    "enabled": (bool, None, None),
    "threshold": ((float, int), None, _fraction),
    "patience": (int, None, _positive),
    "cooldown": (int, None, _positive),
}
_MOE = {**_WIRE, "combine": (str, MOE_WIRES, None), "grad": (str, MOE_WIRES, None)}
_GEMM = {
    "enabled": (bool, None, None),
    "recipe": (str, None, None),
    "skip_first_blocks": (int, None, _nonneg),
    "skip_last_blocks": (int, None, _nonneg),
    "min_features": (int, None, _nonneg),
    "backend": (str, GEMM_BACKENDS, None),
    "quant_backend": (str, KERNEL_BACKENDS, None),
}
_TOP = {
    "enabled": (bool, None, None),
    "mode": (str, MODES, None),
    "log": (bool, None, None),
    "hierarchical": (bool, None, None),
    "check": ((bool, type(None)), None, None),
}
_SECTIONS: dict[str, tuple[dict, type]] = {
    "weights": (_WEIGHTS, WeightConfig),
    "gradients": (_GRAD, GradientConfig),
    "moe": (_MOE, MoeConfig),
    "gemm": (_GEMM, GemmConfig),
    "guard": (_GUARD, GuardConfig),
}


def _type_name(t) -> str:
    if t == (float, int):
        return "a number"
    if isinstance(t, tuple):
        return " or ".join("null" if x is type(None) else x.__name__ for x in t)
    return {bool: "true/false", int: "an integer", str: "a string"}.get(t, t.__name__)


def _unknown(key: str, where: str, valid) -> Fp8CommConfigError:
    hint = difflib.get_close_matches(key, list(valid), n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    return Fp8CommConfigError(
        f"unknown key '{where}{key}'{did}; valid keys in {where.rstrip('.') or SECTION}: {', '.join(valid)}"
    )


def _check_value(path: str, v, spec) -> None:
    typ, allowed, extra = spec
    ok = isinstance(v, typ) and not (typ in (int, (float, int)) and isinstance(v, bool))
    if not ok:
        raise Fp8CommConfigError(f"{path} must be {_type_name(typ)}, got {v!r}")
    if allowed is not None and v not in allowed:
        raise Fp8CommConfigError(f"{path} = {v!r} is not valid; valid: {', '.join(map(_show, allowed))}{_why(path, v)}")
    if extra is not None and (msg := extra(v)):
        raise Fp8CommConfigError(f"{path} = {v!r} {msg}")


def _show(v) -> str:
    return "null" if v is None else repr(v)


def _why(path: str, v) -> str:
    """Why a 4-bit format is refused where only FP8 goes (weight values, MoE tokens)."""
    if v not in FP4_WIRE_FORMATS:
        return ""
    if path.endswith("weights.fmt"):
        return (
            f" (4-bit weights travel only as changes of a replica: {SECTION}.weights.update_fmt, ZeRO-1/2; "
            "ZeRO-3 keeps FP8 weights)"
        )
    return " (the MoE all-to-all has no 4-bit wire)"


def _section(name: str, raw, schema: dict, cls):
    path = f"{SECTION}.{name}"
    if isinstance(raw, bool):
        return cls(enabled=raw)
    if not isinstance(raw, dict):
        raise Fp8CommConfigError(f"{path} must be an object or true/false, got {raw!r}")
    for k, v in raw.items():
        if k not in schema:
            raise _unknown(k, path + ".", schema)
        _check_value(f"{path}.{k}", v, schema[k])
    # Writing a sub-section means "on" unless it says otherwise (as for the section): an off-by-default part
    # (gemm, guard) given only its options would otherwise be silently ignored.
    return cls(**{"enabled": True, **raw})


def parse(ds_config: dict | None) -> Fp8CommDeepSpeedConfig:
    """The validated fp8_comm section of a DeepSpeed config dict (disabled when absent)."""
    if not ds_config or SECTION not in ds_config:
        return Fp8CommDeepSpeedConfig()
    raw = ds_config[SECTION]
    if isinstance(raw, bool):
        raw = {"enabled": raw}
    if not isinstance(raw, dict):
        raise Fp8CommConfigError(f"{SECTION} must be an object or true/false, got {raw!r}")
    valid = [*_TOP, *_SECTIONS, "planner"]
    kw: dict = {}
    for k, v in raw.items():
        if k == "planner":
            kw[k] = parse_settings(v, f"{SECTION}.planner")
        elif k in _TOP:
            _check_value(f"{SECTION}.{k}", v, _TOP[k])
            kw[k] = v
        elif k in _SECTIONS:
            schema, cls = _SECTIONS[k]
            kw[k] = _section(k, v, schema, cls)
        else:
            raise _unknown(k, f"{SECTION}.", valid)
    kw.setdefault("enabled", True)  # writing the section at all means "on" unless it says otherwise
    if kw.get("planner") is not None:
        kw = _with_planner(raw, kw)
    cfg = Fp8CommDeepSpeedConfig(**kw)
    if cfg.gemm.enabled:
        _check_recipe(cfg.gemm.recipe)
    g = cfg.gradients
    try:  # the wire's own rules (4-bit block and scale kind, hadamard only with 4 bits), named by key path
        g.wire(cfg.check)
    except Fp8CommConfigError as e:
        raise Fp8CommConfigError(f"{SECTION}.gradients: {e}") from None
    w = cfg.weights
    if w.update_fmt is not None and not w.enabled:
        raise Fp8CommConfigError(
            f"{SECTION}.weights.update_fmt needs {SECTION}.weights.enabled (it replaces the weight all-gather)"
        )
    if w.update_fmt is not None and cfg.measure_only:
        raise Fp8CommConfigError(
            f"{SECTION}.weights.update_fmt with mode 'measure': measure mode quantizes nothing; drop one of them"
        )
    if g.error_feedback and not g.enabled:
        raise Fp8CommConfigError(
            f"{SECTION}.gradients.error_feedback needs {SECTION}.gradients.enabled (error "
            "feedback re-sends the FP8 gradient quantization error)"
        )
    if cfg.guard.enabled and cfg.measure_only:
        raise Fp8CommConfigError(
            f"{SECTION}.guard with mode 'measure': measure mode quantizes nothing, so there is "
            "nothing to guard; drop one of them"
        )
    if g.error_feedback and cfg.measure_only:
        raise Fp8CommConfigError(
            f"{SECTION}.gradients.error_feedback with mode 'measure': measure mode quantizes "
            "nothing, so there is no error to feed back; drop one of them"
        )
    return cfg


def _with_planner(raw: dict, kw: dict) -> dict:
    """The section under the planner: weights and gradients on; with allow_4bit the gradients carry the validated
    4-bit recipe (mxfp4 + error feedback, residuals of the whole gradient); what the user set that the planner
    decides is an error naming both."""
    p = f"{SECTION}.planner"
    a4 = kw["planner"].allow_4bit

    def given(sec: str, key: str):
        v = raw.get(sec)
        return v.get(key) if isinstance(v, dict) else None

    for sec, key, what in (
        ("gradients", "fmt", "the gradient format"),
        ("weights", "update_fmt", "the weights' update format"),
    ):
        if given(sec, key) is not None:
            raise Fp8CommConfigError(
                f"{p} and {SECTION}.{sec}.{key} both choose {what}: drop one (the planner picks DeepSpeed's own, FP8 "
                "or, with allow_4bit, mxfp4 per bucket size)"
            )
    for sec in ("weights", "gradients"):
        v = raw.get(sec)
        if v is False or (isinstance(v, dict) and v.get("enabled") is False):
            raise Fp8CommConfigError(
                f"{p} with {SECTION}.{sec} off: the planner chooses the {sec}' wire (DeepSpeed's own among the "
                "options); drop one of them"
            )
    if kw.get("mode") == "measure":
        raise Fp8CommConfigError(f"{p} with mode 'measure': measure mode quantizes nothing; drop one of them")
    if a4 and given("gradients", "error_feedback") is False:
        raise Fp8CommConfigError(
            f"{p}.allow_4bit with {SECTION}.gradients.error_feedback false: the validated 4-bit gradient recipe is "
            "mxfp4 WITH error feedback; drop one of them"
        )
    out = dict(kw)
    out["weights"] = WeightConfig(**{**asdict(kw.get("weights", WeightConfig())), "enabled": True})
    g = asdict(kw.get("gradients", GradientConfig()))
    g["enabled"] = True
    if a4:
        g.update(fmt="mxfp4", error_feedback=True, allow_unpartitioned_residuals=True, block_size=128, scaling="fp32")
    out["gradients"] = GradientConfig(**g)
    return out


def _check_recipe(name: str) -> None:
    if name not in RECIPES:
        hint = difflib.get_close_matches(name, list(RECIPES), n=1)
        did = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise Fp8CommConfigError(f"{SECTION}.gemm.recipe = {name!r} is not a recipe{did}; valid: {', '.join(RECIPES)}")


def defaults() -> dict:
    """Every option with its default (docs and tests use this, so the two never drift apart)."""
    return Fp8CommDeepSpeedConfig(enabled=True).as_dict()
