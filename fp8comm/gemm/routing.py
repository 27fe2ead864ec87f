"""GEMM routing state for the process: which backend took each GEMM (counters), which failed, what was probed.

Routing is never silent: every GEMM counts under `gemm.<backend>[.<why>]` (padding, fallbacks) and each new
routing decision is logged once. The state is per process because what it caches is (the device's capabilities,
a backend that raised once for a signature); `reset()` clears it (tests, benchmarks).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

log = logging.getLogger("fp8comm.gemm")


class Routing:
    """Counters, the failure memo, the once-per-decision log set and the blockwise-layout probe results."""

    def __init__(self) -> None:
        self.counters: Counter = Counter()
        self.failed: dict[tuple, str] = {}  # (backend, signature) -> error: not retried for that signature
        self.logged: set[tuple] = set()
        self.blockwise_probe: dict[str, Any] = {}  # "device/pair" -> block_scaled_mm.Layout, or False
        self._lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def snapshot(self, prefix: str = "") -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in sorted(self.counters.items()) if k.startswith(prefix)}

    def failures(self) -> dict[tuple, str]:
        """(backend, signature) -> the error that took that backend out of the routing."""
        return dict(self.failed)

    def reset(self, counters_only: bool = False) -> None:
        with self._lock:
            self.counters.clear()
            if not counters_only:
                self.failed.clear()
                self.logged.clear()
                self.blockwise_probe.clear()


ROUTING = Routing()
