"""Reusable scratch buffers (packed send/receive bytes, fp32 accumulators) and the async handle that returns them.

A buffer is leased for the lifetime of one collective and returned when its handle completes, so overlapping async
calls never share scratch memory. Freed buffers are reused by later calls of the same or smaller size.

On CUDA, "returned" means "its last kernel is enqueued", not "its last kernel ran": the release records one event
on the stream current at release, and a later lease from another stream makes that stream wait for the event
(on the GPU: no host sync). Engines issue collectives from several streams (DeepSpeed ZeRO-3: all-gather stream
and reduce stream, FSDP2 likewise), so without the event a gather could pack into bytes that the previous
reduce-scatter's decode has not read yet. A buffer used on a stream other than the one it was allocated on is
`record_stream`-ed there, so dropping it from the pool hands it back to the caching allocator safely too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

# Allocation granularity: sizes are rounded up so slightly different bucket sizes reuse the same buffer.
_GRANULE = 1 << 16
# Free buffers kept per (device, dtype); beyond this the smallest are dropped.
_MAX_FREE = 8


@dataclass(eq=False)
class _Block:
    """One pooled allocation, the event of its last release and the streams that have used it (CUDA)."""

    base: torch.Tensor
    alloc_stream: object = None  # the CUDA stream current when it was allocated (the allocator's owner stream)
    event: object = None  # torch.cuda.Event recorded after its last use, or None (CPU, never released yet)
    event_stream: object = None  # where that event was recorded
    streams: set = field(default_factory=set)  # streams it was leased on, besides alloc_stream (record_stream-ed)


def _current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class ScratchPool:
    """A free list of flat tensors per (device, dtype); `take` leases a view, `give` returns its block.

    Reuse across CUDA streams is ordered on the GPU by the event recorded at `give` (see the module docstring)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[_Block]] = {}
        self._lock = threading.Lock()
        self.allocations = 0  # how many blocks were ever allocated (tests check reuse with it)
        self.cross_stream_waits = 0  # leases that had to wait on another stream's event (CUDA)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, _Block]:
        """(view of exactly `numel` elements, its block to give back). Contents are undefined.

        On CUDA the view is safe to use on the current stream: earlier users on other streams are waited for."""
        device = torch.device(device)
        key = (device, dtype)
        stream = _current_stream(device)
        block = None
        with self._lock:
            free = self._free.setdefault(key, [])
            fits = [i for i, b in enumerate(free) if b.base.numel() >= numel]
            if fits:
                block = free.pop(min(fits, key=lambda i: free[i].base.numel()))
            else:
                self.allocations += 1
        if block is None:
            n = max(_GRANULE, -(-numel // _GRANULE) * _GRANULE)
            block = _Block(torch.empty(n, dtype=dtype, device=device), stream)
        elif stream is not None:
            if block.event is not None and block.event_stream != stream:
                stream.wait_event(block.event)  # GPU-side ordering behind the last user's kernels
                self.cross_stream_waits += 1
            if stream != block.alloc_stream and stream not in block.streams:
                block.base.record_stream(stream)  # the allocator must not recycle it before this stream is done
                block.streams.add(stream)
        return block.base[:numel], block

    def give(self, block: _Block, event=None, stream=None) -> None:
        """Return `block`; on CUDA `event` (recorded on `stream` after its last use) orders the next lease."""
        block.event, block.event_stream = event, stream
        key = (block.base.device, block.base.dtype)
        with self._lock:
            free = self._free.setdefault(key, [])
            free.append(block)
            if len(free) > _MAX_FREE:
                free.pop(min(range(len(free)), key=lambda i: free[i].base.numel()))

    def clear(self) -> None:
        """Drop every free buffer (leased ones are freed when their call completes)."""
        with self._lock:
            self._free.clear()

    def nbytes(self) -> int:
        with self._lock:
            return sum(b.base.numel() * b.base.element_size() for fl in self._free.values() for b in fl)


class Lease:
    """The scratch tensors one call holds; released together when the call finishes (or fails)."""

    def __init__(self, pool: ScratchPool) -> None:
        self.pool = pool
        self._blocks: list[_Block] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        view, block = self.pool.take(numel, dtype, device)
        self._blocks.append(block)
        return view

    def release(self):
        """Give every block back; on CUDA returns the event recorded after their last use (else None)."""
        event = stream = None
        cuda = [b for b in self._blocks if b.base.device.type == "cuda"]
        if cuda:
            device = cuda[0].base.device
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event()
            event.record(stream)
        for b in self._blocks:
            self.pool.give(b, event if b.base.device.type == "cuda" else None, stream)
        self._blocks.clear()
        return event


class Handle:
    """Returned by async_op=True: `wait()` completes the transfer, dequantizes/accumulates, returns the output.

    Multi-phase ops (all_reduce, hierarchical modes) run their later phases inside wait(). `is_completed()` is True
    only once the output is valid: the transfer has finished AND the decode has run (on CUDA: its kernels have
    executed). It never blocks; once the transfer is done it starts the decode itself.
    """

    def __init__(self, works: list, finish: Callable[[], torch.Tensor], lease: Lease | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._lease = lease
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._done = False
        self._ready = None  # CUDA event recorded after the decode (None on CPU: the decode ran synchronously)

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
                    self._ready = self._lease.release()
        if self._error is not None:
            raise self._error
        return cast(torch.Tensor, self._result)  # None only for finishers that fill the caller's output

    def is_completed(self) -> bool:
        if not self._done:
            if not all(w.is_completed() for w in self._works):
                return False
            self.wait()  # the transfer is done: this only enqueues (GPU) or runs (CPU) the decode
        return self._ready is None or self._ready.query()

    @property
    def result(self) -> torch.Tensor | None:
        return self._result


def completed(result: torch.Tensor) -> Handle:
    """A handle for a call that needed no communication (e.g. empty tensors)."""
    return Handle([], lambda: result)
