"""MoE checks on 2 gloo ranks (EP=2, 4 experts, top-2, hidden 64): FP8 dispatch and FP8/bf16 combine in Megatron's
alltoall and allgather token dispatchers, one forward/backward against Megatron's own collectives, then training.

One forward/backward from identical weights isolates each hook's error (loss relative error, gradients' relative
L2 error); 20 training iterations show the loss trajectory. bf16 combine through fp8comm on a bf16 alltoall model
moves the same bytes as Megatron's own all_to_all, so it must be bit-identical (the plumbing check).
"""

from __future__ import annotations

import logging

import mcore_checks as C
import mcore_checks_guard as G
import mcore_train as T
import torch
import torch.distributed as dist

ALL_DDP = dict(grad_reduce=True, param_gather=True)
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)


def _one_step(dispatcher: str, hooks: dict | None) -> dict:
    """One forward/backward (2 micro-batches) of a fresh MoE model; loss, all main grads, hook and comm stats."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fm = C._fm()
    comm_stats, reset_comm_stats = C._stats()
    model, _, config = T.build(T.ddp_kwargs(), moe=True, moe_token_dispatcher_type=dispatcher)
    fm.hook_stats(reset=True)
    reset_comm_stats()
    if hooks is not None:
        fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
    try:
        model.zero_grad_buffer()
        out = get_forward_backward_func()(
            forward_step_func=T.forward_step,
            data_iterator=iter(T.batches(2, 2, _dp_rank())),
            model=[model],
            num_microbatches=2,
            seq_length=T.SEQ,
            micro_batch_size=2,
            forward_only=False,
        )
    finally:
        fm.uninstall()
    s = torch.stack([o["lm loss"] for o in out]).sum(0)
    grads = torch.cat([p.main_grad.float().reshape(-1) for p in model.parameters()])
    return {"loss": float(s[0] / s[1]), "grads": grads, "hooks": fm.hook_stats(reset=True), "comm": comm_stats()}


def _dp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank()


def _compare(ref: dict, got: dict) -> dict:
    gerr = float((got["grads"] - ref["grads"]).norm() / ref["grads"].norm())
    return {
        "loss": round(got["loss"], 5),
        "loss_rel": float(f"{C._rel(got['loss'], ref['loss']):.3g}"),
        "grad_rel_l2": round(gerr, 5),
        "hooks": got["hooks"],
        "bytes": {k: {"wire": v["wire_bytes"], "ratio": round(v["ratio"], 3)} for k, v in got["comm"].items()},
    }


def _assert_close(tag: str, r: dict) -> None:
    assert r["loss_rel"] <= C.MOE_LOSS_RTOL, f"{tag}: loss relative error {r['loss_rel']} > {C.MOE_LOSS_RTOL}"
    assert 0 < r["grad_rel_l2"] <= C.MOE_GRAD_RTOL, f"{tag}: gradients' relative L2 error {r['grad_rel_l2']}"


def _one_step_matrix(dispatcher: str, info: dict) -> dict:
    """Every dispatch/combine choice against Megatron's own collectives (native) in one forward/backward."""
    ref = _one_step(dispatcher, None)
    cases = {
        "fp8_dispatch": dict(moe_dispatch=True),
        "fp8_combine": dict(moe_combine="fp8"),
        "fp8_dispatch_fp8_combine": dict(moe_dispatch=True, moe_combine="fp8"),
        "bf16_combine": dict(moe_combine="bf16"),
    }
    res = {tag: _compare(ref, _one_step(dispatcher, hooks)) for tag, hooks in cases.items()}
    info[f"{dispatcher}_one_step"] = {"loss_native": round(ref["loss"], 5), **res}
    for tag in ("fp8_dispatch", "fp8_combine", "fp8_dispatch_fp8_combine"):
        _assert_close(f"{dispatcher} {tag}", res[tag])
    d, c = res["fp8_dispatch"]["hooks"], res["fp8_combine"]["hooks"]
    assert d.get("moe_dispatch", {}).get("fp8_calls", 0) > 0 and "moe_combine" not in d, d
    assert c.get("moe_combine", {}).get("fp8_calls", 0) > 0 and "moe_dispatch" not in c, c
    b = res["bf16_combine"]["hooks"].get("moe_combine", {})
    assert b.get("bf16_calls", 0) > 0 and b.get("fp8_calls", 0) == 0, b
    return res


def moe_ep2(rank, world, info):
    """alltoall dispatcher, EP=2: every dispatch/combine choice for one step, then 20 iterations with all hooks,
    Megatron's combine (native) vs FP8 combine."""
    T.init_parallel(tp=1, ep=2)
    res = _one_step_matrix("alltoall", info)
    for tag, ratio_min in (("fp8_dispatch", 1.8), ("fp8_combine", 1.8)):
        a2a = res[tag]["bytes"].get("all_to_all")
        assert a2a and a2a["ratio"] >= ratio_min, f"{tag}: no FP8 token bytes: {res[tag]['bytes']}"
    # bf16 wire for bf16 tokens: the same bytes as Megatron's all_to_all, so the same numbers, bit for bit.
    assert res["bf16_combine"]["loss_rel"] == 0 and res["bf16_combine"]["grad_rel_l2"] == 0, res["bf16_combine"]
    base = C.run(OVERLAP, None, moe=True)
    for tag, hooks in (
        ("moe_ep2_all_hooks", dict(ALL_DDP, moe_dispatch=True)),
        ("moe_ep2_all_hooks_fp8_combine", dict(ALL_DDP, moe_dispatch=True, moe_combine="fp8")),
    ):
        f8 = C.run(OVERLAP, hooks, moe=True)
        C.check_parity(base, f8, info, tag)
        for h in ("grad_reduce_scatter", "param_all_gather", "moe_dispatch") + (
            ("moe_combine",) if "moe_combine" in hooks else ()
        ):
            assert f8["hooks"][h]["fp8_calls"] > 0, f8["hooks"]
        # Expert-parallel buckets have a data-parallel group of one rank here: passed through, never quantized.
        assert f8["hooks"]["grad_reduce_scatter"]["passthrough_calls"] > 0, f8["hooks"]
    a, b = info["moe_ep2_all_hooks"], info["moe_ep2_all_hooks_fp8_combine"]
    info["fp8_combine_loss_delta"] = {
        "final_loss_native_combine": a["loss_fp8"][1],
        "final_loss_fp8_combine": b["loss_fp8"][1],
        "max_loss_rel_vs_baseline": [a["max_loss_rel"], b["max_loss_rel"]],
    }


def moe_ep2_allgather(rank, world, info):
    """allgather dispatcher, EP=2 (its TP x EP group has 2 ranks): FP8 token all-gather and FP8 combine
    reduce-scatter for one step, then 20 iterations with every hook vs Megatron alone."""
    T.init_parallel(tp=1, ep=2)
    res = _one_step_matrix("allgather", info)
    ag = res["fp8_dispatch"]["bytes"].get("all_gather")
    assert ag and ag["ratio"] >= 1.8, f"no FP8 token all-gather bytes: {res['fp8_dispatch']['bytes']}"
    rs = res["fp8_combine"]["bytes"].get("reduce_scatter")  # the combine reduce-scatters fp32 (the probs' dtype)
    assert rs and rs["ratio"] >= 3.6, f"no FP8 combine reduce-scatter bytes: {res['fp8_combine']['bytes']}"
    over = {"moe_token_dispatcher_type": "allgather"}
    base = C.run(OVERLAP, None, moe=True, cfg_over=over)
    # with the numerics guard on (healthy data): its buckets count the gathers and reduce-scatters, nothing falls back
    f8 = C.run(OVERLAP, dict(ALL_DDP, moe_dispatch=True, moe_combine="fp8", **G.GUARD), moe=True, cfg_over=over)
    C.check_parity(base, f8, info, "moe_ep2_allgather_all_hooks")
    for h in ("grad_reduce_scatter", "param_all_gather", "moe_dispatch", "moe_combine"):
        assert f8["hooks"][h]["fp8_calls"] > 0, f8["hooks"]
    assert "guard.to_bf16" not in f8["comm"] and not f8["hooks"]["guard"].get("moe_bf16_calls"), f8["hooks"]
    # layer 0's gathered tokens stop fitting FP8: that layer's gather and combine go to Megatron's own collectives
    with G.Injection("moe0", fn="all_gather") as inj:
        hooks = dict(ALL_DDP, moe_dispatch=True, moe_combine="fp8", **G.GUARD)
        bad = C.run(OVERLAP, hooks, moe=True, cfg_over=over, train_kw={"after_backward": inj.after_backward})
    info["allgather_guard"] = dict(hooks=bad["hooks"].get("guard"), injected=inj.injected)
    assert bad["comm"]["guard.to_bf16"]["calls"] == 1 and inj.injected > 0, (bad["comm"], inj.injected)
    assert bad["hooks"]["guard"]["moe_bf16_calls"] >= 2 * (C.ITERS - G.START - 3), bad["hooks"]  # gather + combine
    assert bad["hooks"]["moe_dispatch"]["fp8_calls"] > 0, bad["hooks"]  # layer 1 stayed FP8


def moe_ep2_guard(rank, world, info):
    """The numerics guard on MoE token traffic (alltoall dispatcher, EP=2, 2 MoE layers): layer 0's dispatched
    tokens stop fitting FP8 from iteration G.START on (a 2^20 scale margin): from the same step on every rank, that
    layer's tokens take Megatron's own all-to-all while layer 1's stay FP8, and training goes on. Healthy data never
    falls back."""
    T.init_parallel(tp=1, ep=2)
    hooks = dict(ALL_DDP, moe_dispatch=True)
    base = C.run(OVERLAP, None, moe=True)
    healthy = C.run(OVERLAP, dict(hooks, **G.GUARD), moe=True)
    lines: list = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fp8comm.guard").addHandler(handler)
    try:
        with G.Injection("moe0", fn="all_to_all") as inj:
            guarded = C.run(OVERLAP, dict(hooks, **G.GUARD), moe=True, train_kw={"after_backward": inj.after_backward})
    finally:
        logging.getLogger("fp8comm.guard").removeHandler(handler)
    with G.Injection("moe0", fn="all_to_all") as inj_u:
        unguarded = C.run(OVERLAP, hooks, moe=True, train_kw={"after_backward": inj_u.after_backward})
    summary = guarded["hooks"].get("guard", {})
    rel_g = max(C._rel(a, b) for a, b in zip(guarded["loss"], base["loss"]))
    rel_u = max(C._rel(a, b) for a, b in zip(unguarded["loss"], base["loss"]))
    info.update(
        healthy_switches=healthy["comm"].get("guard.to_bf16", {}).get("calls", 0),
        guard_hooks=summary,
        injected=[inj.injected, inj_u.injected],
        log=lines[:2],
        max_loss_rel_guarded=round(rel_g, 4),
        max_loss_rel_unguarded=round(rel_u, 4),
        loss_base=[round(x, 4) for x in base["loss"][::4]],
        loss_guarded=[round(x, 4) for x in guarded["loss"][::4]],
        loss_unguarded=[round(x, 4) for x in unguarded["loss"][::4]],
    )
    assert info["healthy_switches"] == 0 and not healthy["hooks"].get("guard", {}).get("moe_bf16_calls"), healthy
    assert guarded["comm"]["guard.to_bf16"]["calls"] == 1, guarded["comm"]  # one bucket (moe0), once
    everyone = [None] * world
    dist.all_gather_object(everyone, summary)
    assert all(e == summary for e in everyone), everyone  # the same step on every rank
    assert summary.get("moe_bf16_calls", 0) >= C.ITERS - G.START - 3, summary  # patience 2 + one step of lag
    assert guarded["hooks"]["moe_dispatch"]["fp8_calls"] > 0, guarded["hooks"]  # layer 1 stayed FP8
    assert 0 < inj.injected < inj_u.injected, (inj.injected, inj_u.injected)  # layer 0 left the FP8 path
    if rank == 0:
        assert any("moe0 -> BF16" in m for m in lines), lines
    # No loss claim: this 2-layer model trains about as well with layer 0's tokens zeroed as with them (the
    # residual path carries it), so the recorded losses show the guard's cost/benefit here, they do not prove one.
    assert guarded["loss"][-1] < guarded["loss"][G.START], "training stalled after the fallback"
