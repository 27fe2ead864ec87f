"""Calibration at run time (issue 30 item 1): every rank of a group times its links and its codecs, rank 0 decides
from what every rank measured and publishes one `Calibration` through the c10d store, so every rank holds the same
numbers; a calibration that cannot finish in time falls back, on every rank alike, with one warning.

What is timed (on every rank, at once, as a collective would load the machine):
- node-local: an exchange (send and receive at once, both directions) with a node-mate (local index i ^ 1) at two
  sizes; bandwidth from the difference (the fixed cost cancels), latency from the small one (see "latency" below);
- cross-node: the same with the rail peer (same local index on node n ^ 1), all rail pairs of a node at once (every
  exchange starts after a barrier; beyond two rails per node they share the large size, rail_sizes, so a window
  stays short on a slow link): a node's figure is all its rail bytes over the window until its last rail
  exchange ends (Calibration.inter is a node's cross-node bandwidth, all its NICs; a sum of the ranks' own rates
  would count a pair that finished early and left the link to the others twice);
- codecs: pack and unpack_sum of each codec at two sizes (calibration.measure_codecs; the fixed cost per kernel
  call from the two, both below the kernel switch at dispatch.COMPILE_MIN_NUMEL), then again at the two
  LARGE_ELEMS with every rank at once after a barrier (calls long enough to overlap; on CPU FP8's compiled kernel,
  whose first calls compile): CodecSpeed.above for calls of the smaller one and more, with its own fixed cost;
  unpack is set to unpack_sum's speed and error feedback's residual to unpack's (not timed: the start-up budget);
- call_overhead: one metadata check's all_gather (16 + 2 x world int64), timed on the private group, one per
  window, every rank's pooled, the median: the fixed cost the model charges each quantized call. The check itself
  runs only on a group's first calls of each op under the default policy ("first"); later calls pay a fixed cost
  of about its size all the same (their own collectives' calls: docs/planner.md, "What call_overhead stands for").
- small calls (small_calls=True, a calibration of the whole world only): every option (the engine's own all-gather,
  reduce-scatter and all-reduce in bf16 and fp32, each codec flat and two-level) timed as a real call of
  smallcalls.SMALL_ELEMS elements on throwaway groups (smallcalls): Calibration.small_calls, which the model
  prefers to call_overhead per option; with large_call_elems the options again at that size (the planner's default
  wires first, within smallcalls.LARGE_BUDGET_S, agreed on every rank): Calibration.large_calls, toward which
  planner.anchored scales each option's prediction above the small size.
Rank 0 keeps the SLOWEST per level (the node-local link of the slowest rank, the cross-node bandwidth of the slowest
node) and each codec's slowest rank: a collective step ends when its slowest member does, so a plan from the typical
rank would promise what the collective cannot deliver.
The small-size figures are the exception (latency, call_overhead, the codecs' fixed cost per call: the ranks' median).
Latency: every rank's small samples pooled, the median, less their bytes; node-local from one
node-mate exchange per window after a barrier, cross-node from a ring pass over the group at the small size (send to
the next group rank, receive from the previous, world - 1 steps per window: a ring collective's own steps). On shared
hosts a small exchange either takes its link's time or stalls for milliseconds (the simulated cluster, 2026-12-04:
0.1-0.4 ms, or 2-4 ms in a third of the windows or more); the slowest rank's median (or a node's slowest rail per
window) landed on the stalls, 1.7-3.7 ms per step where the bench's ring steps took 0.3-0.8 ms, and exchanges back to
back (a burst) stalled more often (0.7-2.4 ms per exchange).

Transfers run on a private gloo group built on this calibration's own store prefix (not registered with
torch.distributed, no group names to agree on), with CPU tensors: a peer that stops answering breaks that group's
connections only (gloo closes a pair whose wait timed out), never the caller's groups. Only gloo groups are
calibrated: an NCCL group's links are NCCL's own transfers, which this does not time (yet).

Agreement (no split decision, no hang): every step that needs all ranks is waited for with one deadline
(timeout_s from the call); each outcome is one store key written with compare_set (the first writer wins) and read
back by everyone: rank 0 writes "go" (all ranks arrived), the result, or "fallback: <why>"; a rank whose deadline
passes first writes "fallback: <why>" into the same key. Whatever the key holds is what every rank does. On
fallback calibrate() returns None on every rank with exactly one CalibrationWarning carrying the same text: the
caller keeps its fixed choice (the wire it was configured with). Bad arguments, ranks that called with different
arguments, and a layout with uneven ranks per node are errors (Fp8CommConfigError) on every rank, before any bytes
move between ranks.

For tests only: FP8COMM_CALIBRATE_STALL="<group rank>:<phase>:<seconds>" makes that rank sleep before `phase`
(ready: before it announces itself; links: after the start, before the transfers; codecs: before the codec timing;
calls: before the small calls).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import Fp8CommConfigError
from ..quant.dispatch import COMPILE_MIN_NUMEL
from . import smallcalls, topology
from .calibration import WIRE_CONFIGS, Calibration, Link, device_kind, measure_codecs
from .linkmodel import CodecSpeed

STALL_ENV = "FP8COMM_CALIBRATE_STALL"
PHASES = ("ready", "links", "codecs", "calls")
SIZES = (16 << 10, 2 << 20)  # bytes per exchange: small (latency), large (bandwidth, from the difference)
CODEC_ELEMS = (1 << 14, 1 << 18)  # elements per codec call, small and large: both below COMPILE_MIN_NUMEL
TAG = 0xCA1  # point-to-point tag on the private group
# codecs timed at these sizes too, every rank at once: large calls' kernel (from COMPILE_MIN_NUMEL), at two sizes
# for its own fixed cost per call (the compiled FP8 kernel: about 0.2-0.3 ms a call whatever its size)
LARGE_ELEMS = (COMPILE_MIN_NUMEL, 1 << 21)
SMALL_REPS = 5  # windows of one small exchange (and of check gathers) per rep of the large exchange
RAIL_SHARE = 2  # a node's rail exchanges move at most RAIL_SHARE x the large size together (rail_sizes)
_POLL_S = 0.005
_epochs: dict[tuple[int, ...], int] = {}


class CalibrationWarning(UserWarning):
    """A calibration that could not finish; the caller keeps its fixed choice."""


def _err(msg: str) -> Fp8CommConfigError:
    return Fp8CommConfigError(f"calibrate: {msg}")


def calibrate(
    group: Any = None,
    *,
    nodes: Sequence[int] | None = None,
    codecs: Sequence[str] = tuple(WIRE_CONFIGS),
    sizes: tuple[int, int] = SIZES,
    codec_elems: tuple[int, int] = CODEC_ELEMS,
    reps: int = 3,
    timeout_s: float = 30.0,
    store: Any = None,
    report: dict | None = None,
    small_calls: bool = False,
    large_call_elems: int = 0,
) -> Calibration | None:
    """Measure and agree on one Calibration for `group` (None: the world); collective over the group's members.

    nodes: the node index of each member in group rank order (default: fp8comm.comm.topology's rule from every
    member's GROUP_RANK / LOCAL_WORLD_SIZE / host name); sizes: bytes per link exchange (small, large); codec_elems:
    elements per codec call (small, large); reps: timed repetitions per size (the median is kept); timeout_s: the
    whole calibration's deadline; store: the c10d store to agree through (default: the default group's);
    small_calls: also time every option as a small real call (smallcalls; a group spanning the whole world only, and
    about 1-5 s more on the simulated cluster: `fp8comm calibrate` ahead of time does, the engines' start does not);
    large_call_elems: with small_calls, also time the options as real calls of this many elements (> the small
    calls'; smallcalls.LARGE_CALL_ELEMS in `fp8comm calibrate`; 0: not; needs timeout_s >= 2 x LARGE_MARGIN_S),
    their timed calls at most smallcalls.LARGE_BUDGET_S.
    Returns the identical Calibration on every rank, or None on every rank (with one CalibrationWarning) when it
    could not finish in time. `report`, when given, receives rank 0's published details: every rank's raw numbers,
    the seconds each phase took (first codec calls, the compiles, apart) and the rule that decided."""
    t_start = time.monotonic()
    deadline = t_start + timeout_s
    if not dist.is_available() or not dist.is_initialized():
        raise _err("torch.distributed is not initialized; call dist.init_process_group first")
    if dist.get_backend(group) != "gloo":
        raise _err(
            f"only gloo groups are calibrated; this group runs {dist.get_backend(group)!r} (NCCL's links are its own "
            "transfers, which calibrate() does not time yet): give a gloo group or a calibration file"
        )
    sizes = _pair(sizes, "sizes")
    codec_elems = _pair(codec_elems, "codec_elems")
    if (problem := codec_elems_problem(codec_elems)) is not None:
        raise _err(f"codec_elems: {problem}")
    bad = [c for c in codecs if c not in WIRE_CONFIGS]
    if bad or not codecs:
        raise _err(f"codecs must name some of {', '.join(WIRE_CONFIGS)}; got {list(codecs)}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise _err(f"reps must be an int >= 1, got {reps!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise _err(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    members = topology.group_ranks(group)
    world = len(members)
    if world < 2:
        raise _err("a calibration needs a group of >= 2 ranks (links are timed between ranks)")
    if nodes is not None and len(nodes) != world:
        raise _err(f"nodes gives {len(nodes)} node indices for a group of {world} ranks")
    if small_calls and members != tuple(range(dist.get_world_size())):
        raise _err(
            f"small_calls=True needs a group of the whole world in rank order (its throwaway groups are made with "
            f"dist.new_group, collective over the world); this group has ranks {list(members)}"
        )
    if large_call_elems:
        ok = isinstance(large_call_elems, int) and not isinstance(large_call_elems, bool)
        if not ok or large_call_elems <= smallcalls.elems(world) * 2 or not small_calls:
            raise _err(
                f"large_call_elems must be an int > 2 x the small calls' {smallcalls.elems(world)} elements, with "
                f"small_calls=True (the model scales between the two sizes); got {large_call_elems!r} with "
                f"small_calls={small_calls!r}"
            )
        if timeout_s < 2 * smallcalls.LARGE_MARGIN_S:
            raise _err(
                f"large_call_elems needs timeout_s >= {2 * smallcalls.LARGE_MARGIN_S:g} s (no large call starts with "
                f"less than {smallcalls.LARGE_MARGIN_S:g} s left: a first call may compile); got {timeout_s:g}"
            )
    me = members.index(dist.get_rank())
    epoch = _epochs.get(members, 0)
    _epochs[members] = epoch + 1
    base = store if store is not None else dist.distributed_c10d._get_default_store()
    tag = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:12]
    kv = dist.PrefixStore(f"fp8comm-calibrate/{tag}/{epoch}/", base)
    args = json.dumps(
        {
            "codecs": list(codecs),
            "sizes": sizes,
            "codec_elems": codec_elems,
            "reps": reps,
            "nodes": nodes,
            "small_calls": bool(small_calls),  # a Python flag into the arguments' JSON (no tensor), once per call
            "large_call_elems": int(large_call_elems),
        }
    )

    # ---- start: every member announces itself; rank 0 says go (with the node layout), or fallback, or error
    _stall(me, "ready")
    facts = topology._local_facts()
    kv.set(f"ready/{me}", json.dumps({"facts": facts, "args": args}))
    if me == 0:
        missing = _wait(kv, [f"ready/{i}" for i in range(world)], deadline)
        if missing:
            start = f"fallback: group rank(s) {_ids(missing)} did not arrive within {timeout_s:g} s"
        else:
            start = _start(kv, world, members, args, nodes)
        start = _decide(kv, "start", start)
    else:
        start = _await(kv, "start", deadline + _grace(timeout_s), f"no start from rank 0 within {timeout_s:g} s", me)
    if start.startswith("error: "):
        raise _err(start[len("error: ") :])
    if start.startswith("fallback: "):
        _fallback(start, report)
        return None
    layout = json.loads(start[len("go: ") :])
    t_go = time.monotonic()

    # ---- measure: links on a private gloo group, then codecs; any failure is reported, never raised
    mine: dict[str, Any] = {"rank": me}
    pg: Any = None
    try:
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore("pg/", kv), me, world, datetime.timedelta(seconds=max(0.1, deadline - time.monotonic()))
        )
        _stall(me, "links")
        t0 = time.monotonic()
        mine["links"] = _time_links(pg, me, layout["nodes"], sizes, reps, deadline)
        mine["links_s"] = time.monotonic() - t0
        _stall(me, "codecs")
        t0 = time.monotonic()
        timings: dict = {}
        speeds = measure_codecs(codecs, elems=codec_elems, reps=reps, kinds=("pack", "unpack_sum"), timings=timings)
        mine["codecs"] = {k: [s.pack, s.unpack_sum] for k, s in speeds.items()}
        mine["codec_fixed"] = {k: s.fixed for k, s in speeds.items()}
        # every codec again at LARGE_ELEMS, all ranks at once after a barrier: calls long enough to overlap (ranks
        # sharing cores slow each other, as in a collective), with the kernel a large call runs (CPU FP8: the
        # compiled one from COMPILE_MIN_NUMEL, the torch reference below; its first calls compile)
        if codec_elems[1] < LARGE_ELEMS[0]:
            pg.barrier().wait(datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
            big = measure_codecs(codecs, elems=LARGE_ELEMS, reps=reps, kinds=("pack", "unpack_sum"), timings=timings)
            mine["codecs_large"] = {k: [LARGE_ELEMS[0], s.pack, s.unpack_sum, s.fixed] for k, s in big.items()}
        mine["codecs_s"] = time.monotonic() - t0
        mine["first_calls_s"] = sum(t["first_call_s"] for t in timings.values())
        mine["kernel"] = next(iter(speeds.values())).source
    except Exception as e:  # a peer that stopped answering (gloo: timed out, connection closed), or out of time
        mine["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        del pg  # closes this calibration's connections; the caller's groups are untouched
    if small_calls:  # every rank past "go" alike, whatever failed above (smallcalls: the world's group counter)
        _stall(me, "calls")
        # they stop short of the deadline: out of time they are dropped and the calibration stands without them
        mine |= smallcalls.time_calls(
            me, layout["nodes"], codecs, SMALL_REPS * reps, deadline - _grace(timeout_s), large_call_elems
        )
    kv.set(f"result/{me}", json.dumps(mine))

    # ---- decide: rank 0 builds the calibration from everyone's numbers, or falls back; everyone reads the key
    if me == 0:
        missing = _wait(kv, [f"result/{i}" for i in range(world)], deadline)
        if missing:
            out = f"fallback: group rank(s) {_ids(missing)} did not finish within {timeout_s:g} s"
        else:
            rows = [json.loads(kv.get(f"result/{i}")) for i in range(world)]
            failed = [f"{r['rank']} ({r['failed']})" for r in rows if "failed" in r]
            if failed:
                out = f"fallback: measurement failed on group rank(s) {'; '.join(failed)}"
            else:
                times = {"go_s": t_go - t_start, "decided_s": time.monotonic() - t_start}
                out = "ok: " + json.dumps(_build(rows, layout["nodes"], sizes, world, times))
        final = _decide(kv, "decided", out)
    else:
        final = _await(kv, "decided", deadline + _grace(timeout_s), f"no result from rank 0 within {timeout_s:g} s", me)
    if final.startswith("fallback: "):
        _fallback(final, report)
        return None
    payload = json.loads(final[len("ok: ") :])
    if report is not None:
        report.update(payload["report"])
    return Calibration.from_dict(payload["calibration"])


# ------------------------------------------------------------------------------------------------ agreement
def _pair(v: Any, name: str) -> tuple[int, int]:
    ok = (
        isinstance(v, (tuple, list))
        and len(v) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
        and v[0] < v[1]
    )
    if not ok:
        raise _err(f"{name} must be (small, large) positive ints with small < large, got {v!r}")
    return int(v[0]), int(v[1])


def codec_elems_problem(codec_elems: tuple[int, int]) -> str | None:
    """Why two codec timing sizes cannot give one kernel's speed and fixed cost (None: they can): on CPU the kernel
    switches at dispatch.COMPILE_MIN_NUMEL, and the intercept of two kernels' timings is neither one's."""
    if codec_elems[0] < COMPILE_MIN_NUMEL <= codec_elems[1]:
        return (
            f"{codec_elems[0]} and {codec_elems[1]} elements straddle the CPU kernel switch at {COMPILE_MIN_NUMEL} "
            "(the torch reference below, the compiled kernel from there): give both sizes below it, or both at or above"
        )
    return None


def _grace(timeout_s: float) -> float:
    """How much longer than rank 0 the others wait for its word (rank 0 decides at its own deadline)."""
    return min(2.0, 0.25 * timeout_s)


def _ids(keys: list[str]) -> str:
    return ", ".join(k.rsplit("/", 1)[1] for k in keys)


def _wait(kv: Any, keys: list[str], deadline: float) -> list[str]:
    """The keys still missing at the deadline ([] as soon as all are there); polls check(), which never blocks."""
    while True:
        if kv.check(keys):
            return []
        if time.monotonic() >= deadline:
            return [k for k in keys if not kv.check([k])]
        time.sleep(_POLL_S)


def _decide(kv: Any, key: str, value: str) -> str:
    """Write `value` unless someone wrote first; returns what the key holds (the one outcome for everyone)."""
    return bytes(kv.compare_set(key, "", value)).decode()


def _await(kv: Any, key: str, deadline: float, why: str, me: int) -> str:
    if _wait(kv, [key], deadline):
        return _decide(kv, key, f"fallback: group rank {me} had {why}")
    return bytes(kv.get(key)).decode()


def _fallback(text: str, report: dict | None) -> None:
    warnings.warn(
        f"fp8comm calibration did not finish, keeping the fixed choice: {text[len('fallback: ') :]}",
        CalibrationWarning,
        stacklevel=3,
    )
    if report is not None:
        report["fallback"] = text[len("fallback: ") :]


def _start(kv: Any, world: int, members: tuple[int, ...], args: str, nodes: Sequence[int] | None) -> str:
    """Rank 0's start decision from every member's announcement: 'go: {layout}' or 'error: why'."""
    got = [json.loads(kv.get(f"ready/{i}")) for i in range(world)]
    differ = [i for i, g in enumerate(got) if g["args"] != args]
    if differ:
        return f"error: group rank(s) {differ} called calibrate() with other arguments than rank 0 ({args})"
    if nodes is None:
        table = topology.table_from([tuple(g["facts"]) for g in got])
        lws = topology._int(got[0]["facts"][1])
        if table.source == topology.LAYOUT and lws:  # node-major in GLOBAL ranks (a subgroup's need not start at 0)
            nodes = [m // lws for m in members]
        else:
            nodes = list(table.nodes)
    order = list(dict.fromkeys(nodes))
    count = {n: list(nodes).count(n) for n in order}
    if len(set(count.values())) != 1:
        return (
            f"error: uneven ranks per node {count} (node of each group rank: {list(nodes)}); a calibration holds one "
            "ranks-per-node layout"
        )
    return "go: " + json.dumps({"nodes": [order.index(n) for n in nodes]})


def _stall(me: int, phase: str) -> None:
    spec = os.environ.get(STALL_ENV, "")
    if not spec:
        return
    try:
        rank, ph, secs = spec.split(":")
        if ph not in PHASES:
            raise ValueError(ph)
        if int(rank) == me and ph == phase:
            time.sleep(float(secs))
    except ValueError:
        raise _err(f"{STALL_ENV}={spec!r}: expected <group rank>:<{'|'.join(PHASES)}>:<seconds>") from None


# ------------------------------------------------------------------------------------------------ links
def _peers(me: int, nodes: Sequence[int]) -> dict[str, int | None]:
    """This rank's partner per level: node-mate (local index ^ 1), rail peer (same local index, node ^ 1)."""
    mine = [i for i, n in enumerate(nodes) if n == nodes[me]]
    local = mine.index(me)
    n_nodes = max(nodes) + 1
    mate = local ^ 1
    rail = nodes[me] ^ 1
    return {
        "intra": mine[mate] if mate < len(mine) else None,
        "inter": [i for i, n in enumerate(nodes) if n == rail][local] if rail < n_nodes else None,
    }


def _per_node(nodes: Sequence[int]) -> int:
    """Ranks per node of a node layout (node index per rank)."""
    return len(nodes) // (max(nodes) + 1)


def rail_sizes(sizes: tuple[int, int], per_node: int) -> tuple[int, int]:
    """Bytes of one rail exchange (small, large): the large one shared by the node's rails beyond RAIL_SHARE of
    them (all cross the node's one link at once: at 2x4 and 200 Mbit/s four rails of 2 MiB are 8 MiB, about 0.34 s
    a window)."""
    return sizes[0], max(sizes[0], min(sizes[1], sizes[1] * RAIL_SHARE // max(per_node, 1)))


def _time_links(
    pg: Any, me: int, nodes: Sequence[int], sizes: tuple[int, int], reps: int, deadline: float
) -> dict[str, list[list[float]] | None]:
    """{level: [[seconds of each timed exchange at the small size], [... at the large size]] or None (no partner)}.
    Every exchange starts after a barrier of the private group, so all pairs of a level run at once and a node's
    rail pairs start together (rank 0 times a node's cross-node window from the last of them to finish); every rank
    takes part in every barrier, with a partner or not."""
    peers = _peers(me, nodes)
    by_level = {"intra": sizes, "inter": rail_sizes(sizes, _per_node(nodes))}
    bufs = [(torch.empty(s, dtype=torch.uint8), torch.empty(s, dtype=torch.uint8)) for s in sizes]
    out: dict[str, list[list[float]] | None] = {}

    def wait(work: Any) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("calibration deadline passed during the link timing")
        work.wait(datetime.timedelta(seconds=left))

    def exchange(peer: int, a: torch.Tensor, b: torch.Tensor, src: int | None = None) -> None:
        # a to peer, b from src (default: the same peer) at once
        r = pg.recv([b], peer if src is None else src, TAG)
        s = pg.send([a], peer, TAG)
        wait(r)
        wait(s)

    for level in ("intra", "inter"):
        peer = peers[level]
        wait(pg.barrier())
        if peer is not None:
            exchange(peer, *bufs[0])  # untimed: first use of the pair
        times: list[list[float]] = []
        for i, (a, b) in enumerate((x[:n], y[:n]) for (x, y), n in zip(bufs, by_level[level])):
            # the small size in SMALL_REPS x reps windows (cheap; latency is noisy on shared cores), one exchange
            # each: back to back they stall more often than the collectives' steps do (module docstring)
            ts = []
            for _ in range(SMALL_REPS * reps if i == 0 else reps):
                wait(pg.barrier())
                t0 = time.perf_counter()
                if peer is not None:
                    exchange(peer, a, b)
                ts.append(time.perf_counter() - t0)
            times.append(ts)
        out[level] = times if peer is not None else None
    # a ring pass at the small size (group rank order, node-major: one crossing per node boundary and step), as a ring
    # collective's steps run: the per-step time, the cross-node latency's source where the group spans nodes
    world = len(nodes)
    a, b = bufs[0]
    nxt, prv = (me + 1) % world, (me - 1) % world
    ring = []
    for _ in range(SMALL_REPS * reps):
        wait(pg.barrier())
        t0 = time.perf_counter()
        for _ in range(world - 1):
            exchange(nxt, a, b, src=prv)
        ring.append((time.perf_counter() - t0) / (world - 1))
    out["ring"] = [ring]
    # the metadata check every quantized call makes (fp8comm.comm.checks): one all_gather of (16 + 2*world) int64
    mine = torch.zeros(16 + 2 * world, dtype=torch.int64)
    table = [[torch.empty_like(mine) for _ in range(world)]]
    wait(pg.allgather(table, [mine]))  # untimed: first use
    check = []
    for _ in range(SMALL_REPS * reps):  # one gather per window, as the latency's exchanges
        wait(pg.barrier())
        t0 = time.perf_counter()
        wait(pg.allgather(table, [mine]))
        check.append(time.perf_counter() - t0)
    out["check"] = [check]
    wait(pg.barrier())
    return out


def _link(t: Sequence[float], sizes: tuple[int, int], count: int = 1) -> tuple[float, float]:
    """(bandwidth B/s, latency s) from the seconds of an exchange of `count` x sizes[0] and of `count` x sizes[1]
    bytes: bandwidth from the difference, latency what the small exchange takes beyond its bytes; the large size's
    own rate where the difference is not positive."""
    ts, tl = t
    small, large = count * sizes[0], count * sizes[1]
    bw = (large - small) / (tl - ts) if tl > ts else large / tl
    return bw, max(0.0, ts - small / bw)


def _build(rows: list[dict], nodes: Sequence[int], sizes: tuple[int, int], world: int, times: dict) -> dict:
    """Rank 0's decision: the slowest per level and per codec (see the module's docstring), as published JSON.
    Node-local: each rank's link from its median exchanges. Cross-node: per node, each rep's window is the slowest
    of its rail exchanges (they started together after a barrier), the node's bytes are all of them. Latency per
    level: every rank's small samples pooled (node-local exchanges, cross-node ring steps), the median, less their
    bytes (the per-rank and per-node latencies in the report are the pair exchanges', kept to show the spread)."""
    n_nodes, per_node = max(nodes) + 1, _per_node(nodes)
    med = statistics.median

    rails_sz = rail_sizes(sizes, per_node)  # what each cross-node exchange moved (_time_links)

    def rank_link(r: dict, level: str) -> tuple[float, float] | None:
        t = r["links"][level]
        return _link([med(t[0]), med(t[1])], rails_sz if level == "inter" else sizes) if t is not None else None

    ranks: list[dict[str, Any]] = [
        {"rank": i, "node": nodes[i], "intra": rank_link(r, "intra"), "inter": rank_link(r, "inter")}
        for i, r in enumerate(rows)
    ]
    node_links: list[dict[str, Any]] = []
    for n in range(n_nodes):
        rails = [r["links"]["inter"] for i, r in enumerate(rows) if nodes[i] == n and r["links"]["inter"] is not None]
        if rails:
            window = [med(max(t[k][j] for t in rails) for j in range(len(rails[0][k]))) for k in (0, 1)]
            node_links.append({"node": n, "rails": len(rails), "inter": _link(window, rails_sz, len(rails))})
    notes = []
    intra = inter = None
    # latency: the median of every rank's small samples, pooled, less their bytes at the level's (slowest) bandwidth:
    # node-local from the node-mate exchanges, cross-node from the ring pass's steps (one crossing per node and step)
    pooled = {
        lv: [x for r in rows if r["links"].get(lv) is not None for x in r["links"][lv][0]] for lv in ("intra", "ring")
    }
    latency: dict[str, dict[str, Any]] = {}

    def lat(level: str, samples: str, bw: float) -> float:
        m = med(pooled[samples])
        latency[level] = {"from": samples, "median_s": m, "samples": len(pooled[samples]), "bytes_s": sizes[0] / bw}
        return max(0.0, m - sizes[0] / bw)

    got: list[tuple[float, float]] = [x["intra"] for x in ranks if x["intra"] is not None]
    if got:
        bw = min(b for b, _ in got)
        intra = Link(bw, lat("intra", "intra", bw))
    if node_links:
        bw = min(x["inter"][0] for x in node_links)
        inter = Link(bw, lat("inter", "ring", bw))
    if inter is None:  # one node
        assert intra is not None
        inter = Link(intra.bandwidth * per_node, intra.latency)
        notes.append("one node: cross-node link not measured, set to the node-local one (x ranks per node)")
    if intra is None:  # one rank per node
        intra = Link(inter.bandwidth, inter.latency)
        notes.append("one rank per node: node-local link not measured, set to the cross-node one")
    codecs = {}
    for name in rows[0]["codecs"]:
        pack = min(r["codecs"][name][0] for r in rows)
        usum = min(r["codecs"][name][1] for r in rows)
        # the fixed cost per call is a small-size figure (the intercept of two short timings): the ranks' median, as
        # the latencies (a rank whose short calls met a stall read 1.4-5.5 ms where the others read 0.3-0.5)
        fixed = med([r.get("codec_fixed", {}).get(name, 0.0) for r in rows])
        src = (
            f"calibrate: slowest of {world} ranks, pack and unpack_sum timed at two sizes (unpack set to unpack_sum, "
            "residual to unpack: not timed), fixed cost per kernel call from the two sizes (the ranks' median)"
        )
        codecs[name] = CodecSpeed(pack, usum, usum, src, fixed=fixed)
        big = [r["codecs_large"][name] for r in rows if name in r.get("codecs_large", {})]
        if big:  # calls of >= LARGE_ELEMS[0]: the speeds timed at two sizes from there, every rank at once
            lp, lu = min(b[1] for b in big), min(b[2] for b in big)
            lf = med([b[3] if len(b) > 3 else 0.0 for b in big])  # its fixed cost: the ranks' median, as above
            src_big = (
                f"calibrate: slowest of {world} ranks, calls >= {big[0][0]} elements: timed at two sizes from there, "
                "every rank at once (the kernel large calls run), fixed cost per call the ranks' median"
            )
            codecs[name] = replace(codecs[name], above=(int(big[0][0]), CodecSpeed(lp, lu, lu, src_big, fixed=lf)))
    # the metadata check's gather every quantized call adds: every rank's single gathers pooled, the median (the
    # latency's rule: a host's stalls are not the call's cost); Python's own cost per call is not in it
    checks = [x for r in rows if r["links"].get("check") for x in r["links"]["check"][0]]
    call_overhead = med(checks) if checks else 0.0
    latency["check"] = {"from": "check", "median_s": call_overhead, "samples": len(checks)}
    # each option's small real call (smallcalls): every call's slowest rank (a collective ends with its last member,
    # as bench comm counts a row), the median over the calls; none where any rank's calls failed (said in the notes)
    small: dict[str, float] = {}
    dropped = [f"{r['rank']} ({r['calls_failed']})" for r in rows if "calls_failed" in r]
    if dropped:
        notes.append(f"small calls not timed (call_overhead stands for them): failed on rank(s) {'; '.join(dropped)}")
    elif all("calls" in r for r in rows):
        for k in rows[0]["calls"]:
            small[k] = med([max(r["calls"][k][i] for r in rows) for i in range(len(rows[0]["calls"][k]))])
    # the large calls likewise, the options every rank finished (the same on every rank unless one failed mid-way)
    large: dict[str, float] = {}
    if small and all("large_calls" in r for r in rows):
        keys = [k for k in rows[0]["large_calls"] if all(k in r["large_calls"] for r in rows)]
        for k in keys:
            n = min(len(r["large_calls"][k]) for r in rows)
            large[k] = med([max(r["large_calls"][k][i] for r in rows) for i in range(n)])
        lost = [f"{r['rank']} ({r['large_failed']})" for r in rows if "large_failed" in r]
        stop = next((r["large_stop"] for r in rows if "large_stop" in r), "")
        why = (
            f"failed on rank(s) {'; '.join(lost)}"
            if lost
            else f"a rank had less than {smallcalls.LARGE_MARGIN_S:g} s left"
            if stop == "deadline"
            else f"their timed calls reached {smallcalls.LARGE_BUDGET_S:g} s"
        )
        if len(large) < len(small):
            notes.append(
                f"large calls: {len(large)} of {len(small)} options timed ({why}; the rest: the model alone above "
                "the small calls)"
            )
    spent = {
        "links_s": max(r["links_s"] for r in rows),
        "codecs_s": max(r["codecs_s"] for r in rows),
        "first_calls_s": max(r["first_calls_s"] for r in rows),
    }
    if any("calls_s" in r for r in rows):
        spent["calls_s"] = max(r.get("calls_s", 0.0) for r in rows)
    if any("large_s" in r for r in rows):
        spent["large_calls_s"] = max(r.get("large_s", 0.0) for r in rows)
    spent |= times
    spent["without_first_calls_s"] = spent["decided_s"] - spent["first_calls_s"]
    cal = Calibration(
        inter=inter,
        intra=intra,
        codecs=codecs,
        device=device_kind("cpu"),
        ranks_per_node=per_node,
        backend="gloo",
        world_size=world,
        call_overhead=call_overhead,
        small_calls=small,
        small_call_elems=smallcalls.elems(world) if small else 0,
        large_calls=large,
        large_call_elems=rows[0]["large_elems"] if large else 0,
        source=(
            f"fp8comm calibrate, {time.strftime('%Y-%m-%d %H:%M')}: {n_nodes} node(s) x {per_node} ranks, gloo, "
            f"exchanges of {sizes[0]} and {sizes[1]} bytes ({rails_sz[1]} per rail across nodes), slowest rank / node "
            "per level"
        ),
        notes=(
            *notes,
            "node_local_cap not measured (None); call_overhead: the metadata check's all_gather of (16 + 2 x world) "
            f"int64 ({call_overhead * 1e6:.0f} us), not Python's own cost per call",
            f"time: {spent['decided_s']:.2f} s in all, {spent['first_calls_s']:.2f} s of it first codec calls "
            f"(compiles, caches); links {spent['links_s']:.2f} s, codecs {spent['codecs_s']:.2f} s"
            + (f", small calls {spent['calls_s']:.2f} s" if "calls_s" in spent else "")
            + (f" (of it large calls {spent['large_calls_s']:.2f} s)" if "large_calls_s" in spent else ""),
        ),
    )
    report = {
        "seconds": spent,
        "rule": "slowest: node-local link of the slowest rank, cross-node bandwidth of the slowest node (all its rail "
        "exchanges at once, timed to the last one), each codec's slowest rank; latency per level: the median of every "
        "rank's small samples, pooled, less their bytes (node-local: node-mate exchanges; cross-node: ring steps)",
        "latency": latency,
        "ranks": [
            x | {k: r.get(k, {}) for k in ("codecs", "codec_fixed", "codecs_large")} for x, r in zip(ranks, rows)
        ],
        "nodes": node_links,
    }
    return {"calibration": cal.to_dict(), "report": report}
