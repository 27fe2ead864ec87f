"""fp8comm.comm.planned: the engine switch's settings and their errors, the group shape, the choice per collective
(a plan per size class, logged once; the fixed choice without a calibration), predicted and measured time in
comm_stats()."""

from __future__ import annotations

import pytest
import torch

from fp8comm.comm import comm_stats, reset_comm_stats
from fp8comm.comm import linkmodel as lm
from fp8comm.comm.calibration import Calibration, Link
from fp8comm.comm.planned import FALLBACK, PlannerSettings, RuntimePlanner, group_shape, parse_settings
from fp8comm.comm.planner import NATIVE, GroupShape, Option, Policy, predict
from fp8comm.comm.topology import Split
from fp8comm.errors import Fp8CommConfigError

MiB = 1 << 20


def cal(inter_bw: float, speed: float = 1e9) -> Calibration:
    s = lm.CodecSpeed(pack=speed, unpack_sum=2 * speed, unpack=2 * speed)
    return Calibration(Link(inter_bw, 1e-4), Link(10 * inter_bw, 1e-5), {"*": s}, "cpu", 2, "gloo")


def test_settings_values():
    assert parse_settings(True, "x") == PlannerSettings()
    assert parse_settings(False, "x") is None and parse_settings(None, "x") is None
    got = parse_settings({"allow_4bit": True, "calibration": "c.json", "timeout_s": 5}, "x")
    assert got == PlannerSettings(True, "c.json", 5.0)


@pytest.mark.parametrize(
    "value, match",
    [
        ("yes", r"fp8_comm.planner = 'yes' is not valid; valid: true, false, or an object"),
        ({"allow4bit": True}, r"unknown key\(s\) \['allow4bit'\] in fp8_comm.planner"),
        ({"allow_4bit": 1}, r"allow_4bit must be true or false"),
        ({"calibration": 3}, r"calibration must be a file path"),
        ({"timeout_s": 0}, r"timeout_s must be a number > 0"),
    ],
)
def test_settings_errors(value, match):
    with pytest.raises(Fp8CommConfigError, match=match):
        parse_settings(value, "fp8_comm.planner")


def test_allow_4bit_where_the_engine_cannot():
    with pytest.raises(Fp8CommConfigError, match=r"p.allow_4bit: no 4-bit wire here"):
        parse_settings({"allow_4bit": True}, "p", four_bit="no 4-bit wire here")
    assert parse_settings({"allow_4bit": False}, "p", four_bit="no 4-bit wire here") == PlannerSettings()


def test_group_shape():
    assert group_shape(Split((0, 1, 2, 3), (0, 0, 1, 1), 2, ""), 4) == GroupShape(2, 2)
    assert group_shape(Split((0, 1, 2), (0, 0, 1), 0, "uneven"), 3) == GroupShape(1, 3)
    assert group_shape(None, 4) == GroupShape(1, 4)


def test_choice_per_class_logged_once_and_fixed_without_calibration():
    lines: list[str] = []
    rp = RuntimePlanner(PlannerSettings(), Policy(), lines.append, "test")
    # no calibration (a measurement that did not finish): the fixed choice, FP8, two levels where possible
    assert rp.choose("reduce_scatter", 4 * MiB, torch.bfloat16, GroupShape(2, 2), two_level=True).option == FALLBACK
    assert rp.choose("reduce_scatter", 4 * MiB, "bf16", GroupShape(1, 4), two_level=False).option == Option("fp8")
    assert lines == []
    rp.calibration = cal(1e12)  # a link far faster than the codec: the engine's own
    c = rp.choose("reduce_scatter", 4 * MiB, "bf16", GroupShape(2, 2), two_level=True)
    assert c.option.wire == NATIVE and c.native and c.plan is not None
    rp.choose("reduce_scatter", 3 * MiB, "bf16", GroupShape(2, 2), two_level=True)  # the same class: no new line
    assert len(lines) == 1 and lines[0].startswith("fp8comm plan: reduce_scatter of gradients (bf16)")
    rp.calibration = cal(1e6)
    rp._planners.clear()
    slow = rp.choose("reduce_scatter", 4 * MiB, "bf16", GroupShape(2, 2), two_level=True)
    assert slow.option == Option("fp8", "two_level")  # 4 bits not allowed
    flat = rp.choose("reduce_scatter", 4 * MiB, "bf16", GroupShape(2, 2), two_level=False)
    assert flat.option == Option("fp8", "flat")  # no node groups: two levels excluded
    rp4 = RuntimePlanner(PlannerSettings(allow_4bit=True), Policy(allow_4bit=True), lines.append, "test")
    rp4.calibration = cal(1e6)
    g = rp4.choose("reduce_scatter", 4 * MiB, "bf16", GroupShape(2, 2), two_level=True)
    assert g.option == Option("mxfp4", "two_level", feedback=True)
    w = rp4.choose("all_gather", 4 * MiB, "bf16", GroupShape(2, 2), two_level=True)
    assert w.option.wire == "fp8"  # weights at most FP8


def test_native_op_is_the_engines_own_call():
    rp = RuntimePlanner(PlannerSettings(), Policy(), lambda s: None, "test")
    rp.calibration = cal(1e8)
    c = rp.choose("reduce_scatter", 8 * MiB, "bf16", GroupShape(1, 4), two_level=False, native_op="all_reduce")
    native = c.plan.candidate(Option(NATIVE))
    assert native.seconds == pytest.approx(
        predict("all_reduce", 8 * MiB, "bf16", GroupShape(1, 4), Option(NATIVE), rp.calibration)
    )
    assert "the engine's own call: an all-reduce" in c.plan.describe()


def test_timed_records_predicted_and_measured():
    reset_comm_stats()
    rp = RuntimePlanner(PlannerSettings(), Policy(), lambda s: None, "test")
    rp.calibration = cal(1e8)
    shape = GroupShape(1, 4)
    c = rp.choose("all_gather", 2 * MiB, "bf16", shape, two_level=False)
    for _ in range(2):
        with rp.timed("all_gather", c, 2 * MiB, "bf16", shape, "cpu"):
            sum(range(1000))
    s = comm_stats(reset=True)["all_gather"]
    want = predict("all_gather", 2 * MiB, "bf16", shape, c.option, rp.calibration)
    assert s["timed_calls"] == 2 and s["predicted_s"] == pytest.approx(2 * want) and s["measured_s"] > 0
    fixed = RuntimePlanner(PlannerSettings(), Policy(), lambda s: None, "test")
    with fixed.timed(
        "all_gather", fixed.choose("all_gather", MiB, "bf16", shape, two_level=False), MiB, "bf16", shape, "cpu"
    ):
        pass
    assert comm_stats() == {}  # the fixed choice predicts nothing


def test_gpu_timing_is_sampled_and_fp16_planned_as_bf16(monkeypatch):
    """On a GPU each timed call synchronizes the device: only the first TIMED_ON_GPU calls of a plan are timed."""
    import fp8comm.comm.planned as planned

    monkeypatch.setattr(planned, "_sync", lambda device: None)
    reset_comm_stats()
    rp = RuntimePlanner(PlannerSettings(), Policy(), lambda s: None, "test")
    rp.calibration = cal(1e8)
    shape = GroupShape(1, 4)
    c = rp.choose("all_gather", 2 * MiB, torch.float16, shape, two_level=False)
    assert c.plan is rp.choose("all_gather", 2 * MiB, "bf16", shape, two_level=False).plan
    for _ in range(planned.TIMED_ON_GPU + 3):
        with rp.timed("all_gather", c, 2 * MiB, torch.float16, shape, "cuda"):
            pass
    assert comm_stats(reset=True)["all_gather"]["timed_calls"] == planned.TIMED_ON_GPU


def test_missing_calibration_file_says_how_to_write_one(tmp_path):
    rp = RuntimePlanner(PlannerSettings(calibration=str(tmp_path / "none.json")), Policy(), lambda s: None, "p")
    with pytest.raises(Fp8CommConfigError, match=r"p: calibration file .*no such file.*fp8comm calibrate --out FILE"):
        rp.check_file("cpu", 2)


def test_a_plan_far_off_its_prediction_is_logged_once():
    lines: list[str] = []
    rp = RuntimePlanner(PlannerSettings(), Policy(), lines.append, "test")
    rp.calibration = cal(1e6)
    shape = GroupShape(2, 2)
    c = rp.choose("reduce_scatter", 4 * MiB, "bf16", shape, two_level=True)
    lines.clear()
    for _ in range(1 + planned_mod().CHECK_AFTER + 3):  # the first call is left out (compiles)
        rp.record("reduce_scatter", c, 0.010, 0.050)
    off = [ln for ln in lines if "measured 50.0 ms per call over 4 calls, predicted 10.0 ms (5.0x)" in ln]
    assert len(off) == 1 and "class 22" in off[0] and "fp8 two-level" in off[0], lines
    near = RuntimePlanner(PlannerSettings(), Policy(), lines.append, "test")
    near.calibration = cal(1e6)
    lines.clear()
    c2 = near.choose("reduce_scatter", 4 * MiB, "bf16", shape, two_level=True)
    lines.clear()
    for _ in range(10):
        near.record("reduce_scatter", c2, 0.010, 0.015)
    assert lines == []
    reset_comm_stats()


def planned_mod():
    import fp8comm.comm.planned as planned

    return planned


class _Group:
    """The trial's agreement (planned.exchange) with one other member whose values are `other`: [1 if its timings
    are missing, its median measured/predicted ratio]."""

    def __init__(self, monkeypatch, other=None) -> None:
        P = planned_mod()
        self.other, self.calls, self.keys = other, 0, []
        monkeypatch.setattr(P, "exchange", self.exchange)
        monkeypatch.setattr(P.topology, "group_ranks", lambda group: (0, 1))

    def exchange(self, group, key, values):
        assert group is self
        self.calls += 1
        self.keys.append(key)
        return [values] + ([self.other] if self.other is not None else [])


def _run(rp, group, calls, slow):
    """`calls` reduce-scatters of 4 MiB on 2x2, each measured at slow[wire] x its prediction; the options run."""
    shape, ran = GroupShape(2, 2), []
    for _ in range(calls):
        c = rp.choose("reduce_scatter", 4 * MiB, "bf16", shape, two_level=True, group=group)
        pred = rp.predicted("reduce_scatter", 4 * MiB, "bf16", shape, c.option)
        if slow.get(c.option.wire) is not None:
            rp.record("reduce_scatter", c, pred, pred * slow[c.option.wire])
        ran.append(c.option.label("bf16", "gloo"))
    return ran


def test_a_plan_measured_slower_than_another_prediction_tries_it_and_keeps_the_faster(monkeypatch):
    """mxfp4+EF predicted fastest but measured 8x its prediction: the option expected fastest after correcting
    mxfp4's predictions by that (fp8 two-level) runs 1 + TRIAL_CALLS calls and, measured faster, is kept."""
    P = planned_mod()
    lines: list[str] = []
    rp = RuntimePlanner(PlannerSettings(), Policy(allow_4bit=True), lines.append, "test")
    rp.calibration = cal(1e7)
    g = _Group(monkeypatch)
    ran = _run(rp, g, 3 * (1 + P.TRIAL_CALLS) + 4, {"mxfp4": 8.0, "fp8": 1.0, NATIVE: 1.0})
    n = 1 + P.TRIAL_CALLS
    assert ran[:n] == ["mxfp4 +EF two-level"] * n
    assert ran[n : 2 * n] == ["fp8 two-level"] * n  # not mxfp4 flat: predicted 115 ms, expected 8x that
    assert set(ran[2 * n :]) == {"fp8 two-level"}
    assert g.calls == 2  # one agreement per tried option, none once decided
    (a, b) = [k.split("/") for k in g.keys]  # op/dtype/class/serial/round: the same trial, its rounds 1 and 2
    assert a[:4] == b[:4] and a[:3] == ["reduce_scatter", "bf16", "22"] and (a[4], b[4]) == ("1", "2"), g.keys
    tried = [ln for ln in lines if "trying" in ln]
    assert (
        len(tried) == 1 and "mxfp4 +EF two-level measured 638.7 ms (predicted 79.8); trying fp8 two-level" in tried[0]
    )
    kept = [ln for ln in lines if "keeps" in ln]
    assert kept == [
        "fp8comm planner: reduce_scatter of gradients class 22: measured mxfp4 +EF two-level 638.7 ms, "
        "fp8 two-level 131.7 ms; keeps fp8 two-level"
    ]
    (t,) = rp.trials()
    assert t["done"] and t["planned"] == "mxfp4 +EF two-level" and t["running"] == "fp8 two-level"
    assert t["measured_ms"] == {
        "mxfp4 +EF two-level": pytest.approx(638.7, abs=0.1),
        "fp8 two-level": pytest.approx(131.7, abs=0.1),
    }
    reset_comm_stats()


def test_the_slowest_member_decides_and_a_close_prediction_stands(monkeypatch):
    """Every member runs what the group's max ratio says: here another member measured mxfp4 at 1.1x (this one at
    1.0x), above no other option's prediction: no trial, one agreement, the plan stands. Without a group: no trial."""
    P = planned_mod()
    lines: list[str] = []
    rp = RuntimePlanner(PlannerSettings(), Policy(allow_4bit=True), lines.append, "test")
    rp.calibration = cal(1e7)
    g = _Group(monkeypatch, other=[0.0, 1.1])
    ran = _run(rp, g, 2 * (1 + P.TRIAL_CALLS), {"mxfp4": 1.0})
    assert set(ran) == {"mxfp4 +EF two-level"} and g.calls == 1
    assert rp.trials()[0]["measured_ms"] == {"mxfp4 +EF two-level": pytest.approx(79.9 * 1.1, abs=0.1)}
    assert not [ln for ln in lines if "trying" in ln or "keeps" in ln]
    # another member measured it at 2x: above fp8 two-level's 131.8 ms prediction, so that one is tried
    rp2 = RuntimePlanner(PlannerSettings(), Policy(allow_4bit=True), lines.append, "test")
    rp2.calibration = cal(1e7)
    ran = _run(rp2, _Group(monkeypatch, other=[0.0, 2.0]), 2 * (1 + P.TRIAL_CALLS), {"mxfp4": 1.0, "fp8": 1.0})
    assert ran[1 + P.TRIAL_CALLS :] == ["fp8 two-level"] * (1 + P.TRIAL_CALLS)
    rp3 = RuntimePlanner(PlannerSettings(), Policy(allow_4bit=True), lines.append, "test")
    rp3.calibration = cal(1e7)
    c = rp3.choose("reduce_scatter", 4 * MiB, "bf16", GroupShape(2, 2), two_level=True)
    assert rp3.trials() == [] and c.option == c.plan.chosen
    reset_comm_stats()


def test_a_trial_whose_timings_never_come_keeps_the_plan(monkeypatch):
    """A member without timings (handles waited late, or never) holds the decision for every member; after TRIAL_WAIT
    agreements the plan stands."""
    P = planned_mod()
    rp = RuntimePlanner(PlannerSettings(), Policy(allow_4bit=True), lambda s: None, "test")
    rp.calibration = cal(1e7)
    g = _Group(monkeypatch, other=[1.0, 0.0])  # the other member has no timings
    n = 1 + P.TRIAL_CALLS + P.TRIAL_WAIT + 5
    ran = _run(rp, g, n, {"mxfp4": 8.0, "fp8": 1.0})  # this member's timings say: try fp8
    assert set(ran) == {"mxfp4 +EF two-level"} and g.calls == P.TRIAL_WAIT
    assert rp.trials()[0]["done"] and rp.trials()[0]["measured_ms"] == {}
    reset_comm_stats()


def test_a_member_that_never_reports_is_a_clear_error(monkeypatch):
    """The trial's exchange waits up to the store's timeout for every member; past it: Fp8CommStateError naming the
    rank, the trial and the way out (trials off), not torch's bare store timeout."""
    import datetime

    import torch.distributed as dist

    from fp8comm.errors import Fp8CommStateError

    P = planned_mod()
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(milliseconds=200))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(P.topology, "group_ranks", lambda group: (0, 1))
    with pytest.raises(
        Fp8CommStateError, match=r"rank 1 did not report its timings for the trial 'k/1'.*'trials': false"
    ):
        P.exchange(object(), "k/1", [0.0, 1.5])
    tag = __import__("hashlib").sha1(b"0,1").hexdigest()[:12]
    dist.PrefixStore(f"fp8comm-trial/{tag}/k/2/", store).set("1", "[0.0, 2.0]")  # rank 1 reported this time
    assert P.exchange(object(), "k/2", [0.0, 1.5]) == [[0.0, 1.5], [0.0, 2.0]]
