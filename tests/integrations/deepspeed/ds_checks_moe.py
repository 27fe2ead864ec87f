"""MoE one-step checks (scenario "moe"): each MoE wire's own error in one forward/backward from identical weights.

Imported by ds_worker.py after cpu.prepare(). The 30-step runs of ds_worker.py show the loss trajectory; this
isolates what each wire changes (as tests/integrations/megatron/mcore_checks_moe.py does for Megatron): the loss
and every parameter's reduced gradient of one step, FP8 wire against the same run with the native wire.
"""

from __future__ import annotations

import math

import ds_train as T
import torch
import torch.distributed as dist

import fp8comm.integrations.deepspeed as fd

# Bounds from the measured values (2026-12-01, 2 gloo ranks, the tiny MoE of ds_train with 64 channels, ZeRO-2 bf16,
# step 0's batch): loss 1.3e-5 (FP8 dispatch) and 2.6e-5 (FP8 combine, with or without the FP8 backward) relative;
# per-parameter gradient SQNR min / median 31.5 / 46.2 dB (dispatch), 32.5 / 48.6 dB (combine), 32.5 / 42.2 dB
# (combine + backward). e4m3 rounding alone leaves 29-35 dB per element (RMS error ulp / sqrt(12), the ulp 1/16 to
# 1/8 of the value); the bounds allow ~4x on the loss and ~6 dB (2x in amplitude) on the gradients, and a
# misdecoded or dropped block (tens of percent off) falls far outside them.
LOSS_RTOL = 1e-4  # |loss - loss_native| / loss_native
GRAD_SQNR_DB = 26.0  # per parameter: 20 log10(|g_native| / |g - g_native|), the lowest over all parameters
GRAD_SQNR_MEDIAN_DB = 36.0  # the median over the parameters


def _one_step(section: dict | None) -> dict:
    """One forward/backward of a fresh MoE model (seed 0, step 0's batch): the loss (mean over ranks) and every
    parameter's reduced gradient (fp32), by name."""
    from deepspeed.utils import safe_get_full_grad

    eng, _ = T.build(T.ds_config(2, "bf16", section), model_fn=T.MoEModel)
    x, y = T.batch(0, dist.get_rank())
    _, loss = eng(x, y)
    eng.backward(loss)
    grads = {n: safe_get_full_grad(p).float().clone() for n, p in eng.module.named_parameters()}
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    stats = fd.hook_stats(eng) if section is not None else {}
    T.destroy(eng)
    fd.uninstall()
    return {"loss": mean.item() / dist.get_world_size(), "grads": grads, "stats": stats}


def _compare(ref: dict, got: dict) -> dict:
    """Loss relative difference and per-parameter gradient SQNR (dB) of `got` against `ref`, worst over ranks."""
    sq = []
    for n, g in ref["grads"].items():
        err = float((got["grads"][n] - g).norm())
        sq.append(math.inf if err == 0 else 20 * math.log10(float(g.norm()) / err))
    sq_t = torch.tensor([min(sq), sorted(sq)[len(sq) // 2]])
    dist.all_reduce(sq_t, op=dist.ReduceOp.MIN)  # expert parameters differ by rank: the worst rank counts
    return {
        "loss_rel": abs(got["loss"] - ref["loss"]) / abs(ref["loss"]),
        "grad_sqnr_db_min": float(sq_t[0]),
        "grad_sqnr_db_median": float(sq_t[1]),
        "params": len(sq),
    }


def moe_ep2_one_step(info):
    """deepspeed.moe EP=2, ZeRO-2 bf16, weights and gradients off (only the MoE wires differ), one step:
    - combine over fp8comm's bf16 wire moves the bytes DeepSpeed's own all-to-all moves: bit-identical loss and
      gradients (the plumbing check, as for Megatron);
    - FP8 combine, and FP8 combine + FP8 backward, against the native combine; FP8 dispatch against DeepSpeed
      alone: loss within LOSS_RTOL and every parameter's gradient SQNR >= GRAD_SQNR_DB (median >=
      GRAD_SQNR_MEDIAN_DB), and not bit-identical (the wire really changed)."""
    off = {"gemm": False, "weights": False, "gradients": False}
    runs = {
        "deepspeed": None,
        "native": {**off, "moe": {}},  # FP8 dispatch, DeepSpeed's own combine and backward
        "combine_bf16": {**off, "moe": {"combine": "bf16"}},
        "combine_fp8": {**off, "moe": {"combine": "fp8"}},
        "combine_fp8_grad_fp8": {**off, "moe": {"combine": "fp8", "grad": "fp8"}},
    }
    res = {name: _one_step(section) for name, section in runs.items()}
    cmp = {
        "dispatch_fp8_vs_deepspeed": _compare(res["deepspeed"], res["native"]),
        "combine_bf16_vs_native": _compare(res["native"], res["combine_bf16"]),
        "combine_fp8_vs_native": _compare(res["native"], res["combine_fp8"]),
        "combine_fp8_grad_fp8_vs_native": _compare(res["native"], res["combine_fp8_grad_fp8"]),
    }
    info.update(
        one_step={k: {m: (round(v, 6) if isinstance(v, float) else v) for m, v in c.items()} for k, c in cmp.items()},
        loss_native=res["native"]["loss"],
    )
    # the wires ran as configured (fp8comm's counters)
    assert res["native"]["stats"]["moe.dispatch"]["fp8_calls"] > 0, res["native"]["stats"]
    assert res["native"]["stats"]["moe.combine"]["fp8_calls"] == 0, res["native"]["stats"]
    assert res["combine_bf16"]["stats"]["moe.combine"]["fp8_calls"] == 0, res["combine_bf16"]["stats"]
    assert res["combine_fp8"]["stats"]["moe.combine"]["fp8_calls"] > 0, res["combine_fp8"]["stats"]
    assert res["combine_fp8_grad_fp8"]["stats"]["moe.backward"]["fp8_calls"] > 0, res["combine_fp8_grad_fp8"]["stats"]
    b = cmp["combine_bf16_vs_native"]
    assert b["loss_rel"] == 0 and b["grad_sqnr_db_min"] == math.inf, f"bf16 combine is not DeepSpeed's bytes: {b}"
    for tag in ("dispatch_fp8_vs_deepspeed", "combine_fp8_vs_native", "combine_fp8_grad_fp8_vs_native"):
        c = cmp[tag]
        assert c["grad_sqnr_db_median"] < math.inf, f"{tag}: gradients bit-identical, the FP8 wire changed nothing"
        assert c["loss_rel"] <= LOSS_RTOL, f"{tag}: one-step loss off by {c['loss_rel']:.2e} > {LOSS_RTOL}"
        assert c["grad_sqnr_db_min"] >= GRAD_SQNR_DB and c["grad_sqnr_db_median"] >= GRAD_SQNR_MEDIAN_DB, (
            f"{tag}: gradient SQNR min {c['grad_sqnr_db_min']:.1f} dB (>= {GRAD_SQNR_DB}), median "
            f"{c['grad_sqnr_db_median']:.1f} dB (>= {GRAD_SQNR_MEDIAN_DB})"
        )
