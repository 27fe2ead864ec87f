"""`fp8comm plan`: predicted communication time per training step for each wire choice on a cluster you describe,
and the one the planner would pick per bucket-size class, before you rent the cluster.

The cluster: nodes, GPUs per node, one node's cross-node bandwidth (all its NICs), one GPU's node-local bandwidth,
optionally a cap on a node's node-local traffic (a shared PCIe host bridge), latencies. The step: the model's
parameters cut into buckets (or the bucket sizes themselves): one gradient reduce-scatter (or all-reduce) and
`--weight-gathers` weight all-gathers per bucket per step, over one data-parallel group of every GPU. Codec speeds:
`gpu` (one H200, docs/benchmarks.md, 2026-11-30), `cpu` (measured here, now), or a file (an fp8comm calibration,
or a results file with codec_<codec>_<kind>_elems_per_s rows). Every time is fp8comm.comm.linkmodel's prediction
(fp8comm.comm.planner), never a measurement of that cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import Fp8CommError

if TYPE_CHECKING:  # imported where used: `fp8comm plan -h` needs no torch
    from ..comm.calibration import Calibration
    from ..comm.planner import GroupShape, Option, Policy

H200 = "cuda:NVIDIA H200"
_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "B": 1e9}
_BIN = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


class Usage(Fp8CommError):
    """A command-line value that cannot be read; the message names the option and the accepted forms."""


def count(text: str, what: str = "count") -> int:
    """'7B', '40M', '64Mi', '1e9', '1000' -> an int (k/M/G/T/B decimal, B = billion; Ki/Mi/Gi/Ti binary)."""
    m = re.fullmatch(_NUM + r"\s*(Ki|Mi|Gi|Ti|k|K|M|G|T|B)?", text.strip())
    if not m:
        raise Usage(f"{what}: cannot read {text!r} (e.g. 7B, 40M, 64Mi, 1e9)")
    unit = m.group(2) or ""
    v = float(m.group(1)) * (_BIN[unit] if unit in _BIN else _SI[unit])
    if v < 1 or v != int(v):
        raise Usage(f"{what}: {text!r} is not a whole number >= 1")
    return int(v)


def bandwidth(text: str, what: str = "bandwidth") -> float:
    """'400Gbit', '8x400Gb/s', '100Gbps', '25GB/s', '900MB/s' -> bytes per second (per direction)."""
    m = re.fullmatch(r"(?:([0-9]+)\s*x\s*)?" + _NUM + r"\s*([kKMGT]?)(bit|b|B)(?:/s|ps|it/s)?", text.strip())
    if not m:
        raise Usage(
            f"{what}: cannot read {text!r}; give a unit, e.g. 400Gbit, 8x400Gb/s, 100Gbps (bits) or 25GB/s (bytes)"
        )
    mult = int(m.group(1) or 1)
    v = mult * float(m.group(2)) * _SI[m.group(3)] / (1 if m.group(4) == "B" else 8)
    if v <= 0:
        raise Usage(f"{what}: {text!r} must be > 0")
    return v


def seconds(text: str, what: str = "latency") -> float:
    """'5us', '2 us', '0.01ms', '1e-6s' -> seconds."""
    m = re.fullmatch(_NUM + r"\s*(ns|us|µs|ms|s)", text.strip())
    if not m:
        raise Usage(f"{what}: cannot read {text!r}; give a unit, e.g. 5us, 0.01ms, 1e-6s")
    return float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def buckets(text: str) -> list[int]:
    """'40M', '64Mix10,13M' -> bucket sizes in elements (SIZExCOUNT repeats)."""
    out: list[int] = []
    for part in text.split(","):
        size, _, n = part.strip().partition("x")
        out += [count(size, "--buckets size")] * (count(n, "--buckets count") if n else 1)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, required=True, help="nodes (>= 1)")
    c.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node (>= 1)")
    c.add_argument("--inter", help="one node's cross-node bandwidth, all NICs: 8x400Gbit, 100Gbit")
    c.add_argument("--intra", help="one GPU's node-local bandwidth per direction: 450GB/s, 25GB/s")
    c.add_argument("--node-local-cap", help="a node's node-local traffic in all (shared PCIe bridge): 50GB/s")
    c.add_argument("--inter-latency", help="per cross-node step (default 5us, an assumption)")
    c.add_argument("--intra-latency", help="per node-local step (default 2us, an assumption)")
    c.add_argument(
        "--calibration",
        help="links, codec speeds and backend from an fp8comm calibration FILE (fp8comm calibrate) instead of "
        "--inter/--intra/latencies/--codec-speeds; refused when taken with another fp8comm version, another ranks "
        "per node than --gpus-per-node, or another --device",
    )
    c.add_argument("--device", help="with --calibration: this job's device kind (cpu, 'cuda:NVIDIA H200'), checked")
    c.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        help="the engines' own collectives (default: nccl, gloo with --codec-speeds cpu)",
    )
    c.add_argument("--call-overhead", default="0us", help="host time per quantized call (default 0: not modelled)")
    s = p.add_argument_group("step")
    s.add_argument("--params", help="model parameters (7B, 70e9); cut into --bucket-size buckets")
    s.add_argument("--bucket-size", help="elements per bucket (default: Megatron's max(40M, 1M x GPUs))")
    s.add_argument("--buckets", help="bucket sizes in elements instead of --params: 64Mix10,13M")
    s.add_argument("--grad-dtype", default="bf16", choices=("bf16", "fp32"), help="gradient buckets' dtype")
    s.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp32"), help="gathered weights' dtype")
    s.add_argument(
        "--grad-op",
        default="reduce_scatter",
        choices=("reduce_scatter", "all_reduce"),
        help="reduce_scatter (ZeRO, FSDP2, distributed optimizer) or all_reduce (plain DDP)",
    )
    s.add_argument(
        "--weight-gathers",
        type=int,
        default=None,
        help="weight all-gathers per bucket per step (default 1; 0 with --grad-op all_reduce; "
        "ZeRO-3/FSDP2 resharding after forward gather twice)",
    )
    n = p.add_argument_group("numerics policy")
    n.add_argument("--allow-4bit", action="store_true", help="4-bit gradients (the recipe: mxfp4 + error feedback)")
    n.add_argument("--allow-4bit-updates", action="store_true", help="4-bit weight changes (engines with replicas)")
    n.add_argument("--no-replicas", action="store_true", help="the engine keeps no weight replicas (ZeRO-3, FSDP2)")
    n.add_argument("--fp8-scales", default="fp32", help="FP8 scale encodings allowed: fp32, e8m0 or fp32,e8m0")
    n.add_argument("--no-two-level", action="store_true", help="flat calls only")
    n.add_argument("--residual-dtype", default="float32", help="the 4-bit recipe's residual: float32, bfloat16, fp8")
    o = p.add_argument_group("codec speeds and output")
    o.add_argument(
        "--codec-speeds",
        default=None,
        help="gpu (H200, docs/benchmarks.md 2026-11-30), cpu (measured here now) or a FILE "
        "(fp8comm calibration JSON, or a results file such as docs/results/gpu.json)",
    )
    o.add_argument("--codec-elems", default="4Mi", help="elements per codec timing with --codec-speeds cpu")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--brief", action="store_true", help="per size class the choice and its reason only")


def _codecs(args, ranks: int) -> tuple[dict, str, str]:
    """(codec speeds, device kind, where they come from)."""
    from ..comm import linkmodel
    from ..comm.calibration import Calibration, measure_codecs, results_speeds

    src = args.codec_speeds or "gpu"
    if src == "gpu":
        where = "one H200 (FP8: docs/benchmarks.md, 2026-11-30; residuals and 4-bit: docs/results/gpu.json, 2026-12-04)"
        return linkmodel.gpu_speeds(), H200, where
    if src == "cpu":
        n = count(args.codec_elems, "--codec-elems")
        sp = measure_codecs(elems=n)
        return sp, "cpu", next(iter(sp.values())).source
    path = Path(src)
    if not path.is_file():
        raise Usage(
            f"--codec-speeds: {src!r} is neither gpu, cpu nor an existing file"
            + (
                " (docs/results/gpu.json is written by a GPU run, launch/device_check.py; none has written it in this "
                "checkout: use --codec-speeds gpu for docs/benchmarks.md's H200 figures)"
                if path.name == "gpu.json"
                else ""
            )
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Usage(f"--codec-speeds: {src} is not JSON: {e}") from None
    if isinstance(data, dict):
        cal = Calibration.from_dict(data, where=str(path))
        return dict(cal.codecs), cal.device, f"{path} ({cal.source or cal.device})"
    if isinstance(data, list):
        return results_speeds(data, str(path)), H200 if "gpu" in path.name else "unknown", str(path)
    raise Usage(f"--codec-speeds: {src} holds neither a calibration (an object) nor results rows (a list)")


def build(args) -> tuple[Calibration, GroupShape, Policy, list[int]]:
    """The calibration, group shape, policy and bucket list the arguments describe; bad values raise Usage (or the
    planner's own Fp8CommConfigError) before anything is measured."""
    from ..comm.calibration import Calibration, Link
    from ..comm.planner import GroupShape, Policy

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise Usage(f"--nodes and --gpus-per-node must be >= 1; got {args.nodes} and {args.gpus_per_node}")
    shape = GroupShape(args.nodes, args.gpus_per_node)
    if bool(args.params) == bool(args.buckets):
        raise Usage("give the model size (--params, with --bucket-size) or the bucket sizes (--buckets), one of them")
    if args.buckets and args.bucket_size:
        raise Usage("--bucket-size cuts --params into buckets; with --buckets the sizes are given")
    if args.params:
        p = count(args.params, "--params")
        b = count(args.bucket_size, "--bucket-size") if args.bucket_size else max(40_000_000, 1_000_000 * shape.size)
        sizes = [b] * (p // b) + ([p % b] if p % b else [])
    else:
        sizes = buckets(args.buckets)
    scales = tuple(s.strip() for s in args.fp8_scales.split(","))
    policy = Policy(
        allow_4bit=args.allow_4bit,
        allow_4bit_updates=args.allow_4bit_updates,
        replicas=not args.no_replicas,
        fp8_scales=scales,
        two_level=not args.no_two_level,
        residual_dtype=args.residual_dtype,
    )
    if args.weight_gathers is not None and args.weight_gathers < 0:
        raise Usage(f"--weight-gathers must be >= 0, got {args.weight_gathers}")
    if args.calibration:
        return _from_file(args, shape), shape, policy, sizes
    if args.device:
        raise Usage("--device checks a --calibration file's device kind; without --calibration it means nothing")
    if not args.inter or not args.intra:
        raise Usage("give the links: --inter and --intra (with units), or --calibration FILE (fp8comm calibrate)")
    links = (
        Link(bandwidth(args.inter, "--inter"), seconds(args.inter_latency or "5us", "--inter-latency")),
        Link(bandwidth(args.intra, "--intra"), seconds(args.intra_latency or "2us", "--intra-latency")),
    )
    cap = bandwidth(args.node_local_cap, "--node-local-cap") if args.node_local_cap else None
    overhead = seconds(args.call_overhead, "--call-overhead")
    if args.codec_speeds == "cpu":
        count(args.codec_elems, "--codec-elems")  # a bad size fails before the measurement starts
    codecs, device, source = _codecs(args, args.gpus_per_node)
    backend = args.backend or ("gloo" if args.codec_speeds == "cpu" else "nccl")
    cal = Calibration(
        links[0],
        links[1],
        codecs,
        device,
        args.gpus_per_node,
        backend,
        cap,
        overhead,
        world_size=shape.size,
        source=f"fp8comm plan: links from the command line; codec speeds: {source}",
    )
    return cal, shape, policy, sizes


def _from_file(args, shape: GroupShape) -> Calibration:
    """The calibration in --calibration, checked (version, --gpus-per-node, --device; the world size may differ)."""
    from ..comm.calibration import Calibration

    given = [
        f"--{k.replace('_', '-')}"
        for k in ("inter", "intra", "inter_latency", "intra_latency", "node_local_cap", "backend", "codec_speeds")
        if getattr(args, k)
    ]
    if given:
        raise Usage(f"{', '.join(given)}: --calibration gives the links, codec speeds and backend; give one or other")
    path = Path(args.calibration)
    if not path.is_file():
        raise Usage(f"--calibration: no such file: {path}")
    cal = Calibration.load(path, device=args.device, ranks_per_node=args.gpus_per_node)
    return dataclasses.replace(cal, source=f"links and codec speeds from {path} ({cal.source or cal.device})")


def collectives(args, sizes: list[int]) -> list[tuple[str, str, int]]:
    """(op, dtype, calls per bucket per step) of the step."""
    out = [(args.grad_op, args.grad_dtype, 1)]
    gathers = args.weight_gathers if args.weight_gathers is not None else (0 if args.grad_op == "all_reduce" else 1)
    if gathers:
        out.append(("all_gather", args.weight_dtype, gathers))
    return out


def choice(o: Option, backend: str) -> str:
    """One choice's name across collectives: mxfp4 is the recipe with error feedback for gradients, plain for
    weights (their 4-bit changes)."""
    if o.native:
        return f"engine's own ({'NCCL ring' if backend == 'nccl' else 'torch gloo'})"
    return f"{o.wire} {'two-level' if o.levels == 'two_level' else 'flat'}"


def report(args) -> dict:
    """Everything `fp8comm plan` prints, as one JSON-able dict."""
    from ..comm.planner import DTYPES, Planner, options, predict

    cal, shape, policy, sizes = build(args)
    planner = Planner(policy, cal)
    out: dict = {
        "cluster": {
            "nodes": shape.nodes,
            "gpus_per_node": shape.ranks_per_node,
            "inter_GBps": cal.inter.bandwidth / 1e9,
            "intra_GBps": cal.intra.bandwidth / 1e9,
            "node_local_cap_GBps": cal.node_local_cap / 1e9 if cal.node_local_cap else None,
            "inter_latency_us": cal.inter.latency * 1e6,
            "intra_latency_us": cal.intra.latency * 1e6,
            "call_overhead_us": cal.call_overhead * 1e6,
            "small_calls_ms": {k: v * 1e3 for k, v in cal.small_calls.items()},
            "large_calls_ms": {k: v * 1e3 for k, v in cal.large_calls.items()},
            "backend": cal.backend,
            "device": cal.device,
            "source": cal.source,
        },
        "step": {
            "elements": sum(sizes),
            "buckets": {str(s): n for s, n in sorted(Counter(sizes).items(), reverse=True)},
        },
        "policy": {
            "allow_4bit": policy.allow_4bit,
            "allow_4bit_updates": policy.allow_4bit_updates,
            "replicas": policy.replicas,
            "fp8_scales": list(policy.fp8_scales),
            "two_level": policy.two_level,
            "residual_dtype": policy.residual_dtype,
        },
        "collectives": [],
    }
    names = [choice(o, cal.backend) for o in options("weights")]
    total: dict[str, float | None] = dict.fromkeys([*names, "planner"], 0.0)
    for op, dtype, calls in collectives(args, sizes):
        role = "weights" if op == "all_gather" else "gradients"
        step: dict[str, float | None] = dict.fromkeys([*names, "planner"], 0.0)
        why: dict[str, str] = {}
        classes: dict[int, dict] = {}
        for size, n in sorted(Counter(sizes).items(), reverse=True):
            nbytes = size * DTYPES[dtype]
            plan = planner.plan(op, nbytes, dtype, shape)  # one plan per size class
            cl = classes.setdefault(plan.size_class, {"buckets": {}, "plan": plan.to_dict(), "text": plan.describe()})
            cl["buckets"][str(size)] = n
            for c in plan.candidates:  # each choice on every bucket, at the bucket's own size
                k = choice(c.option, cal.backend)
                if c.excluded:
                    why[k] = c.excluded
                prev = step[k]
                ok = prev is not None and c.seconds is not None
                step[k] = prev + calls * n * predict(op, nbytes, dtype, shape, c.option, cal) if ok else None  # type: ignore[operator]
            step["planner"] += calls * n * predict(op, nbytes, dtype, shape, plan.chosen, cal)  # type: ignore[operator]
        for k, v in step.items():
            total[k] = None if v is None or total[k] is None else total[k] + v  # type: ignore[operator]
        out["collectives"].append(
            {
                "op": op,
                "role": role,
                "dtype": dtype,
                "calls_per_bucket": calls,
                "classes": list(classes.values()),
                "per_step_ms": {k: None if v is None else v * 1e3 for k, v in step.items()},
                "not_allowed": why,
            }
        )
    out["total_ms"] = {k: None if v is None else v * 1e3 for k, v in total.items()}
    return out


def _print(r: dict, brief: bool = False) -> None:
    c, p = r["cluster"], r["policy"]
    cap = f", node-local cap {c['node_local_cap_GBps']:g} GB/s per node" if c["node_local_cap_GBps"] else ""
    print(
        f"# fp8comm plan: {c['nodes']} nodes x {c['gpus_per_node']} GPUs; cross-node {c['inter_GBps']:g} GB/s per node "
        f"({c['inter_latency_us']:g} us/step), node-local {c['intra_GBps']:g} GB/s per GPU "
        f"({c['intra_latency_us']:g} us/step){cap}; engine's own collectives: {c['backend']}; host cost per "
        f"quantized call {c['call_overhead_us']:g} us"
        + (
            f" (options with a small call from the calibration: {len(c['small_calls_ms'])}, charged their own)"
            if c["small_calls_ms"]
            else ""
        )
        + (
            f" (with a large call: {len(c['large_calls_ms'])}, scaled toward it on the layout it was timed on)"
            if c.get("large_calls_ms")
            else ""
        )
    )
    print(f"# {c['source']}")
    sizes = ", ".join(f"{n} x {int(s):,}" for s, n in r["step"]["buckets"].items())
    print(f"# {r['step']['elements']:,} elements per step in buckets of {sizes} elements")
    print(
        f"# policy: 4-bit gradients {'allowed' if p['allow_4bit'] else 'no'}, 4-bit weight updates "
        f"{'allowed' if p['allow_4bit_updates'] else 'no'}, FP8 scales {'/'.join(p['fp8_scales'])}, "
        f"two levels {'allowed' if p['two_level'] else 'off'}"
    )
    print("# times: fp8comm.comm.linkmodel's predictions (docs/scaling.md), not measurements of that cluster\n")
    for col in r["collectives"]:
        print(f"## {col['op']} of {col['role']} ({col['dtype']}), {col['calls_per_bucket']} per bucket per step")
        for cl in col["classes"]:
            held = " + ".join(f"{n} x {int(s):,}" for s, n in cl["buckets"].items())
            text = cl["text"] if not brief else "\n".join(cl["text"].splitlines()[:2])
            print(f"{held} elements -> {text}")
        print()
    cols = r["collectives"]
    print("## per step (ms): every bucket on one choice, or the planner's choice per size class")
    head = ["choice", *(f"{x['op']} ({x['role']})" for x in cols), "total"]
    rows = []
    for k, v in r["total_ms"].items():
        cells = [_ms(x["per_step_ms"][k], x["not_allowed"].get(k, "")) for x in cols]
        barred = any(x["not_allowed"].get(k) for x in cols)
        rows.append([k, *cells, _ms(v, "x" if barred else "")])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |")
    print("(x): not allowed by the policy or the numerics for that collective (the reasons are in the plans above);")
    print("n/a: does not apply to this group. mxfp4 for gradients is the recipe with error feedback; for weights,")
    print("4-bit changes of a replica (ReplicaUpdate).")


def _ms(v: float | None, why: str = "") -> str:
    if v is None:
        return "n/a"
    return f"{v:.2f}" + (" (x)" if why and not why.startswith("n/a") else "")


def run(args) -> int:
    try:
        r = report(args)
    except Fp8CommError as e:
        print(f"fp8comm plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        for col in r["collectives"]:
            for cl in col["classes"]:
                cl.pop("text")  # the plan's dict carries the same
        print(json.dumps(r, indent=1))
    else:
        _print(r, args.brief)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="fp8comm plan", description=__doc__)
    add_args(ap)
    sys.exit(run(ap.parse_args()))
