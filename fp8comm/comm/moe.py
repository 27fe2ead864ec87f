"""MoE token all-to-all: tokens [T, H] quantized per token per 128 channels (1x128), uneven/zero splits, autograd.

The forward packs the tokens for each destination as one chunk (payload then scales) and moves all chunks with
ONE all_to_all_single over bytes. The backward sends gradients the reverse way (bf16 by default, FP8 optional).
For the combine direction call it with the reversed splits; wire="bf16" (DeepSeek-V3's choice) or "fp8".
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

from ..quant.formats import get_format
from ..quant.layout import Chunks
from ..quant.tensor import Fp8Tensor
from .buffers import Handle, Lease, refuse_capture
from .checks import Meta, as_int_list, exchange_sizes, group_rank_size, out_problem, split_problem, tensor_problem
from .collectives import start_call
from .config import WireConfig, WireSpec
from .core import Call, Pieces, _slices, guarded, padded_rows, quantize_input, update_residual
from .feedback import ErrorFeedback
from .guard import GuardBucket
from .pieces import row_part, sized_plan
from .state import CommState

WIRES = ("fp8", "bf16", "native")


@dataclass(frozen=True)
class _Spec:
    """Everything the backward needs to send gradients back: reversed splits and the gradient wire options."""

    out_splits: tuple[int, ...]
    in_splits: tuple[int, ...]
    group: dist.ProcessGroup | None
    grad_wire: str
    grad_spec: WireSpec  # used when grad_wire is fp8
    state: CommState  # the forward's buffer state: the backward leases, counts and seeds through it too
    bwd_hint: int | None = None  # size hint (see Call.size_hint) for the backward's reverse all-to-all
    ef: ErrorFeedback | None = None  # the forward's error feedback (FP8 wire)
    guard: GuardBucket | None = None  # the forward's guard bucket: an FP8 backward counts into it too


def all_to_all(
    tensor: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    *,
    wire: str = "fp8",
    grad_wire: str = "bf16",
    grad_fmt=None,
    async_op: bool = False,
    fp8_out: bool = False,
    out=None,
    error_feedback: ErrorFeedback | None = None,
    **kw,
):
    """Send rows input_split_sizes[j] of tokens [T, H] to rank j; returns [sum(output_split_sizes), H] (autograd).

    config= / keyword options / buffer= / seed= as for every collective (fp8comm.comm.collectives).
    wire/grad_wire: "fp8" (1x128 block scales), "bf16" or "native" (the tensor's own dtype). None splits: equal.
    fp8_out=True (wire="fp8"): return the received tokens as an Fp8Tensor (codes [sum(outs), H] + fp32 scales
    [sum(outs), ceil(H/B)], DeepEP's FP8 dispatch output) for an FP8 expert GEMM, not dequantized; it has no
    autograd edge, so the tokens must not require grad (detach them; the combine carries the gradient path).
    out: a preallocated output ([sum(outs), H] in the tokens' dtype or float32, or an Fp8Tensor with fp8_out=True),
    as DeepEP's Buffer keeps its receive buffers; a float32 out receives every contribution decoded straight into
    fp32 (for a consumer that sums them in fp32); no autograd edge either (the tokens must not require grad).
    error_feedback (wire="fp8"): this rank's quantization residual, laid out like the tokens, is added before
    quantizing and updated after (the call travels in one piece); for gradient traffic such as ZeRO-1/2's.
    guard (a numerics-guard bucket): counts what the forward packs in FP8 and, with grad_wire="fp8", the backward.
    """
    rank, world = group_rank_size(group)
    meta = Meta("all_to_all", dtype=getattr(tensor, "dtype", None), shape=tuple(getattr(tensor, "shape", ())))
    meta.fail(tensor_problem(tensor, "tokens"))
    ins, outs = _splits(tensor, output_split_sizes, input_split_sizes, world, meta)
    for w, name in ((wire, "wire"), (grad_wire, "grad_wire")):
        if w not in WIRES:
            meta.fail(("option", f"{name} must be one of {WIRES}, got {w!r}"))
    meta.reduce_op = WIRES.index(wire) if wire in WIRES else 0
    if fp8_out and wire != "fp8":
        meta.fail(("option", f"fp8_out=True needs wire='fp8' (got wire={wire!r})"))
    if error_feedback is not None and (wire != "fp8" or not isinstance(error_feedback, ErrorFeedback)):
        meta.fail(("option", "error_feedback needs wire='fp8' and an fp8comm.comm.ErrorFeedback"))
    if fp8_out and isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        meta.fail(
            (
                "option",
                "fp8_out=True returns FP8 codes with no autograd edge, but the tokens require grad; "
                "pass tokens.detach() (or use the dequantizing path, which has the backward)",
            )
        )
    grad_format = None
    if grad_fmt is not None:
        try:
            grad_format = get_format(grad_fmt)
        except ValueError as e:
            meta.fail(("option", f"grad_fmt: {e}"))

    def out_check(spec: WireSpec):
        if out is None or meta.error is not None:
            return None
        if not fp8_out and tensor.requires_grad and torch.is_grad_enabled():
            return (
                "option",
                "out= writes in place and has no autograd edge, but the tokens require grad; "
                "pass tokens.detach() or leave out=None",
            )
        # a float32 out for any floating input: every contribution decoded straight into fp32 (a gradient consumer
        # summing in fp32 must not see each one rounded to the input's dtype first)
        wide = (
            not fp8_out and isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tensor.is_floating_point()
        )
        dtype = torch.float32 if wide else tensor.dtype
        return out_problem(out, (sum(outs), tensor.shape[1]), dtype, tensor.device, spec if fp8_out else None)

    def check(spec: WireSpec):
        if fp8_out and not spec.codec.codes_out:
            return "option", f"fp8_out=True returns FP8 codes; the {spec.wire_name} wire has no such output"
        return out_check(spec)

    even = input_split_sizes is None and output_split_sizes is None
    # Deferred with even splits: the check travels while the first piece is quantized. Uneven splits need its
    # table first (the piece plan below depends on every rank's token count).
    call = start_call(
        "all_to_all",
        group,
        meta,
        kw,
        check,
        defer=even,
        fp8_wire=wire == "fp8",
        ef=error_feedback,
        device=tensor.device if isinstance(tensor, torch.Tensor) else None,
    )
    spec = call.spec
    # The backward's quantized wire: the forward's codec, or grad_fmt's FP8 format (with the forward's FP8
    # scaling; the default scaling when the forward is 4-bit).
    grad_spec = spec
    if grad_format is not None:
        scaling = spec.scaling if spec.fp4 is None else WireConfig().spec.scaling
        grad_spec = WireSpec(grad_format, scaling, spec.rounding, spec.backend)
    # Auto pipelining needs a size every rank agrees on: even splits (the token count is checked to be equal), or
    # the largest rank's token count from the metadata check's table of every rank's splits.
    h = tensor.shape[1]
    mx = meta.max_tokens(world)  # None while the check is deferred (even splits) or when this call is unchecked
    if mx is None and not even:
        mx = _plan_sizes(call, tensor, ins, outs, wire == "fp8", grad_wire == "fp8")
    if mx is not None:
        call.size_hint, bwd = mx[0] * h, mx[1] * h
    elif even:
        call.size_hint = bwd = tensor.numel()
    else:
        bwd = None
    s = _Spec(tuple(outs), tuple(ins), group, grad_wire, grad_spec, call.state, bwd, error_feedback, call.guard)
    if fp8_out or out is not None:  # no autograd edge: FP8 codes out, or a caller's preallocated output
        h = guarded(
            call,
            lambda: _start(
                call,
                tensor.detach(),
                s.out_splits,
                s.in_splits,
                wire,
                "all_to_all",
                fp8_out=fp8_out,
                out=out,
                ef=error_feedback,
            ),
        )
        if async_op:
            return Handle([h], h.wait, call.lease)
        try:
            return h.wait()
        finally:
            call.lease.release()
    if not async_op:
        try:
            return _AllToAll.apply(tensor, call, wire, s)
        finally:
            call.lease.release()
    # Async: the transfer starts now; wait() dequantizes and attaches the autograd edge for the backward.
    h = guarded(
        call, lambda: _start(call, tensor.detach(), s.out_splits, s.in_splits, wire, "all_to_all", ef=error_feedback)
    )
    return Handle([h], lambda: _Attach.apply(tensor, h.wait(), s), call.lease)


def _plan_sizes(call: Call, tensor: torch.Tensor, ins, outs, fwd: bool, bwd: bool) -> tuple[int, int] | None:
    """(max over ranks of tokens sent, of tokens received) for the automatic piece plan, by one exchange of two
    int64 per rank, when given splits and no check table leave no size every rank agrees on; else None.

    Without it an unchecked call (the "first" policy's steady state) travels in one piece on CPU: quantize, wire
    and dequantize in sequence instead of overlapped (the all-to-all regression of 24936a2, docs/benchmarks.md).
    The decision uses only options and the call's form (splits given), never split values, so every rank makes
    the same one: a rank whose own splits happen to be even must still take part."""
    dev, pipe = tensor.device, call.pipeline
    need = (fwd and sized_plan(dev, call.spec.rounding, pipe)) or (bwd and sized_plan(dev, call.spec.rounding, 0))
    if not need:
        return None
    rows, sent = exchange_sizes([sum(ins), sum(outs)], call.group, call.world)
    call.state.stats.record("all_to_all", 0, 0, 0, calls=0, plan_bytes=sent)
    return max(r[0] for r in rows), max(r[1] for r in rows)


def _splits(tensor, output_split_sizes, input_split_sizes, world, meta: Meta):
    t = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 else None
    if isinstance(tensor, torch.Tensor) and tensor.dim() != 2:
        meta.fail(("shape", f"tokens must be 2-D [T, H], got shape {tuple(tensor.shape)}"))
    ins, outs = as_int_list(input_split_sizes), as_int_list(output_split_sizes)
    if ins is None or outs is None:
        if t is not None and t % world:
            meta.fail(("splits", f"split sizes omitted but {t} tokens do not divide over {world} ranks"))
            return [0] * world, [0] * world
        even = [(t or 0) // world] * world
        ins, outs = ins or even, outs or even
    meta.fail(split_problem(ins, world, t, "input_split_sizes"))
    meta.fail(split_problem(outs, world, None, "output_split_sizes"))
    meta.in_splits, meta.out_splits = ins, outs
    return ins, outs


class _Pending:
    """A started all-to-all: wait() returns the received tokens in the input dtype."""

    def __init__(self, work, finish):
        self._work, self._finish, self._out = work, finish, None

    def wait(self, timeout=None):
        if self._out is None:
            if self._work is not None and not getattr(self._work, "waited_by_finish", False):
                self._work.wait()
            self._out = self._finish()
        return self._out

    def is_completed(self):
        return self._out is not None or self._work is None or self._work.is_completed()


def _start(
    call: Call,
    x: torch.Tensor,
    outs,
    ins,
    wire: str,
    stats_op: str,
    fp8_out: bool = False,
    out=None,
    ef: ErrorFeedback | None = None,
) -> _Pending:
    """Start moving rows ins[j] of x to rank j (receiving outs[i] rows from rank i) with `wire` encoding."""
    h, dev, dtype = x.shape[1], x.device, x.dtype
    me = call.rank
    given = out
    if not fp8_out and out is None:
        out = torch.empty(sum(outs), h, dtype=dtype, device=dev)
    if wire != "fp8":
        wdt = torch.bfloat16 if wire == "bf16" else dtype
        send = x if x.dtype == wdt else x.to(wdt)
        recv = out if wdt == out.dtype else torch.empty(sum(outs), h, dtype=wdt, device=dev)
        call.checked()
        work = dist.all_to_all_single(recv, send, list(outs), list(ins), group=call.group, async_op=True)
        nbytes = (sum(ins) - ins[me]) * h * send.element_size()
        call.record(stats_op, nbytes, (sum(ins) - ins[me]) * h * x.element_size(), 0)
        return _Pending(work, lambda: out if recv is out else out.copy_(recv))
    spec, codec = call.spec, call.codec
    # Pipelined on CPU: piece p carries rows row_part(n, p, P) of every destination's chunk (whole tokens, so each
    # chunk's rows stay contiguous in the input and in the output), one all_to_all each; see core.rs_phase. With
    # error feedback too: each piece's rows get their residual once their collective is issued (blocks are per
    # row, so the one-piece call's bits), overlapping the wire.
    npieces = call.piece_count(call.size_hint, dev)
    xq = x if ef is None else quantize_input(call, x, x.numel(), ef).view(x.shape)  # + residual, fp32
    x2 = padded_rows(call, xq.reshape(-1), x.shape[0], h)  # tokens padded to the codec's row width
    k = x2.shape[1]
    parts = [[row_part(n, p, npieces) for n in ins] for p in range(npieces)]
    oparts = [[row_part(n, p, npieces) for n in outs] for p in range(npieces)]
    lins = [codec.layout(tuple(b - a for a, b in pp), k) for pp in parts]
    louts = [codec.layout(tuple(b - a for a, b in pp), k) for pp in oparts]
    sends = _slices(
        call.lease.take(sum(lay.total_bytes for lay in lins), torch.uint8, dev), [lay.total_bytes for lay in lins]
    )
    recvs = _slices(
        call.lease.take(sum(lay.total_bytes for lay in louts), torch.uint8, dev), [lay.total_bytes for lay in louts]
    )
    kq, kd = call.kernel(dev, x2.numel()), call.kernel(dev, sum(outs) * k)
    in0, out0 = [0, *accumulate(ins)], [0, *accumulate(outs)]  # first row of each chunk
    works = []
    res = None if ef is None else ef.take(x.numel(), dev).view(x.shape[0], h)  # the rows' residuals, updated below
    for pp, lin, send, recv, lout in zip(parts, lins, sends, recvs, louts):
        if npieces == 1:  # one call for every chunk (one fused kernel on GPU)
            call.pack(x2, lin, send, kq)
        else:
            for j, (a, b) in enumerate(pp):
                one, o = codec.layout((b - a,), k), lin.offsets[j]
                call.pack(x2[in0[j] + a : in0[j] + b], one, send[o : o + one.total_bytes], kq)
        call.checked()  # the deferred metadata check travelled while piece 0 was quantized
        # Byte splits: each destination's chunk is payload + scales, so one collective carries both.
        works.append(
            dist.all_to_all_single(
                recv, send, list(lout.chunk_bytes), list(lin.chunk_bytes), group=call.group, async_op=True
            )
        )
        if ef is None:
            continue
        # what was meant minus what was sent; reads `send` while it travels (read-only on both sides)
        if npieces == 1:
            update_residual(call, ef, xq.view(x.shape[0], h), send, lin, (0, k), kq)
            continue
        xr = xq.view(x.shape[0], h)
        assert res is not None
        for j, (a, b) in enumerate(pp):
            if b > a:
                one, o, r0 = codec.layout((b - a,), k), lin.offsets[j], in0[j] + a
                sent = send[o : o + one.total_bytes]
                codec.residual(sent, one, xr[r0 : r0 + b - a], res[r0 : r0 + b - a], kernel=kq, scratch=call.scratch)
    if ef is not None and npieces > 1:
        ef.commit()  # every row's residual is written (a compact one is encoded now)
    call.record(
        stats_op,
        sum(lin.total_bytes - lin.chunk_bytes[me] for lin in lins),
        (sum(ins) - ins[me]) * h * x.element_size(),
        x.numel(),
    )
    if fp8_out and given is not None:
        codes, scales = given.data.view(torch.uint8), given.scale
    elif fp8_out:
        codes = torch.empty(sum(outs), h, dtype=torch.uint8, device=dev)
        scales = torch.empty(spec.scaling.scale_shape(sum(outs), h), dtype=torch.float32, device=dev)

    def receive(recv: torch.Tensor, lout: Chunks, r0: int, r1: int) -> None:
        # rows [r0, r1) of the output, laid out as lout in recv
        if fp8_out:
            codec.unpack_codes(recv, lout, codes[r0:r1], scales[r0:r1])
        else:
            codec.unpack(recv, lout, out[r0:r1], kernel=kd, scratch=call.scratch)

    def finish():
        for pp, lout, recv, w in zip(oparts, louts, recvs, works):
            w.wait()
            if npieces == 1:
                receive(recv, lout, 0, sum(outs))
                continue
            for i, (a, b) in enumerate(pp):
                if b > a:
                    o = lout.offsets[i]
                    receive(recv[o : o + lout.chunk_bytes[i]], codec.layout((b - a,), k), out0[i] + a, out0[i] + b)
        if fp8_out:
            return (
                given
                if given is not None
                else Fp8Tensor(codes.view(spec.fmt.dtype), scales, spec.fmt, spec.scaling, dtype)
            )
        return out

    return _Pending(Pieces(works), finish)


def _backward(ctx_spec: _Spec, g: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    refuse_capture("all_to_all.backward", g.device)
    s = ctx_spec
    call = Call(
        "all_to_all.backward",
        s.group,
        rank,
        world,
        s.grad_spec,
        Lease(s.state.pool),
        s.state.next_seed(None, rank, s.grad_spec.rounding),
        size_hint=s.bwd_hint,
        state=s.state,
        guard=s.guard,
    )
    try:
        # Reverse direction: what we received (out_splits) goes back to where it came from.
        return _start(call, g.contiguous(), s.in_splits, s.out_splits, s.grad_wire, "all_to_all.backward").wait()
    finally:
        call.lease.release()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, call: Call, wire: str, s: _Spec):
        ctx.s, ctx.rank, ctx.world = s, call.rank, call.world
        return _start(call, x, s.out_splits, s.in_splits, wire, "all_to_all", ef=s.ef).wait()

    @staticmethod
    def backward(ctx, g):
        return _backward(ctx.s, g, ctx.rank, ctx.world), None, None, None


class _Attach(torch.autograd.Function):
    """Gives an already-received async result the all-to-all backward."""

    @staticmethod
    def forward(ctx, x, received, s: _Spec):
        ctx.s, ctx.rank, ctx.world = s, dist.get_rank(s.group), dist.get_world_size(s.group)
        return received

    @staticmethod
    def backward(ctx, g):
        return _backward(ctx.s, g, ctx.rank, ctx.world), None, None
