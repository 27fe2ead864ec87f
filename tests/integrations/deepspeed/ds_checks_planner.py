"""The planner in a DeepSpeed engine (issue 30 items 3 and 6): "fp8_comm": {"planner": ...} on 4 ranks laid out as 2
simulated nodes x 2 (LOCAL_WORLD_SIZE=2, GROUP_RANK=rank // 2). Calibration files are written here with chosen link
figures, so the choice is known: a link far faster than any codec must give DeepSpeed's own collectives (then the run
is bit-identical to DeepSpeed without fp8comm), a very slow one the quantized wire in two levels (4 bits for the
gradients when allowed). The "planner" scenario of ds_worker.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import ds_train as T
import torch
import torch.distributed as dist
from ds_checks_levels import _nodes, _same_everywhere, captured

import fp8comm.comm as fc
import fp8comm.integrations.deepspeed as fd
from fp8comm.comm import linkmodel as lm
from fp8comm.comm.calibration import Calibration, Link
from fp8comm.comm.planned import TRIAL_CALLS
from fp8comm.errors import Fp8CommConfigError

STEPS = 3
TRIAL_STEPS = 2 * (1 + TRIAL_CALLS) + 3  # one gradient bucket per step: the plan's calls, a trial's, then settled


def _file(name: str, inter_bw: float, **kw) -> str:
    """A calibration file: cross-node `inter_bw` bytes/s, node-local 10x that, every codec at 1e8 elements/s, 1 ms of
    host time per quantized call (what fp8comm's Python costs a call here: tiny buckets stay DeepSpeed's own)."""
    s = lm.CodecSpeed(pack=1e8, unpack_sum=2e8, unpack=2e8)
    base = dict(
        inter=Link(inter_bw, 1e-4),
        intra=Link(10 * inter_bw, 1e-5),
        codecs={"*": s},
        device="cpu",
        ranks_per_node=2,
        backend="gloo",
        call_overhead=1e-3,
    )
    path = Path(os.environ["FP8COMM_TEST_OUT"]) / f"{name}.json"
    if dist.get_rank() == 0:
        path.write_text(Calibration(**(base | kw)).to_json())
    dist.barrier()
    return str(path)


def _planned(info, stage: int, planner, section: dict | None = None, **zero):
    _nodes()
    fc.reset_comm_stats()
    with captured() as lines:
        eng, _ = T.build(T.ds_config(stage, "bf16", {"planner": planner, **(section or {})}, **zero))
        run = T.train(eng, range(STEPS))
    es = fd.engine_state(eng)
    plans = [(p["op"], p["role"], p["size_class"], p["chosen"]) for p in run.stats["plans"]]
    _same_everywhere(plans)
    info.update(losses=run.losses, plans=plans, hooks=run.stats["hooks"], summary=es.summary)
    stats = fc.comm_stats()
    T.destroy(eng)
    fd.uninstall()
    return run, stats, lines, es


def _plain(stage: int, **zero) -> list:
    _nodes()
    eng, _ = T.build(T.ds_config(stage, "bf16", None, **zero))
    run = T.train(eng, range(STEPS))
    T.destroy(eng)
    return run.losses


def planner_fast_link_is_deepspeeds_own(info):
    """A link no codec can beat: every plan keeps DeepSpeed's own collective, and the run is DeepSpeed's, bit for
    bit; the plans are logged (rank 0) and the calls timed into comm_stats. Trials off: the file's link is fiction,
    which trials would correct by measurement (planner_trial_measures_and_agrees)."""
    path = _file("fast", 1e13)
    for stage in (2, 3):
        run, stats, lines, es = _planned(info, stage, {"calibration": path, "trials": False})
        plain = _plain(stage)  # every collective before any assertion: a rank that fails alone cannot hang the rest
        assert run.stats["plans"] and all(p["chosen"].startswith("engine bf16") for p in run.stats["plans"]), info
        hooks = run.stats["hooks"]
        assert hooks.get("planner.gradients.native", 0) >= STEPS and hooks.get("planner.weights.native", 0) >= 1, hooks
        assert not any(k.startswith("zero12.grad_reduce.fmt") for k in hooks), hooks
        timed = {op: s for op, s in stats.items() if s.get("timed_calls")}
        assert "reduce_scatter" in timed and timed["reduce_scatter"]["measured_s"] > 0, stats
        assert timed["reduce_scatter"]["predicted_s"] > 0, stats
        assert "PLANNED per bucket-size class" in es.summary and "planner on (FP8 at most" in es.summary, es.summary
        plan_lines = [ln for ln in lines if ln.startswith("fp8comm plan:")]
        if dist.get_rank() == 0:
            assert len(plan_lines) == len(run.stats["plans"]), lines
            assert all("engine bf16 (torch gloo)" in ln for ln in plan_lines), plan_lines
            info[f"plan_lines_zero{stage}"] = plan_lines
        else:
            assert not plan_lines, plan_lines
        assert run.losses == plain, (run.losses, plain)


def planner_slow_link_quantizes(info):
    """A slow link: FP8 in two levels for weights and gradients; with allow_4bit the gradients take the 4-bit
    recipe (mxfp4 with error feedback: the residual store fills), the weights stay FP8."""
    path = _file("slow", 1e5)
    run, stats, _, es = _planned(info, 3, {"calibration": path})
    plans3 = info["plans"]
    run4, _, _, es4 = _planned(info, 2, {"calibration": path, "allow_4bit": True})
    fast, slow4 = (
        lm.CodecSpeed(pack=1e8, unpack_sum=2e8, unpack=2e8),
        lm.CodecSpeed(pack=1e4, unpack_sum=1e4, unpack=1e4),
    )
    path8 = _file("slow_mxfp4", 1e5, codecs={"*": fast, "mxfp4": slow4})  # FP8 beats the 4-bit recipe here
    run8, _, _, _ = _planned(info, 2, {"calibration": path8, "allow_4bit": True})
    hooks = run.stats["hooks"]
    assert hooks.get("planner.gradients.fp8.two_level", 0) >= STEPS, hooks
    assert hooks.get("planner.weights.fp8.two_level", 0) >= 1, hooks
    # every class whose bytes matter goes FP8 two-level; the 256-byte class (8) may stay DeepSpeed's own: 1.92 ms
    # predicted against FP8 two-level's 2.07 (its 1 ms fixed cost), on CPU ranks whose per-step latency overlaps the
    # bytes (linkmodel's host_latency)
    assert all("fp8 two-level" in p[3] for p in plans3 if p[2] >= 10), plans3
    assert any(p[2] >= 10 for p in plans3), plans3
    assert stats["reduce_scatter"]["timed_calls"] >= STEPS, stats
    hooks = run4.stats["hooks"]
    assert hooks.get("planner.gradients.mxfp4.two_level", 0) >= STEPS, hooks
    n = sum(v for k, v in hooks.items() if k.startswith("zero12.grad_reduce.fmt."))
    assert n and hooks.get("zero12.grad_reduce.fmt.mxfp4") == n, hooks
    assert run4.stats["error_feedback"]["residuals"] > 0, run4.stats
    assert "planner on (4-bit gradients allowed" in es4.summary, es4.summary
    grads = [p for p in run4.stats["plans"] if p["role"] == "gradients"]
    assert grads and all(p["chosen"] == "mxfp4 +EF two-level" for p in grads), grads
    assert any("allow_unpartitioned_residuals" in n for p in grads for n in p["notes"]), grads
    assert all(x == x for x in run4.losses), run4.losses
    # 4 bits allowed, FP8 chosen: FP8 as predicted, without error feedback (no residual is kept or sent)
    hooks8 = run8.stats["hooks"]
    assert hooks8.get("planner.gradients.fp8.two_level", 0) >= STEPS, hooks8
    n8 = sum(v for k, v in hooks8.items() if k.startswith("zero12.grad_reduce.fmt."))
    assert n8 and hooks8.get("zero12.grad_reduce.fmt.e4m3") == n8, hooks8
    assert run8.stats["error_feedback"]["residuals"] == 0, run8.stats["error_feedback"]
    # the user's own error feedback (4 bits not allowed) is kept on the FP8 the plan chooses, never dropped in silence:
    # predicted with its cost, labelled, and its residual kept
    runf, _, _, _ = _planned(info, 1, {"calibration": path}, {"gradients": {"error_feedback": True}})
    gradsf = [p for p in runf.stats["plans"] if p["role"] == "gradients"]
    assert gradsf and all(p["chosen"] == "fp8 +EF two-level" for p in gradsf), gradsf
    assert runf.stats["error_feedback"]["residuals"] > 0, runf.stats["error_feedback"]


def planner_trial_measures_and_agrees(info):
    """A file whose codecs are infinitely fast and whose link is slow: FP8 is predicted far below anything it can
    measure, so its size class tries DeepSpeed's own collective and keeps the faster as measured. Every rank runs the
    same options (the trial's agreement), the log says what was tried and kept, training stays in step."""
    path = _file(
        "fiction", 1e9, codecs={"*": lm.CodecSpeed(pack=1e15, unpack_sum=1e15, unpack=1e15)}, call_overhead=0.0
    )
    _nodes()
    with captured() as lines:
        eng, _ = T.build(T.ds_config(2, "bf16", {"planner": {"calibration": path}}))
        run = T.train(eng, range(TRIAL_STEPS))
        trials = fd.engine_state(eng).planner.trials()
    flat = torch.cat([p.detach().reshape(-1).float() for p in eng.module.parameters()])
    T.destroy(eng)
    fd.uninstall()
    _same_everywhere(trials)
    _same_everywhere(flat.tolist())
    grads = [t for t in trials if t["op"] == "reduce_scatter"]
    info.update(trials=trials, losses=run.losses)
    assert grads and all(t["done"] for t in grads), trials
    t = grads[0]
    assert t["planned"].startswith("fp8") and "engine bf16 (torch gloo)" in t["measured_ms"], t
    assert t["running"] == min(t["measured_ms"], key=t["measured_ms"].get), t
    hooks = run.stats["hooks"]
    assert hooks.get("planner.gradients.native", 0) >= 1 + TRIAL_CALLS, hooks  # the trial ran DeepSpeed's own
    assert all(x == x for x in run.losses), run.losses
    if dist.get_rank() == 0:
        assert any("trying engine bf16 (torch gloo)" in ln for ln in lines), lines
        assert any("; keeps " in ln for ln in lines), lines


def planner_measured_at_build(info):
    """No file: the links and codecs are measured once over the world at build (gloo), every rank holds the same
    calibration and the same plans."""
    t0 = time.monotonic()
    run, stats, lines, es = _planned(info, 2, True)
    cal = es.planner.calibration
    _same_everywhere(None if cal is None else cal.to_json())
    assert cal is not None and not es.planner.fallback, es.planner.fallback
    info["calibration"] = {
        "inter_Bps": cal.inter.bandwidth,
        "intra_Bps": cal.intra.bandwidth,
        "first_engine_build_and_train_s": time.monotonic() - t0,
        "calibrate_s": es.planner.calibrate_s,
    }
    if dist.get_rank() == 0:
        assert any(ln.startswith("fp8comm planner: calibrated in") for ln in lines), lines


def planner_bad_calibration_file(info):
    """A file from another ranks-per-node layout or fp8comm version: the same error on every rank, before the
    engine is built."""
    _nodes()
    for name, kw, want in (
        ("rpn4", {"ranks_per_node": 4}, "taken with 4 ranks per node, this job has 2"),
        ("old", {"version": "0.0.1"}, "taken with fp8comm 0.0.1"),
        ("gpu", {"device": "cuda:NVIDIA H200"}, "taken on device kind 'cuda:NVIDIA H200', this job runs on 'cpu'"),
    ):
        path = _file(name, 1e9, **kw)
        try:
            T.build(T.ds_config(2, "bf16", {"planner": {"calibration": path}}))
        except Fp8CommConfigError as e:
            assert want in str(e) and "fp8_comm.planner" in str(e), str(e)
        else:
            raise AssertionError(f"{name}: the calibration file was accepted")
        fd.uninstall()
    missing = str(Path(os.environ["FP8COMM_TEST_OUT"]) / "nope.json")
    try:
        T.build(T.ds_config(2, "bf16", {"planner": {"calibration": missing}}))
    except Fp8CommConfigError as e:
        assert "no such file" in str(e), str(e)
    else:
        raise AssertionError("a missing calibration file was accepted")
    fd.uninstall()


CHECKS = [
    planner_bad_calibration_file,
    planner_fast_link_is_deepspeeds_own,
    planner_slow_link_quantizes,
    planner_trial_measures_and_agrees,
    planner_measured_at_build,
]
