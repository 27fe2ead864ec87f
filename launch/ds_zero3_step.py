"""DeepSpeed ZeRO-3 training step with the fp8comm flag on or off: step time, bytes on this node's link, loss.

    launch/cluster.py up --nodes 2 --rate 1gbit
    launch/cluster.py run -- launch/ds_zero3_step.py              # DeepSpeed's own collectives
    launch/cluster.py run -- launch/ds_zero3_step.py --fp8        # "fp8_comm": {"enabled": true, "gemm": false}

The model is `--layers` x Linear(dim, dim) in bf16 (no FP8 GEMMs: only the communication changes), trained to
match a fixed random teacher, the same weights and batches in both modes. Rank 0 prints one line
`ds_zero3_step summary: {json}`: median step time (after `--warmup` steps), bytes this node's link interface sent
per step (fp8comm.distributed.link_ifname), rank 0's forward / backward / optimizer-step medians, first and last
loss, and fp8comm's own byte counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fp8", action="store_true", help="enable fp8comm (weights and gradients in FP8, GEMMs off)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median (first-call compiles)")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")

    from fp8comm.integrations.deepspeed import cpu

    if os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        cpu.prepare()
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    import fp8comm.integrations.deepspeed as fd
    from fp8comm.distributed import link_bytes, link_ifname

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a.dim, a.dim, bias=False) for _ in range(a.layers)])
    teacher = torch.randn(a.dim, a.dim, generator=torch.Generator().manual_seed(1)) / a.dim**0.5
    ds = {
        "train_micro_batch_size_per_gpu": a.rows,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if a.fp8:
        ds["fp8_comm"] = {"enabled": True, "gemm": False}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = fd.initialize(model=model, optimizer=opt, config=ds)
    ifname = link_ifname()
    times, link, losses = [], [], []
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(a.rows, a.dim, generator=g)
        y = (x @ teacher).bfloat16()
        dist.barrier()  # every step starts together: its time and link bytes are this step's
        tx0, t0 = (link_bytes(ifname) or (0, 0))[0] if ifname else 0, time.perf_counter()
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
        if ifname:
            link.append((link_bytes(ifname) or (0, 0))[0] - tx0)
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if rank == 0:
            print(f"step {step + 1}/{a.steps} | loss {losses[-1]:.5f} | {times[-1] * 1e3:.0f} ms", flush=True)
    if rank == 0:
        steady = slice(a.warmup, None)
        summary = {
            "fp8comm": a.fp8,
            "world": world,
            "params": sum(p.ds_numel for p in engine.module.parameters()),
            "steps": a.steps,
            "step_time_s_median": round(statistics.median(times[steady]), 4),
            "step_times_s": [round(t, 4) for t in times],
            "phase_s_median": {k: round(statistics.median(v[steady]), 4) for k, v in phases.items()},
            "link": ifname,
            "link_tx_bytes_per_step_median": statistics.median(link[steady]) if link else None,
            "loss_first": round(losses[0], 6),
            "loss_last": round(losses[-1], 6),
            "fp8comm_hook_stats": fd.hook_stats(engine) if a.fp8 else None,
        }
        print("ds_zero3_step summary: " + json.dumps(summary, default=str), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
