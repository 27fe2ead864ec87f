"""Fp8Linear: forward, dgrad and wgrad of every recipe against float64 references; inf/NaN; zero-size; caching."""

import dataclasses

import pytest
import torch
from torch import nn

from fp8comm.gemm import RECIPES, Fp8Linear, Telemetry, backends, get_recipe, telemetry
from fp8comm.quant import dequantize

# normwise relative error bounds vs the unquantized float64 product (FP8 rounding of both operands):
# e4m3 keeps 3 mantissa bits (~2.5% rms per element), e5m2 keeps 2 (~5%)
BOUND = {"e4m3": 0.06, "e5m2": 0.10}


def _capture(layer):
    """Record every (role, primary, Fp8Tensor) that the layer quantizes."""
    seen = []
    layer.register_quantize_hook(lambda _layer, role, primary, q: seen.append((role, primary, q)))
    return seen


def _deq64(q):
    return dequantize(q, torch.float64)


def _data(m_shape, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*m_shape, k, generator=g) * torch.logspace(-1, 1, k)).to(dtype)
    w = torch.randn(n, k, generator=g) * 0.05
    dy = (torch.randn(*m_shape, n, generator=g) * 1e-3).to(dtype)
    return x, w, dy


def _nrel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = [((37,), 200, 72), ((2, 3, 64), 256, 128), ((130,), 96, 40)]


@pytest.mark.parametrize("recipe", [r for r in RECIPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["2d-odd", "3d", "2d-tall"])
def test_forward_and_gradients_match_float64(recipe, dtype, case):
    m_shape, k, n = case
    x, w, dy = _data(m_shape, k, n, dtype)
    layer = Fp8Linear(k, n, bias=True, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(torch.linspace(-1, 1, n))
    seen = _capture(layer)
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(dy)
    assert y.shape == (*m_shape, n) and y.dtype == dtype
    assert xr.grad.dtype == dtype and layer.weight.grad.dtype == torch.float32

    q = {(role, p): qq for role, p, qq in seen}
    xq, wq, dyq = q[("input", True)], q[("weight", True)], q[("grad", True)]
    r = get_recipe(recipe)
    # 1) exactness: each GEMM equals float64 on the dequantized FP8 operands it was given
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    y64 = _deq64(xq).reshape(-1, k) @ _deq64(wq).t() + layer.bias.double()
    assert _nrel(y.reshape(-1, n), y64) < tol
    w_t = backends.transpose(wq) if r.weight.transpose_invariant else q[("weight", False)]
    dx64 = _deq64(dyq).reshape(-1, n) @ _deq64(w_t).t()
    assert _nrel(xr.grad.reshape(-1, k), dx64) < tol
    x_t = backends.transpose(xq) if r.input.transpose_invariant else q[("input", False)]
    dy_t = backends.transpose(dyq) if r.grad.transpose_invariant else q[("grad", False)]
    dw64 = _deq64(dy_t) @ _deq64(x_t).t()
    assert _nrel(layer.weight.grad, dw64) < 1e-5
    torch.testing.assert_close(layer.bias.grad.double(), dy.double().reshape(-1, n).sum(0), rtol=1e-5, atol=1e-6)

    # 2) accuracy: within the recipe's FP8 error of the unquantized float64 computation
    x64, w64, dy64 = x.double().reshape(-1, k), w.double(), dy.double().reshape(-1, n)
    fx, fw, fg = BOUND[r.input.fmt], BOUND[r.weight.fmt], BOUND[r.grad.fmt]
    slack = 3.0 if recipe in ("fp8_noscale", "cscale") else 1.0  # no scaling: small values lose bits
    assert _nrel(y.reshape(-1, n), x64 @ w64.t() + layer.bias.double()) < slack * max(fx, fw)
    assert _nrel(xr.grad.reshape(-1, k), dy64 @ w64) < slack * max(fg, fw)
    assert _nrel(layer.weight.grad, dy64.t() @ x64) < slack * max(fg, fx)


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise", "rowwise", "mxfp8", "delayed"])
def test_zero_size_batch(recipe):
    layer = Fp8Linear(64, 32, recipe=recipe)
    x = torch.zeros(0, 7, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 7, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
    assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))


@pytest.mark.parametrize("recipe", ["blockwise", "fp8_amax", "delayed", "mxfp8"])
def test_inf_nan_propagate_and_are_counted(recipe):
    layer = Fp8Linear(128, 64, recipe=recipe)
    tel = Telemetry().attach(nn.Sequential(layer))
    telemetry.reset_counters()
    x = torch.randn(16, 128)
    x[3, 7] = float("inf")
    x[9, 0] = float("nan")
    xr = x.clone().requires_grad_()
    y = layer(xr)
    bad = ~torch.isfinite(y)
    assert bad[3].all() and bad[9].all()
    if recipe in ("blockwise", "mxfp8"):  # per-token scales: other tokens are untouched
        assert torch.isfinite(y[[0, 1, 2, 4]]).all()
    dy = torch.randn_like(y) * 1e-3
    dy[5, 2] = float("nan")
    y.backward(torch.where(torch.isfinite(y), dy, torch.zeros_like(dy)))
    assert not torch.isfinite(xr.grad[5]).all()  # NaN in the gradient reaches dgrad
    assert not torch.isfinite(layer.weight.grad).all()  # and wgrad
    assert tel.nonfinite[("0", "input")] == 2 and tel.nonfinite[("0", "grad")] == 1
    assert telemetry.counters("nonfinite.") == {"nonfinite.grad": 1, "nonfinite.input": 2}


def test_weight_quantized_once_per_optimizer_step():
    layer = Fp8Linear(64, 32, recipe="blockwise")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(3):
        for _ in range(4):  # micro-batches with gradient accumulation
            layer(torch.randn(8, 64)).sum().backward()
        assert layer.weight_quantizations == step + 1
        opt.step()
        opt.zero_grad()
    layer(torch.randn(8, 64))
    assert layer.weight_quantizations == 4


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "blockwise"])
def test_weight_transpose_cached_per_step(recipe):
    layer = Fp8Linear(64, 32, recipe=recipe)
    wq_ts = []
    for _ in range(3):
        layer(torch.randn(8, 64, requires_grad=True)).sum().backward()
        wq_ts.append(layer.cached_weight()[1])
    assert layer.weight_quantizations == 1 and wq_ts[0] is not None
    assert all(t is wq_ts[0] for t in wq_ts)  # W^T made with W once, then reused


def test_matches_nn_linear_state_dict_and_from_linear():
    lin = nn.Linear(48, 24)
    f = Fp8Linear.from_linear(lin, "tensorwise")
    assert f.weight is lin.weight and f.bias is lin.bias
    assert list(f.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    assert "recipe=tensorwise" in repr(f)
    x = torch.randn(5, 48)
    assert _nrel(f(x), lin(x)) < 0.06


def test_bad_input_raises():
    layer = Fp8Linear(32, 16)
    with pytest.raises(ValueError, match="last dim 32"):
        layer(torch.randn(4, 31))
    with pytest.raises(TypeError, match="float32/bfloat16"):
        layer(torch.ones(4, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown recipe"):
        Fp8Linear(32, 16, recipe="fp4")
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        Fp8Linear(32, 16, backend="cublas")


def test_autocast_output_dtype_like_nn_linear():
    layer = Fp8Linear(64, 32, recipe="blockwise")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(4, 64))
    assert y.dtype == torch.bfloat16


def test_recipe_validation():
    from fp8comm.gemm import RoleConfig

    with pytest.raises(ValueError, match="granularity must be 'tensor'"):
        RoleConfig("e4m3", "block", source="delayed")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        RoleConfig("e3m4")
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("nope")
    assert get_recipe("cscale", constant_bias=3).constant_bias == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_recipe("blockwise").name = "x"
    assert "128x128" in get_recipe("blockwise").describe()


def test_works_under_torch_compile_fullgraph():
    """The whole layer (quantizers, GEMM, autograd.Function) traces as one graph; numerics equal eager."""
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, recipe="blockwise", quant_backend="reference")
    x = torch.randn(16, 64, requires_grad=True)
    y = layer(x)
    y.backward(torch.ones_like(y))
    gx, gw = x.grad.clone(), layer.weight.grad.clone()
    x.grad = layer.weight.grad = layer.bias.grad = None
    yc = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    yc.backward(torch.ones_like(yc))
    torch.testing.assert_close(yc, y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, gx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, gw, rtol=1e-5, atol=1e-6)


def test_delayed_under_torch_compile_matches_eager():
    """Delayed scaling mutates its amax history: compile splits the graph there and the results still match."""
    torch.manual_seed(0)
    a = Fp8Linear(64, 32, recipe="delayed", quant_backend="reference")
    b = Fp8Linear(64, 32, recipe="delayed", quant_backend="reference")
    b.load_state_dict(a.state_dict())
    cb = torch.compile(b, backend="aot_eager")
    for i in range(3):
        x = torch.randn(16, 64) * (i + 1)
        ya, yb = a(x), cb(x)
        ya.sum().backward()
        yb.sum().backward()
        torch.testing.assert_close(yb, ya, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad_amax_history, a.grad_amax_history)
    torch.testing.assert_close(b.input_amax_history, a.input_amax_history)
    # compiled graphs re-quantize the weight every call (no version counter there): one push per call
    assert (b.weight_amax_history[:3] > 0).all() and (a.weight_amax_history[1:] == 0).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "fp8_amax", "rowwise"])
def test_scaled_mm_backend_matches_emulation_in_fp8linear(recipe):
    """The GPU's _scaled_mm path (transposed operands, padding of odd dims), run on CPU where torch allows it."""
    torch.manual_seed(0)
    x = torch.randn(2, 19, 72) * 3
    dy = torch.randn(2, 19, 40) * 1e-3
    outs = []
    for backend in ("emulation", "scaled_mm"):
        layer = Fp8Linear(72, 40, recipe=recipe, backend=backend)
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(-0.1, 0.1, 72 * 40).reshape(40, 72))
            layer.bias.copy_(torch.linspace(-1, 1, 40))
        xr = x.clone().requires_grad_()
        y = layer(xr)
        y.backward(dy)
        outs.append((y, xr.grad, layer.weight.grad))
    for a, b in zip(*outs):
        assert _nrel(b, a) < 1e-5


@pytest.mark.parametrize("recipe", ["tensorwise", "fp8_amax", "delayed", "blockwise", "rowwise"])
def test_gemm_operands_are_contiguous(recipe, monkeypatch):
    """Every GEMM operand arrives laid out for it (a [rows, K] row-major block of codes): _scaled_mm takes
    row-major A and column-major B only, so a transposed view would cost a full copy before each GEMM."""
    seen = []
    orig = backends.gemm

    def spy(a, b, out_dtype=torch.float32, backend="auto"):
        seen.append((a.data.stride(-1) == 1, b.data.stride(-1) == 1))  # row-major (rows may be block-padded)
        return orig(a, b, out_dtype, backend)

    monkeypatch.setattr(backends, "gemm", spy)
    layer = Fp8Linear(64, 32, recipe=recipe)
    for _ in range(2):  # the second step reuses the cached weight (and its transpose)
        layer(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert len(seen) == 6 and all(a and b for a, b in seen), seen


def test_transposed_weight_comes_with_weight_and_follows_updates():
    layer = Fp8Linear(64, 32, recipe="tensorwise")
    with torch.no_grad():
        layer(torch.randn(4, 64))  # no-grad forward: no transposed copy yet
    assert layer.cached_weight()[1] is None
    layer(torch.randn(4, 64, requires_grad=True)).sum().backward()  # dgrad makes it once, from the cached codes
    wq, wq_t = layer.cached_weight()
    assert wq_t.data.is_contiguous() and torch.equal(wq_t.data.view(torch.uint8), wq.data.view(torch.uint8).t())
    assert layer.weight_quantizations == 1
    with torch.no_grad():
        layer.weight.mul_(2)  # an optimizer step: both layouts are re-made from the new weight
    layer(torch.randn(4, 64, requires_grad=True)).sum().backward()
    assert layer.weight_quantizations == 2
    wq, wq_t = layer.cached_weight()
    assert torch.equal(wq_t.data.view(torch.uint8), wq.data.view(torch.uint8).t())


@pytest.mark.slow  # compile- or memory-bound (5-20 s on 2 cores): out of the fast tier, in the full run
@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise", "rowwise", "mxfp8", "delayed"])
def test_weight_cache_gathered_matches_step_and_keeps_no_copy(recipe):
    """weight_cache="gathered" (ZeRO-3 / FSDP) gives the same bits as caching, keeps no FP8 weight alive between
    forward and backward, and its backward quantizes the weight as the engine holds it then (re-gathered)."""
    import gc

    from fp8comm.quant import Fp8Tensor

    x, w, dy = _data((40,), 96, 48, torch.float32, seed=3)  # 40 tokens: no activation is shaped like W [48, 96]

    def step(policy, release=False):
        lin = Fp8Linear(96, 48, recipe=recipe, weight_cache=policy)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(torch.linspace(-1, 1, 48))
        xi = x.clone().requires_grad_()

        def census():
            gc.collect()
            return sum(1 for o in gc.get_objects() if isinstance(o, Fp8Tensor) and o.data.shape in ((48, 96), (96, 48)))

        before = census()
        y = lin(xi)
        live = census() - before
        if release:  # what ZeRO-3 does between forward and backward: the full weight is gone, then re-gathered
            full = lin.weight.data
            lin.weight.data = torch.empty(0)
            lin.weight.data = full
        y.backward(dy)
        return y, xi.grad, lin.weight.grad, live

    ys, dxs, dws, live_step = step("step")
    yg, dxg, dwg, live_gathered = step("gathered", release=True)
    for a, b in ((ys, yg), (dxs, dxg), (dws, dwg)):
        assert torch.equal(a, b)
    assert live_step >= 1 and live_gathered == 0, (live_step, live_gathered)


def test_weight_cache_policy_validation_and_convert():
    from fp8comm.gemm import convert_to_fp8, set_weight_cache

    with pytest.raises(ValueError, match="weight_cache"):
        Fp8Linear(32, 32, weight_cache="never")
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    with pytest.raises(ValueError, match="weight_cache"):
        convert_to_fp8(model, "blockwise", weight_cache="bogus")
    convert_to_fp8(model, "blockwise", weight_cache="gathered")
    assert {m.weight_cache for m in model.modules() if isinstance(m, Fp8Linear)} == {"gathered"}
    assert "weight_cache=gathered" in repr(model[0])
    assert set_weight_cache(model, "step") == 2 and model[2].weight_cache == "step"
