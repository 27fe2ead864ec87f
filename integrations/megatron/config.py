"""What the Megatron plugin turns on and how it quantizes: one frozen config, built from argparse args or keywords."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from fp8comm.comm import (
    CHECK_POLICIES,
    RESIDUAL_ALIASES,
    RESIDUAL_DTYPES,
    ROUNDINGS,
    SCALE_ENCODINGS,
    WIRES,
    GuardPolicy,
    WireConfig,
    residual_dtype_name,
)
from fp8comm.comm.config import FP4_WIRE_FORMATS, FP8_FORMATS, HADAMARD
from fp8comm.comm.planned import PlannerSettings, parse_settings
from fp8comm.errors import Fp8CommConfigError

FORMATS = FP8_FORMATS  # parameters and MoE tokens: FP8 only (one byte per element, the block size and scaling flags)
GRAD_FORMATS = FP8_FORMATS + FP4_WIRE_FORMATS  # gradients: FP8 or the 4-bit wire (block and scale fixed by format)
PARAM_UPDATE_FORMATS = FP4_WIRE_FORMATS  # the distributed optimizer's weight-update all-gather (replica += change)
FP4_LAYOUT = {"mxfp4": "1x32 blocks, E8M0 scales", "nvfp4": "1x16 blocks, E4M3 scales + one fp32 scale per chunk"}
assert set(FP4_LAYOUT) == set(FP4_WIRE_FORMATS)
SCALINGS = SCALE_ENCODINGS
CHECKS = CHECK_POLICIES
MOE_GRAD_WIRES = ("bf16", "fp8", "native")
MOE_COMBINES = ("native", "bf16", "fp8")  # native: Megatron's own combine collective, untouched
assert set(MOE_GRAD_WIRES) == set(MOE_COMBINES) == set(WIRES)
# --fp8comm-error-feedback-dtype: float32 (4 bytes per gradient element), bfloat16 (2) or fp8 (E5M2 codes with one
# scale per bucket: 1), the spelling every adapter shares; "fp32" and "bf16" (this flag's values before 0.6) stay
# accepted and mean float32 and bfloat16.
EF_DTYPES = (*RESIDUAL_DTYPES, *RESIDUAL_ALIASES)
# MoE token dispatchers of megatron-core 0.19 (TransformerConfig.moe_token_dispatcher_type) fp8comm hooks.
HOOKED_DISPATCHERS = ("alltoall", "allgather")


class Fp8CommMegatronError(Fp8CommConfigError):
    """A setting that would corrupt training or silently do nothing; raised before anything is patched."""


@dataclass(frozen=True)
class Fp8CommMegatronConfig:
    """Plugin settings. Defaults match the argparse defaults in args.py (docs/megatron.md lists both)."""

    grad_reduce: bool = False  # FP8 gradient reduction in DDP: reduce-scatter (distributed optimizer) or all-reduce
    param_gather: bool = False  # FP8 parameter all-gather of the distributed optimizer
    moe_dispatch: bool = False  # FP8 token dispatch in MoEAlltoAllTokenDispatcher
    fmt: str = "e4m3"  # FP8 format of parameters and MoE tokens
    grad_fmt: str = "e4m3"  # gradient wire: FP8 (e4m3, e5m2) or 4-bit (mxfp4, nvfp4: block and scale fixed by format)
    block_size: int = 128  # FP8 wires: elements per scale (1 x block_size blocks of the flat buffer / of each token)
    scaling: str = "fp32"  # FP8 wires: scale encoding, fp32 (exact amax scale), pow2 or e8m0 (power-of-two byte)
    rounding: str = "nearest"  # gradient rounding: nearest or stochastic (params/tokens always nearest)
    # gradients/params: two levels, high precision inside a node, FP8/4-bit across nodes, for every data-parallel
    # group that spans nodes with > 1 member on each (fp8comm.comm.topology decides; others run flat)
    hierarchical: bool = True
    check: str = "first"  # cross-rank metadata check: first call per buffer, every call, or never
    moe_grad_wire: str = "bf16"  # MoE dispatch/combine backward (token gradients): bf16, fp8 or the tensor's dtype
    error_feedback: bool = False  # gradient hook: carry each bucket's FP8 quantization error into the next step
    error_feedback_dtype: str = "float32"  # residual: float32 (+4 B per gradient element), bfloat16 (+2), fp8 (+1)
    moe_combine: str = "native"  # MoE combine (expert outputs back): native (Megatron's), bf16 or fp8
    guard: bool = False  # numerics guard: a bucket whose data stops fitting FP8 falls back to Megatron's bf16
    guard_threshold: float = 1e-3  # fraction of a bucket's elements saturated or underflowed in one step
    guard_patience: int = 3  # steps over the threshold before the bucket falls back
    guard_cooldown: int = 50  # steps in bf16 before FP8 is tried again
    # Distributed optimizer: the parameter all-gather sends each shard's change since the last gather (fp32 master
    # minus replica) in this 4-bit format and every rank adds the decoded change to its replica (replica_update.py).
    param_update_fmt: str | None = None
    # 4-bit gradients: block Hadamard transform of 16 or 32 elements before quantizing (0: none); the signs come
    # from one seed on every rank and the receiver applies the inverse to its fp32 sum
    hadamard: int = 0
    # The planner (planning.py): per bucket-size class, Megatron's own collective, FP8 or (allow_4bit) the 4-bit
    # recipe, flat or two-level, predicted from a calibration (a file, or measured over the world at install).
    # planner_allow_4bit or planner_calibration imply planner; the planner turns the gradient hook on (and the FP8
    # parameter gather where the distributed optimizer gathers bf16/fp16 params): planned() is what install runs.
    planner: bool = False
    planner_allow_4bit: bool = False
    planner_calibration: str | None = None
    planner_timeout_s: float = 30.0
    planner_trials: bool = True  # a plan measured slower than another option's prediction tries it (planned.py)

    def __post_init__(self) -> None:
        if self.param_update_fmt is not None and self.param_update_fmt not in PARAM_UPDATE_FORMATS:
            raise Fp8CommMegatronError(
                f"fp8comm: param_update_fmt={self.param_update_fmt!r} is not one of {PARAM_UPDATE_FORMATS} (or None)"
            )
        for name, allowed in (
            ("fmt", FORMATS),
            ("grad_fmt", GRAD_FORMATS),
            ("scaling", SCALINGS),
            ("rounding", ROUNDINGS),
            ("check", CHECKS),
            ("moe_grad_wire", MOE_GRAD_WIRES),
            ("error_feedback_dtype", EF_DTYPES),
            ("moe_combine", MOE_COMBINES),
        ):
            if getattr(self, name) not in allowed:
                raise Fp8CommMegatronError(f"fp8comm: {name}={getattr(self, name)!r} is not one of {allowed}")
        # one name per residual dtype (aliases fp32/bf16 -> float32/bfloat16)
        object.__setattr__(self, "error_feedback_dtype", residual_dtype_name(self.error_feedback_dtype))
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise Fp8CommMegatronError(f"fp8comm: block_size must be a positive int, got {self.block_size!r}")
        for name in (
            "grad_reduce",
            "param_gather",
            "moe_dispatch",
            "hierarchical",
            "error_feedback",
            "guard",
            "planner",
            "planner_allow_4bit",
            "planner_trials",
        ):
            if not isinstance(getattr(self, name), bool):
                raise Fp8CommMegatronError(f"fp8comm: {name} must be True or False, got {getattr(self, name)!r}")
        if self.planner_calibration is not None and (
            not isinstance(self.planner_calibration, str) or not self.planner_calibration
        ):
            raise Fp8CommMegatronError(
                f"fp8comm: planner_calibration must be a file path or None, got {self.planner_calibration!r}"
            )
        if self.planner_allow_4bit or self.planner_calibration is not None:
            object.__setattr__(self, "planner", True)  # --fp8comm-planner-allow-4bit / -calibration imply it
        if self.planner:
            try:
                self.planner_settings  # noqa: B018 - validates the timeout
            except Fp8CommConfigError as e:
                raise Fp8CommMegatronError(f"fp8comm: {e}") from None
        if self.hadamard not in HADAMARD or isinstance(self.hadamard, bool):
            raise Fp8CommMegatronError(f"fp8comm: hadamard={self.hadamard!r} is not one of {HADAMARD}")
        try:
            self.guard_policy  # noqa: B018 - validates the thresholds
            if self.grad_fp4:
                self.wire("grad")  # the 4-bit options must fit the format (e.g. nvfp4's 16-element blocks)
        except Fp8CommConfigError as e:
            raise Fp8CommMegatronError(f"fp8comm: {e}") from None

    @property
    def planner_settings(self) -> PlannerSettings | None:
        """The planner's settings (fp8comm.comm.planned), None when it is off."""
        if not self.planner:
            return None
        value: dict[str, object] = {
            "allow_4bit": self.planner_allow_4bit,
            "timeout_s": self.planner_timeout_s,
            "trials": self.planner_trials,
        }
        if self.planner_calibration is not None:
            value["calibration"] = self.planner_calibration
        return parse_settings(value, "--fp8comm-planner")

    def planned(self, dist_opt: bool | None = True, params_fp32: bool = False, te_quantized: bool = False):
        """The settings install() runs under the planner (self when it is off): the gradient hook on; the FP8
        parameter gather on where the distributed optimizer gathers bf16/fp16 params (dist_opt not False, no fp32
        params, no Transformer Engine quantized params); with allow_4bit the gradients' base config is the
        validated recipe, mxfp4 with error feedback (buckets the plan puts on FP8 send config_for(base, "fp8")
        without error feedback; ddp_hooks._grad_collective)."""
        if not self.planner:
            return self
        gather = self.param_gather or (dist_opt is not False and not params_fp32 and not te_quantized)
        four = self.planner_allow_4bit
        return replace(
            self,
            grad_reduce=True,
            param_gather=gather and self.param_update_fmt is None,
            grad_fmt="mxfp4" if four else self.grad_fmt,
            error_feedback=self.error_feedback or four,
        )

    @property
    def guard_policy(self) -> GuardPolicy:
        return GuardPolicy(self.guard_threshold, self.guard_patience, self.guard_cooldown)

    @property
    def grad_fp4(self) -> bool:
        """Gradients travel on a 4-bit wire (mxfp4 / nvfp4)."""
        return self.grad_fmt in FP4_WIRE_FORMATS

    @property
    def param_update(self) -> bool:
        """The distributed optimizer's parameter all-gather sends 4-bit changes (replica += decoded change)."""
        return self.param_update_fmt is not None

    @property
    def uses_fp8_blocks(self) -> bool:
        """Some hook quantizes to FP8, where block_size and scaling apply (4-bit formats fix their own)."""
        return (self.grad_reduce and not self.grad_fp4) or self.param_gather or self.moe

    @property
    def moe(self) -> bool:
        """A MoE hook is on: FP8 dispatch, or a combine other than Megatron's own."""
        return self.moe_dispatch or self.moe_combine != "native"

    @property
    def any(self) -> bool:
        return self.grad_reduce or self.param_gather or self.param_update or self.moe

    def describe(self, dist_opt: bool | None = None) -> str:
        """One line: which hooks are on and how they quantize (install() logs it). dist_opt: whether DDP uses the
        distributed optimizer (gradients reduce-scattered) or not (all-reduced); None: unknown, both named."""
        gemms = "; GEMMs untouched (FP8 GEMMs only through Megatron's own --fp8-format, Transformer Engine)"
        if not self.any:
            return "fp8comm: no hook enabled (Megatron communication unchanged)" + gemms
        grad = {True: "grad reduce-scatter", False: "grad all-reduce", None: "grad reduce-scatter/all-reduce"}
        planned = self.planner
        fp8 = [
            n
            for n, f in (
                (grad[dist_opt], self.grad_reduce and not self.grad_fp4 and not planned),
                ("param all-gather", self.param_gather and not planned),
                ("MoE dispatch", self.moe_dispatch),
                ("MoE combine", self.moe_combine == "fp8"),
            )
            if f
        ]
        head = "FP8 " + ", ".join(fp8) if fp8 else ""
        if planned:
            what = grad[dist_opt] + (" and param all-gather" if self.param_gather else "")
            four = f", {self.grad_fmt} + error feedback for gradients" if self.planner_allow_4bit else ""
            cal = self.planner_calibration or "measured over the world at install"
            head = (
                f"{what} PLANNED per bucket-size class (Megatron's own, FP8{four}; flat or two-level; calibration: "
                f"{cal})" + ("; " + head if head else "")
            )
            if not self.param_gather and dist_opt is not False:  # plain DDP gathers no parameters
                head += "; param all-gather Megatron's own (planned only for bf16/fp16 params, distributed optimizer)"
        elif self.grad_reduce and self.grad_fp4:
            had = f", Hadamard 1x{self.hadamard}" if self.hadamard else ""
            head += ("; " if head else "") + f"{self.grad_fmt} {grad[dist_opt]} ({FP4_LAYOUT[self.grad_fmt]}{had})"
        if self.param_update_fmt is not None:
            head += ("; " if head else "") + (
                f"{self.param_update_fmt} weight-update all-gather (replica += change, "
                f"{FP4_LAYOUT[self.param_update_fmt]})"
            )
        if self.moe_combine == "bf16":
            head += ("; " if head else "") + "bf16 MoE combine through fp8comm"
        extra = []
        if self.guard:
            extra.append(
                f"guard (bf16 fallback above {self.guard_threshold:.2%} for {self.guard_patience} steps, "
                f"{self.guard_cooldown} steps)"
            )
        if self.error_feedback:
            extra.append(f"error feedback {self.error_feedback_dtype} residuals")
        if self.moe:
            extra.append(f"MoE backward {self.moe_grad_wire}")
        blocks = f"1x{self.block_size} {self.scaling} scales, " if self.uses_fp8_blocks else ""
        return (
            f"fp8comm: {head} active (params/tokens {self.fmt}, grads {self.grad_fmt}, {blocks}"
            f"rounding {self.rounding}, hierarchical {'on' if self.hierarchical else 'off'}"
            f", check {self.check}" + "".join(", " + e for e in extra) + ")" + gemms
        )

    def wire(self, kind: str, check: bool | None = None, block_size: int | None = None) -> WireConfig:
        """The fp8comm.comm WireConfig of one hook kind, 'grad', 'param', 'update' or 'moe' (gradients: grad_fmt,
        rounding and error feedback; parameters and tokens: fmt, nearest rounding; update: param_update_fmt,
        nearest); check: this call's check decision. 4-bit wires take the block and scale kind of their format."""
        grad = kind == "grad"
        if kind == "update":
            assert self.param_update_fmt is not None
            return WireConfig(fmt=self.param_update_fmt, rounding="nearest", check=check)
        if grad and self.grad_fp4:
            return WireConfig(
                fmt=self.grad_fmt,
                hadamard=self.hadamard,
                rounding=self.rounding,
                check=check,
                error_feedback=self.error_feedback,
                residual_dtype=self.error_feedback_dtype,
            )
        return WireConfig(
            fmt=self.grad_fmt if grad else self.fmt,
            scaling=self.scaling,
            block_size=block_size or self.block_size,
            rounding=self.rounding if grad else "nearest",
            check=check,
            error_feedback=grad and self.error_feedback,
            residual_dtype=self.error_feedback_dtype,
        )

    @classmethod
    def from_args(cls, args) -> Fp8CommMegatronConfig:
        """From a Megatron-LM argparse namespace extended by add_args (attribute names fp8comm_<field>)."""
        missing = [f.name for f in fields(cls) if not hasattr(args, "fp8comm_" + f.name)]
        if missing:
            raise Fp8CommMegatronError(
                "fp8comm: args lack " + ", ".join("fp8comm_" + m for m in missing) + "; pass "
                "extra_args_provider=fp8comm.integrations.megatron.add_args to parse_args (or call install() "
                "with keywords instead of args)"
            )
        kw = {f.name: getattr(args, "fp8comm_" + f.name) for f in fields(cls)}
        for name in GIVEN_OR_DEFAULT:  # argparse default None: not given (the planner refuses a given one)
            if kw[name] is None:
                kw[name] = cls.__dataclass_fields__[name].default
        return cls(**kw)

    @staticmethod
    def given_in_args(args) -> set[str]:
        """Fields whose flag the command line gave (of GIVEN_OR_DEFAULT: their argparse default is None)."""
        return {name for name in GIVEN_OR_DEFAULT if getattr(args, "fp8comm_" + name, None) is not None}


# Fields whose flag defaults to None in add_args so that install() can tell a given value from the default: the
# planner chooses what they set, and naming both is an error.
GIVEN_OR_DEFAULT = ("grad_fmt",)


# Per-hook counters (this process): proof that each installed hook actually ran, next to fp8comm.comm.comm_stats().
_HOOK_STATS: dict[str, dict[str, int]] = {}


def count(hook: str, key: str, n: int = 1) -> None:
    s = _HOOK_STATS.setdefault(hook, {"fp8_calls": 0, "passthrough_calls": 0, "elements": 0})
    s[key] = s.get(key, 0) + n


def hook_stats(reset: bool = False) -> dict[str, dict[str, int]]:
    """{hook: {fp8_calls, passthrough_calls (group of one rank: nothing to move), elements, [hook-specific]}}.

    Hooks: grad_reduce_scatter, grad_all_reduce (plain DDP), param_all_gather (each with `native_calls`: buckets
    the planner gave Megatron's own collective), param_update (the 4-bit
    weight-update all-gather: `update_calls` and their `wire_bytes` / `dtype_bytes` (what Megatron's gather of the
    same elements would send), `full_calls` (first gathers, in the buffer's dtype) and their `full_wire_bytes` /
    `full_dtype_bytes`, `staged_steps`), moe_dispatch, moe_combine (calls
    that went through fp8comm, FP8 or bf16 wire: `bf16_calls`), error_feedback (`skipped_step_resets`: residuals
    zeroed after a skipped step).
    """
    out = {k: dict(v) for k, v in sorted(_HOOK_STATS.items())}
    if reset:
        _HOOK_STATS.clear()
    return out
