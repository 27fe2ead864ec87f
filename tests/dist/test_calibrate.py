"""fp8comm.comm.calibrate (issue 30 item 1, and item 6's bad input): 4 gloo ranks on 127.0.0.1 laid out as 2 nodes x
2 ranks (LOCAL_WORLD_SIZE=2), one launch running these scenarios in turn on every rank:
- a calibration: every rank returns the identical Calibration (2 ranks per node, cpu, gloo, every codec), with
  positive link figures, and the time it took;
- a rank that does not arrive (stalled before announcing itself, longer than the timeout) and a rank that stalls
  after the start, inside the link timing: every rank returns None with exactly one CalibrationWarning, the same
  text on every rank, the ranks that were on time within the timeout plus the grace (no hang), and the caller's own
  world group still works afterwards (an all_reduce);
- arguments that differ between ranks, and a layout with uneven ranks per node: the same error on every rank.
And `fp8comm calibrate --nproc 4 --local-size 2` writes a file `fp8comm plan --calibration` accepts, which is refused
with another fp8comm version, device kind or ranks per node (another world size accepted); with a rank that does not
arrive it writes nothing and exits 1 with the reason.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import dist_harness
import pytest

from fp8comm import __version__
from fp8comm.comm.calibrate import SMALL_REPS
from fp8comm.comm.calibration import Calibration
from fp8comm.comm.smallcalls import SMALL_ELEMS
from fp8comm.quant.dispatch import COMPILE_MIN_NUMEL
from fp8comm.tools import cli

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
FAST = {"sizes": (1 << 10, 64 << 10), "codec_elems": (1 << 12, 1 << 15), "reps": 2}
STALL_READY = (3, 4.0, 7.0)  # rank, timeout_s, stall seconds
STALL_LINKS = (2, 6.0, 9.0)
STALL_CALLS = (1, 8.0, 11.0)
LARGE = 1 << 17  # elements of the large calls (fp8comm calibrate's 4Mi: too long for the suite)
LATE_CALLS = (1, 30.0, 8.0)  # late for the small calls' groups (5 s at most), in time for the calibration


def _scenario(rec: dict, name: str, fn) -> None:
    import torch
    import torch.distributed as dist

    import fp8comm
    from fp8comm.comm.calibrate import CalibrationWarning

    t0 = time.monotonic()
    out: dict = {}
    try:
        torch.manual_seed(7)  # the engines calibrate before the model is built: its random stream must not move
        rng = torch.get_rng_state()
        stats = fp8comm.comm_stats()  # nor may its calls show in the caller's statistics
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cal = fn()
        out["rng_kept"] = torch.equal(torch.get_rng_state(), rng)
        out["stats_kept"] = fp8comm.comm_stats() == stats
        out["result"] = None if cal is None else cal.to_json()
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, CalibrationWarning)]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    try:  # the caller's world group must still work
        x = torch.ones(3)
        dist.all_reduce(x)
        out["world_ok"] = x.tolist() == [WORLD] * 3
    except Exception as e:
        out["world_ok"] = f"{type(e).__name__}: {e}"
    try:  # and so must the caller's next new group (the small calls' groups kept the world's group count even)
        pg = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=30))
        x = torch.ones(2)
        dist.all_reduce(x, group=pg)
        dist.destroy_process_group(pg)
        out["new_group_ok"] = x.tolist() == [WORLD] * 2
    except Exception as e:
        out["new_group_ok"] = f"{type(e).__name__}: {e}"
    rec[name] = out


def _target(rank: int, world: int, port: int, outdir: str, env: dict, names) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    from fp8comm.comm.calibrate import STALL_ENV, calibrate

    out = dist_harness.join(rank, world, port, outdir, 60.0, dist_harness.PG_TIMEOUT_S)
    rec: dict = {"check": "calibrate", "state": "done", "ok": True}
    try:
        report: dict = {}
        _scenario(
            rec, "ok", lambda: calibrate(**FAST, timeout_s=120, report=report, small_calls=True, large_call_elems=LARGE)
        )
        rec["report"] = report
        for name, (who, timeout, stall) in (("ready", STALL_READY), ("links", STALL_LINKS), ("calls", STALL_CALLS)):
            os.environ[STALL_ENV] = f"{who}:{name}:{stall}"
            _scenario(rec, f"stall_{name}", lambda t=timeout: calibrate(**FAST, timeout_s=t, small_calls=True))
            os.environ.pop(STALL_ENV)
        os.environ[STALL_ENV] = f"{LATE_CALLS[0]}:calls:{LATE_CALLS[2]}"
        _scenario(rec, "late_calls", lambda: calibrate(**FAST, timeout_s=LATE_CALLS[1], small_calls=True))
        os.environ.pop(STALL_ENV)
        _scenario(rec, "args", lambda: calibrate(**(FAST | {"reps": 3 if rank == 1 else 2}), timeout_s=60))
        _scenario(rec, "uneven", lambda: calibrate(**FAST, nodes=[0, 0, 0, 1], timeout_s=60))
        _scenario(rec, "large_alone", lambda: calibrate(**FAST, large_call_elems=LARGE, timeout_s=60))
        _scenario(rec, "again", lambda: calibrate(**FAST, codecs=("fp8",), timeout_s=120))
        pair = dist.new_group([0, 1])  # small calls need the whole world: refused on a pair, before anything moves
        if rank < 2:  # (not a _scenario: its checks are collectives over the world)
            t0 = time.monotonic()
            try:
                calibrate(pair, **FAST, timeout_s=60, small_calls=True)
                rec["small_pair"] = {"error": ""}
            except Exception as e:
                rec["small_pair"] = {"error": f"{type(e).__name__}: {e}"}
            rec["small_pair"]["seconds"] = time.monotonic() - t0
        dist.barrier()
        if rank < 2:
            dist.destroy_process_group(pair)
    except BaseException as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
    out.write(json.dumps(rec) + "\n")
    out.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run = dist_harness.launch(
        WORLD, tmp_path_factory.mktemp("calibrate"), env={"LOCAL_WORLD_SIZE": "2"}, target=_target, timeout=400
    )
    assert not run["timed_out"] and run["exitcodes"] == [0] * WORLD, run
    recs = {r: run["results"][r][-1] for r in range(WORLD)}
    for r, rec in recs.items():
        assert rec["ok"], (r, rec.get("error"), rec.get("trace"))
    return recs


def test_every_rank_holds_the_identical_calibration(runs):
    got = [runs[r]["ok"] for r in range(WORLD)]
    assert all("error" not in g and g["warnings"] == [] and g["world_ok"] is True for g in got), got
    assert all(g["new_group_ok"] is True for g in got), got
    assert all(g["rng_kept"] is True for g in got), got  # torch's global generator untouched on every rank
    assert all(g["stats_kept"] is True for g in got), got  # the small calls recorded nowhere the caller reads
    texts = {g["result"] for g in got}
    assert len(texts) == 1
    cal = Calibration.from_json(texts.pop(), device="cpu", ranks_per_node=2)
    assert cal.ranks_per_node == 2 and cal.world_size == WORLD and cal.backend == "gloo" and cal.version == __version__
    assert set(cal.codecs) == {"fp8", "fp8_e8m0", "mxfp4", "nvfp4"}
    assert cal.inter.bandwidth > 0 and cal.intra.bandwidth > 0
    rep = runs[0]["report"]
    assert rep == runs[3]["report"]  # published by rank 0: the same details everywhere
    assert [x["node"] for x in rep["ranks"]] == [0, 0, 1, 1]
    # the decision is the slowest: the node-local link of the slowest rank, the cross-node one of the slower node
    # (both its rail exchanges at once); latency per level the pooled median of every rank's small exchanges
    assert cal.intra.bandwidth == min(x["intra"][0] for x in rep["ranks"])
    assert [(x["node"], x["rails"]) for x in rep["nodes"]] == [(0, 2), (1, 2)]
    assert cal.inter.bandwidth == min(x["inter"][0] for x in rep["nodes"])
    for level, link in (("intra", cal.intra), ("inter", cal.inter)):
        lat = rep["latency"][level]
        assert lat["samples"] == WORLD * SMALL_REPS * FAST["reps"]  # every rank's windows
        assert link.latency == max(0.0, lat["median_s"] - lat["bytes_s"])
    assert cal.codecs["fp8"].pack == min(x["codecs"]["fp8"][0] for x in rep["ranks"])
    # calls from the CPU kernel switch on: FP8's compiled kernel, timed at two sizes, with its own fixed cost
    at, big = cal.codecs["fp8"].above
    large = [x["codecs_large"]["fp8"] for x in rep["ranks"]]  # per rank: [from numel, pack, unpack_sum, fixed]
    assert at == COMPILE_MIN_NUMEL and "timed at two sizes" in big.source and len(large) == WORLD
    assert big.pack == min(x[1] for x in large) and big.fixed == statistics.median(x[3] for x in large)
    s = rep["seconds"]
    assert 0 < s["first_calls_s"] < s["decided_s"] and s["without_first_calls_s"] > 0
    # every option's small real call: the engine's own all-gather and reduce-scatter in bf16 and fp32, every codec
    # flat and two-level (2 nodes x 2 ranks), each the median of its calls' slowest rank
    algos = [("gloo", d) for d in ("bf16", "fp32")] + [(a, c) for c in cal.codecs for a in ("flat", "two_level")]
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    assert set(cal.small_calls) == {f"{op}/{a}/{c}" for op in ops for a, c in algos}
    assert all(v > 0 for v in cal.small_calls.values()) and cal.small_call_elems == SMALL_ELEMS
    assert 0 < s["calls_s"] < s["decided_s"]
    # and again as large calls, every option within the budget at this size (the same options on every rank), or,
    # where a rank fell more than the throwaway groups' 5 s behind (a loaded 2-core machine), those every rank
    # finished, with the notes saying why: never fewer in silence
    _all_large_or_said(cal)
    assert cal.large_call_elems == LARGE and 0 < s["large_calls_s"] < s["calls_s"]
    # a second calibration on the same group (fresh keys) works as well
    again = {runs[r]["again"]["result"] for r in range(WORLD)}
    assert len(again) == 1 and None not in again
    again_cal = Calibration.from_json(again.pop())
    assert set(again_cal.codecs) == {"fp8"} and again_cal.small_calls == {}  # small calls only when asked for


def _all_large_or_said(cal) -> None:
    assert set(cal.large_calls) <= set(cal.small_calls), cal.large_calls
    assert all(v > 0 for v in cal.large_calls.values())
    if set(cal.large_calls) != set(cal.small_calls):
        said = f"large calls: {len(cal.large_calls)} of {len(cal.small_calls)} options timed (failed on rank(s) "
        assert any(n.startswith(said) for n in cal.notes), cal.notes


@pytest.mark.parametrize("phase,stall", [("ready", STALL_READY), ("links", STALL_LINKS), ("calls", STALL_CALLS)])
def test_a_rank_that_does_not_answer_gives_one_fallback_everywhere(runs, phase, stall):
    who, timeout, secs = stall
    got = [runs[r][f"stall_{phase}"] for r in range(WORLD)]
    for r, g in enumerate(got):
        assert "error" not in g and g["result"] is None, (r, g)
        assert len(g["warnings"]) == 1, (r, g)
        assert g["world_ok"] is True and g["new_group_ok"] is True, (r, g)
    assert len({g["warnings"][0] for g in got}) == 1  # one outcome, decided once, read by everyone
    text = got[0]["warnings"][0]
    assert "keeping the fixed choice" in text and str(who) in text, text
    grace = min(2.0, 0.25 * timeout)
    for r, g in enumerate(got):
        if r != who:  # on time: back within the timeout and the grace (plus slack for a loaded 2-core machine)
            assert g["seconds"] < timeout + grace + 3.0, (r, g["seconds"])
    assert got[who]["seconds"] >= secs  # the stalled rank slept, then read the decision (no second outcome)


def test_bad_arguments_and_uneven_layouts_are_one_error_everywhere(runs):
    for name, msg in (
        ("args", "called calibrate() with other arguments"),
        ("uneven", "uneven ranks per node"),
        ("large_alone", "large_call_elems must be an int > 2 x the small calls' 32768 elements, with small_calls=True"),
    ):
        errs = {runs[r][name].get("error") for r in range(WORLD)}
        assert len(errs) == 1, (name, errs)
        err = errs.pop()
        assert err and err.startswith("Fp8CommConfigError: calibrate: ") and msg in err, err


def test_small_calls_out_of_time_leave_one_outcome(runs):
    # a rank late for the small calls' groups (their creation waits 5 s at most): one outcome on every rank, either
    # the same calibration without small calls, saying why, or (when the late rank's own group attempts ran past the
    # deadline: seen on the 2-core VM) one fallback; the caller's world group and its next new group work
    # either way (every rank made the same new_group calls: the group counter stayed even)
    got = [runs[r]["late_calls"] for r in range(WORLD)]
    for r, g in enumerate(got):
        assert "error" not in g and g["world_ok"] is True and g["new_group_ok"] is True, (r, g)
    results = {g["result"] for g in got}
    assert len(results) == 1, got
    (result,) = results
    if result is None:
        assert all(len(g["warnings"]) == 1 for g in got) and len({g["warnings"][0] for g in got}) == 1, got
        assert f"group rank(s) {LATE_CALLS[0]} did not finish" in got[0]["warnings"][0]
    else:
        assert all(g["warnings"] == [] for g in got), got
        cal = Calibration.from_json(result)
        assert cal.small_calls == {} and cal.small_call_elems == 0
        why = "small calls not timed (call_overhead stands for them): failed on rank(s)"
        assert any(n.startswith(why) for n in cal.notes), cal.notes


def test_small_calls_need_the_whole_world(runs):
    for r in (0, 1):
        err = runs[r]["small_pair"].get("error", "")
        assert err.startswith("Fp8CommConfigError: calibrate: small_calls=True needs a group of the whole world"), err
        assert "ranks [0, 1]" in err and runs[r]["small_pair"]["seconds"] < 1.0, runs[r]["small_pair"]


def test_bad_arguments_are_refused_before_anything_moves():
    from fp8comm.comm.calibrate import calibrate
    from fp8comm.errors import Fp8CommConfigError

    with pytest.raises(Fp8CommConfigError, match="not initialized"):
        calibrate()


# ---------------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "cal.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LOCAL_WORLD_SIZE", None)
    r = subprocess.run(
        [sys.executable, "-m", "fp8comm.tools.cli", "calibrate", "--nproc", "4", "--local-size", "2", "--out",
         str(out), "--sizes", "1Ki,64Ki", "--codec-elems", "4Ki,32Ki", "--reps", "2", "--timeout", "120",
         "--large-call-elems", "128Ki"],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def test_cli_writes_a_file_plan_accepts(written, capsys):
    out, stdout = written
    assert "| cross-node (per node)" in stdout and "| fp8 " in stdout and "first codec calls" in stdout
    cal = Calibration.load(out, device="cpu", ranks_per_node=2)
    assert cal.world_size == 4
    # ahead of time it times every option as a small real call (30 at 2x2 with four codecs), and prints them
    assert len(cal.small_calls) == 30 and "| reduce_scatter/two_level/mxfp4 " in stdout
    # and as large calls (every option at this size, within the budget, or the notes say why not), printed as well
    _all_large_or_said(cal)
    assert cal.large_call_elems == 128 << 10
    assert "| option (large call) " in stdout and "# large calls: 131072 elements per buffer" in stdout
    base = ["plan", "--nodes", "8", "--gpus-per-node", "2", "--params", "100M", "--json"]  # another world size: fine
    assert cli.main([*base, "--calibration", str(out)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cluster"]["inter_GBps"] == cal.inter.bandwidth / 1e9 and str(out) in r["cluster"]["source"]
    assert r["cluster"]["small_calls_ms"] == {k: v * 1e3 for k, v in cal.small_calls.items()}
    assert r["cluster"]["large_calls_ms"] == {k: v * 1e3 for k, v in cal.large_calls.items()}


def test_cli_refuses_a_foreign_file(written, tmp_path, capsys):
    out, _ = written
    d = json.loads(out.read_text())
    base = ["plan", "--nodes", "2", "--gpus-per-node", "2", "--params", "100M"]
    cases = [
        (d | {"version": "0.0.1"}, [], f"taken with fp8comm 0.0.1, this is fp8comm {__version__}"),
        (d, ["--device", "cuda:NVIDIA H200"], "taken on device kind 'cpu', this job runs on 'cuda:NVIDIA H200'"),
        (d | {"device": "cuda:NVIDIA H200"}, ["--device", "cpu"], "device kind 'cuda:NVIDIA H200'"),
        (d | {"ranks_per_node": 4}, [], "taken with 4 ranks per node, this job has 2"),
    ]
    for i, (doc, extra, msg) in enumerate(cases):
        f = tmp_path / f"c{i}.json"
        f.write_text(json.dumps(doc))
        assert cli.main([*base, "--calibration", str(f), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fp8comm plan: calibration: ") and msg in err, err
    # the links come from the file: giving them as well is an error naming the option, as is a missing file
    assert cli.main([*base, "--calibration", str(out), "--inter", "1Gbit"]) == 2
    assert "--inter: --calibration gives the links" in capsys.readouterr().err
    assert cli.main([*base, "--calibration", str(tmp_path / "none.json")]) == 2
    assert "--calibration: no such file" in capsys.readouterr().err
    assert cli.main([*base]) == 2
    assert "--inter and --intra" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--nproc", "1"], "--nproc must be >= 2"),
        (["--nproc", "4", "--local-size", "3"], "--local-size 3 must be >= 1 and divide --nproc 4"),
        (["--sizes", "1Mi,1Ki"], "--sizes: give small,large with small < large"),
        (["--codecs", "fp8,fp6"], "--codecs: unknown fp6"),
        (["--codec-elems", "16Ki,512Ki"], "--codec-elems: 16384 and 524288 elements straddle the CPU kernel switch"),
        (["--out", "/nonexistent/dir/c.json"], "directory '/nonexistent/dir' does not exist"),
        (["--large-call-elems", "64Ki"], "--large-call-elems must be 0 or > 65536"),
        (["--large-call-elems", "4x"], "--large-call-elems: cannot read '4x'"),
        (["--no-small-calls", "--large-call-elems", "1Mi"], "--large-call-elems needs the small calls"),
        (["--timeout", "30", "--large-call-elems", "4Mi"], "--large-call-elems needs --timeout >= 60 s"),
    ],
)
def test_cli_bad_input_is_a_clear_error(args, msg, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["calibrate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8comm calibrate: ") and msg in err, err


def test_cli_falls_back_without_writing(tmp_path):
    """A rank that does not arrive: nothing written, exit 1, the reason on stderr, well before the spawner's limit."""
    out = tmp_path / "cal.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), FP8COMM_CALIBRATE_STALL="1:ready:5")
    env.pop("LOCAL_WORLD_SIZE", None)
    r = subprocess.run(
        [sys.executable, "-m", "fp8comm.tools.cli", "calibrate", "--nproc", "2", "--out", str(out), "--timeout", "2",
         "--codecs", "fp8", "--sizes", "1Ki,64Ki", "--codec-elems", "4Ki,32Ki"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 1, (r.stdout, r.stderr[-3000:])
    assert "fp8comm calibrate: nothing written: " in r.stderr, r.stderr[-3000:]
    assert "group rank(s) 1 did not arrive within 2 s" in r.stderr, r.stderr[-3000:]
    assert not out.exists()
