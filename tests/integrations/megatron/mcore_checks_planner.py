"""The planner switch (issue 30, items 3 and 6) in real Megatron-Core runs: 4 gloo ranks as 2 simulated nodes x 2
(LOCAL_WORLD_SIZE=2, GROUP_RANK set per check), DP=4, overlap on (the bucket collectives are issued inside
Megatron's coalescing blocks and waited later: the timed path is issue-to-wait). Calibration files are written here
with chosen numbers, so the choices are known in advance:

- FAST (1e13 B/s links, 1 us latency, codecs at 1e6 elements/s): every bucket class is Megatron's own collective,
  so the run is bit-identical to Megatron alone and the plan lines say "engine ... (torch gloo)";
- SLOW (1e5 B/s across nodes, codecs at 1e9 elements/s): FP8 two-level for gradients and parameters, and with
  allow_4bit mxfp4 + error feedback for gradients (parameters stay FP8); --no-fp8comm-hierarchical runs them flat;
  with allow_4bit and a very slow mxfp4 codec the plan is FP8, run without error feedback (no residual, e4m3 calls).

Run by test_megatron_planner.py through worker() below (mcore_harness.worker with this module among its check
modules)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import mcore_train as T
import torch
import torch.distributed as dist
from mcore_checks import _fm, check_parity, run

import fp8comm.comm as fcomm
from fp8comm.comm import linkmodel as lm
from fp8comm.comm import topology
from fp8comm.comm.calibration import Calibration, Link
from fp8comm.comm.planned import TRIAL_CALLS

ITERS = 4
TRIAL_ITERS = 2 + TRIAL_CALLS  # enough calls for each bucket-size class to measure its plan once
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)
PLAIN = dict(use_distributed_optimizer=False, overlap_grad_reduce=True)  # plain DDP: bucket all-reduces
FAST = dict(inter=1e13, intra=1e13, latency=1e-6, codec=1e6)
SLOW = dict(inter=1e5, intra=1e6, latency=1e-5, codec=1e9)
FP4_LOSS_RTOL = 0.02  # the 4-bit recipe's final-loss bound against Megatron alone (mcore_checks_fp4)


def worker(rank: int, world: int, port: int, outdir: str, env: dict, names: list[str]) -> None:
    """mcore_harness.worker with this module's checks reachable by name."""
    import mcore_harness as H

    if __name__ not in H.CHECK_MODULES:
        H.CHECK_MODULES = (*H.CHECK_MODULES, __name__)
    H.worker(rank, world, port, outdir, env, names)


def _nodes(rank: int) -> None:
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    topology.forget()


def calibration_file(
    name: str, inter: float, intra: float, latency: float, codec: float, codecs: dict | None = None, **over
) -> str:
    """A calibration file with chosen numbers (device cpu, gloo, 2 ranks per node: this launch's layout); codecs:
    speeds of named codecs beside "*" (every codec at `codec` elements/s)."""
    s = lm.CodecSpeed(pack=codec, unpack_sum=2 * codec, unpack=2 * codec)
    kw = dict(device="cpu", ranks_per_node=2, backend="gloo", source="mcore_checks_planner")
    kw.update(over)
    speeds = {"*": s, **(codecs or {})}
    cal = Calibration(Link(inter, latency), Link(intra, latency), speeds, **kw)  # type: ignore[arg-type]
    path = Path(tempfile.mkdtemp(prefix=f"fp8comm_planner_{dist.get_rank()}_")) / f"{name}.json"
    path.write_text(cal.to_json())
    return str(path)


def _keep_installation(box: dict):
    def on_install(model):
        box["inst"] = _fm().installation()

    return on_install


def _plans(box: dict) -> tuple[list[str], list]:
    inst = box["inst"]
    return list(inst.plan_log), list(inst.planner.plans)


def _same_on_every_rank(value, what: str) -> None:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    assert all(e == everyone[0] for e in everyone), f"ranks decided {what} differently: {everyone}"


def _timed(comm: dict, op: str) -> dict:
    s = comm.get(op, {})
    assert s.get("timed_calls", 0) > 0 and s["predicted_s"] > 0 and s["measured_s"] > 0, (op, comm)
    return {k: s[k] for k in ("calls", "timed_calls", "predicted_s", "measured_s")}


def gpt_dp4_planner_fast_link_is_megatrons_own(rank, world, info):
    """FAST calibration: the plan gives every size class of the gradient reduce-scatter and the parameter
    all-gather Megatron's own collective; the run is bit-identical to Megatron alone (loss, grad norm, parameters),
    no fp8comm bytes moved, and comm_stats holds each call's predicted and measured seconds."""
    _nodes(rank)
    T.init_parallel(tp=1)
    base = run(OVERLAP, None, iters=ITERS)
    box: dict = {}
    path = calibration_file("fast", **FAST)
    # trials off: the file's link is fiction, which trials would correct by measurement (checked at the end)
    on = run(
        OVERLAP, dict(planner_calibration=path, planner_trials=False), iters=ITERS, on_install=_keep_installation(box)
    )
    log, plans = _plans(box)
    assert log[0].startswith(f"fp8comm planner: calibration from {path}"), log[0]
    heads = [p.describe().splitlines()[0] for p in plans]
    assert {p.op for p in plans} == {"reduce_scatter", "all_gather"}, heads
    assert all(p.chosen.native for p in plans), heads
    assert all(h.endswith(("engine fp32 (torch gloo)", "engine bf16 (torch gloo)")) for h in heads), heads
    # each plan logged once; the rest: plans measured far off this file's fiction (Megatron's timed calls)
    assert len([ln for ln in log if ln.startswith("fp8comm plan: ")]) == len(plans), log
    assert all(ln.startswith(("fp8comm plan: ", "fp8comm planner: ")) for ln in log[1:]), log
    assert any("measured" in ln and "predicted" in ln for ln in log), log
    _same_on_every_rank([p.describe() for p in plans], "the plans")
    h, c = on["hooks"], on["comm"]
    assert h["grad_reduce_scatter"]["native_calls"] > 0 and h["grad_reduce_scatter"]["fp8_calls"] == 0, h
    assert h["param_all_gather"]["native_calls"] > 0 and h["param_all_gather"]["fp8_calls"] == 0, h
    assert all(s["calls"] == 0 and s["wire_bytes"] == 0 for s in c.values()), c  # no fp8comm call at all
    info["fast"] = {
        "plans": [p.describe() for p in plans],
        "reduce_scatter": _timed(c, "reduce_scatter"),
        "all_gather": _timed(c, "all_gather"),
        "hooks": h,
    }
    assert on["loss"] == base["loss"] and on["grad_norm"] == base["grad_norm"], (on["loss"], base["loss"])
    assert torch.equal(on["params"], base["params"]), "the planned run's parameters differ from Megatron alone"
    # plain DDP (no distributed optimizer): the bucket all-reduce, Megatron's own too; no parameter gather
    base_ar = run(PLAIN, None, iters=ITERS)
    box_ar: dict = {}
    ar = run(
        PLAIN, dict(planner_calibration=path, planner_trials=False), iters=ITERS, on_install=_keep_installation(box_ar)
    )
    _, plans_ar = _plans(box_ar)
    assert {p.op for p in plans_ar} == {"all_reduce"} and all(p.chosen.native for p in plans_ar), plans_ar
    assert ar["hooks"]["grad_all_reduce"]["native_calls"] > 0, ar["hooks"]
    assert ar["loss"] == base_ar["loss"] and ar["grad_norm"] == base_ar["grad_norm"], (ar["loss"], base_ar["loss"])
    assert torch.equal(ar["params"], base_ar["params"]), "plain DDP: parameters differ from Megatron alone"
    info["fast"]["plain_ddp_all_reduce"] = _timed(ar["comm"], "all_reduce")
    # trials on: Megatron's timed calls reach the planner (the gradient buckets' issue-to-wait times); each class
    # measures its plan, may try another option, and every rank runs the same
    box_t: dict = {}
    tried = run(OVERLAP, dict(planner_calibration=path), iters=TRIAL_ITERS, on_install=_keep_installation(box_t))
    trials = box_t["inst"].planner.trials()
    _same_on_every_rank(repr(trials), "the trials")
    info["fast"]["trials"] = trials
    grads = [t for t in trials if t["op"] == "reduce_scatter"]
    assert grads and all(t["done"] and t["measured_ms"] for t in grads), trials
    assert tried["loss"] == tried["loss"], tried["loss"]


def gpt_dp4_planner_slow_link_quantizes(rank, world, info):
    """SLOW calibration: FP8 two-level for gradients and parameters (".intra" records), within the FP8 parity
    bounds of Megatron alone; with allow_4bit and --no-fp8comm-hierarchical: mxfp4 + error feedback, flat, for the
    gradients (two levels excluded by the policy), FP8 flat for the parameters (weights at most FP8), the final loss
    within the 4-bit recipe's bound."""
    _nodes(rank)
    T.init_parallel(tp=1)
    base = run(OVERLAP, None, iters=ITERS)
    path = calibration_file("slow", **SLOW)
    box8: dict = {}
    f8 = run(OVERLAP, dict(planner_calibration=path), iters=ITERS, on_install=_keep_installation(box8))
    log8, plans8 = _plans(box8)
    assert plans8 and all(str(p.chosen.label()) == "fp8 two-level" for p in plans8), log8
    check_parity(base, f8, info, "planner_fp8")
    assert f8["comm"].get("reduce_scatter.intra", {}).get("calls", 0) > 0, f8["comm"]
    assert f8["comm"].get("all_gather.intra", {}).get("calls", 0) > 0, f8["comm"]
    assert f8["hooks"]["grad_reduce_scatter"].get("native_calls", 0) == 0, f8["hooks"]
    _same_on_every_rank([p.describe() for p in plans8], "the FP8 plans")
    # plain DDP: the planned FP8 all-reduce (reduce-scatter + all-gather of the sums), two levels
    box_ar: dict = {}
    ar = run(
        PLAIN, dict(planner_calibration=path, planner_trials=False), iters=ITERS, on_install=_keep_installation(box_ar)
    )
    _, plans_ar = _plans(box_ar)
    assert [(p.op, p.chosen.label()) for p in plans_ar] == [("all_reduce", "fp8 two-level")] * len(plans_ar), plans_ar
    check_parity(run(PLAIN, None, iters=ITERS), ar, info, "planner_fp8_plain_ddp")
    assert ar["hooks"]["grad_all_reduce"]["fp8_calls"] > 0, ar["hooks"]

    box4: dict = {}
    hooks4 = dict(planner_calibration=path, planner_allow_4bit=True, hierarchical=False)
    f4 = run(OVERLAP, hooks4, iters=ITERS, on_install=_keep_installation(box4))
    log4, plans4 = _plans(box4)
    chosen = {p.op: p.chosen.label() for p in plans4}
    assert chosen == {"reduce_scatter": "mxfp4 +EF flat", "all_gather": "fp8 flat"}, log4
    rs = next(p for p in plans4 if p.op == "reduce_scatter")
    assert rs.candidate(rs.chosen).excluded == "" and "recipe: mxfp4 with error feedback" in rs.describe()
    two = [c for c in rs.candidates if c.option.levels == "two_level"]
    assert two and all(c.excluded == "policy: two levels off" for c in two), rs.describe()
    assert not [k for k in f4["comm"] if k.endswith(".intra")], f4["comm"]
    assert f4["hooks"]["grad_reduce_scatter"]["fp8_calls"] > 0, f4["hooks"]
    ratio = f4["comm"]["reduce_scatter"]["ratio"]
    assert ratio > 7.0, f"4-bit gradients should send > 7x fewer bytes than fp32 buckets, got {ratio}"
    rel = abs(f4["loss"][-1] - base["loss"][-1]) / base["loss"][-1]
    assert rel <= FP4_LOSS_RTOL, (f4["loss"], base["loss"])
    _same_on_every_rank([p.describe() for p in plans4], "the 4-bit plans")

    # allow_4bit, but mxfp4's codec is so slow that FP8 wins: the plan's FP8 runs as predicted and chosen, WITHOUT
    # error feedback (no residual kept or sent for any bucket), every gradient call e4m3
    slow4 = lm.CodecSpeed(pack=1e4, unpack_sum=1e4, unpack=1e4)
    path48 = calibration_file("slow_mxfp4", **SLOW, codecs={"mxfp4": slow4})
    box48: dict = {}
    calls48: list = []
    rs_into = fcomm.reduce_scatter_into

    def spy(*a, **kw):
        c = kw.get("config")
        calls48.append((c.fmt, c.error_feedback, kw.get("error_feedback") is not None))
        return rs_into(*a, **kw)

    fcomm.reduce_scatter_into = spy
    try:
        f48 = run(
            OVERLAP,
            dict(planner_calibration=path48, planner_allow_4bit=True),
            iters=ITERS,
            on_install=_keep_installation(box48),
        )
    finally:
        fcomm.reduce_scatter_into = rs_into
    log48, plans48 = _plans(box48)
    rs48 = [p.chosen.label() for p in plans48 if p.op == "reduce_scatter"]
    assert rs48 and all(x == "fp8 two-level" for x in rs48), log48
    assert f48["hooks"]["grad_reduce_scatter"]["fp8_calls"] == len(calls48) > 0, (f48["hooks"], calls48)
    assert set(calls48) == {("e4m3", False, False)}, sorted(set(calls48))
    kept = [ef.nbytes() for ref, ef in box48["inst"].residuals.values() if ref() is not None and ef.stored()]
    assert not kept, f"{len(kept)} error-feedback residuals ({sum(kept)} bytes) on a plan without error feedback"
    # the same FP8 run as the plan without 4 bits allowed (no residual added to any bucket)
    assert f48["loss"] == f8["loss"] and f48["grad_norm"] == f8["grad_norm"], (f48["loss"], f8["loss"])
    _same_on_every_rank([p.describe() for p in plans48], "the FP8-over-mxfp4 plans")
    info["slow"] = {
        "fp8_plans": [p.describe() for p in plans8],
        "fp4_flat_plans": [p.describe() for p in plans4],
        "fp8_reduce_scatter": _timed(f8["comm"], "reduce_scatter"),
        "fp8_all_gather": _timed(f8["comm"], "all_gather"),
        "fp4_reduce_scatter": _timed(f4["comm"], "reduce_scatter"),
        "fp8_plain_ddp_all_reduce": _timed(ar["comm"], "all_reduce"),
        "fp4_ratio_vs_fp32": round(ratio, 3),
        "fp4_final_loss_rel": round(rel, 5),
    }


def planner_bad_inputs_and_measurement(rank, world, info):
    """Bad input is one clear error on every rank before any bucket moves, nothing installed: a calibration file
    from another fp8comm version, device kind or ranks-per-node layout, a missing file, the planner beside an
    explicit --fp8comm-grad-format. Without a file the planner measures over the world at install: every rank logs
    the same outcome (calibrated, or the fixed choice when the deadline passes)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    fm = _fm()
    _nodes(rank)
    T.init_parallel(tp=1)
    ddp = DistributedDataParallelConfig(**T.ddp_kwargs(**OVERLAP))
    tc = T.transformer_config()
    errors = {}
    for tag, over, match in (
        ("version", dict(version="0.0.1"), "taken with fp8comm 0.0.1"),
        ("device", dict(device="cuda:NVIDIA H100"), "taken on device kind 'cuda:NVIDIA H100'"),
        ("ranks_per_node", dict(ranks_per_node=4), "taken with 4 ranks per node, this job has 2"),
    ):
        path = calibration_file(tag, **{**SLOW, **over})
        try:
            fm.install(ddp_config=ddp, transformer_config=tc, planner_calibration=path)
        except fm.Fp8CommMegatronError as e:
            errors[tag] = str(e)
        else:
            raise AssertionError(f"{tag}: a foreign calibration file was accepted")
        assert match in errors[tag] and "--fp8comm-planner" in errors[tag], errors[tag]
        assert fm.active_config() is None
    try:
        fm.install(ddp_config=ddp, transformer_config=tc, planner_calibration="/nonexistent/cal.json")
    except fm.Fp8CommMegatronError as e:
        errors["missing"] = str(e)
    assert "no such file: /nonexistent/cal.json" in errors.get("missing", ""), errors
    try:
        fm.install(ddp_config=ddp, transformer_config=tc, planner=True, grad_fmt="e4m3")
    except fm.Fp8CommMegatronError as e:
        errors["grad_fmt"] = str(e)
    assert "--fp8comm-planner and --fp8comm-grad-format e4m3" in errors.get("grad_fmt", ""), errors
    assert fm.active_config() is None
    # the same error on every rank (each rank wrote its files under its own temporary directory)
    _same_on_every_rank({k: re.sub(r"/tmp/fp8comm_planner_\d_\w+/", "DIR/", v) for k, v in errors.items()}, "errors")
    # Megatron-LM's way: install(args) from add_args, the Megatron facts from the same namespace
    import argparse

    args = fm.add_args(argparse.ArgumentParser()).parse_args(
        ["--fp8comm-planner-calibration", calibration_file("args", **FAST)]
    )
    args.use_distributed_optimizer, args.bf16 = True, True
    got = fm.install(args)
    try:
        assert got.planner and got.grad_reduce and got.param_gather and not got.planner_allow_4bit, got
        assert fm.installation().planner.started and fm.active_config() == got
    finally:
        fm.uninstall()
    # measured at install (no file): the deadline is short on purpose; either outcome is one decision everywhere
    cfg = fm.install(ddp_config=ddp, transformer_config=tc, planner=True, planner_timeout_s=3.0)
    try:
        inst = fm.installation()
        first = inst.plan_log[0]
        assert first.startswith(("fp8comm planner: calibrated in", "fp8comm planner: calibration did not finish"))
        assert cfg.grad_reduce and cfg.param_gather and cfg.planner, cfg
        outcome = "fallback" if inst.planner.fallback else "calibrated"
        cal = inst.planner.calibration
        _same_on_every_rank((outcome, None if cal is None else cal.to_dict()), "the calibration")
        info["measured"] = {"outcome": outcome, "line": first}
    finally:
        fm.uninstall()
    info["errors"] = errors
