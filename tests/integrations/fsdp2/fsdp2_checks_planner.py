"""The planner switch of the FSDP2 adapter (issue 30 items 3, 6), on 4 gloo ranks laid out as 2 simulated nodes x
2 ranks (fsdp2_checks_levels._nodes: what torchrun would set), a 2-layer model with bf16 parameters and fp32
gradient reduction, calibration files written here with chosen numbers (device "cpu", 2 ranks per node, gloo):

- a very slow cross-node link (1e5 bytes/s): the weight all-gather goes FP8 two-level and, with allow_4bit, the
  gradient reduce-scatter the 4-bit recipe (mxfp4 with error feedback) two-level; with hierarchical=False both
  flat FP8; the plan lines say so (rank 0 only) and every rank decided alike; comm_stats() has timed_calls,
  predicted_s and measured_s per op; with allow_4bit and a very slow mxfp4 codec the gradients' plan is FP8, run
  without error feedback (e4m3 calls, no residual);
- a very fast one (1e13 bytes/s, 1 us): FSDP2's own collectives on every call, and the training is bit-identical
  to a run without fp8comm (losses and parameters);
- bad input (a file from another fp8comm version, device kind or ranks-per-node layout, a missing file, 4-bit
  gradients without the residual opt-in) is an error before any bytes move: nothing communicated, no hook installed;
- no file: the calibration is measured over the world at enable() (or falls back alike on every rank).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import fsdp2_checks as C
import fsdp2_checks_levels as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8comm.comm as fc
import fp8comm.integrations.fsdp2 as f2
from fp8comm.comm import linkmodel as lm
from fp8comm.comm import topology
from fp8comm.comm.calibration import Calibration, Link
from fp8comm.comm.planned import TRIAL_CALLS

STEPS = 3
TRIAL_STEPS = 2 + TRIAL_CALLS  # one gradient reduce-scatter per step: its plan's first call left out, then timed
SLOW = (1e5, 1e-4)  # cross-node bytes/s, latency: any quantized wire beats FSDP2's own by far
FAST = (1e13, 1e-6)  # the codec costs more than the bytes it saves: FSDP2's own
LOGGER = "fp8comm.integrations.fsdp2"
RESIDUALS = {"allow_unpartitioned_residuals": True}


def calibration(link: tuple[float, float], codecs: dict | None = None, **kw) -> Calibration:
    """Chosen numbers (tests/unit/test_planned.py's cal()): node-local links 10x the cross-node bandwidth; codecs:
    speeds of named codecs beside "*" (every codec at 1e9 elements/s)."""
    bw, lat = link
    s = lm.CodecSpeed(pack=1e9, unpack_sum=2e9, unpack=2e9)
    args = {"device": "cpu", "ranks_per_node": 2, "backend": "gloo", **kw}
    return Calibration(Link(bw, lat), Link(10 * bw, lat / 10), {"*": s, **(codecs or {})}, **args)


def write(name: str, cal: Calibration | str, rank: int) -> str:
    path = Path(os.environ["FSDP2_TEST_DIR"]) / f"cal_{name}_{rank}.json"
    path.write_text(cal if isinstance(cal, str) else cal.to_json())
    return str(path)


def _model() -> nn.Module:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@contextmanager
def captured():
    log = logging.getLogger(LOGGER)
    h, level = L._Lines(), log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        yield h.lines
    finally:
        log.removeHandler(h)
        log.setLevel(level)


def train(steps: int = STEPS, **options) -> dict:
    """`steps` SGD steps of the model, from the same weights on the same batches; with options under enable()."""
    model = _model()
    fc.reset_comm_stats()
    f2.reset_hook_stats()
    rep = None
    with captured() as lines:
        if options:
            rep = f2.enable(model, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        try:
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + dist.get_rank())
                x = torch.randn(8, 64, generator=g)
                loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
        finally:
            stats, hooks = fc.comm_stats(), f2.hook_stats()
            residuals = [  # error-feedback residuals the gradient hooks hold (bytes of each stored one)
                rs.error_feedback.nbytes()
                for pg in _groups(model)
                if f2.hooks.is_ours(rs := pg._reduce_scatter_comm)
                and rs.error_feedback is not None
                and rs.error_feedback.stored()
            ]
            if options:
                f2.disable(model)
    planner = None if rep is None else rep.planner
    plans = [p.describe() for p in planner.plans] if planner is not None else []
    return {
        "trials": planner.trials() if planner is not None else [],
        "losses": losses,
        "digest": C.digest(C.full_params(model)),
        "stats": stats,
        "hooks": hooks,
        "residuals": residuals,
        "lines": list(lines),
        "plans": plans,
        "report": str(rep),
    }


def _heads(plans: list[str]) -> list[str]:
    return [p.splitlines()[0] for p in plans]


def _decided_alike(plans: list[str]) -> None:
    C.same_on_all_ranks("\n\n".join(plans), "the plans")


def _plan_lines(rank: int, run: dict) -> list[str]:
    """The plan lines rank 0 logged (each plan once), none on the other ranks."""
    got = [x for x in run["lines"] if x.startswith("fp8comm plan: ")]
    if rank == 0:
        assert got == ["fp8comm plan: " + p for p in run["plans"]], (got, run["plans"])
    else:
        assert not got, got
    return got


def _timed(stats: dict, op: str, calls: int) -> dict:
    s = stats[op]
    assert s["timed_calls"] == calls and s["predicted_s"] > 0 and s["measured_s"] > 0, (op, s)
    return {k: s[k] for k in ("timed_calls", "predicted_s", "measured_s")}


# 2 FSDP2 groups (the Linears; the root has no parameters), reshard_after_forward: 2 gathers + 1 reduce per step
AG_CALLS, RS_CALLS = 2 * 2 * STEPS, 2 * STEPS


def planner_slow_link_quantizes(rank, world, info):
    L._nodes(rank)
    path = write("slow", calibration(SLOW), rank)
    # allow_4bit alone: the recipe's memory option (allow_unpartitioned_residuals) is set by the planner and stated
    run = train(planner={"allow_4bit": True, "calibration": path})
    _decided_alike(run["plans"])
    heads = _heads(run["plans"])
    lines = _plan_lines(rank, run)
    info.update(plans=heads, losses=run["losses"], plan_example=lines[:2], report=run["report"].splitlines()[:2])
    assert "allow_unpartitioned_residuals'] (set by the planner)" in run["plans"][1], run["plans"][1]
    assert run["residuals"] and all(n > 0 for n in run["residuals"]), run["residuals"]
    assert heads == [
        "all_gather of weights (bf16), buckets <= 32 KiB (class 15), group 2x2: fp8 two-level",
        "reduce_scatter of gradients (fp32), buckets <= 64 KiB (class 16), group 2x2: mxfp4 +EF two-level",
    ], heads
    assert "recipe: mxfp4 with error feedback" in run["plans"][1], run["plans"][1]
    w, g = run["hooks"]["weights"], run["hooks"]["gradients"]
    assert w["fp8_calls"] == AG_CALLS and g["fp8_calls"] == RS_CALLS and w["native_calls"] == g["native_calls"] == 0
    st = run["stats"]
    info.update(ratios={k: round(v["ratio"], 3) for k, v in st.items()})
    # two levels: the node-local phase in the call's dtype (fp32 sums) or FP8 (weights), the cross-node one
    # (comm_stats' plain op) in 4 bits for gradients and FP8 for weights
    assert st["reduce_scatter"]["ratio"] > 7.0 and st["reduce_scatter.intra"]["ratio"] == 1.0, st
    assert st["all_gather"]["ratio"] > 1.9 and st["all_gather.intra"]["ratio"] > 1.9, st
    assert st["all_gather.intra"]["calls"] > 0 and st["reduce_scatter.intra"]["calls"] > 0, sorted(st)
    info.update(timed={op: _timed(st, op, n) for op, n in (("all_gather", AG_CALLS), ("reduce_scatter", RS_CALLS))})
    assert all(x == x and abs(x) < 1e3 for x in run["losses"]), run["losses"]
    on = "planner on: per collective size class FSDP2's own, FP8 or 4-bit gradients, flat or two-level"
    assert on in run["report"], run["report"]
    # hierarchical=False: the same link, two levels excluded by policy: flat FP8 (no 4 bits: not allowed here)
    flat = train(1, planner={"calibration": path}, hierarchical=False)
    _decided_alike(flat["plans"])
    info.update(plans_flat=_heads(flat["plans"]))
    assert [h.rsplit(": ", 1)[1] for h in _heads(flat["plans"])] == ["fp8 flat", "fp8 flat"], flat["plans"]
    assert all("[policy: two levels off]" in p for p in flat["plans"]), flat["plans"]
    assert not any(k.endswith(".intra") for k in flat["stats"]), sorted(flat["stats"])
    assert run["residuals"] and all(run["residuals"]), run["residuals"]  # the 4-bit recipe keeps its residuals
    # allow_4bit, but mxfp4's codec is so slow that FP8 wins: the plan's FP8 runs as predicted and chosen, WITHOUT
    # error feedback (no residual kept or sent), every gradient call e4m3
    slow4 = lm.CodecSpeed(pack=1e4, unpack_sum=1e4, unpack=1e4)
    path8 = write("slow_mxfp4", calibration(SLOW, codecs={"mxfp4": slow4}), rank)
    calls8: list = []
    rs_into = fc.reduce_scatter_into

    def spy(*a, **kw):
        c = kw["config"]
        calls8.append((c.fmt, c.error_feedback, kw.get("error_feedback") is not None))
        return rs_into(*a, **kw)

    fc.reduce_scatter_into = spy
    try:
        run8 = train(planner={"allow_4bit": True, "calibration": path8}, gradients=RESIDUALS)
    finally:
        fc.reduce_scatter_into = rs_into
    _decided_alike(run8["plans"])
    heads8 = _heads(run8["plans"])
    info.update(plans_fp8_over_mxfp4=heads8, calls_fp8_over_mxfp4=sorted(set(calls8)))
    assert heads8[1:] == [
        "reduce_scatter of gradients (fp32), buckets <= 64 KiB (class 16), group 2x2: fp8 two-level"
    ], heads8
    assert run8["hooks"]["gradients"]["fp8_calls"] == len(calls8) == RS_CALLS, (run8["hooks"], calls8)
    assert set(calls8) == {("e4m3", False, False)}, sorted(set(calls8))
    assert not run8["residuals"], f"{len(run8['residuals'])} error-feedback residuals on a plan without feedback"
    # the user's own error feedback (4 bits not allowed) rides on the FP8 the plan chooses, never dropped in silence
    callsf: list = []

    def spyf(*a, **kw):
        c = kw["config"]
        callsf.append((c.fmt, c.error_feedback, kw.get("error_feedback") is not None))
        return rs_into(*a, **kw)

    fc.reduce_scatter_into = spyf
    try:
        runf = train(1, planner={"calibration": path}, gradients={"error_feedback": True, **RESIDUALS})
    finally:
        fc.reduce_scatter_into = rs_into
    _decided_alike(runf["plans"])
    info.update(plans_user_feedback=_heads(runf["plans"]), calls_user_feedback=sorted(set(callsf)))
    assert _heads(runf["plans"])[1].endswith(": fp8 +EF two-level"), runf["plans"]
    assert "asked for: fp8 with error feedback" in runf["plans"][1], runf["plans"][1]
    assert callsf and set(callsf) == {("e4m3", True, True)}, sorted(set(callsf))
    assert runf["residuals"] and all(runf["residuals"]), runf["residuals"]


def planner_fast_link_is_fsdp2_own(rank, world, info):
    L._nodes(rank)
    plain = train()
    path = write("fast", calibration(FAST), rank)
    # trials off: the file's link is fiction, which trials would correct by measurement (checked below)
    run = train(planner={"allow_4bit": True, "calibration": path, "trials": False}, gradients=RESIDUALS)
    _decided_alike(run["plans"])
    heads = _heads(run["plans"])
    lines = _plan_lines(rank, run)
    info.update(plans=heads, losses=run["losses"], plain=plain["losses"], plan_example=lines[:1])
    # trials on: each size class measures its plan and may try another option; every rank runs the same
    tried = train(TRIAL_STEPS, planner={"calibration": path}, gradients=RESIDUALS)
    _decided_alike([repr(tried["trials"])])
    info["trials"] = tried["trials"]
    assert {t["op"] for t in tried["trials"]} == {"all_gather", "reduce_scatter"}, tried["trials"]
    assert all(t["done"] and t["measured_ms"] for t in tried["trials"]), tried["trials"]
    assert all(x == x for x in tried["losses"]), tried["losses"]
    assert [h.rsplit(": ", 1)[1] for h in heads] == ["engine bf16 (torch gloo)", "engine fp32 (torch gloo)"], heads
    w, g = run["hooks"]["weights"], run["hooks"]["gradients"]
    assert w["native_calls"] == AG_CALLS and g["native_calls"] == RS_CALLS and w["fp8_calls"] == g["fp8_calls"] == 0
    assert run["losses"] == plain["losses"], (run["losses"], plain["losses"])  # bit for bit
    assert run["digest"] == plain["digest"], "parameters differ from FSDP2 without fp8comm"
    st = run["stats"]
    info.update(timed={op: _timed(st, op, n) for op, n in (("all_gather", AG_CALLS), ("reduce_scatter", RS_CALLS))})
    assert st["all_gather"]["wire_bytes"] == 0 and st["reduce_scatter"]["wire_bytes"] == 0, st  # fp8comm sent none


def planner_bad_input_refused_before_bytes(rank, world, info):
    """Every refusal happens before the node table is gathered (the first collective enable() makes) and leaves
    the model without hooks."""
    L._nodes(rank)
    model = _model()
    good = calibration(SLOW)
    other = json.loads(good.to_json())
    other["version"] = "0.0.1"
    cases = {
        "version": (write("version", json.dumps(other), rank), "taken with fp8comm 0.0.1"),
        "device": (write("device", calibration(SLOW, device="cuda:NVIDIA H100"), rank), "taken on device kind"),
        "ranks_per_node": (write("rpn", calibration(SLOW, ranks_per_node=4), rank), "taken with 4 ranks per node"),
        "missing": (str(Path(os.environ["FSDP2_TEST_DIR"]) / "nope.json"), "no such file"),
    }
    gather, calls = topology._gather, []

    def no_comm(*a, **k):
        calls.append(1)
        raise AssertionError("enable() communicated before refusing")

    topology._gather = no_comm
    got = {}
    try:
        for key, (path, want) in cases.items():
            try:
                f2.enable(model, planner={"calibration": path})
                got[key] = "accepted"
            except f2.Fp8CommFsdp2Error as e:
                got[key] = str(e)
            assert want in got[key], (key, got[key])
            assert "fp8comm FSDP2 planner: calibration file" in got[key], got[key]
        try:  # 4-bit gradients keep residuals of the whole gradient: refusing that memory and allowing 4 bits clash
            f2.enable(
                model,
                planner={"allow_4bit": True, "calibration": cases["version"][0]},
                gradients={"allow_unpartitioned_residuals": False},
            )
            got["opt_out"] = "accepted"
        except f2.Fp8CommFsdp2Error as e:
            got["opt_out"] = str(e)
        assert "allow_4bit" in got["opt_out"] and "allow_unpartitioned_residuals': False" in got["opt_out"], got
    finally:
        topology._gather = gather
    info.update(errors=got)
    assert not calls and not f2.is_enabled(model)
    assert not any(f2.hooks.is_ours(pg._all_gather_comm) for pg in _groups(model))


def _groups(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]


def planner_measured_at_enable(rank, world, info):
    """No file: enable() measures the links over the world (gloo), or falls back to the fixed choice, the same
    on every rank either way; one step runs on what was decided."""
    L._nodes(rank)
    run = train(1, planner={"timeout_s": 60})
    _decided_alike(run["plans"])
    said = [x for x in run["lines"] if x.startswith("fp8comm planner: ")]
    C.same_on_all_ranks(str(bool(run["plans"])), "calibrated or not")
    info.update(said=[s.split(" (")[0] for s in said], plans=_heads(run["plans"]))
    if rank == 0:
        assert len(said) == 1 and ("calibrated in" in said[0] or "did not finish" in said[0]), said
    w, g = run["hooks"]["weights"], run["hooks"]["gradients"]
    assert w["calls"] == 4 and g["calls"] == 2, (w, g)
