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
    monkeypatch.setattr("fp8comm.quant.codec.pack_chunks", lambda *a, **k: packs.append(k["counters"]))
    g = Guard(GuardPolicy())
    b = g.bucket("w", torch.device("cpu"))
    call = Call.__new__(Call)  # only what Call.pack reads
    from fp8comm.comm.config import WireConfig

    call.guard, call.spec, call.seed = b, WireConfig().spec, 0

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


# ------------------------------------------------------------------------------------------- 4-bit buckets
def feed4(guard: Guard, key: str, flushed: int, elements: int = 1000) -> None:
    """One step of a 4-bit bucket as the collectives count it: 4-bit packs while the guard says "fp4", FP8 packs
    (with `flushed` standing for FP8 underflow) while demoted, nothing while on BF16."""
    b = guard.bucket(key, torch.device("cpu"), fp4=True)
    w = guard.wire(key)
    if w == "bf16":
        return
    b.counters += torch.tensor([0, flushed if w == "fp4" else 0, 0])
    b.add_elements(elements, fp4=w == "fp4")


def test_fp4_bucket_falls_back_to_fp8_then_returns():
    g = Guard(GuardPolicy(threshold=0.01, patience=2, cooldown=3, fp4_threshold=0.25))
    wires = []
    for step in range(10):
        feed4(g, "normal", flushed=120)  # 12% flushed: normal at 4 bits, 120x the FP8 threshold
        feed4(g, "spiky", flushed=400 if step < 4 else 50)  # 40% for 4 steps
        wires.append(g.step())
    assert [w["normal"] for w in wires] == ["fp4"] * 10
    assert [w["spiky"] for w in wires] == ["fp4", "fp4", "fp8", "fp8", "fp8", "fp4", "fp4", "fp4", "fp4", "fp4"]
    assert g.summary()["spiky"]["switches"] == 2


def test_fp4_bucket_demoted_to_fp8_can_go_on_to_bf16():
    g = Guard(GuardPolicy(threshold=0.01, patience=1, cooldown=4, fp4_threshold=0.25))
    b = g.bucket("k", torch.device("cpu"), fp4=True)
    assert g.wire("k") == "fp4"
    seen = []
    for _ in range(6):
        w = g.wire("k")
        if w != "bf16":  # 4 bits: 30% flushed; FP8: 5% underflowed (over the FP8 threshold as well)
            b.counters += torch.tensor([0, 300 if w == "fp4" else 50, 0])
            b.add_elements(1000, fp4=w == "fp4")
        seen.append(g.step()["k"])
    # one step of lag: step 0's 4-bit counts demote at step() #2; step 1's (4-bit, already decided) are passed over;
    # step 2's FP8 counts take it on to BF16 at step() #4
    assert seen[:4] == ["fp4", "fp8", "fp8", "bf16"], seen
    assert g.summary()["k"]["switches"] == 2


def test_config_for_demotes_4bit_configs_only():
    from fp8comm.comm import WireConfig, config_for

    c4 = WireConfig(fmt="mxfp4", rounding="stochastic", hadamard=32)
    assert config_for(c4, "fp4") is c4
    d = config_for(c4, "fp8", "e5m2")
    assert (d.fmt, d.block_size, d.hadamard, d.rounding) == ("e5m2", 128, 0, "stochastic")
    c8 = WireConfig(fmt="e4m3")
    assert config_for(c8, "fp8") is c8 and config_for(c8, "bf16") is None
    with pytest.raises(ValueError, match="unknown guard wire"):
        config_for(c8, "int4")
    with pytest.raises(ValueError, match="fp4_threshold"):
        GuardPolicy(fp4_threshold=1.0)
