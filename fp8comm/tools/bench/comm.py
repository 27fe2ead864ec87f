"""FP8 and 4-bit collectives vs plain torch.distributed (bf16, fp32), side by side in one run, nccl-tests style.

Starts --nproc ranks itself (gloo on 127.0.0.1), or runs as one rank under torchrun (launch/bench_check.py runs it
so on the simulated cluster). Sizes are bytes of the full buffer in bf16 (all_gather: the output; reduce_scatter,
all_reduce, all_to_all: the input); fp32 rows move the same elements. "wire" = bytes one rank sends to other ranks
in the row's own algorithm (FP8 rows: payload + scales + alignment; torch's gloo reduce_scatter is a ring all-reduce,
twice a reduce-scatter's bytes). `bf16-ring` rows: NCCL's ring reduce-scatter / all-gather / all-reduce on gloo
point-to-point (ring.py), the bf16 baseline a user would otherwise run; the wire ratios are against the ring's
(all_to_all: direct sends') bytes. "xnode B/node": bytes one node sends to other nodes per call (LOCAL_WORLD_SIZE
ranks per node; FP8 rows from fp8comm's own statistics, torch/ring rows from their algorithm); "link B/node": node
0's link counter (GLOO_SOCKET_IFNAME, under launch/cluster.py), with `!` where the two differ by more than 10%.
Every row, FP8 or torch, writes into an output allocated once (engines keep their buffers); time = median over
--iters calls, each started after a barrier, the slowest rank's.
`python PATH/TO/comm.py ARGS` (the file itself) benchmarks whichever fp8comm the path resolves first, e.g. an older
checkout on PYTHONPATH: the A/B runs of docs/benchmarks.md use that.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import time
from pathlib import Path

import fp8comm

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
BUSBW = {
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
}


def _shutdown() -> None:
    """fp8comm.shutdown() before destroy_process_group(); launch/bench_check.py --with runs this file against older
    checkouts, which predate it (0.2 and earlier)."""
    getattr(fp8comm, "shutdown", lambda: None)()


def _ring_module():
    """ring.py next to this file (not through the fp8comm package: the A/B runs put an older fp8comm, which has no
    ring.py, first on the path)."""
    import sys

    name = "_fp8comm_bench_ring"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("ring.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


BASELINES = ("bf16", "fp32", "bf16-ring")  # torch's rows and the ring: everything else is fp8comm's
RING_OPS = ("all_gather", "reduce_scatter", "all_reduce")
LINK_TOLERANCE = 0.10  # stats / algorithm count vs link counter: flag beyond this (TCP/IP adds ~2-4%) ...
LINK_SLACK = 32 << 10  # ... plus this (the barriers around the call, ACKs for received bytes)


def _ifname() -> str | None:
    name = os.environ.get("FP8COMM_LINK_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME", "")
    name = name.split(",")[0].strip()
    return name if name and _tx(name) is not None else None


def _tx(ifname: str) -> int | None:
    """Bytes `ifname` has sent, from /proc/net/dev (per network namespace)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    except OSError:
        pass
    return None


def _link_flag(model, measured) -> str:
    if model is None or measured is None:
        return ""
    return "!" if abs(measured - model) > LINK_TOLERANCE * model + LINK_SLACK else ""


def _has_fp4() -> bool:
    """Whether the fp8comm under test has the 4-bit wire (0.3 and earlier do not: the A/B runs older checkouts)."""
    from fp8comm.comm import FORMATS

    return "mxfp4" in FORMATS


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--min-size", type=_size, default=_size("64K"))
    p.add_argument("--max-size", type=_size, default=_size("256M"))
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--fmt", default="e4m3", choices=("e4m3", "e5m2"))
    p.add_argument("--scales", default="fp32,e8m0", help="FP8 scale encodings to run (fp32, pow2, e8m0)")
    p.add_argument(
        "--fp4",
        default="mxfp4,nvfp4",
        help="4-bit wire formats to run (every op; '' for none)",
    )
    p.add_argument("--hidden", type=int, default=4096, help="token width for all_to_all")
    p.add_argument("--iters", type=int, default=20, help="max timed iterations per row")
    p.add_argument("--target-s", type=float, default=1.0, help="aim for this much timed work per row")
    p.add_argument(
        "--local-size",
        type=int,
        default=None,
        help="ranks per node of the two-level rows ('-2l', beside the flat ones; default: LOCAL_WORLD_SIZE where the "
        "world spans nodes of more than one rank, as the engines decide; 0: flat rows only)",
    )
    p.add_argument("--backend", default="auto", help="quant kernel backend for FP8 rows")
    p.add_argument(
        "--sqnr-ranks",
        default="",
        help="instead of timing: reduce_scatter SQNR table for these world sizes, e.g. 2,3,4",
    )
    p.add_argument("--ef-steps", type=int, default=16, help="steps for the error-feedback table (0: skip)")
    p.add_argument("--json", default="", help="also write every row as JSON lines here")
    p.add_argument(
        "--check-cost-size",
        type=_size,
        default=None,
        help="size for the metadata-check cost lines (default --min-size; 0: skip them)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="kill the ranks after this many seconds")


# ---------------------------------------------------------------------------------------------- launching
def run(args) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist

        dist.init_process_group("gloo")
        _worker_body(args, "table")
        _shutdown()
        dist.destroy_process_group()
        return 0
    if args.sqnr_ranks:
        for w in [int(v) for v in args.sqnr_ranks.split(",") if v]:
            if _spawn(args, w, "sqnr"):
                return 1
        return 0
    return _spawn(args, args.nproc, "table")


def _spawn(args, world: int, mode: str) -> int:
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120)
    )
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, vars(args), mode)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    bad = [p for p in procs if p.is_alive() or p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if bad:
        print(f"# bench comm: {len(bad)} rank(s) failed or timed out")
    return 1 if bad else 0


def _worker(rank: int, world: int, port: int, argd: dict, mode: str) -> None:
    import torch
    import torch.distributed as dist

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        _worker_body(argparse.Namespace(**argd), mode)
    finally:
        _shutdown()
        dist.destroy_process_group()


def _worker_body(args, mode: str) -> None:
    if mode == "sqnr":
        _sqnr_table(args)
    else:
        _table(args)


# ------------------------------------------------------------------------------------------------ helpers
def _say(*a) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(*a, flush=True)


def _sqnr(out, ref) -> float:
    """Global SQNR (dB) of out vs ref over every rank's elements."""
    import torch
    import torch.distributed as dist

    r = ref.double()
    t = torch.tensor([float((r * r).sum()), float(((out.double() - r) ** 2).sum())], dtype=torch.float64)
    dist.all_reduce(t)
    return 10 * math.log10(t[0] / t[1]) if t[1] > 0 else float("inf")


def _timeit(fn, args) -> tuple[float, int, list[float]]:
    """(median seconds per call, iterations, every call's seconds): each call starts after a barrier and counts as
    the slowest rank's time; one warm-up first; iterations fit --target-s (at most --iters), agreed by all ranks."""
    import statistics

    import torch
    import torch.distributed as dist

    fn()  # warm-up (first call may compile kernels)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t1 = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t1, op=dist.ReduceOp.MAX)
    iters = max(1, min(args.iters, int(args.target_s / max(float(t1), 1e-6))))
    ts = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
    dist.all_reduce(ts, op=dist.ReduceOp.MAX)
    times = [float(v) for v in ts]
    return statistics.median(times), iters, times


def _problem(op: str, count: int, world: int, hidden: int, rank: int):
    """(input bf16, fp8 call, plain call factory, analytic wire bytes for itemsize) for one op at `count`."""
    import torch
    import torch.distributed as dist

    import fp8comm.comm as fc
    from fp8comm.comm.core import all_gather_bytes, torch_reduce_scatter

    g = torch.Generator().manual_seed(1234 + rank)
    if op == "all_gather":
        n = count // world
        x = torch.randn(n, generator=g).to(torch.bfloat16)

        def plain_ag(t):
            out = torch.empty(n * world, dtype=t.dtype)
            return lambda: (all_gather_bytes(out, t), out)[1]

        ag_out = torch.empty(n * world, dtype=torch.bfloat16)
        return x, lambda t, **kw: fc.all_gather_into(ag_out, t, **kw), plain_ag, lambda isz: (world - 1) * n * isz
    if op in ("reduce_scatter", "all_reduce"):
        n = count // world * world
        x = torch.randn(n, generator=g).to(torch.bfloat16)
        if op == "reduce_scatter":

            def plain_rs(t):
                out = torch.empty(n // world, dtype=t.dtype)
                return lambda: (torch_reduce_scatter(out, t), out)[1]

            rs_out = torch.empty(n // world, dtype=torch.bfloat16)
            return (
                x,
                lambda t, **kw: fc.reduce_scatter_into(rs_out, t, **kw),
                plain_rs,
                lambda isz: (world - 1) * n // world * isz,
            )

        def plain_ar(t):
            buf = t.clone()  # in place, as torch's all_reduce is; the first call's result is the one compared
            return lambda: (buf.copy_(t), dist.all_reduce(buf), buf)[2]

        ar_out = torch.empty(n, dtype=torch.bfloat16)
        return (
            x,
            lambda t, **kw: fc.all_reduce_into(ar_out, t, **kw),
            plain_ar,
            lambda isz: 2 * (world - 1) * n // world * isz,
        )
    per = max(1, count // hidden // world)
    x = torch.randn(per * world, hidden, generator=g).to(torch.bfloat16)
    splits = [per] * world

    def plain_a2a(t):
        out = torch.empty_like(t)
        return lambda: (dist.all_to_all_single(out, t, splits, splits), out)[1]

    a2a_out = torch.empty_like(x)
    # Given splits (as MoE dispatchers pass them): the piece plan of an unchecked call needs every rank's sizes.
    return (
        x,
        lambda t, **kw: fc.all_to_all(t, splits, splits, out=a2a_out, **kw),
        plain_a2a,
        lambda isz: (world - 1) * per * hidden * isz,
    )


def _ring_call(op: str, x, world: int):
    """The bf16 ring row's call on input x (preallocated output and receive buffers), or None for all_to_all."""
    import torch

    ring = _ring_module()
    if op == "all_gather":
        r = ring.Ring(x.numel() * world, x.dtype)
        out = torch.empty(x.numel() * world, dtype=x.dtype)
        return lambda: r.all_gather(out, x)
    if op == "reduce_scatter":
        r = ring.Ring(x.numel(), x.dtype)
        out = torch.empty(x.numel() // world, dtype=x.dtype)
        return lambda: r.reduce_scatter(out, x)
    if op == "all_reduce":
        r = ring.Ring(x.numel(), x.dtype)
        out = torch.empty_like(x)
        return lambda: r.all_reduce(out, x)
    return None


def _measured(fn, ifname):
    """(fn()'s result, bytes node 0's link sent meanwhile or None): barriers on both sides."""
    import torch.distributed as dist

    if ifname is None:
        return fn(), None
    # Read before the barrier: the node's other ranks leave it first and may send before this rank reads.
    tx0 = _tx(ifname)
    dist.barrier()
    out = fn()
    dist.barrier()
    tx1 = _tx(ifname)
    # and after: a rank through the first barrier would start the next call and its bytes before this read
    dist.barrier()
    return out, (tx1 - tx0 if tx0 is not None and tx1 is not None else None)


def _full_count(op: str, count: int, world: int, hidden: int) -> int:
    """Elements of the buffer the link models count (reduce_scatter/all_reduce input, all_gather output)."""
    if op == "all_to_all":
        return max(1, count // hidden // world) * world * hidden
    return count // world * world


# -------------------------------------------------------------------------------------------- main table
def _table(args) -> None:
    import torch
    import torch.distributed as dist

    import fp8comm.comm as fc

    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's ranks per node; spawned: one node
    ring = _ring_module()
    ifname = _ifname()
    ops = [o for o in args.ops.split(",") if o]
    encs = [e for e in args.scales.split(",") if e]
    fp4s = [f for f in getattr(args, "fp4", "").split(",") if f and _has_fp4()]
    two = args.local_size if args.local_size is not None else (local if 1 < local < world and world % local == 0 else 0)
    hg = fc.node_groups(local_size=two) if two else None
    sizes = []
    s = args.min_size
    while s <= args.max_size:
        sizes.append(s)
        s *= args.factor
    _say(
        f"# fp8comm bench comm  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.node()}  "
        f"{platform.machine()}  cpus={os.cpu_count()}  torch {torch.__version__}  "
        f"fp8comm from {os.path.dirname(os.path.dirname(os.path.abspath(fc.__file__)))}"
    )
    _say(
        f"# world {world} (gloo; fp8comm flat{f' and two-level (-2l rows, {two} ranks/node)' if hg else ''}), "
        f"{args.fmt}, 1x128 blocks; size = bytes of the bf16 buffer; FP8 rows start from bf16 input"
    )
    _say(
        "# time = median per call (barrier before each, slowest rank); algbw = buffer bytes in the row's input "
        "dtype / time; busbw = algbw * nccl-tests factor; SQNR vs the fp32 result"
    )
    _say(
        f"# {world // local if world % local == 0 else '?'} node(s) x {local} ranks (LOCAL_WORLD_SIZE); wire ratios "
        "vs the bf16/fp32 ring's bytes (all_to_all: direct sends); torch's gloo reduce_scatter is a ring "
        f"all-reduce (2x a reduce-scatter's bytes); link counter: {ifname or 'none (not under launch/cluster.py)'}"
    )
    hdr = (
        f"{'op':<15}{'size':>11}{'count':>11}  {'variant':<10}{'time(us)':>12}{'algbw':>8}{'busbw':>8}"
        f"{'wire B/rank':>13}{'vs bf16 ring':>13}{'vs fp32 ring':>13}{'xnode B/node':>14}{'link B/node':>14}"
        f"{'SQNR dB':>9}"
    )
    _say(hdr)
    rows: list = []
    ratios: dict = {}
    speed: list = []
    jf = open(args.json, "a") if (args.json and rank == 0) else None
    for op in ops:
        for size in sizes:
            count = size // 2
            x, fp8, plain, wire_of = _problem(op, count, world, args.hidden, rank)
            nbytes_bf16 = count * 2
            full = _full_count(op, count, world, args.hidden)
            ref = plain(x.float())()  # fp32 result: the reference for SQNR
            ref = ref.clone()
            res = {}
            # torch's gloo reduce_scatter all-reduces a clone: a ring all-reduce's bytes (ProcessGroupGloo)
            torch_factor = 2 if op == "reduce_scatter" else 1
            for dt, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                fn = plain(x.to(dt))
                first, link = _measured(fn, ifname)
                first = first.clone()
                t, it, ts = _timeit(fn, args)
                isz = 2 if dt == torch.bfloat16 else 4
                res[name] = dict(
                    time=t,
                    iters=it,
                    times=ts,
                    wire=wire_of(isz) * torch_factor,
                    sqnr=_sqnr(first.float(), ref),
                    nbytes=nbytes_bf16 * (1 if name == "bf16" else 2),
                    xnode=ring.torch_gloo_link_bytes_per_node(op, full, isz, world, local),
                    link=link,
                    algo="torch gloo" + (" (ring all-reduce)" if op == "reduce_scatter" else ""),
                )
            rfn = _ring_call(op, x, world) if op in RING_OPS else None
            if rfn is not None:
                first, link = _measured(rfn, ifname)
                first = first.clone()
                t, it, ts = _timeit(rfn, args)
                res["bf16-ring"] = dict(
                    time=t,
                    iters=it,
                    times=ts,
                    wire=wire_of(2),  # the ring sends exactly the minimal count
                    sqnr=_sqnr(first.float(), ref),
                    nbytes=nbytes_bf16,
                    xnode=ring.ring_link_bytes_per_node(op, full, 2, world, local),
                    link=link,
                    algo="bf16 ring (NCCL's algorithm on gloo p2p)",
                )
            variants = [("fp8" if e == "fp32" else f"fp8-{e}", dict(fmt=args.fmt, scaling=e)) for e in encs]
            variants += [(f, dict(fmt=f)) for f in fp4s]
            if hg is not None and op != "all_to_all":  # the MoE all_to_all has no two-level form
                variants += [(f"{name}-2l", dict(kw, hierarchical=hg)) for name, kw in variants]
            for name, kw in variants:
                kw["backend"] = args.backend
                fc.reset_comm_stats()
                try:
                    first, link = _measured(lambda fp8=fp8, x=x, kw=kw: fp8(x, **kw), ifname)
                except ValueError as e:  # Fp8CommError (a ValueError; older fp8comm may lack the module)
                    # 4-bit two-level calls and the 4-bit all_to_all arrived in fp8comm 0.5: an older checkout
                    # (an A/B run) refuses them, the same on every rank; say so and go on
                    said = str(e).lower()
                    if name.startswith("fp8") or not ("hierarch" in said or "all_to_all" in said):
                        raise
                    _say(f"# skipped {op} {size} {name} (this fp8comm refuses it): {str(e).splitlines()[0][:160]}")
                    fc.reset_comm_stats()
                    continue
                first = first.clone()  # the output buffer is reused by the timed calls
                st = fc.comm_stats(reset=True)
                wire = sum(v["wire_bytes"] for k, v in st.items() if k.startswith(op))
                base = sum(v["dtype_bytes"] for k, v in st.items() if k.startswith(op))
                t, it, ts = _timeit(lambda fp8=fp8, x=x, kw=kw: fp8(x, **kw), args)
                res[name] = dict(
                    time=t,
                    iters=it,
                    times=ts,
                    wire=wire,
                    sqnr=_sqnr(first.float(), ref),
                    nbytes=nbytes_bf16,
                    stats_dtype_bytes=base,
                    xnode=ring.stats_link_bytes_per_node(st, op, world, local, invocations=1),
                    link=link,
                    algo="fp8comm " + ("two-level" if kw.get("hierarchical") is not None else "flat"),
                )
            for name, v in res.items():
                algbw = v["nbytes"] / v["time"] / 1e9
                ours = name not in BASELINES
                vb = wire_of(2) / v["wire"] if ours else float("nan")
                vf = wire_of(4) / v["wire"] if ours else float("nan")
                if ours:
                    ratios.setdefault(name, []).append((vb, vf))
                v["link_flag"] = _link_flag(v["xnode"], v["link"]) if world > local else ""
                link = "-" if v["link"] is None else f"{v['link']}{v['link_flag']}"
                line = (
                    f"{op:<15}{size:>11}{count:>11}  {name:<10}{v['time'] * 1e6:>12.1f}{algbw:>8.3f}"
                    f"{algbw * BUSBW[op](world):>8.3f}{v['wire']:>13}"
                    + (f"{vb:>12.3f}x{vf:>12.3f}x" if ours else f"{'-':>13}{'-':>13}")
                    + f"{v['xnode']:>14}{link:>14}"
                    + f"{v['sqnr']:>9.1f}"
                )
                _say(line)
                row = dict(op=op, size=size, count=count, variant=name, world=world, local=local, **v)
                rows.append(row)
                if jf:
                    jf.write(json.dumps(row) + "\n")
            speed.append((op, size, {k: v["time"] for k, v in res.items()}))
            del x, ref, res
    for name, rs in ratios.items():
        _say(
            f"# {name}: wire bytes vs bf16 ring {min(r[0] for r in rs):.3f}x..{max(r[0] for r in rs):.3f}x, "
            f"vs fp32 ring {min(r[1] for r in rs):.3f}x..{max(r[1] for r in rs):.3f}x (min..max over sizes; "
            "all_to_all: vs direct sends)"
        )
    for op, size, ts in speed:
        parts = []
        for name, t in ts.items():
            if name in BASELINES:
                continue
            vs = [f"{ts['bf16'] / t:.2f}x vs torch gloo bf16"]
            if "bf16-ring" in ts:
                vs.append(f"{ts['bf16-ring'] / t:.2f}x vs bf16 ring")
            parts.append(f"{name} {', '.join(vs)}")
        if parts:
            _say(f"# speed {op} {size}: " + "; ".join(parts))
    if args.check_cost_size != 0:
        _check_cost(args, ops)
    if args.ef_steps:
        _ef_table(args)
    if jf:
        jf.close()


def _check_cost(args, ops) -> None:
    """Smallest FP8 call with the metadata check on vs off: interleaved trials, medians (the VM is noisy)."""
    import statistics

    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    size = args.check_cost_size or args.min_size
    for op in ops:
        x, fp8, _, _ = _problem(op, size // 2, world, args.hidden, rank)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(max(7, args.iters)):
            for chk in (True, False):
                dist.barrier()
                t0 = time.perf_counter()
                fp8(x, fmt=args.fmt, check=chk)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[chk].append(float(t))
        on, off = statistics.median(times[True]), statistics.median(times[False])
        _say(
            f"# metadata check, {op} at {size} B: median {on * 1e6:.0f} us with, {off * 1e6:.0f} us "
            f"without ({(on - off) * 1e6:+.0f} us; one all_gather of {16 + 2 * world} int64 + host read)"
        )


def _ef_table(args) -> None:
    """A constant gradient reduce-scattered T times: SQNR of one step and of the T-step mean, per option."""
    import torch
    import torch.distributed as dist

    import fp8comm.comm as fc
    from fp8comm.comm.core import torch_reduce_scatter

    world, rank, T = dist.get_world_size(), dist.get_rank(), args.ef_steps
    g = torch.randn(world * 65536, generator=torch.Generator().manual_seed(77 + rank))
    ref = torch.empty(65536)
    torch_reduce_scatter(ref, g.clone())
    _say(f"# error feedback / stochastic rounding: reduce_scatter of a constant fp32 gradient, {T} steps, {args.fmt}")
    _say(f"{'option':<28}{'SQNR step 1':>12}{'SQNR mean':>12}")
    for name, kw in (
        ("nearest", {}),
        ("stochastic", {"rounding": "stochastic"}),
        ("error_feedback", {"error_feedback": fc.ErrorFeedback()}),
        ("e5m2 nearest", {"fmt": "e5m2"}),
        ("e5m2 error_feedback", {"fmt": "e5m2", "error_feedback": fc.ErrorFeedback()}),
    ):
        kw.setdefault("fmt", args.fmt)
        mean, first = torch.zeros(65536, dtype=torch.float64), None
        for _ in range(T):
            o = fc.reduce_scatter(g, **kw).double()
            first = o if first is None else first
            mean += o / T
        _say(f"{name:<28}{_sqnr(first, ref):>12.1f}{_sqnr(mean, ref):>12.1f}")


def _sqnr_table(args) -> None:
    """reduce_scatter SQNR vs the fp32 reference at this world size (1M-element Gaussian gradients)."""
    import torch
    import torch.distributed as dist

    import fp8comm.comm as fc
    from fp8comm.comm.core import torch_reduce_scatter

    world, rank = dist.get_world_size(), dist.get_rank()
    n = (1 << 20) // world * world
    x = torch.randn(n, generator=torch.Generator().manual_seed(5 + rank))
    ref = torch.empty(n // world)
    torch_reduce_scatter(ref, x.clone())
    cols = [(f, e, r) for f in ("e4m3", "e5m2") for e in ("fp32", "e8m0") for r in ("nearest", "stochastic")]
    if world == int(args.sqnr_ranks.split(",")[0]):
        _say(
            "# reduce_scatter SQNR (dB) vs the fp32 sum, 1M-element Gaussian per rank; SUM (AVG is the same "
            "up to the exact /world)"
        )
        _say(f"{'ranks':<7}" + "".join(f"{f + '/' + e + ('/sr' if r == 'stochastic' else ''):>16}" for f, e, r in cols))
    vals = []
    for f, e, r in cols:
        vals.append(_sqnr(fc.reduce_scatter(x, fmt=f, scaling=e, rounding=r, backend=args.backend), ref))
    _say(f"{world:<7}" + "".join(f"{v:>16.2f}" for v in vals))


def main(argv=None) -> int:
    """`python .../comm.py ARGS`: the benchmark of whichever fp8comm is first on the path (A/B against a checkout)."""
    p = argparse.ArgumentParser(prog="comm.py", description=__doc__.splitlines()[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
