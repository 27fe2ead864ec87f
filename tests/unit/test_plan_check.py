"""launch/plan_check.py's comparison (no ranks started) and the model pieces it relies on: a codec speed per kernel
regime (CodecSpeed.above), the fixed cost per kernel call, the metadata check's cost per quantized call, and their
round trip through a calibration's JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fp8comm.comm import linkmodel
from fp8comm.comm.calibration import Calibration, Link
from fp8comm.comm.linkmodel import CodecSpeed
from fp8comm.comm.planner import GroupShape, Option, estimate, predict
from fp8comm.errors import Fp8CommConfigError

ROOT = Path(__file__).resolve().parents[2]


def _plan_check():
    spec = importlib.util.spec_from_file_location("plan_check", ROOT / "launch" / "plan_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["plan_check"] = mod
    spec.loader.exec_module(mod)
    return mod


LARGE = CodecSpeed(8e8, 4e8, 4e8, "large")
SMALL = CodecSpeed(1e8, 2e8, 2e8, "small", fixed=1e-4, above=(1 << 20, LARGE))


def _cal(**kw) -> Calibration:
    return Calibration(
        inter=Link(1e9, 1e-4),
        intra=Link(5e8, 5e-5),
        codecs={"fp8": SMALL, "mxfp4": CodecSpeed(3e8, 6e8, 6e8, "x")},
        device="cpu",
        ranks_per_node=2,
        backend="gloo",
        **kw,
    )


def test_regimes_and_fixed_costs():
    assert SMALL.at(1 << 20) is LARGE and SMALL.at((1 << 20) - 1) is SMALL and SMALL.at(None) is SMALL
    m = _cal().machine(2, 2)
    assert m.host_local and m.host_latency  # CPU ranks: node-local copies and per-step latency on their own cores
    assert not replace(_cal(), device="cuda").machine(2, 2).host_latency  # GPUs: the network's latency, summed
    # flat reduce-scatter of 64Ki elements: the kernel is chosen from the whole buffer (small: the reference's
    # speeds, a fixed cost per pack and per unpack_sum call), one piece
    e = linkmodel.time("reduce_scatter", "flat", "fp8", m, 1 << 16)
    st = dict(e.stages)
    assert st["pack"] == pytest.approx((1 << 16) / 1e8 + 1e-4)
    assert st["unpack_sum"] == pytest.approx((1 << 16) / 2e8 + 1e-4)
    # 4 Mi elements: the large kernel, no fixed cost
    e = linkmodel.time("reduce_scatter", "flat", "fp8", m, 1 << 22, 2)
    assert dict(e.stages)["pack"] == pytest.approx((1 << 22) / 8e8)
    # a flat all-gather packs the shard (small kernel) and decodes the whole buffer (large kernel)
    st = dict(linkmodel.time("all_gather", "flat", "fp8", m, 1 << 21).stages)
    assert st["pack"] == pytest.approx((1 << 19) / 1e8 + 1e-4) and st["unpack"] == pytest.approx((1 << 21) / 4e8)
    # without regimes or fixed costs nothing changes (tests/unit/test_linkmodel.py pins those figures)
    plain = CodecSpeed(1e8, 2e8, 2e8)
    m2 = linkmodel.Machine("x", 2, 2, 1e9, 1e-4, 5e8, 5e-5, {"fp8": plain})
    assert dict(linkmodel.time("reduce_scatter", "flat", "fp8", m2, 1 << 16).stages)["pack"] == (1 << 16) / 1e8


def test_call_overhead_once_per_quantized_call():
    # once per call, less what the first piece's work before the wire hides (the check travels meanwhile)
    a, b = _cal(), _cal(call_overhead=2e-2)
    nb = 1 << 20
    for opt in (Option("fp8"), Option("fp8", "two_level"), Option("mxfp4")):
        e = estimate("reduce_scatter", nb, "bf16", GroupShape(2, 2), opt, a)
        names = [n for n, _ in e.stages]
        first = names.index("wire" if "wire" in names else "rails wire")
        lead = sum(s for _, s in e.stages[:first]) / e.pieces
        assert 0 < lead < 2e-2
        assert predict("reduce_scatter", nb, "bf16", GroupShape(2, 2), opt, b) == pytest.approx(
            predict("reduce_scatter", nb, "bf16", GroupShape(2, 2), opt, a) + 2e-2 - lead
        )
    native = Option("native")
    assert predict("all_gather", nb, "bf16", GroupShape(2, 2), native, b) == predict(
        "all_gather", nb, "bf16", GroupShape(2, 2), native, a
    )


def test_calibration_round_trip_with_regimes():
    cal = _cal(call_overhead=7e-4)
    back = Calibration.from_json(cal.to_json(), device="cpu", ranks_per_node=2)
    assert back == cal and back.codecs["fp8"].above == (1 << 20, LARGE) and back.call_overhead == 7e-4
    d = json.loads(cal.to_json())
    d["codecs"]["fp8"]["above"]["numel"] = 0
    with pytest.raises(Fp8CommConfigError, match="above.numel"):
        Calibration.from_dict(d)
    with pytest.raises(Fp8CommConfigError, match="fixed"):
        _cal().__class__(**{**_cal().__dict__, "codecs": {"fp8": CodecSpeed(1, 1, 1, fixed=-1.0)}})


def test_small_calls_round_trip_and_bad_ones_are_named():
    small = {"all_gather/flat/fp8": 3e-3, "reduce_scatter/gloo/fp32": 4e-3}
    cal = _cal(small_calls=small, small_call_elems=4096, world_size=4)
    back = Calibration.from_json(cal.to_json(), device="cpu", ranks_per_node=2)
    assert back == cal and back.machine(2, 2).small_calls == small and back.machine(2, 2).small_elems == 4096
    # timed on 2 x 2: another layout's calls run other steps on other links, so they charge call_overhead
    assert back.machine(4, 2).small_calls == {} == back.machine(1, 4).small_calls
    assert _cal(small_calls=small, small_call_elems=4096).machine(2, 2).small_calls == {}  # layout unknown
    # the planner's own estimate of the engine's own call takes its small call (key op/gloo/dtype)
    opt, shape = Option("native"), GroupShape(2, 2)
    with_small = predict("reduce_scatter", 1 << 20, "fp32", shape, opt, back)
    without = predict("reduce_scatter", 1 << 20, "fp32", shape, opt, _cal(world_size=4))
    bare = linkmodel.time("reduce_scatter", "gloo", "fp32", _cal().machine(2, 2), 4096).seconds
    assert with_small == pytest.approx(without + 4e-3 - bare)
    old = json.loads(_cal().to_json())
    del old["small_calls"], old["small_call_elems"]  # files from before the small calls: none, call_overhead stands
    assert Calibration.from_dict(old).small_calls == {}
    for kw, msg in [
        ({"small_calls": {"all_gather/flat/fp6": 1e-3}, "small_call_elems": 8}, "key 'all_gather/flat/fp6'"),
        ({"small_calls": {"all_gather/ring": 1e-3}, "small_call_elems": 8}, "key 'all_gather/ring'"),
        ({"small_calls": {"all_gather/flat/fp8": -1.0}, "small_call_elems": 8}, "small_calls['all_gather/flat/fp8']"),
        ({"small_calls": {"all_gather/flat/fp8": 1e-3}}, "small_call_elems must be an int >= 1"),
        ({"small_call_elems": 2.5}, "small_call_elems must be an int"),
    ]:
        with pytest.raises(Fp8CommConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            _cal(**kw)
    d = json.loads(cal.to_json())
    d["small_calls"]["all_gather/flat/fp8"] = "fast"
    with pytest.raises(Fp8CommConfigError, match="small_calls.all_gather/flat/fp8"):
        Calibration.from_dict(d)


def test_compare_rows_against_the_planner():
    pc = _plan_check()
    cal = _cal()
    rows = [
        {"op": "reduce_scatter", "size": 1 << 20, "count": 1 << 19, "variant": v, "time": t}
        for v, t in (("bf16", 0.01), ("fp32", 0.02), ("bf16-ring", 0.005), ("fp8", 0.004), ("fp8-2l", 0.5))
    ] + [{"op": "reduce_scatter", "size": 1 << 20, "count": 1 << 19, "variant": "nvfp4", "time": 0.01}]
    got = pc.compare(rows, cal, 2, 2)
    assert [c["variant"] for c in got] == ["bf16", "fp32", "bf16-ring", "fp8", "fp8-2l"]  # nvfp4: not calibrated
    shape, elems = GroupShape(2, 2), 1 << 19
    want = {
        "bf16": predict("reduce_scatter", 2 * elems, "bf16", shape, Option("native"), cal),
        "fp32": predict("reduce_scatter", 4 * elems, "fp32", shape, Option("native"), cal),
        "bf16-ring": linkmodel.time("reduce_scatter", "ring", "bf16", cal.machine(2, 2), elems).seconds,
        "fp8": predict("reduce_scatter", 2 * elems, "bf16", shape, Option("fp8"), cal),
        "fp8-2l": predict("reduce_scatter", 2 * elems, "bf16", shape, Option("fp8", "two_level"), cal),
    }
    for c, r in zip(got, rows):
        assert c["predicted_ms"] == pytest.approx(want[c["variant"]] * 1e3)
        assert c["ratio"] == pytest.approx(want[c["variant"]] / r["time"])
        assert c["within"] == (abs(c["ratio"] - 1) <= 0.2)
    assert not got[-1]["within"] and got[2]["planner_option"] is False
    s = pc.summary(got)
    assert s["rows_total"] == 5 and s["planner_options_total"] == 4
    assert s["rows_within"] == sum(c["within"] for c in got)
    text = pc.format_table(got, s)
    assert "fp8 two-level" in text and f"{s['planner_options_within']} / 4 rows" in text
    # two levels on a group that does not span nodes: not predicted
    assert pc.compare(rows[4:5], cal, 1, 4) == []


def test_paired_rounds_compare_medians():
    # issue 30 item 5: each comparison the median of >= 3 paired runs; every round is predicted from its own
    # calibration, the row compares the median measured with the median predicted
    pc = _plan_check()
    cals = [_cal(call_overhead=x) for x in (1e-3, 5e-3, 2e-3)]
    times = (0.004, 0.009, 0.005)
    rounds = [
        (c, [{"op": "all_gather", "size": 1 << 18, "count": 1 << 17, "variant": "fp8", "time": t}])
        for c, t in zip(cals, times)
    ]
    got = pc.compare_rounds(rounds, 2, 2)
    assert len(got) == 1
    g = got[0]
    preds = [predict("all_gather", 1 << 18, "bf16", GroupShape(2, 2), Option("fp8"), c) * 1e3 for c in cals]
    assert g["rounds"] == 3 and g["measured_rounds"] == [t * 1e3 for t in times]
    assert g["predicted_rounds"] == pytest.approx(preds)
    assert g["measured_ms"] == pytest.approx(5.0) and g["predicted_ms"] == pytest.approx(sorted(preds)[1])
    assert g["ratio"] == pytest.approx(sorted(preds)[1] / 5.0)
    # one round: the same figures as compare()
    one = pc.compare_rounds(rounds[:1], 2, 2)[0]
    plain = pc.compare(rounds[0][1], cals[0], 2, 2)[0]
    assert one["ratio"] == pytest.approx(plain.pop("ratio"))
    assert {k: one[k] for k in plain} == plain


def test_from_pools_saved_launches(tmp_path, capsys):
    pc = _plan_check()
    meta = {"nodes": 2, "local": 2, "link": "eth0", "commit": "x", "uncommitted": False, "date": "d", "load": [1.0]}
    row = {"op": "reduce_scatter", "size": 1 << 20, "count": 1 << 19, "variant": "fp8"}
    old = {"meta": meta, "calibration": _cal().to_dict(), "rows": [dict(row, time=0.010)]}  # before --rounds
    new = {
        "meta": meta,
        "rounds": [{"calibration": _cal().to_dict(), "rows": [dict(row, time=t)]} for t in (0.020, 0.030)],
    }
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(old))
    b.write_text(json.dumps(new))
    assert pc.main(["--from", str(a), str(b), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["rounds"] == 3 and res["meta"]["from"] == [str(a), str(b)]
    (c,) = res["checked"]
    assert c["measured_rounds"] == [10.0, 20.0, 30.0] and c["measured_ms"] == 20.0
    assert "3 paired rounds" in capsys.readouterr().out
    # a round with small calls: the same rows are also counted as predicted without them (call_overhead alone)
    fast = _cal(call_overhead=0.05, small_calls={"reduce_scatter/flat/fp8": 0.0}, small_call_elems=4096, world_size=4)
    b.write_text(json.dumps(dict(new, rounds=[{"calibration": fast.to_dict(), "rows": [dict(row, time=0.010)]}])))
    assert pc.main(["--from", str(b), "--json", str(out)]) == 0
    summ = json.loads(out.read_text())["summary"]
    assert summ["planner_options_within"] == 1 and summ["planner_options_within_without_small_calls"] == 0
    assert "without the small calls (call_overhead alone): 0 / 1 rows" in capsys.readouterr().out
    # launches of another shape do not pool
    other = dict(new, meta=dict(meta, local=4))
    b.write_text(json.dumps(other))
    assert pc.main(["--from", str(a), str(b)]) == 2
    # a file that is not a saved run, or is missing: a clear error, exit 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    capsys.readouterr()
    assert pc.main(["--from", str(bad)]) == 2
    assert pc.main(["--from", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.json: not a saved plan_check run" in err and "missing.json: not a saved plan_check run" in err


def test_choices_against_the_best_measured():
    # per (op, size): the option with the smallest prediction against the fastest as measured (fp32 rows and the
    # bench's ring are not options for a bf16 buffer; 4-bit rows only when allowed)
    pc = _plan_check()

    def row(variant, meas, pred, size=1 << 20):
        return {
            "op": "all_gather",
            "size": size,
            "variant": variant,
            "planner_option": variant != "bf16-ring",
            "measured_ms": meas,
            "predicted_ms": pred,
        }

    checked = [
        row("bf16", 10.0, 9.0),
        row("fp32", 1.0, 1.0),
        row("bf16-ring", 2.0, 2.0),
        row("fp8", 8.0, 12.0),
        row("mxfp4", 5.0, 4.0),
        row("bf16", 3.0, 3.0, 1 << 18),
        row("fp8", 3.1, 2.0, 1 << 18),
    ]
    fp8 = pc.choices(checked, allow_4bit=False)
    assert [(c["size"], c["picked"], c["best"], c["within"]) for c in fp8] == [
        (1 << 20, "bf16", "fp8", False),
        (1 << 18, "fp8", "bf16", True),  # 3.1 / 3.0: within 5%
    ]
    assert fp8[0]["slower"] == pytest.approx(10.0 / 8.0)
    four = pc.choices(checked, allow_4bit=True)
    assert (four[0]["picked"], four[0]["best"], four[0]["within"]) == ("mxfp4", "mxfp4", True)
    assert "1 / 2 within 5%" in pc.format_choices(fp8, "FP8")


def test_repeat_two_launches(tmp_path, capsys):
    # --repeat: does the measurement itself repeat within 20% across two launches of one shape, and how do the
    # predictions fare on the rows that do (each launch predicted from its own calibration)
    pc = _plan_check()
    meta = {"nodes": 2, "local": 2, "link": "eth0", "commit": "x", "uncommitted": False, "date": "d", "load": [1.0]}
    cal = _cal()

    def launch(times):
        rows = [
            {"op": "reduce_scatter", "size": 1 << 20, "count": 1 << 19, "variant": v, "time": t}
            for v, t in times.items()
        ]
        return {"meta": meta, "rounds": [{"calibration": cal.to_dict(), "rows": rows}]}

    shape, elems = GroupShape(2, 2), 1 << 19
    bf16 = predict("reduce_scatter", 2 * elems, "bf16", shape, Option("native"), cal)
    fp8 = predict("reduce_scatter", 2 * elems, "bf16", shape, Option("fp8"), cal)
    # bf16: measured at the prediction, then 10% slower (repeats, predicted within in both); fp8: at the
    # prediction, then 1.5x (does not repeat); the ring: not a planner option, not counted
    first = launch({"bf16": bf16, "fp8": fp8, "bf16-ring": 0.001})
    second = launch({"bf16": bf16 * 1.1, "fp8": fp8 * 1.5, "bf16-ring": 0.001})
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    assert pc.main(["--repeat", str(a), str(b), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["bf16"]["ratio"] == pytest.approx(1.1) and rows["bf16"]["repeats"]
    assert rows["fp8"]["ratio"] == pytest.approx(1.5) and not rows["fp8"]["repeats"]
    assert rows["fp8"]["predicted_within"] == [True, False]
    assert res["summary"] == {
        "tolerance": 0.2,
        "planner_options": 2,
        "measurement_repeats": 1,
        "predicted_within": [2, 1],
        "predicted_within_both": 1,
        "repeating_predicted_within_both": 1,
    }
    text = capsys.readouterr().out
    assert "repeats within 20% (2nd launch against the 1st): 1 / 2 rows" in text
    # two shapes, --repeat with --from, a file that is not a saved run: a clear error, exit 2
    b.write_text(json.dumps(dict(second, meta=dict(meta, local=4))))
    assert pc.main(["--repeat", str(a), str(b)]) == 2
    assert pc.main(["--repeat", str(a), str(a), "--from", str(a)]) == 2
    assert pc.main(["--repeat", str(a), str(a), "--calibration", str(a)]) == 2  # not silently ignored
    assert pc.main(["--repeat", str(a), str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "different shapes" in err and "two different reports" in err and "missing.json: not a saved" in err
    assert "--calibration goes with --from (--repeat predicts each launch from its own)" in err


@pytest.mark.parametrize("flag", ["--from", "--repeat"])
def test_a_saved_run_with_a_bad_calibration_is_named(tmp_path, capsys, flag):
    # a saved run whose calibration does not load: exit 2 naming the file (--from raised a traceback before)
    pc = _plan_check()
    meta = {"nodes": 2, "local": 2, "link": "eth0", "commit": "x", "uncommitted": False, "date": "d", "load": [1.0]}
    row = {"op": "reduce_scatter", "size": 1 << 20, "count": 1 << 19, "variant": "fp8", "time": 0.01}
    bad = tmp_path / "badcal.json"
    bad.write_text(json.dumps({"meta": meta, "rounds": [{"calibration": {"format": "other"}, "rows": [row]}]}))
    files = [str(bad)] if flag == "--from" else [str(bad), str(bad)]
    assert pc.main([flag, *files]) == 2
    assert f"{flag} {bad}: not a saved plan_check run" in capsys.readouterr().err


def test_large_calls_scale_each_option_toward_its_measured_large_call():
    import math

    S, B = 4096, 1 << 20
    small = {"reduce_scatter/flat/fp8": 3e-3, "reduce_scatter/gloo/bf16": 2e-3}
    base = _cal(small_calls=small, small_call_elems=S, world_size=4)
    opt, shape = Option("fp8", "flat"), GroupShape(2, 2)
    at_big = predict("reduce_scatter", 2 * B, "bf16", shape, opt, base)  # the model alone at the large size
    two = Option("fp8", "two_level")
    at_two = predict("reduce_scatter", 2 * B, "bf16", shape, two, base)
    timed = {"reduce_scatter/flat/fp8": 3 * at_big, "reduce_scatter/two_level/fp8": 3 * at_two}
    cal = replace(base, large_calls=timed, large_call_elems=B)
    back = Calibration.from_json(cal.to_json(), device="cpu", ranks_per_node=2)
    assert back == cal
    # at the large size and above: the factor q = measured / modelled (3); at the small size and below: 1
    assert predict("reduce_scatter", 2 * B, "bf16", shape, opt, cal) == pytest.approx(3 * at_big)
    for n in (4 * B, S, S // 2):
        assert estimate("reduce_scatter", 2 * n, "bf16", shape, opt, cal).measured_scale == pytest.approx(
            3.0 if n > B else 1.0
        )
    # between: q ** t, t linear in log size (half way at the geometric middle)
    mid = int(math.sqrt(S * B))
    e = estimate("reduce_scatter", 2 * mid, "bf16", shape, opt, cal)
    assert e.measured_scale == pytest.approx(3**0.5, rel=1e-3)
    assert e.seconds == pytest.approx(predict("reduce_scatter", 2 * mid, "bf16", shape, opt, base) * e.measured_scale)
    # the call was timed on bf16 without error feedback: q compares it with that call's model and scales this one's,
    # so an fp32 buffer and error feedback's residual stage keep their share of the time
    for o, dt, timed_model in ((Option("fp8", "flat", feedback=True), "bf16", at_big), (two, "fp32", at_two)):
        size = (4 if dt == "fp32" else 2) * B
        model = estimate("reduce_scatter", size, dt, shape, o, base).seconds
        assert model > 1.05 * timed_model  # the residual stage, the two-level call's fp32 node-local part: more
        assert predict("reduce_scatter", size, dt, shape, o, cal) == pytest.approx(3 * model)
    # other options (no large call), other layouts (timed on 2 x 2 only): the model alone
    for o, sh in ((Option("native"), shape), (opt, GroupShape(4, 2)), (opt, GroupShape(1, 4))):
        assert estimate("reduce_scatter", 2 * B, "bf16", sh, o, cal).measured_scale == 1.0
    # bad ones are named: a large call without small calls, not larger than them, a bad key or time
    for kw, msg in [
        ({"large_calls": {"reduce_scatter/flat/fp8": 1e-2}, "large_call_elems": B}, "large_calls need small_calls"),
        (
            {"small_calls": small, "small_call_elems": S, "large_calls": {"reduce_scatter/flat/fp8": 1e-2},
             "large_call_elems": S},
            "large_calls need small_calls of fewer elements",
        ),
        ({"small_calls": small, "small_call_elems": S, "large_calls": {"x/flat/fp8": 1e-2}, "large_call_elems": B},
         "large_calls key 'x/flat/fp8'"),
        ({"small_calls": small, "small_call_elems": S, "large_calls": {"reduce_scatter/flat/fp8": 0.0},
          "large_call_elems": B}, "large_calls['reduce_scatter/flat/fp8'] must be a positive"),
        ({"large_calls": {"reduce_scatter/flat/fp8": 1e-2}}, "large_call_elems must be an int >= 1"),
    ]:  # fmt: skip
        with pytest.raises(Fp8CommConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            _cal(**kw)
    old = json.loads(base.to_json())
    del old["large_calls"], old["large_call_elems"]  # files from before the large calls: the model alone above
    assert Calibration.from_dict(old).large_calls == {}
