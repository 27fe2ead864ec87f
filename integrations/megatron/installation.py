"""The one fp8comm installation of this process: its config, the patches to undo, and everything its hooks keep.

Megatron's patch points are module globals, so there is at most one installation per process (`current()`). What
the hooks remember (which buffers already ran the metadata check, hierarchical node groups, error-feedback
residuals, 4-bit weight-update states, the numerics guard and its bucket keys) lives on that object, so
uninstall() drops all of it at once.
The per-hook counters (config.hook_stats) are process statistics, like fp8comm.comm.comm_stats(): they outlive it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from fp8comm.comm import ErrorFeedback, Guard

from .config import Fp8CommMegatronConfig, Fp8CommMegatronError


@dataclass(eq=False)
class Installation:
    cfg: Fp8CommMegatronConfig
    saved: list[tuple[object, str, object]] = field(default_factory=list)  # (owner, name, original), patch order
    checked: set = field(default_factory=set)  # keys whose first call ran the metadata check (check="first")
    # hierarchical: global ranks of each DP group -> its fp8comm node groups (or why it cannot be split), all
    # created at install on every rank in one order
    node_groups: dict = field(default_factory=dict)
    # id(bucket grad_data) -> (weakref to it, its residual); the weakref guards against a reused id after a free
    residuals: dict[int, tuple[weakref.ref, ErrorFeedback]] = field(default_factory=dict)
    # id(bucket param_data) -> (weakref to it, its 4-bit weight-update state: replica_update.BucketReplica)
    replicas: dict[int, tuple[weakref.ref, Any]] = field(default_factory=dict)
    guard: Guard | None = None
    guard_keys: dict[tuple[str, int], tuple[weakref.ref, str]] = field(default_factory=dict)  # (kind, id) -> key
    # --fp8comm-planner: the RuntimePlanner (fp8comm.comm.planned; None: off), the world's node table gathered at
    # install (group shapes are computed from it without communication), group ranks -> GroupShape, and every line
    # the planner logged on this rank (rank 0 prints them)
    planner: Any = None
    node_table: Any = None
    shapes: dict = field(default_factory=dict)
    plan_log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cfg.guard and self.guard is None:
            self.guard = Guard(self.cfg.guard_policy)

    @property
    def residual_dtype(self) -> str:
        """The residuals' precision: float32, bfloat16 or fp8 (compact codes, fp8comm.quant.residual)."""
        return self.cfg.error_feedback_dtype


_CURRENT: list[Installation] = []  # the patch points are process-wide: one slot


def current() -> Installation | None:
    return _CURRENT[0] if _CURRENT else None


def installed() -> Installation:
    """current(), for the hooks: they only run while installed (uninstall() restores Megatron's own functions)."""
    inst = current()
    if inst is None:  # a reference to a hook kept past uninstall()
        raise Fp8CommMegatronError("fp8comm: a Megatron hook ran after uninstall(); nothing is installed")
    return inst


def begin(cfg: Fp8CommMegatronConfig) -> Installation:
    inst = Installation(cfg)
    _CURRENT[:] = [inst]
    return inst


def end() -> Installation | None:
    """Forget the installation (its residuals, guard and memos with it); returns it so its patches can be undone."""
    return _CURRENT.pop() if _CURRENT else None


def hierarchical_groups(group):
    """fp8comm node groups of a Megatron group (None: this group runs flat), prepared at install
    (prepare_node_groups); never created here, where only the group's own members are."""
    plan = installed().node_groups
    if not plan:  # install() could not prepare any (logged): flat everywhere, the same on every rank
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    split = plan.get(ranks)
    if split is None:
        raise Fp8CommMegatronError(
            f"fp8comm: hierarchical (two-level) collectives: a bucket collective runs over ranks {list(ranks)}, "
            "which is not one of the data-parallel groups whose node groups install() prepared (a process group "
            "passed to DDP through pg_collection?); creating them now would deadlock: only this group's members "
            "get here. Pass hierarchical=False (--no-fp8comm-hierarchical) to run it flat"
        )
    return split.groups
