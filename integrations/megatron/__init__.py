"""fp8comm for Megatron-Core / Megatron-LM: FP8 or 4-bit gradient reduce-scatter (optional error feedback), FP8
parameter all-gather or 4-bit weight updates (replica += change), FP8 MoE dispatch and combine; or, with the
planner (--fp8comm-planner), per bucket-size class whichever of Megatron's own, FP8 or 4 bits is predicted fastest.

Megatron-LM:  args = parse_args(extra_args_provider=add_args); ...; install(args)   (before the model is built)
Megatron-Core: install(ddp_config=ddp_config, transformer_config=config, grad_reduce=True, param_gather=True)
uninstall() restores every patched name; shutdown() at the end of the job, before destroy_process_group(), also
releases the process groups Megatron keeps. See docs/megatron.md.
"""

from fp8comm.deprecation import renamed

from .args import add_args
from .config import Fp8CommMegatronConfig, Fp8CommMegatronError, hook_stats
from .error_feedback import load_state_dict as load_error_feedback_state_dict
from .error_feedback import nbytes as error_feedback_nbytes
from .error_feedback import state_dict as error_feedback_state_dict
from .guard import load_state_dict as load_guard_state_dict
from .guard import state_dict as guard_state_dict
from .guard import summary as guard_summary
from .install import active_config, install, uninstall
from .installation import Installation
from .installation import current as installation
from .patch_points import PATCH_POINTS, SUPPORTED_SERIES, check_patch_points, check_version, megatron_version
from .planning import summary as planner_summary
from .replica_update import load_state_dict as load_replica_update_state_dict
from .replica_update import nbytes as replica_update_nbytes
from .replica_update import reset as reset_replica_updates
from .replica_update import state_dict as replica_update_state_dict
from .teardown import release_groups, shutdown

__all__ = [
    "add_args",
    "install",
    "uninstall",
    "shutdown",
    "release_groups",
    "active_config",
    "hook_stats",
    "Fp8CommMegatronConfig",
    "Fp8CommMegatronError",
    "PATCH_POINTS",
    "SUPPORTED_SERIES",
    "check_patch_points",
    "check_version",
    "megatron_version",
    "error_feedback_state_dict",
    "load_error_feedback_state_dict",
    "error_feedback_nbytes",
    "guard_state_dict",
    "load_guard_state_dict",
    "guard_summary",
    "replica_update_state_dict",
    "load_replica_update_state_dict",
    "replica_update_nbytes",
    "reset_replica_updates",
    "Installation",
    "installation",
    "planner_summary",
]

__getattr__ = renamed(
    __name__,
    {
        "Fp8commConfig": ("Fp8CommMegatronConfig", Fp8CommMegatronConfig),
        "Fp8commMegatronError": ("Fp8CommMegatronError", Fp8CommMegatronError),
    },
)
