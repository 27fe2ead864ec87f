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

from ..errors import Fp8CommCaptureError

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
    streams: set = field(default_factory=set)  # streams that used it, besides alloc_stream (record_stream-ed)


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
        self.evictions = 0  # free blocks dropped because more than _MAX_FREE were free

    def _used_on(self, block: _Block, stream) -> None:
        """Mark `block` used by `stream` for the caching allocator (CUDA): once the pool drops it (eviction,
        clear()), its memory is not handed out again until the work queued on `stream` so far has run."""
        if stream is not None and stream != block.alloc_stream and stream not in block.streams:
            block.base.record_stream(stream)
            block.streams.add(stream)

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
            self._used_on(block, stream)
        return block.base[:numel], block

    def give(self, block: _Block, event=None, stream=None) -> None:
        """Return `block`; on CUDA `event` (recorded on `stream` after its last use) orders the next lease.

        `stream` (the releasing stream, e.g. the one that ran the decode) is record_stream-ed on the block first,
        so the block may leave the pool (eviction below, clear()) while that stream's kernels are still queued."""
        self._used_on(block, stream)
        block.event, block.event_stream = event, stream
        key = (block.base.device, block.base.dtype)
        with self._lock:
            free = self._free.setdefault(key, [])
            free.append(block)
            if len(free) > _MAX_FREE:
                free.pop(min(range(len(free)), key=lambda i: free[i].base.numel()))
                self.evictions += 1

    def clear(self) -> None:
        """Drop every free buffer (leased ones are freed when their call completes). Safe with kernels still queued
        on CUDA: every stream that used a block was record_stream-ed on it (take, give)."""
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


# Device types whose calls can run inside CUDA graph capture (a test adds "cpu" to fake a capture on CPU tensors).
_GRAPH_DEVICE_TYPES = ("cuda",)


def _capturing(device) -> bool:
    """Whether a call on `device` would be queued inside CUDA graph capture (the current stream is capturing).

    Asked only for CUDA devices (the CPU build raises in torch.cuda.is_current_stream_capturing); device None (a
    caller that does not say): asked once this process has initialized CUDA."""
    if device is None:
        if not torch.cuda.is_initialized():
            return False
    elif torch.device(device).type not in _GRAPH_DEVICE_TYPES:
        return False
    return torch.cuda.is_current_stream_capturing()


def refuse_capture(what: str, device) -> None:
    """Raise Fp8CommCaptureError if `what` (a collective, or a handle's wait) would run inside CUDA graph capture.

    Called before anything is checked, leased or queued, so every rank (all capture the same region) raises the
    same error and nothing is left half-issued."""
    if _capturing(device):
        raise Fp8CommCaptureError(
            f"fp8comm.{what}: called inside CUDA graph capture, which fp8comm refuses: its scratch blocks return "
            "to a pool that eager calls and other graphs reuse while a replay still writes them, the metadata "
            "check reads on the host, and all_reduce issues its second phase in wait(). Run fp8comm collectives "
            "(and their wait()) outside the captured region, and capture the compute around them."
        )


class Handle:
    """Returned by async_op=True: `wait()` completes the transfer, dequantizes/accumulates, returns the output.

    `is_completed()` only asks; it never blocks and never issues a collective. It is True once the output is valid
    (transfer finished AND decode run; on CUDA: its kernels executed); once the transfer is done it runs (CPU) or
    enqueues (CUDA) the decode itself, which is local work. Ops with later phases (`later_phases=True`: all_reduce,
    whose all-gather of the reduced chunks starts in wait()) issue those collectives in wait() only, at the point
    in the program where every rank calls it; their is_completed() stays False until wait() has run.
    Neither runs inside CUDA graph capture (Fp8CommCaptureError; `device`: where the call's tensors live).
    """

    def __init__(
        self,
        works: list,
        finish: Callable[[], torch.Tensor],
        lease: Lease | None = None,
        *,
        later_phases: bool = False,
        device=None,
    ) -> None:
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._lease = lease
        self._later_phases = later_phases
        self._device = device if device is not None else _lease_device(lease)
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._done = False
        self._ready = None  # CUDA event recorded after the decode (None on CPU: the decode ran synchronously)

    def wait(self, timeout=None) -> torch.Tensor:
        if not self._done:
            refuse_capture("Handle.wait", self._device)  # before anything: wait() again after the capture works
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
            # Refused inside capture whether or not the transfer has finished: a poll that raised only when it
            # happened to find the transfer done would fail on some ranks and runs, not others.
            refuse_capture("Handle.is_completed", self._device)
            if self._later_phases:
                return False  # its later collectives start in wait(): a poll must not issue them at its own moment
            if not all(w.is_completed() for w in self._works):
                return False
            self.wait()  # the transfer is done: this only enqueues (GPU) or runs (CPU) the local decode
        return self._ready is None or self._ready.query()

    @property
    def result(self) -> torch.Tensor | None:
        return self._result


def _lease_device(lease: Lease | None):
    """The device of a lease's scratch (where the call runs), or None when it holds none."""
    blocks = getattr(lease, "_blocks", None)
    return blocks[0].base.device if blocks else None


def completed(result: torch.Tensor) -> Handle:
    """A handle for a call that needed no communication (e.g. empty tensors): already done, so its wait() queues
    nothing and is allowed anywhere (inside graph capture too)."""
    h = Handle([], lambda: result)
    h._result, h._done = result, True
    return h
