"""The GPU scripts' machine-readable rows (docs/results/gpu.json): names, targets and the merge by name, on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
sys.path.insert(0, str(LAUNCH))

import device_check_gemm  # noqa: E402
import gpu_results  # noqa: E402


def test_timings_become_named_rows_and_merge_by_name(tmp_path):
    timings = [
        {"check": "timing", "case": "fp8 blockwise scaled_mm 8192^3", "status": "ok", "speedup": 1.71},
        {"check": "timing", "case": "fp8 blockwise triton 8192^3", "status": "ok", "speedup": 0.83},
        {"check": "timing", "case": "Fp8Linear rowwise fwd+bwd 16384x8192->8192", "status": "ok", "speedup": 0.96},
        {"check": "timing", "case": "fp8 blockwise scaled_mm 4096^3", "status": "ok", "speedup": 9.0},  # not named
    ]
    rows = device_check_gemm.result_rows(timings, "test device")
    got = {r["name"]: (r["value"], r["target"]) for r in rows}
    assert got == {"gemm_blockwise_vs_bf16_8192": (1.71, 1.5), "linear_rowwise_vs_bf16": (0.96, 1.3)}
    assert all(set(r) == {"name", "value", "target", "unit", "date", "commit", "device"} for r in rows)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps([{"name": "linear_rowwise_vs_bf16", "value": 0.5}, {"name": "keep", "value": 1}]))
    gpu_results.merge(rows, path)
    merged = {r["name"]: r["value"] for r in json.loads(path.read_text())}
    assert merged == {"keep": 1, "gemm_blockwise_vs_bf16_8192": 1.71, "linear_rowwise_vs_bf16": 0.96}


def test_training_results_become_rows_per_recipe():
    results = [
        {"recipe": "bf16", "seed": 0, "val_loss": 2.00, "seconds": 10.0},
        {"recipe": "bf16", "seed": 1, "val_loss": 2.02, "seconds": 12.0},
        {"recipe": "blockwise", "seed": 0, "val_loss": 2.03, "seconds": 8.0},
        {"recipe": "blockwise", "seed": 1, "val_loss": 2.03, "seconds": 14.0},
    ]
    rows = {r["name"]: r for r in device_check_gemm.train_rows(results, "test device")}
    assert set(rows) == {"train_blockwise_val_loss_rel", "train_blockwise_tokens_per_s_vs_bf16"}
    assert rows["train_blockwise_val_loss_rel"]["value"] == round((2.03 - 2.01) / 2.01, 5)  # signed: worse > 0
    assert rows["train_blockwise_tokens_per_s_vs_bf16"]["value"] == 1.0  # 11 s per run either way
    assert "2 paired seeds" in rows["train_blockwise_val_loss_rel"]["unit"]
    assert device_check_gemm.train_rows(results[2:], "test device") == []  # no baseline, no ratio


def test_training_rows_pair_seeds_when_a_run_was_cut_short():
    """A budget cut leaves bf16 with seed 0 only: blockwise's seed 1 must not enter a mean against it."""
    results = [
        {"recipe": "bf16", "seed": 0, "val_loss": 2.00, "seconds": 10.0},
        {"recipe": "blockwise", "seed": 0, "val_loss": 2.02, "seconds": 8.0},
        {"recipe": "blockwise", "seed": 1, "val_loss": 3.00, "seconds": 20.0},
    ]
    rows = {r["name"]: r for r in device_check_gemm.train_rows(results, "test device")}
    assert rows["train_blockwise_val_loss_rel"]["value"] == round(0.02 / 2.00, 5)
    assert rows["train_blockwise_tokens_per_s_vs_bf16"]["value"] == 1.25
    assert "1 paired seed" in rows["train_blockwise_val_loss_rel"]["unit"]


# --- the budgeted driver (launch/gpu_results.Runner): rows appended as measured, hard deadline, crash-safe -----------
def _rows(path) -> dict:
    return {r["name"]: r["value"] for r in json.loads(path.read_text())}


def test_sections_append_their_rows_one_by_one(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps([{"name": "older_run", "value": 7}]))
    seen = []

    def first(run):
        run.row("a", 1)
        seen.append(_rows(path))  # on disk before the section even returns
        run.row("b", 2)

    def second(run):
        seen.append(_rows(path))
        run.row("c", 3)
        return {"status": "fail"}

    r = gpu_results.Runner(60, "test device", rows_path=path, doc_path=tmp_path / "run.json")
    res = r.run([gpu_results.Section("first", first), gpu_results.Section("second", second)])
    assert seen[0] == {"older_run": 7, "section_first": "running", "a": 1}
    assert seen[1] == {"older_run": 7, "section_first": "ok", "a": 1, "b": 2, "section_second": "running"}
    final = _rows(path)
    assert final == {"older_run": 7, "a": 1, "b": 2, "c": 3, "section_first": "ok", "section_second": "fail"}
    assert [k for k in res] == ["first", "second"] and r.failed() == ["second"]
    assert json.loads((tmp_path / "run.json").read_text())["sections"]["second"]["status"] == "fail"


def test_a_section_past_its_deadline_is_cut_and_later_ones_skipped(tmp_path):
    path = tmp_path / "gpu.json"

    def spins(run):
        run.row("before_the_cut", 1)
        while True:  # pure Python: the alarm interrupts it
            time.sleep(0.01)

    def capped(run):
        while True:
            time.sleep(0.01)

    after = []
    r = gpu_results.Runner(3.0, "test device", rows_path=path)
    res = r.run(
        [
            gpu_results.Section("capped", capped, cap_s=0.3, min_s=0),  # its own cap, not the run's deadline
            gpu_results.Section("fine", lambda run: run.row("fine_row", 1), min_s=0),
            gpu_results.Section("spins", spins, min_s=0),
            gpu_results.Section("after", lambda run: after.append(1), min_s=1),
        ]
    )
    assert [res[k]["status"] for k in ("capped", "fine", "spins", "after")] == ["cut", "ok", "cut", "skipped"]
    assert after == []
    rows = _rows(path)
    assert rows["before_the_cut"] == 1 and rows["fine_row"] == 1  # what a cut section measured is kept
    assert rows["section_spins"] == "cut" and rows["section_after"] == "skipped"
    assert set(r.failed()) == {"capped", "spins"}


def test_a_subprocess_section_is_killed_at_its_deadline(tmp_path):
    def sub(run):
        run.run_sub([sys.executable, "-c", "import time; time.sleep(120)"])

    r = gpu_results.Runner(60, "test device", rows_path=tmp_path / "gpu.json")
    res = r.run([gpu_results.Section("sub", sub, cap_s=2.0, min_s=0)])
    assert res["sub"]["status"] == "cut" and "killed" in res["sub"]["reason"]
    assert len(r.spawned) == 1 and r.children == set()
    with pytest.raises(ProcessLookupError):
        os.kill(r.spawned[0], 0)  # the child is gone (reaped), not left running on the device


CRASHING = """
import os, signal, sys, time
sys.path.insert(0, {launch!r})
import gpu_results as g

def fine(run):
    run.row("x", 1)
    run.row("y", 2)

def dies(run):
    run.row("z", 3)
    os.kill(os.getpid(), signal.SIGKILL)

def hangs(run):
    run.row("w", 4)
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})  # as if stuck in C code: the alarm cannot land
    time.sleep(60)

which = sys.argv[1]
r = g.Runner(float(sys.argv[2]), "test", rows_path=sys.argv[3], doc_path=sys.argv[3] + ".run", grace_s=0.5)
r.run([g.Section("fine", fine, min_s=0), g.Section(which, dies if which == "dies" else hangs, min_s=0)])
"""


@pytest.mark.parametrize("which", ["dies", "hangs"])
def test_nothing_written_is_lost_when_the_run_dies_or_hangs(tmp_path, which):
    path = tmp_path / "gpu.json"
    script = tmp_path / "crash.py"
    script.write_text(CRASHING.format(launch=str(LAUNCH)))
    p = subprocess.run(
        [sys.executable, str(script), which, "1.0", str(path)], capture_output=True, text=True, timeout=60
    )
    rows = _rows(path)
    assert rows["x"] == 1 and rows["y"] == 2 and rows["section_fine"] == "ok"
    if which == "dies":
        assert p.returncode == -9
        assert rows["z"] == 3 and rows["section_dies"] == "running"  # "running" after the run: it died there
    else:
        assert p.returncode == 124, p.stdout + p.stderr  # the watchdog ended it
        assert rows["w"] == 4 and rows["section_hangs"] == "cut"
    doc = json.loads(Path(str(path) + ".run").read_text())
    assert doc["sections"]["fine"]["status"] == "ok"


def test_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "gpu.json"
    gpu_results.merge([{"name": "a", "value": 1}], path)
    before = path.read_text()

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gpu_results.os, "replace", fail)
    with pytest.raises(OSError):
        gpu_results.merge([{"name": "b", "value": 2}], path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["gpu.json"]  # no stray temp file


# --- gpu_ready_check.host_ahead's protocol, against a stand-in for torch.cuda's queue (virtual clock) ---------------
class _FakeCuda:
    """One GPU queue on a virtual clock: _sleep occupies it for 1 s; an event completes when the queue reaches it;
    Event.synchronize / synchronize move the host's clock there (the host blocked)."""

    def __init__(self) -> None:
        self.host = 0.0
        self.queue_end = 0.0
        fake = self

        class Event:
            def record(self) -> None:
                self.t = max(fake.queue_end, fake.host)

            def query(self) -> bool:
                return fake.host >= self.t

            def synchronize(self) -> None:
                fake.host = max(fake.host, self.t)

        self.Event = Event

    def synchronize(self) -> None:
        self.host = max(self.host, self.queue_end)

    def _sleep(self, cycles: int) -> None:
        self.queue_end = max(self.queue_end, self.host) + 1.0


def test_host_ahead_checks_guard_step_at_its_sync_point():
    """guard.step waits for the PREVIOUS call's event by contract: ten calls in a row behind a queued sleep block on
    call 1's event (the false failure); one call after the engine's sync point must not, and a call that waits for
    its OWN work is still caught."""
    import gpu_ready_check as grc

    cuda = _FakeCuda()

    class GuardStep:  # guard.step's protocol: decide from the previous call's counts, record this call's event
        prev = None

        def __call__(self) -> None:
            if self.prev is not None:
                self.prev.synchronize()
            self.prev = cuda.Event()
            self.prev.record()

    def own_sync() -> None:  # a hidden sync: waits for its own queued work
        e = cuda.Event()
        e.record()
        e.synchronize()

    step = GuardStep()
    step()
    assert grc.host_ran_ahead(step, 10, cuda)[0] is False  # the old check's protocol: a false "blocked"
    assert grc.calls_for("guard.step") == 1 and grc.calls_for("all_gather") == 10
    assert grc.host_ran_ahead(step, grc.calls_for("guard.step"), cuda)[0] is True
    assert grc.host_ran_ahead(own_sync, 1, cuda)[0] is False
    assert grc.host_ran_ahead(lambda: None, 10, cuda)[0] is True


def test_gpu_scripts_refuse_clearly_without_cuda():
    root = LAUNCH.parent
    for script in ("gpu_ready_check.py", "gpu_cluster_check.py"):
        p = subprocess.run(
            [sys.executable, str(LAUNCH / script)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=root,
            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        )
        assert p.returncode == 2, (script, p.stdout, p.stderr)
        assert "no CUDA device" in p.stderr, (script, p.stderr)


def test_cluster_check_refuses_what_it_cannot_run(monkeypatch, capsys):
    """launch/gpu_cluster_check.py's refusals, in order, before any process group exists (CUDA mocked present)."""
    import gpu_cluster_check as gcc

    monkeypatch.setattr(gcc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gcc.torch.cuda, "device_count", lambda: 1)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert gcc.main([]) == 2 and "run under torchrun" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert gcc.main([]) == 2 and "needs 2 or more ranks" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert gcc.main([]) == 2 and "NCCL refuses two ranks on one GPU" in capsys.readouterr().err


def test_cluster_check_compares_bits_and_nan_positions():
    import gpu_cluster_check as gcc

    a = torch.tensor([1.0, float("nan"), -0.0])
    assert gcc.same(a, a.clone()) is None
    assert gcc.same(a, torch.tensor([1.0, float("nan"), 0.0])) == "1 of 2 values differ"  # -0 vs +0: bits
    assert "NaN positions" in gcc.same(a, torch.tensor([1.0, 2.0, -0.0]))


@pytest.mark.slow
def test_cluster_check_logic_runs_on_two_gloo_ranks(tmp_path):
    """--dry-run-cpu: the script's own logic (every call, the gloo references, the table) on 2 CPU ranks; what it
    proves about NCCL needs GPUs."""
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(LAUNCH / "gpu_cluster_check.py"), "--dry-run-cpu"],
        capture_output=True, text=True, timeout=600, cwd=LAUNCH.parent,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| hierarchical_nccl_groups.node1 | 2/2 |" in p.stdout and "overall: ok" in p.stdout


def test_stream_reuse_section_records_the_helper_rows(monkeypatch, tmp_path):
    """gpu_ready_check's stream_reuse section turns launch/gpu_check_streams.py's {"name", "ok", "detail"} rows into
    gpu.json rows and fails on any ok=False (the check function stubbed: no GPU here)."""
    import types

    import gpu_ready_check as grc

    fake = types.ModuleType("gpu_check_streams")
    fake.check_stream_reuse = lambda device: [
        {"name": "stream_reuse.evict", "ok": True, "detail": "10 outputs equal"},
        {"name": "stream_reuse.clear", "ok": False, "detail": "call 3 differs"},
    ]
    monkeypatch.setitem(sys.modules, "gpu_check_streams", fake)
    monkeypatch.setattr(grc, "init_nccl_1rank", lambda: None)
    path = tmp_path / "gpu.json"
    r = gpu_results.Runner(60, "test device", rows_path=path)
    res = r.run([gpu_results.Section("stream_reuse", grc.stream_reuse, min_s=0)])
    assert res["stream_reuse"]["status"] == "fail" and res["stream_reuse"]["failed"] == ["stream_reuse.clear"]
    rows = {x["name"]: x for x in json.loads(path.read_text())}
    assert rows["stream_reuse.evict"]["value"] is True and rows["stream_reuse.clear"]["value"] is False
    assert rows["stream_reuse.clear"]["unit"] == "call 3 differs" and rows["section_stream_reuse"]["value"] == "fail"


def test_codec_speed_section_writes_the_rows_plan_reads(tmp_path):
    """gpu_ready_check's codec_speeds section (run here on CPU at small sizes) writes rows that
    results_speeds, and so `fp8comm plan --codec-speeds docs/results/gpu.json`, reads back to the same speeds."""
    import gpu_ready_check

    from fp8comm.comm.calibration import WIRE_CONFIGS, results_speeds

    path = tmp_path / "gpu.json"
    run = gpu_results.Runner(60, "test device", rows_path=path)
    res = gpu_ready_check.codec_speeds(run, device="cpu", elems=(8 * 1024, 8 * 8192), reps=1)
    assert res["status"] == "ok" and set(res["codecs"]) == set(WIRE_CONFIGS)
    rows = json.loads(path.read_text())
    got = results_speeds(rows, "gpu.json")
    assert set(got) == set(WIRE_CONFIGS)
    by_name = {r["name"]: r["value"] for r in rows}
    for codec, s in got.items():
        assert s.pack == by_name[f"codec_{codec}_pack_elems_per_s"] > 0
        assert s.residual == by_name[f"codec_{codec}_residual_elems_per_s"] > 0
        assert s.fixed == by_name.get(f"codec_{codec}_fixed_s", 0.0)
