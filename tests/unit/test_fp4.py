"""4-bit E2M1 quantization (MXFP4, NVFP4; fp8comm/quant/fp4.py): the bits, the scale rules, rounding, non-finite
blocks, the Hadamard transform and the error bounds of docs/fp4.md, and the Triton (TRITON_INTERPRET=1) and
compiled paths bit for bit against the reference, over every code x scale case and on random data.
"""

from __future__ import annotations

import importlib
import math
import os
from fractions import Fraction

import pytest
import torch

from fp8comm.errors import Fp8CommError, Fp8CommTypeError
from fp8comm.quant import fp4, fp4_api

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
FORMATS = [fp4.MXFP4, fp4.NVFP4]
GRID = torch.tensor(fp4.E2M1_VALUES, dtype=torch.float64)
E4M3_ALL = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448
TOL = 1 + 2.0**-20  # the division by a non-power-of-two NVFP4 scale rounds once


@pytest.fixture(scope="module")
def ft():
    """fp4_triton with its kernels built for the interpreter while this module runs, then rebuilt as before
    (as tests/unit/test_triton.py does for the FP8 kernels)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[triton])")
    from fp8comm.quant import fp4_triton

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.reload(fp4_triton)
    yield fp4_triton
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(fp4_triton)


# ------------------------------------------------------------------------------------------------- helpers
def same_q(a: fp4.Fp4Tensor, b: fp4.Fp4Tensor, what: str) -> None:
    for name in ("codes", "scales", "tensor_scale"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}"
        if x.dtype == torch.float32:
            x, y = x.view(torch.int32), y.view(torch.int32)
        if not torch.equal(x, y):
            bad = (x != y).nonzero()
            i = tuple(bad[0].tolist())
            raise AssertionError(f"{what} {name}: {bad.shape[0]} differ, first at {i}: {x[i]} vs {y[i]}")


def same_f(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Identical fp32 bits, NaN positions identical (NaN payloads are the hardware's)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"{what}: NaN positions differ"
    x, y = torch.where(na, 0.0, a).view(torch.int32), torch.where(nb, 0.0, b).view(torch.int32)
    assert torch.equal(x, y), f"{what}: {int((x != y).sum())} values differ"


def unit_values() -> torch.Tensor:
    """Magnitudes in units of the block scale that cover every code, every rounding midpoint, and the fp32
    neighbours of both (ties, and the values just off them), with both signs: 1-D float64."""
    mids = (GRID[:-1] + GRID[1:]) / 2
    base = torch.cat([GRID, mids, torch.tensor([6.5, 7.9])]).float()  # (beyond 6: only via a given tensor amax)
    v = torch.cat([base, torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(9.0))])
    v = v[v <= 6]
    return torch.cat([v, -v]).double()


def exhaustive(fmt: fp4.Fp4Format) -> torch.Tensor:
    """One block per scale case, each holding 6 (the block amax, in scale units) then unit values: MXFP4 over every
    E8M0 scale 2**-126 .. 2**125 (6 * 2**126 is beyond fp32), NVFP4 over every E4M3 block scale under tensor
    scale 1 (the first block, amax 2688, fixes it). Rows of [blocks, block] fp32."""
    vals = unit_values()
    body = fmt.block - 1
    nrep = -(-vals.numel() // body)
    vals = torch.cat([vals, torch.zeros(nrep * body - vals.numel(), dtype=torch.float64)]).reshape(nrep, body)
    if fmt.two_level:
        scales = E4M3_ALL[1:]
    else:
        scales = torch.tensor([2.0**e for e in range(-126, 126)], dtype=torch.float64)
    blocks = []
    for s in scales.tolist():
        for r in range(nrep):
            blocks.append(torch.cat([torch.tensor([6.0], dtype=torch.float64), vals[r]]) * s)
    out = torch.stack(blocks).float()
    if fmt.two_level:
        assert out.abs().max().item() == fp4.NV_TENSOR_MAX
    pad = -out.shape[0] % 8  # whole rows of 8 blocks; the padding blocks are zero
    return torch.cat([out, out.new_zeros(pad, fmt.block)]).reshape(-1, 8 * fmt.block)


def scale_edges(fmt: fp4.Fp4Format) -> torch.Tensor:
    """Blocks whose amax is one fp32 ulp above or below 6 x every scale case (the scale rounds up to the next
    power of two / E4M3 value, or stays), each with random values below it; NVFP4 keeps tensor scale 1 (amax 2688)."""
    g = torch.Generator().manual_seed(8)
    six = (E4M3_ALL[1:] if fmt.two_level else torch.tensor([2.0**e for e in range(-126, 125)])).float() * 6
    amax = torch.cat([torch.nextafter(six, torch.tensor(0.0)), torch.nextafter(six, torch.tensor(math.inf))])
    tiny = torch.tensor([2.0**-149, 2.0**-148, 3 * 2.0**-149, 2.0**-130])  # a / 6 underflows: the E4M3 ceil bumps
    amax = torch.cat([amax[amax < fp4.NV_TENSOR_MAX], tiny, torch.tensor([fp4.NV_TENSOR_MAX])])
    body = (torch.rand(amax.numel(), fmt.block - 1, generator=g) * 2 - 1) * amax[:, None]
    out = torch.cat([amax[:, None], body], 1)
    pad = -out.shape[0] % 8
    return torch.cat([out, out.new_zeros(pad, fmt.block)]).reshape(-1, 8 * fmt.block)


def random_data(fmt: fp4.Fp4Format, m: int = 24, k: int = 256, nonfinite: bool = True, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with per-block magnitudes over 2**-40 .. 2**40, outliers, zero and denormal blocks, -0.0, and
    (optionally) NaN/inf elements in a few blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    mag = torch.pow(2.0, torch.randint(-40, 41, (m, k // fmt.block), generator=g).float())
    x = x * mag.repeat_interleave(fmt.block, 1)
    x[0, 3] *= 1000.0
    x[1, : fmt.block] = 0.0
    x[1, 1] = -0.0
    x[2, : fmt.block] = torch.randn(fmt.block, generator=g) * 2.0**-140  # fp32 subnormals
    if nonfinite:
        x[3, 7] = float("nan")
        x[4, 0] = float("inf")
        x[5, k - 1] = float("-inf")
    return x


def oracle_rne(u: torch.Tensor) -> torch.Tensor:
    """Round |u| (float64, <= 6) to the nearest E2M1 magnitude, ties to the even code: an independent oracle."""
    a = u.abs().unsqueeze(-1)
    d = (a - GRID).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best) & ((torch.arange(8) % 2 == 0) | ((d == best).sum(-1, keepdim=True) == 1))
    idx = torch.where(cand, torch.arange(8), 99).min(dim=-1).values
    return GRID[idx] * torch.sign(u)


# ------------------------------------------------------------------------------------------------- the bits
def test_codes_and_nibble_order():
    """E2M1 code c -> value; byte j = code(2j) | code(2j+1) << 4; MXFP4 block of amax 6 has scale byte 127."""
    assert fp4.e2m1_values(torch.arange(16)).tolist() == [
        *fp4.E2M1_VALUES,
        *(-v for v in fp4.E2M1_VALUES),
    ]
    assert fp4.e2m1_values(torch.tensor([8])).view(torch.int32).item() == -(2**31)  # code 8 is -0.0
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([0.5, -6.0, 1.0, 0.0, -0.0, 3.0])
    q = fp4_api.quantize_fp4(x, "mxfp4")
    assert q.scales.tolist() == [[127]]
    assert q.codes[0, :3].tolist() == [0xF1, 0x02, 0x58]
    assert q.codes.shape == (1, 16) and q.tensor_scale.tolist() == [1.0]
    assert torch.equal(fp4.unpack_nibbles(fp4.pack_nibbles(torch.arange(16).repeat(2))), torch.arange(16).repeat(2))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_exhaustive_reference_rne(fmt):
    """Every code, midpoint and fp32 neighbour x every scale case: the decoded value is the nearest grid value
    (ties to the even code) times the block scale, the scale is the one the case was built for."""
    x = exhaustive(fmt)
    q = fp4_api.quantize_fp4(x, fmt)
    d = fp4_api.dequantize_fp4(q).double()
    s = fp4.scale_values(q).double().repeat_interleave(fmt.block, 1)
    xb = x.double().reshape(-1, fmt.block)
    want_s = xb.abs().amax(-1, keepdim=True) / 6  # built so: a power of two (MX) or an E4M3 value (NV)
    live = want_s > 0  # (zero padding blocks: scale 1 for MXFP4, 0 for NVFP4)
    assert torch.equal(s.reshape(-1, fmt.block)[:, :1][live], want_s[live])
    s = torch.where(s > 0, s, 1.0)  # NVFP4 zero blocks have block scale 0 (and decode to zero)
    assert torch.equal(d, oracle_rne(x.double() / s) * s)
    # signs survive, -0.0 included
    neg = torch.signbit(x) & (d == 0)
    assert torch.equal(torch.signbit(d[neg]), torch.ones_like(d[neg], dtype=torch.bool))


def _min_e8m0_exponent(a: float) -> int:
    """Brute force: the smallest e with a <= 6 * 2**e (exact rationals)."""
    fa, e = Fraction(a), -200
    lo, hi = -200, 200
    while lo < hi:
        e = (lo + hi) // 2
        if fa <= 6 * Fraction(2) ** e:
            hi = e
        else:
            lo = e + 1
    return lo


def test_mx_scale_is_smallest_power_of_two_that_fits():
    """E = ceil(log2(amax / 6)) exactly: at 6 * 2**e, one ulp either side, 3 * 2**e, 2**e, subnormal amax, 0."""
    vals = []
    for e in range(-149, 128):
        for m in (1.0, 1.5, 1.25, 1.75):
            v = m * 2.0**e
            if v < 3.4e38:
                vals.append(v)
    a = torch.tensor(vals, dtype=torch.float32)
    a = torch.cat([a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(math.inf))])
    a = a[torch.isfinite(a) & (a > 0)]
    got = fp4.pow2_exponent(a, fp4.E2M1_MAX)
    want = torch.tensor([max(-126, min(126, _min_e8m0_exponent(v))) for v in a.tolist()], dtype=torch.int32)
    assert torch.equal(got, want)
    assert fp4.pow2_exponent(torch.tensor([0.0]), fp4.E2M1_MAX).tolist() == [0]
    # values in [6, 8) times 2**e are not clamped to 6 (the OCP floor rule would): amax 7 -> scale 2, 7/2 -> 3.5 -> 4
    x = torch.zeros(1, 32)
    x[0, 0] = 7.0
    q = fp4_api.quantize_fp4(x, "mxfp4")
    assert q.scales.tolist() == [[128]] and fp4_api.dequantize_fp4(q)[0, 0].item() == 8.0


def test_nv_block_scale_is_smallest_e4m3_that_fits():
    """e4m3_ceil(a) is the smallest E4M3 value s with 6 s >= a (brute force over all 127), capped at 448; its code
    is the value's E4M3 byte."""
    g = torch.Generator().manual_seed(1)
    s6 = (E4M3_ALL * 6).float()
    a = torch.cat(
        [
            s6,
            torch.nextafter(s6, torch.tensor(0.0)),
            torch.nextafter(s6, torch.tensor(1e9)),
            torch.pow(2.0, torch.rand(4000, generator=g) * 24 - 14),
            torch.tensor([0.0, 1e-45, 2.0**-140, 3000.0, 1e30]),
        ]
    )
    s, code = fp4.e4m3_ceil(a)
    ad = a.double()[:, None]
    fits = E4M3_ALL[None, :] * 6 >= ad
    want = torch.where(fits, E4M3_ALL[None, :], math.inf).min(-1).values
    want = torch.where(torch.isinf(want), 448.0, want)
    assert torch.equal(s.double(), want)
    assert torch.equal(fp4.decode_e4m3(code.to(torch.uint8)).double(), want)


def test_nv_tensor_scale_keeps_block_scales_in_range():
    """Tensor scale 2**G is the smallest power of two with amax / 2**G <= 6 * 448; block scale bytes stay finite
    E4M3 (<= 0x7E); a smaller given tensor amax saturates (codes +-6, scale 448) and never makes a NaN byte."""
    for amax in (1e-30, 1.0, 2688.0, 2689.0, 3e38):
        x = torch.zeros(2, 16)
        x[0, 0] = amax
        x[1, 3] = -amax / 1000
        q = fp4_api.quantize_fp4(x, "nvfp4")
        ts = q.tensor_scale.item()
        assert amax / ts <= 2688 and (amax / ts > 1344 or ts == 2.0**-126)
        assert int(q.scales.max()) <= 0x7E
    x = torch.randn(4, 32) * 100
    q = fp4_api.quantize_fp4(x, "nvfp4", tensor_amax=torch.tensor(1.0))
    assert int(q.scales.max()) == 0x7E  # 448
    d = fp4_api.dequantize_fp4(q)
    assert torch.isfinite(d).all() and d.abs().max().item() == 6 * 448 * q.tensor_scale.item()


# ------------------------------------------------------------------------------------------------- rounding
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_stochastic_rounding_is_unbiased(fmt):
    """Each draw is one of the two grid neighbours; the mean over 4096 draws (rows: independent counters) is the
    input within 5 standard deviations of the binomial; same seed -> same bits, another seed -> other bits."""
    g = torch.Generator().manual_seed(2)
    row = torch.rand(fmt.block, generator=g) * 12 - 6
    row[0] = 6.0  # the block amax: scale 1 (MX), tensor/block scale chosen so values stay in units of 1
    n = 4096
    x = row.repeat(n, 1)
    q = fp4_api.quantize_fp4(x, fmt, rounding="stochastic", seed=11)
    d = fp4_api.dequantize_fp4(q).double()
    s = fp4.scale_values(q).double()[0, 0].item()
    u = row.double() / s
    lo = torch.floor(u * 2) / 2
    lo = torch.where(u.abs() >= 2, torch.floor(u), lo)
    lo = torch.where(u.abs() >= 4, torch.floor(u / 2) * 2, lo)
    hi = torch.where(u.abs() >= 4, lo + 2, torch.where(u.abs() >= 2, lo + 1, lo + 0.5))
    dv = d / s
    assert bool(((dv == lo) | (dv == hi) | (dv == u)).all())
    p = ((u - lo) / (hi - lo)).clamp(0, 1)
    sd = (hi - lo) * torch.sqrt(p * (1 - p) / n)
    err = (dv.mean(0) - u).abs()
    assert bool((err <= 5 * sd + 1e-12).all()), f"biased: max err {err.max():.4g}, sd {sd.max():.4g}"
    assert torch.equal(fp4_api.quantize_fp4(x, fmt, rounding="stochastic", seed=11).codes, q.codes)
    assert not torch.equal(fp4_api.quantize_fp4(x, fmt, rounding="stochastic", seed=12).codes, q.codes)
    # the counter is the flat index: index_base shifts the stream
    q2 = fp4_api.quantize_fp4(x[1:], fmt, rounding="stochastic", seed=11, index_base=fmt.block)
    assert torch.equal(q2.codes, q.codes[1:])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_error_bounds(fmt, rounding):
    """docs/fp4.md: |x - q| <= max(|x|/5, S/4) (nearest) or < max(|x|/2, S/2) (stochastic), S the block's effective
    scale; relative to the block amax: <= amax/5 (nearest) and < amax/2 (stochastic) where the scale is in range
    (MXFP4: every block with amax >= 2**-120; NVFP4: block scale a normal E4M3 number)."""
    x = random_data(fmt, m=64, k=512, nonfinite=False, seed=3)
    q = fp4_api.quantize_fp4(x, fmt, rounding=rounding, seed=5)
    d = fp4_api.dequantize_fp4(q).double()
    s = fp4.scale_values(q).double().repeat_interleave(fmt.block, 1)
    err = (d - x.double()).abs()
    c = 5 if rounding == "nearest" else 2
    if fmt.two_level:  # an underflowed block scale (0) stands for the smallest one, 2**-9 * tensor scale
        s = torch.clamp(s, min=2.0**-9 * q.tensor_scale.item())
    bound = torch.maximum(x.double().abs() / c, s * (1 / 4 if rounding == "nearest" else 1 / 2)) * TOL
    ok = err <= bound if rounding == "nearest" else err < bound
    assert bool(ok.all()), f"{int((~ok).sum())} elements beyond the bound; worst {(err / bound).max():.4g}"
    amax = x.double().abs().reshape(x.shape[0], -1, fmt.block).amax(-1)
    if fmt.two_level:
        in_range = fp4.decode_e4m3(q.scales).double() >= 2.0**-6
    else:
        in_range = amax >= 2.0**-120
    rel = (err.reshape(x.shape[0], -1, fmt.block).amax(-1) / amax)[in_range & (amax > 0)]
    assert rel.numel() > 0.1 * amax.numel()
    assert rel.max().item() <= (1 / 5 if rounding == "nearest" else 1 / 2) * TOL, rel.max().item()


# ------------------------------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_nonfinite_block_gets_nan_scale(fmt):
    """A block with NaN or +-inf gets the NaN scale byte (E8M0 0xFF / E4M3 0x7F) and decodes all NaN; every other
    block (and the NVFP4 tensor scale) is what it would be with that block zeroed: nothing is clamped away."""
    x = random_data(fmt, m=8, k=4 * fmt.block, nonfinite=False, seed=4)
    x[3, 1] = float("nan")
    x[4, fmt.block] = float("inf")
    x[5, -1] = float("-inf")
    q = fp4_api.quantize_fp4(x, fmt)
    d = fp4_api.dequantize_fp4(q)
    bad = ~torch.isfinite(x).reshape(8, -1, fmt.block).all(-1)
    nan_byte = fp4.E4M3_NAN if fmt.two_level else fp4.E8M0_NAN
    assert torch.equal(q.scales == nan_byte, bad)
    assert bool(torch.isnan(d.reshape(8, -1, fmt.block))[bad].all())
    qc = fp4_api.quantize_fp4(torch.where(torch.isfinite(x), x, 0.0), fmt)  # the non-finite elements zeroed
    assert torch.equal(q.tensor_scale, qc.tensor_scale)
    assert torch.equal(q.scales[~bad], qc.scales[~bad])
    assert torch.equal(q.codes, qc.codes)  # non-finite elements: code 0; their neighbours: as without them
    assert bool(torch.isfinite(d.reshape(8, -1, fmt.block)[~bad]).all())


# ------------------------------------------------------------------------------------------------- Hadamard
def _hadamard_matrix(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", fp4.HADAMARD_SIZES)
def test_hadamard_forward_inverse_and_bound(n):
    """forward = c_f H D x per n-block (float64 check), signs a function of the seed only; the fp32 round trip
    stays within 2 log2(n) 2**-24 sum|x_block| (docs/fp4.md) on data with outliers."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=g)
    x[::7, ::13] *= 1e4
    y = fp4.hadamard_forward(x, n, seed=9)
    d = fp4.hadamard_signs(n, 9).double()
    cf, ci = fp4.hadamard_scales(n)
    assert cf * ci == 1 / n and math.log2(cf) == int(math.log2(cf)) and math.log2(ci) == int(math.log2(ci))
    want = (x.double().reshape(-1, n) * d) @ _hadamard_matrix(n).T * cf
    assert torch.allclose(y.double().reshape(-1, n), want, rtol=0, atol=1e-4 * x.abs().max().item())
    back = fp4.hadamard_inverse(y, n, seed=9)
    err = (back.double() - x.double()).abs()
    bound = fp4.hadamard_error_bound(x, n)
    assert bool((err <= bound).all()), f"worst {(err / bound).max():.3g} of the bound"
    assert err.max().item() > 0  # fp32 round trip is not exact: the bound is doing work
    assert torch.equal(fp4.hadamard_signs(n, 9), fp4.hadamard_signs(n, 9))
    assert not torch.equal(fp4.hadamard_signs(n, 9), fp4.hadamard_signs(n, 10))
    assert (fp4.hadamard_signs(n, 9) == 1).sum() not in (0, n)


def _sqnr(x: torch.Tensor, d: torch.Tensor) -> float:
    return 10 * math.log10((x.double() ** 2).sum().item() / ((d.double() - x.double()) ** 2).sum().item())


@pytest.mark.parametrize("n", fp4.HADAMARD_SIZES)
def test_hadamard_helps_mxfp4_on_spiky_data(n):
    """Gaussian data with 2% of elements x10: MXFP4 after the transform gains > 2 dB SQNR (measured ~3.8-4.2 dB;
    NVFP4's finer E4M3 scales gain nothing there, docs/fp4.md), and dequantize_fp4 returns the input's domain."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 64, generator=g) * torch.where(torch.rand(256, 64, generator=g) < 0.02, 10.0, 1.0)
    plain = _sqnr(x, fp4_api.dequantize_fp4(fp4_api.quantize_fp4(x, "mxfp4")))
    had = _sqnr(x, fp4_api.dequantize_fp4(fp4_api.quantize_fp4(x, "mxfp4", hadamard=n, hadamard_seed=3)))
    assert had > plain + 2.0, (had, plain)


# ------------------------------------------------------------------------------------------------- errors
def test_bad_input_is_refused():
    x = torch.randn(4, 32)
    with pytest.raises(Fp8CommError, match="unknown 4-bit format"):
        fp4_api.quantize_fp4(x, "fp4")
    with pytest.raises(Fp8CommError, match="unknown rounding"):
        fp4_api.quantize_fp4(x, "mxfp4", rounding="up")
    with pytest.raises(Fp8CommError, match="multiple of the block size 32"):
        fp4_api.quantize_fp4(torch.randn(4, 48), "mxfp4")
    with pytest.raises(Fp8CommError, match="hadamard=32 for nvfp4"):
        fp4_api.quantize_fp4(x, "nvfp4", hadamard=32)
    with pytest.raises(Fp8CommError, match="hadamard=8"):
        fp4_api.quantize_fp4(x, "mxfp4", hadamard=8)
    with pytest.raises(Fp8CommTypeError, match="float32, bfloat16 or float16"):
        fp4_api.quantize_fp4(x.to(torch.float8_e4m3fn), "mxfp4")
    with pytest.raises(Fp8CommTypeError):
        fp4_api.quantize_fp4(torch.ones(4, 32, dtype=torch.int32), "mxfp4")
    with pytest.raises(Fp8CommError, match="unknown 4-bit backend"):
        fp4_api.quantize_fp4(x, "mxfp4", backend="cuda")
    with pytest.raises(Fp8CommError, match="at least one dimension"):
        fp4_api.quantize_fp4(torch.tensor(1.0), "mxfp4")
    with pytest.raises(Fp8CommError, match="tensor_amax must be finite"):
        fp4_api.quantize_fp4(x, "nvfp4", tensor_amax=float("nan"))
    with pytest.raises(Fp8CommError, match="mxfp4 has none"):
        fp4_api.quantize_fp4(x, "mxfp4", tensor_amax=1.0)
    with pytest.raises(Fp8CommTypeError, match="one floating-point value"):
        fp4_api.quantize_fp4(x, "nvfp4", tensor_amax=torch.ones(2))
    q = fp4_api.quantize_fp4(torch.zeros(0, 32), "mxfp4")  # empty is fine
    assert q.codes.shape == (0, 16) and fp4_api.dequantize_fp4(q).shape == (0, 32)


# ------------------------------------------------------------------------------------------------- backends
def _cases(fmt):
    """(name, x, kwargs): every code x scale case and random data with non-finite blocks in one input, nearest
    and stochastic (with an index base that wraps the 32-bit counter), bf16/fp16 input, a given tensor amax and
    the Hadamard path. (Few inputs: the interpreter pays per launch.)"""
    ex = exhaustive(fmt)
    rnd = random_data(fmt, m=16, k=ex.shape[1])
    both = torch.cat([ex, rnd])
    yield "exhaustive+random", both, {}
    yield "exhaustive+random-sr", both, dict(rounding="stochastic", seed=3, index_base=2**32 - 100)
    yield "scale-edges", scale_edges(fmt), {}
    yield "bf16", rnd.bfloat16(), {}
    yield "fp16-sr", (rnd * 2.0**-30).half(), dict(rounding="stochastic", seed=123456789)
    yield "hadamard", rnd, dict(hadamard=16, hadamard_seed=7)
    if fmt.two_level:
        yield "tensor-amax", rnd, dict(tensor_amax=torch.tensor(3.0))


@pytest.mark.slow  # compile- or memory-bound (5-20 s on 2 cores): out of the fast tier, in the full run
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_triton_bit_exact(ft, fmt):
    """The fused Triton quantize+pack and dequantize kernels (interpreted) against the reference, byte for byte."""
    for name, x, kw in _cases(fmt):
        want = fp4_api.quantize_fp4(x, fmt, **kw)
        got = fp4_api.quantize_fp4(x, fmt, backend="triton", **kw)
        same_q(got, want, f"{fmt} {name}")
        same_f(
            fp4_api.dequantize_fp4(got, torch.float32, backend="triton"),
            fp4_api.dequantize_fp4(want, torch.float32),
            name,
        )
    # decode of every scale byte (foreign producers' too: E8M0 0 and 255, negative and NaN E4M3) x every code pair,
    # against the reference and against torch's own float8 conversions
    codes = (torch.arange(16, dtype=torch.int32) * 0x11).to(torch.uint8).repeat(256, 1)  # every code, both nibbles
    sb = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1).repeat(1, 32 // fmt.block)
    ts = torch.tensor([2.0**-3])
    want = fp4.decode_2d(codes, sb, ts, fmt)
    same_f(ft.decode_2d(codes, sb, ts, fmt), want, f"{fmt} every scale byte")
    sv = sb.view(torch.float8_e4m3fn if fmt.two_level else torch.float8_e8m0fnu).float() * (ts if fmt.two_level else 1)
    sv = sv.repeat_interleave(fmt.block, 1)
    same_f(fp4.e2m1_values(fp4.unpack_nibbles(codes)) * sv, want, f"{fmt} oracle")
    # the tensor amax kernel alone, on awkward sizes (partial programs) and non-finite values
    x = random_data(fmt, m=7, k=fmt.block * 3)
    ref_amax = torch.where(torch.isfinite(x), x.abs(), 0.0).max().reshape(1)
    assert torch.equal(ft.tensor_amax(x), ref_amax)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_compiled_bit_exact(fmt):
    """fp4_compiled (the reference compiled by inductor) against the reference: nearest and stochastic, on every
    code x scale case plus random data with non-finite blocks in one input (few graphs: compiling is slow)."""
    ex = exhaustive(fmt)
    x = torch.cat([ex, scale_edges(fmt), random_data(fmt, m=16, k=ex.shape[1])])
    for kw in ({}, dict(rounding="stochastic", seed=77, index_base=5)):
        want = fp4_api.quantize_fp4(x, fmt, **kw)
        got = fp4_api.quantize_fp4(x, fmt, backend="compiled", **kw)
        same_q(got, want, f"{fmt} compiled {kw}")
    same_f(
        fp4_api.dequantize_fp4(got, torch.float32, backend="compiled"),
        fp4_api.dequantize_fp4(want, torch.float32),
        "deq",
    )


@pytest.fixture(params=["installed", "baseline"])
def native_build(request, monkeypatch, tmp_path):
    """The installed extension (on this CPU its widest clone runs), and a build of the same source with no per-CPU
    clones (what a CPU without AVX2 runs): both must give the reference's bits."""
    import ctypes
    import shutil
    import subprocess

    from fp8comm.quant import fp4_native

    if not fp4_native.available():
        pytest.fail(f"the native 4-bit kernels did not build: {fp4_native.problem()}")
    if request.param == "baseline":
        cc = shutil.which("cc")
        if cc is None:
            pytest.fail("no C compiler to build the baseline variant (the README's set-up needs one)")
        so = tmp_path / "baseline.so"
        flags = [*fp4_native.CFLAGS, "-fPIC", "-shared", "-DFP8COMM_NO_CLONES"]
        sha = f'-DFP8COMM_SRC_SHA="{fp4_native.source_sha()}"'
        subprocess.run([cc, *flags, sha, str(fp4_native._SRC), "-o", str(so), "-lm"], check=True)
        lib = fp4_native._bind(ctypes.CDLL(str(so)), "baseline")
        monkeypatch.setattr(fp4_native, "_lib", lambda: lib)
    return request.param


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_native_bit_exact(fmt, native_build):
    """fp4_native (the C kernels of the CPU wire) against the reference: every code x scale case, the scale edges
    and random data with non-finite blocks; nearest and stochastic; NVFP4's three tensor-scale scopes (the whole
    input, a given amax of one or per row, each row's own); and the decode of every scale byte x every code."""
    from fp8comm.quant import fp4_native

    ex = exhaustive(fmt)
    x = torch.cat([ex, scale_edges(fmt), random_data(fmt, m=16, k=ex.shape[1])])
    kws: list[dict] = [{}, dict(rounding="stochastic", seed=77, index_base=5)]
    if fmt.two_level:
        kws += [
            dict(tensor_amax=torch.tensor([3.0])),
            dict(rounding="stochastic", seed=3, tensor_amax=torch.tensor(1e-3)),
        ]
    for kw in kws:
        want = fp4_api.quantize_fp4(x, fmt, **kw)
        got = fp4_api.quantize_fp4(x, fmt, backend="native", **kw)
        same_q(got, want, f"{fmt} native {kw}")
        xb = x.bfloat16()  # bf16 input: widened inside the kernel
        same_q(fp4_api.quantize_fp4(xb, fmt, backend="native", **kw), fp4_api.quantize_fp4(xb, fmt, **kw), "bf16")
        same_f(
            fp4_api.dequantize_fp4(got, torch.float32, backend="native"),
            fp4_api.dequantize_fp4(want, torch.float32),
            f"{fmt} native deq {kw}",
        )
    if fmt.two_level:  # per-row second-level scales: given per row, and each row's own
        rows_ta = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=1) * 0.7
        for ta, own in ((rows_ta, False), (None, True)):
            want = fp4.encode_2d(x, fmt, None, 0, ta, own)
            got = fp4_native.encode_2d(x, fmt, None, 0, ta, own)
            same_q(fp4.Fp4Tensor(*got, fmt, x.shape, x.dtype), fp4.Fp4Tensor(*want, fmt, x.shape, x.dtype), "rows")
            same_f(fp4_native.decode_2d(*got, fmt), fp4.decode_2d(*want, fmt), "per-row decode")
    codes = (torch.arange(16, dtype=torch.int32) * 0x11).to(torch.uint8).repeat(256, 1)
    sb = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1).repeat(1, 32 // fmt.block)
    ts = torch.tensor([2.0**-3])
    same_f(fp4_native.decode_2d(codes, sb, ts, fmt), fp4.decode_2d(codes, sb, ts, fmt), f"{fmt} every scale byte")


def _added(rep: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
    """The reference bits of replica += change: widen, add in fp32, round once (torch's CPU conversion)."""
    return rep.float().add_(change).bfloat16()


def test_native_decode_add_rounds_as_torch(native_build):
    """Decoded values that land exactly halfway between two bf16 values (to even), that overflow a large replica
    entry to inf, and replicas holding NaN and inf: the one-pass decode-and-add gives torch's bits."""
    from fp8comm.quant import fp4_native

    codes = torch.zeros(2, 32, dtype=torch.int32)
    codes[0, :4] = torch.tensor([1, 3, 9, 11])  # +-0.5, +-1.5 at 2**-7; +2**-8 and +3 * 2**-8 are ties at 1.0
    codes[1, :3] = 7  # 6 at 2**125: overflows 3e38 + 2.5e38 to inf
    sb = torch.tensor([[127 - 7], [127 + 125]], dtype=torch.uint8)
    packed = fp4.pack_nibbles(codes)
    rep = torch.ones(2, 32, dtype=torch.bfloat16)
    rep[1, :3] = torch.tensor([3.0e38, float("nan"), -float("inf")]).bfloat16()
    want = _added(rep, fp4.decode_2d(packed, sb, torch.ones(1), fp4.MXFP4))
    got = fp4_native.decode_add((packed, sb, None), fp4.MXFP4, rep.clone())
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[0, :2].tolist() == [1.0, 1.015625] and got[1, 0] == float("inf")  # ties to even; overflow


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_native_decode_add_matches_decode_then_add(fmt, native_build):
    """The replica update's decode and add in one pass (fp4_native.decode_add, a column piece of a strided replica)
    gives the bits of the reference decode followed by the reference add; every scale byte decoded once."""
    from fp8comm.quant import fp4_native

    rows, k, cols = 16, 512, 512  # a column piece of a replica whose rows are longer
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)) * torch.logspace(-6, 6, k)
    codes, sb, ts = fp4.encode_2d(x, fmt)
    sb = (torch.arange(sb.numel()) % 256).to(torch.uint8).view(sb.shape)  # every scale byte, NaN ones included
    want_dec = fp4.decode_2d(codes, sb, ts, fmt)[:, :cols]
    rep = (torch.randn(rows * 600, generator=torch.Generator().manual_seed(7)) * 4).bfloat16()
    rep[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).bfloat16()
    replica = rep.view(rows, 600)  # rows of 600: the piece's rows are strided
    want = replica.clone()
    want[:, 10 : 10 + cols] = _added(want[:, 10 : 10 + cols], want_dec)
    assert want_dec.isnan().any()  # NaN scale bytes: whole NaN blocks
    got = replica.clone()
    t = ts.float().reshape(-1)[:1].contiguous() if fmt.two_level else None
    fp4_native.decode_add((codes.contiguous(), sb.contiguous(), t), fmt, got[:, 10 : 10 + cols])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(Fp8CommError, match="adds into bf16"):
        fp4_native.decode_add((codes, sb, t), fmt, got.float()[:, :cols])


def test_native_kernels_come_from_the_install():
    """The README's set-up builds the extension at install: the bit-exactness tests above ran against it (not an
    opt-in build at first use, nor a fallback)."""
    from fp8comm.quant import fp4_native

    assert fp4_native.available(), fp4_native.problem()
    assert fp4_native.source() == "extension"
