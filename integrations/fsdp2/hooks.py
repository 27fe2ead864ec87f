"""The two FSDP2 comm hooks: FP8 all-gather of flat parameter shards, FP8 reduce-scatter of flat gradients.

FSDP2 calls them with keywords (output_tensor=, input_tensor=, group=, op=, async_op=) and allocates its buffers
through allocate(). With async_op=True the return is a torch Work whose wait() finishes the FP8 call (decode or
fp32 accumulation, then unpadding): FSDP2 waits only on dist.Work instances. Counters: hook_stats().
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import fp8comm.comm as fc

from . import layout
from .config import Fp8CommFsdp2Error, GradientWire, WeightWire

FP8_DTYPES_IN = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------- stats
@dataclass
class DirectionStats:
    """One direction's traffic on this rank: FP8 calls, calls passed through untouched, bytes vs FSDP2's own."""

    calls: int = 0
    fp8_calls: int = 0
    passthrough_calls: int = 0  # e.g. FSDP2's uint8 all-gather of mixed-dtype parameters (moved unchanged)
    unaligned_calls: int = 0  # layout not known: blocks may straddle parameters
    wire_bytes: int = 0  # sent to other ranks: FP8 payload + scales + block padding (+ passthrough bytes)
    check_bytes: int = 0  # fp8comm metadata-check descriptors sent to other ranks
    baseline_bytes: int = 0  # what FSDP2's own collective sends for the same calls (its dtype, its layout)
    padding_elements: int = 0  # elements added on the wire so parameters start whole blocks (per rank's input)
    elements: int = 0  # elements this rank contributed
    passthrough: dict = field(default_factory=dict)  # reason -> calls

    @property
    def ratio(self) -> float:
        """FSDP2's bytes / ours, metadata check included."""
        sent = self.wire_bytes + self.check_bytes
        return self.baseline_bytes / sent if sent else float("nan")

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["passthrough"] = dict(self.passthrough)
        d["ratio"] = self.ratio
        return d


_STATS: dict[str, DirectionStats] = {}
_LOCK = threading.Lock()


def hook_stats(reset: bool = False) -> dict[str, dict]:
    """{"weights" | "gradients": DirectionStats.as_dict()} for this process since the last reset."""
    with _LOCK:
        out = {k: v.as_dict() for k, v in sorted(_STATS.items())}
        if reset:
            _STATS.clear()
    return out


def reset_hook_stats() -> None:
    with _LOCK:
        _STATS.clear()


def _totals() -> tuple[int, int]:
    s = fc.comm_stats()
    return (sum(v["wire_bytes"] for v in s.values()), sum(v["check_bytes"] for v in s.values()))


class _Counted:
    """Attribute what fp8comm.comm records during the block (wire and check bytes) to one direction."""

    def __init__(self, direction: str, baseline: int, elements: int, padding: int, aligned: bool) -> None:
        self.args = (direction, baseline, elements, padding, aligned)

    def __enter__(self):
        self.before = _totals()

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        direction, baseline, elements, padding, aligned = self.args
        wire, check = (a - b for a, b in zip(_totals(), self.before))
        with _LOCK:
            s = _STATS.setdefault(direction, DirectionStats())
            s.calls += 1
            s.fp8_calls += 1
            s.unaligned_calls += int(not aligned)
            s.wire_bytes += wire
            s.check_bytes += check
            s.baseline_bytes += baseline
            s.padding_elements += padding
            s.elements += elements
        return False


def _passthrough(direction: str, reason: str, nbytes: int) -> None:
    with _LOCK:
        s = _STATS.setdefault(direction, DirectionStats())
        s.calls += 1
        s.passthrough_calls += 1
        s.passthrough[reason] = s.passthrough.get(reason, 0) + 1
        s.wire_bytes += nbytes
        s.baseline_bytes += nbytes


# ------------------------------------------------------------------------------------------------- handles
class Fp8Work(dist.Work):
    """A torch Work for FSDP2: wait() finishes the fp8comm handle, then `after()` (unpadding); idempotent."""

    def __init__(self, handle, after=None) -> None:
        super().__init__()
        self._handle, self._after, self._done = handle, after, False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._handle.wait()
            if self._after is not None:
                self._after()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _finish(handle, after, async_op: bool):
    """A Work for FSDP2 to wait on (async_op), or None after finishing now (FSDP2's synchronous contract)."""
    work = Fp8Work(handle, after)
    if async_op:
        return work
    work.wait()
    return None


def _unpad_after(dst: torch.Tensor, wire: torch.Tensor, sp):
    """The copy from the wire layout to FSDP2's, run when the call completes; on CUDA the wire buffer is marked
    used by the stream that copies (FSDP2 may wait on another stream than the one that issued the call)."""

    def after():
        layout.unpack_rows(dst, wire, sp)
        if wire.is_cuda:
            wire.record_stream(torch.cuda.current_stream(wire.device))

    return after


class _Alloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _Levels:
    """The node groups of the group FSDP2 passes (None: flat), from the splits enable() prepared on every rank;
    looked up once per process group object, never created here (only the group's members get here)."""

    splits: dict = {}

    def hier(self, group):
        if not self.splits:
            return None
        cache = self.__dict__.setdefault("_hier", {})
        key = id(group)
        if key not in cache:
            s = self.splits.get(tuple(dist.get_process_group_ranks(group)))
            cache[key] = None if s is None else s.groups
        return cache[key]


# ---------------------------------------------------------------------------------------------- all-gather
class Fp8AllGather(_Levels, _Alloc, AllGather):
    """FP8 all-gather of one FSDP param group's flat shard: every rank decodes the same bytes (bit-identical
    replicas); raw-byte (uint8) and other non-float gathers pass through unchanged and are counted."""

    def __init__(self, param_group, wire: WeightWire, check, align: bool, splits: dict | None = None) -> None:
        self.param_group, self.wire, self.align = param_group, wire, align
        self.config = wire.wire(check)
        self.splits = splits or {}

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ):
        world, n, dt = dist.get_world_size(group), input_tensor.numel(), input_tensor.dtype
        if dt not in FP8_DTYPES_IN or output_tensor.dtype != dt:
            # Mixed parameter dtypes: FSDP2 gathers raw bytes; quantizing them would be meaningless.
            _passthrough("weights", f"{dt} input", (world - 1) * n * input_tensor.element_size())
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return fn(output_tensor, input_tensor, group=group, async_op=async_op)
        if output_tensor.numel() != world * n:
            raise Fp8CommFsdp2Error(
                f"all-gather output has {output_tensor.numel()} elements, expected world ({world}) x input ({n})"
            )
        sizes = layout.ag_sizes(self.param_group, n)
        sp, wn = layout.spans(sizes or [n], self.wire.block_size, self.align and sizes is not None)
        counted = _Counted("weights", (world - 1) * n * input_tensor.element_size(), n, wn - n, sizes is not None)
        if layout.is_identity(sp, n, wn):
            # The input is FSDP2's view of this rank's slot in the output: quantized before any slot is written.
            with counted:
                h = fc.all_gather_into(
                    output_tensor, input_tensor, group, async_op=True, config=self.config, hierarchical=self.hier(group)
                )
            return _finish(h, None, async_op)
        win = layout.pack_rows(input_tensor.view(1, n), sp, wn).view(-1)
        wout = torch.empty(world * wn, dtype=dt, device=input_tensor.device)
        with counted:
            h = fc.all_gather_into(wout, win, group, async_op=True, config=self.config, hierarchical=self.hier(group))
        return _finish(h, _unpad_after(output_tensor.view(world, n), wout.view(world, wn), sp), async_op)


# ------------------------------------------------------------------------------------------ reduce-scatter
class Fp8ReduceScatter(_Levels, _Alloc, ReduceScatter):
    """FP8 reduce-scatter of one FSDP param group's flat gradients: each rank quantizes with its own block scales,
    the receiver sums in fp32; SUM, AVG and PREMUL_SUM are honoured exactly as FSDP2 passes them."""

    def __init__(self, param_group, wire: GradientWire, check, align: bool, splits: dict | None = None) -> None:
        self.splits = splits or {}
        if wire.error_feedback and not wire.allow_unpartitioned_residuals:
            # enable() refuses first, with the model's byte count; this guards hooks built by hand.
            raise Fp8CommFsdp2Error(
                "error_feedback keeps a residual of the group's WHOLE (unsharded) gradient on every rank "
                f"({wire.residual_dtype}); set allow_unpartitioned_residuals=True to accept that memory"
            )
        self.param_group, self.wire, self.align = param_group, wire, align
        self.config = wire.wire(check)
        self.error_feedback = fc.ErrorFeedback(self.config.residual_dtype) if wire.error_feedback else None

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
        kind, factor = layout.reduce_op(op)  # unsupported ops raise here, before any bytes move
        dt = input_tensor.dtype
        if dt not in FP8_DTYPES_IN:
            raise Fp8CommFsdp2Error(
                f"FSDP2 reduce-scatter input is {dt}; the FP8 gradient hook takes float32, bfloat16 "
                "or float16 (set MixedPrecisionPolicy.reduce_dtype, or gradients=False)"
            )
        world, L = dist.get_world_size(group), output_tensor.numel()
        if input_tensor.numel() != world * L:
            raise Fp8CommFsdp2Error(
                f"reduce-scatter input has {input_tensor.numel()} elements, expected world ({world})"
                f" x output ({L}); FSDP2 always pads to that"
            )
        sizes = layout.rs_sizes(self.param_group, L)
        sp, wl = layout.spans(sizes or [L], self.wire.wire_block, self.align and sizes is not None)
        counted = _Counted(
            "gradients", (world - 1) * L * input_tensor.element_size(), world * L, world * (wl - L), sizes is not None
        )
        if layout.is_identity(sp, L, wl):
            if factor is not None:
                input_tensor.mul_(factor)  # FSDP2's own pre-divide works on this buffer in place too
            with counted:
                h = fc.reduce_scatter_into(
                    output_tensor,
                    input_tensor,
                    group,
                    op=kind,
                    async_op=True,
                    config=self.config,
                    error_feedback=self.error_feedback,
                    hierarchical=self.hier(group),
                )
            return _finish(h, None, async_op)
        win = layout.pack_rows(input_tensor.view(world, L), sp, wl, factor)
        wout = torch.empty(wl, dtype=dt, device=input_tensor.device)
        with counted:
            h = fc.reduce_scatter_into(
                wout,
                win.view(-1),
                group,
                op=kind,
                async_op=True,
                config=self.config,
                error_feedback=self.error_feedback,
                hierarchical=self.hier(group),
            )
        return _finish(h, _unpad_after(output_tensor.view(1, L), wout.view(1, wl), sp), async_op)


def is_ours(comm) -> bool:
    return isinstance(comm, (Fp8AllGather, Fp8ReduceScatter))
