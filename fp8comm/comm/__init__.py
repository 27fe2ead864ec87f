"""FP8 and 4-bit collectives (all-gather, reduce-scatter, all-reduce, MoE all-to-all) on the packed wire format.

Every call quantizes with per-block scales, moves payload and scales in ONE uint8 collective, and dequantizes on
the receiver; see docs/collectives.md for options, error bounds and the metadata check.
"""

from ..errors import CommMismatchError, Fp8CommConfigError, Fp8CommError
from .api import Buffer, shutdown, teardown, unpin_default_groups
from .buffers import Handle, ScratchPool
from .collectives import all_gather, all_gather_into, all_reduce, all_reduce_into, reduce_scatter, reduce_scatter_into
from .config import (
    CHECK_POLICIES,
    FORMATS,
    KERNEL_BACKENDS,
    RESIDUAL_ALIASES,
    RESIDUAL_DTYPES,
    ROUNDINGS,
    SCALE_ENCODINGS,
    WireConfig,
    default_check_policy,
    residual_dtype_name,
    residual_nbytes,
)
from .feedback import ErrorFeedback
from .guard import Guard, GuardBucket, GuardPolicy, config_for
from .hierarchical import HierarchicalGroups, node_groups, release_node_groups
from .moe import WIRES, all_to_all
from .state import CommState, default_state
from .stats import Stats, comm_stats, format_comm_stats, reset_comm_stats
from .updates import ReplicaUpdate, UpdateHandle

DEFAULT_POOL = default_state().pool  # the functional API's scratch pool (0.1 name)

# Importing fp8comm imported torch._dynamo, and with it torch.distributed.nn.functional, whose default arguments
# would otherwise pin the default process group (see api.unpin_default_groups); shutdown() repeats this for
# anything imported later.
unpin_default_groups()

__all__ = [
    "all_gather",
    "all_gather_into",
    "reduce_scatter",
    "reduce_scatter_into",
    "all_reduce",
    "all_reduce_into",
    "all_to_all",
    "comm_stats",
    "shutdown",
    "teardown",
    "reset_comm_stats",
    "format_comm_stats",
    "Buffer",
    "WireConfig",
    "Handle",
    "ScratchPool",
    "DEFAULT_POOL",
    "CommState",
    "default_state",
    "Stats",
    "ErrorFeedback",
    "HierarchicalGroups",
    "node_groups",
    "release_node_groups",
    "Fp8CommError",
    "Fp8CommConfigError",
    "CommMismatchError",
    "FORMATS",
    "SCALE_ENCODINGS",
    "ROUNDINGS",
    "KERNEL_BACKENDS",
    "CHECK_POLICIES",
    "RESIDUAL_ALIASES",
    "RESIDUAL_DTYPES",
    "residual_dtype_name",
    "residual_nbytes",
    "WIRES",
    "default_check_policy",
    "Guard",
    "GuardPolicy",
    "GuardBucket",
    "config_for",
    "ReplicaUpdate",
    "UpdateHandle",
]
