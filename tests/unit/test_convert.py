"""convert_to_fp8: what is converted and why the rest is skipped; checkpoints both ways; delayed-scaling state."""

import pytest
import torch
from torch import nn

from fp8comm.gemm import Fp8Linear, convert_to_fp8, strip_fp8_state
from fp8comm.tools.gpt import GPT, GPTConfig


def _gpt(seed=0, n_layer=4):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=n_layer, n_head=2, n_embd=64))


def test_report_converts_block_linears_and_explains_the_rest():
    m = _gpt()
    rep = convert_to_fp8(m, "blockwise", skip_first_blocks=1, skip_last_blocks=1)
    assert rep.converted == [
        f"h.{i}.{s}" for i in (1, 2) for s in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert all(isinstance(m.get_submodule(n), Fp8Linear) for n in rep.converted)
    assert rep.skipped["lm_head"].startswith("output head")
    assert rep.skipped["wte"] == rep.skipped["wpe"] == "embedding"
    assert rep.skipped["ln_f"] == rep.skipped["h.0.ln_1"] == "norm"
    assert "first 1 block(s)" in rep.skipped["h.0.mlp.c_fc"]
    assert "last 1 block(s)" in rep.skipped["h.3.attn.c_proj"]
    assert isinstance(m.h[0].mlp.c_fc, nn.Linear) and not isinstance(m.h[0].mlp.c_fc, Fp8Linear)
    assert m.lm_head.weight is m.wte.weight  # tying survives
    text = str(rep)
    assert "8 converted" in text and "output head" in text


def test_size_threshold_and_user_filter():
    m = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 32))
    rep = convert_to_fp8(m, "tensorwise", min_features=16, module_filter=lambda name, lin: name != "4")
    assert rep.converted == ["3"]
    assert "below size threshold" in rep.skipped["0"] and "below size threshold" in rep.skipped["2"]
    assert rep.skipped["4"] == "user filter"
    rep2 = convert_to_fp8(m, "tensorwise", min_features=0)
    assert rep2.skipped["3"].startswith("already Fp8Linear")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown recipe"):
        convert_to_fp8(_gpt(), "fp4")
    with pytest.raises(ValueError, match="no ModuleList"):
        convert_to_fp8(nn.Sequential(nn.Linear(32, 32)), skip_first_blocks=1)
    with pytest.raises(TypeError, match="nn.Module"):
        convert_to_fp8(torch.randn(3))


@pytest.mark.parametrize("recipe", ["blockwise", "fp8_amax", "delayed"])
def test_checkpoints_load_both_ways(recipe):
    plain = _gpt(seed=1)
    conv = _gpt(seed=2)
    convert_to_fp8(conv, recipe)
    x = torch.randint(0, 65, (2, 16))
    conv(x)  # delayed: fills the amax histories
    # plain -> converted (strict): delayed layers start their histories fresh
    conv.load_state_dict(plain.state_dict())
    assert torch.equal(conv.h[1].mlp.c_fc.weight, plain.h[1].mlp.c_fc.weight)
    # converted -> plain: identical keys except delayed-scaling state, which strip_fp8_state removes
    sd = conv.state_dict()
    extra = set(sd) - set(plain.state_dict())
    assert bool(extra) == (recipe == "delayed")
    fresh = _gpt(seed=3)
    fresh.load_state_dict(strip_fp8_state(sd))
    assert all(torch.equal(v, sd[k]) for k, v in fresh.state_dict().items())
    # and the converted model's outputs stay close to the plain one after the load
    with torch.no_grad():
        lp, lc = plain(x)[0], conv(x)[0]
    assert ((lp - lc).norm() / lp.norm()).item() < 0.05


def _run(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 65, (4, 16), generator=g)
        _, loss = model(x, x.roll(1, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_delayed_scaling_state_survives_save_load_and_resume_is_identical(tmp_path):
    m = _gpt(n_layer=2)
    convert_to_fp8(m, "delayed")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    _run(m, opt, 3, seed=0)
    hist = m.h[0].mlp.c_fc.grad_amax_history
    assert (hist[:3] > 0).all() and (hist[3:] == 0).all()  # one push per backward
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    cont = _run(m, opt, 4, seed=1)

    m2 = _gpt(seed=9, n_layer=2)
    convert_to_fp8(m2, "delayed")
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    ck = torch.load(tmp_path / "ckpt.pt")
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    assert torch.equal(m2.h[0].mlp.c_fc.input_amax_history, ck["model"]["h.0.mlp.c_fc.input_amax_history"])
    assert m2.h[0].mlp.c_fc.delayed_ready == {"input": True, "weight": True, "grad": True}
    assert _run(m2, opt2, 4, seed=1) == cont  # bit-identical continuation


def test_telemetry_records_roles_and_plots(tmp_path):
    from fp8comm.gemm import Telemetry

    m = _gpt(n_layer=2)
    convert_to_fp8(m, "fp8_amax")
    tel = Telemetry(interval=2).attach(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(4):
        _run(m, opt, 1, seed=0)
        tel.step()
    recs = [r for r in tel.records if r.layer == "h.0.mlp.c_fc"]
    assert {r.role for r in recs} == {"input", "weight", "grad"}
    assert sorted({r.step for r in recs}) == [0, 2]  # sampled every 2 steps
    g = [r for r in recs if r.role == "grad"][0]
    assert g.fmt == "e5m2" and g.scale_log2_min == g.scale_log2_max  # per tensor, power of two
    assert float(g.scale_log2_min).is_integer() and 0 <= g.underflow < 1 and g.overflow == 0
    tel.plot(str(tmp_path / "scales.png"))
    tel.to_jsonl(str(tmp_path / "t.jsonl"))
    assert (tmp_path / "scales.png").stat().st_size > 10_000
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == len(tel.records)
    assert {row["role"] for row in tel.summary()} == {"input", "weight", "grad"}
    with pytest.raises(ValueError, match="no Fp8Linear"):
        Telemetry().attach(nn.Sequential(nn.Linear(4, 4)))
