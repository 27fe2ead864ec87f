"""FSDP2 hook checks (run on every rank by fsdp2_harness): reduce ops, block alignment, non-finite gradients,
uint8 pass-through, async handles, options, bad input, and Fp8Linear's weight cache under FSDP2.

Most use TwoParams (loss = <a, u> + <b, v>, so grad a = u and grad b = v exactly, per rank) to compare FSDP2's
sharded gradients with an exact fp32 reference built from an all-reduce of every rank's u and v.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import ReduceOp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8comm.integrations.fsdp2 as f2

NA, NB = 300, 100  # per-rank shards of 150 and 50 elements at world 2: neither is a whole number of 128-blocks


class TwoParams(nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(NA, dtype=dtype))
        self.b = nn.Parameter(torch.randn(NB, dtype=dtype))

    def forward(self, u, v):
        return (self.a * u).sum() + (self.b * v).sum()


def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def sharded(module: nn.Module, **kw) -> nn.Module:
    torch.manual_seed(0)
    fully_shard(module, mesh=mesh(), **kw)
    return module


def grads_of(model, u, v) -> tuple[torch.Tensor, torch.Tensor]:
    model(u, v).backward()
    return model.a.grad.full_tensor(), model.b.grad.full_tensor()


def inputs(seed: int, b_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed * 97 + dist.get_rank())
    return torch.randn(NA, generator=g), torch.randn(NB, generator=g) * b_scale


def summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone().double()
    dist.all_reduce(t)
    return t.float()


def rel_err(x, ref) -> float:
    return float((x - ref).norm() / ref.norm())


class OpSpy:
    """Record the reduce ops FSDP2 hands to the FP8 reduce-scatter (layout.reduce_op is where they arrive)."""

    def __init__(self) -> None:
        self.ops, self.orig = [], f2.layout.reduce_op

    def __enter__(self):
        def spy(op):
            self.ops.append(repr(op) if not hasattr(op, "factor") else f"PREMUL_SUM({op.factor:.4f})")
            return self.orig(op)

        f2.layout.reduce_op = spy
        return self

    def __exit__(self, *exc):
        f2.layout.reduce_op = self.orig


# ----------------------------------------------------------------------------------------------- checks
def reduce_ops_honoured(rank, world, info):
    """AVG (default; also with bf16 gradients), gradient_divide_factor == world (AVG), 3.0 (PREMUL_SUM(1/3), which
    gloo itself cannot run) and force-sum (SUM + FSDP2's own post-divide): each gives sum/factor within the FP8
    bound, without bias (the projection coefficient on the exact result is 1 to within 1%)."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gradients reduced in bf16
    cases = {
        "default": ({}, None),
        "bf16_gradients": ({"mp_policy": bf16}, None),
        "divide_by_world": ({}, lambda m: m.set_gradient_divide_factor(float(world))),
        "divide_by_3": ({}, lambda m: m.set_gradient_divide_factor(3.0)),
        "force_sum": ({}, lambda m: m.set_force_sum_reduction_for_comms(True)),
    }
    for i, (name, (kw, setup)) in enumerate(cases.items()):
        model = sharded(TwoParams(), **kw)
        if setup is not None:
            setup(model)
        f2.enable(model)
        f2.reset_hook_stats()
        u, v = inputs(i)
        with OpSpy() as spy:
            ga, gb = grads_of(model, u, v)
        factor = 3.0 if name == "divide_by_3" else float(world)
        ref = torch.cat([summed(u), summed(v)]) / factor
        got = torch.cat([ga, gb]).float()
        coef = float(got @ ref / (ref @ ref))
        g = f2.hook_stats()["gradients"]  # FSDP2's bytes for the call: (world - 1) x L x its itemsize
        info[name] = {
            "op": spy.ops,
            "reduce_itemsize": g["baseline_bytes"] // ((world - 1) * g["elements"] // world),
            "rel_err": round(rel_err(got, ref), 5),
            "scale_coef": round(coef, 5),
        }
        assert rel_err(got, ref) < 0.06 and abs(coef - 1) < 0.01, (name, info[name])
        f2.disable(model)
    assert info["divide_by_3"]["op"] == ["PREMUL_SUM(0.3333)"] and "SUM" in info["force_sum"]["op"][0]
    assert info["bf16_gradients"]["reduce_itemsize"] == 2 and info["default"]["reduce_itemsize"] == 4


def block_alignment(rank, world, info):
    """Parameters packed back to back in FSDP2's flat buffer, one of them 1e-6 times smaller: with blocks padded to
    parameter boundaries the small one keeps E4M3's relative precision; sharing a block, it flushes to zero."""
    for align in (True, False):
        model = sharded(TwoParams())
        f2.enable(model, align_blocks=align, weights=False)
        u, v = inputs(7, b_scale=1e-6)
        ga, gb = grads_of(model, u, v)
        ea, eb = rel_err(ga, summed(u) / world), rel_err(gb, summed(v) / world)
        info[f"align_{align}"] = {"rel_err_large": round(ea, 5), "rel_err_small": round(eb, 5)}
        f2.disable(model)
    s = f2.hook_stats()
    assert info["align_True"]["rel_err_small"] < 0.06 and info["align_True"]["rel_err_large"] < 0.06, info
    assert info["align_False"]["rel_err_small"] > 0.5, info  # the small parameter drowned in the big one's scale
    info["padding_elements"] = s["gradients"]["padding_elements"]


def nonfinite_gradients_arrive(rank, world, info):
    """inf on one rank and NaN on another reach exactly the matching gradient elements; nothing is clamped."""
    model = sharded(TwoParams())
    f2.enable(model)
    u, v = inputs(3)
    if rank == world - 1:
        u[7] = float("inf")
    if rank == 0:
        v[3] = float("nan")
    ga, gb = grads_of(model, u, v)
    bad = set(torch.nonzero(~torch.isfinite(torch.cat([ga, gb]))).flatten().tolist())
    info.update(nonfinite_indices=sorted(bad), values=[float(ga[7]), float(gb[3])])
    assert bad == {7, NA + 3}, bad
    f2.disable(model)


def uint8_gather_passes_through(rank, world, info):
    """A bf16 trainable parameter next to a frozen fp32 one (no mixed-precision policy): FSDP2 all-gathers raw
    bytes; they pass through untouched and are counted, gradients (bf16) still travel in FP8."""
    model = TwoParams()
    model.b = nn.Parameter(model.b.detach().float(), requires_grad=False)
    model.a = nn.Parameter(model.a.detach().bfloat16())
    sharded(model)
    rep = f2.enable(model)
    f2.reset_hook_stats()
    u, v = inputs(5)
    model(u.bfloat16(), v).backward()
    s = f2.hook_stats()
    info.update(weights=s["weights"]["passthrough"], gradient_fp8_calls=s["gradients"]["fp8_calls"])
    assert "mixed parameter dtypes" in str(rep), str(rep)
    assert s["weights"]["passthrough_calls"] == s["weights"]["calls"] >= 1 and s["gradients"]["fp8_calls"] == 1
    assert list(s["weights"]["passthrough"]) == ["torch.uint8 input"], s
    f2.disable(model)


def async_handles(rank, world, info):
    """With async_op=True the hooks return a torch Work (FSDP2 waits only on those) whose wait() does the decode
    (all-gather) or the fp32 sum (reduce-scatter); FSDP2's explicit unshard(async_op=True) runs through it."""
    model = sharded(TwoParams(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    f2.enable(model)
    pg = model._get_fsdp_state()._fsdp_param_groups[0]
    ag = pg._all_gather_comm
    n = (NA + NB) // world
    out = torch.full((world * n,), float("nan"), dtype=torch.bfloat16)
    inp = out.narrow(0, rank * n, n)  # FSDP2's copy-in: the input is this rank's slot of the output
    inp.copy_(torch.arange(n, dtype=torch.bfloat16) / n + rank)
    work = ag(output_tensor=out, input_tensor=inp, group=dist.group.WORLD, async_op=True)
    pending = bool(torch.isnan(out.view(world, n)[(rank + 1) % world]).all())
    assert isinstance(work, dist.Work) and not work.is_completed()
    work.wait()
    ref = torch.stack([torch.arange(n, dtype=torch.bfloat16) / n + r for r in range(world)]).float()
    err = rel_err(out.view(world, n).float(), ref)
    info.update(others_pending_before_wait=pending, rel_err=round(err, 5))
    assert pending and work.is_completed() and err < 0.05
    rs = pg._reduce_scatter_comm
    grads = torch.stack([torch.arange(world * n, dtype=torch.float32) / (world * n) + r for r in range(world)])
    red = torch.full((n,), float("nan"))
    work = rs(
        output_tensor=red, input_tensor=grads[rank].clone(), group=dist.group.WORLD, op=ReduceOp.AVG, async_op=True
    )
    rs_pending = bool(torch.isnan(red).all())
    work.wait()
    rs_err = rel_err(red, grads.mean(0).view(world, n)[rank])
    info.update(reduce_scatter_pending_before_wait=rs_pending, reduce_scatter_rel_err=round(rs_err, 5))
    assert rs_pending and isinstance(work, dist.Work) and rs_err < 0.05
    before = f2.hook_stats()["weights"]["calls"]
    model.unshard(async_op=True).wait()
    assert f2.hook_stats()["weights"]["calls"] == before + 1
    model.reshard()
    f2.disable(model)


def options_and_check_policy(rank, world, info):
    """Per-direction options reach fp8comm: e8m0 weight scales (~1.98x vs bf16), E5M2 + stochastic rounding +
    error feedback for gradients (a residual per module), check True/False (descriptor bytes or none), one
    direction off (FSDP2's own collective there)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {
        "e8m0": dict(weights={"scaling": "e8m0"}, check=False),
        "grad_options": dict(
            gradients={
                "fmt": "e5m2",
                "rounding": "stochastic",
                "error_feedback": True,
                "allow_unpartitioned_residuals": True,
            }
        ),
        "check_on": dict(check=True),
        "weights_off": dict(weights=False),
        "gradients_off": dict(gradients=False),
    }
    for name, opts in runs.items():
        model = sharded(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), mp_policy=mp)
        f2.enable(model, **opts)
        f2.reset_hook_stats()
        for _ in range(2):
            model(torch.randn(8, 256)).square().mean().backward()
        s = f2.hook_stats()
        info[name] = {
            d: {"ratio": round(x["ratio"], 4), "check_bytes": x["check_bytes"], "calls": x["calls"]}
            for d, x in s.items()
        }
        if name == "grad_options":
            ef = model._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm.error_feedback
            info[name]["residual_norm"] = ef.norm()
            assert ef.norm() > 0
        f2.disable(model)
    assert info["e8m0"]["weights"]["ratio"] > 1.95 and info["e8m0"]["weights"]["check_bytes"] == 0
    assert info["check_on"]["weights"]["check_bytes"] > 0 and info["check_on"]["gradients"]["check_bytes"] > 0
    assert "weights" not in info["weights_off"] and "gradients" not in info["gradients_off"]


def bad_inputs_are_refused(rank, world, info):
    """Clear errors before anything is installed or any byte moves: no FSDP2 module, FSDP1, enabled twice, several
    param groups, an unsupported reduce op, a non-float reduce-scatter input, mismatched sizes, a misspelt option."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    errors = {}

    def refused(name, fn, match):
        try:
            fn()
        except f2.Fp8CommFsdp2Error as e:
            errors[name] = str(e)
            assert match in str(e), (name, str(e))
            return
        raise AssertionError(f"{name}: no error")

    refused("not_sharded", lambda: f2.enable(nn.Linear(4, 4)), "no module sharded by FSDP2")
    from torch.distributed.fsdp import FullyShardedDataParallel

    refused(
        "fsdp1", lambda: f2.enable(FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))), "FSDP1"
    )
    model = sharded(TwoParams())
    f2.enable(model)
    refused("twice", lambda: f2.enable(model), "already enabled")
    rs = model._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    out, inp = torch.zeros(NA // world + NB // world), torch.zeros(NA + NB)
    refused(
        "op_max",
        lambda: rs(output_tensor=out, input_tensor=inp, group=dist.group.WORLD, op=ReduceOp.MAX),
        "supports SUM, AVG and PREMUL_SUM",
    )
    refused(
        "int_input",
        lambda: rs(output_tensor=out.long(), input_tensor=inp.long(), group=dist.group.WORLD, op=ReduceOp.SUM),
        "reduce-scatter input is torch.int64",
    )
    refused(
        "sizes",
        lambda: rs(output_tensor=out, input_tensor=inp[:-2], group=dist.group.WORLD, op=ReduceOp.SUM),
        "expected world",
    )
    f2.disable(model)
    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"), shard_mesh_dim=0)
    two = TwoParams()
    fully_shard(
        two, mesh=mesh(), shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p is two.b else None
    )
    refused("param_groups", lambda: f2.enable(two), "2 param groups")
    assert not f2.is_enabled(two) and not any(
        f2.hooks.is_ours(g._all_gather_comm) for g in two._get_fsdp_state()._fsdp_param_groups
    )
    refused("option", lambda: f2.enable(model, gradient={}), "did you mean 'gradients'")
    info.update(errors=errors)


# --------------------------------------------------------------------------- Fp8Linear under FSDP2 (staleness)
def _stale_forwards(enable: bool, steps: int = 4) -> tuple[int, int, list]:
    """(stale layer outputs, forwards, cache modes): convert_to_fp8 + fully_shard per layer, the worst case of
    storage reuse (FSDP2's unsharded storage kept, as the CUDA caching allocator mostly does), SGD steps; each
    Fp8Linear output is compared bit for bit with a fresh Fp8Linear on the weight it was called with."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

    import fp8comm
    from fp8comm.gemm import Fp8Linear

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)])
    fp8comm.convert_to_fp8(model, "blockwise", skip_output_head=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh(), mp_policy=mp)
    fully_shard(model, mesh=mesh(), mp_policy=mp)
    if enable:
        f2.enable(model)
    seen, weights = [], []
    lins = [m for m in model if isinstance(m, Fp8Linear)]
    # The weight it is called with: after FSDP2's pre-forward (unsharded), before its post-forward (resharded).
    hooks = [
        m.register_forward_pre_hook(lambda m, i: weights.append((m.weight.detach().clone(), m.bias.detach().clone())))
        for m in lins
    ]
    hooks += [
        m.register_forward_hook(lambda m, i, o: seen.append((m, i[0].detach(), o.detach(), *weights.pop())))
        for m in lins
    ]
    free = fsdp_param.free_storage
    fsdp_param.free_storage = lambda t: None  # the same storage (data_ptr) and version after every step
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stale = 0
    try:
        for s in range(steps):
            model(torch.randn(16, 128, generator=torch.Generator().manual_seed(s))).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            for m, x, y, w, b in seen:
                ref = Fp8Linear(128, 128, recipe=m.recipe, dtype=w.dtype)
                with torch.no_grad():
                    ref.weight.copy_(w)
                    ref.bias.copy_(b)
                stale += int(not torch.equal(ref(x), y))
            seen_n = len(seen)
            seen.clear()
    finally:
        fsdp_param.free_storage = free
        for h in hooks:
            h.remove()
    modes = [getattr(m, "weight_cache", None) for m in model if isinstance(m, Fp8Linear)]
    if enable:
        f2.disable(model)
    return stale, steps * seen_n, modes


def fp8linear_weight_never_stale(rank, world, info):
    """Without enable() FSDP2 hands Fp8Linear the same (version, data_ptr) after a step, and its cached FP8
    weight goes stale; with enable() every forward computes with the weight it was given."""
    info["stale_without_enable"], forwards, _ = _stale_forwards(False)
    info["stale_with_enable"], _, info["weight_cache"] = _stale_forwards(True)
    info["forwards"] = forwards
    assert info["stale_without_enable"] > 0, "the hazard did not show: the test no longer exercises it"
    assert info["stale_with_enable"] == 0, info


def fp8linear_weight_cache_gathered(rank, world, info):
    """enable() puts every Fp8Linear on weight_cache='gathered' (fp8comm.gemm.set_weight_cache): no FP8 copy of a
    full weight outlives the window in which FSDP2 holds the gathered weight."""
    _, _, modes = _stale_forwards(True, steps=1)
    info["weight_cache"] = modes
    assert modes and all(m == "gathered" for m in modes), modes
