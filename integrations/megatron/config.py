"""What the Megatron plugin turns on and how it quantizes: one frozen config, built from argparse args or keywords."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fp8comm.comm import CHECK_POLICIES, FORMATS, ROUNDINGS, SCALE_ENCODINGS, WIRES, GuardPolicy, WireConfig
from fp8comm.errors import Fp8CommConfigError

SCALINGS = SCALE_ENCODINGS
CHECKS = CHECK_POLICIES
MOE_GRAD_WIRES = ("bf16", "fp8", "native")
MOE_COMBINES = ("native", "bf16", "fp8")  # native: Megatron's own combine collective, untouched
assert set(MOE_GRAD_WIRES) == set(MOE_COMBINES) == set(WIRES)
EF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # flag value -> residual dtype (4 or 2 bytes per element)
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
    grad_fmt: str = "e4m3"  # FP8 format of gradients (per-block scales leave E4M3 enough range)
    block_size: int = 128  # elements per scale (1 x block_size blocks of the flat buffer / of each token)
    scaling: str = "fp32"  # scale encoding: fp32 (exact amax scale), pow2 or e8m0 (power-of-two byte)
    rounding: str = "nearest"  # gradient rounding: nearest or stochastic (params/tokens always nearest)
    hierarchical: bool = False  # gradients/params: high precision inside a node, FP8 across nodes
    check: str = "first"  # cross-rank metadata check: first call per buffer, every call, or never
    moe_grad_wire: str = "bf16"  # MoE dispatch/combine backward (token gradients): bf16, fp8 or the tensor's dtype
    error_feedback: bool = False  # gradient hook: carry each bucket's FP8 quantization error into the next step
    error_feedback_dtype: str = "fp32"  # residual dtype: fp32 (+4 B per gradient element) or bf16 (+2 B)
    moe_combine: str = "native"  # MoE combine (expert outputs back): native (Megatron's), bf16 or fp8
    guard: bool = False  # numerics guard: a bucket whose data stops fitting FP8 falls back to Megatron's bf16
    guard_threshold: float = 1e-3  # fraction of a bucket's elements saturated or underflowed in one step
    guard_patience: int = 3  # steps over the threshold before the bucket falls back
    guard_cooldown: int = 50  # steps in bf16 before FP8 is tried again

    def __post_init__(self) -> None:
        for name, allowed in (
            ("fmt", FORMATS),
            ("grad_fmt", FORMATS),
            ("scaling", SCALINGS),
            ("rounding", ROUNDINGS),
            ("check", CHECKS),
            ("moe_grad_wire", MOE_GRAD_WIRES),
            ("error_feedback_dtype", tuple(EF_DTYPES)),
            ("moe_combine", MOE_COMBINES),
        ):
            if getattr(self, name) not in allowed:
                raise Fp8CommMegatronError(f"fp8comm: {name}={getattr(self, name)!r} is not one of {allowed}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise Fp8CommMegatronError(f"fp8comm: block_size must be a positive int, got {self.block_size!r}")
        for name in ("grad_reduce", "param_gather", "moe_dispatch", "hierarchical", "error_feedback", "guard"):
            if not isinstance(getattr(self, name), bool):
                raise Fp8CommMegatronError(f"fp8comm: {name} must be True or False, got {getattr(self, name)!r}")
        try:
            self.guard_policy  # noqa: B018 - validates the thresholds
        except Fp8CommConfigError as e:
            raise Fp8CommMegatronError(f"fp8comm: {e}") from None

    @property
    def guard_policy(self) -> GuardPolicy:
        return GuardPolicy(self.guard_threshold, self.guard_patience, self.guard_cooldown)

    @property
    def moe(self) -> bool:
        """A MoE hook is on: FP8 dispatch, or a combine other than Megatron's own."""
        return self.moe_dispatch or self.moe_combine != "native"

    @property
    def any(self) -> bool:
        return self.grad_reduce or self.param_gather or self.moe

    def describe(self, dist_opt: bool | None = None) -> str:
        """One line: which hooks are on and how they quantize (install() logs it). dist_opt: whether DDP uses the
        distributed optimizer (gradients reduce-scattered) or not (all-reduced); None: unknown, both named."""
        gemms = "; GEMMs untouched (FP8 GEMMs only through Megatron's own --fp8-format, Transformer Engine)"
        if not self.any:
            return "fp8comm: no hook enabled (Megatron communication unchanged)" + gemms
        grad = {True: "grad reduce-scatter", False: "grad all-reduce", None: "grad reduce-scatter/all-reduce"}
        fp8 = [
            n
            for n, f in (
                (grad[dist_opt], self.grad_reduce),
                ("param all-gather", self.param_gather),
                ("MoE dispatch", self.moe_dispatch),
                ("MoE combine", self.moe_combine == "fp8"),
            )
            if f
        ]
        head = "FP8 " + ", ".join(fp8) if fp8 else ""
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
        return (
            f"fp8comm: {head} active (params/tokens {self.fmt}, grads {self.grad_fmt}, 1x{self.block_size} "
            f"{self.scaling} scales, rounding {self.rounding}, hierarchical {'on' if self.hierarchical else 'off'}"
            f", check {self.check}" + "".join(", " + e for e in extra) + ")" + gemms
        )

    def wire(self, kind: str, check: bool | None = None, block_size: int | None = None) -> WireConfig:
        """The fp8comm.comm WireConfig of one hook kind, 'grad', 'param' or 'moe' (gradients: grad_fmt, rounding
        and error feedback; parameters and tokens: fmt, nearest rounding); check: this call's check decision."""
        grad = kind == "grad"
        return WireConfig(
            fmt=self.grad_fmt if grad else self.fmt,
            scaling=self.scaling,
            block_size=block_size or self.block_size,
            rounding=self.rounding if grad else "nearest",
            check=check,
            error_feedback=grad and self.error_feedback,
            residual_dtype=EF_DTYPES[self.error_feedback_dtype],
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
        return cls(**{f.name: getattr(args, "fp8comm_" + f.name) for f in fields(cls)})


# Per-hook counters (this process): proof that each installed hook actually ran, next to fp8comm.comm.comm_stats().
_HOOK_STATS: dict[str, dict[str, int]] = {}


def count(hook: str, key: str, n: int = 1) -> None:
    s = _HOOK_STATS.setdefault(hook, {"fp8_calls": 0, "passthrough_calls": 0, "elements": 0})
    s[key] = s.get(key, 0) + n


def hook_stats(reset: bool = False) -> dict[str, dict[str, int]]:
    """{hook: {fp8_calls, passthrough_calls (group of one rank: nothing to move), elements, [hook-specific]}}.

    Hooks: grad_reduce_scatter, grad_all_reduce (plain DDP), param_all_gather, moe_dispatch, moe_combine (calls
    that went through fp8comm, FP8 or bf16 wire: `bf16_calls`), error_feedback (`skipped_step_resets`: residuals
    zeroed after a skipped step).
    """
    out = {k: dict(v) for k, v in sorted(_HOOK_STATS.items())}
    if reset:
        _HOOK_STATS.clear()
    return out
