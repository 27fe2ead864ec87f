"""fp8comm.comm.planner and .calibration, and `fp8comm plan`: predictions are linkmodel's, choices obey the policy and
are deterministic per size class, calibrations round-trip and refuse another version / device kind / layout."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8comm import __version__
from fp8comm.comm import linkmodel as lm
from fp8comm.comm.calibration import Calibration, Link, measure_codecs, results_speeds
from fp8comm.comm.pieces import piece_count
from fp8comm.comm.planner import (
    NATIVE,
    GroupShape,
    Option,
    Planner,
    Policy,
    choose,
    class_bytes,
    options,
    predict,
    size_class,
)
from fp8comm.errors import Fp8CommConfigError
from fp8comm.tools import cli

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
SHAPE = GroupShape(8, 8)


def cal_of(m: lm.Machine, device: str = "cuda:NVIDIA H200", **kw) -> Calibration:
    base = dict(
        inter=Link(m.inter_bw, m.inter_lat),
        intra=Link(m.intra_bw, m.intra_lat),
        codecs=m.codecs,
        device=device,
        ranks_per_node=m.g,
        node_local_cap=m.intra_node_bw,
        source=m.name,
    )
    return Calibration(**(base | kw))


def toy(inter_bw=1e9, intra_bw=1e10, speed=1e9, device="cpu", backend="gloo", **kw) -> Calibration:
    s = lm.CodecSpeed(pack=speed, unpack_sum=2 * speed, unpack=2 * speed)
    return Calibration(Link(inter_bw, 1e-5), Link(intra_bw, 1e-6), {"*": s}, device, 4, backend, **kw)


# ------------------------------------------------------------------------------- predict is linkmodel.time
def test_predict_is_linkmodels_time():
    b = cal_of(lm.SHAPES[1])
    m = b.machine(8, 8)
    E = 64 * MiB
    assert (
        predict("reduce_scatter", 2 * E, "bf16", SHAPE, Option(NATIVE), b)
        == lm.time("reduce_scatter", "ring", "bf16", m, E).seconds
    )
    assert (
        predict("all_gather", 4 * E, "fp32", SHAPE, Option(NATIVE), b)
        == lm.time("all_gather", "ring", "fp32", m, E).seconds
    )
    two = Option("fp8", "two_level")
    assert (
        predict("reduce_scatter", 2 * E, "bf16", SHAPE, two, b)
        == lm.time("reduce_scatter", "two_level", "fp8", m, E).seconds
    )
    ef = Option("mxfp4", "flat", feedback=True)
    got = predict("reduce_scatter", 2 * E, "bf16", SHAPE, ef, b)
    assert got == lm.time("reduce_scatter", "flat", "mxfp4", m, E, feedback=True).seconds
    assert got > lm.time("reduce_scatter", "flat", "mxfp4", m, E).seconds  # the residual stage costs time
    # gloo: the engine's own reduce-scatter is torch's gloo call (an all-reduce of a clone); CPU: pieces as fp8comm cuts
    c = toy()
    mc = c.machine(2, 4)
    sh = GroupShape(2, 4)
    assert (
        predict("reduce_scatter", 2 * E, "bf16", sh, Option(NATIVE), c)
        == lm.time("reduce_scatter", "gloo", "bf16", mc, E).seconds
    )
    p = piece_count(E, __import__("torch").device("cpu"), "nearest", 0)
    assert p > 1
    assert (
        predict("reduce_scatter", 2 * E, "bf16", sh, two, c)
        == lm.time("reduce_scatter", "two_level", "fp8", mc, E, p).seconds
    )
    # a flat all-gather is cut from its shard; NVFP4 travels in one piece
    ps = piece_count(E // 8, __import__("torch").device("cpu"), "nearest", 0)
    assert (
        predict("all_gather", 2 * E, "bf16", sh, Option("fp8"), c)
        == lm.time("all_gather", "flat", "fp8", mc, E, ps).seconds
    )
    assert (
        predict("reduce_scatter", 2 * E, "bf16", sh, Option("nvfp4"), c)
        == lm.time("reduce_scatter", "flat", "nvfp4", mc, E).seconds
    )


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_reduce"])
def test_predict_grows_with_bytes(op):
    for cal in (cal_of(lm.SHAPES[0]), cal_of(lm.SHAPES[2]), toy()):
        for o in options("gradients" if op != "all_gather" else "weights"):
            ts = [predict(op, 2 * MiB << k, "bf16", SHAPE, o, cal) for k in range(0, 10, 3)]
            assert all(a < b for a, b in zip(ts, ts[1:])), (o, ts)


def test_two_levels_win_where_the_cross_node_link_is_the_bottleneck():
    slow = toy(inter_bw=1e9, intra_bw=1e11, speed=1e11, device="cuda:X", backend="nccl")
    for op in ("reduce_scatter", "all_gather"):
        for wire in ("fp8", "mxfp4"):
            flat = predict(op, 256 * MiB, "bf16", SHAPE, Option(wire, "flat"), slow)
            two = predict(op, 256 * MiB, "bf16", SHAPE, Option(wire, "two_level"), slow)
            assert two < flat, (op, wire)
    # one rank per node: nothing to do inside a node, two levels do not apply
    with pytest.raises(Fp8CommConfigError, match="two levels need"):
        predict("reduce_scatter", MiB, "bf16", GroupShape(8, 1), Option("fp8", "two_level"), slow)
    plan = choose("reduce_scatter", MiB, "bf16", GroupShape(8, 1), Policy(), slow)
    assert all(c.seconds is None for c in plan.candidates if c.option.levels == "two_level")


def test_engines_own_wins_on_fast_links_with_a_slow_codec():
    fast = toy(inter_bw=1e12, intra_bw=1e12, speed=1e8, device="cuda:X", backend="nccl")
    pol = Policy(allow_4bit=True, allow_4bit_updates=True, fp8_scales=("fp32", "e8m0"))
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        assert choose(op, 256 * MiB, "bf16", SHAPE, pol, fast).chosen == Option(NATIVE)
    # the same cluster with a slow link and a fast codec quantizes
    slow = toy(inter_bw=1e9, intra_bw=1e11, speed=1e12, device="cuda:X", backend="nccl")
    assert not choose("reduce_scatter", 256 * MiB, "bf16", SHAPE, pol, slow).chosen.native


def test_users_error_feedback_rides_on_fp8_gradients():
    """Policy.fp8_feedback (the user asked for error feedback, 4 bits not allowed): FP8 gradient options carry it,
    predicted with its cost, labelled and noted; weights never; without it FP8 runs without. keeps_feedback says
    what a planned call keeps."""
    from fp8comm.comm.planned import Choice, keeps_feedback

    grads = options("gradients", fp8_feedback=True)
    assert all(o.feedback for o in grads if not o.native and o.wire != "nvfp4"), grads
    assert not any(o.feedback for o in options("weights", fp8_feedback=True))
    assert not any(o.feedback for o in options("gradients") if o.wire.startswith("fp8"))
    slow = toy(inter_bw=1e8, intra_bw=1e11, speed=1e9, device="cuda:X", backend="nccl")
    ef = choose("reduce_scatter", 256 * MiB, "bf16", SHAPE, Policy(fp8_feedback=True), slow)
    plain = choose("reduce_scatter", 256 * MiB, "bf16", SHAPE, Policy(), slow)
    assert ef.chosen == Option("fp8", "two_level", feedback=True) and plain.chosen == Option("fp8", "two_level")
    assert ef.chosen.label() == "fp8 +EF two-level"
    assert any(x.startswith("asked for: fp8 with error feedback") for x in ef.notes), ef.notes
    secs = {c.option: c.seconds for c in plain.candidates}
    fp8 = [c for c in ef.candidates if c.option.wire.startswith("fp8") and c.seconds is not None]
    assert fp8 and all(c.seconds > secs[Option(c.option.wire, c.option.levels)] for c in fp8)  # EF costs time
    assert keeps_feedback(None) and keeps_feedback(Choice(ef.chosen, ef))
    assert not keeps_feedback(Choice(plain.chosen, plain))
    with pytest.raises(Fp8CommConfigError, match="fp8_feedback must be True or False"):
        Policy(fp8_feedback=1)


# ------------------------------------------------------------------------------------------------ choose()
def _fastest_allowed(plan):
    ok = [(c.seconds, i) for i, c in enumerate(plan.candidates) if not c.excluded and c.seconds is not None]
    return plan.candidates[min(ok)[1]].option


def test_choose_obeys_the_policy():
    slow = toy(inter_bw=1e8, intra_bw=1e11, speed=1e12, device="cuda:X", backend="nccl")
    n = 256 * MiB
    # 4 bits are the fastest wire here, for gradients and weights alike
    rs = choose("reduce_scatter", n, "bf16", SHAPE, Policy(), slow)
    ag = choose("all_gather", n, "bf16", SHAPE, Policy(), slow)
    four = min(c.seconds for c in rs.candidates if c.option.wire in ("mxfp4", "nvfp4"))
    assert four < min(c.seconds for c in rs.candidates if c.option.wire not in ("mxfp4", "nvfp4"))
    assert rs.chosen.wire == "fp8" and ag.chosen.wire == "fp8"  # not allowed: at most FP8
    assert "4-bit gradients not allowed" in rs.reason or "recipe" in rs.reason
    # gradients in 4 bits when allowed: the recipe only (mxfp4 with error feedback), never nvfp4
    rs4 = choose(
        "reduce_scatter",
        n,
        "bf16",
        SHAPE,
        Policy(allow_4bit=True, residual_option="allow_unpartitioned_residuals"),
        slow,
    )
    assert rs4.chosen.wire == "mxfp4" and rs4.chosen.feedback
    assert any("allow_unpartitioned_residuals" in x for x in rs4.notes)
    assert all(c.excluded.startswith("numerics") for c in rs4.candidates if c.option.wire == "nvfp4")
    # 4-bit gradients do not open 4-bit weights; 4-bit updates do
    assert choose("all_gather", n, "bf16", SHAPE, Policy(allow_4bit=True), slow).chosen.wire == "fp8"
    ag4 = choose("all_gather", n, "bf16", SHAPE, Policy(allow_4bit_updates=True), slow)
    assert ag4.chosen.wire == "mxfp4" and not ag4.chosen.feedback
    # e8m0 scales and two levels only when allowed
    assert all(c.excluded for c in rs.candidates if c.option.wire == "fp8_e8m0")
    flat = choose("reduce_scatter", n, "bf16", SHAPE, Policy(two_level=False), slow)
    assert flat.chosen.levels == "flat"
    for plan in (rs, ag, rs4, ag4, flat):
        assert plan.chosen == _fastest_allowed(plan)


def test_policy_refuses_4bit_updates_without_replicas():
    with pytest.raises(Fp8CommConfigError, match="replicas"):
        Policy(allow_4bit_updates=True, replicas=False)
    with pytest.raises(Fp8CommConfigError, match="fp8_scales"):
        Policy(fp8_scales=("fp16",))
    with pytest.raises(Fp8CommConfigError, match="residual_dtype|float32"):
        Policy(residual_dtype="int8")
    with pytest.raises(Fp8CommConfigError, match="unknown wire"):
        Option("fp6")
    with pytest.raises(Fp8CommConfigError, match="engine's own"):
        Option(NATIVE, "two_level")
    with pytest.raises(Fp8CommConfigError, match="unknown op"):
        choose("broadcast", MiB, "bf16", SHAPE, Policy(), toy())
    with pytest.raises(Fp8CommConfigError, match="multiple of fp32"):
        predict("all_gather", 6, "fp32", SHAPE, Option(NATIVE), toy())
    with pytest.raises(Fp8CommConfigError, match="unknown dtype"):
        predict("all_gather", 8, "fp16", SHAPE, Option(NATIVE), toy())


def test_size_classes_and_determinism():
    assert [size_class(n) for n in (1, 2, 3, 4, MiB, MiB + 1)] == [0, 1, 2, 2, 20, 21]
    assert class_bytes(size_class(3 * MiB)) == 4 * MiB and class_bytes(0, "fp32") == 4
    cal, pol = cal_of(lm.SHAPES[2]), Policy(allow_4bit=True)
    a = choose("reduce_scatter", 96 * MiB, "bf16", SHAPE, pol, cal)
    b = choose("reduce_scatter", 128 * MiB, "bf16", SHAPE, pol, cal)  # same class: the same plan
    assert a == b and a.nbytes == 128 * MiB
    # a fresh calibration from the published JSON (what another rank holds) gives the identical plan
    other = Calibration.from_json(cal.to_json())
    assert choose("reduce_scatter", 96 * MiB, "bf16", SHAPE, pol, other) == a
    planner = Planner(pol, cal)
    assert planner.plan("reduce_scatter", 100 * MiB, "bf16", SHAPE) is planner.plan(
        "reduce_scatter", 65 * MiB, "bf16", SHAPE
    )
    assert planner.plan("reduce_scatter", 64 * MiB, "bf16", SHAPE).size_class == 26
    assert len(planner.plans) == 2


def test_ties_keep_the_earlier_option(monkeypatch):
    """Equal predictions: the option earlier in options()' fixed order wins, the engine's own first."""
    from fp8comm.comm import planner

    monkeypatch.setattr(planner, "predict", lambda op, n, d, shape, o, cal: 1.0)
    pol = Policy(allow_4bit=True, fp8_scales=("e8m0", "fp32"))
    assert choose("reduce_scatter", MiB, "bf16", SHAPE, pol, toy()).chosen == Option(NATIVE)
    monkeypatch.setattr(planner, "predict", lambda op, n, d, shape, o, cal: 2.0 if o.native else 1.0)
    assert choose("reduce_scatter", MiB, "bf16", SHAPE, pol, toy()).chosen == Option("fp8", "flat")
    monkeypatch.setattr(planner, "predict", lambda op, n, d, shape, o, cal: 1.0 if o.levels == "two_level" else 2.0)
    assert choose("reduce_scatter", MiB, "bf16", SHAPE, pol, toy()).chosen == Option("fp8", "two_level")


def test_describe_and_dict_name_every_option():
    plan = choose("reduce_scatter", 128 * MiB, "bf16", SHAPE, Policy(), cal_of(lm.SHAPES[1]))
    text = plan.describe()
    assert text.count("\n") == 1 + len(options("gradients"))
    assert "* fp8 two-level" in text
    d = plan.to_dict()
    assert d["chosen"] == "fp8 two-level" and len(d["options"]) == len(options("gradients"))
    json.dumps(d)


# ------------------------------------------------------------------------------------------- calibration
def test_calibration_round_trip_and_refusals():
    cal = cal_of(lm.SHAPES[2], world_size=64, notes=("test",))
    text = cal.to_json()
    assert Calibration.from_json(text) == cal
    assert Calibration.from_json(text, device="cuda:NVIDIA H200", ranks_per_node=8) == cal
    d = json.loads(text)
    # another world size is accepted
    assert Calibration.from_dict(d | {"world_size": 16}, ranks_per_node=8).world_size == 16
    with pytest.raises(
        Fp8CommConfigError, match=r"fp8comm 0\.0\.1, this is fp8comm " + __version__.replace(".", r"\.")
    ):
        Calibration.from_dict(d | {"version": "0.0.1"})
    with pytest.raises(Fp8CommConfigError, match="device kind 'cuda:NVIDIA H200'.*'cpu'"):
        Calibration.from_json(text, device="cpu")
    with pytest.raises(Fp8CommConfigError, match="8 ranks per node, this job has 4"):
        Calibration.from_json(text, ranks_per_node=4)
    with pytest.raises(Fp8CommConfigError, match="'inter.bandwidth' missing"):
        Calibration.from_dict(d | {"inter": {"latency": 1e-6}})
    with pytest.raises(Fp8CommConfigError, match="'codecs.fp8.pack' must be a number"):
        Calibration.from_dict(d | {"codecs": {"fp8": {"pack": "fast", "unpack_sum": 1, "unpack": 1}}})
    with pytest.raises(Fp8CommConfigError, match="not an fp8comm calibration"):
        Calibration.from_dict({"name": "x"})
    with pytest.raises(Fp8CommConfigError, match="not JSON"):
        Calibration.from_json("{")
    with pytest.raises(Fp8CommConfigError, match="bandwidth must be a positive"):
        Link(0, 1e-6)
    with pytest.raises(Fp8CommConfigError, match="unknown backend"):
        dataclasses.replace(cal, backend="mpi")
    with pytest.raises(Fp8CommConfigError, match="no such file"):
        Calibration.load("/nonexistent/calibration.json")


def test_codec_speeds_from_results_rows():
    rows = [
        {"name": f"codec_mxfp4_{k}_elems_per_s", "value": v, "device": "H200", "date": "d", "commit": "c"}
        for k, v in (("pack", 1e11), ("unpack_sum", 2e11), ("unpack", 3e11))
    ] + [{"name": "pack_fp32_vs_copy_256MiB", "value": 0.57}]
    got = results_speeds(rows, "gpu.json")
    assert set(got) == {"mxfp4"} and got["mxfp4"].unpack == 3e11 and got["mxfp4"].residual_speed == 3e11
    with pytest.raises(Fp8CommConfigError, match="lacks rows for unpack"):
        results_speeds(rows[:2], "gpu.json")
    with pytest.raises(Fp8CommConfigError, match="no codec speed rows"):
        results_speeds(rows[3:], "gpu.json")


def test_measure_codecs_here():
    got = measure_codecs(elems=8 * 4096, reps=1)
    assert set(got) == {"fp8", "fp8_e8m0", "mxfp4", "nvfp4"}
    for s in got.values():
        for k in ("pack", "unpack_sum", "unpack", "residual"):
            assert math.isfinite(getattr(s, k)) and getattr(s, k) > 0
        assert "measured here (cpu" in s.source


# ---------------------------------------------------------------------------------------------------- CLI
# The three shapes of docs/scaling.md (linkmodel.SHAPES), as a user types them
SHAPE_ARGS = {
    0: ["--inter", "8x400Gbit", "--intra", "450GB/s"],
    1: ["--inter", "100Gbit", "--intra", "450GB/s"],
    2: ["--inter", "100Gbit", "--intra", "25GB/s", "--node-local-cap", "50GB/s", "--intra-latency", "5us"],
}


def _plan_json(capsys, *args) -> dict:
    assert cli.main(["plan", "--nodes", "8", "--gpus-per-node", "8", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("i", sorted(SHAPE_ARGS))
@pytest.mark.parametrize("allow", [False, True])
def test_cli_plans_the_three_shapes_as_the_planner_does(capsys, i, allow):
    extra = ["--allow-4bit", "--allow-4bit-updates"] if allow else []
    r = _plan_json(capsys, *SHAPE_ARGS[i], "--buckets", "64Mix3", *extra)
    cal = cal_of(lm.SHAPES[i])
    pol = Policy(allow_4bit=allow, allow_4bit_updates=allow)
    for col in r["collectives"]:
        want = choose(col["op"], 128 * MiB, "bf16", SHAPE, pol, cal)
        (cl,) = col["classes"]
        assert cl["plan"]["chosen"] == want.chosen.label("bf16", "nccl")
        # buckets of exactly a class's size: the planner is no slower than any allowed fixed choice
        step = col["per_step_ms"]
        allowed = [v for k, v in step.items() if k != "planner" and v is not None and k not in col["not_allowed"]]
        assert step["planner"] <= min(allowed) * (1 + 1e-12)
        assert step["planner"] == pytest.approx(3 * want.seconds * 1e3, rel=1e-12)
    assert r["total_ms"]["planner"] == pytest.approx(sum(c["per_step_ms"]["planner"] for c in r["collectives"]))


def test_cli_params_cut_into_buckets(capsys):
    r = _plan_json(capsys, *SHAPE_ARGS[1], "--params", "1B")  # default bucket: max(40M, 1M x 64 GPUs) = 64M
    assert r["step"]["buckets"] == {"64000000": 15, "40000000": 1}
    r = _plan_json(capsys, *SHAPE_ARGS[1], "--params", "1B", "--bucket-size", "250M", "--grad-op", "all_reduce")
    assert r["step"]["buckets"] == {"250000000": 4} and [c["op"] for c in r["collectives"]] == ["all_reduce"]


def test_cli_end_to_end_prints_the_choices():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "fp8comm.tools.cli", "plan", "--nodes", "8", "--gpus-per-node", "8",
         *SHAPE_ARGS[1], "--params", "7B", "--allow-4bit"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "* mxfp4 +EF two-level" in out.stdout and "* fp8 two-level" in out.stdout
    assert "| planner" in out.stdout and "docs/benchmarks.md" in out.stdout


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--inter", "400", "--intra", "450GB/s", "--params", "7B"], "--inter: cannot read '400'; give a unit"),
        (["--inter", "400Gbit", "--intra", "fast", "--params", "7B"], "--intra: cannot read 'fast'"),
        (["--inter", "400Gbit", "--intra", "450GB/s"], "--params"),
        (["--inter", "400Gbit", "--intra", "450GB/s", "--params", "7B", "--buckets", "1M"], "one of them"),
        (["--inter", "400Gbit", "--intra", "450GB/s", "--params", "seven"], "--params: cannot read 'seven'"),
        (["--inter", "1Gbit", "--intra", "1GB/s", "--params", "7B", "--inter-latency", "5"], "--inter-latency"),
        (
            ["--inter", "1Gbit", "--intra", "1GB/s", "--params", "7B", "--allow-4bit-updates", "--no-replicas"],
            "keeps no weight replicas|weight replicas",
        ),
        (["--inter", "1Gbit", "--intra", "1GB/s", "--params", "7B", "--fp8-scales", "fp16"], "fp8_scales"),
        (
            ["--inter", "1Gbit", "--intra", "1GB/s", "--params", "7B", "--codec-speeds", "/nonexistent/gpu.json"],
            "neither gpu, cpu nor an existing file.*written by a GPU run",
        ),
    ],
)
def test_cli_bad_input_is_a_clear_error(capsys, args, msg):
    assert cli.main(["plan", "--nodes", "2", "--gpus-per-node", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8comm plan: ") and __import__("re").search(msg, err), err


def test_cli_codec_speeds_from_files(capsys, tmp_path):
    cal = cal_of(lm.SHAPES[0])
    f = tmp_path / "cal.json"
    f.write_text(cal.to_json())
    r = _plan_json(capsys, *SHAPE_ARGS[0], "--buckets", "64Mi", "--codec-speeds", str(f))
    assert r["cluster"]["device"] == cal.device and str(f) in r["cluster"]["source"]
    f.write_text(json.dumps(json.loads(cal.to_json()) | {"version": "0.0.1"}))
    assert cli.main(["plan", "--nodes", "8", "--gpus-per-node", "8", *SHAPE_ARGS[0], "--buckets", "64Mi",
                     "--codec-speeds", str(f)]) == 2  # fmt: skip
    assert "fp8comm 0.0.1" in capsys.readouterr().err
    rows = tmp_path / "gpu.json"
    rows.write_text(json.dumps([{"name": "pack_fp32_vs_copy_256MiB", "value": 0.57}]))
    assert cli.main(["plan", "--nodes", "8", "--gpus-per-node", "8", *SHAPE_ARGS[0], "--buckets", "64Mi",
                     "--codec-speeds", str(rows)]) == 2  # fmt: skip
    assert "no codec speed rows" in capsys.readouterr().err


def test_gpu_speeds_are_the_committed_gpu_run():
    """linkmodel.gpu_speeds()' 4-bit and residual figures are docs/results/gpu.json's rows (the H200 run of
    2026-12-04), and `fp8comm plan --codec-speeds docs/results/gpu.json` reads that file."""
    path = Path(__file__).resolve().parents[2] / "docs" / "results" / "gpu.json"
    measured = results_speeds(json.loads(path.read_text()), str(path))
    used = lm.gpu_speeds()
    for codec in ("mxfp4", "nvfp4"):
        for kind in ("pack", "unpack_sum", "unpack", "residual"):
            assert getattr(used[codec], kind) == pytest.approx(getattr(measured[codec], kind), rel=1e-3), (codec, kind)
    for codec in ("fp8", "fp8_e8m0"):
        assert used[codec].residual == pytest.approx(measured[codec].residual, rel=1e-3)
    assert all(s.fixed > 0 for s in measured.values())  # the file form charges the fixed cost per call
