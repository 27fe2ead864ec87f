"""Shared by the DeepSpeed check modules: tolerances, cached baselines, the exact step-0 gradient check, parity runs.

Imported by ds_worker.py after cpu.prepare() (the CPU accelerator is chosen before deepspeed is imported).
"""

from __future__ import annotations

import json
import math
import os

import ds_train as T
import torch
import torch.distributed as dist

import fp8comm.comm as fc
import fp8comm.integrations.deepspeed as fd

STEPS = 30
# Loss parity: |mean of the last 10 step losses, FP8 vs baseline| / baseline. Stated in docs/deepspeed.md; the
# measured values are reported by every check (info["rel"]). Trajectories drift apart chaotically at the 0.1-1%
# level from any perturbation (even DeepSpeed's own state from earlier engines in the process moves the baseline
# by ~0.3%), so the exact check of the reduction itself is grad_check below, not this.
TOL_COMM = 0.02
SMALL_BUCKET = 20000  # elements: several ZeRO-1/2 reduce buckets per step (the tiny GPT has ~110k parameters)
TOL_GEMM = 0.02
# Per-tensor relative error of a reduced step-0 gradient: 2 x the unit roundoff of e4m3 (3 mantissa bits: 2^-4),
# room for FP8 gradients plus FP8-gathered weights in the forward (ZeRO-3) on top of bf16.
GRAD_BOUND = 2 * 2.0**-4


def expected_ratio(itemsize: int, block: int, algorithm_factor: int = 1) -> float:
    """Bytes saved by FP8 + one fp32 scale per block, vs `itemsize` bytes per element (x2 where DeepSpeed
    all-reduces what fp8comm reduce-scatters)."""
    return algorithm_factor * itemsize / (1 + 4 / block)


_BASELINES: dict = {}  # baseline losses per DeepSpeed config: several checks compare against the same run


def baseline(cfg: dict, steps: int = STEPS, model_fn=T.tiny_gpt) -> list:
    key = json.dumps([cfg, steps, model_fn.__name__], sort_keys=True)
    if key not in _BASELINES:
        eng, _ = T.build(cfg, model_fn=model_fn)
        _BASELINES[key] = T.train(eng, range(steps)).losses
        T.destroy(eng)
    return _BASELINES[key]


_REFERENCE: dict = {}


def reference_grads() -> dict:
    """Exact step-0 gradients: a plain fp32 copy of the model, each rank's batch, averaged over ranks."""
    if not _REFERENCE:
        torch.manual_seed(0)
        model = T.tiny_gpt()
        _, loss = model(*T.batch(0, dist.get_rank()))
        loss.backward()
        for n, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            _REFERENCE[n] = (g / dist.get_world_size(), p.grad.clone())
    return _REFERENCE


def grad_check(engine, info: dict, bound: float = GRAD_BOUND) -> None:
    """Reduced step-0 gradients vs the exact average. A reduction that lost other ranks' contributions would
    look like this rank's own gradient: its error is computed too and must be far outside the bound."""
    from deepspeed.utils import safe_get_full_grad

    ref = reference_grads()
    errs, local = [], []
    for n, p in engine.module.named_parameters():
        g = safe_get_full_grad(p).float()  # collective under ZeRO-3: every rank, same order
        avg, own = ref[n]
        errs.append(((g - avg).norm() / avg.norm()).item())
        local.append(((own - avg).norm() / avg.norm()).item())
    info["grad_rel_err_max"], info["local_grad_rel_err_median"] = max(errs), sorted(local)[len(local) // 2]
    assert max(errs) <= bound, f"reduced gradient off by {max(errs):.3f} > {bound} (relative)"
    assert info["local_grad_rel_err_median"] > 2 * bound, "the gradient check could not tell a missing reduction apart"


def parity(
    info: dict,
    stage: int,
    dtype: str,
    fp8: dict | None = None,
    tol: float = TOL_COMM,
    init=None,
    env: dict | None = None,
    on_step=None,
    grad_bound: float = GRAD_BOUND,
    **zero,
) -> T.Run:
    """STEPS steps of `fp8` against the same config without fp8comm: step-0 gradient check, loss, bytes, replicas.
    on_step(engine, step) runs after each backward (before the step)."""
    # qgZ cannot run on CPU without fp8comm (int4 CUDA kernels): its baseline is the plain reduce-scatter.
    base = T.Run(
        losses=baseline(T.ds_config(stage, dtype, **{k: v for k, v in zero.items() if k != "zero_quantized_gradients"}))
    )
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    fc.reset_comm_stats()
    try:
        eng, _ = T.build(T.ds_config(stage, dtype, fp8 if fp8 is not None else {"gemm": False}, **zero), init=init)

        def each(step):
            if step == 0:
                grad_check(eng, info, grad_bound)
            if on_step is not None:
                on_step(eng, step)

        run = T.train(eng, range(STEPS), on_step=each)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    comm = fc.comm_stats()  # the collectives' own counters, independent of the integration's accounting
    digests = T.rank_digests(T.full_params_digest(eng))
    rel = T.rel_diff(run.losses, base.losses)
    info["comm_stats"] = {op: round(v["ratio"], 3) for op, v in comm.items() if v["wire_bytes"]}
    moved = [op for op in ("all_gather", "reduce_scatter", "all_to_all") if comm.get(op, {}).get("wire_bytes")]
    assert len(moved) >= 2, f"fp8comm.comm_stats() shows no FP8 weight + gradient traffic: {comm}"
    info.update(
        stage=stage,
        dtype=dtype,
        rel=round(rel, 5),
        tol=tol,
        base_final=round(base.losses[-1], 4),
        fp8_final=round(run.losses[-1], 4),
        stats=run.stats,
        summary=fd.summary(),
    )
    assert len(set(digests)) == 1, f"parameters differ across ranks: {digests}"
    assert run.losses != base.losses, "FP8 run is bit-identical to the baseline: the hooks changed nothing"
    for r in (base, run):  # both actually trained
        assert sum(r.losses[-10:]) / 10 < sum(r.losses[:5]) / 5, r.losses
    assert rel <= tol, (
        f"loss mean over the last 10 steps differs by {rel:.4f} > {tol} ({run.losses[-10:]} vs {base.losses[-10:]})"
    )
    T.destroy(eng)
    return run


def check_ratio(stats: dict, role: str, itemsize: int, block: int = 128, factor: int = 1) -> float:
    s = stats[role]
    assert s["fp8_calls"] > 0 and s["wire_bytes"] > 0, f"no FP8 {role} traffic: {s}"
    want = expected_ratio(itemsize, block, factor)
    # Slack for the 16-byte alignment of each chunk's scales and for padding rows (small buckets).
    assert s["ratio"] >= 0.9 * want, f"{role}: bytes ratio {s['ratio']:.3f} < 0.9 x {want:.3f}"
    return s["ratio"]


SQNR: dict = {}  # GradSqnr of earlier checks in the same launch, by name
SQNR_STEPS = 12  # the checks measure the first 12 steps (the measurement script: all)


class GradSqnr:
    """SQNR (dB) of the engine's reduced gradients against the exact fp32 average of every rank's gradient, per
    step and for their running sums over the steps (error feedback's promise: the sum's error stays bounded).

    The exact gradients come from a plain fp32 replica loaded with the weights the engine's forward used (ZeRO-1/2:
    engine.module), run on the same batch. Call as on_step(engine, step) after the backward, before the step."""

    def __init__(self, steps: int | None = None) -> None:
        self.steps = steps  # measure the first `steps` steps only (None: all)
        self.shadow = T.tiny_gpt()
        self.step_db: list[float] = []
        self.sum_db: list[float] = []
        self._sums: dict = {}

    def __call__(self, engine, step: int) -> None:
        from deepspeed.utils import safe_get_full_grad

        if self.steps is not None and step >= self.steps:
            return
        world = dist.get_world_size()
        self.shadow.load_state_dict({n: p.detach().float() for n, p in engine.module.named_parameters()}, strict=False)
        self.shadow.zero_grad()
        _, loss = self.shadow(*T.batch(step, dist.get_rank()))
        loss.backward()
        mine = dict(self.shadow.named_parameters())
        sig = err = asig = aerr = 0.0
        for n, p in engine.module.named_parameters():
            exact = mine[n].grad.clone()
            dist.all_reduce(exact)
            exact /= world
            got = safe_get_full_grad(p).float()  # collective: every rank, same order
            se, sg = self._sums.get(n, (0.0, 0.0))
            se, sg = se + exact, sg + got
            self._sums[n] = (se, sg)
            sig += float(exact.square().sum())
            err += float((got - exact).square().sum())
            asig += float(se.square().sum())
            aerr += float((sg - se).square().sum())
        self.step_db.append(10 * math.log10(sig / err) if err else math.inf)  # inf: the exact reduction itself
        self.sum_db.append(10 * math.log10(asig / aerr) if aerr else math.inf)
