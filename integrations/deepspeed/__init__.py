"""DeepSpeed integration: one config section turns on FP8 weight gathers, gradient reduction, MoE dispatch and GEMMs.

    import deepspeed
    import fp8comm.integrations.deepspeed   # from now on deepspeed.initialize honours "fp8_comm"

    config = {..., "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "fp8_comm": {"enabled": True}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

or call fp8comm.integrations.deepspeed.initialize(...) with the same arguments. See docs/deepspeed.md for every
option, what each hook replaces, the supported versions and how to check that FP8 is really on.
"""
from __future__ import annotations

from fp8comm.deprecation import renamed
from fp8comm.errors import Fp8CommConfigError, Fp8CommError, Fp8CommStateError, Fp8CommUnsupportedError

from .compat import SUPPORTED_BELOW, SUPPORTED_MIN
from .config import Fp8CommDeepSpeedConfig, TrafficConfig, defaults, parse
from .engine import enable_config_flag, initialize, install, state, uninstall


def is_installed() -> bool:
    return state() is not None


def hook_stats() -> dict:
    """Per traffic kind ("weights", "gradients", "moe.dispatch", "moe.combine", "moe.backward"): calls, fp8_calls,
    wire_bytes (sent to other ranks), dtype_bytes (what DeepSpeed's own collective moves) and their ratio."""
    st = state()
    return {} if st is None else st.acct.snapshot()


def reset_hook_stats() -> None:
    st = state()
    if st is not None:
        st.acct.reset()


def summary() -> str:
    """The one-line description of what is active ('' when nothing is installed)."""
    st = state()
    return "" if st is None else st.summary


enable_config_flag()

__all__ = ["initialize", "install", "uninstall", "is_installed", "hook_stats", "reset_hook_stats", "summary",
           "parse", "defaults", "Fp8CommDeepSpeedConfig", "TrafficConfig", "Fp8CommError", "Fp8CommConfigError",
           "Fp8CommUnsupportedError", "Fp8CommStateError",
           "enable_config_flag", "SUPPORTED_MIN", "SUPPORTED_BELOW"]

__getattr__ = renamed(__name__, {"Fp8CommConfig": ("Fp8CommDeepSpeedConfig", Fp8CommDeepSpeedConfig),
                                 "UnsupportedError": ("fp8comm.errors.Fp8CommUnsupportedError",
                                                      Fp8CommUnsupportedError)})
