"""Scaled FP8 GEMM backends: each matches a float64 product of the dequantized operands; backends agree."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fp8comm.gemm import backends, telemetry
from fp8comm.gemm.routing import ROUTING
from fp8comm.quant import Scaling, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {  # name -> (scaling of a, scaling of b)
    "tensor": (Scaling(None, None), Scaling(None, None)),
    "tensor_pow2": (Scaling(None, None, "pow2"), Scaling(None, None, "pow2", 3)),
    "row": (Scaling(1, None), Scaling(1, None)),
    "block_1x128_128x128": (Scaling(1, 128), Scaling(128, 128)),
    "block_1x128_1x128": (Scaling(1, 128), Scaling(1, 128)),
    "mx": (Scaling(1, 32, "e8m0"), Scaling(1, 32, "e8m0")),
    "mixed_row_block": (Scaling(1, None), Scaling(1, 128)),
}
SHAPES = [(64, 48, 256), (37, 72, 200), (5, 3, 33), (128, 128, 128)]


def _operands(m, n, k, layout, fmts=("e4m3", "e4m3"), seed=0):
    g = torch.Generator().manual_seed(seed)
    # columns with very different magnitudes make block scales matter
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k).roll(3)
    w = torch.randn(n, k, generator=g) * 0.05
    sa, sb = LAYOUTS[layout]
    return quantize(x, fmts[0], scaling=sa, backend="reference"), quantize(w, fmts[1], scaling=sb, backend="reference")


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_emulation_matches_float64(layout, shape):
    a, b = _operands(*shape, layout)
    out = backends.emulate(a, b, torch.float32)
    assert out.shape == (shape[0], shape[1]) and out.dtype == torch.float32
    assert _rel(out, backends.emulate_f64(a, b)) < 1e-5  # fp32 accumulation only


def test_emulation_mixed_formats_and_bf16_output():
    a, b = _operands(33, 40, 160, "tensor", fmts=("e5m2", "e4m3"))
    out = backends.emulate(a, b, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert _rel(out.float(), backends.emulate_f64(a, b)) < 2**-7  # one bf16 rounding


@pytest.mark.parametrize("layout", ["tensor", "tensor_pow2", "row"])
@pytest.mark.parametrize("shape", [(64, 48, 256), (37, 72, 200)], ids=lambda s: "x".join(map(str, s)))
def test_scaled_mm_on_cpu_agrees_with_emulation(layout, shape):
    """torch._scaled_mm runs tensorwise/rowwise on CPU; odd dims get padded (and counted)."""
    a, b = _operands(*shape, layout)
    telemetry.reset_counters()
    out = backends.gemm(a, b, torch.float32, backend="scaled_mm")
    ref = backends.emulate_f64(a, b)
    assert _rel(out, ref) < 1e-5
    assert _rel(out, backends.emulate(a, b)) < 1e-5
    assert telemetry.counters("gemm.scaled_mm") == (
        {"gemm.scaled_mm.forced": 1, "gemm.scaled_mm.pad": 1}
        if shape[2] % 16 or shape[1] % 16
        else {"gemm.scaled_mm.forced": 1}
    )


def test_scaled_mm_rejects_block_scales_it_cannot_take():
    a, b = _operands(32, 32, 64, "mx")
    with pytest.raises(NotImplementedError, match="_scaled_mm"):
        backends.scaled_mm(a, b)


def test_auto_on_cpu_is_emulation_and_counted(caplog):
    a, b = _operands(16, 16, 128, "block_1x128_128x128")
    ROUTING.reset()
    with caplog.at_level(logging.DEBUG, logger="fp8comm.gemm"):
        backends.gemm(a, b)
    assert telemetry.counters("gemm.") == {"gemm.emulation": 1}
    assert any("emulation" in r.getMessage() for r in caplog.records)


def test_nonfinite_codes_propagate():
    x = torch.randn(8, 128)
    x[2, 5], x[6, 0] = float("inf"), float("nan")
    a = quantize(x, "e4m3", scaling=Scaling(1, 128))
    b = quantize(torch.randn(4, 128), "e4m3", scaling=Scaling(128, 128))
    out = backends.gemm(a, b)
    bad = ~torch.isfinite(out)
    assert bad[2].all() and bad[6].all() and not bad[[0, 1, 3, 4, 5, 7]].any()


def test_bad_operands_raise_clear_errors():
    a, b = _operands(8, 8, 64, "tensor")
    with pytest.raises(ValueError, match="contraction dims"):
        backends.gemm(a, _operands(8, 8, 32, "tensor")[1])
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        backends.gemm(a, b, backend="cublas")
    blk = _operands(8, 8, 128, "block_1x128_1x128")[0]
    with pytest.raises(ValueError, match="transpose-invariant"):
        backends.transpose(blk)


def test_transpose_invariant_weight_serves_dgrad():
    """128x128 blocks: the forward codes, transposed with their scales, equal W^T dequantized (no re-quantization)."""
    w = torch.randn(256, 384) * torch.logspace(-1, 1, 384)
    q = quantize(w, "e4m3", scaling=Scaling(128, 128))
    qt = backends.transpose(q)
    assert qt.shape == (384, 256) and qt.scale.shape == (3, 2)
    torch.testing.assert_close(qt.dequantize(), q.dequantize().t(), rtol=0, atol=0)


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from fp8comm.gemm import backends
    from fp8comm.gemm.triton_gemm import triton_gemm
    from fp8comm.quant import Scaling, quantize
    g = torch.Generator().manual_seed(0)
    cases = [((Scaling(1, 128), Scaling(128, 128)), (40, 72, 200), ("e4m3", "e4m3")),
             ((Scaling(1, 128), Scaling(1, 128)), (64, 64, 256), ("e4m3", "e4m3")),
             ((Scaling(None, None), Scaling(None, None)), (33, 17, 48), ("e5m2", "e4m3")),
             ((Scaling(1, None), Scaling(1, None)), (16, 64, 64), ("e4m3", "e4m3")),
             ((Scaling(1, 32, "e8m0"), Scaling(1, 32, "e8m0")), (24, 40, 96), ("e4m3", "e4m3")),
             # 10 x 3 tiles of 64: the grouped tile order (8 row tiles, then a group of 2) with ragged edges
             ((Scaling(1, 128), Scaling(128, 128)), (581, 130, 256), ("e4m3", "e4m3"))]
    for (sa, sb), (m, n, k), (fa, fb) in cases:
        x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
        w = torch.randn(n, k, generator=g)
        a, b = quantize(x, fa, scaling=sa), quantize(w, fb, scaling=sb)
        ref = backends.emulate_f64(a, b)
        for out in (triton_gemm(a, b, torch.float32), backends.gemm(a, b, backend="triton")):
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, (sa, sb, m, n, k, err)
        emu = backends.emulate(a, b)
        assert ((out - emu).abs().max() / emu.abs().max()).item() < 1e-5
    print("ok", len(cases))
""")


def test_triton_block_scaled_gemm_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok 6" in r.stdout


def test_bench_gemm_command_prints_ratios(capsys):
    from fp8comm.tools.cli import main

    assert (
        main(
            [
                "bench",
                "gemm",
                "--shapes",
                "32x48x64",
                "--linear-shapes",
                "32x16x64",
                "--reps",
                "1",
                "--warmup",
                "0",
                "--backends",
                "emulation,scaled_mm",
                "--recipes",
                "blockwise",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "SLOWER than bf16" in out  # the CPU caveat is part of the output
    assert "| gemm | 32x48x64 | blockwise | emulation |" in out
    assert "| gemm | 32x48x64 | mxfp8 | scaled_mm | error: Fp8CommNotImplementedError" in out
    assert "| linear | 32x64->16 | blockwise | emulation:3 |" in out


def test_failing_backend_is_routed_around_visibly(monkeypatch, caplog):
    """A backend that raises is recorded, warned about once, counted, and skipped from then on (never bf16)."""
    a, b = _operands(16, 16, 64, "mx")
    monkeypatch.setattr(backends, "candidates", lambda *_: [("scaled_mm", ""), ("emulation", "fallback")])
    ROUTING.reset()
    with caplog.at_level(logging.WARNING, logger="fp8comm.gemm"):
        out1 = backends.gemm(a, b)
        out2 = backends.gemm(a, b)
    assert torch.equal(out1, backends.emulate(a, b)) and torch.equal(out2, out1)
    assert telemetry.counters("gemm.") == {
        "gemm.scaled_mm": 1,
        "gemm.scaled_mm.failed": 1,
        "gemm.emulation.fallback": 2,
    }
    assert sum("routing to emulation" in r.getMessage() for r in caplog.records) == 1
    assert list(ROUTING.failures()) == [("scaled_mm", ("cpu", "mx32", "mx32", "e4m3", "e4m3", "torch.float32"))]
    ROUTING.reset()
