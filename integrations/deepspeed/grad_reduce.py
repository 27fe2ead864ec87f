"""ZeRO-1/2 gradient reduction to the owner of each slice, in the configured format (FP8 or 4 bits).

Gradients (wrapped per optimizer instance, so only fp8comm engines are touched): DeepSpeed's `average_tensor`
splits the reduce bucket into slices, each owned by one rank's optimizer partition, and hands them to
`allreduce_and_scatter`, which all-reduces the whole bucket and lets each owner copy its slices. The hook keeps
that contract but moves each slice only to its owner: every slice is cut at parameter boundaries (DeepSpeed merges
neighbouring slices of one owner, differently on the owner and on the other ranks), each parameter's piece starts
on a row of `block_size` elements of its own, and the pieces are grouped per owner in a reused send buffer (only
the pads are zeroed). The configured format (FP8 or 4 bits) travels on every path:

- A balanced batch (DeepSpeed's default bucket holds every parameter and partitions are equal) pads every owner's
  part to the largest and goes through ONE fp8comm.comm.reduce_scatter_into with an fp32 output (pipelined, two
  levels where the group spans nodes): every contribution decoded straight into fp32 and summed in fp32.
- Small buckets hold mostly one owner each. Such a call waits (copied into a staging buffer) and is coalesced with
  the next ones while together they hold at most COALESCE_BUCKETS x reduce_bucket_size elements; a batch that
  becomes balanced goes out as the reduce-scatter above, otherwise (the bound reached, the end of the backward) as
  ONE fp8comm.comm.all_to_all to the owners with exact parts: flat, or two levels (an exact node-local all-to-all
  summed in fp32, then one quantization per node across the rails), decoded straight into fp32 (a float32 out)
  and summed in fp32. Results of calls that already returned go where DeepSpeed moved the owner's gradient
  meanwhile (the fp32 compact partition, else the parameter's gradient in its partition buffer).

Either way the owner gets the fp32 sum (a bf16 decode would round each contribution first); inf/NaN in any block
arrives as inf/NaN, so DeepSpeed's overflow check still fires. Slices several ranks consume (Muon) keep
DeepSpeed's own all-reduce (counted), as do guard fallbacks; rank 0 logs once per bucket layout which collectives
the backward took, in which format (hook_stats "grad_layouts"). With error feedback each parameter's residual
(residuals.py) is assembled into the send layout and scattered back after the call.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import fp8comm.comm as fc
from fp8comm.errors import Fp8CommStateError

from . import levels, planning
from .patching import say_rank0


def _owner(ranks) -> int | None:
    if isinstance(ranks, int):
        return ranks
    if isinstance(ranks, frozenset) and len(ranks) == 1:
        return next(iter(ranks))
    return None


def bucket_layout(es, opt, orig, layout: dict):
    """average_tensor(tensor, dtype): remember which parameters the flat bucket holds, in order (names, sizes)."""

    @functools.wraps(orig)
    def average_tensor(tensor, communication_data_type):
        bucket = opt.ipg_buckets[communication_data_type]
        params = [opt.bit16_groups[g][i] for g, i, _ in bucket.params]
        starts, n = [], 0
        for p in params:
            starts.append(n)
            n += p.numel()
        names = [es.name_of(p) for p in params]
        layout["cur"] = (tensor, starts, [(k, p.numel()) for k, p in zip(names, params)], dict(zip(names, params)))
        try:
            return orig(tensor, communication_data_type)
        finally:
            layout.pop("cur", None)

    return average_tensor


def _segments(t: torch.Tensor, cur) -> list[tuple[int, int, str | None, int, int]]:
    """[(offset in t, length, parameter name, its numel, offset in the parameter)] covering slice t."""
    if cur is None:
        return [(0, t.numel(), None, 0, 0)]
    base, starts, params = cur[:3]
    off = (t.data_ptr() - base.data_ptr()) // t.element_size()
    if t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or off < 0 or off + t.numel() > base.numel():
        return [(0, t.numel(), None, 0, 0)]
    out, i, pos, end = [], bisect.bisect_right(starts, off) - 1, off, off + t.numel()
    while pos < end and i < len(params):
        pend = starts[i] + params[i][1]
        n = min(end, pend) - pos
        if n > 0:
            out.append((pos - off, n, params[i][0], params[i][1], pos - starts[i]))
        pos += max(n, 0)
        i += 1
    return out


class _Scratch:
    """Per-engine buffers reused across steps (the padded send layout, the fp32 sums): a fresh bucket-sized
    allocation per call costs its page faults every step (measured ~60 ms per 134 MB on the 2-core CPU VM)."""

    def __init__(self) -> None:
        self.bufs: dict[tuple, torch.Tensor] = {}

    def take(self, key: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        k = (key, dtype, torch.device(device))
        b = self.bufs.get(k)
        if b is None or b.numel() < numel:
            self.bufs[k] = b = torch.empty(numel, dtype=dtype, device=device)
        return b[:numel]


# A batch goes through one reduce-scatter when padding every owner's part to the largest costs at most this share of
# extra elements over the exact parts of the to-owners all-to-all (both carry the configured codec).
BALANCE_SLACK = 1 / 8
# Coalescing bound: DeepSpeed's calls wait in the adapter (copied into its staging buffer) only while together they
# hold at most this many reduce buckets (reduce_bucket_size elements each).
COALESCE_BUCKETS = 2


def plan_reduce(rows: list[int]) -> bool:
    """True: one reduce-scatter with every owner's part padded to the largest; False: the all-to-all to the owners
    with each owner's exact row count. Both carry the configured codec (FP8 or 4 bits), so only the padding decides;
    decided from the layout alone, which every rank shares, so every rank picks the same call."""
    total = sum(rows)
    return bool(total) and len(rows) * max(rows) <= total * (1 + BALANCE_SLACK)


@dataclass(eq=False)
class _Piece:
    """One parameter's part of an owned slice: it starts on a row of block_size elements of its own."""

    owner: int
    src: torch.Tensor | None  # DeepSpeed's elements while its call runs (None once staged)
    stage: int  # offset in the staging buffer once staged (-1: not staged)
    n: int
    name: str | None
    numel: int  # the parameter's
    poff: int  # offset in the parameter
    out: torch.Tensor | None  # the owner's fp32 compact gradient partition slice (DeepSpeed's), or None
    dest: torch.Tensor | None  # the bucket slice DeepSpeed reads after its call (None once that call returned)
    param: object  # the parameter (deferred results go to its gradient)


@dataclass(eq=False)
class _Batch:
    key: tuple
    pg: object
    world: int
    me: int
    scale: float | None
    how: str
    gb: object
    dtype: torch.dtype
    device: torch.device
    decision: planning.Decision | None = None  # the plan and guard's route (two levels: decision.hier)
    pieces: list = field(default_factory=list)
    elements: int = 0
    calls: int = 0
    baseline: int = 0

    def rows(self, H: int) -> list[int]:
        r = [0] * self.world
        for p in self.pieces:
            r[p.owner] += -(-p.n // H)
        return r


class _Reducer:
    """One engine's ZeRO-1/2 gradient reduction: DeepSpeed's calls (one per reduce bucket, or per parameter larger
    than the bucket) coalesced into fewer collectives.

    A call whose owned slices are balanced over the owners goes out at once (one padded reduce-scatter: DeepSpeed's
    default bucket). An unbalanced one (small buckets: mostly one owner each) waits, copied into a staging buffer,
    for the next calls while the waiting elements stay within COALESCE_BUCKETS x reduce_bucket_size; the batch goes
    out when it becomes balanced (then as one reduce-scatter), when the next call would exceed the bound, and at the
    end of the backward (DeepSpeed's epilogue reduce_ipg_grads()), as an all-to-all to the owners otherwise. Results
    of calls that already returned go where DeepSpeed moved the owner's gradient meanwhile (its fp32 compact
    partition, else the parameter's gradient in its partition buffer), before anything reads them."""

    def __init__(self, es, opt, orig) -> None:
        self.es, self.opt, self.orig = es, opt, orig
        cfg = es.cfg.gradients
        self.wcfg, self.H = cfg.wire(es.cfg.check), cfg.block_size
        self.fp4 = cfg.is_fp4
        self.scratch = _Scratch()
        self.limit = COALESCE_BUCKETS * int(opt.reduce_bucket_size)
        self.batch: _Batch | None = None
        self.staged = 0  # elements in the staging buffer
        self.sent: list[tuple] = []  # this backward's collectives (the layout log)
        self.layouts: dict[tuple, int] = {}

    # ---------------------------------------------------------------------------------------- one DeepSpeed call
    def __call__(self, cur, bucket, communication_data_type, numel_per_bucket, log, divide, process_group):
        es, opt, orig = self.es, self.opt, self.orig
        pg = opt.dp_process_group if process_group is None else process_group
        me, world = dist.get_rank(group=pg), dist.get_world_size(group=pg)
        items = [(b[0], b[1], b[2] if len(b) > 2 else None) for b in bucket]
        shared = [b for b, it in zip(bucket, items) if _owner(it[0]) is None]
        owned_raw = [b for b, it in zip(bucket, items) if _owner(it[0]) is not None]
        owned = [it for it in items if _owner(it[0]) is not None]
        comm_dtype = communication_data_type
        if opt.sequence_parallel_size > 1:  # DeepSpeed reduces in fp32 then (allreduce_bucket)
            comm_dtype = torch.float32
        itemsize = comm_dtype.itemsize
        if shared:  # consumed by several ranks: DeepSpeed's own all-reduce, counted as such
            n = 2 * (world - 1) * sum(b[1].numel() for b in shared) * itemsize // world
            es.acct.add("gradients", n, n, False)
            es.acct.hit("zero12.grad_reduce.shared_allreduce")
            self.sent.append(("shared", "all-reduce", "flat", f"DeepSpeed's own ({comm_dtype})", 1, 0, ()))
            orig(shared, communication_data_type, numel_per_bucket, log, divide, process_group)
        if not owned:
            return
        n_total = sum(t.numel() for _, t, _ in owned)
        # DeepSpeed's own path all-reduces the whole bucket: a ring moves 2 (world-1)/world of it per rank.
        baseline = 2 * (world - 1) * n_total * itemsize // world
        es.acct.hit("zero12.grad_reduce")
        nbytes = n_total * itemsize
        if es.cfg.measure_only or world == 1:
            d = planning.Decision("fp8", None, None, None)
        else:  # the plan (DeepSpeed's own call is an all-reduce of the bucket), then the guard
            d = planning.decide(
                es,
                "gradients",
                owned[0][1].device,
                self.fp4,
                op="reduce_scatter",
                nbytes=nbytes,
                dtype=comm_dtype,
                group=pg,
                native_op="all_reduce",
            )
        how, gb = d.how, d.guard
        if es.cfg.measure_only or world == 1 or how == "bf16":  # plan or guard: residuals kept for the next step
            self.flush()  # what waits was copied; it goes first, in its own format
            if world > 1:
                es.acct.add("gradients", baseline, baseline, False)
                if not es.cfg.measure_only:
                    who = "planner" if d.choice is not None and d.choice.native else "guard"
                    self.sent.append(("owned", "all-reduce", "flat", f"bf16 ({who}: DeepSpeed's own)", 1, n_total, ()))
            with planning.timed(es, d, "reduce_scatter", nbytes, comm_dtype, owned[0][1].device, "all_reduce"):
                return orig(owned_raw, communication_data_type, numel_per_bucket, log, divide, process_group)
        scale = None
        if divide and opt.gradient_average:  # same factor allreduce_bucket would divide by
            scale = float(opt.sequence_parallel_size) / world
        if cur is None:
            es.acct.hit("zero12.grad_reduce.unsegmented")
            if es.residuals is not None:
                raise Fp8CommStateError(
                    "fp8comm ZeRO-1/2 error feedback: allreduce_and_scatter was called outside "
                    "average_tensor, so its slices cannot be keyed by parameter"
                )
        pieces = []
        params = {} if cur is None else cur[3]
        for ranks, t, out in owned:
            v, ov = t.reshape(-1), None if out is None else out.view(-1)
            for a, n, name, numel, poff in _segments(t, cur):
                pieces.append(
                    _Piece(
                        _owner(ranks),
                        v[a : a + n],
                        -1,
                        n,
                        name,
                        numel,
                        poff,
                        None if ov is None else ov[a : a + n],
                        v[a : a + n],
                        params.get(name),
                    )
                )
        key = (id(pg), comm_dtype, scale, how, d.hier is not None)
        b = self.batch
        if b is not None and (b.key != key or b.elements + n_total > self.limit or cur is None):
            self.flush()
            b = None
        if b is None:
            b = _Batch(key, pg, world, me, scale, how, gb, comm_dtype, owned[0][1].device, d)
        b.pieces += pieces
        b.elements += n_total
        b.calls += 1
        b.baseline += baseline
        # Out now: a balanced batch (one reduce-scatter), a call that cannot be deferred (slices not keyed by
        # parameter) or that alone exceeds the bound. Otherwise it waits for the next calls.
        if plan_reduce(b.rows(self.H)) or cur is None or n_total > self.limit or not self._deferrable(pieces):
            self.batch = None
            self._send(b)
            return
        self._stage(pieces, comm_dtype)
        self.batch = b

    def _deferrable(self, pieces) -> bool:
        """A result that arrives after the call returned needs a parameter to go to (owned pieces only)."""
        return all(p.param is not None for p in pieces)

    def _stage(self, pieces, dtype) -> None:
        """Copy this call's pieces into the staging buffer (DeepSpeed reuses its bucket for the next call)."""
        need = self.staged + sum(p.n for p in pieces)
        buf = self.scratch.bufs.get(("stage", dtype, torch.device(pieces[0].src.device)))
        if buf is None or buf.numel() < need:  # grows (keeping what waits) only while the first backwards run
            grown = torch.empty(max(need, min(self.limit, need * 3 // 2)), dtype=dtype, device=pieces[0].src.device)
            if buf is not None and self.staged:
                grown[: self.staged].copy_(buf[: self.staged])
            self.scratch.bufs[("stage", dtype, torch.device(pieces[0].src.device))] = buf = grown
        for p in pieces:
            buf[self.staged : self.staged + p.n].copy_(p.src)
            p.src, p.dest, p.stage = None, None, self.staged
            self.staged += p.n

    def flush(self) -> None:
        """Send what waits (the end of the backward, a call that does not fit, or a step: nothing may stay)."""
        b, self.batch = self.batch, None
        if b is not None:
            self._send(b)

    def end_of_backward(self) -> None:
        self.flush()
        if self.sent:
            self._log_layout()
        self.sent = []

    # ---------------------------------------------------------------------------------------------- the collective
    def _send(self, b: _Batch) -> None:
        """The batch's collective, timed (planner) from the send buffer's assembly to the results in DeepSpeed's
        partitions: the passes over the bucket that the option brings (copies, residuals) count as its cost."""
        if b.decision is None:
            return self._reduce(b)
        with planning.timed(self.es, b.decision, "reduce_scatter", b.elements * b.dtype.itemsize, b.dtype, b.device):
            return self._reduce(b)

    def _reduce(self, b: _Batch) -> None:
        es, opt, H, world, me = self.es, self.opt, self.H, b.world, b.me
        rows = b.rows(H)
        rs = plan_reduce(rows)
        # two levels where the DP group spans nodes and the plan (if on) says so (fp32 sums inside a node)
        hg = es.hier(b.pg) if b.decision is None else b.decision.hier
        # owners in the send buffer: rank order; the two-level all-to-all lays them out rail-major (local index,
        # then node) so that each node-local destination's rows are contiguous
        order = list(range(world))
        if not rs and hg is not None:
            order.sort(key=lambda o: (o % hg.local, o // hg.local))
        per_owner: list[list[_Piece]] = [[] for _ in range(world)]
        for p in b.pieces:
            per_owner[p.owner].append(p)
        part = max(rows) * H if rs else 0  # elements per owner in the reduce-scatter layout
        total = world * part if rs else sum(rows) * H
        flat = self.scratch.take("send", total, b.dtype, b.device)
        stage = self.scratch.bufs.get(("stage", b.dtype, torch.device(b.device)))
        lay, row0 = [], 0
        for o in order:
            if rs:
                row0 = o * part
            for p in per_owner[o]:
                if p.src is not None:
                    src = p.src
                else:
                    assert stage is not None  # staged pieces exist only once the staging buffer does
                    src = stage[p.stage : p.stage + p.n]
                flat[row0 : row0 + p.n].copy_(src)
                pad = -p.n % H
                flat[row0 + p.n : row0 + p.n + pad].zero_()  # only the pads are zeroed, never the whole buffer
                lay.append((p.name, p.numel, p.poff, row0, p.n))
                row0 += p.n + pad
            if rs:
                flat[row0 : (o + 1) * part].zero_()
        self.staged = 0  # everything staged is in the send buffer now
        d = b.decision or planning.Decision(b.how, b.gb, hg, None)
        # two levels: the residual covers only what this rank quantizes (its rail's part of the send buffer)
        window = None
        if hg is not None:
            window = levels.rail_window(total, hg) if rs else self._owners_window(rows, hg)
        ef = None
        if es.residuals is not None and planning.feedback(d):
            ef = es.residuals.assemble(lay, total, b.device, window)
        call_cfg = planning.call_config(es, self.wcfg, d)
        path = "reduce_scatter" if rs else "all_to_all"
        es.acct.hit("zero12.grad_reduce." + path)
        es.acct.hit("zero12.grad_reduce.fmt." + call_cfg.spec.wire_name)
        if hg is not None:
            es.acct.hit("zero12.grad_reduce.two_level")
        if b.calls > 1:
            es.acct.hit("zero12.grad_reduce.coalesced", b.calls)
        owners = tuple(o for o in range(world) if rows[o])
        self.sent.append(
            ("owned", path, "two-level" if hg is not None else "flat", call_cfg.describe(), b.calls, b.elements, owners)
        )
        with es.acct.fp8("gradients", baseline=b.baseline), torch.no_grad():
            if rs:
                acc = self.scratch.take("acc", part, torch.float32, b.device)
                # fp32 output: every sender's contribution decoded straight into fp32, summed in fp32 in rank order
                fc.reduce_scatter_into(
                    acc, flat, b.pg, "sum", config=call_cfg, error_feedback=ef, guard=b.gb, hierarchical=hg
                )
            elif hg is None:
                acc = self._owners_flat(flat, rows, b, call_cfg, ef)
            else:
                acc = self._owners_two_level(flat, rows, b, call_cfg, ef, hg)
        if ef is not None:
            es.residuals.scatter(ef, lay, total, window)
        if b.scale is not None:
            acc.mul_(b.scale)
        off = 0
        for p in per_owner[me]:
            piece = acc[off : off + p.n]
            if p.out is not None:  # the fp32 sum straight into DeepSpeed's fp32 gradient partition
                opt._add_to_grad_partition_buffer(p.out, piece)
            if p.dest is not None:  # its call is still running: DeepSpeed reads the bucket slice next
                p.dest.copy_(piece)
            elif p.out is None:  # deferred: where DeepSpeed moved the owner's gradient meanwhile
                self._grad_of(p).copy_(piece)
            off += -(-p.n // H) * H

    def _grad_of(self, p: _Piece) -> torch.Tensor:
        opt = self.opt
        get = getattr(opt, "get_gradient_for_reduction", None)
        g = get(p.param) if get is not None else getattr(p.param, "grad", None)
        if g is None:
            raise Fp8CommStateError(
                f"fp8comm ZeRO-1/2: the reduced gradient of {p.name!r} arrived after DeepSpeed's call (coalesced), "
                "but the parameter holds no gradient to receive it"
            )
        ptr = g.untyped_storage().data_ptr()
        for bk in opt.ipg_buckets.values():
            if any(ptr == t.untyped_storage().data_ptr() for t in getattr(bk, "buffer", [])):
                raise Fp8CommStateError(
                    f"fp8comm ZeRO-1/2: the gradient of {p.name!r} still lives in DeepSpeed's reduce bucket after its "
                    "call (not moved to the partition: contiguous_gradients off?); a coalesced result cannot go there"
                )
        return g.reshape(-1)[p.poff : p.poff + p.n]

    def _owners_flat(self, flat, rows, b: _Batch, cfg, ef) -> torch.Tensor:
        """One all-to-all to the owners with exact parts, every contribution decoded straight into fp32, summed in
        fp32 in rank order."""
        H, world, mine = self.H, b.world, rows[b.me]
        got = self.scratch.take("recv32", world * mine * H, torch.float32, b.device).view(-1, H)
        fc.all_to_all(flat.view(-1, H), [mine] * world, rows, b.pg, config=cfg, error_feedback=ef, guard=b.gb, out=got)
        return _sum_rows(got, world, mine * H, self.scratch, b.device)

    def _owners_two_level(self, flat, rows, b: _Batch, cfg, ef, hg) -> torch.Tensor:
        """Two levels: inside the node an all-to-all in the communication dtype (exact) to the rank of each owner's
        local index, summed there in fp32 in local-rank order; across nodes one quantization of each node's partial
        sums and an all-to-all among the rails with exact parts, decoded into fp32 and summed in node order.
        flat is rail-major (owners by local index, then node). Error feedback covers the rail quantization: `ef`
        holds the residual of my rail's owners' rows only (_owners_window), the other owners' rows are theirs."""
        H, lc, nn, lr = self.H, hg.local, hg.nodes, hg.local_rank
        rail_rows = [[rows[m * lc + j] for m in range(nn)] for j in range(lc)]
        R = [sum(r) for r in rail_rows]
        mine = R[lr]
        recv = self.scratch.take("intra", lc * mine * H, b.dtype, b.device).view(-1, H)
        fc.all_to_all(flat.view(-1, H), [mine] * lc, R, hg.intra, wire="native", out=recv)
        node = self.scratch.take("node", mine * H, torch.float32, b.device)
        node.copy_(recv[:mine].reshape(-1))
        if lc > 1:
            tmp = self.scratch.take("tmp", mine * H, torch.float32, b.device)
            # each term widened to fp32 first, then added (levels.hier_rs_phase's order): a mixed-dtype add_ costs
            # ~3x the copy and the fp32 add on CPU (8 Mi elements, one thread: 19.4 vs 6.5 ms, 2026-12-03)
            for i in range(1, lc):
                tmp.copy_(recv[i * mine : (i + 1) * mine].reshape(-1))
                node.add_(tmp)
        own = rows[b.me]
        got = self.scratch.take("recv32", nn * own * H, torch.float32, b.device).view(-1, H)
        fc.all_to_all(
            node.view(-1, H), [own] * nn, rail_rows[lr], hg.inter, config=cfg, error_feedback=ef, guard=b.gb, out=got
        )
        return _sum_rows(got, nn, own * H, self.scratch, b.device)

    def _owners_window(self, rows: list[int], hg) -> list[tuple[int, int, int]]:
        """The send-buffer range (rail-major: owners by local index, then node) of my rail's owners' rows: what
        _owners_two_level quantizes across the nodes, so what its error-feedback residual covers."""
        lc, nn, lr, H = hg.local, hg.nodes, hg.local_rank, self.H
        R = [sum(rows[m * lc + j] for m in range(nn)) for j in range(lc)]
        start = sum(R[:lr]) * H
        return [(start, start + R[lr] * H, 0)]

    # ------------------------------------------------------------------------------------------------ the log
    def _log_layout(self) -> None:
        """Once per bucket layout (DeepSpeed buckets the first backward after a build differently from later ones):
        which collectives the backward's gradients took and in which format, on rank 0; kept in hook_stats."""
        sig = tuple(self.sent)
        if sig in self.layouts:
            return
        self.layouts[sig] = len(self.layouts) + 1
        groups: dict[tuple, list] = {}
        for kind, path, lv, wire, calls, n, owners in self.sent:
            g = groups.setdefault((kind, path, lv, wire), [0, 0, 0, set()])
            g[0] += 1
            g[1] += calls
            g[2] += n
            g[3].update(owners)
        parts = []
        for (kind, path, lv, wire), (k, calls, n, owners) in groups.items():
            if kind == "shared":
                parts.append(f"{k} x slices several ranks consume: {wire} all-reduce")
                continue
            what = "reduce-scatter" if path == "reduce_scatter" else path.replace("_", "-")
            to = "" if path == "reduce_scatter" else f" to owners {sorted(owners)}"
            parts.append(f"{k} x {what}{to} {lv} {wire} ({calls} DeepSpeed calls, {n:,} elements)")
        stage = self.es.engine.zero_optimization_stage() if self.es.engine is not None else "1/2"
        msg = (
            f"fp8comm: ZeRO-{stage} gradient bucket layout {self.layouts[sig]} (reduce_bucket_size "
            f"{int(self.opt.reduce_bucket_size):,}, coalesced up to {self.limit:,} elements): " + "; ".join(parts)
        )
        self.es.grad_layouts.append(msg)
        say_rank0(f"{msg} [engine {self.es.number}]")


def _sum_rows(got: torch.Tensor, senders: int, n: int, scratch: _Scratch, device) -> torch.Tensor:
    """Sum of `senders` fp32 contributions of n elements each (got, flat in sender order), in sender order."""
    flat = got.view(-1)
    acc = scratch.take("acc", n, torch.float32, device)
    acc.copy_(flat[:n])
    for r in range(1, senders):
        acc.add_(flat[r * n : (r + 1) * n])
    return acc


def grad_reduce(es, opt, orig, layout: dict):
    reducer = es.__dict__["z12_reducer"] = _Reducer(es, opt, orig)

    @functools.wraps(orig)
    def allreduce_and_scatter(
        bucket, communication_data_type, numel_per_bucket=500000000, log=None, divide=True, process_group=None
    ):
        return reducer(layout.get("cur"), bucket, communication_data_type, numel_per_bucket, log, divide, process_group)

    return allreduce_and_scatter


def end_of_backward(es, orig):
    """reduce_ipg_grads(): DeepSpeed's epilogue calls it without a dtype once the backward's last bucket is handed
    over; what the adapter still holds goes out then, before DeepSpeed reads the gradients."""

    @functools.wraps(orig)
    def reduce_ipg_grads(*a, **k):
        out = orig(*a, **k)
        if (a[0] if a else k.get("comm_dtype")) is None:
            es.z12_reducer.end_of_backward()
        return out

    return reduce_ipg_grads


def flush_before_step(es, orig):
    """step(): nothing may wait in the adapter when DeepSpeed reads gradients (counted if something did)."""

    @functools.wraps(orig)
    def step(*a, **k):
        r = es.z12_reducer
        if r.batch is not None:
            es.acct.hit("zero12.grad_reduce.flushed_at_step")
            r.flush()
        return orig(*a, **k)

    return step
