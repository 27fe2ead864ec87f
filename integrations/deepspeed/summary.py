"""The adapter's one-line summary of an engine: each traffic kind's wire and format, GEMMs, guard, planner, levels."""

from __future__ import annotations

import torch.distributed as dist

from fp8comm.comm import default_check_policy

from . import levels
from .config import Fp8CommDeepSpeedConfig


def describe(cfg: Fp8CommDeepSpeedConfig, version: str, combo: dict, model, conversion) -> str:
    """The one-line summary: each traffic kind's wire (FP8 and its format, or native: DeepSpeed's own), and
    whether FP8 GEMMs are on (with the recipe)."""
    world = dist.get_world_size() if dist.is_initialized() else "?"
    head = f"fp8comm: DeepSpeed {version}, ZeRO-{combo['stage']} {combo['dtype']}, {world} ranks"
    gemm = describe_gemm(cfg, conversion)
    if cfg.measure_only:
        return head + ": MEASURE mode - DeepSpeed's own collectives run unchanged, fp8comm only counts bytes; " + gemm
    parts = []
    upd = cfg.weights.update_wire(None)
    if cfg.planner is not None:
        how = "reduce-scatter" if combo["stage"] == 3 else "reduce to owners"
        four = f", 4-bit ({cfg.gradients.describe()})" if cfg.planner.allow_4bit else ""
        parts.append(
            f"weight all-gather and gradient {how} PLANNED per bucket-size class: DeepSpeed's own, FP8 "
            f"({cfg.weights.describe()}){four}, flat or two-level"
        )
    elif cfg.weights.enabled and upd is not None:
        parts.append(f"weight all-gather as 4-bit changes of the replica ({upd.describe()})")
    elif cfg.weights.enabled:
        parts.append(f"weight all-gather FP8 ({cfg.weights.describe()}{', hpZ' if combo['hpz'] > 1 else ''})")
    else:
        parts.append("weight all-gather native (DeepSpeed's own)")
    how = "reduce-scatter" if combo["stage"] == 3 else "reduce to owners"
    if cfg.planner is not None:
        pass
    elif cfg.gradients.enabled:
        bits = "4-bit" if cfg.gradients.is_fp4 else "FP8"
        # ZeRO-1/2: every owned slice, on both paths (reduce-scatter, all-to-all); which buckets took which path
        # (and any guard fallback or slice several ranks consume) is logged per bucket layout at the backward
        where = "" if combo["stage"] == 3 else ", every bucket; layout logged at the first backward"
        qgz = ", replaces qgZ" if combo["qgz"] else ""
        parts.append(f"gradient {how} {bits} ({cfg.gradients.describe()}{qgz}{where})")
    else:
        parts.append(f"gradient {how} native (DeepSpeed's own)")
    if cfg.moe.enabled:
        n = sum(type(m).__name__ == "MOELayer" for m in model.modules()) if model is not None else "?"
        parts.append(f"MoE dispatch FP8 (MoE layers: {n}; combine {cfg.moe.combine}, backward {cfg.moe.grad})")
    else:
        parts.append("MoE all-to-all native (DeepSpeed's own)")
    parts.append(gemm)
    if cfg.guard.enabled:
        g = cfg.guard
        parts.append(
            f"guard on (BF16 for {g.cooldown} steps after {g.patience} steps over {g.threshold:.2%} "
            "saturated or underflowed)"
        )
    if cfg.check is None:
        check = {
            "first": "on the first calls per group",
            "always": "on every call (FP8COMM_CHECK=always)",
            "never": "off (FP8COMM_CHECK=never)",
        }[default_check_policy()]
    else:
        check = "on every call" if cfg.check else "off"
    if cfg.planner is not None:
        p = cfg.planner
        bits = "4-bit gradients allowed: mxfp4 with error feedback" if p.allow_4bit else "FP8 at most"
        cal = f"from {p.calibration}" if p.calibration else "measured at build"
        parts.append(
            f"planner on ({bits}; calibration {cal}; per bucket-size class the plan lines below, at its first "
            "collective, say which wire)"
        )
    if cfg.weights.enabled or cfg.gradients.enabled:
        hier = (
            "hierarchical on (two levels per group where it spans nodes, see the lines below; " + levels.FLAT_NOTE + ")"
            if cfg.hierarchical
            else "hierarchical off (flat)"
        )
        parts.append(hier)
    return head + ": " + "; ".join(parts) + f"; metadata check {check}"


def describe_gemm(cfg: Fp8CommDeepSpeedConfig, conversion) -> str:
    if not cfg.gemm.enabled:
        return "FP8 GEMMs off"
    if conversion is None:
        return f"GEMMs FP8 {cfg.gemm.recipe} (no model given: nothing converted)"
    return f"GEMMs FP8 {conversion.recipe} ({len(conversion.converted)} linears)"
