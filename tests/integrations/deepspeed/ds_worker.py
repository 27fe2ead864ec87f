"""torchrun worker: runs one scenario's checks against real DeepSpeed (CPU, gloo) and writes a JSON line per check.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ds_worker.py SCENARIO OUTDIR

After a failed check the ranks stop (collectives may be out of step); the parent reports which check it was.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fp8comm.integrations.deepspeed import cpu

cpu.prepare()

import deepspeed  # noqa: E402
import ds_train as T  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ds_checks_fp4 import (  # noqa: E402
    zero1_bf16_nvfp4_hadamard,
    zero2_bf16_fp4,
    zero2_bf16_fp4_small_buckets,
    zero3_bf16_fp4_gradients,
)
from ds_checks_grad import (  # noqa: E402
    zero1_bf16_fp32_accumulation,
    zero1_fp32_error_feedback,
    zero2_bf16_fp32_accumulation,
)
from ds_checks_guard import guard_fallback, moe_guard_fallback  # noqa: E402
from ds_checks_levels import CHECKS as LEVELS  # noqa: E402
from ds_checks_moe import moe_ep2_one_step  # noqa: E402
from ds_checks_planner import CHECKS as PLANNER  # noqa: E402
from ds_checks_residuals import checkpoint_fp32_residuals_into_fp8  # noqa: E402
from ds_checks_scope import engines_per_scope  # noqa: E402
from ds_checks_updates import CHECKS as UPDATES  # noqa: E402
from ds_common import SMALL_BUCKET, SQNR, SQNR_STEPS, STEPS, TOL_COMM, TOL_GEMM, GradSqnr, baseline, check_ratio, parity  # noqa: E402
from ds_mutations import apply_from_env  # noqa: E402

import fp8comm.integrations.deepspeed as fd  # noqa: E402


# --------------------------------------------------------------------------------------------- scenario: zero
def zero3_bf16_flag(info):
    """The config flag through plain deepspeed.initialize; uninstall restores it."""
    orig = fd.engine._ORIG_INIT
    assert deepspeed.initialize is not orig, "importing the integration did not wrap deepspeed.initialize"
    run = parity(info, 3, "bf16", init=deepspeed.initialize)
    assert "zero3.param_gather.unaligned" not in run.stats["hooks"], run.stats["hooks"]
    info["ratio_w"] = check_ratio(run.stats, "weights", 2)
    info["ratio_g"] = check_ratio(run.stats, "gradients", 2)
    fd.uninstall()
    assert deepspeed.initialize is orig and not fd.is_installed()
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero import stage3

    assert not getattr(pp._dist_allgather_fn, "_fp8comm_hook", False)
    assert not getattr(stage3.reduce_scatter_coalesced, "_fp8comm_hook", False)


def _zero(stage, dtype, factor, **zero):
    def check(info):
        sq = GradSqnr(SQNR_STEPS) if (stage, dtype) == (1, "fp32") else None  # zero1_fp32_error_feedback uses it
        run = parity(info, stage, dtype, on_step=sq, **zero)
        if sq is not None:
            SQNR["zero1_fp32"] = sq
            info.update(step_sqnr_db_mean=sum(sq.step_db) / len(sq.step_db), sum_sqnr_db=sq.sum_db[-1])
        size = 2 if dtype == "bf16" else 4
        info["ratio_w"] = check_ratio(run.stats, "weights", size)
        info["ratio_g"] = check_ratio(run.stats, "gradients", size, factor=factor)
        hooks = run.stats["hooks"]
        if stage == 3:
            assert hooks.get("zero3.grad_reduce.plain", 0) >= STEPS and "zero3.param_gather.unaligned" not in hooks
        else:
            assert hooks.get("zero12.grad_reduce", 0) >= STEPS, hooks
        if zero.get("zero_hpz_partition_size", 1) > 1:  # the backward gathers really used hpZ's secondary shards
            info["hpz_secondary_gathers"] = hooks.get("zero3.param_gather.hpz_secondary", 0)
            assert info["hpz_secondary_gathers"] > 0, f"hpZ on, but no gather of secondary shards: {hooks}"
        fd.uninstall()

    check.__name__ = f"zero{stage}_{dtype}" + "".join(f"_{k}" for k in zero)
    return check


def zero3_bf16_measure_mode(info):
    """mode "measure": DeepSpeed's own collectives, bytes counted, training bit-identical to the baseline."""
    baseline(T.ds_config(3, "bf16"))  # before any hooks are installed
    eng, _ = T.build(T.ds_config(3, "bf16", {"mode": "measure", "gemm": False}))
    run = T.train(eng, range(STEPS))
    assert run.losses == baseline(T.ds_config(3, "bf16")), "measure mode changed the numerics"
    assert run.stats["weights"]["calls"] > 0 and run.stats["weights"]["fp8_calls"] == 0, run.stats
    info["stats"] = run.stats
    T.destroy(eng)
    fd.uninstall()


def zero3_bf16_qgz(info):
    """ZeRO++ qgZ (int4, CUDA-only) replaced: LOCAL_SIZE=1 makes DeepSpeed see 2 nodes and take the qgZ path."""
    run = parity(info, 3, "bf16", env={"LOCAL_SIZE": "1"}, zero_quantized_gradients=True)
    info["ratio_g"] = check_ratio(run.stats, "gradients", 2)
    assert "replaces qgZ" in info["summary"], info["summary"]
    hooks = run.stats["hooks"]
    assert hooks.get("zero3.grad_reduce.qgz", 0) >= STEPS and "zero3.grad_reduce.plain" not in hooks, hooks
    fd.uninstall()


# ------------------------------------------------------------------------------------------- scenario: safety
EF_OPT_IN = {"error_feedback": True, "allow_unpartitioned_residuals": True}  # ZeRO-2/3: the memory accepted


def _masters(engine):
    opt = engine.optimizer
    return (
        opt.fp32_partitioned_groups_flat
        if engine.zero_optimization_stage() == 3
        else opt.single_partition_of_fp32_groups
    )


def _inf_run(cfg, inject_step: int, steps: int = 6):
    """Train `steps`, with rank 1's gradient of one weight element set to +inf at `inject_step`."""
    eng, model = T.build(cfg)
    w = model.h[0].mlp.c_fc.weight
    rank = dist.get_rank()
    state = {"step": -1}

    def hook(g):
        if state["step"] == inject_step and rank == 1:
            g = g.clone()
            g.view(-1)[7] = float("inf")
        return g

    w.register_hook(hook)
    changed, losses, norms = [], [], []
    es = fd.engine_state(eng)
    for step in range(steps):
        state["step"] = step
        before = T._digest(_masters(eng))
        x, y = T.batch(step, rank)
        _, loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        changed.append(T._digest(_masters(eng)) != before)
        losses.append(loss.item())
        if es is not None and es.residuals is not None:
            norms.append(es.residuals.norm())
    flags = torch.tensor([float(c) for c in changed])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # "changed" only if every rank's master moved
    out = {
        "skipped": int(eng.skipped_steps),
        "changed": [bool(f) for f in flags],
        "losses": losses,
        "residual_norms": norms,
    }
    T.destroy(eng)
    return out


def _inf(stage, dtype, ef: bool = False):
    """An inf at step 2 skips that step exactly as without fp8comm. With error feedback (ef): the skipped step
    zeroes every residual on every rank (its gradients are dropped, and their quantization error with them), and
    the next step builds them up again."""

    def check(info):
        base = _inf_run(T.ds_config(stage, dtype), 2)
        section = {"gemm": False, "gradients": {"error_feedback": True}} if ef else {"gemm": False}
        fp8 = _inf_run(T.ds_config(stage, dtype, section), 2)
        info.update(base=base, fp8=fp8)
        assert not base["changed"][2], f"DeepSpeed itself did not skip the step with an inf gradient: {base}"
        assert fp8["skipped"] == base["skipped"] and fp8["changed"] == base["changed"], (base, fp8)
        assert all(x == x and abs(x) != float("inf") for x in fp8["losses"]), fp8["losses"]
        if ef:
            norms = torch.tensor(fp8["residual_norms"])
            every = [torch.empty_like(norms) for _ in range(dist.get_world_size())]
            dist.all_gather(every, norms)
            for r, n in enumerate(every):
                assert n[2] == 0 and all(n[i] > 0 for i in (0, 1, 3, 4)), f"rank {r} residual norms per step: {n}"
        fd.uninstall()

    check.__name__ = f"inf_skip_zero{stage}_{dtype}" + ("_error_feedback" if ef else "")
    return check


def _checkpoint(stage, dtype, fp8, latest: bool = False):
    """save_checkpoint at step 4, load into a fresh engine (other initial weights): the resumed steps 4-8 equal the
    uninterrupted ones bit for bit. With error feedback the residuals (non-zero at the save) travel in a per-rank
    file next to DeepSpeed's; without them the resumed run would differ. latest: load with tag=None."""

    def check(info):
        cfg = T.ds_config(stage, dtype, fp8)
        ck = Path(os.environ["FP8COMM_TEST_OUT"]) / f"ckpt_{check.__name__}"
        eng, _ = T.build(cfg)
        T.train(eng, range(0, 4))
        es = fd.engine_state(eng)
        norm = es.residuals.norm() if es.residuals is not None else None
        eng.save_checkpoint(str(ck), tag="step4")
        cont = T.train(eng, range(4, 9))
        guard_steps = es.guard.steps if es.guard is not None else None
        T.destroy(eng)
        eng2, _ = T.build(cfg, seed=123)  # different initial weights: everything must come from the checkpoint
        eng2.load_checkpoint(str(ck), tag=None if latest else "step4")
        resumed = T.train(eng2, range(4, 9))
        info.update(continued=cont.losses, resumed=resumed.losses, stats=resumed.stats, residual_norm_at_save=norm)
        assert resumed.losses == cont.losses, "resumed training differs from uninterrupted training"
        assert resumed.stats["weights"]["fp8_calls"] > 0
        if norm is not None:
            assert norm > 0 and (ck / "step4" / f"fp8comm_rank{dist.get_rank():05d}.pt").exists()
            assert resumed.stats["hooks"].get("checkpoint.fp8comm_state_loaded") == 1, resumed.stats["hooks"]
        if fp8.get("weights", {}).get("update_fmt"):  # the replica itself came back, not bf16(master)
            assert resumed.stats["hooks"].get("checkpoint.replica_restored") == 1, resumed.stats["hooks"]
        if guard_steps is not None:  # the guard's clock and per-bucket state came back with the checkpoint
            assert fd.engine_state(eng2).guard.steps == guard_steps == 9, fd.engine_state(eng2).guard.steps
        T.destroy(eng2)
        fd.uninstall()

    ef = fp8.get("gradients", {}).get("error_feedback", False)
    check.__name__ = (
        f"checkpoint_zero{stage}_{dtype}"
        + ("_gemm" if fp8.get("gemm", False) else "")
        + (f"_error_feedback_{fp8['gradients'].get('residual_dtype', 'fp32')}" if ef else "")
        + ("_guard" if fp8.get("guard") else "")
        + ("_fp4" if fp8.get("weights", {}).get("update_fmt") else "")
    )
    return check


def _gemm(stage, **zero):
    def check(info):
        recipe = "blockwise"
        run = parity(info, stage, "bf16", {"gemm": {"enabled": True, "recipe": recipe}}, tol=TOL_GEMM, **zero)
        from fp8comm.gemm import Fp8Linear

        layers = [m for m in run.engine.module.modules() if isinstance(m, Fp8Linear)]
        assert layers, "no Fp8Linear after conversion"
        # Every optimizer step must re-quantize the (changed) weight: at least one quantization per step.
        q = min(m.weight_quantizations for m in layers)
        info.update(fp8_linears=len(layers), min_weight_quantizations=q)
        assert q >= STEPS, f"an Fp8Linear quantized its weight only {q} times in {STEPS} steps (stale cache)"
        fd.uninstall()

    check.__name__ = f"gemm_zero{stage}_bf16" + "".join(f"_{k}" for k in zero)
    return check


def _fp8_weight_census(layers, wshapes) -> tuple[int, int]:
    """(live FP8 copies of Fp8Linear weights anywhere in the process, Fp8Linear weights DeepSpeed holds gathered).

    Copies are found by a scan of every live object (caches, autograd contexts, anything): Fp8Tensors shaped like a
    weight or its transpose. The batch's token count is chosen so no activation has such a shape."""
    import gc

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from fp8comm.quant import Fp8Tensor

    gc.collect()
    with warnings.catch_warnings():  # isinstance() on every object touches deprecated torch module attributes
        warnings.simplefilter("ignore")
        copies = sum(1 for o in gc.get_objects() if isinstance(o, Fp8Tensor) and tuple(o.data.shape) in wshapes)
    gathered = sum(1 for m in layers if m.weight.ds_status == ZeroParamStatus.AVAILABLE)
    return copies, gathered


def _zero3_gemm_run(policy: str | None, steps: int = 3) -> dict:
    """ZeRO-3 + FP8 GEMMs with no reuse window, prefetch or resident parameters: DeepSpeed holds one layer
    gathered at a time. Census of FP8 weight copies after each forward, inside each layer's backward, after each
    step; policy None keeps what the integration chose, else every Fp8Linear is set to it."""
    from fp8comm.gemm import Fp8Linear

    zero = dict(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0, stage3_param_persistence_threshold=0)
    eng, _ = T.build(T.ds_config(3, "bf16", {"gemm": {"enabled": True, "recipe": "blockwise"}}, **zero))
    layers = [m for m in eng.module.modules() if isinstance(m, Fp8Linear)]
    chosen = {getattr(m, "weight_cache", "step") for m in layers}  # (fp8comm before 0.2 always cached)
    if policy is not None:
        from fp8comm.gemm import set_weight_cache

        set_weight_cache(eng.module, policy)
    wshapes = {tuple(m.weight.ds_shape) for m in layers}
    wshapes |= {s[::-1] for s in wshapes}
    bs = 5  # 5 x 32 = 160 tokens: no activation or gradient operand is shaped like a weight (64, 192, 256 dims)
    assert all(bs * T.BLOCK not in s for s in wshapes), wshapes
    samples = {"after_forward": [], "in_backward": [], "after_step": []}
    hooks = [
        m.register_full_backward_hook(lambda *_: samples["in_backward"].append(_fp8_weight_census(layers, wshapes)))
        for m in layers
    ]
    losses = []
    for step in range(steps):
        x, y = T.batch(step, dist.get_rank(), bs)
        _, loss = eng(x, y)
        samples["after_forward"].append(_fp8_weight_census(layers, wshapes))
        eng.backward(loss)
        eng.step()
        samples["after_step"].append(_fp8_weight_census(layers, wshapes))
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    out = {
        "losses": losses,
        "layers": len(layers),
        "chosen": sorted(chosen),
        "samples": samples,
        "worst": {k: max(c - 2 * g for c, g in v) for k, v in samples.items()},
    }
    T.destroy(eng)
    fd.uninstall()
    return out


def zero3_gemm_memory(info):
    """ZeRO-3's memory promise with FP8 GEMMs on: FP8 copies of a weight (W, and W^T for dgrad) live only while
    DeepSpeed holds that weight gathered, never for the whole model between forward and backward or across a step;
    and the loss is bit for bit what caching the FP8 weights gives."""
    lean = _zero3_gemm_run(None)
    info["samples"] = lean["samples"]
    assert all(v <= 0 for v in lean["worst"].values()), (
        f"FP8 weight copies beyond 2 per gathered layer (census (copies, gathered layers)): {lean['samples']}"
    )
    cached = _zero3_gemm_run("step")
    info.update(
        layers=lean["layers"],
        chosen=lean["chosen"],
        worst_excess=lean["worst"],
        cached_worst_excess=cached["worst"],
        losses=lean["losses"],
        cached_after_forward=cached["samples"]["after_forward"][-1],
    )
    assert all(v <= 0 for v in lean["worst"].values()), (
        f"FP8 weight copies beyond 2 per gathered layer: {lean['samples']}"
    )
    assert lean["chosen"] == ["gathered"], f"the integration left weight_cache at {lean['chosen']} under ZeRO-3"
    # the census can fail: caching keeps every layer's W and W^T alive after the forward
    assert cached["worst"]["after_forward"] > 0, cached["samples"]
    assert lean["losses"] == cached["losses"], (lean["losses"], cached["losses"])


# ---------------------------------------------------------------------------------------------- scenario: moe
_MOE_LOSSES: dict = {}  # losses of earlier MoE checks in this launch, by check name


def _moe(fp8_extra: dict, name: str, against: str | None = None):
    """deepspeed.moe EP=2 under ZeRO-2 bf16 with FP8 dispatch (+ the `fp8_extra` wires) vs no fp8comm; against: an
    earlier MoE check whose losses this one is also compared with (FP8 vs BF16 combine, everything else equal)."""

    def check(info):
        moe_cfg = {"gemm": False, "moe": fp8_extra}
        base = T.Run(losses=baseline(T.ds_config(2, "bf16"), model_fn=T.MoEModel))
        eng, _ = T.build(T.ds_config(2, "bf16", moe_cfg), model_fn=T.MoEModel)
        run = T.train(eng, range(STEPS))
        rel = T.rel_diff(run.losses, base.losses)
        info.update(rel=round(rel, 5), tol=TOL_COMM, stats=run.stats, summary=fd.summary())
        assert "MoE layers: 1" in fd.summary(), fd.summary()
        block = min(128, T.MOE_HIDDEN)  # one scale per token row of `hidden` channels when hidden < 128
        info["ratio_dispatch"] = check_ratio(run.stats, "moe.dispatch", 2, block)
        if fp8_extra.get("combine") == "fp8":
            info["ratio_combine"] = check_ratio(run.stats, "moe.combine", 2, block)
        else:  # DeepSpeed's own all-to-all, counted
            assert run.stats["moe.combine"]["fp8_calls"] == 0 and run.stats["moe.combine"]["calls"] > 0
        if fp8_extra.get("grad") == "fp8":
            info["ratio_backward"] = check_ratio(run.stats, "moe.backward", 2, block)
        assert run.losses != base.losses
        assert sum(run.losses[-10:]) < sum(run.losses[:10]), run.losses
        assert rel <= TOL_COMM, f"MoE loss differs by {rel:.4f}"
        _MOE_LOSSES[name] = run.losses
        if against in _MOE_LOSSES:
            info[f"rel_vs_{against}"] = d = T.rel_diff(run.losses, _MOE_LOSSES[against])
            assert run.losses != _MOE_LOSSES[against] and d <= TOL_COMM, (d, run.losses, _MOE_LOSSES[against])
        T.destroy(eng)
        fd.uninstall()

    check.__name__ = name
    return check


SCENARIOS = {
    "levels": LEVELS,  # 4 ranks as 2 simulated nodes x 2 (test_deepspeed_levels.py)
    "planner": PLANNER,  # 4 ranks as 2 simulated nodes x 2 (test_deepspeed_planner.py)
    "zero": [
        zero3_bf16_flag,
        zero2_bf16_fp32_accumulation,
        zero1_bf16_fp32_accumulation,
        engines_per_scope,
        _zero(2, "bf16", 2, reduce_bucket_size=SMALL_BUCKET),
        _zero(1, "bf16", 2),
        _zero(3, "fp32", 1),
        _zero(2, "fp32", 2),
        _zero(1, "fp32", 2),
        zero1_fp32_error_feedback,
        _zero(3, "bf16", 1, zero_hpz_partition_size=2),
        zero3_bf16_measure_mode,
        zero3_bf16_qgz,
        _gemm(3),
        _gemm(2, reduce_bucket_size=SMALL_BUCKET),
        zero2_bf16_fp4,
        zero2_bf16_fp4_small_buckets,
        zero1_bf16_nvfp4_hadamard,
        zero3_bf16_fp4_gradients,
    ],
    "safety": [
        _inf(2, "bf16"),
        _inf(3, "bf16"),
        _inf(1, "fp32", ef=True),
        _checkpoint(3, "bf16", {"gemm": False, "gradients": {**EF_OPT_IN, "residual_dtype": "bf16"}}),
        _checkpoint(3, "bf16", {"gemm": False, "gradients": {**EF_OPT_IN, "residual_dtype": "fp8"}}),
        checkpoint_fp32_residuals_into_fp8,
        _checkpoint(
            2,
            "bf16",
            {"gemm": {"enabled": True, "recipe": "blockwise"}, "gradients": EF_OPT_IN, "guard": True},
            latest=True,
        ),
        _checkpoint(2, "bf16", {"gemm": False, "gradients": {"fmt": "mxfp4"}, "weights": {"update_fmt": "mxfp4"}}),
        guard_fallback,
        zero3_gemm_memory,
        *UPDATES,  # overlapped 4-bit weight updates (ds_checks_updates.py)
    ],
    "moe": [
        moe_ep2_one_step,
        _moe({}, "moe_ep2_dispatch_fp8"),  # combine: DeepSpeed's own all-to-all in bf16
        _moe({"combine": "fp8"}, "moe_ep2_combine_fp8", against="moe_ep2_dispatch_fp8"),
        _moe({"combine": "fp8", "grad": "fp8"}, "moe_ep2_all_fp8"),
        moe_guard_fallback,
    ],
}


def main() -> int:
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[3] else None
    os.environ["FP8COMM_TEST_OUT"] = str(outdir)
    mutation = apply_from_env()  # ds_mutations.py: a deliberately broken variant its checks must catch
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    out = open(outdir / f"rank{rank}.jsonl", "w", buffering=1)
    status = dist.new_group(backend="gloo")
    plan = [fn for fn in SCENARIOS[scenario] if not only or fn.__name__ in only]
    out.write(json.dumps({"plan": [fn.__name__ for fn in plan], "mutation": mutation}) + "\n")
    for fn in plan:
        out.write(json.dumps({"check": fn.__name__, "state": "started"}) + "\n")
        info, t0 = {}, time.perf_counter()
        try:
            fn(info)
            rec = {"ok": True}
        except BaseException as e:
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
            fd.uninstall()
        rec.update(check=fn.__name__, state="done", seconds=round(time.perf_counter() - t0, 2), info=info)
        out.write(json.dumps(rec, default=str) + "\n")
        flag = torch.tensor([0 if rec["ok"] else 1])
        dist.all_reduce(flag, group=status)
        if int(flag):
            out.write(json.dumps({"check": "*", "state": "stopped", "after": fn.__name__}) + "\n")
            break
    dist.barrier(group=status)
    out.close()
    del status
    fd.shutdown()  # DeepSpeed's and fp8comm's references to the groups go first: else their gloo threads outlive
    dist.destroy_process_group()  # them, and interpreter teardown meets running threads (an abort, at random)
    return 0


if __name__ == "__main__":
    sys.exit(main())
