"""What the Megatron plugin turns on and how it quantizes: one frozen config, built from argparse args or keywords."""
from __future__ import annotations

from dataclasses import dataclass, fields

FORMATS = ("e4m3", "e5m2")
SCALINGS = ("fp32", "pow2", "e8m0")
ROUNDINGS = ("nearest", "stochastic")
CHECKS = ("first", "always", "never")
MOE_GRAD_WIRES = ("bf16", "fp8", "native")


class Fp8commMegatronError(ValueError):
    """A setting that would corrupt training or silently do nothing; raised before anything is patched."""


@dataclass(frozen=True)
class Fp8commConfig:
    """Plugin settings. Defaults match the argparse defaults in args.py (docs/megatron.md lists both)."""

    grad_reduce: bool = False  # FP8 gradient reduce-scatter in DDP (distributed optimizer)
    param_gather: bool = False  # FP8 parameter all-gather of the distributed optimizer
    moe_dispatch: bool = False  # FP8 token dispatch in MoEAlltoAllTokenDispatcher
    fmt: str = "e4m3"  # FP8 format of parameters and MoE tokens
    grad_fmt: str = "e4m3"  # FP8 format of gradients (per-block scales leave E4M3 enough range)
    block_size: int = 128  # elements per scale (1 x block_size blocks of the flat buffer / of each token)
    scaling: str = "fp32"  # scale encoding: fp32 (exact amax scale), pow2 or e8m0 (power-of-two byte)
    rounding: str = "nearest"  # gradient rounding: nearest or stochastic (params/tokens always nearest)
    hierarchical: bool = False  # gradients/params: high precision inside a node, FP8 across nodes
    check: str = "first"  # cross-rank metadata check: first call per buffer, every call, or never
    moe_grad_wire: str = "bf16"  # MoE dispatch backward (token gradients): bf16, fp8 or the tensor's dtype

    def __post_init__(self) -> None:
        for name, allowed in (("fmt", FORMATS), ("grad_fmt", FORMATS), ("scaling", SCALINGS),
                              ("rounding", ROUNDINGS), ("check", CHECKS), ("moe_grad_wire", MOE_GRAD_WIRES)):
            if getattr(self, name) not in allowed:
                raise Fp8commMegatronError(f"fp8comm: {name}={getattr(self, name)!r} is not one of {allowed}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise Fp8commMegatronError(f"fp8comm: block_size must be a positive int, got {self.block_size!r}")

    @property
    def any(self) -> bool:
        return self.grad_reduce or self.param_gather or self.moe_dispatch

    def describe(self) -> str:
        on = [n for n, f in (("grad reduce-scatter", self.grad_reduce), ("param all-gather", self.param_gather),
                             ("MoE dispatch", self.moe_dispatch)) if f]
        if not on:
            return "fp8comm: no hook enabled (Megatron communication unchanged)"
        return (f"fp8comm: FP8 {', '.join(on)} active (params/tokens {self.fmt}, grads {self.grad_fmt}, 1x"
                f"{self.block_size} {self.scaling} scales, rounding {self.rounding}, hierarchical "
                f"{'on' if self.hierarchical else 'off'}, check {self.check}"
                + (f", MoE backward {self.moe_grad_wire}" if self.moe_dispatch else "") + ")")

    def wire_kwargs(self, kind: str) -> dict:
        """Keyword options for fp8comm.comm for one hook kind: 'grad', 'param' or 'moe'."""
        kw = {"fmt": self.grad_fmt if kind == "grad" else self.fmt, "scaling": self.scaling,
              "block_size": self.block_size}
        if kind == "grad":
            kw["rounding"] = self.rounding
        return kw

    @classmethod
    def from_args(cls, args) -> "Fp8commConfig":
        """From a Megatron-LM argparse namespace extended by add_args (attribute names fp8comm_<field>)."""
        missing = [f.name for f in fields(cls) if not hasattr(args, "fp8comm_" + f.name)]
        if missing:
            raise Fp8commMegatronError(
                "fp8comm: args lack " + ", ".join("fp8comm_" + m for m in missing) + "; pass "
                "extra_args_provider=fp8comm.integrations.megatron.add_args to parse_args (or call install() "
                "with keywords instead of args)")
        return cls(**{f.name: getattr(args, "fp8comm_" + f.name) for f in fields(cls)})


# Per-hook counters (this process): proof that each installed hook actually ran, next to fp8comm.comm.comm_stats().
_HOOK_STATS: dict[str, dict[str, int]] = {}


def count(hook: str, key: str, n: int = 1) -> None:
    s = _HOOK_STATS.setdefault(hook, {"fp8_calls": 0, "passthrough_calls": 0, "elements": 0})
    s[key] += n


def hook_stats(reset: bool = False) -> dict[str, dict[str, int]]:
    """{hook: {fp8_calls, passthrough_calls (group of one rank: nothing to move), elements}}."""
    out = {k: dict(v) for k, v in sorted(_HOOK_STATS.items())}
    if reset:
        _HOOK_STATS.clear()
    return out
