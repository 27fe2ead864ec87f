"""DeepSpeed integration: one config section turns on FP8 weight gathers, gradient reduction and MoE dispatch
(FP8 GEMMs only with "gemm": {"enabled": true}).

    import deepspeed
    import fp8comm.integrations.deepspeed   # optional where the package is installed: its autoload hook already
                                            # makes deepspeed.initialize honour "fp8_comm" (FP8COMM_AUTOLOAD=0: off)

    config = {..., "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "fp8_comm": {"enabled": True}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

or call fp8comm.integrations.deepspeed.initialize(...) with the same arguments. See docs/deepspeed.md for every
option, what each hook replaces, the supported versions and how to check that FP8 is really on.
"""

from __future__ import annotations

import sys

from fp8comm.deprecation import renamed
from fp8comm.errors import Fp8CommConfigError, Fp8CommError, Fp8CommStateError, Fp8CommUnsupportedError

from .compat import SUPPORTED_BELOW, SUPPORTED_MIN
from .config import Fp8CommDeepSpeedConfig, GradientConfig, GuardConfig, TrafficConfig, defaults, parse
from .engine import EngineState, enable_config_flag, engine_state, engines, initialize, install, uninstall
from .patching import PASSTHROUGH
from .teardown import release_groups, shutdown


def is_installed() -> bool:
    """True while fp8comm's dispatchers are in DeepSpeed (from the first fp8_comm engine until uninstall())."""
    from .engine import _HOOKS

    return len(_HOOKS) > 0


def _merge(stats: list[dict]) -> dict:
    out: dict = {}
    for s in stats:
        for role, v in s.items():
            if role == "hooks":
                h = out.setdefault("hooks", {})
                for k, c in v.items():
                    h[k] = h.get(k, 0) + c
            elif role == "error_feedback":
                e = out.setdefault(role, {"residual_bytes": 0, "residuals": 0, "skipped_step_resets": 0})
                for k in e:
                    e[k] += v[k]
            else:
                o = out.setdefault(role, {"calls": 0, "fp8_calls": 0, "wire_bytes": 0, "dtype_bytes": 0})
                for k in ("calls", "fp8_calls", "wire_bytes", "dtype_bytes"):
                    o[k] += v[k]
                o["ratio"] = o["dtype_bytes"] / o["wire_bytes"] if o["wire_bytes"] else float("nan")
    return out


def hook_stats(engine=None) -> dict:
    """Per traffic kind ("weights", "gradients", "moe.dispatch", "moe.combine", "moe.backward"): calls, fp8_calls,
    wire_bytes (sent to other ranks), dtype_bytes (what DeepSpeed's own collective moves) and their ratio; "hooks":
    calls per code path; "error_feedback": residual memory. Of `engine`, or summed over every fp8comm engine."""
    if engine is not None:
        es = engine_state(engine)
        return {} if es is None else es.hook_stats()
    return _merge([es.hook_stats() for es in engines()])


def reset_hook_stats(engine=None) -> None:
    for es in [engine_state(engine)] if engine is not None else engines():
        if es is not None:
            es.acct.reset()


def passthrough_stats() -> dict:
    """Calls the dispatchers handed to DeepSpeed's original because they belong to no fp8comm engine, per path."""
    return PASSTHROUGH.snapshot().get("hooks", {})


def summary(engine=None) -> str:
    """The one-line description of what is active for `engine` (None: the most recently built one; '' if none)."""
    es = engine_state(engine)
    return "" if es is None else es.summary


def finish_updates(engine=None) -> int:
    """Wait the 4-bit weight-update gathers still in flight (ZeRO-1/2, weights.update_fmt): the next forward does it
    by itself; call this before reading engine.module's parameters between a step and the next forward. Of `engine`
    (None: every fp8comm engine); returns how many gathers it waited."""
    from .updates import finish_updates as finish

    return sum(finish(es, "api") for es in ([engine_state(engine)] if engine is not None else engines()) if es)


def _take_over_from_autoload() -> None:
    """The autoload hook (_fp8comm_autoload, run by the installed .pth) gives deepspeed.initialize back before the
    flag wraps it, so the flag wraps DeepSpeed's own function once; if the flag cannot be enabled, the hook returns.
    Both are no-ops when FP8COMM_AUTOLOAD=0 turned the hook off: a failed import then leaves initialize untouched."""
    hook = sys.modules.get("_fp8comm_autoload")
    if hook is not None:
        hook.release()
    try:
        enable_config_flag()
    except BaseException:
        if hook is not None:
            hook.reattach()  # keep the section from being silently ignored by later initialize() calls
        raise


_take_over_from_autoload()

__all__ = [
    "initialize",
    "install",
    "uninstall",
    "shutdown",
    "release_groups",
    "is_installed",
    "hook_stats",
    "reset_hook_stats",
    "finish_updates",
    "summary",
    "engine_state",
    "engines",
    "EngineState",
    "passthrough_stats",
    "parse",
    "defaults",
    "Fp8CommDeepSpeedConfig",
    "TrafficConfig",
    "GradientConfig",
    "GuardConfig",
    "Fp8CommError",
    "Fp8CommConfigError",
    "Fp8CommUnsupportedError",
    "Fp8CommStateError",
    "enable_config_flag",
    "SUPPORTED_MIN",
    "SUPPORTED_BELOW",
]

__getattr__ = renamed(
    __name__,
    {
        "Fp8CommConfig": ("Fp8CommDeepSpeedConfig", Fp8CommDeepSpeedConfig),
        "UnsupportedError": ("fp8comm.errors.Fp8CommUnsupportedError", Fp8CommUnsupportedError),
    },
)
