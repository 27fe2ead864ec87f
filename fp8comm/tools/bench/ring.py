"""NCCL's ring reduce-scatter / all-gather / all-reduce on torch.distributed point-to-point: the bf16 baseline a user
would otherwise run (a benchmark baseline, not a library API).

torch's gloo reduce_scatter is a clone plus a ring ALL-REDUCE (ProcessGroupGloo.reduce_scatter_tensor_coalesced),
so it moves twice a reduce-scatter's bytes; NCCL runs a ring reduce-scatter. This module runs NCCL's ring on the same
transport (gloo isend/irecv), ranks in group rank order (node-major under torchrun, so on every hop exactly one rank
per node sends across the node's link):

  reduce-scatter  world-1 steps; at step s rank r sends chunk (r-1-s) mod W to rank r+1 (its own input at s=0, the
                  running sum after), receives chunk (r-2-s) mod W from rank r-1 and adds its own input of that
                  chunk, in the input dtype (as NCCL sums bf16); the last step's sum is chunk r, the output.
  all-gather      world-1 steps; at step s rank r sends chunk (r-s) mod W to rank r+1 and receives chunk
                  (r-1-s) mod W from rank r-1 straight into the output.
  all-reduce      the reduce-scatter into the output's own chunk, then the all-gather in place.

Bytes each rank sends: (W-1) chunks per phase, chunk = N/W elements; on a node's link (one crossing rank per node
and hop, n >= 2 nodes): the same (W-1) chunks per phase (link_bytes_per_node).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ring:
    """Ring collectives over `group` for flat buffers of `count` elements of `dtype` (count % world == 0).

    Two receive buffers of one chunk are allocated here, once; the calls allocate nothing."""

    def __init__(self, count: int, dtype: torch.dtype, group=None, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if count % self.world:
            raise ValueError(f"ring: {count} elements do not split into {self.world} equal chunks")
        self.count, self.chunk, self.dtype = count, count // self.world, dtype
        w, r = self.world, self.rank
        glob = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
        self.next, self.prev = glob((r + 1) % w), glob((r - 1) % w)
        n = self.chunk if w > 1 else 0
        self._bufs = (torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device))

    def _part(self, t: torch.Tensor, c: int) -> torch.Tensor:
        return t[c * self.chunk : (c + 1) * self.chunk]

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [
            dist.isend(send, self.next, group=self.group),
            dist.irecv(recv, self.prev, group=self.group),
        ]
        for op in ops:
            if op is not None:  # None: this rank is not in the group (never here: every rank takes part)
                op.wait()

    def _check(self, full: torch.Tensor, part: torch.Tensor) -> None:
        if full.numel() != self.count or part.numel() != self.chunk or full.dtype != self.dtype:
            raise ValueError(
                f"ring built for {self.count} {self.dtype} elements, called with {full.numel()} {full.dtype} "
                f"and a chunk of {part.numel()}"
            )

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """out (chunk elements) = sum over ranks of inp's chunk `rank` (SUM, in the input dtype)."""
        inp, o = inp.reshape(-1), out.view(-1)
        self._check(inp, o)
        w, r = self.world, self.rank
        if w == 1:
            o.copy_(inp)
            return out
        send = self._part(inp, (r - 1) % w)
        for s in range(w - 1):
            recv = self._bufs[s % 2]
            self._exchange(send, recv)
            c = (r - 2 - s) % w
            if s == w - 2:  # c == r: the last partial sum meets this rank's own chunk
                torch.add(recv, self._part(inp, c), out=o)
            else:
                recv.add_(self._part(inp, c))
                send = recv  # the other buffer receives next (no overlap with this one)
        return out

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """out (world * chunk elements) = every rank's inp, in rank order."""
        o, src = out.view(-1), inp.reshape(-1)
        self._check(o, src)
        w, r = self.world, self.rank
        mine = self._part(o, r)
        if mine.data_ptr() != src.data_ptr():
            mine.copy_(src)
        for s in range(w - 1):
            self._exchange(self._part(o, (r - s) % w), self._part(o, (r - 1 - s) % w))
        return out

    def all_reduce(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """out = sum over ranks of inp (ring reduce-scatter into out's own chunk, then the ring all-gather)."""
        o = out.view(-1)
        self.reduce_scatter(self._part(o, self.rank), inp)
        return self.all_gather(o, self._part(o, self.rank))


# ------------------------------------------------------------------------------------------ byte accounting
# Closed forms kept here (this file also benchmarks older checkouts, which have no fp8comm.comm.linkmodel);
# tests/unit/test_link_bytes.py checks them against the one byte model, linkmodel.bytes.
def ring_link_bytes_per_node(op: str, count: int, itemsize: int, world: int, local: int) -> int:
    """Bytes one node sends across its link in one ring call on `count` elements (the full buffer: the
    reduce-scatter's input, the all-gather's output, the all-reduce's buffer): with ranks node-major, one rank per
    node sends to the next node on every one of the world-1 steps of each phase."""
    if world <= local:
        return 0
    phases = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}[op]
    return phases * (world - 1) * (count // world) * itemsize


def torch_gloo_link_bytes_per_node(op: str, count: int, itemsize: int, world: int, local: int) -> int:
    """Bytes one node sends across its link in torch's gloo call on `count` elements (as ring_link_bytes_per_node).

    gloo's all-gather and all-reduce are rings in rank order (one crossing rank per node and step); torch's gloo
    reduce-scatter is a clone plus that ring all-reduce (twice a reduce-scatter's bytes); all_to_all_single sends
    every rank's chunk straight to its destination: local ranks x chunks for other nodes."""
    if world <= local:
        return 0
    chunk = count // world * itemsize
    if op == "all_gather":
        return (world - 1) * chunk
    if op in ("reduce_scatter", "all_reduce"):
        return 2 * (world - 1) * chunk
    if op == "all_to_all":
        return local * (world - local) * chunk
    raise ValueError(op)


def cross_node_bytes(per_dest: list[int], rank: int, local: int) -> int:
    """Of one rank's per-destination bytes (index = destination rank in node-major order), those for other
    nodes."""
    node = rank // local
    return sum(b for d, b in enumerate(per_dest) if d // local != node)


def stats_link_bytes_per_node(stats: dict, op: str, world: int, local: int, invocations: int | None = None) -> int:
    """Bytes one node sends across its link in one call, from fp8comm's own statistics (comm_stats() or a
    Buffer's stats; every rank of the node sends alike), per invocation: the stats cover `invocations` calls of
    the row (default: stats[op]["calls"]; a row of 4 async buckets is one invocation of 4 calls).

    Two-level call: stats[op] is the cross-node (rail) phase, all of it crossing; stats[op + ".intra"] stays in
    the node. Flat reduce-scatter: equal chunks to each of the world-1 other ranks, those for ranks on other nodes
    cross (for a node of g of world ranks: g * (world-g)/(world-1) of one rank's bytes). Flat all-gather: the
    backend's all_gather is a ring in rank order (gloo and NCCL), so one rank per node crosses with all world-1
    chunks it sends. Flat all-reduce: half of its bytes each (its reduce-scatter and all-gather phases send
    equal chunks)."""
    if world <= local:
        return 0
    s = stats.get(op)
    if not s:
        return 0
    calls = max(1, int(invocations if invocations is not None else s.get("calls", 1)))
    wire = int(s["wire_bytes"]) // calls
    if (op + ".intra") in stats:
        return local * wire
    if op == "all_gather":
        return wire
    rs = wire // 2 if op == "all_reduce" else wire
    per_dest = [0 if d == 0 else rs // (world - 1) for d in range(world)]  # rank 0's view: chunks to others
    return local * cross_node_bytes(per_dest, 0, local) + (wire - rs)
