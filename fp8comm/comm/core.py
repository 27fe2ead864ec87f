"""The phases every FP8 collective is built from: pack once, ONE uint8 collective, dequantize in the handle.

reduce-scatter phase: the (padded) flat input is viewed as [world, L], one chunk per destination, each sender
quantizes with its own 1xB block scales, one all_to_all, the receiver dequantizes every contribution and sums in
fp32. all-gather phase: the own shard is packed as one chunk, one all_gather of bytes, every rank (the owner too)
dequantizes the same bytes, so all replicas end bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..quant.dispatch import backend_name
from ..quant.layout import align
from ..quant.wire import ChunkLayout, layout_of, pack_chunks, unpack_chunks, unpack_codes, unpack_sum
from ..quant.wire4 import Fp4Layout, fp4_backend, fp4_layout, pack_fp4, residual_fp4, unpack_fp4, unpack_fp4_sum
from .buffers import Lease
from .checks import settled
from .config import WireSpec
from .feedback import ErrorFeedback
from .guard import GuardBucket
from .pieces import piece_count, plan_pieces
from .state import CommState, default_state


@dataclass
class Call:
    """One collective in flight: its group, options, seed and the scratch it leases."""

    op: str
    group: object
    rank: int
    world: int
    spec: WireSpec
    lease: Lease
    seed: int
    pipeline: int = 0  # pieces per call (0: auto); see options.plan_pieces
    size_hint: int | None = None  # all-to-all: elements of the largest rank's message (all ranks agree), if known
    settle: Callable[[], None] = settled  # a deferred metadata check (checks.exchange), run before the payload
    state: CommState = None  # type: ignore[assignment]  # whose statistics the call adds to (default: the process's)
    guard: GuardBucket | None = None  # the numerics guard's bucket: the packing kernels count into it

    def pack(self, x2: torch.Tensor, layout: ChunkLayout, out: torch.Tensor, backend: str) -> None:
        """Quantize x2 into `out` as `layout` (the call's format, rounding and seed; its guard counts)."""
        g = self.guard
        if g is not None:
            g.before_pack()  # CUDA: after the guard step's last read-and-zero of the counters
        pack_chunks(
            x2,
            layout,
            self.spec.fmt,
            self.spec.rounding,
            self.seed,
            out=out,
            backend=backend,
            counters=None if g is None else g.counters,
        )
        if g is not None:
            g.after_pack()  # CUDA: the next guard step reads only after this stream's adds
            g.add_elements(x2.numel())

    def pack4(self, x2: torch.Tensor, layout: Fp4Layout, out: torch.Tensor, backend: str) -> None:
        """Quantize x2 into `out` as the 4-bit `layout` (the call's format, rounding, seed and Hadamard transform;
        its guard counts flushed and non-finite elements, and learns the bucket is 4-bit)."""
        g, s = self.guard, self.spec
        if g is not None:
            g.before_pack()
        pack_fp4(
            x2,
            layout,
            s.rounding,
            self.seed,
            s.hadamard,
            s.hadamard_seed,
            out=out,
            backend=backend,
            counters=None if g is None else g.counters,
        )
        if g is not None:
            g.after_pack()
            g.add_elements(x2.numel(), fp4=True)

    def kernel4(self, device: torch.device, numel: int) -> str:
        return fp4_backend(self.spec.backend, device, numel)

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = default_state()

    def record(self, op: str, wire_bytes: int, dtype_bytes: int, elements: int = 0, calls: int = 1) -> None:
        self.state.stats.record(op, wire_bytes, dtype_bytes, elements, calls=calls)

    def checked(self) -> None:
        """Finish the deferred metadata check (raises on every rank on a problem); a no-op after the first call."""
        settle, self.settle = self.settle, settled
        settle()

    def pieces(self, k: int, numel: int | None, device: torch.device) -> list[tuple[int, int]]:
        """Column ranges [a, b) of the K dimension, whole blocks each, that travel as separate pipelined pieces."""
        return plan_pieces(k, self.spec.scaling.cols, numel, device, self.spec.rounding, self.pipeline)

    def piece_count(self, numel: int | None, device: torch.device) -> int:
        """Pieces of whole rows (the all-to-all's tokens): see options.piece_count."""
        return piece_count(numel, device, self.spec.rounding, self.pipeline)

    def kernel(self, device: torch.device, numel: int) -> str:
        """The quant backend for this call's buffers, chosen once from the whole call's size (every piece of a
        pipelined call uses the same one); "auto" resolves in fp8comm.quant.dispatch."""
        return backend_name(self.spec.backend, device, numel)


def guarded(call: Call, fn):
    """fn() (which starts the call's collectives); releases the call's scratch lease if it raises (a failed
    deferred check, bad input found late), since no handle will own the lease then."""
    try:
        return fn()
    except BaseException:
        call.lease.release()
        raise


def chunk_rows(n0: int, world: int, rank: int) -> tuple[int, int]:
    """(rows per chunk c, rows this rank owns): chunk r is rows [r*c, min((r+1)*c, n0)) with c = ceil(n0/world)."""
    c = -(-n0 // world) if n0 else 0
    return c, max(0, min(c, n0 - rank * c))


def all_gather_bytes(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    # all_gather_into_tensor is deprecated in torch 2.13 in favour of all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def quantize_input(
    call: Call, x: torch.Tensor, total: int, ef: ErrorFeedback | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The flat buffer to quantize: x, zero-padded to `total` elements, plus the error-feedback residual."""
    n = x.numel()
    if ef is None and n == total and (dtype is None or dtype == x.dtype):
        return x.reshape(-1)
    buf = call.lease.take(total, torch.float32 if ef is not None else (dtype or x.dtype), x.device)
    buf[:n].copy_(x.reshape(-1))
    buf[n:].zero_()
    if ef is not None:
        buf += ef.take(total, x.device)
    return buf


def update_residual(call: Call, ef: ErrorFeedback, xin: torch.Tensor, send: torch.Tensor, layout: ChunkLayout):
    """residual = what we meant to send - what we sent; non-finite entries reset to 0 (never carried forward)."""
    deq = call.lease.take(xin.numel(), torch.float32, xin.device).view(layout.total_rows, layout.k)
    unpack_chunks(send, layout, call.spec.fmt, torch.float32, out=deq, backend=call.kernel(xin.device, xin.numel()))
    r = ef.take(xin.numel(), xin.device)
    if r.dtype == torch.float32:
        torch.sub(xin, deq.view(-1), out=r)
    else:  # the difference in fp32, then rounded once into the (bf16) residual
        d = deq.view(-1)
        torch.sub(xin, d, out=d)
        r.copy_(d)
    r.masked_fill_(~torch.isfinite(r), 0.0)


class Pieces:
    """The collectives of one pipelined call (one per piece). The call's finish() waits for each piece right before
    it decodes that piece, so piece i is dequantized while pieces > i are still on the wire; wait() waits all."""

    waited_by_finish = True

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout=None) -> None:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _slices(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, o = [], 0
    for n in sizes:
        out.append(buf[o : o + n])
        o += n
    return out


def rs_phase(
    call: Call,
    x: torch.Tensor,
    L: int,
    group,
    gsize: int,
    ef: ErrorFeedback | None,
    stats_op: str,
    stats_dtype: torch.dtype,
    calls: int = 1,
):
    """Start an FP8 reduce-scatter of x (<= gsize*L elements) over `group`: returns (work, finish -> fp32 [L] sum).

    Pipelined (CPU, nearest rounding, no error feedback): the [gsize, L] view is cut into column pieces of whole
    blocks; piece i+1 is quantized while piece i travels (its own all_to_all), and piece i is summed while later
    ones travel. The blocks, their scales and the fp32 sum order are the same as in one piece: bit-identical.
    """
    spec, dev = call.spec, x.device
    total = gsize * L
    xin = quantize_input(call, x, total, ef)
    if spec.fp4 is not None:
        return _rs_phase4(call, xin, L, group, gsize, ef, stats_op, stats_dtype, calls)
    pieces = call.pieces(L, total, dev) if ef is None else [(0, L)]
    lays = [layout_of((1,) * gsize, b - a, spec.scaling) for a, b in pieces]
    kb = call.kernel(dev, total)
    sizes = [lay.total_bytes for lay in lays]
    sends = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    recvs = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    x2 = xin.view(gsize, L)
    works = []
    for (a, b), lay, send, recv in zip(pieces, lays, sends, recvs):
        call.pack(x2[:, a:b], lay, send, kb)
        call.checked()  # the deferred metadata check travelled while piece 0 was quantized
        if ef is not None:
            update_residual(call, ef, xin, send, lay)
        # Equal chunks, so no split sizes: one all_to_all moves payload and scales together.
        works.append(dist.all_to_all_single(recv, send, group=group, async_op=True))
    itemsize = stats_dtype.itemsize
    call.record(
        stats_op,
        (gsize - 1) * sum(lay.chunk_bytes[0] for lay in lays) if L else 0,
        (gsize - 1) * L * itemsize,
        total,
        calls=calls,
    )

    def finish() -> torch.Tensor:
        acc = call.lease.take(L, torch.float32, dev).view(1, L)
        for (a, b), lay, recv, w in zip(pieces, lays, recvs, works):
            w.wait()
            unpack_sum(recv, lay, spec.fmt, out=acc[:, a:b], backend=kb)
        return acc.view(-1)

    return Pieces(works), finish


def ag_phase(
    call: Call, src: torch.Tensor, dest, group, gsize: int, stats_op: str, stats_dtype: torch.dtype, calls: int = 1
):
    """Start an FP8 all-gather of flat src (N elements) into dest [gsize, N]: returns (work, finish -> dest).

    dest may be a pair (codes uint8 [gsize, N], scales fp32 [gsize, N/B]): the FP8 output, nothing dequantized.
    Pipelined like rs_phase (column pieces of whole blocks, one all_gather each), bit-identical to one piece.
    """
    spec, dev, n = call.spec, src.device, src.numel()
    if spec.fp4 is not None:
        return _ag_phase4(call, src, dest, group, gsize, stats_op, stats_dtype, calls)
    pieces = call.pieces(n, n, dev)
    lays = [layout_of((1,), b - a, spec.scaling) for a, b in pieces]
    sizes = [lay.total_bytes for lay in lays]
    sends = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    recvs = _slices(call.lease.take(gsize * sum(sizes), torch.uint8, dev), [gsize * t for t in sizes])
    x2 = src.reshape(1, n)
    kq = call.kernel(dev, n)
    works = []
    for (a, b), lay, send, recv in zip(pieces, lays, sends, recvs):
        call.pack(x2[:, a:b], lay, send, kq)
        call.checked()
        works.append(all_gather_bytes(recv, send, group, async_op=True))
    itemsize = stats_dtype.itemsize
    call.record(stats_op, (gsize - 1) * sum(sizes), (gsize - 1) * n * itemsize, n, calls=calls)
    kd = call.kernel(dev, gsize * n)
    blk = lays[0].block if lays else 1

    def finish():
        # Every rank, the owner included, decodes the same bytes: replicas end bit-identical.
        for (a, b), lay, recv, w in zip(pieces, lays, recvs, works):
            w.wait()
            all_rows = lay.with_rows((1,) * gsize)
            if isinstance(dest, tuple):
                codes, scales = dest
                unpack_codes(recv, all_rows, codes[:, a:b], scales[:, a // blk : a // blk + lay.kb])
            else:
                unpack_chunks(recv, all_rows, spec.fmt, dest.dtype, out=dest[:, a:b], backend=kd)
        return dest

    return Pieces(works), finish


# ------------------------------------------------------------------------------------------------- 4-bit wire
def _rows4(call: Call, xin: torch.Tensor, rows: int, L: int) -> torch.Tensor:
    """xin viewed as [rows, L], zero-padded to whole 4-bit blocks per row (the tail block of every destination
    chunk travels padded: zeros change no scale and are dropped on the receiver)."""
    lp = align(L, call.spec.fp4.block)  # type: ignore[union-attr]
    if lp == L:
        return xin.view(rows, L)
    x2 = call.lease.take(rows * lp, xin.dtype, xin.device).view(rows, lp)
    x2[:, :L].copy_(xin.view(rows, L))
    x2[:, L:].zero_()
    return x2


def update_residual4(
    call: Call, ef: ErrorFeedback, xin: torch.Tensor, send: torch.Tensor, lay: Fp4Layout, L: int, cols=None
):
    """The 4-bit residual, in the original (un-transformed) domain: what we meant to send minus the inverse
    transform of what we sent (that inverse is exact up to fp32 rounding, docs/fp4.md); non-finite -> 0.
    cols = (a, b): `send` holds columns [a, b) of the padded [rows, L] input (a pipelined piece)."""
    s = call.spec
    a, b = cols if cols is not None else (0, lay.k)
    w = min(b, L) - a  # the piece's real columns (the rest is padding)
    if w <= 0:
        return
    r = ef.take(xin.numel(), xin.device).view(lay.total_rows, L)[:, a : a + w]
    x = xin.view(lay.total_rows, L)[:, a : a + w]
    kb = call.kernel4(xin.device, xin.numel())
    if kb == "native" and not s.hadamard and r.dtype == xin.dtype == torch.float32:
        residual_fp4(send, lay, x, r)  # one pass, the same bits as the decode + subtraction below
        return
    deq = call.lease.take(lay.total_rows * lay.k, torch.float32, xin.device).view(lay.total_rows, lay.k)
    unpack_fp4(send, lay, s.hadamard, s.hadamard_seed, out=deq, backend=kb)
    d = deq[:, :w]
    if r.dtype == torch.float32:
        torch.sub(x, d, out=r)
    else:
        r.copy_(x - d)
    r.masked_fill_(~torch.isfinite(r), 0.0)


def _pieces4(call: Call, k: int, numel: int, device: torch.device) -> list[tuple[int, int]]:
    """Pipelined pieces of a 4-bit call (column ranges of whole blocks, as FP8's): MXFP4 without the transform
    only, where every piece's blocks and scales are the one-piece call's (NVFP4's per-chunk second-level scale
    spans the whole row; the transform's path is plain torch)."""
    s = call.spec
    if s.fp4 is None or s.fp4.two_level or s.hadamard:
        return [(0, k)]
    return plan_pieces(k, s.fp4.block, numel, device, s.rounding, call.pipeline)


def _rs_phase4(call: Call, xin, L: int, group, gsize: int, ef, stats_op: str, stats_dtype: torch.dtype, calls: int):
    """rs_phase on the 4-bit wire: each destination chunk is a row of [gsize, L] padded to whole blocks,
    quantized with its own block (and, NVFP4, tensor) scales; the receiver sums in fp32 and inverts the Hadamard
    transform once on the sum. Pipelined on CPU like rs_phase (MXFP4: _pieces4), error feedback included: each
    piece's residual covers its own columns, so the bits are the one-piece call's."""
    s, dev = call.spec, xin.device
    x2 = _rows4(call, xin, gsize, L)
    lp = x2.shape[1]
    pieces = _pieces4(call, lp, gsize * lp, dev)
    lays = [fp4_layout((1,) * gsize, b - a, s.fp4) for a, b in pieces]
    kb = call.kernel4(dev, x2.numel())
    sizes = [lay.total_bytes for lay in lays]
    sends = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    recvs = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    works = []
    for (a, b), lay, send, recv in zip(pieces, lays, sends, recvs):
        call.pack4(x2[:, a:b], lay, send, kb)
        call.checked()
        if ef is not None:
            update_residual4(call, ef, xin, send, lay, L, (a, b))
        works.append(dist.all_to_all_single(recv, send, group=group, async_op=True))
    chunk = sum(lay.chunk_bytes[0] for lay in lays) if L else 0
    call.record(stats_op, (gsize - 1) * chunk, (gsize - 1) * L * stats_dtype.itemsize, gsize * L, calls=calls)

    def finish() -> torch.Tensor:
        acc = call.lease.take(lp, torch.float32, dev).view(1, lp)
        for (a, b), lay, recv, w in zip(pieces, lays, recvs, works):
            w.wait()
            unpack_fp4_sum(recv, lay, s.hadamard, s.hadamard_seed, out=acc[:, a:b], backend=kb)
        return acc.view(-1)[:L]

    return Pieces(works), finish


def _ag_phase4(call: Call, src, dest, group, gsize: int, stats_op: str, stats_dtype: torch.dtype, calls: int):
    """ag_phase on the 4-bit wire: the shard padded to whole blocks; every rank (the owner too) decodes the same
    bytes, inverts the transform and writes dest [gsize, N] in its dtype: bit-identical replicas. Pipelined on CPU
    like ag_phase (MXFP4: _pieces4)."""
    if isinstance(dest, tuple):  # refused before the call starts (collectives._ag_out_problem); never reached
        raise AssertionError("fp8_out has no 4-bit form")
    s, dev, n = call.spec, src.device, src.numel()
    x2 = _rows4(call, src.reshape(-1), 1, n)
    lp = x2.shape[1]
    pieces = _pieces4(call, lp, lp, dev)
    lays = [fp4_layout((1,), b - a, s.fp4) for a, b in pieces]
    sizes = [lay.total_bytes for lay in lays]
    sends = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    recvs = _slices(call.lease.take(gsize * sum(sizes), torch.uint8, dev), [gsize * t for t in sizes])
    kq = call.kernel4(dev, n)
    works = []
    for (a, b), lay, send, recv in zip(pieces, lays, sends, recvs):
        call.pack4(x2[:, a:b], lay, send, kq)
        call.checked()
        works.append(all_gather_bytes(recv, send, group, async_op=True))
    call.record(stats_op, (gsize - 1) * sum(sizes), (gsize - 1) * n * stats_dtype.itemsize, n, calls=calls)
    kd = call.kernel4(dev, gsize * n)
    d2 = dest  # [gsize, n]
    direct = dest.dtype == torch.float32  # decoded straight into dest's columns (no padded copy)

    def finish():
        for (a, b), lay, recv, w in zip(pieces, lays, recvs, works):
            w.wait()
            all_rows = lay.with_rows((1,) * gsize)
            c = min(b, n) - a  # the piece's real columns
            if c <= 0:
                continue
            if direct:
                unpack_fp4(recv, all_rows, s.hadamard, s.hadamard_seed, out=d2[:, a : a + c], backend=kd)
            else:
                dec = call.lease.take(gsize * lay.k, torch.float32, dev).view(gsize, lay.k)
                unpack_fp4(recv, all_rows, s.hadamard, s.hadamard_seed, out=dec, backend=kd)
                d2[:, a : a + c].copy_(dec[:, :c])
        return dest

    return Pieces(works), finish


def gathered_into(call: Call, out_flat: torch.Tensor, n_valid: int, L: int, gsize: int) -> torch.Tensor:
    """dest [gsize, L] for an all-gather whose first n_valid elements land in out_flat (scratch when padded)."""
    if n_valid == gsize * L:
        return out_flat.view(gsize, L)
    return call.lease.take(gsize * L, out_flat.dtype, out_flat.device).view(gsize, L)
