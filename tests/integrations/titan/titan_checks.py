"""torchtitan checks (run on every rank by tests/integrations/fsdp2/fsdp2_harness.py): torchtitan 0.3.0's llama3
debugmodel, its own parallelize_llama / apply_fsdp_to_decoder, through examples/torchtitan_fsdp2.py.

Each check is check(rank, world, info); `info` carries the measured numbers to the pytest report.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import torchtitan_fsdp2 as ex

import fp8comm.comm as fc
import fp8comm.integrations.fsdp2 as f2

STEPS = 10
LOSS_TOL = 0.02  # as the FSDP2 suite: final loss and every 5-step running mean within 2% of plain FSDP2
WEIGHTS_MIN, GRADIENTS_MIN = 1.93, 3.86  # the wire format's limits with fp32 scales: 1.939x, 3.879x
# FP8 calls per step: tok_embeddings and the 6 blocks gather in forward and again in backward, norm+lm_head once
# (torchtitan keeps it unsharded after forward); one reduce-scatter per param group (8; the root has none).
WEIGHT_CALLS, GRADIENT_CALLS = 1 * 2 + 6 * 2 + 1, 8


def _same_on_all_ranks(value: str, what: str) -> None:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    assert len(set(got)) == 1, f"{what} differ across ranks: {got}"


def _digest(model) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.full_tensor().detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _windows(a: list[float], b: list[float]) -> list[float]:
    return [
        abs(sum(a[max(0, i - 4) : i + 1]) - sum(b[max(0, i - 4) : i + 1])) / sum(b[max(0, i - 4) : i + 1])
        for i in range(len(a))
    ]


def titan_llama3_vs_plain(rank, world, info):
    """The example's --bench (plain torchtitan FSDP2, then + fp8comm, same weights and batches): loss within 2%,
    fp8comm engaged on every param group (byte ratios, FP8 call counts, no pass-through), the shared
    [norm, lm_head] group listed once as norm+lm_head; then disable(): FSDP2's own collectives on every group and
    a step makes no fp8comm call."""
    json_path = Path(os.environ["FSDP2_TEST_DIR"]) / "titan.json"
    res = ex.main(["--bench", "--steps", str(STEPS), "--json", str(json_path)])
    plain, fp8 = res["plain"]["losses"], res["fp8"]["losses"]
    rel = [abs(a - b) / b for a, b in zip(fp8, plain)]
    report = res["fp8"]["report"]
    names = [line.split()[0] for line in report.splitlines()[1:] if line.startswith("  ") and " params, " in line]
    info.update(
        loss_first=round(plain[0], 4),
        loss_last_plain=round(plain[-1], 4),
        loss_last_fp8=round(fp8[-1], 4),
        final_rel_loss_diff=round(rel[-1], 5),
        max_rel_loss_diff_5step_mean=round(max(_windows(fp8, plain)), 5),
        weights_ratio=round(res["fp8"]["weights_ratio"], 4),
        gradients_ratio=round(res["fp8"]["gradients_ratio"], 4),
        fp8_calls={d: res["fp8"][f"{d}_fp8_calls"] for d in ("weights", "gradients")},
        groups=names,
        step_ms={k: round(res[k]["median_step_s"] * 1e3) for k in ("plain", "fp8")},
    )
    assert all(torch.isfinite(torch.tensor(plain + fp8))), (plain, fp8)
    assert plain[-1] < plain[0] - 0.1, f"plain run did not train: {plain}"
    assert rel[-1] <= LOSS_TOL and max(_windows(fp8, plain)) <= LOSS_TOL, info
    assert info["weights_ratio"] >= WEIGHTS_MIN and info["gradients_ratio"] >= GRADIENTS_MIN, info
    assert res["fp8"]["weights_passthrough_calls"] == 0 and res["fp8"]["gradients_passthrough_calls"] == 0, res
    assert info["fp8_calls"] == {"weights": STEPS * WEIGHT_CALLS, "gradients": STEPS * GRADIENT_CALLS}, info
    assert "8 of 9 FSDP2 modules with FP8 hooks" in report and names.count("norm+lm_head") == 1, report
    assert "norm" not in names and "lm_head" not in names, names

    args = ex.parse_args(["--steps", "1"])
    model, _ = ex.build(args, fp8=True)
    _same_on_all_ranks(_digest(model), "initial weights")
    assert f2.disable(model)
    groups = [
        g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups
    ]
    info["comms_after_disable"] = sorted(
        {type(c).__name__ for g in groups for c in (g._all_gather_comm, g._reduce_scatter_comm)}
    )
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # plain FSDP2 on gloo (see the example)
    f2.reset_hook_stats()
    before = fc.comm_stats()
    x, y = ex.batch(ex.load_tokens(), args, 0, rank)
    model(x).float().sum().backward()
    info["hook_stats_after_disable"] = f2.hook_stats()
    assert f2.hook_stats() == {} and fc.comm_stats() == before, "fp8comm ran after disable()"
    assert not any(f2.hooks.is_ours(c) for g in groups for c in (g._all_gather_comm, g._reduce_scatter_comm)), info
