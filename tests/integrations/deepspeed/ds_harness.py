"""Launch one scenario of ds_worker.py with torchrun (2 gloo ranks, CPU DeepSpeed) and collect its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[2]


def launch(scenario: str, outdir: Path, ranks: int = 2, timeout: float = 300.0, only: list[str] | None = None) -> dict:
    """{"returncode", "timed_out", "results": {rank: [records]}, "log": tail of the output}."""
    outdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(HERE / "ds_worker.py"),
        scenario,
        str(outdir),
        ",".join(only or []),
    ]
    log = outdir / "log.txt"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc, timed_out = p.wait(timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)  # torchrun and its workers: the session we started
            rc, timed_out = p.wait(), True
    results = {}
    for r in range(ranks):
        f = outdir / f"rank{r}.jsonl"
        results[r] = [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []
    return {"returncode": rc, "timed_out": timed_out, "results": results, "log": log.read_text()[-6000:]}


def failures(run: dict) -> list[str]:
    msgs = []
    for r, recs in run["results"].items():
        done = {x["check"] for x in recs if x.get("state") == "done"}
        for x in recs:
            if x.get("state") == "done" and not x["ok"]:
                msgs.append(f"rank {r}: {x['check']}: {x['error']}\n{x.get('trace', '')}")
            if x.get("state") == "started" and x["check"] not in done:
                msgs.append(f"rank {r}: {x['check']} never finished ({'timeout' if run['timed_out'] else 'crash'})")
        plan = next((x["plan"] for x in recs if "plan" in x), None)
        if plan is None:
            msgs.append(f"rank {r}: wrote no plan (crashed at start-up?)")
        elif not msgs and [c for c in plan if c not in done]:
            msgs.append(f"rank {r}: checks never run: {[c for c in plan if c not in done]}")
    if run["timed_out"]:
        msgs.append("launch timed out")
    if run["returncode"] != 0:
        msgs.append(f"torchrun exited with {run['returncode']}; output tail:\n{run['log']}")
    return msgs


def summary(run: dict) -> str:
    """One line per check (rank 0): time, loss difference vs baseline and bytes ratios."""
    lines = []
    for x in run["results"].get(0, []):
        if x.get("state") != "done":
            continue
        info = x.get("info", {})
        keys = (
            "rel",
            "tol",
            "ratio_w",
            "ratio_g",
            "ratio_dispatch",
            "ratio_combine",
            "ratio_backward",
            "fp8_linears",
            "min_weight_quantizations",
            "hpz_secondary_gathers",
            "grad_rel_err_max",
            "local_grad_rel_err_median",
            "rel_vs_moe_ep2_dispatch_fp8",
            "step_sqnr_db_mean",
            "sum_sqnr_db",
            "plain_sum_sqnr_db",
            "exact",
            "owned_elements",
            "drift_max",
            "drift_last5",
            "bf16_floor",
        )
        extra = " ".join(
            f"{k}={info[k]:.4g}" if isinstance(info[k], float) else f"{k}={info[k]}" for k in keys if k in info
        )
        if "comm_stats" in info:
            extra += " comm_stats ratio " + ",".join(f"{k}={v}" for k, v in info["comm_stats"].items())
        lines.append(f"  {x['check']:<36} {'ok' if x['ok'] else 'FAIL'} {x['seconds']:6.1f}s {extra}")
    return "\n".join(lines)
