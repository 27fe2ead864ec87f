"""Single-process pieces of the pipelined / FP8-out collectives: the piece plan and the FP8-out receive side."""

import pytest
import torch

import fp8comm
from fp8comm.comm import WireConfig
from fp8comm.comm.pieces import PIPELINE_MAX, PIPELINE_PIECE, plan_pieces, row_part
from fp8comm.quant import BlockScaling, ChunkLayout, get_format, pack_chunks
from fp8comm.quant.wire import unpack_codes

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "k,block,numel,pipe",
    [
        (16 << 20, 128, 16 << 20, 0),
        (1000, 128, 1000, 3),
        (4096, 128, None, 0),
        (384, 128, 384, 7),
        (4 << 20, 32, 16 << 20, 5),
    ],
)
def test_plan_pieces_whole_blocks_cover_k(k, block, numel, pipe):
    ps = plan_pieces(k, block, numel, CPU, "nearest", pipe)
    assert ps[0][0] == 0 and ps[-1][1] == k
    assert all(b == c for (_, b), (c, _) in zip(ps, ps[1:]))  # contiguous, no gaps or overlaps
    assert all(a % block == 0 for a, _ in ps)  # every piece starts on a block boundary
    widths = {b - a for a, b in ps[:-1]}
    assert len(widths) <= 1 and ps[-1][1] - ps[-1][0] <= max(widths | {k})
    want = pipe or (min(PIPELINE_MAX, numel // PIPELINE_PIECE) if numel is not None else 1)
    assert len(ps) == max(1, min(want, -(-k // block)))


def test_plan_pieces_not_pipelined():
    k = 1 << 22
    assert plan_pieces(k, 128, k, torch.device("cuda"), "nearest", 0) == [(0, k)]  # GPU codec: no pieces
    assert plan_pieces(k, 128, k, CPU, "stochastic", 4) == [(0, k)]  # the rounding hash counts within a piece
    assert plan_pieces(k, None, k, CPU, "nearest", 4) == [(0, k)]  # one scale per chunk
    assert plan_pieces(k, 128, k, CPU, "nearest", 1) == [(0, k)]
    assert plan_pieces(1 << 20, 128, 1 << 20, CPU, "nearest", 0) == [(0, 1 << 20)]  # small: not worth it


@pytest.mark.parametrize("n,pieces", [(0, 8), (3, 8), (1024, 8), (1001, 7), (5, 1)])
def test_row_part_covers_chunk(n, pieces):
    parts = [row_part(n, p, pieces) for p in range(pieces)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))  # contiguous, no gaps or overlaps
    sizes = [b - a for a, b in parts]
    assert max(sizes) - min(sizes) <= 1  # near-equal, so no piece waits on a much bigger one


def test_pipeline_option():
    def pieces(v):
        return WireConfig(pipeline=v).pipeline

    assert pieces(None) == 0 and pieces("auto") == 0 and pieces(0) == 0 and pieces(False) == 1
    assert pieces(6) == 6
    for bad in ("many", -2, 2.5, 5000):
        with pytest.raises(ValueError, match="pipeline"):
            pieces(bad)


def test_unpack_codes_is_the_quantizer_output():
    f, sc = get_format("e4m3"), BlockScaling(128)
    rows, k = (2, 0, 3), 320
    x = torch.randn(5, k) * torch.logspace(-3, 3, 5).unsqueeze(1)
    lay = ChunkLayout(rows, k, sc)
    buf = pack_chunks(x, lay, f, backend="reference")
    codes = torch.full((5, k + 4), 7, dtype=torch.uint8)
    scales = torch.empty(5, 3)
    unpack_codes(buf, lay, codes[:, 2 : 2 + k], scales)  # a strided destination, like one pipeline piece
    q = fp8comm.quantize(x, "e4m3", 128, backend="reference")
    assert torch.equal(codes[:, 2 : 2 + k], q.data.view(torch.uint8)) and torch.equal(scales, q.scale)
    assert (codes[:, :2] == 7).all() and (codes[:, 2 + k :] == 7).all()
    with pytest.raises(ValueError, match="codes must be uint8"):
        unpack_codes(buf, lay, torch.empty(5, k), scales)
    with pytest.raises(ValueError, match="scales must be fp32"):
        unpack_codes(buf, lay, codes[:, 2 : 2 + k], torch.empty(5, 2))
    with pytest.raises(ValueError, match="wire buffer"):
        unpack_codes(buf[:10], lay, codes[:, 2 : 2 + k], scales)


@pytest.fixture
def one_rank():
    """A one-rank gloo default group (the collectives' real path, no second process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_polling_a_handle_inside_capture_is_refused_whatever_the_transfer_state(monkeypatch):
    """is_completed() inside capture raises even while the transfer is still in flight (it used to raise only once
    the transfer had finished, so the same program failed or not by timing; seen in CI under load)."""
    import fp8comm.comm.buffers as fb
    from fp8comm.errors import Fp8CommCaptureError

    class InFlight:
        def is_completed(self):
            return False

        def wait(self, timeout=None):
            return True

    monkeypatch.setattr(fb, "_GRAPH_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    h = fb.Handle([InFlight()], lambda: torch.zeros(1), device=torch.device("cpu"))
    with pytest.raises(Fp8CommCaptureError, match="Handle.is_completed"):
        h.is_completed()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not h.is_completed() and torch.equal(h.wait(), torch.zeros(1))


def test_cpu_tensors_never_ask_about_capture(one_rank, monkeypatch):
    """The capture query is asked only for CUDA tensors: the CPU build raises in it."""
    import fp8comm.comm as fc

    def boom():
        raise RuntimeError("is_current_stream_capturing asked for a CPU call")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", boom)
    x = torch.randn(256)
    assert torch.equal(fc.all_reduce(x, check=True), fc.all_reduce(x.clone(), check=False))
    assert fc.all_gather(x, async_op=True).wait().shape == (256,)


def test_graph_capture_refused_before_anything_moves(one_rank, monkeypatch):
    """Inside CUDA graph capture every collective raises Fp8CommCaptureError at its start (before the metadata
    check and the scratch lease), and a handle started before the capture refuses wait() during it and completes
    normally after. CPU tensors stand in for CUDA ones (the device-type list and the query are patched)."""
    import fp8comm.comm as fc
    import fp8comm.comm.buffers as fb
    from fp8comm.errors import Fp8CommCaptureError

    capturing = {"on": False}
    monkeypatch.setattr(fb, "_GRAPH_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    x = torch.randn(512)
    state = fc.default_state()
    want = fc.all_reduce(x)
    h = fc.all_gather(x, async_op=True)  # started before the capture
    capturing["on"] = True
    allocs, checks = state.pool.allocations, fc.comm_stats().get("all_gather", {}).get("check_bytes", 0)
    calls = {
        "all_gather": lambda: fc.all_gather(x, check=True),
        "all_gather_into": lambda: fc.all_gather_into(torch.empty(512), x, check=True),
        "reduce_scatter": lambda: fc.reduce_scatter(x, check=True),
        "reduce_scatter_into": lambda: fc.reduce_scatter_into(torch.empty(512), x, check=True),
        "all_reduce": lambda: fc.all_reduce(x, check=True, async_op=True),
        "all_to_all": lambda: fc.all_to_all(x.view(4, 128), [4], [4], check=True),
        "Handle.wait": h.wait,
    }
    for name, fn in calls.items():
        op = name.replace("_into", "")  # the into-buffer variants report their op's name
        with pytest.raises(Fp8CommCaptureError, match=f"fp8comm.{op}: called inside CUDA graph capture"):
            fn()
    with pytest.raises(Fp8CommCaptureError):
        h.is_completed()  # would run the decode inside the capture
    assert state.pool.allocations == allocs, "a refused call leased scratch memory"
    assert fc.comm_stats().get("all_gather", {}).get("check_bytes", 0) == checks, "a refused call ran the check"
    capturing["on"] = False
    assert torch.equal(h.wait(), fc.all_gather(x)) and h.is_completed()
    assert torch.equal(fc.all_reduce(x), want)


def test_two_level_all_gather_cuts_smaller_pieces():
    """A two-level all-gather's tail after the link is its last piece's node-local gather and decode: it plans pieces
    GATHER_SPLIT times smaller, from what crosses the rails (nodes x shard), not the whole output: each piece costs
    every rank of a node a gather and a decode call per node-mate. A 16 MiB bf16 call (8 Mi output elements) runs 2
    pieces at 2x4 and 4 at 2x2 (a reduce-scatter of the same buffer: 4); the planner's model cuts it the same way."""
    from fp8comm.comm.pieces import GATHER_SPLIT, piece_count
    from fp8comm.comm.planner import GroupShape, Option, pieces

    E = 8 << 20
    assert piece_count(E, CPU, "nearest", 0) == 4
    assert piece_count(E, CPU, "nearest", 0, GATHER_SPLIT) == 8
    assert piece_count(E, CPU, "nearest", 3, GATHER_SPLIT) == 3  # an explicit piece count wins
    assert piece_count(64 << 20, CPU, "nearest", 0, GATHER_SPLIT) == PIPELINE_MAX
    sh = GroupShape(2, 4)
    assert pieces("all_gather", Option("fp8", "two_level"), E, sh, "cpu") == 2
    assert pieces("all_gather", Option("fp8", "two_level"), E, GroupShape(2, 2), "cpu") == 4
    assert pieces("all_gather", Option("fp8", "two_level"), E, GroupShape(4, 2), "cpu") == 4
    assert pieces("reduce_scatter", Option("fp8", "two_level"), E, sh, "cpu") == 4
    assert pieces("all_gather", Option("fp8", "two_level"), E, sh, "cuda") == 1


def test_all_reduce_phases_keep_their_own_pieces():
    """fp8comm's all_reduce runs its all-gather phase after the reduce-scatter's sum (comm/collectives.py), and that
    phase plans its pieces as an all-gather does (flat: from the shard; two levels: GATHER_SPLIT times smaller). The
    model predicts the two phases one after the other, each with its own pieces, the metadata check once."""
    import dataclasses

    from fp8comm.comm import linkmodel as lm
    from fp8comm.comm.calibration import Calibration, Link
    from fp8comm.comm.planner import GroupShape, Option, estimate, pieces

    cal = Calibration(
        inter=Link(1.2e8, 2e-4),
        intra=Link(6e8, 1e-4),
        codecs={"fp8": lm.CodecSpeed(2e8, 3e8, 3e8)},
        device="cpu",
        ranks_per_node=4,
        backend="gloo",
        call_overhead=3e-3,
    )
    sh, E = GroupShape(2, 4), 8 << 20
    m = cal.machine(2, 4)
    for levels, p_rs, p_ag in (("two_level", 4, 2), ("flat", 4, 1)):
        o = Option("fp8", levels)
        assert (pieces("reduce_scatter", o, E, sh, "cpu"), pieces("all_gather", o, E, sh, "cpu")) == (p_rs, p_ag)
        rs = lm.time("reduce_scatter", levels, "fp8", m, E, p_rs)
        ag = lm.time("all_gather", levels, "fp8", dataclasses.replace(m, call_overhead=0.0), E, p_ag)
        got = estimate("all_reduce", 2 * E, "bf16", sh, o, cal)
        assert got.seconds == pytest.approx(rs.seconds + ag.seconds), levels
        assert got.levels == rs.levels + ag.levels
