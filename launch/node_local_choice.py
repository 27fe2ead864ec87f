#!/usr/bin/env python3
"""Which node-local phase two-level reduce-scatter uses (fp8comm/comm/levels.py), measured side by side.

Both candidates keep the node's sum exact to fp32: (a) an fp32 reduce_scatter (the fp32 wire; gloo sums), (b) an
all_to_all in the input's dtype (bf16) with the receiver summing in fp32. A bf16 reduce_scatter would sum in bf16,
so it does not qualify. Run one node's ranks on loopback:

  torchrun --nproc-per-node 4 launch/node_local_choice.py [--mib 16] [--reps 6]

Alternating order, medians of the slowest rank's time (the first repetition dropped as warm-up).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=16, help="MiB of bf16 input per rank")
    p.add_argument("--reps", type=int, default=6)
    a = p.parse_args()
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    e = a.mib << 19  # bf16 elements
    e -= e % w
    x = torch.randn(e)
    xb = x.to(torch.bfloat16)
    f32, rb, acc = torch.empty(e // w), torch.empty(e, dtype=torch.bfloat16), torch.empty(e // w)

    def fp32_rs() -> None:
        dist.reduce_scatter_tensor(f32, x)

    def bf16_a2a() -> None:
        dist.all_to_all_single(rb, xb)
        torch.sum(rb.view(w, e // w), dim=0, dtype=torch.float32, out=acc)

    runs: dict = {"fp32 reduce_scatter": [], "bf16 all_to_all + fp32 sum": []}
    fns = list(zip(runs, (fp32_rs, bf16_a2a)))
    for rep in range(a.reps):
        for name, fn in fns if rep % 2 else fns[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            runs[name].append(t.item() * 1e3)
    if r == 0:
        med = {k: statistics.median(v[1:]) for k, v in runs.items()}
        for k, v in med.items():
            print(f"{k:28s} median {v:7.1f} ms  ({w} ranks, {a.mib} MiB bf16 each)")
        print(f"bf16 all_to_all + fp32 sum: {med['fp32 reduce_scatter'] / med['bf16 all_to_all + fp32 sum']:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
