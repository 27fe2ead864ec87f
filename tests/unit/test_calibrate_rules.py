"""fp8comm.comm.calibrate's arithmetic without ranks: a link from two timed sizes, rank 0's slowest rule (the
node-local link of the slowest rank, a node's cross-node window up to its last rail exchange, each codec's slowest
rank), and measure_codecs at two sizes."""

from __future__ import annotations

import math

import pytest
import torch

from fp8comm.comm.calibrate import CODEC_ELEMS, LARGE_ELEMS, _build, _link, _peers, codec_elems_problem, rail_sizes
from fp8comm.comm.calibration import Calibration, measure_codecs
from fp8comm.errors import Fp8CommConfigError
from fp8comm.quant import dispatch
from fp8comm.quant.dispatch import COMPILE_MIN_NUMEL

SIZES = (1 << 10, 1 << 20)


def t(bw: float, lat: float, n: int = 1) -> list[float]:
    return [lat + n * s / bw for s in SIZES]


def test_link_from_two_sizes():
    bw, lat = _link(t(1e8, 2e-4), SIZES)
    assert bw == pytest.approx(1e8) and lat == pytest.approx(2e-4)
    bw, lat = _link(t(5e7, 1e-3, 2), SIZES, 2)  # two rails' bytes in one window
    assert bw == pytest.approx(5e7) and lat == pytest.approx(1e-3)
    # no positive difference (noise): the large size's own rate; latency what the small exchange took beyond it
    bw, lat = _link([0.02, 0.01], SIZES)
    assert bw == SIZES[1] / 0.01 and lat == pytest.approx(0.02 - SIZES[0] / bw)


def test_peers_node_mates_and_rails():
    nodes = [0, 0, 1, 1, 2, 2]
    assert [_peers(r, nodes) for r in range(6)] == [
        {"intra": 1, "inter": 2},
        {"intra": 0, "inter": 3},
        {"intra": 3, "inter": 0},
        {"intra": 2, "inter": 1},
        {"intra": 5, "inter": None},  # an odd node out waits
        {"intra": 4, "inter": None},
    ]
    assert _peers(2, [0, 0, 0, 1, 1, 1])["intra"] is None  # an odd rank out


def test_rank_zero_keeps_the_slowest():
    reps = lambda x: [[x[0]] * 3, [x[1]] * 3]
    # 2 nodes x 2 ranks; rank 1's node-local link is the slowest; on node 1 one rail pair is slow, so the node's
    # window ends with it (the other pair's fast exchanges do not count twice)
    intra = [t(1e9, 1e-5), t(4e8, 3e-5), t(1e9, 1e-5), t(1e9, 1e-5)]
    inter = [t(1e8, 1e-4), t(1e8, 1e-4), t(1e8, 1e-4), t(2.5e7, 2e-4)]
    codecs = [{"fp8": [1e8, 4e8]}, {"fp8": [9e7, 5e8]}, {"fp8": [2e8, 3e8]}, {"fp8": [1e8, 4e8]}]
    rows = [
        {"rank": i, "links": {"intra": reps(intra[i]), "inter": reps(inter[i]), "ring": [[1e-4 + SIZES[0] / 1e8] * 3]},
         "codecs": codecs[i], "links_s": 0.1, "codecs_s": 0.2, "first_calls_s": 0.05}
        for i in range(4)
    ]  # fmt: skip
    out = _build(rows, [0, 0, 1, 1], SIZES, 4, {"go_s": 0.01, "decided_s": 0.4})
    cal = Calibration.from_dict(out["calibration"], device="cpu", ranks_per_node=2)
    # bandwidth: the slowest rank's; latency: the typical small exchange (three ranks' 1e-5 s + bytes at 1e9), less
    # its bytes at that slowest bandwidth
    small = SIZES[0]
    assert cal.intra.bandwidth == pytest.approx(4e8)
    assert cal.intra.latency == pytest.approx(1e-5 + small / 1e9 - small / 4e8)
    # node 0: one window moved both rails' bytes at 1e8 each: 2e8; node 1: the window is the slow pair's (2.5e7),
    # in which both rails' bytes moved: 5e7, the slowest node
    nodes = {x["node"]: x["inter"] for x in out["report"]["nodes"]}
    assert nodes[0][0] == pytest.approx(2e8) and nodes[1][0] == pytest.approx(5e7)
    # cross-node: the typical ring step (1e-4 s + its bytes at 1e8), less its bytes at the slowest node's 5e7
    assert cal.inter.bandwidth == pytest.approx(5e7)
    assert cal.inter.latency == pytest.approx(1e-4 + small / 1e8 - small / 5e7)
    assert cal.codecs["fp8"].pack == 9e7 and cal.codecs["fp8"].unpack_sum == 3e8 == cal.codecs["fp8"].unpack
    assert cal.ranks_per_node == 2 and cal.world_size == 4 and cal.backend == "gloo"
    assert out["report"]["seconds"]["without_first_calls_s"] == pytest.approx(0.35)


def test_latency_is_the_typical_exchange_not_the_stalls():
    """A shared host stalls some small exchanges for milliseconds (the simulated cluster: 0.1-0.4 ms, or 2-4 ms in about
    a third of the windows). The slowest rank's median, or a node's slowest rail per window, lands on the stalls; the
    median of every rank's exchanges, pooled, does not; nor does the ranks' median fixed cost per codec call."""
    typical, stall, n = 3e-4, 3e-3, 15
    large = [0.02] * 3

    def small(stalled: set[int]) -> list[float]:
        return [stall if j in stalled else typical for j in range(n)]

    # rank 3 stalled in 8 of 15 windows (its own median is a stall); the rails of a node stall in different windows
    stalls = [set(range(0, 5)), set(range(5, 10)), set(range(10, 15)), set(range(0, 15, 2))]
    rows = [
        {"rank": i, "links": {"intra": [small(stalls[i]), large], "inter": [small(stalls[(i + 1) % 4]), large],
                              "ring": [small(stalls[(i + 2) % 4])]},
         "codecs": {"fp8": [1e8, 4e8]}, "codec_fixed": {"fp8": [3e-4, 3.5e-4, 4e-4, 3e-3][i]}, "links_s": 0.1,
         "codecs_s": 0.2, "first_calls_s": 0.05}
        for i in range(4)
    ]  # fmt: skip
    out = _build(rows, [0, 0, 1, 1], SIZES, 4, {"go_s": 0.01, "decided_s": 0.4})
    cal = Calibration.from_dict(out["calibration"], device="cpu", ranks_per_node=2)
    assert cal.codecs["fp8"].fixed == pytest.approx(3.75e-4)  # the ranks' median: rank 3's short calls met a stall
    assert cal.intra.latency == pytest.approx(typical - SIZES[0] / cal.intra.bandwidth)
    assert cal.inter.latency == pytest.approx(typical - SIZES[0] / cal.inter.bandwidth)  # from the ring's steps
    lat = out["report"]["latency"]
    assert lat["inter"]["from"] == "ring" and lat["inter"]["samples"] == 4 * n and lat["intra"]["median_s"] == typical
    # the older rules the report still shows per rank and node: rank 3's median, and node 0's windows, are stalls
    assert max(x["intra"][1] for x in out["report"]["ranks"]) > 2e-3
    assert max(x["inter"][1] for x in out["report"]["nodes"]) > 2e-3


def test_large_calls_keep_their_kernels_speed_and_fixed_cost():
    """Calls from the kernel switch on: each codec's slowest rank at the two large sizes, the ranks' median fixed
    cost per call (a rank's JSON from before the large fixed cost, three numbers, reads as 0)."""
    links = {"intra": [[1e-4] * 3, [2e-3] * 3], "inter": [[1e-4] * 3, [2e-3] * 3], "ring": [[2e-4] * 3]}
    base = {"links": links, "links_s": 0.1}
    large = [[LARGE_ELEMS[0], 9e8, 2e9, 3e-4], [LARGE_ELEMS[0], 7e8, 3e9, 1e-4], [LARGE_ELEMS[0], 8e8, 1e9, 2e-4]]
    rows = [
        {**base, "rank": i, "codecs": {"fp8": [1e8, 4e8]}, "codecs_large": {"fp8": large[i]}, "codecs_s": 0.2,
         "first_calls_s": 0.05}
        for i in range(3)
    ]  # fmt: skip
    cal = Calibration.from_dict(_build(rows, [0, 0, 1], SIZES, 3, {"go_s": 0.01, "decided_s": 0.4})["calibration"])
    at, big = cal.codecs["fp8"].above
    assert at == COMPILE_MIN_NUMEL and (big.pack, big.unpack_sum, big.fixed) == (7e8, 1e9, 2e-4)
    assert cal.codecs["fp8"].at(COMPILE_MIN_NUMEL) is big and cal.codecs["fp8"].at(COMPILE_MIN_NUMEL - 1).pack == 1e8
    rows[0]["codecs_large"]["fp8"] = large[0][:3]
    cal = Calibration.from_dict(_build(rows, [0, 0, 1], SIZES, 3, {"go_s": 0.01, "decided_s": 0.4})["calibration"])
    assert cal.codecs["fp8"].above[1].fixed == 1e-4  # median of 0, 1e-4, 2e-4


def test_codec_timings_stay_on_one_side_of_the_kernel_switch(monkeypatch):
    """CPU FP8 runs the torch reference below COMPILE_MIN_NUMEL elements and the compiled kernel from there; the
    calibration times each kernel at two sizes on its own side (one intercept per kernel), and refuses a pair that
    straddles the switch."""
    monkeypatch.setattr(dispatch, "compiled_cpu_problem", lambda device: None)  # a C++ compiler, as here
    cpu = torch.device("cpu")
    assert COMPILE_MIN_NUMEL == 1 << 19
    assert dispatch.backend_name("auto", cpu, COMPILE_MIN_NUMEL - 1) == "reference"
    assert dispatch.backend_name("auto", cpu, COMPILE_MIN_NUMEL) == "compiled"
    assert CODEC_ELEMS[1] < COMPILE_MIN_NUMEL == LARGE_ELEMS[0] < LARGE_ELEMS[1]
    assert codec_elems_problem(CODEC_ELEMS) is None and codec_elems_problem(LARGE_ELEMS) is None
    assert "straddle the CPU kernel switch at 524288" in codec_elems_problem((1 << 14, 1 << 19))


def test_measure_codecs_at_two_sizes():
    tm: dict = {}
    got = measure_codecs(["fp8", "mxfp4"], elems=(8 * 256, 8 * 4096), reps=1, kinds=("pack", "unpack_sum"), timings=tm)
    for s in got.values():
        assert math.isfinite(s.pack) and s.pack > 0 and s.unpack == s.unpack_sum > 0 and s.residual == 0
        assert "from the difference" in s.source and "not timed: unpack, residual" in s.source
    assert set(tm) == {"fp8", "mxfp4"} and all(v["first_call_s"] > 0 and v["timed_s"] > 0 for v in tm.values())
    with pytest.raises(Fp8CommConfigError, match="small < large"):
        measure_codecs(elems=(4096, 1024))
    with pytest.raises(Fp8CommConfigError, match="kinds must include pack and unpack_sum"):
        measure_codecs(kinds=("unpack",))


def test_measuring_codecs_leaves_the_callers_random_stream_alone():
    """The planner calibrates at install, before the model is built: the codec timing's test data must not draw
    from torch's global generator, or the model's initialization (and the whole run) changes with the planner on."""
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    measure_codecs(["fp8"], elems=(8 * 256,), reps=1, kinds=("pack", "unpack_sum"))
    assert torch.equal(torch.rand(4), want)


def test_rails_share_the_large_exchange_beyond_two_per_node():
    """Four rails per node cross one link at once: each moves half the large size (the node's window stays two large
    exchanges long on a slow link), and the node's bandwidth counts the bytes they really moved."""
    assert rail_sizes(SIZES, 1) == rail_sizes(SIZES, 2) == SIZES
    assert rail_sizes(SIZES, 4) == (SIZES[0], SIZES[1] // 2) and rail_sizes(SIZES, 8) == (SIZES[0], SIZES[1] // 4)
    assert rail_sizes((1 << 10, 1 << 11), 64) == (1 << 10, 1 << 10)  # never under the small size
    reps = lambda x: [[x[0]] * 3, [x[1]] * 3]
    small, large = rail_sizes(SIZES, 4)
    # every rail gets a quarter of a 1e8 B/s link: each exchange of `large` bytes takes large / 2.5e7
    rail = [1e-4 + small / 2.5e7, 1e-4 + large / 2.5e7]
    rows = [
        {"rank": i, "links": {"intra": reps(t(1e9, 1e-5)), "inter": reps(rail), "ring": [[2e-4] * 3]},
         "codecs": {"fp8": [1e8, 4e8]}, "links_s": 0.1, "codecs_s": 0.2, "first_calls_s": 0.05}
        for i in range(8)
    ]  # fmt: skip
    out = _build(rows, [0, 0, 0, 0, 1, 1, 1, 1], SIZES, 8, {"go_s": 0.01, "decided_s": 0.4})
    cal = Calibration.from_dict(out["calibration"], device="cpu", ranks_per_node=4)
    assert cal.inter.bandwidth == pytest.approx(1e8)
    assert [x["inter"][0] for x in out["report"]["ranks"]] == [pytest.approx(2.5e7)] * 8


def test_small_calls_are_each_calls_slowest_rank_then_the_median():
    reps = lambda x: [[x[0]] * 3, [x[1]] * 3]
    base = {"links": {"intra": reps(t(1e9, 1e-5)), "inter": reps(t(1e8, 1e-4)), "ring": [[1e-4] * 3]},
            "codecs": {"fp8": [1e8, 4e8]}, "links_s": 0.1, "codecs_s": 0.2, "first_calls_s": 0.05}  # fmt: skip
    calls = [[1e-3, 9e-3, 2e-3], [2e-3, 1e-3, 1e-3], [1e-3, 1e-3, 4e-3], [1e-3, 1e-3, 1e-3]]
    rows = [base | {"rank": i, "calls": {"all_gather/flat/fp8": calls[i]}, "calls_s": 0.3} for i in range(4)]
    out = _build(rows, [0, 0, 1, 1], SIZES, 4, {"go_s": 0.01, "decided_s": 0.4})
    cal = Calibration.from_dict(out["calibration"])
    # per call the slowest rank (2e-3, 9e-3, 4e-3: a collective ends with its last member), then the median
    assert cal.small_calls == {"all_gather/flat/fp8": 4e-3} and cal.small_call_elems == (1 << 15)
    assert out["report"]["seconds"]["calls_s"] == 0.3
    # a rank whose small calls failed: the calibration stands without any, and says why
    rows[2] = base | {"rank": 2, "calls_failed": "TimeoutError: late", "calls_s": 5.0}
    cal = Calibration.from_dict(_build(rows, [0, 0, 1, 1], SIZES, 4, {"go_s": 0.01, "decided_s": 0.4})["calibration"])
    assert cal.small_calls == {} and cal.small_call_elems == 0
    assert any("small calls not timed" in n and "2 (TimeoutError: late)" in n for n in cal.notes)


def test_large_calls_are_each_calls_slowest_rank_then_the_median_and_need_every_rank():
    reps = lambda x: [[x[0]] * 3, [x[1]] * 3]
    base = {"links": {"intra": reps(t(1e9, 1e-5)), "inter": reps(t(1e8, 1e-4)), "ring": [[1e-4] * 3]},
            "codecs": {"fp8": [1e8, 4e8]}, "links_s": 0.1, "codecs_s": 0.2, "first_calls_s": 0.05,
            "calls": {"all_gather/flat/fp8": [1e-3] * 3, "all_gather/gloo/bf16": [1e-3] * 3}, "calls_s": 0.3,
            "large_elems": 1 << 22, "large_s": 0.2}  # fmt: skip
    big = [[5e-2, 9e-2, 6e-2], [7e-2, 5e-2, 5e-2], [5e-2, 5e-2, 8e-2], [5e-2, 5e-2, 5e-2]]
    rows = [base | {"rank": i, "large_calls": {"all_gather/flat/fp8": big[i]}} for i in range(4)]
    out = _build(rows, [0, 0, 1, 1], SIZES, 4, {"go_s": 0.01, "decided_s": 0.4})
    cal = Calibration.from_dict(out["calibration"])
    # per call the slowest rank (7e-2, 9e-2, 8e-2), then the median; the option left out (budget) is said
    assert cal.large_calls == {"all_gather/flat/fp8": 8e-2} and cal.large_call_elems == 1 << 22
    assert any(n.startswith("large calls: 1 of 2 options timed (their timed calls reached 6 s") for n in cal.notes)
    assert out["report"]["seconds"]["large_calls_s"] == 0.2
    # stopped because a rank neared the deadline: the notes say so
    rows = [r | {"large_stop": "deadline"} for r in rows]
    cal = Calibration.from_dict(_build(rows, [0, 0, 1, 1], SIZES, 4, {"go_s": 0.01, "decided_s": 0.4})["calibration"])
    assert any("(a rank had less than 30 s left;" in n for n in cal.notes), cal.notes
    # a rank whose large calls failed mid-way: the options every rank finished stand, the small calls too, and the
    # notes say why
    two = {"all_gather/flat/fp8": big[0], "all_gather/gloo/bf16": [5e-2] * 3}
    rows = [base | {"rank": i, "large_calls": dict(two)} for i in range(4)]
    rows[1] = base | {"rank": 1, "large_calls": {"all_gather/flat/fp8": big[1]}, "large_failed": "TimeoutError: late"}
    cal = Calibration.from_dict(_build(rows, [0, 0, 1, 1], SIZES, 4, {"go_s": 0.01, "decided_s": 0.4})["calibration"])
    assert cal.large_calls == {"all_gather/flat/fp8": 7e-2} and len(cal.small_calls) == 2
    assert any("1 of 2 options timed (failed on rank(s) 1 (TimeoutError: late)" in n for n in cal.notes), cal.notes
