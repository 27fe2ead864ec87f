"""The fixed cost of each collective option, timed as a small real call (calibrate()'s last phase, issue 30).

A call costs more than its stages (codec work, wire bytes, a latency per step): on the simulated cluster a quantized
call of 64 KiB took 1.0-3.1 ms (2x2) beyond them, and options differ (each runs its own gloo collectives). Every
option is therefore timed as the engines call it, at SMALL_ELEMS; linkmodel.time charges every call of that option
what the small call took beyond the model's own stages for it.

Real fp8comm calls need registered groups: throwaway ones, made with dist.new_group over the whole world with the
calibration's deadline as their timeout (a peer that stops answering breaks these, never the caller's groups), and
destroyed at the end. dist.new_group is collective over the world and numbers groups by a per-process counter, so
every rank makes the same new_group calls in the same order whatever fails before or during them.

Large calls (large_elems > 0): every option again at a large size (fp8comm calibrate: LARGE_CALL_ELEMS), the
planner's default wires first (LARGE_ORDER), while their timed calls stay within LARGE_BUDGET_S and no rank is
within LARGE_MARGIN_S of the deadline: before each option the ranks agree on both (an all_reduce, the max), so every
rank times the same options. planner.anchored
scales an option's prediction toward its large call: with ranks sharing cores the model's per-stage speeds miss the
calls' contention.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .api import Buffer
from .calibration import WIRE_CONFIGS
from .core import all_gather_bytes, torch_reduce_scatter
from .hierarchical import HierarchicalGroups, destroy_group
from .stats import Stats

# elements of each small call's whole buffer: 64 KiB of bf16, bench comm's smallest row. Smaller calls took longer
# on the simulated cluster (8 KiB: 1.2-2x the 64-256 KiB rows' fixed cost, scheduling on shared cores), and charged
# to every size they made the predictions worse (docs/planner.md, "Each option's own fixed cost")
SMALL_ELEMS = 1 << 15
# elements of each large call's whole buffer (8 MiB of bf16, bench comm's 4M row) and the seconds their timed calls
# may take in all (each option's first call, which may compile, not counted; the deadline still holds)
LARGE_CALL_ELEMS = 1 << 22
LARGE_BUDGET_S = 6.0
LARGE_REPS = 3
# no option's large calls start with less than this left before the deadline: its first call may compile (FP8's
# compiled kernels at a new size: 20-40 s with 8 ranks compiling on 2 cores at once, the simulated cluster)
LARGE_MARGIN_S = 30.0
OPS = ("all_gather", "reduce_scatter", "all_reduce")
CALL_TIMEOUT_S = 5.0  # the throwaway groups' timeout at most: a stuck peer holds the others this long past the deadline
NATIVE = ("bf16", "fp32")  # the engine's own call in these dtypes (torch's gloo collectives)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def key(op: str, algo: str, codec: str) -> str:
    """The name of one option's small-call time: op/algo/codec (algo: gloo, flat or two_level)."""
    return f"{op}/{algo}/{codec}"


def two_level_ok(nodes: Sequence[int]) -> bool:
    """Whether the two-level phases can run on this layout: >= 2 nodes of >= 2 ranks, each node's ranks consecutive."""
    n = max(nodes) + 1
    return n >= 2 and len(nodes) // n >= 2 and list(nodes) == sorted(nodes)


def options(codecs: Sequence[str], nodes: Sequence[int]) -> list[tuple[str, str, str]]:
    """(op, algo, codec) of every option timed, for each op: the engine's own call in bf16 and fp32, each codec flat
    and (where the layout allows) two-level."""
    algos = ("flat", "two_level") if two_level_ok(nodes) else ("flat",)
    out = [(op, "gloo", d) for op in OPS for d in NATIVE]
    return out + [(op, a, c) for op in OPS for c in codecs for a in algos]


def _groups(nodes: Sequence[int], deadline: float) -> tuple[list, list[str]]:
    """Every throwaway group, in one order on every rank: the world, then (two levels) each node's, then each local
    index's across nodes. A creation that fails is recorded and the rest are still made (the counter stays even)."""
    world = len(nodes)
    specs = [list(range(world))]
    if two_level_ok(nodes):
        n, g = max(nodes) + 1, world // (max(nodes) + 1)
        specs += [[i * g + j for j in range(g)] for i in range(n)]
        specs += [[i * g + j for i in range(n)] for j in range(g)]
    made: list = []
    failed: list[str] = []
    for ranks in specs:
        # once one failed the calls are off: the rest are made only to keep the counter even, without waiting
        left = 0.1 if failed else min(CALL_TIMEOUT_S, max(0.1, deadline - time.monotonic()))
        try:
            made.append(dist.new_group(ranks, timeout=datetime.timedelta(seconds=left), backend="gloo"))
        except Exception as e:  # a peer out of time: its rendezvous timed out
            made.append(None)
            failed.append(f"new_group({ranks}): {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    return made, failed


def elems(world: int, n: int = SMALL_ELEMS) -> int:
    """The elements a call's whole buffer holds in a world of `world` ranks (n, default SMALL_ELEMS, whole shards)."""
    return n // world * world


# large calls' order of wires: what the planner weighs by default first (its 4-bit recipe, FP8 with fp32 scales, the
# engine's bf16), then the rest (FP8 with e8m0 scales, the engine's fp32, NVFP4: no default plan picks it), so a slow
# link's budget goes to the options a plan can take
LARGE_ORDER = ("mxfp4", "fp8", "bf16", "fp8_e8m0", "fp32", "nvfp4")


def _large_order(opt: tuple[str, str, str]) -> tuple:
    """Large calls' order: LARGE_ORDER's wires; all-gather, reduce-scatter, all-reduce; flat, two-level."""
    op, algo, codec = opt
    wire = LARGE_ORDER.index(codec) if codec in LARGE_ORDER else len(LARGE_ORDER)
    return wire, OPS.index(op), algo


def time_calls(
    me: int, nodes: Sequence[int], codecs: Sequence[str], reps: int, deadline: float, large_elems: int = 0
) -> dict[str, Any]:
    """{"calls": {key: [seconds of each timed call on this rank]}, "calls_s": seconds} or {"calls_failed": why};
    with large_elems also "large_calls" (the options timed at that size, LARGE_REPS calls each, until the timed calls
    reach LARGE_BUDGET_S or a rank nears the deadline: "large_stop" says which), and "large_failed" (why) where they
    failed: the options finished before stand (every rank passed their last barrier), and so do the small calls.

    Collective over the whole world, group rank == global rank (calibrate() checks); each call starts after a barrier
    of the throwaway world group, as bench comm times its rows; one untimed call per option first. The calls skip
    the metadata check (a group's calls past its first ones run none) and record into a Stats of their own (not
    comm_stats()). The groups time out after CALL_TIMEOUT_S at most (the deadline is checked between calls), and a
    barrier precedes their destruction, so a rank that finishes first does not close a slower one's last call."""
    t0 = time.monotonic()
    made, failed = _groups(nodes, deadline)
    out: dict[str, Any] = {}
    try:
        if failed:
            raise RuntimeError("; ".join(failed))
        world = len(nodes)
        wg = made[0]
        hg = None
        if len(made) > 1:
            n, g = max(nodes) + 1, world // (max(nodes) + 1)
            node, local = divmod(me, g)
            hg = HierarchicalGroups(made[1 + node], made[1 + n + local], n, g, node, local)
        buf = Buffer(wg)
        buf.state.stats = Stats()  # not the process totals: comm_stats() reports the caller's calls only
        gen = torch.Generator().manual_seed(4321 + me)

        def in_time() -> None:
            if time.monotonic() >= deadline:
                raise TimeoutError("calibration deadline passed during the small or large calls")

        def timed(op: str, algo: str, codec: str, n: int, count: int) -> list[float]:
            dt = DTYPES.get(codec, torch.bfloat16)
            full = torch.randn(n, generator=gen).to(dt)
            part = torch.empty(n // world, dtype=dt)
            fn = _native(op, full, part, wg) if algo == "gloo" else _ours(buf, op, algo, codec, full, part, hg)
            in_time()
            fn()  # untimed: first use (scratch, piece plans)
            ts = []
            for _ in range(count):
                in_time()
                dist.barrier(group=wg)
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return ts

        out["calls"] = {key(*o): timed(*o, elems(world), reps) for o in options(codecs, nodes)}
        if large_elems:
            large: dict[str, list[float]] = {}
            out["large_calls"], out["large_elems"] = large, elems(world, large_elems)
            t_large = time.monotonic()
            try:
                state = torch.zeros(2, dtype=torch.float64)
                for o in sorted(options(codecs, nodes), key=_large_order):
                    # the timed calls' seconds so far (first calls may compile: not counted) and whether this rank
                    # is near the deadline (a first call that compiles can take long), every rank's max: one answer
                    state[0] = sum(sum(ts) for ts in large.values())
                    state[1] = float(deadline - time.monotonic() < LARGE_MARGIN_S)
                    # CPU tensors on a gloo group, once per option of a calibration: .item() is no device sync
                    dist.all_reduce(state, op=dist.ReduceOp.MAX, group=wg)
                    out["small_done"] = True  # every rank reached this all_reduce: all finished their small calls
                    if state[1].item() or state[0].item() >= LARGE_BUDGET_S:
                        out["large_stop"] = "deadline" if state[1].item() else "budget"
                        break
                    large[key(*o)] = timed(*o, elems(world, large_elems), LARGE_REPS)
            except Exception as e:  # out of time or a peer gone: the options every rank finished before stand
                out["large_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                raise
            finally:
                out["large_s"] = time.monotonic() - t_large
        dist.barrier(group=wg)  # every rank done with the groups before any destroys them
    except Exception as e:  # a peer that stopped answering, or out of time: these numbers are dropped, never raised
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if out.pop("small_done", False):  # past the large calls' first agreement: the small calls stand everywhere
            out.setdefault("large_failed", why)  # (the last barrier, after them, is what failed otherwise)
        else:
            out.pop("calls", None)
            out.pop("large_calls", None)
            out["calls_failed"] = why
    finally:
        out.pop("small_done", None)
        for pg in reversed(made):
            try:
                if pg is not None:
                    destroy_group(pg)
            except Exception:  # a group a dead peer broke: dropped all the same, nothing to agree on
                pass
    out["calls_s"] = time.monotonic() - t0
    return out


def _native(op: str, full: torch.Tensor, part: torch.Tensor, group: Any):
    """The engine's own call on `group`: torch's all-gather / reduce-scatter / all-reduce of one flat buffer."""
    if op == "all_gather":
        return lambda: all_gather_bytes(full, part, group)
    if op == "all_reduce":
        buf = full.clone()
        return lambda: (buf.copy_(full), dist.all_reduce(buf, group=group))
    return lambda: torch_reduce_scatter(part, full, group=group)


def _ours(buf: Buffer, op: str, algo: str, codec: str, full: torch.Tensor, part: torch.Tensor, hg):
    """fp8comm's call of one option, as the engines make it (no metadata check: a group's later calls run none)."""
    kw = dict(WIRE_CONFIGS[codec], check=False, hierarchical=hg if algo == "two_level" else None)
    if op == "all_gather":
        return lambda: buf.all_gather_into(full, part, **kw)
    if op == "all_reduce":
        out = torch.empty_like(full)
        return lambda: buf.all_reduce_into(out, full, **kw)
    return lambda: buf.reduce_scatter_into(part, full, **kw)
