"""Reusable scratch buffers (packed send/receive bytes, fp32 accumulators) and the async handle that returns them.

A buffer is leased for the lifetime of one collective and returned when its handle completes, so overlapping async
calls never share scratch memory. Freed buffers are reused by later calls of the same or smaller size.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

# Allocation granularity: sizes are rounded up so slightly different bucket sizes reuse the same buffer.
_GRANULE = 1 << 16
# Free buffers kept per (device, dtype); beyond this the smallest are dropped.
_MAX_FREE = 8


class ScratchPool:
    """A free list of flat tensors per (device, dtype); `take` leases a view, `give` returns its base."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocations = 0  # how many bases were ever allocated (tests check reuse with it)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(view of exactly `numel` elements, base to give back). Contents are undefined."""
        key = (torch.device(device), dtype)
        with self._lock:
            free = self._free.setdefault(key, [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                # list.remove would compare tensors elementwise: pop by index.
                base = free.pop(min(fits, key=lambda i: free[i].numel()))
                return base[:numel], base
            self.allocations += 1
        n = max(_GRANULE, -(-numel // _GRANULE) * _GRANULE)
        base = torch.empty(n, dtype=dtype, device=device)
        return base[:numel], base

    def give(self, base: torch.Tensor) -> None:
        key = (base.device, base.dtype)
        with self._lock:
            free = self._free.setdefault(key, [])
            free.append(base)
            if len(free) > _MAX_FREE:
                free.pop(min(range(len(free)), key=lambda i: free[i].numel()))

    def clear(self) -> None:
        """Drop every free buffer (leased ones are freed when their call completes)."""
        with self._lock:
            self._free.clear()

    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for fl in self._free.values() for b in fl)


DEFAULT_POOL = ScratchPool()


class Lease:
    """The scratch tensors one call holds; released together when the call finishes (or fails)."""

    def __init__(self, pool: ScratchPool) -> None:
        self.pool = pool
        self._bases: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        view, base = self.pool.take(numel, dtype, device)
        self._bases.append(base)
        return view

    def release(self) -> None:
        for b in self._bases:
            self.pool.give(b)
        self._bases.clear()


class Handle:
    """Returned by async_op=True: `wait()` completes the transfer, dequantizes/accumulates, returns the output.

    Multi-phase ops (all_reduce, hierarchical modes) run their later phases inside wait().
    """

    def __init__(self, works: list, finish: Callable[[], torch.Tensor], lease: Lease | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._lease = lease
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._done = False

    def wait(self, timeout=None) -> torch.Tensor:
        if not self._done:
            try:
                for w in self._works:
                    if getattr(w, "waited_by_finish", False):
                        continue  # pipelined pieces: finish() waits each right before decoding it
                    w.wait() if timeout is None else w.wait(timeout)
                self._result = self._finish()
            except BaseException as e:
                self._error = e
                raise
            finally:
                # Failed or not, the scratch memory goes back; a failed collective is not retried.
                self._done = True
                if self._lease is not None:
                    self._lease.release()
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    @property
    def result(self) -> torch.Tensor | None:
        return self._result


def completed(result: torch.Tensor) -> Handle:
    """A handle for a call that needed no communication (e.g. empty tensors)."""
    return Handle([], lambda: result)
