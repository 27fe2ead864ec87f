"""The phases every quantized collective is built from: pack once, ONE uint8 collective, decode in the handle.

Written once for every wire format: the call's codec (quant.codec, from its WireSpec) does everything format
specific; 4-bit rows travel padded to whole blocks (codec.width), the receiver drops the padding.

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

from ..quant.codec import WireCodec
from ..quant.layout import Chunks
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

    @property
    def codec(self) -> WireCodec:
        return self.spec.codec

    def pack(self, x2: torch.Tensor, layout: Chunks, out: torch.Tensor, kernel: str) -> None:
        """Quantize x2 into `out` as `layout` (the call's codec, rounding and seed; its guard counts)."""
        g, codec = self.guard, self.spec.codec
        if g is not None:
            g.before_pack()  # CUDA: after the guard step's last read-and-zero of the counters
        codec.pack(
            x2,
            layout,
            out,
            rounding=self.spec.rounding,
            seed=self.seed,
            kernel=kernel,
            counters=None if g is None else g.counters,
        )
        if g is not None:
            g.after_pack()  # CUDA: the next guard step reads only after this stream's adds
            g.add_elements(x2.numel(), fp4=codec.bits == 4)

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = default_state()

    def record(self, op: str, wire_bytes: int, dtype_bytes: int, elements: int = 0, calls: int = 1) -> None:
        self.state.stats.record(op, wire_bytes, dtype_bytes, elements, calls=calls)

    def checked(self) -> None:
        """Finish the deferred metadata check (raises on every rank on a problem); a no-op after the first call."""
        settle, self.settle = self.settle, settled
        settle()

    def pieces(self, k: int, numel: int | None, device: torch.device, split: int = 1) -> list[tuple[int, int]]:
        """Column ranges [a, b) of the K dimension, whole blocks each, that travel as separate pipelined pieces
        (one piece where the codec's pieces would not keep the one-piece bits); split: see pieces.piece_count."""
        if not self.spec.codec.pipelines:
            return [(0, k)]
        return plan_pieces(k, self.spec.codec.block, numel, device, self.spec.rounding, self.pipeline, split)

    def piece_count(self, numel: int | None, device: torch.device) -> int:
        """Pieces of whole rows (the all-to-all's tokens): see options.piece_count."""
        if not self.spec.codec.pipelines:
            return 1
        return piece_count(numel, device, self.spec.rounding, self.pipeline)

    def kernel(self, device: torch.device, numel: int) -> str:
        """The codec's kernel backend for this call's buffers, chosen once from the whole call's size (every piece
        of a pipelined call uses the same one); "auto" resolves per family (quant.dispatch, quant.wire4)."""
        return self.spec.codec.kernel(self.spec.backend, device, numel)

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Scratch memory for the codec, leased for the call."""
        return self.lease.take(numel, dtype, device)


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


def all_gather_bytes(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    # all_gather_into_tensor is deprecated in torch 2.13 in favour of all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def torch_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """torch's own reduce-scatter of one flat buffer (sum): the engines' plain-dtype path, the baselines' too."""
    # reduce_scatter_tensor is deprecated in torch 2.13 in favour of reduce_scatter_single.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
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


def padded_rows(call: Call, flat: torch.Tensor, rows: int, L: int) -> torch.Tensor:
    """flat viewed as [rows, L], zero-padded to the codec's row width (whole blocks where the format needs it:
    the tail block of every destination chunk travels padded; zeros change no scale and are dropped on decode)."""
    k = call.codec.width(L)
    if k == L:
        return flat.view(rows, L)
    x2 = call.lease.take(rows * k, flat.dtype, flat.device).view(rows, k)
    x2[:, :L].copy_(flat.view(rows, L))
    x2[:, L:].zero_()
    return x2


def update_residual(
    call: Call, ef: ErrorFeedback, x2: torch.Tensor, send: torch.Tensor, lay: Chunks, cols, kernel: str
) -> None:
    """residual = what we meant to send - what we sent (in the original domain: a transform is inverted), over
    columns cols = (a, b) of x2 [rows, L] (a pipelined piece's; columns >= L are padding); non-finite -> 0.
    Pieces come in column order: the one that reaches column L completes the residual, which a compact
    ErrorFeedback then encodes (ef.commit(); every codec and path, one place)."""
    rows, L = x2.shape
    a, b = cols
    w = min(b, L) - a  # the piece's real columns
    if w > 0:
        r = ef.take(rows * L, x2.device).view(rows, L)[:, a : a + w]
        call.codec.residual(send, lay, x2[:, a : a + w], r, kernel=kernel, scratch=call.scratch)
    if b >= L:
        ef.commit()


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
    """Start a quantized reduce-scatter of x (<= gsize*L elements) over `group`: (work, finish -> fp32 [L] sum).

    Each destination chunk is a row of [gsize, L] (padded to the codec's width), quantized with its own block
    scales; one all_to_all; the receiver decodes every contribution and sums in fp32, in chunk order (a transform
    is inverted once, on the sum). Pipelined on CPU: column pieces of whole blocks, piece i+1 quantized while piece
    i travels, piece i summed while later ones travel; each piece's residual covers its own columns. Blocks,
    scales and sum order are the one-piece call's: bit-identical.
    """
    dev = x.device
    xin = quantize_input(call, x, gsize * L, ef)
    x2 = padded_rows(call, xin, gsize, L)
    k = x2.shape[1]
    pieces = call.pieces(k, gsize * k, dev)
    lays = [call.codec.layout((1,) * gsize, b - a) for a, b in pieces]
    kb = call.kernel(dev, x2.numel())
    sizes = [lay.total_bytes for lay in lays]
    sends = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    recvs = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    works = []
    for (a, b), lay, send, recv in zip(pieces, lays, sends, recvs):
        call.pack(x2[:, a:b], lay, send, kb)
        call.checked()  # the deferred metadata check travelled while piece 0 was quantized
        # Equal chunks, so no split sizes: one all_to_all moves payload and scales together.
        works.append(dist.all_to_all_single(recv, send, group=group, async_op=True))
        if ef is not None:  # reads `send` while it travels (read-only on both sides): overlaps the wire
            update_residual(call, ef, xin.view(gsize, L), send, lay, (a, b), kb)
    chunk = sum(lay.chunk_bytes[0] for lay in lays) if L else 0
    call.record(stats_op, (gsize - 1) * chunk, (gsize - 1) * L * stats_dtype.itemsize, gsize * L, calls=calls)

    def finish() -> torch.Tensor:
        acc = call.lease.take(k, torch.float32, dev).view(1, k)
        for (a, b), lay, recv, w in zip(pieces, lays, recvs, works):
            w.wait()
            call.codec.unpack_sum(recv, lay, acc[:, a:b], kernel=kb)
        return acc.view(-1)[:L]

    return Pieces(works), finish


def ag_phase(
    call: Call, src: torch.Tensor, dest, group, gsize: int, stats_op: str, stats_dtype: torch.dtype, calls: int = 1
):
    """Start a quantized all-gather of flat src (N elements) into dest [gsize, N]: (work, finish -> dest).

    The shard is packed once (padded to the codec's width); every rank, the owner too, decodes the same bytes, so
    replicas end bit-identical. dest may be a pair (codes uint8 [gsize, N], scales fp32 [gsize, N/B]): the FP8
    output of a codec with codes_out, nothing decoded. Pipelined like rs_phase, bit-identical to one piece.
    """
    dev, n = src.device, src.numel()
    x2 = padded_rows(call, src.reshape(-1), 1, n)
    k = x2.shape[1]
    pieces = call.pieces(k, k, dev)
    lays = [call.codec.layout((1,), b - a) for a, b in pieces]
    sizes = [lay.total_bytes for lay in lays]
    sends = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    recvs = _slices(call.lease.take(gsize * sum(sizes), torch.uint8, dev), [gsize * t for t in sizes])
    kq = call.kernel(dev, n)
    works = []
    for (a, b), lay, send, recv in zip(pieces, lays, sends, recvs):
        call.pack(x2[:, a:b], lay, send, kq)
        call.checked()
        works.append(all_gather_bytes(recv, send, group, async_op=True))
    call.record(stats_op, (gsize - 1) * sum(sizes), (gsize - 1) * n * stats_dtype.itemsize, n, calls=calls)
    kd = call.kernel(dev, gsize * n)

    def finish():
        for (a, b), lay, recv, w in zip(pieces, lays, recvs, works):
            w.wait()
            decode_rows(call, recv, lay.with_rows((1,) * gsize), dest, a, b, n, kd)
        return dest

    return Pieces(works), finish


class AddInto:
    """An all-gather destination that receives `+= decoded` (the fp32 sum rounded once into its dtype) instead of
    the decoded values: a replica's update in one pass (ReplicaUpdate). drop(): the decodes still to come add
    nothing (a discarded update finishes its transfer, every phase issued, and leaves the tensor alone)."""

    def __init__(self, target: torch.Tensor, _dropped: list[bool] | None = None) -> None:
        self.target = target
        self._dropped = [False] if _dropped is None else _dropped  # shared by every view of one destination

    def drop(self) -> None:
        self._dropped[0] = True

    @property
    def dropped(self) -> bool:
        return self._dropped[0]

    def view(self, *shape: int) -> AddInto:
        return AddInto(self.target.view(*shape), self._dropped)

    def __getitem__(self, index) -> AddInto:
        return AddInto(self.target[index], self._dropped)


def decode_rows(call: Call, recv: torch.Tensor, lay: Chunks, dest, a: int, b: int, n: int, kernel: str) -> None:
    """Decode the one-row chunks of `recv` into columns [a, min(b, n)) of dest [rows, n] (padding dropped), into
    its (codes, scales) pair, or added into an AddInto's rows."""
    c = min(b, n) - a  # the piece's real columns
    if c <= 0:
        return
    if isinstance(dest, AddInto):
        if not dest.dropped:
            call.codec.unpack_add(recv, lay, dest.target[:, a : a + c], kernel=kernel, scratch=call.scratch)
    elif isinstance(dest, tuple):
        codes, scales = dest
        blk = call.codec.block
        call.codec.unpack_codes(recv, lay, codes[:, a:b], scales[:, a // blk : a // blk + lay.kb])
    else:
        call.codec.unpack(recv, lay, dest[:, a : a + c], kernel=kernel, scratch=call.scratch)


def gathered_into(call: Call, out_flat: torch.Tensor, n_valid: int, L: int, gsize: int) -> torch.Tensor:
    """dest [gsize, L] for an all-gather whose first n_valid elements land in out_flat (scratch when padded)."""
    if n_valid == gsize * L:
        return out_flat.view(gsize, L)
    return call.lease.take(gsize * L, out_flat.dtype, out_flat.device).view(gsize, L)
