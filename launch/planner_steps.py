"""The planner against every fixed choice, on DeepSpeed's step (issue 30 item 5): launch/ds_zero3_step.py in each mode
on a running simulated cluster, modes alternating within each round, then per mode the median over rounds of the
per-run median step time, and the planner's ratio to the best fixed mode.

    launch/cluster.py --name pl up --nodes 2 --rate 200mbit
    launch/planner_steps.py --cluster pl --stage 2 --rounds 3 --json out.json -- --bias --gelu
    launch/cluster.py --name pl down

Modes: DeepSpeed's own (no fp8_comm), FP8 (the section's defaults: two levels where a group spans nodes), the
4-bit recipe (mxfp4 gradients with error feedback; weights FP8), and the planner with 4 bits allowed (its
calibration measured at build, on the cluster's links). Arguments after `--` go to every ds_zero3_step.py run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "deepspeed": [],
    "fp8": ["--fp8"],
    "mxfp4+ef": ["--fp8", "--grad-fmt", "mxfp4", "--error-feedback"],
    "planner-4bit": ["--planner", "4bit"],
}
FIXED = ("deepspeed", "fp8", "mxfp4+ef")
TAG = "ds_zero3_step summary: "


def run(cluster: str, nproc: int, stage: int, mode: str, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(ROOT / "launch" / "cluster.py"), "--name", cluster, "run", "--nproc-per-node"]
    cmd += [str(nproc), "--", "launch/ds_zero3_step.py", "--stage", str(stage), *MODES[mode], *extra]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        i = line.find(TAG)
        if i >= 0:
            return json.loads(line[i + len(TAG) :])
    raise RuntimeError(f"{mode}: no summary (rc {out.returncode})\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, help="the running simulated cluster's --name")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--json", help="write the runs and the table here")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or a.rounds < 1:
        p.error(f"unknown modes {bad}; valid: {', '.join(MODES)}" if bad else "--rounds must be >= 1")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in modes if r % 2 == 0 else reversed(modes):  # alternate the order: drift hits every mode alike
            s = run(a.cluster, a.nproc_per_node, a.stage, m, extra, a.timeout)
            runs[m].append(s)
            print(f"round {r + 1} {m:<14} {s['step_time_s_median'] * 1e3:8.0f} ms/step", flush=True)
    med = {m: statistics.median(s["step_time_s_median"] for s in v) for m, v in runs.items()}
    fixed = {m: t for m, t in med.items() if m in FIXED}
    best = min(fixed, key=fixed.__getitem__) if fixed else None
    print(f"\nZeRO-{a.stage}, {a.nproc_per_node} ranks per node, {a.rounds} round(s), args {extra}")
    print(f"{'mode':<14}{'ms/step':>10}{'vs DeepSpeed':>14}{'vs best fixed':>15}  link MB/step")
    for m, t in med.items():
        link = statistics.median((s["link_tx_bytes_per_step_median"] or 0) / 1e6 for s in runs[m])
        own = f"{med['deepspeed'] / t:.2f}x" if "deepspeed" in med else "-"
        vs = f"{t / med[best]:.3f}" if best else "-"
        print(f"{m:<14}{t * 1e3:>10.0f}{own:>14}{vs:>15}  {link:.1f}")
    if "planner-4bit" in runs:
        plans = runs["planner-4bit"][-1]["fp8comm_hook_stats"].get("plans", [])
        for pl in plans:
            print(f"  plan: {pl['op']} {pl['role']} class {pl['size_class']}: {pl['chosen']}")
        times = runs["planner-4bit"][-1].get("planned_times", {})
        for op, t in times.items():
            print(
                f"  {op}: {t['timed_calls']} timed calls, predicted {t['predicted_s'] * 1e3:.0f} ms, "
                f"measured {t['measured_s'] * 1e3:.0f} ms"
            )
        if best:
            print(f"planner / best fixed ({best}): {med['planner-4bit'] / med[best]:.3f} (target <= 1.05)")
    if a.json:
        Path(a.json).write_text(json.dumps({"stage": a.stage, "args": extra, "median_s": med, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
