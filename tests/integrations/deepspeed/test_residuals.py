"""Residuals (the DeepSpeed adapter's per-parameter error-feedback state) against a plain model of its contract.

The contract: assemble() hands out a buffer laid out like the call (each piece holds the parameter's residual,
everything else zero), the collective updates it in place, scatter() stores each piece back under its parameter.
A float32/bfloat16 buffer whose parameters lie wholly in the call stays resident instead of being copied; these
tests run calls through both and compare every value, across layout changes, resets and checkpoints.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fp8comm.integrations.deepspeed import levels
from fp8comm.integrations.deepspeed.residuals import Residuals

NUMELS = {"a": 300, "b": 130, "c": 70}


def _layout(order, pad, split=None):
    """pieces and total for parameters in `order`, each starting `pad` elements after the previous one ends;
    split=(key, at): that parameter contributes only its first `at` elements (it is split across calls)."""
    pieces, pos = [], 0
    for k in order:
        n = NUMELS[k] if split is None or split[0] != k else split[1]
        pieces.append((k, NUMELS[k], 0, pos, n))
        pos += n + pad
    return pieces, pos + 5


class _Model:
    """What the residual values must be: one fp32 tensor per parameter, copied in and out of every call."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.r = {}

    def assemble(self, pieces, total):
        buf = torch.zeros(total, dtype=self.dtype)
        for k, numel, src, dst, n in pieces:
            buf[dst : dst + n] = self.r.setdefault(k, torch.zeros(numel, dtype=self.dtype))[src : src + n]
        return buf

    def scatter(self, buf, pieces):
        for k, _, src, dst, n in pieces:
            self.r[k][src : src + n] = buf[dst : dst + n]


def _collective(buf, gen):
    """Stands in for a quantized call: rewrites the residual in place, gaps included (a rotation leaks into pads)."""
    buf.copy_(torch.randn(buf.numel(), generator=gen).to(buf.dtype))


def _same(res: Residuals, model: _Model):
    store = res.store
    assert set(store) == set(model.r)
    for k, v in model.r.items():
        assert torch.equal(store[k], v), k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_buffers_hold_the_same_values_as_copies(dtype):
    res, model = Residuals(dtype), _Model(getattr(torch, dtype))
    gen = torch.Generator().manual_seed(0)
    a = _layout(["a", "b"], 6)
    b = _layout(["b", "a", "c"], 3)
    split = _layout(["c", "a"], 2, split=("a", 100))
    for step, (pieces, total) in enumerate([a, a, a, b, b, a, split, a, b, b]):
        ef = res.assemble(pieces, total, "cpu")
        want = model.assemble(pieces, total)
        assert torch.equal(ef.residual, want), f"step {step}: assembled buffer differs"
        _collective(ef.residual, gen)
        model.scatter(ef.residual, pieces)
        res.scatter(ef, pieces, total)
        if step in (2, 8):
            res.reset()
            for v in model.r.values():
                v.zero_()
        if step in (1, 4, 9):
            _same(res, model)  # `store` moves resident buffers back
    _same(res, model)


def test_the_same_layout_gets_its_buffer_back_without_copies():
    res = Residuals("float32")
    pieces, total = _layout(["a", "b", "c"], 4)
    ef = res.assemble(pieces, total, "cpu")
    ef.residual.fill_(1.0)
    res.scatter(ef, pieces, total)
    assert res.count() == 3 and res.nbytes() == 4 * total  # the buffer is the storage: no per-parameter copies
    again = res.assemble(pieces, total, "cpu")
    assert again.residual is ef.residual
    gaps = torch.ones(total, dtype=torch.bool)
    for _, _, _, dst, n in pieces:
        gaps[dst : dst + n] = False
    assert torch.all(again.residual[gaps] == 0) and torch.all(again.residual[~gaps] == 1)
    # a split parameter never makes its call's buffer resident
    res2 = Residuals("float32")
    sp, st = _layout(["c", "a"], 2, split=("a", 100))
    ef2 = res2.assemble(sp, st, "cpu")
    res2.scatter(ef2, sp, st)
    assert res2.assemble(sp, st, "cpu").residual is not ef2.residual


def test_checkpoint_round_trip_after_resident_calls():
    res = Residuals("float32")
    pieces, total = _layout(["a", "b"], 6)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ef = res.assemble(pieces, total, "cpu")
        _collective(ef.residual, gen)
        res.scatter(ef, pieces, total)
    sd = res.state_dict()
    back = Residuals("float32")
    back.load_state_dict(sd)
    for k in ("a", "b"):
        assert torch.equal(back.store[k], sd["residuals"][k])
    assert torch.equal(back.assemble(pieces, total, "cpu").residual, res.assemble(pieces, total, "cpu").residual)
    res.clear()
    assert res.count() == 0 and res.nbytes() == 0


def test_compact_residuals_are_never_resident():
    res = Residuals("fp8")
    pieces, total = _layout(["a", "b"], 6)
    ef = res.assemble(pieces, total, "cpu")
    ef.residual.fill_(0.5)
    res.scatter(ef, pieces, total)
    assert res.nbytes() == sum(NUMELS[k] for k in ("a", "b")) + 4 * 2  # codes + one fp32 scale each
    assert res.assemble(pieces, total, "cpu").residual is not ef.residual


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
@pytest.mark.parametrize("nodes,local,me", [(2, 2, 0), (2, 2, 1), (3, 4, 2)])
def test_windowed_residual_is_the_rail_cut_out_and_put_back(dtype, nodes, local, me):
    """Two levels: the call's residual covers only this rank's rail (levels.rail_window). The contract, as the
    adapter kept it before windows: assemble the whole send layout, cut the rail out, let the collective update
    it, zero the whole layout, put the rail back, scatter. Flat calls (no window) interleave, as across a switch."""
    hg = SimpleNamespace(nodes=nodes, local=local, local_rank=me)
    chunk = 100
    total = nodes * local * chunk
    numels = {"p": 150, "q": total - 150 - 20}  # pieces: p at 0, q after a 20-element pad
    pieces = [("p", 150, 0, 0, 150), ("q", numels["q"], 0, 170, numels["q"])]
    window = levels.rail_window(total, hg)
    assert window == [((m * local + me) * chunk, (m * local + me + 1) * chunk, m * chunk) for m in range(nodes)]
    res = Residuals(dtype)
    ref = {k: torch.zeros(n) for k, n in numels.items()}  # the contract, on fp32 values
    gen = torch.Generator().manual_seed(2)
    for step, win in enumerate([None, window, window, window, None, window]):
        ef = res.assemble(pieces, total, "cpu", win)
        full = torch.zeros(total)
        for k, _, src, dst, n in pieces:
            full[dst : dst + n] = ref[k][src : src + n]
        rail = torch.cat([full[a:b] for a, b, _ in win]) if win else full
        if dtype == "float32":
            assert torch.equal(ef.residual, rail), step
        new = torch.randn(rail.numel(), generator=gen)
        ef.residual.copy_(new)
        if win:
            full.zero_()
            for (a, b, _), got in zip(win, new.split(chunk)):
                full[a:b] = got
        else:
            full = new
        res.scatter(ef, pieces, total, win)
        for k, _, src, dst, n in pieces:
            ref[k][src : src + n] = full[dst : dst + n]
        if dtype == "fp8":  # compact: the stored values are the codes of the reference's (one scale each)
            from fp8comm.quant.residual import RESIDUAL_FORMATS, decode_residual, encode_residual

            fmt = RESIDUAL_FORMATS["fp8"]
            for k in ref:
                ref[k] = decode_residual(*encode_residual(ref[k], fmt), fmt)
    store = res.store
    for k, v in ref.items():
        got = store[k] if dtype == "float32" else res._values(k)
        assert torch.equal(got, v), k
    if dtype == "float32":  # a windowed layout stays resident at its packed size: 1/local of the send layout
        ef = res.assemble(pieces, total, "cpu", window)
        res.scatter(ef, pieces, total, window)
        assert res.nbytes() == 4 * nodes * chunk and res.count() == 2
