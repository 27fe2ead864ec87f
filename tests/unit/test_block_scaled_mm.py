"""The block-scaled GEMM layouts and their probe, against torch's OWN shape/stride rules (no hand-written model).

No GPU here. torch's checks for `torch.nn.functional.scaled_mm` / `torch._scaled_mm` also run on `device="meta"`
tensors (the meta kernels torch.compile's fake tensors use), so every candidate layout is put to them on CPU.
Values cannot come from meta tensors: `TorchRules` below runs the real op on meta copies of the arguments (its
refusal propagates) and then computes what the op is documented to compute, each scale read by its logical index
(the emulation). Whether cuBLASLt reads memory as documented is for the GPU probe (launch/device_check_gemm.py);
a result wrong only in small-scale blocks is injected below to show the probe refuses it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fp8comm.gemm import backends
from fp8comm.gemm import block_scaled_mm as bsm
from fp8comm.gemm.routing import ROUTING
from fp8comm.quant import Scaling, quantize

ST = F.ScalingType
SHAPES = [(256, 384, 256), (100, 640, 200), (16, 128, 16), (33, 1152, 300)]  # K-blocks 3, 5, 1, 9; odd M and N
DOCUMENTED = {"block128x128": "v2 a:outer-major b:k-major-pad4", "block1x128": "v2 a:outer-major b:outer-major"}


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _product(a, b, sa_grid, sb_grid, b_rows: int, out_dtype):
    """(A * sa) @ (B * sb) with sa_grid [M, KB] and sb_grid [rows of B's blocks, KB], indexed logically."""
    m, k = a.shape
    n = b.shape[1]
    da = a.float() * sa_grid.float().repeat_interleave(128, 1)[:, :k]
    gb = sb_grid.float().repeat_interleave(b_rows, 0)[:n].repeat_interleave(128, 1)[:, :k]  # [n, k]
    return (da @ (b.float() * gb.t())).to(out_dtype)


class TorchRules:
    """Stands in for both APIs: torch's own op on meta copies first (shape/stride checks), then the values."""

    def __init__(self, v2, legacy) -> None:
        self._v2, self._legacy = v2, legacy
        self.calls = {"v2": 0, "legacy": 0}

    def v2(self, a, b, sa, ra, sb, rb, output_dtype=torch.bfloat16, **kw):
        self._v2(_meta(a), _meta(b), _meta(sa), ra, _meta(sb), rb, output_dtype=output_dtype, **kw)
        self.calls["v2"] += 1
        kb = a.shape[1] // 128
        if rb == ST.BlockWise128x128:  # logical [pad4(KB), N/128]
            return _product(a, b, sa, sb[:kb].t(), 128, output_dtype)
        return _product(a, b, sa, sb, 1, output_dtype)  # logical [N, KB]

    def legacy(self, a, b, sa, sb, out_dtype=None, **kw):
        self._legacy(_meta(a), _meta(b), _meta(sa), _meta(sb), out_dtype=out_dtype, **kw)
        self.calls["legacy"] += 1
        rows = 1 if sb.shape[1] == b.shape[1] else 128  # [KB, N] is 1x128, [KB, N/128] is 128x128
        return _product(a, b, sa, sb.t(), rows, out_dtype or a.dtype)


@pytest.fixture
def rules(monkeypatch):
    r = TorchRules(F.scaled_mm, torch._scaled_mm)
    monkeypatch.setattr(F, "scaled_mm", r.v2)
    monkeypatch.setattr(torch, "_scaled_mm", r.legacy)
    ROUTING.reset()
    yield r
    ROUTING.reset()


def _ref(a, b):
    return backends.emulate(a, b, torch.float32)


@pytest.mark.parametrize("pair", bsm.PAIRS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_torch_rules_accept_the_documented_layout_and_refuse_the_other_v2_candidates(pair, m, k, n):
    """Every candidate the probe tries, through bsm.matmul, on meta tensors: torch 2.13 accepts the documented v2
    call at every shape (odd M, N and K-block counts), and no other v2 candidate whose memory layout differs."""
    verdicts = {lay.name: bsm.refusal(lay, pair, m, k, n) for lay in bsm.candidates(pair)}
    assert verdicts[DOCUMENTED[pair]] is None, verdicts[DOCUMENTED[pair]]
    accepted = {name for name, why in verdicts.items() if why is None and name.startswith("v2")}
    if k // 128 == 1:  # one K-block: a row-major [X, 1] scale IS outer-major in memory, and torch says so
        accepted = {name.replace("row-major", "outer-major") for name in accepted}
    assert accepted == {DOCUMENTED[pair]}
    # the legacy API's meta kernel checks the scale SHAPES only (its CUDA kernel also checks strides): both stride
    # variants of each accepted shape pass here, and the GPU probe decides between them
    legacy = {name for name, why in verdicts.items() if why is None and name.startswith("legacy")}
    want = {
        "block128x128": {
            "outer-major b:k-major",
            "outer-major b:n-major",
            "row-major b:k-major",
            "row-major b:n-major",
        },
        "block1x128": {"outer-major b:k-major", "outer-major b:n-major", "row-major b:k-major", "row-major b:n-major"},
    }[pair]
    assert legacy == {f"legacy a:{x}" for x in want}


def test_unpadded_k_major_128x128_scale_is_refused_by_torch():
    """The layout the old probe misread on the H200 (K-major, 3 K-blocks unpadded) is refused outright by v2."""
    lay = {x.name: x for x in bsm.candidates("block128x128")}["v2 a:outer-major b:k-major"]
    why = bsm.refusal(lay, "block128x128", 256, 384, 256)
    assert why is not None and "L4" in why


def test_probe_finds_the_documented_layouts(rules):
    cpu = torch.device("cpu")
    for pair in bsm.PAIRS:
        assert bsm.probe(cpu, pair, _ref).name == DOCUMENTED[pair]
    assert rules.calls["v2"] == 2 and rules.calls["legacy"] == 0  # refused candidates never reach the values


def test_probe_skips_a_layout_torch_refuses(rules, caplog):
    cpu = torch.device("cpu")
    by_name = {x.name: x for x in bsm.candidates("block128x128")}
    unpadded, padded = by_name["v2 a:outer-major b:k-major"], by_name["v2 a:outer-major b:k-major-pad4"]
    with caplog.at_level(logging.DEBUG, logger="fp8comm.gemm"):
        assert bsm.probe(cpu, "block128x128", _ref, [unpadded, padded]) is padded
    assert any("v2 a:outer-major b:k-major (block128x128)" in r.getMessage() for r in caplog.records), caplog.text


def test_probe_refuses_a_misread_confined_to_small_scale_blocks(monkeypatch, caplog):
    """A layout whose result is right except in the block rows of small scale (here: doubled, as a power-of-two
    scale misread gives). Their values are < 2^-8 of the product's largest, so an error measured against the
    global maximum (the probe before this change) stays under 1e-2 and the layout was trusted."""
    seen = {}

    def misread(lay, a, b, pair, out_dtype):
        want = _ref(a, b)
        rowmax = want.abs().amax(1)
        small = rowmax < rowmax.max() * 2**-8
        seen[pair] = int(small.sum())
        got = want.clone()
        got[small] *= 2
        return got.to(out_dtype)

    monkeypatch.setattr(bsm, "matmul", misread)
    lay = bsm.candidates("block128x128")[0]
    for pair in bsm.PAIRS:
        with caplog.at_level(logging.WARNING, logger="fp8comm.gemm"):
            assert bsm.probe(torch.device("cpu"), pair, _ref, [lay]) is None, pair
        assert seen[pair] > 0  # the probe's operands do have such block rows
    assert "disagrees with the emulation" in caplog.text


def test_disagreement_is_relative_to_each_element_and_keeps_nan():
    want = torch.tensor([[1000.0, 1e-3]])
    mag = torch.tensor([[1000.0, 1e-3]])
    assert bsm.disagreement(want, want, mag) == 0.0
    assert bsm.disagreement(torch.tensor([[1000.0, 2e-3]]), want, mag) == pytest.approx(1.0)
    assert bsm.disagreement(torch.tensor([[float("nan"), 1e-3]]), want, mag) != 0.0  # NaN: not < 1e-2


def test_legacy_api_only_pads_k_to_512(rules, monkeypatch):
    def no_v2(*a, **k):
        raise AttributeError("this torch has no torch.nn.functional.scaled_mm")

    monkeypatch.setattr(F, "scaled_mm", no_v2)
    for pair in bsm.PAIRS:
        lay = bsm.probe(torch.device("cpu"), pair, _ref)
        assert lay is not None and lay.name == "legacy a:outer-major b:k-major" and lay.kmult == 512


@pytest.mark.parametrize("pair", bsm.PAIRS)
@pytest.mark.parametrize("m,k,n", SHAPES[1:])
def test_scaled_mm_blockwise_matches_the_emulation(rules, pair, m, k, n):
    """Through backends.scaled_mm (what Fp8Linear's routing calls): odd M and N, K-block counts 5, 1 and 9."""
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g) * 4
    w = torch.randn(n, k, generator=g)
    qa = quantize(x, "e4m3", scaling=Scaling(1, 128), backend="reference")
    qb = quantize(w, "e4m3", scaling=Scaling(128, 128) if pair == "block128x128" else Scaling(1, 128))
    got = backends.scaled_mm(qa, qb, torch.bfloat16)
    want = backends.emulate(qa, qb, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    assert rules.calls["v2"] > 0


def test_layout_error_script_reproduces_the_documented_figures():
    """docs/gemm.md's old-probe figures come from launch/layout_error.py: 58.9x only if the element past the
    unpadded scale's end reads as 1.0 (the model's choice), far less otherwise."""
    path = Path(__file__).resolve().parents[2] / "launch" / "layout_error.py"
    spec = importlib.util.spec_from_file_location("layout_error", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.old_probe_errors()
    assert round(res["fill=1.0"], 1) == 58.9
    assert res["fill=0.0"] < 1 and res["fill=neighbour"] < 1
    assert res["new_probe_refuses"] and set(res["meta_accepts"]) == {
        "as-is/as-is",
        "as-is/outer-major",
        "outer-major/as-is",
        "outer-major/outer-major",
    }
