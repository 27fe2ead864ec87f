"""Two-level collectives for every codec: exact sums inside a node, one quantization across nodes (the rails).

Ranks n*local .. n*local+local-1 of the group form node n (hierarchical.HierarchicalGroups: `intra` my node's
ranks, `inter` the ranks with my local index on every node). reduce-scatter: a node-local all_to_all in the input's
dtype (half an fp32 wire's bytes for bf16) with the receiver summing in fp32, then the rail phase: one quantization
of the node's partial sums and an all_to_all among the rails, fp32 sum. all-gather: the shard quantized once,
gathered across the rails, the same bytes gathered inside the node, every rank decoding identical bytes.
Both pipelined in column pieces of whole blocks, so the two levels overlap (piece p+1 crosses the node while piece
p crosses the rails); the blocks, scales and sum order are the one-piece call's, so the bits are too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .core import Call, Pieces, _slices, all_gather_bytes, decode_rows, padded_rows, quantize_input, update_residual
from .feedback import ErrorFeedback
from .hierarchical import HierarchicalGroups
from .pieces import GATHER_SPLIT


def _local_dtype(x: torch.Tensor) -> torch.dtype:
    """The node-local wire's dtype: the input's own (bf16/fp16/fp32: every value exact in the fp32 sum)."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def hier_rs_phase(
    call: Call,
    hg: HierarchicalGroups,
    x: torch.Tensor,
    L: int,
    ef: ErrorFeedback | None,
    stats_dtype: torch.dtype,
    calls: int = 1,
):
    """Start a two-level reduce-scatter of x (<= world*L elements): (work, finish -> fp32 [L] sum).

    Returns once every piece's node-local phase has arrived and its rail phase is on the wire. Error feedback
    covers the rail quantization: its residual has nodes*L elements (the node's partial sums this rank sends)."""
    codec, dev, nn, lc = call.codec, x.device, hg.nodes, hg.local
    xin = quantize_input(call, x, call.world * L, None)
    wdt = _local_dtype(xin)
    k = codec.width(L)
    # Pieces planned from the whole input (the node-local phase moves all of it), not the rails' share.
    pieces = call.pieces(k, call.world * k, dev)
    cols = [(a, max(a, min(b, L))) for a, b in pieces]  # real columns of each piece (the rest is padding)
    x3 = xin.view(nn, lc, L)  # chunk of group rank node*lc + lr at [node, lr]
    # The node's partial sums I quantize: [nodes, k], fp32, padding columns zero.
    part = call.lease.take(nn * k, torch.float32, dev).view(nn, k)
    tmp = call.lease.take(nn * k, torch.float32, dev).view(nn, k) if lc > 1 else part
    if k > L:
        part[:, L:].zero_()
    # Node-local phase: every piece's all_to_all starts now (each waits only for its own copy-in).
    local_works, local_recvs = [], []
    if lc > 1:
        sizes = [lc * nn * (c1 - c0) for c0, c1 in cols]
        sends = _slices(call.lease.take(sum(sizes), wdt, dev), sizes)
        recvs = _slices(call.lease.take(sum(sizes), wdt, dev), sizes)
        for (c0, c1), send, recv in zip(cols, sends, recvs):
            # To local rank j: the chunks of ranks with local index j on every node, [nodes, cols].
            send.view(lc, nn, c1 - c0).copy_(x3[:, :, c0:c1].transpose(0, 1))
            local_works.append(dist.all_to_all_single(recv, send, group=hg.intra, async_op=True))
            local_recvs.append(recv)
        n_local = nn * L * (lc - 1)
        call.record(call.op + ".intra", n_local * wdt.itemsize, n_local * stats_dtype.itemsize, 0, calls=calls)
    r_ef = None if ef is None else ef.take(nn * L, dev).view(nn, L)
    lays = [codec.layout((1,) * nn, b - a) for a, b in pieces]
    kb = call.kernel(dev, nn * k)
    bsizes = [lay.total_bytes for lay in lays]
    bsends = _slices(call.lease.take(sum(bsizes), torch.uint8, dev), bsizes)
    brecvs = _slices(call.lease.take(sum(bsizes), torch.uint8, dev), bsizes)
    works = []
    for i, ((a, b), (c0, c1), lay, send, recv) in enumerate(zip(pieces, cols, lays, bsends, brecvs)):
        p = part[:, c0:c1]
        if lc > 1:
            local_works[i].wait()
            # fp32 sum over the node's ranks, in local-rank order: each term widened to fp32 first (a mixed-dtype
            # add or torch.sum(dtype=) costs 2-3x more on CPU)
            got, t = local_recvs[i].view(lc, nn, c1 - c0), tmp[:, c0:c1]
            p.copy_(got[0])
            for j in range(1, lc):
                t.copy_(got[j])
                p.add_(t)
        else:
            p.copy_(x3[:, 0, c0:c1])
        if r_ef is not None:
            p.add_(r_ef[:, c0:c1])
        call.pack(part[:, a:b], lay, send, kb)
        call.checked()
        works.append(dist.all_to_all_single(recv, send, group=hg.inter, async_op=True))
        if ef is not None:  # reads `send` while it travels: overlaps the wire (core.rs_phase)
            update_residual(call, ef, part[:, :L], send, lay, (a, b), kb)
    chunk = sum(lay.chunk_bytes[0] for lay in lays) if L else 0
    call.record(call.op, (nn - 1) * chunk, (nn - 1) * L * stats_dtype.itemsize, call.world * L, calls=calls)

    def finish() -> torch.Tensor:
        acc = call.lease.take(k, torch.float32, dev).view(1, k)
        for (a, b), lay, recv, w in zip(pieces, lays, brecvs, works):
            w.wait()
            codec.unpack_sum(recv, lay, acc[:, a:b], kernel=kb)
        return acc.view(-1)[:L]

    return Pieces(works), finish


def _local_rows(dest: torch.Tensor, nn: int, lc: int, j: int) -> torch.Tensor:
    """The rows of dest [world, N] (node-major group ranks) held by local index j on every node: a strided view."""
    return dest.view(nn, lc, -1)[:, j]


def hier_ag_phase(
    call: Call,
    hg: HierarchicalGroups,
    src: torch.Tensor,
    dest,
    stats_dtype: torch.dtype,
    calls: int = 1,
    node_in_finish: bool = False,
):
    """Start a two-level all-gather of flat src into dest [world, N]: (work, finish -> dest).

    The shard is quantized once; each piece crosses the rails, then its bytes are gathered inside the node while
    the next piece crosses, and the piece before it is decoded. Returns once every rail phase has arrived (the
    last node-local phase is on the wire; wait() decodes the last piece). node_in_finish: returns once every rail
    phase is on the wire; finish() waits each, issues its node-local phase and decodes (a second phase, issued
    where the caller waits: the same point of the collective sequence on every rank)."""
    codec, dev, n, nn, lc = call.codec, src.device, src.numel(), hg.nodes, hg.local
    x2 = padded_rows(call, src.reshape(-1), 1, n)
    k = x2.shape[1]
    # planned from what crosses the rails (nodes x shard), in smaller pieces: a shorter tail after the link. Not from
    # the whole output: each piece costs every rank of the node a gather and `local` decode calls on cores they share
    pieces = call.pieces(k, nn * k, dev, GATHER_SPLIT)
    lays = [codec.layout((1,), b - a) for a, b in pieces]
    sizes = [lay.total_bytes for lay in lays]
    sends = _slices(call.lease.take(sum(sizes), torch.uint8, dev), sizes)
    rails = _slices(call.lease.take(nn * sum(sizes), torch.uint8, dev), [nn * t for t in sizes])
    nodes = _slices(call.lease.take(lc * nn * sum(sizes), torch.uint8, dev), [lc * nn * t for t in sizes])
    kq = call.kernel(dev, n)
    rail_works = []
    for (a, b), lay, send, rail in zip(pieces, lays, sends, rails):
        call.pack(x2[:, a:b], lay, send, kq)
        call.checked()
        rail_works.append(all_gather_bytes(rail, send, hg.inter, async_op=True))
    itemsize = stats_dtype.itemsize
    call.record(call.op, (nn - 1) * sum(sizes), (nn - 1) * n * itemsize, n, calls=calls)
    if lc > 1:
        call.record(call.op + ".intra", (lc - 1) * nn * sum(sizes), (lc - 1) * nn * n * itemsize, 0, calls=calls)
    kd = call.kernel(dev, call.world * n)
    works: list = []
    decoded: list[bool] = []

    def decode(i: int) -> None:
        (a, b), lay, t = pieces[i], lays[i], sizes[i]
        if lc == 1:
            decode_rows(call, rails[i], lay.with_rows((1,) * nn), dest, a, b, n, kd)
        else:
            works[i].wait()
            # Bytes arrive as [local, node, chunk] and group rank order is node-major: each local index's rows
            # decode straight into their strided rows of dest (no reordering copy).
            got = nodes[i].view(lc, nn * t)
            for j in range(lc):
                decode_rows(call, got[j], lay.with_rows((1,) * nn), _local_rows(dest, nn, lc, j), a, b, n, kd)
        decoded[i] = True

    def node_phases():
        for i, (rail, node_bytes, w) in enumerate(zip(rails, nodes, rail_works)):
            w.wait()
            works.append(all_gather_bytes(node_bytes, rail, hg.intra, async_op=True) if lc > 1 else None)
            decoded.append(False)
            if i:  # the previous piece decodes while this one crosses the node and later ones the rails
                decode(i - 1)

    if not node_in_finish:
        node_phases()

    def finish():
        if node_in_finish and not decoded:
            node_phases()
        for i, done in enumerate(decoded):
            if not done:
                decode(i)
        return dest

    return Pieces([w for w in (rail_works if node_in_finish else works) if w is not None]), finish
