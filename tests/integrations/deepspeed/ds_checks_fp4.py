"""4-bit checks (scenario "zero"): ZeRO-1/2 gradients and weight updates in MXFP4/NVFP4, ZeRO-3 gradients in MXFP4.

Each is a 30-step parity run against DeepSpeed without fp8comm (loss within TOL_COMM, parameters bit-identical
across ranks, step-0 gradient within FP4_GRAD_BOUND of the exact average) plus: the replica's distance from the
fp32 master every step (bounded, not growing), and the wire bytes of gradients and weight updates vs bf16.
Imported by ds_worker.py after cpu.prepare().
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ds_common import STEPS, parity

import fp8comm.integrations.deepspeed as fd

# Step-0 reduced gradient, per-tensor relative error: one 4-bit contribution alone is ~11.5% (MXFP4, Gaussian data;
# NVFP4 ~10%), the sum of two independent ones about the same. A reduction that dropped the other rank is ~38% off,
# outside 2x this bound (grad_check asserts it can tell).
FP4_GRAD_BOUND = 0.17
# Replica vs fp32 master (this rank's slice, relative L2): the owner's last 4-bit change error plus bf16 rounding.
DRIFT_BOUND = 0.01
MIN_RATIO = 3.5  # issue 23: >= 3.5x fewer bytes than bf16 for gradients and weight updates


class ReplicaDrift:
    """on_step(engine, step) after each backward: relative L2 distance of this rank's replica slice (what forward
    used) from its fp32 master partition, the same for bf16(master) (the floor any bf16 replica has), and the
    bytes of the last weight-update gather."""

    def __init__(self) -> None:
        self.rel: list[float] = []
        self.bf16_floor: list[float] = []
        self.update_bytes: list[tuple[int, int]] = []

    def __call__(self, engine, step: int) -> None:
        opt = engine.optimizer
        num = den = floor = 0.0
        for g, parts in enumerate(opt.parallel_partitioned_bit16_groups):
            me = dist.get_rank(group=opt.real_dp_process_group[g])
            m = opt.single_partition_of_fp32_groups[g].detach()
            num += float((parts[me].detach().float() - m).square().sum())
            floor += float((m.bfloat16().float() - m).square().sum())
            den += float(m.square().sum())
        self.rel.append((num / den) ** 0.5)
        # fail at the step it happens (before the loss comparison at the end): the replica left the master
        assert self.rel[-1] <= DRIFT_BOUND, f"step {step}: replica drifted {self.rel[-1]:.4f} from the fp32 master"
        self.bf16_floor.append((floor / den) ** 0.5)
        es = fd.engine_state(engine)
        self.update_bytes.append(tuple(map(sum, zip(*[(u.last_wire_bytes, u.last_dtype_bytes) for u in es.updates]))))


def _fp4(stage: int, section: dict, name: str):
    def check(info):
        upd = section.get("weights", {}).get("update_fmt")
        drift = ReplicaDrift() if upd else None
        run = parity(info, stage, "bf16", {"gemm": False, **section}, on_step=drift, grad_bound=FP4_GRAD_BOUND)
        stats, hooks = run.stats, run.stats["hooks"]
        g = stats["gradients"]
        # vs a bf16 reduce-scatter of the same buckets (DeepSpeed's ZeRO-1/2 all-reduce, the recorded baseline,
        # moves twice that)
        info["ratio_g"] = g["dtype_bytes"] / (2 if stage < 3 else 1) / g["wire_bytes"]
        assert info["ratio_g"] >= MIN_RATIO, f"4-bit gradients: only {info['ratio_g']:.2f}x fewer bytes than bf16"
        bits = "4-bit" if stage < 3 else "4-bit (mxfp4"
        assert bits in info["summary"], info["summary"]
        if stage < 3:
            assert hooks.get("zero12.grad_reduce.reduce_scatter", 0) >= STEPS, hooks
        if drift is not None:
            # the first gather sends bf16 values (replicas start equal), every later one 4-bit changes
            assert hooks.get("zero12.param_update.full") == 1, hooks
            assert hooks.get("zero12.param_update.change") == STEPS - 1, hooks
            wire, dtype = drift.update_bytes[-1]
            info["ratio_w"] = dtype / wire
            assert info["ratio_w"] >= MIN_RATIO, f"4-bit weight updates: only {info['ratio_w']:.2f}x fewer bytes"
            rel = torch.tensor(drift.rel[1:])  # step 0 runs on the initial weights (no update yet)
            info.update(
                drift_max=float(rel.max()),
                drift_first5=float(rel[:5].mean()),
                drift_last5=float(rel[-5:].mean()),
                bf16_floor=float(torch.tensor(drift.bf16_floor[1:]).mean()),
            )
            assert info["drift_max"] <= DRIFT_BOUND, f"replica drifted {info['drift_max']:.4f} from the fp32 master"
            # the owner's error is re-sent with the next change: drift stays at one step's size, never accumulates
            assert info["drift_last5"] <= 3 * info["drift_first5"], (drift.rel, "replica drift grows with steps")
        fd.uninstall()

    check.__name__ = name
    return check


def zero2_bf16_fp4_small_buckets(info):
    """4-bit gradients with small reduce buckets (mostly one owner each: the all-to-all to the owners, after
    coalescing): every gradient collective carries mxfp4 (none FP8 in its place, as up to this change), >= 3.5x
    fewer bytes than bf16, the parity checks; rank 0 logs the bucket layout once, naming mxfp4 and no other format,
    and hook_stats keeps that line."""
    import logging

    from ds_common import SMALL_BUCKET

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record) -> None:
            lines.append(record.getMessage())

    log, h = logging.getLogger("fp8comm.deepspeed"), Lines(logging.INFO)
    level = log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        sec = {"gemm": False, "gradients": {"fmt": "mxfp4"}}
        run = parity(info, 2, "bf16", sec, grad_bound=FP4_GRAD_BOUND, reduce_bucket_size=SMALL_BUCKET)
    finally:
        log.removeHandler(h)
        log.setLevel(level)
    stats, hooks = run.stats, run.stats["hooks"]
    g = stats["gradients"]
    info["ratio_g"] = g["dtype_bytes"] / 2 / g["wire_bytes"]  # vs a bf16 reduce-scatter of the same buckets
    a2a, rs = hooks.get("zero12.grad_reduce.all_to_all", 0), hooks.get("zero12.grad_reduce.reduce_scatter", 0)
    info.update(hooks=hooks, layouts=stats.get("grad_layouts"))
    assert a2a >= STEPS, f"small buckets should take the all-to-all to the owners: {hooks}"
    assert hooks.get("zero12.grad_reduce.fmt.mxfp4") == a2a + rs and "zero12.grad_reduce.fmt.e4m3" not in hooks, hooks
    assert info["ratio_g"] >= MIN_RATIO, f"4-bit gradients: only {info['ratio_g']:.2f}x fewer bytes than bf16"
    layouts = [ln for ln in lines if "gradient bucket layout" in ln]
    if dist.get_rank() == 0:
        assert layouts and len(layouts) == len(set(layouts)) <= 2, lines  # once per layout (the first step differs)
        assert all("mxfp4" in ln and "e4m3" not in ln for ln in layouts), layouts
    else:
        assert not layouts, layouts
    assert stats.get("grad_layouts") and all("mxfp4" in ln for ln in stats["grad_layouts"]), stats
    assert "gradient reduce to owners 4-bit (mxfp4" in info["summary"], info["summary"]
    fd.uninstall()


# ZeRO-2: the recipe docs/collectives.md recommends for 4-bit gradients (mxfp4 + error feedback, nearest), with the
# residual memory accepted (ZeRO-2 keeps a residual of the whole gradient, see docs/deepspeed.md "Error feedback")
EF = {"error_feedback": True, "allow_unpartitioned_residuals": True}
zero2_bf16_fp4 = _fp4(2, {"gradients": {"fmt": "mxfp4", **EF}, "weights": {"update_fmt": "mxfp4"}}, "zero2_bf16_fp4")
zero1_bf16_nvfp4_hadamard = _fp4(
    1, {"gradients": {"fmt": "nvfp4", "hadamard": 16}, "weights": {"update_fmt": "nvfp4"}}, "zero1_bf16_nvfp4_hadamard"
)
zero3_bf16_fp4_gradients = _fp4(3, {"gradients": {"fmt": "mxfp4"}}, "zero3_bf16_fp4_gradients")
