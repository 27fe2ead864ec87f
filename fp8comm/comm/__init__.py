"""FP8 collectives (all-gather, reduce-scatter, all-reduce, MoE all-to-all) built on the packed wire format.

Every call quantizes with per-block scales, moves payload and scales in ONE uint8 collective, and dequantizes on
the receiver; see docs/collectives.md for options, error bounds and the metadata check.
"""
from .api import Buffer
from .buffers import DEFAULT_POOL, Handle, ScratchPool
from .checks import CommMismatchError, Fp8CommError
from .collectives import (all_gather, all_gather_into, all_reduce, all_reduce_into, reduce_scatter,
                          reduce_scatter_into)
from .hierarchical import HierarchicalGroups, node_groups
from .moe import all_to_all
from .options import ErrorFeedback
from .stats import comm_stats, format_comm_stats, reset_comm_stats

__all__ = ["all_gather", "all_gather_into", "reduce_scatter", "reduce_scatter_into", "all_reduce",
           "all_reduce_into", "all_to_all", "comm_stats", "reset_comm_stats", "format_comm_stats", "Buffer",
           "Handle", "ScratchPool", "DEFAULT_POOL", "ErrorFeedback", "HierarchicalGroups", "node_groups",
           "Fp8CommError", "CommMismatchError"]
