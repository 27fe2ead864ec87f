"""Numerics guard through DeepSpeed (scenario "safety"): a bucket that stops fitting FP8 falls back to BF16.

Imported by ds_worker.py after cpu.prepare().
"""

from __future__ import annotations

import logging

import ds_train as T
import torch
import torch.distributed as dist
from ds_common import SMALL_BUCKET, TOL_COMM, baseline

import fp8comm.comm as fc
import fp8comm.integrations.deepspeed as fd
from fp8comm.quant import Scaling

STEPS = 16
FORCED = range(3, 11)  # steps whose FP8 gradients get a scale 2^20 too large: nearly every element underflows
GUARD = {"enabled": True, "threshold": 1e-3, "patience": 2, "cooldown": 5}


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _run(guard: bool, force: bool) -> dict:
    """STEPS steps of ZeRO-2 bf16 with FP8 weights and gradients; force: the gradient hook's config gets
    Scaling(1, 128, "fp32", margin=20) on FORCED steps (by wrapping fp8comm.comm.all_to_all and reduce_scatter_into,
    the hook's two gradient paths: small buckets coalesce into either)."""
    section = {"gemm": False, **({"guard": GUARD} if guard else {})}
    eng, _ = T.build(T.ds_config(2, "bf16", section, reduce_bucket_size=SMALL_BUCKET))
    es = fd.engine_state(eng)
    orig, orig_rs, step_now = fc.all_to_all, fc.reduce_scatter_into, [-1]
    bad = Scaling(1, 128, "fp32", margin=20)

    def forced(k):
        if force and k.get("config") is not None and k.get("wire", "fp8") == "fp8" and step_now[0] in FORCED:
            k["config"] = k["config"].replace(scaling=bad)
        return k

    def all_to_all(*a, **k):
        return orig(*a, **forced(k))

    def reduce_scatter_into(*a, **k):
        return orig_rs(*a, **forced(k))

    log, logger = _Log(), logging.getLogger("fp8comm.guard")
    logger.addHandler(log)
    fc.reset_comm_stats()
    wires, losses = [], []
    fc.all_to_all, fc.reduce_scatter_into = all_to_all, reduce_scatter_into
    try:
        for step in range(STEPS):
            step_now[0] = step
            if guard:
                wires.append((es.guard.wire("weights"), es.guard.wire("gradients")))
            losses += T.train(eng, range(step, step + 1)).losses
    finally:
        fc.all_to_all, fc.reduce_scatter_into = orig, orig_rs
        logger.removeHandler(log)
    out = {"losses": losses, "wires": wires, "log": log.lines, "comm": fc.comm_stats(), "stats": fd.hook_stats(eng)}
    T.destroy(eng)
    fd.uninstall()
    return out


def _deviation(losses: list, base: list, last: int | None = None) -> float:
    """Mean relative loss deviation from the baseline over the steps from the first forced one (or the last ones)."""
    pairs = list(zip(losses, base))[FORCED[0] :] if last is None else list(zip(losses, base))[-last:]
    return sum(abs(a - b) / b for a, b in pairs) / len(pairs)


def guard_fallback(info):
    """The "gradients" bucket stops fitting FP8 (forced, FORCED steps): it falls back to BF16 on every rank at the
    same step, "weights" stays FP8, the switch is counted in comm_stats ("guard.to_bf16") and logged once, on rank
    0; the loss stays closer to the run without fp8comm than the same forced run without the guard does; with
    healthy data the guard never switches."""
    base = baseline(T.ds_config(2, "bf16", reduce_bucket_size=SMALL_BUCKET), steps=STEPS)
    guarded = _run(guard=True, force=True)
    unguarded = _run(guard=False, force=True)
    healthy = _run(guard=True, force=False)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, guarded["wires"])
    bf16_steps = [i for i, (_, g) in enumerate(guarded["wires"]) if g == "bf16"]
    dev_g, dev_u = _deviation(guarded["losses"], base), _deviation(unguarded["losses"], base)
    info.update(losses_guard=guarded["losses"], losses_no_guard=unguarded["losses"], losses_base=base)
    info.update(
        bf16_steps=bf16_steps,
        deviation_guard=dev_g,
        deviation_no_guard=dev_u,
        deviation_guard_last3=_deviation(guarded["losses"], base, 3),
        deviation_no_guard_last3=_deviation(unguarded["losses"], base, 3),
        deviation_healthy=_deviation(healthy["losses"], base),
        log=guarded["log"],
        to_bf16=guarded["comm"].get("guard.to_bf16"),
        guard=guarded["stats"]["guard"],
        hooks=guarded["stats"]["hooks"],
    )
    assert all(w == every[0] for w in every), f"ranks decided differently: {every}"
    assert bf16_steps and bf16_steps[0] > FORCED[0] and all(w == "fp8" for w, _ in guarded["wires"]), guarded["wires"]
    assert (
        guarded["stats"]["guard"]["gradients"]["switches"] >= 1
        and guarded["stats"]["guard"]["weights"]["switches"] == 0
    ), guarded["stats"]["guard"]
    assert guarded["stats"]["hooks"].get("guard.gradients.bf16", 0) >= 1, guarded["stats"]["hooks"]
    g = guarded["stats"]["gradients"]
    assert 0 < g["fp8_calls"] < g["calls"], g  # the BF16 steps ran DeepSpeed's own reduction, counted
    assert guarded["comm"].get("guard.to_bf16", {}).get("calls", 0) >= 1, guarded["comm"]
    logged = [x for x in guarded["log"] if "gradients -> BF16" in x]
    assert len(logged) == (1 if dist.get_rank() == 0 else 0), guarded["log"]
    # the forced steps before the switch (patience + one step of lag) cost what they cost; from then on BF16
    assert dev_g < 0.7 * dev_u and info["deviation_guard_last3"] <= TOL_COMM, info
    assert all(s["switches"] == 0 for s in healthy["stats"]["guard"].values()), healthy["stats"]["guard"]
    assert not [k for k in healthy["stats"]["hooks"] if k.startswith("guard.")], healthy["stats"]["hooks"]
    assert torch.isfinite(torch.tensor(guarded["losses"])).all()


def moe_guard_fallback(info):
    """The MoE layer's bucket ("moe.0", deepspeed.moe EP=2, FP8 dispatch, combine and grad wire): its tokens stop
    fitting FP8 from step 3 on (forced): the layer falls back to DeepSpeed's own all-to-all on every rank at the
    same step (both directions), the weights and gradients buckets stay FP8, and training goes on."""
    section = {"gemm": False, "moe": {"combine": "fp8", "grad": "fp8"}, "guard": GUARD}
    eng, _ = T.build(T.ds_config(2, "bf16", section), model_fn=T.MoEModel)
    es = fd.engine_state(eng)
    orig, step_now, forced = fc.all_to_all, [-1], [0]
    bad = Scaling(1, 128, "fp32", margin=20)

    def all_to_all(*a, **k):
        g = k.get("guard")
        if g is not None and g.key == "moe.0" and step_now[0] >= 3:
            k["config"] = k["config"].replace(scaling=bad)
            forced[0] += 1
        return orig(*a, **k)

    fc.all_to_all, wires, losses = all_to_all, [], []
    try:
        for step in range(STEPS):
            step_now[0] = step
            wires.append(es.guard.wire("moe.0"))
            losses += T.train(eng, range(step, step + 1)).losses
    finally:
        fc.all_to_all = orig
    stats = fd.hook_stats(eng)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, wires)
    info.update(wires=wires, forced=forced[0], guard=stats["guard"], moe=stats["moe.dispatch"], losses=losses)
    assert all(w == wires for w in every), f"ranks decided differently: {every}"
    assert "bf16" in wires and wires.index("bf16") > 3, wires  # patience 2 + one step of lag after step 3
    assert stats["guard"]["moe.0"]["switches"] >= 1, stats["guard"]
    assert all(stats["guard"][k]["switches"] == 0 for k in ("weights", "gradients")), stats["guard"]
    assert stats["hooks"].get("guard.moe.0.bf16", 0) >= 1, stats["hooks"]
    d = stats["moe.dispatch"]
    assert 0 < d["fp8_calls"] < d["calls"], d  # the BF16 steps ran DeepSpeed's own all-to-all, counted
    assert torch.isfinite(torch.tensor(losses)).all() and sum(losses[-3:]) < sum(losses[:3]), losses
    T.destroy(eng)
    fd.uninstall()
