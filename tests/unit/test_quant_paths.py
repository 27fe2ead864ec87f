"""Fast paths vs the reference (bit-exact), error-bound properties, stochastic rounding, the chunked wire format."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8comm
from fp8comm.quant import (
    BlockScaling,
    ChunkLayout,
    MXScaling,
    RowScaling,
    Scaling,
    TensorScaling,
    dequantize,
    get_format,
    pack_chunks,
    quantize,
    quantize_with_transpose,
    unpack_chunks,
    unpack_sum,
)
from fp8comm.quant import reference as ref

SCALINGS = [
    TensorScaling(),
    TensorScaling("pow2", 3),
    RowScaling(),
    BlockScaling(128),
    MXScaling(),
    BlockScaling(128, 128),
    BlockScaling(128, encoding="e8m0"),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Exact bits (signed zeros included); NaN payloads are canonicalised, since upcast paths differ only there."""
    if t.element_size() == 1:
        return t.contiguous().view(torch.uint8)
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).contiguous().view(torch.int32)


@pytest.mark.slow  # every bf16 pattern through a fresh compile: 40-60 s on 2 cores
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_compiled_bit_exact_all_bf16(all_bf16, fmt):
    for sc in [TensorScaling(), BlockScaling(128), MXScaling(), BlockScaling(128, 128)]:
        for rounding in ["nearest", "stochastic"]:
            a = fp8comm.quantize(all_bf16, fmt, scaling=sc, rounding=rounding, seed=7, backend="reference")
            b = fp8comm.quantize(all_bf16, fmt, scaling=sc, rounding=rounding, seed=7, backend="compiled")
            assert torch.equal(bits(a.data), bits(b.data)) and torch.equal(bits(a.scale), bits(b.scale))
            assert torch.equal(bits(a.dequantize(backend="reference")), bits(b.dequantize(backend="compiled")))
    q = fp8comm.quantize(all_bf16, fmt, None, scale=torch.tensor(2.0**-12), backend="compiled")
    r = fp8comm.quantize(all_bf16, fmt, None, scale=torch.tensor(2.0**-12), backend="reference")
    assert torch.equal(bits(q.data), bits(r.data))


def half_ulp_bound(x: torch.Tensor, q) -> torch.Tensor:
    """Half an FP8 ulp at |x/s| times the block scale, plus the fp32 rounding of x/s itself."""
    m, k = q.data.reshape(-1, q.shape[-1] if q.shape else 1).shape if q.data.dim() else (1, 1)
    s = ref.expand_scale(q.scale, m, k, q.scaling).reshape(x.shape)
    y = (x.float() / s).abs().clamp(max=q.fmt.max)
    return 0.5 * torch.ldexp(torch.ones_like(y), ref.grid_exponent(y, q.fmt)) * s + x.float().abs() * 2.0**-23


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 300),
    log_scale=st.floats(-30, 30),
    dist=st.sampled_from(["normal", "heavy", "uniform", "outliers"]),
    sc=st.sampled_from(SCALINGS),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    seed=st.integers(0, 2**31),
)
def test_error_within_half_ulp(m, k, log_scale, dist, sc, fmt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if dist == "heavy":
        x = x / torch.rand(m, k, generator=g).clamp(min=1e-3) ** 2
    elif dist == "uniform":
        x = torch.rand(m, k, generator=g) - 0.5
    elif dist == "outliers":
        x[:, :: max(1, k // 3)] *= 1e4
    x = x * 2.0**log_scale
    q = fp8comm.quantize(x, fmt, scaling=sc)
    err = (q.dequantize() - x).abs()
    assert torch.all(err <= half_ulp_bound(x, q)), float((err - half_ulp_bound(x, q)).max())


def test_stochastic_rounding_unbiased():
    """The mean of SR-quantized copies of a value between two grid points converges to the value."""
    n = 200_000
    for v, fmt in [(1.1, "e4m3"), (0.013, "e4m3"), (3.3, "e5m2"), (2.0**-8 * 1.37, "e4m3")]:
        x = torch.full((n,), v)
        d = fp8comm.quantize(x, fmt, None, scale=1.0, rounding="stochastic", seed=3).dequantize().double()
        lo, hi = d.min().item(), d.max().item()
        assert lo < v < hi  # both neighbours occur
        sigma = ((hi - v) * (v - lo)) ** 0.5 / n**0.5
        assert abs(d.mean().item() - v) < 5 * sigma, (v, d.mean().item(), sigma)
    nearest = fp8comm.quantize(torch.full((1000,), 1.1), "e4m3", None, scale=1.0).dequantize()
    assert torch.all(nearest == nearest[0])  # RNE is deterministic and biased: the contrast


def test_stochastic_rounding_seeded():
    x = torch.randn(1000)
    a = fp8comm.quantize(x, "e4m3", rounding="stochastic", seed=1).data.view(torch.uint8)
    b = fp8comm.quantize(x, "e4m3", rounding="stochastic", seed=1).data.view(torch.uint8)
    c = fp8comm.quantize(x, "e4m3", rounding="stochastic", seed=2).data.view(torch.uint8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def make_layout(rows, k, sc=None):
    return ChunkLayout(tuple(rows), k, sc if sc is not None else BlockScaling(128))


@pytest.mark.slow  # compile- or memory-bound (5-20 s on 2 cores): out of the fast tier, in the full run
@pytest.mark.parametrize("backend", ["reference", "compiled"])
@pytest.mark.parametrize("sc", [BlockScaling(128), BlockScaling(128, encoding="e8m0"), RowScaling(), MXScaling()])
def test_pack_chunks_matches_per_chunk_quantize(backend, sc):
    g = torch.Generator().manual_seed(1)
    rows, k = [3, 0, 5, 1], 200
    x = torch.randn(sum(rows), k, generator=g, dtype=torch.float32).to(torch.bfloat16)
    x[2, 17] = float("nan")
    lay = make_layout(rows, k, sc)
    buf = pack_chunks(x, lay, get_format("e4m3"), backend=backend)
    ref_buf = pack_chunks(x, lay, get_format("e4m3"), backend="reference")
    assert torch.equal(buf, ref_buf)
    assert all(o % 16 == 0 for o in lay.offsets) and buf.numel() == lay.total_bytes
    out = unpack_chunks(buf, lay, get_format("e4m3"), torch.float32, backend=backend)
    for c, r in enumerate(rows):
        r0 = lay.row_starts[c]
        want = fp8comm.quantize(x[r0 : r0 + r], "e4m3", scaling=sc).dequantize()
        assert torch.equal(bits(out[r0 : r0 + r]), bits(want))
    assert torch.isnan(out[2, 17]) and torch.isfinite(out).sum() == out.numel() - 1


def test_unpack_sum_is_fp32_sum_in_chunk_order():
    g = torch.Generator().manual_seed(2)
    w, L = 4, 300
    x = torch.randn(w, L, generator=g) * torch.tensor([1.0, 1e6, 1e-3, 7.0]).unsqueeze(1)
    x[1, 5] = float("inf")
    lay = make_layout([1] * w, L)
    f = get_format("e5m2")
    buf = pack_chunks(x, lay, f)
    s = unpack_sum(buf, lay, f)
    parts = unpack_chunks(buf, lay, f)
    want = torch.zeros(1, L)
    for i in range(w):
        want = want + parts[i : i + 1]
    assert torch.equal(bits(s), bits(want))
    assert not torch.isfinite(s[0, 5]) and torch.isfinite(s).sum() == L - 1
    with pytest.raises(ValueError, match="equal chunks"):
        unpack_sum(buf, make_layout([2, 1, 1], L), f)


def test_wire_bytes_per_element():
    """1 + 4/128 bytes per element with fp32 scales, 1 + 1/128 with E8M0 (numerics.md)."""
    n = 128 * 1024
    fp32 = make_layout([1], n).total_bytes / n
    e8 = make_layout([1], n, BlockScaling(128, encoding="e8m0")).total_bytes / n
    assert fp32 == 1 + 4 / 128 and e8 == 1 + 1 / 128


def test_wire_bad_input():
    lay = make_layout([2, 2], 64)
    f = get_format("e4m3")
    with pytest.raises(ValueError, match="input shape"):
        pack_chunks(torch.randn(3, 64), lay, f)
    with pytest.raises(ValueError, match="wire buffer"):
        unpack_chunks(torch.zeros(8, dtype=torch.uint8), lay, f)
    with pytest.raises(ValueError, match="1xB"):
        ChunkLayout((1,), 64, Scaling(128, 128))


@pytest.mark.parametrize("backend", ["reference", "compiled"])
@pytest.mark.parametrize("sc", [Scaling(None, None), Scaling(128, 128, "pow2")], ids=lambda s: s.describe())
def test_quantize_with_transpose_is_quantize_plus_transposed_codes(backend, sc):
    x = torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 5
    q, qt = quantize_with_transpose(x, "e5m2", scaling=sc, backend=backend)
    ref = quantize(x, "e5m2", scaling=sc, backend="reference")
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
    assert qt.shape == (300, 200) and qt.data.is_contiguous()
    assert torch.equal(qt.data.view(torch.uint8), ref.data.view(torch.uint8).t())
    assert torch.equal(qt.scale, ref.scale.t())
    assert torch.equal(dequantize(qt), dequantize(ref).t())  # a valid operand: x^T's dequantized values


@pytest.mark.parametrize("sc", [Scaling(1, 128), Scaling(1, None), Scaling(1, 32, "e8m0")], ids=lambda s: s.describe())
def test_quantize_with_transpose_requantizes_other_blocks(sc):
    """Rows and 1xB blocks are not transpose-invariant: q_t is x^T quantized along M, its own scales."""
    x = torch.randn(96, 160, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 160)
    q, qt = quantize_with_transpose(x, "e4m3", scaling=sc, backend="reference")
    want, want_t = (
        quantize(x, "e4m3", scaling=sc, backend="reference"),
        quantize(x.t(), "e4m3", scaling=sc, backend="reference"),
    )
    for got, w in ((q, want), (qt, want_t)):
        assert got.data.is_contiguous() and got.shape == w.shape
        assert torch.equal(got.data.view(torch.uint8), w.data.view(torch.uint8)) and torch.equal(got.scale, w.scale)


def test_quantize_with_transpose_bad_input():
    with pytest.raises(ValueError, match="transpose-invariant"):
        quantize_with_transpose(torch.randn(4, 256), scaling=Scaling(1, 128), scale=torch.ones(4, 2))
    with pytest.raises(ValueError, match="2-D"):
        quantize_with_transpose(torch.randn(2, 4, 8))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_with_transpose(torch.arange(4).reshape(2, 2))
    with pytest.raises(ValueError, match="rounding"):
        quantize_with_transpose(torch.randn(4, 4), rounding="up")
