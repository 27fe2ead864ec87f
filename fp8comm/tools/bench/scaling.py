"""Multi-node scaling: FP8 vs bf16 (and fp32 gradients) collectives and training steps on 1..N simulated nodes.

Driven by `launch/cluster.py bench` (which owns the namespaces and rate-limited links); the pieces:
  python -m fp8comm.tools.bench.scaling worker --out F.json ...  one rank under torchrun: collectives, side by side
  launch/train_demo.py --modes fp8,bf16,fp32 --json F.json        one rank under torchrun: training steps, likewise
  python -m fp8comm.tools.bench.scaling report DIR                tables (markdown) and plots from the JSON files

Every repetition runs every variant once, in rotating order, so slow drifts of the shared machine hit all variants
alike; each time is the slowest rank's (barrier before, max over ranks after); medians over repetitions. Sizes
are the per-rank input in bf16 (all-gather: the shard; reduce-scatter: the gradient bucket; all-to-all: the
tokens); fp32 rows move the same elements. "link MB" are bytes node 0 actually sent on its eth0 (kernel counters,
TCP/IP overhead included), per call; "model MB" the bytes the row's algorithm puts on a node's link per call: FP8
rows from fp8comm's own statistics (ring.stats_link_bytes_per_node), torch rows from gloo's algorithm, ring rows
from the ring's; `!` where a counter and its model differ by more than 10%. `*_ring` rows: NCCL's ring
reduce-scatter / all-gather / all-reduce in bf16 on gloo point-to-point (ring.py), the baseline a user would
otherwise run (torch's gloo reduce_scatter is a ring all-reduce: twice the bytes). Every row, FP8 or not, writes
into preallocated outputs. Ranks per node: torchrun's LOCAL_WORLD_SIZE (`cluster.py bench --nproc-per-node`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import fp8comm

from ...distributed import link_bytes
from . import ring as ringmod

HIDDEN = 4096  # MoE token width for the all-to-all rows

# (key, op, description). FP8 rows quantize inside the timed region: the quantization cost is included.
VARIANTS = [
    ("ag.fp8", "all_gather", "fp8comm.all_gather_into, bf16 in/out (E4M3, 1x128 fp32 scales), pipelined"),
    ("ag.fp8_b4", "all_gather", "the same in 4 buckets issued async, then waited (engine prefetch pattern)"),
    (
        "ag.fp8_out",
        "all_gather",
        "fp8comm.all_gather(fp8_out=True): FP8 out (codes + scales), for an FP8 GEMM consumer",
    ),
    ("ag.fp8_1p", "all_gather", "fp8comm.all_gather, pipeline=False (one piece: codec and wire in sequence)"),
    ("ag.bf16", "all_gather", "torch all_gather_into_tensor, bf16"),
    ("ag.bf16_b4", "all_gather", "the same in 4 async buckets"),
    ("ag.bf16_ring", "all_gather", "NCCL's ring all-gather, bf16, on gloo isend/irecv (ring.py)"),
    ("rs.fp8", "reduce_scatter", "fp8comm.reduce_scatter_into, bf16 in/out, pipelined"),
    ("rs.fp8_f32", "reduce_scatter", "fp8comm.reduce_scatter, fp32 in/out"),
    ("rs.fp8_f32_1p", "reduce_scatter", "fp8comm.reduce_scatter, fp32, pipeline=False (one piece)"),
    ("rs.fp8_f32_b4", "reduce_scatter", "the same in 4 async buckets (DDP/ZeRO gradient buckets)"),
    ("rs.fp8_hier", "reduce_scatter", "fp8comm.reduce_scatter hierarchical, fp32 in/out (fp32 inside a node)"),
    ("rs.mxfp4", "reduce_scatter", "fp8comm.reduce_scatter_into fmt=mxfp4, bf16 in/out, flat"),
    (
        "rs.mxfp4_hier",
        "reduce_scatter",
        "fp8comm.reduce_scatter_into fmt=mxfp4 hierarchical, bf16 in/out (skipped where fp8comm refuses it)",
    ),
    ("rs.bf16", "reduce_scatter", "torch reduce_scatter_tensor, bf16"),
    ("rs.fp32", "reduce_scatter", "torch reduce_scatter_tensor, fp32"),
    ("rs.fp32_b4", "reduce_scatter", "the same in 4 async buckets"),
    ("rs.bf16_ring", "reduce_scatter", "NCCL's ring reduce-scatter, bf16, summed in bf16, on gloo p2p (ring.py)"),
    ("ar.fp8", "all_reduce", "fp8comm.all_reduce_into, bf16 in/out"),
    ("ar.bf16", "all_reduce", "torch all_reduce, bf16 (gloo ring)"),
    ("ar.bf16_ring", "all_reduce", "ring reduce-scatter + ring all-gather, bf16 (ring.py)"),
    ("a2a.fp8", "all_to_all", "fp8comm.all_to_all wire=fp8 out=..., bf16 tokens [T, 4096], pipelined"),
    (
        "a2a.fp8_out",
        "all_to_all",
        "fp8comm.all_to_all(fp8_out=True): FP8 tokens + 1x128 scales out, for an FP8 "
        "expert GEMM consumer (DeepEP-style dispatch)",
    ),
    ("a2a.fp8_1p", "all_to_all", "fp8comm.all_to_all wire=fp8, pipeline=False (one piece)"),
    ("a2a.bf16", "all_to_all", "torch all_to_all_single, bf16 tokens"),
    # No communication: the quantize + dequantize work of the FP8 rows alone, on every rank at once (same CPU
    # contention), to show how much of each FP8 time is codec rather than wire.
    ("codec.ag", "codec", "pack own shard + unpack world shards to bf16 (the all-gather's CPU work)"),
    ("codec.rs", "codec", "pack the fp32 bucket + unpack-and-sum world chunks (the reduce-scatter's CPU work)"),
    ("codec.a2a", "codec", "pack tokens + unpack tokens (the all-to-all's CPU work)"),
]
# Pairs the report turns into speedups: (fp8 key, baseline key).
RATIOS = [
    ("ag.fp8", "ag.bf16"),
    ("ag.fp8_1p", "ag.bf16"),
    ("ag.fp8_b4", "ag.bf16_b4"),
    ("ag.fp8_out", "ag.bf16"),
    ("ag.fp8", "ag.bf16_ring"),
    ("rs.fp8", "rs.bf16"),
    ("rs.fp8", "rs.bf16_ring"),
    ("rs.mxfp4", "rs.bf16"),
    ("rs.mxfp4", "rs.bf16_ring"),
    ("rs.mxfp4_hier", "rs.bf16_ring"),
    ("rs.mxfp4_hier", "rs.mxfp4"),
    ("rs.fp8_f32", "rs.fp32"),
    ("rs.fp8_f32_1p", "rs.fp32"),
    ("rs.fp8_f32_b4", "rs.fp32_b4"),
    ("rs.fp8_hier", "rs.fp32"),
    ("rs.fp8_hier", "rs.fp8_f32"),
    ("ar.fp8", "ar.bf16"),
    ("ar.fp8", "ar.bf16_ring"),
    ("a2a.fp8", "a2a.bf16"),
    ("a2a.fp8_1p", "a2a.bf16"),
    ("a2a.fp8_out", "a2a.bf16"),
]
# Rows whose output is FP8 (no dequantization): labelled in every table, never mixed up with the others.
FP8_OUT = {"ag.fp8_out", "a2a.fp8_out"}
BUCKETS = 4
# What each baseline is: every speedup the report prints names it (a torch gloo reduce-scatter is a ring all-reduce).
BASELINE_NAMES = {
    "ag.bf16": "torch gloo bf16 (ring)",
    "ag.bf16_b4": "torch gloo bf16 (ring), 4 buckets",
    "ag.bf16_ring": "bf16 ring",
    "rs.bf16": "torch gloo bf16 (ring all-reduce)",
    "rs.fp32": "torch gloo fp32 (ring all-reduce)",
    "rs.fp32_b4": "torch gloo fp32 (ring all-reduce), 4 buckets",
    "rs.bf16_ring": "bf16 ring",
    "rs.fp8_f32": "fp8comm flat",
    "rs.mxfp4": "fp8comm flat",
    "ar.bf16": "torch gloo bf16 (ring)",
    "ar.bf16_ring": "bf16 ring",
    "a2a.bf16": "torch gloo bf16 (direct)",
}
# Rows whose link bytes follow from their algorithm (not from fp8comm's statistics): key -> (algorithm, op, dtype)
_ALGO = {
    "ag.bf16": ("torch", "all_gather", 2),
    "ag.bf16_b4": ("torch", "all_gather", 2),
    "ag.bf16_ring": ("ring", "all_gather", 2),
    "rs.bf16": ("torch", "reduce_scatter", 2),
    "rs.fp32": ("torch", "reduce_scatter", 4),
    "rs.fp32_b4": ("torch", "reduce_scatter", 4),
    "rs.bf16_ring": ("ring", "reduce_scatter", 2),
    "ar.bf16": ("torch", "all_reduce", 2),
    "ar.bf16_ring": ("ring", "all_reduce", 2),
    "a2a.bf16": ("torch", "all_to_all", 2),
}
LINK_TOLERANCE = 0.10
# Absolute slack on top: the barrier after each call and the ACKs for the bytes node 0 receives cross too (~10% of
# a 140 KB rail phase at 1 MiB per rank, noise at >= 16 MiB).
LINK_SLACK = 32 << 10


def model_link_bytes(key: str, n: int, world: int, local: int, stats: dict | None, invocations: int) -> int | None:
    """Bytes one node sends across its link per call of row `key` (n = bf16 elements per rank), from the row's
    algorithm (torch, ring) or from fp8comm's statistics of the row's Buffer over `invocations` calls (FP8 rows);
    None for rows without communication."""
    op = _OPS.get(key)
    if key in _ALGO:
        algo, aop, isz = _ALGO[key]
        count = n * world if aop == "all_gather" else n  # the full buffer: all-gather output, else the input
        fn = ringmod.ring_link_bytes_per_node if algo == "ring" else ringmod.torch_gloo_link_bytes_per_node
        return fn(aop, count, isz, world, local)
    if op in (None, "codec") or stats is None:
        return None
    return ringmod.stats_link_bytes_per_node(stats, op, world, local, invocations=invocations)


def link_flag(model, measured) -> str:
    """'!' when the link counter and the model differ by more than LINK_TOLERANCE (of the model) + LINK_SLACK."""
    if model is None or measured is None:
        return ""
    return "!" if abs(measured - model) > LINK_TOLERANCE * model + LINK_SLACK else ""


def _tx(ifname: str = "eth0") -> int:
    return (link_bytes(ifname) or (0, 0))[0]


# ------------------------------------------------------------------------------------------------- worker
def _variants(keys, mib: float, world: int, local: int):
    """(elements per rank, {key: fn} closures over preallocated inputs for one message size, {key: why skipped},
    {key: the row's fp8comm Buffer})."""
    import torch
    import torch.distributed as dist

    import fp8comm.comm as fc
    from fp8comm.comm.core import all_gather_bytes, torch_reduce_scatter
    from fp8comm.quant import Fp8Tensor, Scaling, get_format

    unit = BUCKETS * world * HIDDEN  # bf16 elements per rank, rounded down so buckets, ranks and tokens divide
    n = int(mib * (1 << 20)) // 2 // unit * unit
    g = torch.Generator().manual_seed(dist.get_rank())
    x16 = torch.randn(n, generator=g).to(torch.bfloat16)
    x32 = torch.randn(n, generator=g)
    ag_out = torch.empty(world * n, dtype=torch.bfloat16)
    rs16, rs32 = torch.empty(n // world, dtype=torch.bfloat16), torch.empty(n // world)
    tok = x16.view(-1, HIDDEN)
    a2a_out = torch.empty_like(tok)
    ag, rs = all_gather_bytes, torch_reduce_scatter
    # One Buffer (scratch pool) per variant, reused across repetitions, as an engine would keep per bucket.
    bufs = {k: fc.Buffer() for k in keys}
    hier = fc.node_groups(local_size=local) if world > local else None
    # Ring baselines: receive buffers allocated once here (NCCL's ring, bf16, on gloo p2p).
    ring_ag = ringmod.Ring(world * n, torch.bfloat16) if "ag.bf16_ring" in keys else None
    ring_rs = ringmod.Ring(n, torch.bfloat16) if {"rs.bf16_ring", "ar.bf16_ring"} & set(keys) else None
    ar16 = torch.empty_like(x16) if any(k.startswith("ar.") for k in keys) else x16

    def buckets(fn, xs, outs=None):
        # Issue every bucket before waiting on any: bucket i+1 is quantized while bucket i is on the wire, and
        # bucket i is dequantized (in wait) while later ones still travel.
        hs = [fn(x, None if outs is None else outs[i]) for i, x in enumerate(xs)]
        for h in hs:
            h.wait()

    def split(t, k=BUCKETS):
        return list(t.view(k, -1).unbind(0))

    x16b, x32b, ag_outb, rs32b = split(x16), split(x32), split(ag_out), split(rs32)
    # Every row writes into a preallocated output, like the torch baselines (and engines, which keep their flat
    # buffers): a fresh 128 MiB output alone costs ~60 ms of page faults per call on the dev VM.
    f8 = Fp8Tensor(
        torch.empty(world * n, dtype=torch.float8_e4m3fn),
        torch.empty(1, world * n // 128),
        get_format("e4m3"),
        Scaling(1, 128, "fp32"),
        torch.bfloat16,
    )
    tok8 = Fp8Tensor(
        torch.empty(tok.shape, dtype=torch.float8_e4m3fn),
        torch.empty(tok.shape[0], HIDDEN // 128),
        get_format("e4m3"),
        Scaling(1, 128, "fp32"),
        torch.bfloat16,
    )
    fns = {
        "ag.fp8": lambda: bufs["ag.fp8"].all_gather_into(ag_out, x16),
        "ag.fp8_b4": lambda: buckets(
            lambda x, o: bufs["ag.fp8_b4"].all_gather_into(o, x, async_op=True), x16b, ag_outb
        ),
        "ag.fp8_out": lambda: bufs["ag.fp8_out"].all_gather(x16, fp8_out=True, out=f8),
        "ag.fp8_1p": lambda: bufs["ag.fp8_1p"].all_gather_into(ag_out, x16, pipeline=False),
        "ag.bf16": lambda: ag(ag_out, x16),
        "ag.bf16_b4": lambda: buckets(lambda x, o: ag(o, x, async_op=True), x16b, ag_outb),
        "ag.bf16_ring": lambda: ring_ag.all_gather(ag_out, x16),  # type: ignore[union-attr]
        "rs.fp8": lambda: bufs["rs.fp8"].reduce_scatter_into(rs16, x16),
        "rs.fp8_f32": lambda: bufs["rs.fp8_f32"].reduce_scatter_into(rs32, x32),
        "rs.fp8_f32_1p": lambda: bufs["rs.fp8_f32_1p"].reduce_scatter_into(rs32, x32, pipeline=False),
        "rs.fp8_f32_b4": lambda: buckets(
            lambda x, o: bufs["rs.fp8_f32_b4"].reduce_scatter_into(o, x, async_op=True), x32b, rs32b
        ),
        "rs.fp8_hier": lambda: bufs["rs.fp8_hier"].reduce_scatter_into(rs32, x32, hierarchical=hier),
        "rs.mxfp4": lambda: bufs["rs.mxfp4"].reduce_scatter_into(rs16, x16, fmt="mxfp4"),
        "rs.mxfp4_hier": lambda: bufs["rs.mxfp4_hier"].reduce_scatter_into(rs16, x16, fmt="mxfp4", hierarchical=hier),
        "rs.bf16": lambda: rs(rs16, x16),
        "rs.fp32": lambda: rs(rs32, x32),
        "rs.fp32_b4": lambda: buckets(lambda x, o: rs(o, x, async_op=True), x32b, rs32b),
        "rs.bf16_ring": lambda: ring_rs.reduce_scatter(rs16, x16),  # type: ignore[union-attr]
        "ar.fp8": lambda: bufs["ar.fp8"].all_reduce_into(ar16, x16),
        "ar.bf16": lambda: (ar16.copy_(x16), dist.all_reduce(ar16)),
        "ar.bf16_ring": lambda: ring_rs.all_reduce(ar16, x16),  # type: ignore[union-attr]
        "a2a.fp8": lambda: bufs["a2a.fp8"].all_to_all(tok, wire="fp8", out=a2a_out),
        "a2a.fp8_out": lambda: bufs["a2a.fp8_out"].all_to_all(tok, wire="fp8", fp8_out=True, out=tok8),
        "a2a.fp8_1p": lambda: bufs["a2a.fp8_1p"].all_to_all(tok, wire="fp8", pipeline=False, out=a2a_out),
        "a2a.bf16": lambda: dist.all_to_all_single(a2a_out, tok),
    }
    fns.update(_codecs(x16, x32, tok, world))
    if hier is None:
        fns.pop("rs.fp8_hier")  # one node: nothing crosses a link, hierarchical == flat
        fns.pop("rs.mxfp4_hier")
    skipped = {}
    if "mxfp4" not in getattr(fc, "FORMATS", ()):
        for k in ("rs.mxfp4", "rs.mxfp4_hier"):
            skipped[k] = "this fp8comm has no 4-bit wire"
    elif hier is not None and "rs.mxfp4_hier" in keys:
        reason = _refused(lambda: fc.reduce_scatter(torch.zeros(world * 256), fmt="mxfp4", hierarchical=hier))
        if reason:
            skipped["rs.mxfp4_hier"] = reason
    for k in skipped:
        fns.pop(k, None)
    return n, {k: fns[k] for k in keys if k in fns}, skipped, bufs


def _refused(probe) -> str | None:
    """Run a small call on every rank: the reason when fp8comm refuses it for hierarchical mode (the 4-bit two-level
    collectives arrive in a later fp8comm), None when it runs. Other errors propagate."""
    from fp8comm.errors import Fp8CommError

    try:
        probe()
    except Fp8CommError as e:
        if "hierarch" not in str(e).lower():
            raise
        return f"refused by this fp8comm: {str(e).splitlines()[0][:160]}"
    return None


def _codecs(x16, x32, tok, world: int) -> dict:
    import torch

    from fp8comm.comm import WireConfig
    from fp8comm.quant.dispatch import backend_name
    from fp8comm.quant.wire import ChunkLayout, pack_chunks, unpack_chunks, unpack_sum

    spec = WireConfig().spec  # the collectives' defaults: E4M3, 1x128 fp32 scales, nearest, backend auto
    fmt, sc = spec.fmt, spec.scaling
    n, L = x16.numel(), x16.numel() // world

    def be(numel):
        return backend_name(spec.backend, x16.device, numel)

    one = ChunkLayout((1,), n, sc)
    ag_send = torch.empty(one.total_bytes, dtype=torch.uint8)
    ag_recv, ag_dest = ag_send.repeat(world), torch.empty(world, n, dtype=torch.bfloat16)
    rsl = ChunkLayout((1,) * world, L, sc)
    rs_send, rs_acc = torch.empty(rsl.total_bytes, dtype=torch.uint8), torch.empty(1, L)
    tl = ChunkLayout((tok.shape[0] // world,) * world, tok.shape[1], sc)
    a2a_send, a2a_out = torch.empty(tl.total_bytes, dtype=torch.uint8), torch.empty_like(tok)

    def ag():
        pack_chunks(x16.view(1, n), one, fmt, "nearest", 0, out=ag_send, backend=be(n))
        unpack_chunks(ag_recv, one.with_rows((1,) * world), fmt, torch.bfloat16, out=ag_dest, backend=be(world * n))

    def rs():
        pack_chunks(x32.view(world, L), rsl, fmt, "nearest", 0, out=rs_send, backend=be(n))
        unpack_sum(rs_send, rsl, fmt, out=rs_acc, backend=be(n))

    def a2a():
        pack_chunks(tok, tl, fmt, "nearest", 0, out=a2a_send, backend=be(tok.numel()))
        unpack_chunks(a2a_send, tl, fmt, torch.bfloat16, out=a2a_out, backend=be(tok.numel()))

    return {"codec.ag": ag, "codec.rs": rs, "codec.a2a": a2a}


def worker(a) -> int:
    import torch
    import torch.distributed as dist

    from fp8comm.distributed import init_distributed

    torch.set_num_threads(a.threads)
    info = init_distributed(timeout_s=a.timeout)
    rank, world, local = info.rank, info.world_size, info.local_world_size
    keys = [k for k, _, _ in VARIANTS if any(k.startswith(p) for p in a.ops.split(","))]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    rows = []
    for mib in [float(s) for s in a.sizes_mib.split(",")]:
        n, fns, skipped, bufs = _variants(keys, mib, world, local)
        names = list(fns)
        if rank == 0:
            for k, why in skipped.items():
                print(f"[scaling] {mib:g} MiB: skipped {k}: {why}", flush=True)
        reps = a.reps if mib >= a.full_reps_from_mib else max(3, a.reps // 2)
        times: dict[str, list[float]] = {k: [] for k in names}
        link: dict[str, list[float]] = {k: [] for k in names}
        for r in range(a.warmup + reps):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no variant always goes first
            dt = torch.zeros(len(names), dtype=torch.float64)
            lb = torch.zeros(len(names), dtype=torch.float64)
            for k in order:
                # The counter is read before the barrier: the node's other ranks leave the barrier first and may
                # already send while this rank is still being scheduled (8 ranks on 2 cores: milliseconds).
                tx0 = _tx()
                dist.barrier()
                t0 = time.perf_counter()
                fns[k]()
                dt[names.index(k)] = time.perf_counter() - t0
                dist.barrier()  # every rank done: this node's link counter holds the whole op (+ one barrier)
                lb[names.index(k)] = _tx() - tx0
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r >= a.warmup:
                for i, k in enumerate(names):
                    times[k].append(float(dt[i]))
                    link[k].append(float(lb[i]))
        calls = a.warmup + reps
        for k in names:
            st = bufs[k].stats.snapshot(reset=True) if k in bufs else None  # this row's calls only
            model = model_link_bytes(k, n, world, local, st, calls)
            measured = statistics.median(link[k]) if rank == 0 else None
            rows.append(
                {
                    "key": k,
                    "mib": mib,
                    "elements": n,
                    "median_s": statistics.median(times[k]),
                    "times_s": times[k],
                    "link_tx_bytes": measured,
                    "model_link_bytes": model,
                    "link_flag": link_flag(model, measured) if world > local else "",
                }
            )
        if rank == 0:
            print(
                f"[scaling] {world // local} node(s) x {local} ranks, {mib:g} MiB: "
                + ", ".join(f"{k} {statistics.median(times[k]) * 1e3:.0f} ms" for k in names),
                flush=True,
            )
        del fns
    if rank == 0:
        meta = {
            "nodes": world // local,
            "ranks_per_node": local,
            "world": world,
            "rate": a.rate,
            "reps": a.reps,
            "warmup": a.warmup,
            "threads": a.threads,
            "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "load": load,
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    fp8comm.shutdown()
    dist.destroy_process_group()
    return 0


def machine() -> str:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cores {cpu}".strip()


# ------------------------------------------------------------------------------------------- driver (root)
def drive(cluster, argv, train_script: str | Path | None = None) -> int:
    """Run the whole benchmark on `cluster` (a launch/cluster.py Cluster): up, every node count, down, report.
    `train_script`: the training loop for the training rows (launch/train_demo.py of the checkout that holds
    cluster.py); without it, --train-steps is ignored."""
    p = argparse.ArgumentParser(prog="cluster.py bench", description="scaling benchmark on the simulated cluster")
    p.add_argument("--nodes", default="1,2,3", help="node counts (--nproc-per-node ranks each)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--rate", default="1gbit", help="link rate per direction (tc tbf)")
    p.add_argument("--sizes-mib", default="1,4,16,32,64")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--ops", default="ag,rs,a2a,codec")
    p.add_argument("--train-steps", type=int, default=14, help="0: skip the training rows")
    p.add_argument("--train-dim", type=int, default=2048)
    p.add_argument("--out-dir", default="bench_out/scaling")
    p.add_argument("--plots", default="docs/img", help="folder for scaling_nodes.png / scaling_sizes.png")
    p.add_argument("--timeout", type=float, default=1800, help="per launch (s)")
    a = p.parse_args(argv)
    nodes = [int(v) for v in a.nodes.split(",")]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    try:
        cluster.up(max(nodes), a.rate)
        for k in nodes:
            rc |= cluster.run(
                [
                    "-m",
                    "fp8comm.tools.bench.scaling",
                    "worker",
                    "--out",
                    str(out / f"coll_n{k}.json"),
                    "--sizes-mib",
                    a.sizes_mib,
                    "--reps",
                    str(a.reps),
                    "--ops",
                    a.ops,
                    "--rate",
                    a.rate,
                ],
                nnodes=k,
                nproc=a.nproc_per_node,
                timeout=a.timeout,
                log_dir=out / f"logs_coll_n{k}",
            )
            if a.train_steps and train_script:
                rc |= cluster.run(
                    [
                        str(train_script),
                        "--modes",
                        "fp8,bf16,fp32",
                        "--steps",
                        str(a.train_steps),
                        "--dim",
                        str(a.train_dim),
                        "--json",
                        str(out / f"train_n{k}.json"),
                    ],
                    nnodes=k,
                    nproc=a.nproc_per_node,
                    timeout=a.timeout,
                    log_dir=out / f"logs_train_n{k}",
                )
    finally:
        cluster.down(quiet=True)
    text = report(out, a.plots)
    (out / "report.md").write_text(text)
    print(text)
    return rc


# ------------------------------------------------------------------------------------------------- report
def _load(out: Path, kind: str) -> dict:
    res = {}
    for f in sorted(out.glob(f"{kind}_n*.json")):
        res[int(f.stem.split("_n")[1])] = json.loads(f.read_text())
    return res


def _cv(ts) -> float:
    return 100 * statistics.pstdev(ts) / statistics.mean(ts) if len(ts) > 1 else 0.0


def report(out: Path, plots: str | None = None) -> str:
    out = Path(out)
    coll, train = _load(out, "coll"), _load(out, "train")
    if not coll:
        return f"no results in {out}"
    m0 = next(iter(coll.values()))["meta"]
    lines = [
        f"Run {m0['date']} on {m0['machine']}, torch {m0['torch']}; links {m0['rate']} per direction (tc tbf "
        f"on both ends of each node's veth); {m0['ranks_per_node']} ranks per node, {m0['threads']} thread "
        f"each, all nodes sharing this machine's CPUs. Medians of {m0['reps']} repetitions (sizes < 16 MiB: "
        f"fewer), each the slowest rank's time, variants interleaved in one run. Load average at start: "
        f"{m0.get('load', '?')}.",
        "",
    ]
    lines += [
        "| nodes | op | MiB/rank | FP8 variant | ms | baseline | ms | speedup vs baseline | link MB FP8 / base "
        "| CV% FP8 / base | model MB FP8 / base | link vs model | baseline is |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, d in sorted(coll.items()):
        rows = {(r["key"], r["mib"]): r for r in d["rows"]}
        for mib in sorted({r["mib"] for r in d["rows"]}):
            if mib < 16:
                continue
            for f8, base in RATIOS:
                a, b = rows.get((f8, mib)), rows.get((base, mib))
                if not a or not b:
                    continue
                la, lb = a.get("link_tx_bytes"), b.get("link_tx_bytes")
                link = f"{la / 1e6:.1f} / {lb / 1e6:.1f}" if k > 1 and la is not None and lb else "-"
                ma, mb = a.get("model_link_bytes"), b.get("model_link_bytes")
                model = f"{ma / 1e6:.1f} / {mb / 1e6:.1f}" if k > 1 and ma is not None and mb is not None else "-"
                flags = [f"{who} differs" for who, r in (("FP8", a), ("base", b)) if r.get("link_flag")]
                size = a["elements"] * 2 / 2**20
                label = f"{f8} (FP8 out, for an FP8 GEMM consumer)" if f8 in FP8_OUT else f8
                lines.append(
                    f"| {k} | {_OPS[f8]} | {size:.1f} | {label} | {a['median_s'] * 1e3:.0f} | {base} | "
                    f"{b['median_s'] * 1e3:.0f} | **{b['median_s'] / a['median_s']:.2f}x** | {link} | "
                    f"{_cv(a['times_s']):.0f} / {_cv(b['times_s']):.0f} | {model} | "
                    f"{'! ' + ', '.join(flags) if flags else ('ok' if model != '-' and link != '-' else '-')} | "
                    f"{BASELINE_NAMES.get(base, base)} |"
                )
    codec = [
        (k, r) for k, d in sorted(coll.items()) for r in d["rows"] if r["key"].startswith("codec.") and r["mib"] >= 16
    ]
    if codec:
        lines += [
            "",
            "CPU work of the FP8 rows alone (quantize + dequantize, no communication, every rank at once):",
            "",
            "| nodes | MiB | all-gather codec ms | reduce-scatter codec ms | all-to-all codec ms |",
            "|---|---|---|---|---|",
        ]
        for k in sorted({k for k, _ in codec}):
            for mib in sorted({r["mib"] for kk, r in codec if kk == k}):
                got = {r["key"]: r["median_s"] for kk, r in codec if kk == k and r["mib"] == mib}
                lines.append(
                    f"| {k} | {mib:g} | "
                    + " | ".join(
                        f"{got[c] * 1e3:.0f}" if c in got else "-" for c in ("codec.ag", "codec.rs", "codec.a2a")
                    )
                    + " |"
                )
    if train:
        lines += [
            "",
            "Training step (launch/train_demo.py: ZeRO-style, weights all-gathered and gradients "
            "reduce-scattered each step, the three modes interleaved in one run):",
            "",
            "| nodes | params | FP8 step ms | bf16 step ms | fp32 step ms | bf16/FP8 | fp32/FP8 | final loss "
            "FP8 / bf16 / fp32 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k, t in sorted(train.items()):
            ms = {m: v["median_step_s"] for m, v in t["modes"].items()}
            loss = " / ".join(f"{t['modes'][m]['final_loss']:.4f}" for m in ("fp8", "bf16", "fp32"))
            lines.append(
                f"| {k} | {t['params'] / 1e6:.1f}M | {ms['fp8'] * 1e3:.0f} | {ms['bf16'] * 1e3:.0f} | "
                f"{ms['fp32'] * 1e3:.0f} | {ms['bf16'] / ms['fp8']:.2f}x | {ms['fp32'] / ms['fp8']:.2f}x | "
                f"{loss} |"
            )
    if plots:
        made = _plots(coll, Path(plots))
        lines += ["", *[f"![{n}]({p})" for n, p in made]]
    return "\n".join(lines) + "\n"


_OPS = {k: op for k, op, _ in VARIANTS}


def _label(key: str) -> str:
    return f"{key} (FP8 out, FP8 GEMM consumer)" if key in FP8_OUT else key


def _plots(coll: dict, folder: Path) -> list[tuple[str, str]]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    groups = [
        ("all_gather", ["ag.fp8", "ag.fp8_out", "ag.fp8_b4", "ag.bf16", "ag.bf16_ring"]),
        ("reduce_scatter", ["rs.fp8_f32", "rs.fp8_hier", "rs.bf16", "rs.bf16_ring", "rs.fp32"]),
        ("all_to_all", ["a2a.fp8", "a2a.fp8_out", "a2a.bf16"]),
    ]
    made = []
    rate = next(iter(coll.values()))["meta"]["rate"]
    g = next(iter(coll.values()))["meta"].get("ranks_per_node", 2)
    big = max(r["mib"] for d in coll.values() for r in d["rows"] if r["mib"] <= 32)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (op, keys) in zip(axes, groups):
        for key in keys:
            xs = [
                (k, r["median_s"])
                for k, d in sorted(coll.items())
                for r in d["rows"]
                if r["key"] == key and r["mib"] == big
            ]
            if xs:
                ax.plot([x for x, _ in xs], [y * 1e3 for _, y in xs], marker="o", label=_label(key))
        ax.set(title=f"{op}, {big:g} MiB per rank", xlabel=f"nodes ({g} ranks each)", ylabel="ms (median)")
        ax.set_xticks(sorted(coll))
        ax.legend(fontsize=8)
    fig.suptitle(f"fp8comm on the simulated cluster: time vs nodes ({rate} links)")
    fig.tight_layout()
    fig.savefig(folder / "scaling_nodes.png", dpi=90)
    made.append(("time vs nodes", str(folder / "scaling_nodes.png")))
    k = 2 if 2 in coll else max(coll)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (op, keys) in zip(axes, groups):
        for key in keys:
            xs = sorted((r["mib"], r["median_s"]) for r in coll[k]["rows"] if r["key"] == key)
            if xs:
                ax.plot([x for x, _ in xs], [y * 1e3 for _, y in xs], marker="o", label=_label(key))
        ax.set(title=f"{op}, {k} nodes", xlabel="MiB per rank (bf16)", ylabel="ms (median)", xscale="log", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle(f"fp8comm on the simulated cluster: time vs message size ({k} nodes x {g} ranks, {rate})")
    fig.tight_layout()
    fig.savefig(folder / "scaling_sizes.png", dpi=90)
    made.append(("time vs message size", str(folder / "scaling_sizes.png")))
    plt.close("all")
    return made


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="one rank of the collectives benchmark (under torchrun)")
    w.add_argument("--out", required=True)
    w.add_argument("--sizes-mib", default="1,4,16,32,64")
    w.add_argument("--ops", default="ag,rs,a2a,codec", help="prefixes of variant keys")
    w.add_argument("--reps", type=int, default=7)
    w.add_argument("--full-reps-from-mib", type=float, default=16, help="smaller sizes run reps//2 (>= 3)")
    w.add_argument("--warmup", type=int, default=1)
    w.add_argument("--threads", type=int, default=1)
    w.add_argument("--rate", default="?", help="link rate, recorded in the JSON")
    w.add_argument("--timeout", type=float, default=900, help="collective timeout (s)")
    r = sub.add_parser("report", help="markdown tables + plots from a results folder")
    r.add_argument("dir")
    r.add_argument("--plots", default=None, help="also write plots into this folder")
    a = p.parse_args(argv)
    if a.cmd == "worker":
        return worker(a)
    print(report(Path(a.dir), a.plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
