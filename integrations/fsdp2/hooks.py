"""The two FSDP2 comm hooks: FP8 all-gather of flat parameter shards, FP8 reduce-scatter of flat gradients.

FSDP2 calls them with keywords (output_tensor=, input_tensor=, group=, op=, async_op=) and allocates its buffers
through allocate(). With async_op=True the return is a torch Work whose wait() finishes the FP8 call (decode or
fp32 accumulation, then unpadding): FSDP2 waits only on dist.Work instances. Counters: hook_stats().

With the planner (enable(planner=...)) a hook carries a Planned: per call it asks the RuntimePlanner for the
call's size class (the same answer on every member of the group: bytes, dtype, group shape and calibration are the
same) and runs FSDP2's own comm object (the `native` choice: exactly FSDP2's collective), or fp8comm's on the
chosen wire, flat or two-level; the call is timed into comm_stats() (issue to completion: the wait() of the
returned Work when FSDP2 asks for async_op, the call itself otherwise).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import fp8comm.comm as fc
from fp8comm.comm import topology
from fp8comm.comm.planned import Choice, RuntimePlanner, group_shape, keeps_feedback
from fp8comm.comm.planner import GroupShape

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
    native_calls: int = 0  # the planner chose FSDP2's own collective (its bytes, counted as sent)
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


def _native(direction: str, nbytes: int, elements: int) -> None:
    with _LOCK:
        s = _STATS.setdefault(direction, DirectionStats())
        s.calls += 1
        s.native_calls += 1
        s.wire_bytes += nbytes
        s.baseline_bytes += nbytes
        s.elements += elements


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
    """A torch Work for FSDP2: wait() finishes the fp8comm handle, then `after()` (unpadding), then closes the
    planner's timer when the call is timed (issue to this wait); idempotent."""

    def __init__(self, handle, after=None, timer=None) -> None:
        super().__init__()
        self._handle, self._after, self._timer, self._done = handle, after, timer, False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._handle.wait()
            if self._after is not None:
                self._after()
            self._done = True
            if self._timer is not None:
                self._timer.__exit__(None, None, None)
        return True

    def is_completed(self) -> bool:
        return self._done


def _finish(handle, after, async_op: bool, timer=None):
    """A Work for FSDP2 to wait on (async_op), or None after finishing now (FSDP2's synchronous contract)."""
    work = Fp8Work(handle, after, timer)
    if async_op:
        return work
    work.wait()
    return None


def _own(work, async_op: bool, timer):
    """What FSDP2's own comm object returned, its completion timed: a wrapped Work (async_op) or None."""
    if timer is None:
        return work
    if async_op and work is not None:
        return Fp8Work(work, None, timer)
    if work is not None:
        work.wait()
    timer.__exit__(None, None, None)
    return None


_PLAN_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "bf16"}  # fp16: bf16's bytes


def block_of(config: fc.WireConfig) -> int:
    """Elements per scale on the wire: the config's block, or a 4-bit format's own (32 mxfp4, 16 nvfp4)."""
    return config.spec.scaling.cols or config.block_size or 128


class Planned:
    """The planner's part of one hook: the model's RuntimePlanner, the op it plans, FSDP2's own comm object (the
    `native` choice), the WireConfig of each quantized wire ("fp8", "mxfp4") and the node table the group shapes
    come from (gathered at enable(); nothing here communicates)."""

    def __init__(
        self,
        planner: RuntimePlanner,
        op: str,
        native,
        configs: dict[str, fc.WireConfig],
        table: topology.NodeTable,
    ) -> None:
        self.planner, self.op, self.native, self.configs, self.table = planner, op, native, configs, table
        self._shapes: dict[int, GroupShape] = {}

    def shape(self, group) -> GroupShape:
        key = id(group)
        if key not in self._shapes:
            ranks = topology.group_ranks(group)
            self._shapes[key] = group_shape(topology.split(ranks, self.table), len(ranks))
        return self._shapes[key]

    def start(self, group, nbytes: int, dtype: torch.dtype, two_level: bool, device: torch.device):
        """(choice, timer): the plan of this call's size class, and its timer already running."""
        d, shape = _PLAN_DTYPES[dtype], self.shape(group)
        choice: Choice = self.planner.choose(self.op, nbytes, d, shape, two_level=two_level, group=group)
        timer = self.planner.timed(self.op, choice, nbytes, d, shape, device)
        timer.__enter__()
        return choice, timer

    def config(self, choice: Choice) -> fc.WireConfig:
        """The WireConfig of the chosen quantized wire, with error feedback only where the plan's option carries it
        (keeps_feedback: the 4-bit recipe's residual stays off a class planned on FP8)."""
        cfg = self.configs[choice.option.wire]
        return cfg if keeps_feedback(choice) or not cfg.error_feedback else cfg.replace(error_feedback=False)


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

    def __init__(
        self,
        param_group,
        wire: WeightWire,
        check,
        align: bool,
        splits: dict | None = None,
        planned: Planned | None = None,
    ) -> None:
        self.param_group, self.wire, self.align = param_group, wire, align
        self.config = wire.wire(check)
        self.splits = splits or {}
        self.planned = planned

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
        config, hier, timer = self.config, self.hier(group), None
        if self.planned is not None:
            nbytes = world * n * input_tensor.element_size()
            choice, timer = self.planned.start(group, nbytes, dt, hier is not None, input_tensor.device)
            if choice.native:  # FSDP2's own all-gather, in its dtype
                _native("weights", (world - 1) * n * input_tensor.element_size(), n)
                work = self.planned.native(
                    output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op
                )
                return _own(work, async_op, timer)
            config, hier = self.planned.config(choice), hier if choice.two_level else None
        sizes = layout.ag_sizes(self.param_group, n)
        sp, wn = layout.spans(sizes or [n], block_of(config), self.align and sizes is not None)
        counted = _Counted("weights", (world - 1) * n * input_tensor.element_size(), n, wn - n, sizes is not None)
        if layout.is_identity(sp, n, wn):
            # The input is FSDP2's view of this rank's slot in the output: quantized before any slot is written.
            with counted:
                h = fc.all_gather_into(
                    output_tensor, input_tensor, group, async_op=True, config=config, hierarchical=hier
                )
            return _finish(h, None, async_op, timer)
        win = layout.pack_rows(input_tensor.view(1, n), sp, wn).view(-1)
        wout = torch.empty(world * wn, dtype=dt, device=input_tensor.device)
        with counted:
            h = fc.all_gather_into(wout, win, group, async_op=True, config=config, hierarchical=hier)
        return _finish(h, _unpad_after(output_tensor.view(world, n), wout.view(world, wn), sp), async_op, timer)


# ------------------------------------------------------------------------------------------ reduce-scatter
class Fp8ReduceScatter(_Levels, _Alloc, ReduceScatter):
    """FP8 reduce-scatter of one FSDP param group's flat gradients: each rank quantizes with its own block scales,
    the receiver sums in fp32; SUM, AVG and PREMUL_SUM are honoured exactly as FSDP2 passes them."""

    def __init__(
        self,
        param_group,
        wire: GradientWire,
        check,
        align: bool,
        splits: dict | None = None,
        planned: Planned | None = None,
    ) -> None:
        self.splits = splits or {}
        self.planned = planned
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
        config, hier, timer = self.config, self.hier(group), None
        if self.planned is not None:
            nbytes = world * L * input_tensor.element_size()
            choice, timer = self.planned.start(group, nbytes, dt, hier is not None, input_tensor.device)
            if choice.native:  # FSDP2's own reduce-scatter, its op and dtype
                _native("gradients", (world - 1) * L * input_tensor.element_size(), world * L)
                work = self.planned.native(
                    output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op
                )
                return _own(work, async_op, timer)
            config, hier = self.planned.config(choice), hier if choice.two_level else None
        # a residual only where this call's config keeps error feedback (the plan's FP8 has none)
        ef = self.error_feedback if config.error_feedback else None
        sizes = layout.rs_sizes(self.param_group, L)
        sp, wl = layout.spans(sizes or [L], block_of(config), self.align and sizes is not None)
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
                    config=config,
                    error_feedback=ef,
                    hierarchical=hier,
                )
            return _finish(h, None, async_op, timer)
        win = layout.pack_rows(input_tensor.view(world, L), sp, wl, factor)
        wout = torch.empty(wl, dtype=dt, device=input_tensor.device)
        with counted:
            h = fc.reduce_scatter_into(
                wout,
                win.view(-1),
                group,
                op=kind,
                async_op=True,
                config=config,
                error_feedback=ef,
                hierarchical=hier,
            )
        return _finish(h, _unpad_after(output_tensor.view(1, L), wout.view(1, wl), sp), async_op, timer)


def is_ours(comm) -> bool:
    return isinstance(comm, (Fp8AllGather, Fp8ReduceScatter))
