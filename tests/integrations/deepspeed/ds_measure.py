"""Measurements behind docs/deepspeed.md (not a test): error feedback on the tiny GPT, FP8 vs BF16 MoE combine.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ds_measure.py ef|moe STEPS OUT.json

ef:  ZeRO-1 fp32, FP8 gradients only (weights, MoE, GEMMs off), e4m3 and e5m2, each without and with error feedback
     (fp32 and bf16 residuals): per-step SQNR of the reduced gradient vs the exact fp32 average of the ranks'
     gradients, SQNR of the gradients' running sum, and the loss vs DeepSpeed without fp8comm.
moe: deepspeed.moe EP=2 under ZeRO-2 bf16, FP8 dispatch only (weights/gradients off): combine native (DeepSpeed's
     bf16 all-to-all), fp8comm bf16 and FP8, loss vs DeepSpeed without fp8comm.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fp8comm.integrations.deepspeed import cpu

cpu.prepare()

import deepspeed  # noqa: E402
import ds_train as T  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ds_common import GradSqnr  # noqa: E402

import fp8comm.integrations.deepspeed as fd  # noqa: E402


def run(cfg: dict, steps: int, model_fn=T.tiny_gpt, sqnr: bool = False) -> dict:
    eng, _ = T.build(cfg, model_fn=model_fn)
    sq = GradSqnr() if sqnr else None
    t0 = time.perf_counter()
    r = T.train(eng, range(steps), on_step=None if sq is None else (lambda step: sq(eng, step)))
    out = {"losses": r.losses, "seconds": round(time.perf_counter() - t0, 1), "stats": r.stats}
    if sq is not None:
        out.update(step_db=sq.step_db, sum_db=sq.sum_db)
    T.destroy(eng)
    fd.uninstall()
    return out


def mean(xs) -> float:
    return sum(xs) / len(xs)


def main() -> int:
    what, steps, path = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    deepspeed.init_distributed("gloo")
    torch.set_num_threads(1)
    tail = max(10, steps // 4)  # loss: mean of the last quarter of the steps
    res = {
        "what": what,
        "steps": steps,
        "loss_tail_steps": tail,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if what == "ef":
        runs = {"baseline": None}
        for fmt in ("e4m3", "e5m2"):
            g = {"fmt": fmt}
            runs[f"{fmt}"] = {**g}
            runs[f"{fmt}+ef_fp32"] = {**g, "error_feedback": True}
            runs[f"{fmt}+ef_bf16"] = {**g, "error_feedback": True, "residual_dtype": "bf16"}
        for name, g in runs.items():
            section = None if g is None else {"gemm": False, "weights": False, "moe": False, "gradients": g}
            res[name] = run(T.ds_config(1, "fp32", section), steps, sqnr=True)
    elif what == "moe":
        runs = {"baseline": None, "combine_native": "native", "combine_bf16": "bf16", "combine_fp8": "fp8"}
        for name, combine in runs.items():
            section = (
                None
                if combine is None
                else {"gemm": False, "weights": False, "gradients": False, "moe": {"combine": combine}}
            )
            res[name] = run(T.ds_config(2, "bf16", section), steps, model_fn=T.MoEModel)
    base = mean(res["baseline"]["losses"][-tail:])
    for r in res.values():
        if isinstance(r, dict) and "losses" in r:
            r["loss_tail"] = mean(r["losses"][-tail:])
            r["rel_vs_baseline"] = (r["loss_tail"] - base) / base
            if "step_db" in r:
                r["step_db_mean"] = mean(r["step_db"])
    if what == "moe":
        b = res["combine_bf16"]["loss_tail"]
        res["fp8_vs_bf16_combine"] = (res["combine_fp8"]["loss_tail"] - b) / b
    if dist.get_rank() == 0:
        path.write_text(json.dumps(res, indent=1, default=str))
        for name, r in res.items():
            if isinstance(r, dict) and "losses" in r:
                extra = (
                    f" step SQNR {r['step_db_mean']:.1f} dB, summed {r['sum_db'][-1]:.1f} dB" if "sum_db" in r else ""
                )
                print(
                    f"{name:<16} loss {r['loss_tail']:.4f} ({100 * r['rel_vs_baseline']:+.2f}%){extra} "
                    f"[{r['seconds']} s]"
                )
        if what == "moe":
            print(f"FP8 vs BF16 combine: {100 * res['fp8_vs_bf16_combine']:+.3f}%")
    dist.barrier()
    fd.shutdown()  # DeepSpeed's and fp8comm's references to the groups go before them (gloo threads at exit)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
