"""The reference quantizer's bits, checked against torch's own fp32->fp8 cast and hand-picked special values."""

import math

import pytest
import torch

import fp8comm
from fp8comm.quant import BlockScaling, DelayedScaling, MXScaling, RowScaling, Scaling, TensorScaling, get_format
from fp8comm.quant import reference as ref

FMTS = ["e4m3", "e5m2"]


def torch_cast_oracle(x: torch.Tensor, scale_full: torch.Tensor, fmt) -> torch.Tensor:
    """Independent oracle: torch's RNE cast of clamp(x/s) for finite x, format specials for inf/NaN."""
    x = x.float()
    y = torch.clamp(x / scale_full, -fmt.max, fmt.max)
    codes = y.to(fmt.dtype).view(torch.uint8)
    if fmt.has_inf:
        sp = torch.where(x > 0, 0x7C, 0xFC)
        sp = torch.where(torch.isnan(x), 0x7F, sp)
    else:
        sp = torch.full_like(codes, 0x7F)
    return torch.where(torch.isfinite(x), codes, sp.to(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("s", [1.0, 2.0**-10, 2.0**7, 0.3701, 3.0e-20])
def test_all_bf16_patterns_match_torch_cast(all_bf16, fmt, s):
    f = get_format(fmt)
    q = fp8comm.quantize(all_bf16, fmt, None, scale=torch.tensor(s), backend="reference")
    want = torch_cast_oracle(all_bf16, torch.full_like(all_bf16, s, dtype=torch.float32), f)
    assert torch.equal(q.data.view(torch.uint8), want)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "scaling",
    [
        TensorScaling(),
        TensorScaling("pow2", 2),
        RowScaling(),
        BlockScaling(128),
        BlockScaling(32, encoding="e8m0"),
        BlockScaling(128, 128),
    ],
)
def test_all_bf16_patterns_current_scaling(all_bf16, fmt, scaling):
    f = get_format(fmt)
    q = fp8comm.quantize(all_bf16, fmt, scaling=scaling, backend="reference")
    full = ref.expand_scale(q.scale, 512, 128, scaling)
    assert torch.equal(q.data.view(torch.uint8), torch_cast_oracle(all_bf16, full, f))
    d = q.dequantize()
    finite = torch.isfinite(all_bf16)
    # Non-finite inputs stay non-finite element by element. Finite inputs stay finite, except within one FP8
    # rounding step of the fp32 max, where the rounded value itself (e.g. 2**128) exceeds fp32's range.
    assert not torch.isfinite(d[~finite]).any()
    safe = all_bf16.float().abs() < 2.0**127
    assert torch.isfinite(d[safe]).all()
    assert q.nonfinite_count() == int((~finite).sum())
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()


@pytest.mark.parametrize(
    "fmt,vals,codes",
    [
        (
            "e4m3",
            [0.0, -0.0, 448.0, -448.0, 500.0, 1e30, 2.0**-9, -(2.0**-9), 2.0**-10, 1.5 * 2.0**-10, 2.0**-6],
            [0x00, 0x80, 0x7E, 0xFE, 0x7E, 0x7E, 0x01, 0x81, 0x00, 0x01, 0x08],
        ),
        (
            "e5m2",
            [0.0, -0.0, 57344.0, 60000.0, 1e30, -1e30, 2.0**-16, 2.0**-17, 2.0**-14],
            [0x00, 0x80, 0x7B, 0x7B, 0x7B, 0xFB, 0x01, 0x00, 0x04],
        ),
    ],
)
def test_special_values(fmt, vals, codes):
    q = fp8comm.quantize(torch.tensor(vals), fmt, None, scale=1.0)
    assert q.data.view(torch.uint8).tolist() == codes


@pytest.mark.parametrize("fmt", FMTS)
def test_inf_nan_codes_never_clamped(fmt):
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), 2.0])
    q = fp8comm.quantize(x, fmt, None)
    d = q.dequantize()
    assert d[0] == 1.0 and d[4] == 2.0  # amax ignores the non-finite values
    assert not torch.isfinite(d[1:4]).any()
    if fmt == "e5m2":
        assert d[1] == float("inf") and d[2] == -float("inf")
    assert torch.isnan(d[3])
    assert q.nonfinite_count() == 3


def test_amax_zero_gives_finite_scale():
    for sc in [TensorScaling(), TensorScaling("pow2"), BlockScaling(128), MXScaling()]:
        q = fp8comm.quantize(torch.zeros(4, 256), "e4m3", scaling=sc)
        assert torch.equal(q.scale, torch.ones_like(q.scale))
        assert torch.equal(q.dequantize(), torch.zeros(4, 256))


def test_pow2_scale_is_exact_and_never_overflows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)
    for fmt in FMTS:
        f = get_format(fmt)
        for sc in [MXScaling(), BlockScaling(128, encoding="pow2"), TensorScaling("pow2")]:
            q = fp8comm.quantize(x, fmt, scaling=sc)
            m, e = torch.frexp(q.scale)
            assert torch.all(m == 0.5), "scales must be powers of two"
            amax = ref.block_amax(x, sc)
            assert torch.all(amax / q.scale <= f.max)  # block max never overflows
            assert torch.all(amax / q.scale > f.max / 2)  # and the headroom is at most one binade


def test_margin_adds_headroom():
    x = torch.randn(1000)
    a = fp8comm.quantize(x, "e4m3", scaling=TensorScaling("pow2", 0))
    b = fp8comm.quantize(x, "e4m3", scaling=TensorScaling("pow2", 3))
    assert b.scale.item() == a.scale.item() * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (7,), (3, 200), (2, 3, 130), (1, 1)])
def test_shapes_and_dtypes(shape, dtype):
    x = torch.randn(shape).to(dtype)
    for bs in [None, 128, 32, (128, 128)]:
        q = fp8comm.quantize(x, "e4m3", bs)
        d = fp8comm.dequantize(q, dtype=None)
        assert d.shape == x.shape and d.dtype == dtype
        if x.numel():
            err = (d.float() - x.float()).abs().max().item()
            assert err <= x.float().abs().max().item() * 2.0**-3


def test_non_contiguous_input():
    x = torch.randn(130, 300)
    xt = x.t()  # non-contiguous
    q = fp8comm.quantize(xt, "e4m3", 128)
    q2 = fp8comm.quantize(xt.contiguous(), "e4m3", 128)
    assert torch.equal(q.data.view(torch.uint8), q2.data.view(torch.uint8)) and torch.equal(q.scale, q2.scale)


@pytest.mark.parametrize(
    "bad,err",
    [
        (torch.arange(4), "floating-point"),
        (torch.zeros(4, dtype=torch.complex64), "floating-point"),
        (torch.zeros(4).to(torch.float8_e4m3fn), "already"),
    ],
)
def test_bad_input_dtype(bad, err):
    with pytest.raises(TypeError, match=err):
        fp8comm.quantize(bad)


def test_bad_options():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'"):
        fp8comm.quantize(x, "e3m4")
    for bs in [0, -1, 1.5, (0, 128), "x"]:
        with pytest.raises(ValueError, match="block"):
            fp8comm.quantize(x, "e4m3", bs)
    with pytest.raises(ValueError, match="scale tensor has shape"):
        fp8comm.quantize(x, "e4m3", 4, scale=torch.ones(3))
    with pytest.raises(ValueError, match="finite and > 0"):
        fp8comm.quantize(x, "e4m3", None, scale=0.0)
    with pytest.raises(ValueError, match="power-of-two"):
        fp8comm.quantize(x, "e4m3", scaling=TensorScaling("pow2"), scale=0.3)
    with pytest.raises(ValueError, match="rounding"):
        fp8comm.quantize(x, rounding="up")
    with pytest.raises(ValueError, match="encoding"):
        Scaling(1, 128, "bf16")
    with pytest.raises(ValueError, match="backend"):
        fp8comm.quantize(x, backend="cuda-magic")


def test_outlier_channels_block_beats_tensor():
    """Gaussian 1024^2 with 4 outlier columns x200 (numerics.md): 1x128 blocks >= 35 dB, per tensor ~32 dB."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=g)
    x[:, torch.tensor([3, 100, 517, 900])] *= 200

    def sqnr(q):
        d = q.dequantize()
        return 10 * math.log10(x.pow(2).sum().item() / (d - x).pow(2).sum().item())

    tensor = sqnr(fp8comm.quantize(x, "e4m3", None, backend="reference"))
    block = sqnr(fp8comm.quantize(x, "e4m3", 128, backend="reference"))
    assert block >= 35.0 and tensor < 33.0 and block > tensor + 2, (tensor, block)


def test_delayed_scaling_history_and_state_dict():
    ds = DelayedScaling(history_len=4, reduce="max")
    f = get_format("e4m3")
    assert ds.scale(f).item() == 1.0  # nothing recorded yet
    for a in [1.0, 8.0, 2.0]:
        q = fp8comm.quantize(torch.tensor([a, -a / 2]), f, None, scale=ds.scale(f))
        ds.update(q.amax)
    assert ds.amax().item() == 8.0 and ds.scale(f).item() == pytest.approx(8.0 / 448)
    ds.update(torch.tensor(float("inf")))  # non-finite amax is not recorded
    assert ds.history.tolist() == [2.0, 8.0, 1.0, 0.0]
    ds2 = DelayedScaling(history_len=4, reduce="max")
    ds2.load_state_dict(ds.state_dict())
    assert torch.equal(ds2.history, ds.history) and torch.equal(ds2.scale(f), ds.scale(f))
    with pytest.raises(ValueError, match="history"):
        DelayedScaling(history_len=2).load_state_dict(ds.state_dict())
    recent = DelayedScaling(history_len=4, reduce="most_recent")
    recent.load_state_dict(ds.state_dict())
    assert recent.amax().item() == 2.0


def test_delayed_scaling_overflow_saturates():
    """A stale (too small) scale saturates finite values at the format max instead of producing inf."""
    q = fp8comm.quantize(torch.tensor([1000.0, -1e6]), "e5m2", None, scale=torch.tensor(2.0**-10))
    assert q.dequantize().tolist() == [57344.0 * 2.0**-10, -57344.0 * 2.0**-10]


def test_pack_unpack_roundtrip():
    x = torch.randn(3, 5, 200, dtype=torch.bfloat16)
    for sc in [BlockScaling(128), MXScaling(), TensorScaling(), BlockScaling(128, 128)]:
        q = fp8comm.quantize(x, "e4m3", scaling=sc)
        buf = q.pack()
        assert buf.dtype == torch.uint8 and buf.numel() % 16 == 0
        assert buf.numel() == q.packed_size()
        r = fp8comm.Fp8Tensor.unpack(buf, x.shape, x.dtype, "e4m3", sc)
        assert torch.equal(r.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(r.scale, q.scale)
        assert torch.equal(r.dequantize(None), q.dequantize(None))
    with pytest.raises(ValueError, match="unpack buffer"):
        fp8comm.Fp8Tensor.unpack(buf[:10], x.shape, x.dtype, "e4m3", sc)
    e8 = fp8comm.quantize(x, "e4m3", scaling=MXScaling()).scale_e8m0()
    assert e8.dtype == torch.float8_e8m0fnu
