"""A process-group backend that runs gloo on host copies of any-device tensors: several ranks on ONE GPU.

NCCL refuses two ranks on one GPU (platform.md), so tests/dist cannot meet several senders on CUDA tensors with it.
Backend "staged" (registered on import) copies each collective's inputs to host memory, runs the same collective on
an inner gloo group, and copies the results into the device outputs: every rank's CUDA kernels (Triton pack,
unpack, unpack_sum) see real multi-sender buffers. What it cannot show: NCCL's own stream semantics (here every
collective is synchronous w.r.t. the calling stream) and NCCL's speed. Works on CPU tensors too (the CPU suite
runs through it, which is how this file itself is tested without a GPU).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

NAME = "staged"


# A real backend's async work is not complete when the call returns; one whose work always is would let the
# polling and ordering logic of fp8comm's handles pass without ever seeing an incomplete work. So every work here
# answers is_completed() False for its first LATE_POLLS polls (until wait()), deterministically, at no time cost.
LATE_POLLS = 2


class _Done(dist.Work):
    """The Work of a collective whose results are in place, but which reports completion only after LATE_POLLS
    polls or a wait(), like an async collective still in flight."""

    polls_pending = 0  # is_completed() answers that were False, over all works of this process (tests read it)

    def __init__(self, result=None) -> None:
        super().__init__()
        self._result = result
        self._late = LATE_POLLS

    def wait(self, timeout=None) -> bool:
        self._late = 0
        return True

    def is_completed(self) -> bool:
        if self._late > 0:
            self._late -= 1
            _Done.polls_pending += 1
            return False
        return True

    def result(self):
        return self._result


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True) if t.device.type != "cpu" else t


def _back(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst is not src:
        dst.copy_(src)


class StagedGroup(dist.ProcessGroup):
    """gloo underneath, tensors of any device on top; every call's data is in place when it returns (its Work
    still reports itself in flight for a few polls)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return NAME

    # --------------------------------------------------------------------------------------------- collectives
    def allreduce(self, tensors, opts=None):
        hs = [_host(t) for t in tensors]
        self._gloo.allreduce(hs, opts or dist.AllreduceOptions()).wait()
        for t, h in zip(tensors, hs):
            _back(t, h)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors)

    def broadcast(self, tensors, opts=None):
        hs = [_host(t) for t in tensors]
        self._gloo.broadcast(hs, opts or dist.BroadcastOptions()).wait()
        for t, h in zip(tensors, hs):
            _back(t, h)
        return _Done(tensors)

    def barrier(self, opts=None):
        self._gloo.allreduce([torch.zeros(1)]).wait()
        return _Done()

    def allgather(self, output_lists, inputs, opts=None):
        outs = [
            [_host(o) if o.device.type == "cpu" else torch.empty_like(o, device="cpu") for o in ol]
            for ol in output_lists
        ]
        self._gloo.allgather(outs, [_host(t) for t in inputs], opts or dist.AllgatherOptions()).wait()
        for ol, hl in zip(output_lists, outs):
            for o, h in zip(ol, hl):
                _back(o, h)
        return _Done(output_lists)

    def all_gather_single(self, output, input, opts=None):
        parts = list(torch.chunk(output, self.size()))
        return self.allgather([parts], [input], opts)

    _allgather_base = all_gather_single  # torch < 2.13

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        out_h = output if output.device.type == "cpu" else torch.empty_like(output, device="cpu")
        self._gloo.alltoall_base(
            out_h,
            _host(input),
            list(output_split_sizes or []),
            list(input_split_sizes or []),
            opts or dist.AllToAllOptions(),
        ).wait()
        _back(output, out_h)
        return _Done([output])

    alltoall_base = all_to_all_single  # torch < 2.13

    def alltoall(self, outputs, inputs, opts=None):
        outs = [o if o.device.type == "cpu" else torch.empty_like(o, device="cpu") for o in outputs]
        self._gloo.alltoall(outs, [_host(t) for t in inputs], opts or dist.AllToAllOptions()).wait()
        for o, h in zip(outputs, outs):
            _back(o, h)
        return _Done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        # gloo reduces a flat buffer; the chunk this rank owns is copied out
        full = _host(input).clone()
        o = opts or dist.ReduceScatterOptions()
        ao = dist.AllreduceOptions()
        ao.reduceOp = o.reduceOp
        self._gloo.allreduce([full], ao).wait()
        mine = torch.chunk(full, self.size())[self.rank()]
        output.copy_(mine.view_as(output))
        return _Done([output])

    _reduce_scatter_base = reduce_scatter_single  # torch < 2.13

    def __repr__(self) -> str:
        return f"StagedGroup(rank {self.rank()} of {self.size()}, gloo underneath)"


def _create(store, rank, size, timeout):
    return StagedGroup(store, rank, size, timeout)


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])
