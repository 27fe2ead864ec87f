#!/usr/bin/env python3
"""fp8comm on NCCL across GPUs, one rank per GPU: `torchrun --nproc-per-node=<GPUs> launch/gpu_cluster_check.py`.

What only a machine with 2+ GPUs can show (NCCL refuses two ranks on one GPU, so the single-GPU scripts run their
multi-rank checks through the staged gloo backend, which cannot show NCCL's own stream semantics). Each check runs
the fp8comm call on CUDA tensors over NCCL and the same call on CPU copies over a gloo group (the reference kernels
the CPU suite checks), and compares bit for bit (NaN positions equal, every other bit equal):
- all_gather / reduce_scatter (sum, avg; one rank holds an inf) / all_reduce: equal to the gloo reference on every
  rank, and the gathered output bit-identical across ranks;
- all_to_all with uneven splits (all_to_all_single on NCCL), forward and backward;
- nccl_async_stream_order: 10 async all_gather_into and reduce_scatter_into calls in flight (more than the scratch
  pool keeps), one rank delayed by a GPU sleep before it packs, handles waited in order, outputs read on another
  stream: the decode must run after NCCL's receive, on every call;
- hierarchical NCCL groups: node groups built by fp8comm.comm.node_groups (node size from LOCAL_WORLD_SIZE when the
  job spans nodes, else --node-size, default half the GPUs: one machine split into 2 "nodes"), hierarchical
  all_gather and reduce_scatter against the same on gloo node groups.
Rank 0 prints one table (check, ranks passed, first problem). Exit status: 0 all passed on every rank, 1 a check
failed, 2 cannot run here (no CUDA, not under torchrun, fewer than 2 ranks, fewer GPUs than local ranks).
Several nodes: the usual torchrun flags (--nnodes, --node-rank, --rdzv-endpoint; launch/torchrun.sh sets them).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def refuse(why: str) -> int:
    print(f"gpu_cluster_check: {why}", file=sys.stderr)
    return 2


def same(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when a and b are bit-identical up to NaN payloads (NaN positions equal), else what differs."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    na, nb = a.isnan(), b.isnan()
    if not torch.equal(na, nb):
        return f"NaN positions differ ({int(na.sum())} vs {int(nb.sum())})"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    fa, fb = a[~na].view(bits), b[~nb].view(bits)
    if not torch.equal(fa, fb):
        return f"{int((fa != fb).sum())} of {fa.numel()} values differ"
    return None


class Checks:
    """Runs named checks on this rank; each records ok / the first problem, never aborts the others."""

    def __init__(self) -> None:
        self.results: dict[str, str | None] = {}

    def run(self, name: str, fn) -> None:
        try:
            problem = fn()
        except Exception as e:
            problem = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc()
        self.results[name] = problem
        print(f"[rank {os.environ.get('RANK')}] {name}: {'ok' if problem is None else problem}", flush=True)


def across_ranks(out: torch.Tensor, world: int) -> str | None:
    """Every rank's `out` (CUDA, same shape) bit-identical to this rank's (plain NCCL all_gather of the result)."""
    import torch.distributed as dist

    got = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(got, out.contiguous())
    for r, g in enumerate(got):
        d = same(g, out)
        if d is not None:
            return f"rank {r}'s output differs from mine: {d}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node-size", type=int, default=0, help="ranks per 'node' for the hierarchical checks")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a stuck collective fails the job")
    p.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)  # the script's own logic on gloo
    a = p.parse_args(argv)
    dry = a.dry_run_cpu
    if not torch.cuda.is_available() and not dry:
        return refuse("no CUDA device; this script checks NCCL across GPUs (CPU: the tests/dist suite)")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return refuse("run under torchrun: torchrun --nproc-per-node=<GPUs> launch/gpu_cluster_check.py")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world < 2:
        return refuse(f"needs 2 or more ranks (one per GPU), got WORLD_SIZE={world}")
    if not dry and torch.cuda.device_count() < local_world:
        return refuse(
            f"{local_world} local ranks but {torch.cuda.device_count()} GPUs: NCCL refuses two ranks on one GPU "
            "(several ranks on one GPU: launch/gpu_ready_check.py's multi_rank section, staged gloo backend)"
        )

    import torch.distributed as dist

    import fp8comm.comm as fc

    timeout = datetime.timedelta(seconds=a.timeout)
    if dry:  # CPU tensors on gloo against the same on gloo: proves the script runs, not NCCL
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    else:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)  # the reference path, on CPU copies
    node = a.node_size or (local_world if world > local_world else max(1, world // 2))
    checks = Checks()
    g = torch.Generator().manual_seed(1234 + rank)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    # --- all_gather, reduce_scatter, all_reduce: NCCL vs gloo, and identical across ranks
    x = randn(64, 1000)

    def all_gather():
        out = fc.all_gather(x.to(dev))
        return same(out, fc.all_gather(x, group=gloo)) or across_ranks(out, world)

    checks.run("all_gather", all_gather)
    big = randn(world * 48, 1000, dtype=torch.float32) * (rank + 1)
    if rank == 1:
        big[3, 7] = float("inf")  # non-finite values propagate, on NCCL as on gloo

    for op in ("sum", "avg"):
        checks.run(
            f"reduce_scatter.{op}",
            lambda op=op: same(fc.reduce_scatter(big.to(dev), op=op), fc.reduce_scatter(big, group=gloo, op=op)),
        )

    def all_reduce():
        out = fc.all_reduce(big.to(dev))
        return same(out, fc.all_reduce(big, group=gloo)) or across_ranks(out, world)

    checks.run("all_reduce", all_reduce)

    # --- uneven all_to_all (all_to_all_single on NCCL), forward and backward
    def splits_of(r: int) -> list[int]:
        return [(r + 2 * j) % 3 + 1 for j in range(world)]  # rows rank r sends to rank j: differ per pair

    def all_to_all():
        send = splits_of(rank)
        recv = [splits_of(j)[rank] for j in range(world)]
        t = randn(sum(send), 512)
        dy = randn(sum(recv), 512)
        res = []
        for d, grp in ((dev, None), (torch.device("cpu"), gloo)):
            ti = t.to(d).requires_grad_(True)
            y = fc.all_to_all(ti, recv, send, group=grp)
            y.backward(dy.to(d))
            res.append((y, ti.grad))
        return same(res[0][0], res[1][0]) or same(res[0][1], res[1][1])

    checks.run("all_to_all.uneven_fwd_bwd", all_to_all)

    # --- async NCCL work in flight: decodes ordered after NCCL's receive, scratch reused across streams
    def async_stream_order():
        n = 1 << 18
        xs = [randn(n) * (i + 1) + i for i in range(10)]
        rs_in = [randn(world * 4096, dtype=torch.float32) * (i + 1) for i in range(10)]
        if dry:
            side = reader = None
        else:
            side, reader = torch.cuda.Stream(), torch.cuda.Stream()
            torch.cuda.synchronize()
        outs, rs_outs, handles = [], [], []
        with torch.cuda.stream(side):  # a None stream is a no-op context
            if rank == world - 1 and not dry:
                torch.cuda._sleep(int(5e8))  # this rank packs late: the others' decodes must wait for NCCL
            for i in range(10):
                o = torch.full((world * n,), float("nan"), device=dev, dtype=torch.bfloat16)
                handles.append(fc.all_gather_into(o, xs[i].to(dev, non_blocking=True), async_op=True))
                outs.append(o)
                ro = torch.full((4096,), float("nan"), device=dev)
                handles.append(fc.reduce_scatter_into(ro, rs_in[i].to(dev, non_blocking=True), async_op=True))
                rs_outs.append(ro)
            for h in handles:
                h.wait()
        if reader is not None:
            reader.wait_stream(side)
        with torch.cuda.stream(reader):  # the consumer: another stream, ordered after the waits
            got = [o.clone() for o in outs]
            rs_got = [o.clone() for o in rs_outs]
        if not dry:
            torch.cuda.synchronize()
        for i in range(10):
            want = torch.empty(world * n, dtype=torch.bfloat16)
            fc.all_gather_into(want, xs[i], group=gloo)
            d = same(got[i], want)
            if d is not None:
                return f"all_gather_into call {i}: {d}"
            rwant = torch.empty(4096)
            fc.reduce_scatter_into(rwant, rs_in[i], group=gloo)
            d = same(rs_got[i], rwant)
            if d is not None:
                return f"reduce_scatter_into call {i}: {d}"
        return None

    checks.run("nccl_async_stream_order", async_stream_order)

    # --- hierarchical NCCL node groups vs the same hierarchy on gloo
    def hierarchical():
        if world % node:
            return f"world {world} is not a multiple of --node-size {node}"
        hg = fc.node_groups(None, local_size=node)  # NCCL subgroups, created on every rank in the same order
        nodes = world // node
        intra = [dist.new_group([n * node + i for i in range(node)], backend="gloo") for n in range(nodes)]
        inter = [dist.new_group([n * node + i for n in range(nodes)], backend="gloo") for i in range(node)]
        me_node, me_local = divmod(rank, node)
        hg_ref = fc.HierarchicalGroups(intra[me_node], inter[me_local], nodes, node, me_node, me_local)
        out = fc.all_gather(x.to(dev), hierarchical=hg)
        d = same(out, fc.all_gather(x, group=gloo, hierarchical=hg_ref)) or across_ranks(out, world)
        if d is not None:
            return f"all_gather: {d}"
        d = same(
            fc.reduce_scatter(big.to(dev), hierarchical=hg), fc.reduce_scatter(big, group=gloo, hierarchical=hg_ref)
        )
        return None if d is None else f"reduce_scatter: {d}"

    checks.run(f"hierarchical_nccl_groups.node{node}", hierarchical)

    # --- one table on rank 0; every rank exits with the same status
    everyone: list = [None] * world
    dist.all_gather_object(everyone, checks.results, group=gloo)
    failed = any(v is not None for res in everyone for v in res.values())
    if rank == 0:
        print(
            f"\nfp8comm {world} ranks on {'gloo (--dry-run-cpu)' if dry else 'NCCL'} "
            f"({'cpu' if dry else torch.cuda.get_device_name(dev)}, torch {torch.__version__}), "
            f"reference: the same calls on CPU over gloo"
        )
        print("| check | ranks passed | first problem |\n|---|---|---|")
        for name in checks.results:
            probs = [(r, res.get(name, "missing")) for r, res in enumerate(everyone)]
            bad = [(r, pr) for r, pr in probs if pr is not None]
            first = f"rank {bad[0][0]}: {bad[0][1]}" if bad else ""
            print(f"| {name} | {world - len(bad)}/{world} | {first} |")
        print(f"\noverall: {'FAIL' if failed else 'ok'}", flush=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
