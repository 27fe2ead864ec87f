"""examples/megatron_simple_loop.py, run inside the 2-rank launch: plain DDP and the distributed optimizer, each
with and without fp8comm (same seed, weights and batches), and the distributed optimizer with 4-bit gradients and
4-bit weight updates. fp8comm must engage (its hook counters and wire
bytes), the loss must track the run without it at every iteration, and replicas must end bit-identical."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mcore_checks as C

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron_simple_loop.py"
ITERS = 8


def _example():
    spec = importlib.util.spec_from_file_location("megatron_simple_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None, EXAMPLE
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def megatron_simple_loop(rank, world, info):
    ex = _example()
    for name, flags, hook, op in (
        ("plain_ddp", ["--overlap"], "grad_all_reduce", "all_reduce"),
        ("distributed_optimizer", ["--distributed-optimizer", "--overlap"], "grad_reduce_scatter", "reduce_scatter"),
    ):
        common = ["--iters", str(ITERS), *flags]
        base = ex.main([*common, "--no-fp8comm"])
        f8 = ex.main(common)
        lb, l8 = base["loss"], f8["loss"]
        rel = [abs(a - b) / b for a, b in zip(l8, lb)]
        info[name] = {
            "loss_base": [round(x, 4) for x in (lb[0], lb[-1])],
            "loss_fp8": [round(x, 4) for x in (l8[0], l8[-1])],
            "max_loss_rel": round(max(rel), 5),
            "hooks": f8["hook_stats"],
            "wire": {k: (v["wire_bytes"], round(v["ratio"], 3)) for k, v in f8["comm_stats"].items()},
        }
        assert not base["hook_stats"] and not base["comm_stats"], f"{name}: the baseline ran fp8comm: {base}"
        assert f8["hook_stats"].get(hook, {}).get("fp8_calls", 0) > 0, f"{name}: fp8comm did not engage: {f8}"
        C.check_bytes({"comm": f8["comm_stats"]}, op, 4, name)  # fp32 gradient buckets
        if name == "distributed_optimizer":
            assert f8["hook_stats"]["param_all_gather"]["fp8_calls"] > 0, f8["hook_stats"]
            C.check_bytes({"comm": f8["comm_stats"]}, "all_gather", 2, name)  # bf16 parameters
            _four_bit(ex, common, base, info)
        assert lb[-1] < 0.8 * lb[0], f"{name}: the baseline did not learn: {lb}"
        assert len(l8) == ITERS and max(rel) <= C.LOSS_RTOL, f"{name}: loss {l8} vs {lb}"
        assert l8 != lb, f"{name}: bit-identical to the baseline: fp8comm changed nothing"
        _replicas_identical(f8["params"], name)


def _four_bit(ex, common: list, base: dict, info: dict) -> None:
    """The example with 4-bit gradients (error feedback) and 4-bit weight updates against the same baseline:
    final loss within 2%, gradient bytes >= 7x fewer than the fp32 buckets, update bytes >= 3.5x fewer than bf16."""
    import mcore_checks_fp4 as F

    f4 = ex.main([*common, "--grad-format", "mxfp4", "--error-feedback", "--param-update-format", "mxfp4"])
    lb, l4 = base["loss"], f4["loss"]
    pu = f4["hook_stats"]["param_update"]
    rs = f4["comm_stats"]["reduce_scatter"]
    rel = abs(l4[-1] - lb[-1]) / lb[-1]
    info["4bit"] = {
        "loss_base": [round(x, 4) for x in (lb[0], lb[-1])],
        "loss_4bit": [round(x, 4) for x in (l4[0], l4[-1])],
        "final_loss_rel": round(rel, 5),
        "grad_rs_ratio_vs_fp32": round(rs["dtype_bytes"] / rs["wire_bytes"], 3),
        "update_ag_ratio_vs_bf16": round(pu["dtype_bytes"] / pu["wire_bytes"], 3),
        "hooks": f4["hook_stats"],
    }
    assert rel <= F.FP4_FINAL_LOSS_RTOL, f"4-bit example: final loss {l4[-1]} vs {lb[-1]}"
    assert info["4bit"]["grad_rs_ratio_vs_fp32"] >= F.GRAD_RS_MIN_RATIO, info["4bit"]
    assert info["4bit"]["update_ag_ratio_vs_bf16"] >= F.UPDATE_AG_MIN_RATIO, info["4bit"]
    assert "param_all_gather" not in f4["hook_stats"] and pu["update_calls"] > 0, f4["hook_stats"]
    _replicas_identical(f4["params"], "4bit")


def _replicas_identical(params, tag: str) -> None:
    import torch
    import torch.distributed as dist

    allp = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(allp, params)  # DP = the world in the example
    assert all(torch.equal(p, params) for p in allp), f"{tag}: replicas differ"
