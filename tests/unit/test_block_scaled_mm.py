"""The block-scaled GEMM layouts and their probe, against a CPU MODEL of cuBLASLt's documented contract.

No GPU here: `Contract` stands in for torch's block-scaled GEMM and behaves as the sources collected in docs/gemm.md
say cuBLASLt does (A's scale read outer-dim-major; B's 128x128 scale read K-major with a leading dimension of
pad4(K/128) whatever it is given, so an unpadded one is misread SILENTLY; other layouts refused). These tests prove
the probe and the padding logic against that model; whether the model is right is for the GPU script
(launch/device_check_gemm.py) to show.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from fp8comm.gemm import backends
from fp8comm.gemm import block_scaled_mm as bsm
from fp8comm.gemm.routing import ROUTING
from fp8comm.quant import Scaling, quantize


def _up4(x: int) -> int:
    return -(-x // 4) * 4


def _k_major_grid(sb: torch.Tensor, kb: int, rows: int) -> torch.Tensor:
    """What cuBLASLt reads from a K-major scale: `rows` columns of pad4(kb) values each, from the tensor's memory."""
    if sb.stride(0) != 1:
        raise RuntimeError("contract: the 128x128 scale must be K-major (stride 1 along K-blocks)")
    mem = sb.t().reshape(-1)  # memory order of a (1, ld) strided [ld, rows] tensor
    ld = _up4(kb)
    mem = torch.cat([mem, torch.ones(max(0, rows * ld - mem.numel()))])
    return mem[: rows * ld].view(rows, ld)[:, :kb]  # [rows, kb]


class Contract:
    """The model: `v2(...)` for torch.nn.functional.scaled_mm, `legacy(...)` for torch._scaled_mm."""

    def __init__(self) -> None:
        self.calls = {"v2": 0, "legacy": 0}

    @staticmethod
    def _product(a, b, sa_grid, sb_grid, b_rows: int, out_dtype):
        m, k = a.shape
        n = b.shape[1]
        da = a.float() * sa_grid.repeat_interleave(128, 1)[:, :k]
        gb = sb_grid.repeat_interleave(b_rows, 0)[:n].repeat_interleave(128, 1)[:, :k]  # [n, k]
        db = b.float() * gb.t()
        return (da @ db).to(out_dtype)

    @staticmethod
    def _scale_a(sa, m: int, kb: int):
        if tuple(sa.shape) != (m, kb) or (m > 1 and kb > 1 and sa.stride() != (1, m)):
            raise RuntimeError(f"contract: scale_a must be [{m}, {kb}] outer-dim-major, got {tuple(sa.stride())}")
        return sa

    def v2(self, a, b, sa, ra, sb, rb, output_dtype=torch.bfloat16, **kw):
        self.calls["v2"] += 1
        m, k = a.shape
        n, kb = b.shape[1], k // 128
        st = F.ScalingType
        assert ra == st.BlockWise1x128
        sa_grid = self._scale_a(sa, m, kb)
        if rb == st.BlockWise128x128:
            if sa.shape[1] != kb or sb.shape[0] not in (kb, _up4(kb)) or sb.shape[1] != -(-n // 128):
                raise RuntimeError(f"contract: scale_b shape {tuple(sb.shape)}")
            return self._product(a, b, sa_grid, _k_major_grid(sb, kb, sb.shape[1]), 128, output_dtype)
        if tuple(sb.shape) != (n, kb) or (kb > 1 and sb.stride() != (1, n)):
            raise RuntimeError("contract: a 1x128 scale_b must be [N, K/128] outer-dim-major")
        return self._product(a, b, sa_grid, sb, 1, output_dtype)

    def legacy(self, a, b, sa, sb, out_dtype=None, **kw):
        self.calls["legacy"] += 1
        m, k = a.shape
        n, kb = b.shape[1], k // 128
        if out_dtype is None:
            raise RuntimeError("contract: FP8 output (CUBLAS_STATUS_INVALID_VALUE)")
        if tuple(sb.shape) != (kb, -(-n // 128)):
            raise RuntimeError("contract: the legacy API infers 1x128 x 128x128 from [M, K/128] and [K/128, N/128]")
        return self._product(a, b, self._scale_a(sa, m, kb), _k_major_grid(sb, kb, sb.shape[1]), 128, out_dtype)


@pytest.fixture
def contract(monkeypatch):
    c = Contract()
    monkeypatch.setattr(F, "scaled_mm", c.v2)
    monkeypatch.setattr(torch, "_scaled_mm", c.legacy)
    ROUTING.reset()
    yield c
    ROUTING.reset()


def _ref(a, b):
    return backends.emulate(a, b, torch.float32)


def test_probe_finds_the_documented_layouts(contract):
    cpu = torch.device("cpu")
    assert bsm.probe(cpu, "block128x128", _ref).name == "v2 a:outer-major b:k-major-pad4"
    assert bsm.probe(cpu, "block1x128", _ref).name == "v2 a:outer-major b:outer-major"


def test_probe_rejects_a_silently_wrong_layout(contract, caplog):
    cpu = torch.device("cpu")
    by_name = {x.name: x for x in bsm.candidates("block128x128")}
    unpadded, padded = by_name["v2 a:outer-major b:k-major"], by_name["v2 a:outer-major b:k-major-pad4"]
    with caplog.at_level(logging.WARNING, logger="fp8comm.gemm"):
        assert bsm.probe(cpu, "block128x128", _ref, [unpadded, padded]) is padded
    assert any("v2 a:outer-major b:k-major disagrees" in r.getMessage() for r in caplog.records), caplog.text


def test_legacy_api_only_pads_k_to_512(contract, monkeypatch):
    def no_v2(*a, **k):
        raise AttributeError("this torch has no torch.nn.functional.scaled_mm")

    monkeypatch.setattr(F, "scaled_mm", no_v2)
    lay = bsm.probe(torch.device("cpu"), "block128x128", _ref)
    assert lay is not None and lay.name == "legacy a:outer-major b:k-major" and lay.kmult == 512
    assert bsm.probe(torch.device("cpu"), "block1x128", _ref) is None


@pytest.mark.parametrize("pair", bsm.PAIRS)
@pytest.mark.parametrize("m,k,n", [(100, 640, 200), (16, 128, 16), (33, 1152, 300)])
def test_scaled_mm_blockwise_matches_the_emulation(contract, pair, m, k, n):
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
    assert contract.calls["v2"] > 0
