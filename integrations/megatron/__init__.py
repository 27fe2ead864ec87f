"""fp8comm for Megatron-Core / Megatron-LM: FP8 gradient reduce-scatter, FP8 parameter all-gather, FP8 MoE dispatch.

Megatron-LM:  args = parse_args(extra_args_provider=add_args); ...; install(args)   (before the model is built)
Megatron-Core: install(ddp_config=ddp_config, transformer_config=config, grad_reduce=True, param_gather=True)
uninstall() restores every patched name. See docs/megatron.md.
"""
from .args import add_args
from .config import Fp8commConfig, Fp8commMegatronError, hook_stats
from .install import (PATCH_POINTS, SUPPORTED_SERIES, active_config, check_patch_points, check_version, install,
                      megatron_version, uninstall)

__all__ = ["add_args", "install", "uninstall", "active_config", "hook_stats", "Fp8commConfig",
           "Fp8commMegatronError", "PATCH_POINTS", "SUPPORTED_SERIES", "check_patch_points", "check_version",
           "megatron_version"]
