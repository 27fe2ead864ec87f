"""FSDP2 integration: FP8 weight all-gather and FP8 gradient reduce-scatter for PyTorch's fully_shard.

    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32))
    fully_shard(model, mesh=mesh, ...)
    report = fp8comm.integrations.fsdp2.enable(model)      # FSDP2's comm hooks, on every FSDP2 module
    print(report)
    ...
    fp8comm.integrations.fsdp2.disable(model)              # FSDP2's own collectives again

    fp8comm.integrations.fsdp2.enable(model, planner=True) # per size class: FSDP2's own, FP8 (or 4-bit gradients),
                                                           # flat or two-level, from a calibration

See docs/fsdp2.md for the options, what crosses the wire, and the limits.
"""

from .config import Fp8CommFsdp2Config, Fp8CommFsdp2Error, GradientWire, WeightWire, defaults, parse
from .enable import Fsdp2Report, ModuleEntry, disable, enable, is_enabled, report
from .hooks import Fp8AllGather, Fp8ReduceScatter, Fp8Work, hook_stats, reset_hook_stats
from .layout import FSDP2_INTERNALS, check_fsdp2_internals

__all__ = [
    "enable",
    "disable",
    "is_enabled",
    "report",
    "hook_stats",
    "reset_hook_stats",
    "Fsdp2Report",
    "ModuleEntry",
    "Fp8CommFsdp2Config",
    "WeightWire",
    "GradientWire",
    "Fp8CommFsdp2Error",
    "parse",
    "defaults",
    "Fp8AllGather",
    "Fp8ReduceScatter",
    "Fp8Work",
    "FSDP2_INTERNALS",
    "check_fsdp2_internals",
]
