"""CommState: what the collectives keep between calls (scratch pool, statistics, seeds, metadata-check counts).

Each Buffer owns one; calls without a Buffer use the process's default state (`default_state()`), so the
functional API and a Buffer never share scratch memory, counters or seeds by accident.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from ..quant.reference import mix32
from .buffers import ScratchPool
from .config import check_policy
from .stats import PROCESS_STATS, Stats

FIRST_CALLS = 3  # calls of each op on each group that the "first" check policy checks


class CommState:
    """Scratch pool, per-op statistics, the stochastic-rounding call counter and the check policy's call counts."""

    def __init__(self) -> None:
        self.pool = ScratchPool()
        self.stats = Stats(parent=PROCESS_STATS)
        self._seed_calls = 0
        self._check_calls: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def next_seed(self, seed: int | None, rank: int, rounding: str) -> int:
        """This call's stochastic-rounding key: distinct per rank and (seed None) per call; 0 for nearest rounding
        (the counter still moves, so later stochastic calls see the same seeds whatever rounded to nearest)."""
        if seed is None:
            with self._lock:
                self._seed_calls += 1
                seed = self._seed_calls
        if rounding != "stochastic":
            return 0
        # mix32 hashes a 32-bit value; folding the rank in keeps ranks' rounding decisions independent.
        return int(mix32((int(seed) * 0x9E3779B1 + rank * 0x85EBCA77) & 0xFFFFFFFF))

    def should_check(self, check, group, op: str) -> bool:
        """Whether this call runs the metadata check under policy `check`; the same answer on every rank.

        "first" checks the first FIRST_CALLS calls of each op on each group made through this state: every member
        makes the same calls in the same order (or the payload itself would hang), so the counts agree."""
        policy = check_policy(check)
        key = (_group_key(group), op)
        with self._lock:
            n = self._check_calls.get(key, 0)
            self._check_calls[key] = n + 1
        if policy == "first":
            return n < FIRST_CALLS
        return policy == "always"


def _group_key(group):
    """A process-wide identity of a group: its registered name (unique per group), else the object's id."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg.group_name or id(pg)
    except RuntimeError:  # a backend-level group without a registered name
        return id(pg)


_DEFAULT = CommState()


def default_state() -> CommState:
    """The state of calls made without a Buffer (the functional API)."""
    return _DEFAULT
