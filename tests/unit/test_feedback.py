"""ErrorFeedback: the preset residual an engine assembles; compact (fp8) residuals: the reference encode/decode's
bits, bytes per element and non-finite values, the option's names and aliases, state dicts and the conversion of
float32 checkpoints."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import fp8comm.comm as fc
from fp8comm.quant.residual import COMPACT, RESIDUAL_FORMATS, decode_residual, encode_residual


def test_preset_residual_is_used_and_validated():
    r = torch.full((256,), 0.25, dtype=torch.bfloat16)
    ef = fc.ErrorFeedback(torch.bfloat16, residual=r)
    assert ef.take(256, r.device) is r and ef.nbytes() == 512  # the call adds and updates this very tensor
    assert ef.take(128, r.device) is not r and ef.residual.abs().sum() == 0  # another size: fresh zeros
    with pytest.raises(fc.Fp8CommError, match="flat torch.float32 tensor, got torch.bfloat16"):
        fc.ErrorFeedback(torch.float32, residual=r)
    with pytest.raises(fc.Fp8CommError, match=r"shape \(16, 16\)"):
        fc.ErrorFeedback(torch.bfloat16, residual=r.view(16, 16))


# ------------------------------------------------------------------------------------ compact residuals
def _spread(n: int, seed: int = 0) -> torch.Tensor:
    """Residual-like values over 6 decades (blocks of very different magnitude, as gradients' errors are)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-6, 0, n)[torch.randperm(n, generator=g)]


def test_fp8_residual_bits_are_e5m2_of_x_over_the_smallest_fitting_power_of_two():
    """Independent of the reference's code: the scale is the smallest 2**E with amax / 2**E <= 57344 (so the
    scaled amax lies in (28672, 57344]), the codes are torch's own round-to-nearest-even cast of x / 2**E, and
    decode is code * 2**E."""
    x = _spread(3000)
    codes, scales = encode_residual(x)
    assert codes.dtype == scales.dtype == torch.uint8 and codes.shape == (3000,) and scales.shape == (4,)
    scale = float(scales.view(torch.float32))
    m, e = math.frexp(scale)
    assert m == 0.5, f"scale {scale} is not a power of two"
    assert 28672 < float(x.abs().max()) / scale <= 57344
    want = (x / scale).to(torch.float8_e5m2)
    assert torch.equal(codes, want.view(torch.uint8))
    assert torch.equal(decode_residual(codes, scales), want.float() * scale)
    assert COMPACT.fmt.name == "e5m2" and COMPACT.block is None


@pytest.mark.parametrize("name", ["fp8", "e4m3"])
def test_tensor_scaled_fast_path_gives_the_reference_bits(name):
    """encode_residual / decode_residual of the one-scale layouts take a few-pass path (torch's FP8 cast); it must
    give the FP8 reference quantizer's bits: random magnitudes over many binades (subnormal codes included), exact
    grid midpoints, signed zeros, all-zero, tiny and huge tensors, +-inf and NaN of both signs."""
    from fp8comm.quant.reference import dequantize_2d
    from fp8comm.quant.residual import encode_residual_reference

    f = RESIDUAL_FORMATS[name]
    g = torch.Generator().manual_seed(7)
    mid = torch.tensor([1.125, 1.375, 2.25, -3.5, 0.0, -0.0, 2.0**-16 * 3, -(2.0**-17) * 5, 1e-30])
    cases = [
        torch.randn(40_000, generator=g) * torch.exp2(torch.randint(-30, 30, (40_000,), generator=g).float()),
        torch.cat([mid, torch.tensor([57344.0 if f.fmt.has_inf else 448.0])]),  # amax at max: scale 1
        torch.zeros(1000),
        torch.tensor([-0.0, 0.0, -0.0]),
        torch.randn(3000, generator=g) * 1e-38,
        torch.randn(3000, generator=g) * 3e38,
    ]
    special = torch.randn(600, generator=g)
    special[[5, 77, 300, 301]] = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan")])
    cases.append(special)
    for x in cases:
        got, want = encode_residual(x, f), encode_residual_reference(x, f)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, x[:4])
        ref = dequantize_2d(want[0].view(1, -1), torch.ones(1, 1) * want[1].view(torch.float32), f.fmt, f.scaling)
        dec = decode_residual(*got, f)
        assert torch.equal(dec.isnan(), ref.view(-1).isnan()), name
        fin = ~dec.isnan()
        assert torch.equal(dec[fin], ref.view(-1)[fin]), name


def test_bytes_per_element_of_every_format():
    """fp8: one byte per element plus ONE 4-byte scale per residual tensor (n + 4); e4m3-b128: n + ceil(n/128)."""
    for n in (1, 127, 128, 129, 100_000):
        for name, f in RESIDUAL_FORMATS.items():
            codes, scales = encode_residual(torch.ones(n), f)
            assert codes.numel() + scales.numel() == f.nbytes(n), (name, n)
        assert COMPACT.nbytes(n) == n + 4 and RESIDUAL_FORMATS["e4m3-b128"].nbytes(n) == n + -(-n // 128)
    assert COMPACT.nbytes(10**6) / 10**6 == 1.000004
    assert fc.residual_nbytes("fp8", 1000) == 1004 and fc.residual_nbytes("bf16", 1000) == 2000
    assert fc.residual_nbytes("float32", 1000) == 4000


@pytest.mark.parametrize("name", list(RESIDUAL_FORMATS))
def test_non_finite_values_propagate_through_encode_and_decode(name):
    """The pair never clamps inf/NaN away: E5M2 keeps +-inf, E4M3 (no inf) and NaN give NaN; the finite values
    keep the precision they have without them (the scale comes from finite values only)."""
    f = RESIDUAL_FORMATS[name]
    x = _spread(512, 1)
    clean = decode_residual(*encode_residual(x, f), f)
    x[[3, 200, 401]] = torch.tensor([float("inf"), float("nan"), float("-inf")])
    y = decode_residual(*encode_residual(x, f), f)
    assert torch.equal(~torch.isfinite(y), ~torch.isfinite(x))
    if f.fmt.has_inf:
        assert y[3] == float("inf") and y[401] == float("-inf")
    assert bool(torch.isnan(y[200]))
    fin = torch.isfinite(x)
    assert torch.equal(y[fin], clean[fin]), "a non-finite value changed its finite neighbours"


def test_encode_decode_refuse_bad_input():
    with pytest.raises(fc.Fp8CommError, match="flat float tensor"):
        encode_residual(torch.ones(4, 4))
    codes, scales = encode_residual(torch.ones(300))
    with pytest.raises(fc.Fp8CommError, match="4 uint8 scale bytes"):
        decode_residual(codes, scales[:2])


def test_residual_dtype_names_and_aliases():
    for given, name in (("float32", "float32"), ("fp32", "float32"), ("bf16", "bfloat16"), ("FP8", "fp8")):
        assert fc.WireConfig(error_feedback=True, residual_dtype=given).residual_dtype == name
        assert fc.ErrorFeedback(given).kind == name
    assert fc.ErrorFeedback(torch.bfloat16).kind == "bfloat16"
    with pytest.raises(fc.Fp8CommConfigError, match=r"residual_dtype='fp16' is not valid; valid: float32, bfloat16"):
        fc.WireConfig(residual_dtype="fp16")
    with pytest.raises(fc.Fp8CommError, match="float32, bfloat16 or fp8"):
        fc.ErrorFeedback("int8")
    with pytest.raises(fc.Fp8CommError, match="compact"):
        fc.ErrorFeedback("fp8", residual=torch.zeros(8))


def test_compact_error_feedback_keeps_codes_between_calls():
    """take() hands out one fp32 working tensor per call; commit() encodes it (the reference's bits) and drops it;
    the next take() decodes it; nbytes counts codes + scale."""
    ef = fc.ErrorFeedback("fp8")
    assert ef.take(1000, torch.device("cpu")).abs().sum() == 0 and ef.take(1000, torch.device("cpu")) is ef.residual
    x = _spread(1000, 2)
    ef.residual.copy_(x)
    ef.commit()
    assert ef.residual is None and ef.nbytes() == 1004 and ef.stored() and ef.numel == 1000
    codes, scales = encode_residual(x)
    assert torch.equal(ef.codes, codes) and torch.equal(ef.scales, scales)
    assert torch.equal(ef.take(1000, torch.device("cpu")), decode_residual(codes, scales))
    ef.commit()
    ef.reset()
    assert not ef.stored() and ef.nbytes() == 0 and ef.norm() == 0.0


def test_compact_state_dict_round_trip_and_fp32_checkpoint_conversion(caplog):
    """state_dict -> load_state_dict restores codes and scales bit for bit; a float32 (or bfloat16) residual
    loads into a compact ErrorFeedback, encoded by the reference, with a warning saying so; compact residuals do
    not load into a float32 one (a clear error)."""
    ef = fc.ErrorFeedback("fp8")
    ef.take(700, torch.device("cpu")).copy_(_spread(700, 3))
    ef.commit()
    back = fc.ErrorFeedback("fp8")
    back.load_state_dict(ef.state_dict())
    assert torch.equal(back.codes, ef.codes) and torch.equal(back.scales, ef.scales)
    r32 = _spread(700, 4)
    old = fc.ErrorFeedback(torch.float32, residual=r32.clone())
    with caplog.at_level(logging.WARNING, logger="fp8comm.feedback"):
        back.load_state_dict(old.state_dict())
    codes, scales = encode_residual(r32)
    assert torch.equal(back.codes, codes) and torch.equal(back.scales, scales)
    assert any("converted a checkpointed float32 residual (700 elements) to fp8" in r.message for r in caplog.records)
    with pytest.raises(fc.Fp8CommError, match="compact residual loads only into a compact one"):
        fc.ErrorFeedback(torch.float32).load_state_dict(ef.state_dict())
