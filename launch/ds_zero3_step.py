"""DeepSpeed ZeRO-3 (or ZeRO-1/2) training step with the fp8comm flag on or off: step time, link bytes, loss.

    launch/cluster.py up --nodes 2 --rate 1gbit
    launch/cluster.py run -- launch/ds_zero3_step.py              # DeepSpeed's own collectives
    launch/cluster.py run -- launch/ds_zero3_step.py --fp8        # "fp8_comm": {"enabled": true, "gemm": false}
    launch/cluster.py run -- launch/ds_zero3_step.py --fp8 --no-hierarchical    # flat collectives (one level)
    launch/cluster.py run -- launch/ds_zero3_step.py --stage 2 --fp8    # ZeRO-2 (also --stage 1)
    launch/cluster.py run -- launch/ds_zero3_step.py --stage 2 --fp8 --grad-fmt mxfp4 --update-fmt mxfp4  # 4 bits
    launch/cluster.py run -- launch/ds_zero3_step.py --stage 2 --bias --gelu --bucket-size 1.6e7   # HF's "auto" size
    launch/cluster.py run -- launch/ds_zero3_step.py --stage 2 --fp8 --grad-fmt mxfp4 --error-feedback   # the recipe
    launch/cluster.py run -- launch/ds_zero3_step.py --stage 2 --planner 4bit    # "planner": {"allow_4bit": true}

`--profile DIR` writes a cProfile of each rank's steady-state steps (DIR/rank<r>.prof) to find non-link time.

The model is `--layers` x Linear(dim, dim) in bf16 (no FP8 GEMMs: only the communication changes; `--bias` gives
the linears biases, `--gelu` puts a GELU after every linear but the last), trained to match a fixed random teacher,
the same weights and batches in both modes. Rank 0 prints one line
`ds_zero3_step summary: {json}`: median step time (after `--warmup` steps), bytes this node's link interface sent
per step (fp8comm.distributed.link_ifname), rank 0's forward / backward / optimizer-step medians, first and last
loss, rank 0's CPU time per step (all its threads: the work that is not waiting on the link; less sensitive
to other load on a shared machine than wall time), and fp8comm's own byte counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fp8", action="store_true", help="enable fp8comm (weights and gradients in FP8, GEMMs off)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--grad-fmt", default="e4m3", help="with --fp8: gradients.fmt (e4m3, e5m2, mxfp4, nvfp4)")
    p.add_argument("--hadamard", type=int, default=0, help="with --fp8 and a 4-bit --grad-fmt: 0, 16 or 32")
    p.add_argument("--update-fmt", default=None, help="with --fp8, ZeRO-1/2: weights.update_fmt (mxfp4, nvfp4)")
    p.add_argument(
        "--error-feedback",
        action="store_true",
        help="with --fp8: gradients.error_feedback (and allow_unpartitioned_residuals under ZeRO-2/3)",
    )
    p.add_argument(
        "--planner",
        choices=("on", "4bit"),
        default=None,
        help="the fp8_comm section's planner (implies --fp8): 'on' = true, '4bit' = {\"allow_4bit\": true}",
    )
    p.add_argument("--calibration", default=None, help="with --planner: a calibration file (default: measured)")
    p.add_argument(
        "--no-planner-trials",
        action="store_true",
        help='with --planner: "trials": false (the prediction alone chooses, no measured trials)',
    )
    p.add_argument(
        "--hierarchical",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --fp8: the fp8_comm section's \"hierarchical\" (default: the adapter's default, two levels)",
    )
    p.add_argument(
        "--bucket-size",
        type=float,
        default=None,
        help="zero_optimization reduce_bucket_size and allgather_bucket_size, in elements (e.g. 5e7; "
        "default: DeepSpeed's own, 5e8)",
    )
    p.add_argument("--bias", action="store_true", help="linears with biases (default: bias-free)")
    p.add_argument("--gelu", action="store_true", help="a GELU after every linear but the last")
    p.add_argument("--profile", metavar="DIR", help="cProfile each rank's steps after warmup into DIR/rank<r>.prof")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median (first-call compiles)")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")
    if a.bucket_size is not None and (a.bucket_size < 1 or a.bucket_size != int(a.bucket_size)):
        p.error(f"--bucket-size must be a whole number of elements >= 1, got {a.bucket_size:g}")

    from fp8comm.integrations.deepspeed import cpu

    if os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        cpu.prepare()
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    import fp8comm.integrations.deepspeed as fd
    from fp8comm.comm import comm_stats
    from fp8comm.distributed import link_bytes, link_ifname

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(a.layers):
        mods.append(nn.Linear(a.dim, a.dim, bias=a.bias))
        if a.gelu and i < a.layers - 1:
            mods.append(nn.GELU())
    model = nn.Sequential(*mods)
    teacher = torch.randn(a.dim, a.dim, generator=torch.Generator().manual_seed(1)) / a.dim**0.5
    ds = {
        "train_micro_batch_size_per_gpu": a.rows,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": a.stage},
    }
    if a.stage == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if a.bucket_size is not None:
        ds["zero_optimization"]["reduce_bucket_size"] = int(a.bucket_size)
        ds["zero_optimization"]["allgather_bucket_size"] = int(a.bucket_size)
    if a.planner:
        a.fp8 = True
        if a.grad_fmt != "e4m3" or a.update_fmt or a.error_feedback:
            p.error("--planner chooses the formats: drop --grad-fmt / --update-fmt / --error-feedback")
    if a.fp8:
        ds["fp8_comm"] = {"enabled": True, "gemm": False}
        if a.planner:
            plan: dict = {"allow_4bit": a.planner == "4bit"}
            if a.calibration:
                plan["calibration"] = a.calibration
            if a.no_planner_trials:
                plan["trials"] = False
            ds["fp8_comm"]["planner"] = plan
        if a.hierarchical is not None:
            ds["fp8_comm"]["hierarchical"] = a.hierarchical
        if a.grad_fmt != "e4m3" or a.hadamard:  # only keys that differ: the script also runs older checkouts
            ds["fp8_comm"]["gradients"] = {"fmt": a.grad_fmt, "hadamard": a.hadamard}
        if a.update_fmt:
            ds["fp8_comm"]["weights"] = {"update_fmt": a.update_fmt}
        if a.error_feedback:
            g = ds["fp8_comm"].setdefault("gradients", {})
            g["error_feedback"] = True
            if a.stage > 1:
                g["allow_unpartitioned_residuals"] = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = fd.initialize(model=model, optimizer=opt, config=ds)
    ifname = link_ifname()
    times, cpu_s, link, losses = [], [], [], []
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    prof = None
    for step in range(a.steps):
        if a.profile and step == a.warmup:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(a.rows, a.dim, generator=g)
        y = (x @ teacher).bfloat16()
        dist.barrier()  # every step starts together: its time and link bytes are this step's
        tx0, t0, c0 = (link_bytes(ifname) or (0, 0))[0] if ifname else 0, time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y.float())
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        dist.barrier()
        for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[k].append(dt)
        times.append(time.perf_counter() - t0)
        cpu_s.append(time.process_time() - c0)
        if ifname:
            link.append((link_bytes(ifname) or (0, 0))[0] - tx0)
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if rank == 0:
            print(f"step {step + 1}/{a.steps} | loss {losses[-1]:.5f} | {times[-1] * 1e3:.0f} ms", flush=True)
    if prof is not None:
        prof.disable()
        os.makedirs(a.profile, exist_ok=True)
        prof.dump_stats(os.path.join(a.profile, f"rank{rank}.prof"))
    if rank == 0:
        steady = slice(a.warmup, None)
        summary = {
            "fp8comm": a.fp8,
            # where the adapter was imported from: a worktree A/B must show its own tree here (an editable install
            # maps fp8comm.integrations to the installed checkout when only fp8comm/ is found on PYTHONPATH)
            "adapter": str(Path(fd.__file__).parent),
            "stage": a.stage,
            "model": {"layers": a.layers, "dim": a.dim, "bias": a.bias, "gelu": a.gelu, "dtype": "bf16"},
            "zero_optimization": ds["zero_optimization"],
            "fp8_comm": ds.get("fp8_comm"),
            "world": world,
            "params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
            "steps": a.steps,
            "step_time_s_median": round(statistics.median(times[steady]), 4),
            "step_times_s": [round(t, 4) for t in times],
            # this process's CPU time (all its threads, gloo's included): the non-link work, less load-sensitive
            "cpu_s_per_step_median": round(statistics.median(cpu_s[steady]), 4),
            "phase_s_median": {k: round(statistics.median(v[steady]), 4) for k, v in phases.items()},
            "link": ifname,
            "link_tx_bytes_per_step_median": statistics.median(link[steady]) if link else None,
            "loss_first": round(losses[0], 6),
            "loss_last": round(losses[-1], 6),
            "fp8comm_hook_stats": fd.hook_stats(engine) if a.fp8 else None,
            # the planner's calls: predicted and measured seconds per op (comm_stats), summed over the run
            "planned_times": {
                op: {k: v[k] for k in ("timed_calls", "predicted_s", "measured_s")}
                for op, v in comm_stats().items()
                if v.get("timed_calls")
            },
        }
        print("ds_zero3_step summary: " + json.dumps(summary, default=str), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
