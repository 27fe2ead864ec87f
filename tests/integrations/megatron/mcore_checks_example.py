"""examples/megatron_simple_loop.py, run inside the 2-rank launch: plain DDP and the distributed optimizer, each
with and without fp8comm (same seed, weights and batches). fp8comm must engage (its hook counters and wire
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
        assert lb[-1] < 0.8 * lb[0], f"{name}: the baseline did not learn: {lb}"
        assert len(l8) == ITERS and max(rel) <= C.LOSS_RTOL, f"{name}: loss {l8} vs {lb}"
        assert l8 != lb, f"{name}: bit-identical to the baseline: fp8comm changed nothing"
        _replicas_identical(f8["params"], name)


def _replicas_identical(params, tag: str) -> None:
    import torch
    import torch.distributed as dist

    allp = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(allp, params)  # DP = the world in the example
    assert all(torch.equal(p, params) for p in allp), f"{tag}: replicas differ"
