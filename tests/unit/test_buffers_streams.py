"""Scratch memory released on one CUDA stream and dropped later (pool eviction, clear(), ZeRO-3's padded gather
buffer) must be record_stream-ed on that stream first, or the caching allocator hands it out on the allocation
stream while the decode is still queued. The ordering logic is ours, so it runs here against mocked CUDA stream,
event and tensor objects; launch/gpu_check_streams.py shows the same on a GPU.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fp8comm.comm import buffers

CUDA = torch.device("cuda", 0)  # only a name here: no CUDA tensor is ever made


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def __repr__(self) -> str:
        return f"stream {self.name}"


class FakeEvent:
    def __init__(self, *a, **k) -> None:
        self.stream = None

    def record(self, stream=None) -> None:
        self.stream = stream


class FakeCudaTensor:
    """What ScratchPool and Lease touch of a CUDA tensor: size, dtype, device, slicing and record_stream."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        self.n, self.dtype, self.device = n, dtype, CUDA
        self.recorded: list = []

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def __getitem__(self, s):
        return self  # the view the lease hands out; the tests only follow its block

    def record_stream(self, stream) -> None:
        self.recorded.append(stream)


@pytest.fixture
def cuda(monkeypatch):
    """Mocked CUDA: torch.empty on a cuda device makes a FakeCudaTensor (all of them listed, each with a finalizer
    that snapshots the streams recorded on it when it is freed), current_stream() is `state.current`."""

    class State:
        current = FakeStream("A")
        made: list = []
        freed: dict = {}  # id of a made tensor -> its recorded streams at the moment it was freed

    real_empty = torch.empty

    def empty(*size, dtype=None, device=None, **kw):
        if device is not None and torch.device(device).type == "cuda":
            t = FakeCudaTensor(size[0], dtype)
            State.made.append(weakref.ref(t))
            weakref.finalize(t, _snapshot, State.freed, id(t), t.recorded)
            return t
        return real_empty(*size, dtype=dtype, device=device, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: State.current)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return State


def _snapshot(freed: dict, key: int, recorded: list) -> None:
    freed[key] = list(recorded)


def _lease_on(pool, cuda, stream, numel: int):
    """Lease one block of `numel` bytes on `stream`; returns the lease and the block's tensor."""
    cuda.current = stream
    lease = buffers.Lease(pool)
    lease.take(numel, torch.uint8, CUDA)
    return lease, lease._blocks[0].base


def test_release_stream_recorded_before_clear(cuda):
    """Leased on A (allocated there), decoded and released on B, then clear(): the block is freed with B among
    its recorded streams, so the allocator waits for B's queued decode before reusing the memory."""
    pool = buffers.ScratchPool()
    a, b = FakeStream("A"), FakeStream("B")
    lease, base = _lease_on(pool, cuda, a, 1000)
    key = id(base)
    del base
    cuda.current = b
    ev = lease.release()
    assert isinstance(ev, FakeEvent) and ev.stream is b
    assert pool.nbytes() > 0
    pool.clear()
    del lease
    gc.collect()
    assert key in cuda.freed, "the cleared block must be freed (else the test proves nothing)"
    assert cuda.freed[key] == [b], f"freed with recorded streams {cuda.freed[key]}; the releasing stream B is missing"


def test_release_stream_recorded_before_eviction(cuda):
    """The same when the block leaves by eviction: more than 8 free blocks drop the smallest."""
    pool = buffers.ScratchPool()
    a, b = FakeStream("A"), FakeStream("B")
    leases = [_lease_on(pool, cuda, a, (i + 1) * buffers._GRANULE)[0] for i in range(buffers._MAX_FREE + 1)]
    smallest = id(leases[0]._blocks[0].base)
    cuda.current = b
    for lease in leases:
        lease.release()
    del leases, lease
    gc.collect()
    assert smallest in cuda.freed, "the smallest block must have been evicted and freed"
    assert cuda.freed[smallest] == [b], f"evicted with recorded streams {cuda.freed[smallest]}; B is missing"
    assert pool.evictions == 1 and len(cuda.freed) == 1


def test_record_stream_only_when_needed(cuda):
    """No record_stream for the allocation stream, one per other stream however often it releases, and a lease
    on a third stream waits for the last release's event and is recorded too."""
    pool = buffers.ScratchPool()
    a, b, c = FakeStream("A"), FakeStream("B"), FakeStream("C")
    lease, base = _lease_on(pool, cuda, a, 100)
    cuda.current = a
    lease.release()
    assert base.recorded == []
    for _ in range(3):
        lease, _ = _lease_on(pool, cuda, a, 100)
        cuda.current = b
        ev = lease.release()
    assert base.recorded == [b]
    lease, again = _lease_on(pool, cuda, c, 100)
    assert again is base and pool.allocations == 1
    assert c.waited == [ev] and len(a.waited) == 2 and pool.cross_stream_waits == 3
    assert base.recorded == [b, c]
    cuda.current = c
    lease.release()
    assert base.recorded == [b, c]


def test_cpu_blocks_record_nothing():
    pool = buffers.ScratchPool()
    lease = buffers.Lease(pool)
    lease.take(10, torch.float32, torch.device("cpu"))
    assert lease.release() is None
    block = pool._free[(torch.device("cpu"), torch.float32)][0]
    assert block.streams == set() and block.event is None


# ---------------------------------------------------------------------------------- DeepSpeed ZeRO-3 padded gather
class _CudaLike(torch.Tensor):
    """A CPU tensor that answers is_cuda and logs record_stream: the padded gather buffer as _UnpadHandle sees it."""

    log: list = []

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        _CudaLike.log.append(stream)


def test_zero3_padded_gather_buffer_recorded_on_wait_stream(monkeypatch):
    """ZeRO-3's padded all-gather output is allocated on the issuing stream and decoded + copied on the stream
    that calls wait(): it must be record_stream-ed there before the handle (and with it the buffer) is dropped."""
    pytest.importorskip("deepspeed")
    from fp8comm.integrations.deepspeed import zero3

    wait_stream = FakeStream("wait")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: wait_stream)
    _CudaLike.log = []

    class Inner:
        waited = False

        def wait(self):
            Inner.waited = True

    world, spans = 2, [(0, 0, 3), (3, 4, 2)]  # two shards of 3 and 2 elements padded to blocks of 4
    padded = torch.arange(world * 8, dtype=torch.float32).as_subclass(_CudaLike)
    out = torch.zeros(world * 5)
    h = zero3._UnpadHandle(Inner(), padded, out, spans, world)
    assert h.wait() is out and Inner.waited
    want = torch.tensor([0, 1, 2, 4, 5, 8, 9, 10, 12, 13], dtype=torch.float32)
    assert torch.equal(out, want)
    assert _CudaLike.log == [wait_stream], f"padded buffer recorded on {_CudaLike.log}, expected the wait stream"
