"""The numerics guard's policy on one process: counts in, per-step wire decisions out (one step of lag)."""

import pytest
import torch

from fp8comm.comm import Guard, GuardPolicy, comm_stats


def feed(guard: Guard, key: str, bad: int, elements: int = 1000, nonfinite: int = 0) -> None:
    """What the packing kernels and the collective add in one step: `bad` underflowed elements."""
    b = guard.bucket(key, torch.device("cpu"))
    if guard.wire(key) == "fp8":  # a bucket in BF16 sends through the engine's own collective: nothing counted
        b.counters += torch.tensor([0, bad, nonfinite])
        b.add_elements(elements)


def test_policy_validation():
    for bad in (dict(threshold=0), dict(threshold=1.5), dict(patience=0), dict(cooldown=-1), dict(patience=1.5)):
        with pytest.raises(ValueError, match="guard"):
            GuardPolicy(**bad)


def test_fallback_after_patience_then_fp8_again():
    g = Guard(GuardPolicy(threshold=0.01, patience=2, cooldown=3))
    before = comm_stats().get("guard.to_bf16", {}).get("calls", 0)
    wires = []
    for step in range(10):
        feed(g, "healthy", bad=1)  # 0.1%: under the threshold
        feed(g, "outliers", bad=100 if step < 4 else 0)  # 10% for the first 4 steps
        wires.append(g.step())
    assert [w["healthy"] for w in wires] == ["fp8"] * 10
    # step k's counts decide at step k+1: over at steps 0 and 1 -> decided at the steps 1 and 2 -> BF16 from the
    # wire returned by step() #3 for `cooldown` steps, then FP8 (the data fits again)
    assert [w["outliers"] for w in wires] == ["fp8", "fp8", "bf16", "bf16", "bf16", "fp8", "fp8", "fp8", "fp8", "fp8"]
    assert g.summary()["outliers"]["switches"] == 2 and g.summary()["healthy"]["switches"] == 0
    assert comm_stats()["guard.to_bf16"]["calls"] == before + 1
    assert [h["step"] for h in g.history][:2] == [2, 3] and g.history[0]["outliers"] == pytest.approx(0.1)


def test_nonfinite_never_triggers_a_fallback():
    g = Guard(GuardPolicy(threshold=0.01, patience=1, cooldown=2))
    for _ in range(5):
        feed(g, "b", bad=0, nonfinite=900)  # inf/NaN must reach the engine's overflow check, in FP8 as before
        assert g.step()["b"] == "fp8"


def test_state_dict_round_trip_and_policy_mismatch():
    g = Guard(GuardPolicy(threshold=0.01, patience=1, cooldown=5))
    for _ in range(3):
        feed(g, "b", bad=500)
        g.step()
    sd = g.state_dict()
    h = Guard(GuardPolicy(threshold=0.01, patience=1, cooldown=5))
    h.load_state_dict(sd)
    assert h.wire("b") == "bf16" and h.summary() == g.summary() and h.steps == g.steps
    with pytest.raises(ValueError, match="policy"):
        Guard(GuardPolicy(threshold=0.02)).load_state_dict(sd)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    g = Guard(GuardPolicy(threshold=0.01, patience=1, cooldown=2))
    for step in range(6):
        feed(g, "a", bad=step * 10)
        g.step()
    g.plot(str(tmp_path / "guard.png"))
    assert (tmp_path / "guard.png").stat().st_size > 1000


class _FakeEvent:
    def __init__(self, log: list) -> None:
        self.log, self.stream = log, None

    def record(self, stream) -> None:
        self.stream = stream
        self.log.append(("record", stream.name, id(self)))


class _FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, ev) -> None:
        self.log.append(("wait", self.name, id(ev)))


def test_counters_ordered_across_streams_by_events(monkeypatch):
    """The guard's CUDA ordering logic with fake streams and events (CPU counters standing in for device ones): the
    step stream waits for the last pack on every other stream before it reads the counters, and a pack after the
    step waits for the step's zeroing, once per stream; nothing waits on its own stream."""
    import fp8comm.comm.guard as gm
    from fp8comm.comm.core import Call

    log: list = []
    streams = {n: _FakeStream(n, log) for n in ("gather", "reduce", "step")}
    current = {"s": streams["gather"]}
    monkeypatch.setattr(gm, "_STREAM_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(gm, "_current_stream", lambda device: current["s"])
    monkeypatch.setattr(gm, "_new_event", lambda: _FakeEvent(log))
    packs: list = []
    monkeypatch.setattr("fp8comm.comm.core.pack_chunks", lambda *a, **k: packs.append(k["counters"]))
    g = Guard(GuardPolicy())
    b = g.bucket("w", torch.device("cpu"))
    call = Call.__new__(Call)  # only what Call.pack reads
    call.guard, call.spec, call.seed = b, type("S", (), {"fmt": None, "rounding": "nearest"})(), 0

    def pack(stream: str) -> None:
        current["s"] = streams[stream]
        Call.pack(call, torch.zeros(1, 4), None, None, "reference")

    pack("gather")
    pack("gather")
    pack("reduce")
    assert [e[0] for e in log] == ["record"] * 3 and packs == [b.counters] * 3
    last = {e[1]: e[2] for e in log if e[0] == "record"}  # the last event recorded on each stream
    log.clear()
    current["s"] = streams["step"]
    g.step()
    waits = [e for e in log if e[0] == "wait"]
    assert sorted(waits) == sorted([("wait", "step", last["gather"]), ("wait", "step", last["reduce"])]), log
    zero = [e for e in log if e[0] == "record"]
    assert len(zero) == 1 and zero[0][1] == "step" and log.index(zero[0]) > max(log.index(w) for w in waits), log
    log.clear()
    pack("gather")
    pack("gather")  # the same stream is ordered behind the zeroing once
    pack("reduce")
    current["s"] = streams["step"]
    pack("step")  # the stream that zeroed needs no wait
    assert [e for e in log if e[0] == "wait"] == [("wait", "gather", zero[0][2]), ("wait", "reduce", zero[0][2])]
    first = [e[0] for e in log if e[1] == "gather"]
    assert first[:2] == ["wait", "record"], log  # the wait comes before the pack that adds
