"""The fused torch.compile wire graphs (quantize straight into the send buffer, dequantize into strided outputs,
one-pass unpack_sum) are bit-exact against the reference backend, specials and signed zeros included."""

import pytest
import torch

from fp8comm.quant import (
    BlockScaling,
    ChunkLayout,
    MXScaling,
    Scaling,
    get_format,
    pack_chunks,
    unpack_chunks,
    unpack_sum,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:
        return t.contiguous().view(torch.uint8)
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).contiguous().view(torch.int32)


def nasty(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-30, 30, m, base=2.0).unsqueeze(1)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[1, :64] = -0.0  # whole-zero (negative) block start: scale 1.0, codes -0
    x[1, 64:70] = -1e-30  # underflows to -0 codes
    x[-1, :] = 0.0  # an all-zero row
    return x.to(dtype)


# Each config compiles its own graphs (seconds each): the three scale encodings, a 1x32 and a whole-row block.
CONFIGS = [
    ("e4m3", BlockScaling(128), torch.bfloat16),
    ("e5m2", MXScaling(), torch.float32),
    ("e4m3", Scaling(1, None, "pow2", 2), torch.bfloat16),
]


@pytest.mark.slow  # compile- or memory-bound (5-20 s on 2 cores): out of the fast tier, in the full run
@pytest.mark.parametrize("fmt,sc,dtype", CONFIGS, ids=lambda v: getattr(v, "describe", lambda: str(v))())
def test_fused_wire_graphs_bit_exact(fmt, sc, dtype):
    f = get_format(fmt)
    rows, k = (3, 0, 4, 1), 320  # 320: a partial last 128-block
    x = nasty(sum(rows), 2 * k, dtype, 1)[:, k // 2 : k // 2 + k]  # a strided column piece, like a pipeline piece
    lay = ChunkLayout(rows, k, sc)
    got = torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8)  # garbage: padding must be zeroed
    pack_chunks(x, lay, f, out=got, backend="compiled")
    want = pack_chunks(x, lay, f, backend="reference")
    assert torch.equal(got, want)
    # dequantize into a strided slice of a wider output (the rest must stay untouched)
    for odt in (torch.bfloat16, torch.float32):
        wide = torch.full((lay.total_rows, k + 7), 5.0, dtype=odt)
        unpack_chunks(want, lay, f, odt, out=wide[:, 3 : 3 + k], backend="compiled")
        ref_out = unpack_chunks(want, lay, f, odt, backend="reference")
        assert torch.equal(bits(wide[:, 3 : 3 + k]), bits(ref_out))
        assert (wide[:, :3] == 5).all() and (wide[:, 3 + k :] == 5).all()
    # unpack_sum over equal chunks (reduce-scatter receive side), signed zeros and non-finite included
    eq = ChunkLayout((2,) * 4, k, sc)
    xs = nasty(8, k, dtype, 2)
    xs[2:4, 100:110] = -0.0  # -0 in every chunk at the same place: the reference sum gives +0
    xs[4:6, 100:110] = -0.0
    xs[6:8, 100:110] = -0.0
    buf = pack_chunks(xs, eq, f, backend="reference")
    s_got = unpack_sum(buf, eq, f, out=torch.empty(2, k), backend="compiled")
    s_want = unpack_sum(buf, eq, f, backend="reference")
    assert torch.equal(bits(s_got), bits(s_want))


@pytest.mark.slow  # compiles the stochastic graph: ~25 s
def test_fused_pack_stochastic_uses_reference_bits():
    f, sc = get_format("e5m2"), BlockScaling(128)
    x = nasty(4, 256, torch.float32, 3)
    lay = ChunkLayout((2, 2), 256, sc)
    a = pack_chunks(x, lay, f, "stochastic", 11, backend="compiled")
    assert torch.equal(a, pack_chunks(x, lay, f, "stochastic", 11, backend="reference"))


def _grid_edges(fmt) -> torch.Tensor:
    """Every FP8 grid value, every midpoint between neighbours (the ties), 1-2 fp32 ulps either side of each, the
    range past max, fp32 subnormals; both signs: where a cast could round differently from round_to_grid."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    v = torch.unique(codes[torch.isfinite(codes) & (codes >= 0)])
    mids = (v[1:] + v[:-1]) / 2  # exact in fp32
    pts = torch.cat([v, mids, torch.tensor([fmt.max * 1.01, fmt.max * 1.5, 1e-45, 1e-40, 2.0**-126])])
    bits = pts.view(torch.int32)
    near = torch.cat([bits + d for d in (-2, -1, 0, 1, 2)]).clamp(min=0).view(torch.float32)
    return torch.cat([near, -near])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_nearest_cast_matches_round_to_grid(fmt):
    from fp8comm.quant import backend_compiled, reference

    f, sc = get_format(fmt), BlockScaling(128)
    y = _grid_edges(f)
    y = torch.cat([y, torch.zeros((-y.numel()) % 128)]).view(-1, 128)
    ones = torch.ones(y.shape[0], 1)
    want = reference.encode(y, ones, sc, f, "nearest", 0)
    for enc in (backend_compiled.encode_nearest, backend_compiled.encode_nearest_compiled):  # eager, then compiled
        assert torch.equal(enc(y, ones, sc, f).view(torch.uint8), want)


@pytest.mark.parametrize("margin", [0, -3, 24], ids=["fit", "saturate", "underflow"])
def test_fused_pack_counts_for_the_guard(margin):
    """The compiled pack's guard counts come out of the same graph and equal the reference's."""
    f, sc = get_format("e4m3"), BlockScaling(128, margin=margin)
    x = nasty(8, 320, torch.bfloat16, 2)
    x[2:4, ::128] = 1e9  # an outlier per block pushes the rest of the block to zero
    lay = ChunkLayout((3, 5), 320, sc)
    counts = {}
    for backend in ("reference", "compiled"):
        counts[backend] = torch.zeros(3, dtype=torch.int64)
        buf = pack_chunks(x, lay, f, backend=backend, counters=counts[backend])
        assert torch.equal(buf, pack_chunks(x, lay, f, backend="reference"))  # counting changes no byte
    assert counts["compiled"].tolist() == counts["reference"].tolist()
    assert counts["reference"][1] > 0 and counts["reference"][2] == 3 and (counts["reference"][0] > 0) == (margin < 0)
    with pytest.raises(ValueError, match="counters must be int64"):
        pack_chunks(x, lay, f, counters=torch.zeros(3))
