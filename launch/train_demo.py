#!/usr/bin/env python3
"""A small ZeRO-style data-parallel training loop whose weights and gradients travel through fp8comm.

Each rank owns 1/world of the flat fp32 master weights and their Adam state. A step: all-gather the weights
(FP8 via fp8comm.all_gather, or plain bf16 / fp32), forward + backward on this rank's batch, reduce-scatter
(mean) the gradients (FP8 via fp8comm.reduce_scatter, or bf16 / fp32), Adam on the owned shard.

--modes fp8,bf16,fp32 trains one model per mode side by side in one run (same init and data), rotating which
mode steps first, so the step times compare under the same machine load. Checkpoints every --ckpt-every steps
(one file per rank, then an atomic `latest` marker written by rank 0 after a barrier); on start it resumes from
`latest`, which is what makes torchrun's elastic restart (--max-restarts) continue a killed run.
Launch: launch/torchrun.sh, launch/cluster.py run, sbatch launch/slurm/*.sbatch, or launch/mpirun.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fp8comm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp8comm.comm as fc
from fp8comm.distributed import init_distributed

MODES = ("fp8", "bf16", "fp32")


def build_model(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in every mode
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
    return torch.nn.Sequential(*mods[:-1])


def batch(step: int, rank: int, bs: int, dim: int, teacher: torch.Tensor):
    """This rank's batch for `step`: a pure function of (step, rank), so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(bs, dim, generator=g)
    return x, torch.tanh(x @ teacher)


class Replica:
    """One mode's model copy, its flat full-weight and gradient buffers, and the owned master shard + Adam."""

    def __init__(self, mode: str, a, rank: int, world: int) -> None:
        self.mode, self.rank, self.world = mode, rank, world
        self.model = build_model(a.dim, a.layers)
        params = list(self.model.parameters())
        n = sum(p.numel() for p in params)
        self.shard_n = -(-n // (world * 128)) * 128  # shards of whole 128-element blocks
        total = self.shard_n * world
        self.flat = torch.zeros(total)
        self.gflat = torch.zeros(total)
        off = 0
        for p in params:
            k = p.numel()
            self.flat[off : off + k].copy_(p.data.view(-1))
            p.data = self.flat[off : off + k].view_as(p)  # the model reads the gathered weights in place
            p.grad = self.gflat[off : off + k].view_as(p)  # backward accumulates straight into the flat buffer
            off += k
        mine = slice(rank * self.shard_n, (rank + 1) * self.shard_n)
        self.master = self.flat[mine].clone()
        self.m, self.v = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.lr, self.t = a.lr, 0
        # Scratch memory reused every step; one Buffer per collective keeps each pool's request sizes fixed.
        self.buf_ag, self.buf_rs = fc.Buffer(), fc.Buffer()
        self.loss = float("nan")

    def gather_weights(self) -> None:
        if self.mode == "fp8":
            # FP8 payload + 1x128 scales on the wire; every replica decodes the same bytes -> identical weights.
            self.buf_ag.all_gather_into(self.flat, self.master)
        else:
            dt = torch.bfloat16 if self.mode == "bf16" else torch.float32
            out = torch.empty(self.flat.numel(), dtype=dt)
            _ag(out, self.master.to(dt))
            self.flat.copy_(out)

    def reduce_grads(self) -> torch.Tensor:
        if self.mode == "fp8":
            out = torch.empty(self.shard_n)
            self.buf_rs.reduce_scatter_into(out, self.gflat, op="avg")
            return out
        dt = torch.bfloat16 if self.mode == "bf16" else torch.float32
        out = torch.empty(self.shard_n, dtype=dt)
        _rs(out, self.gflat.to(dt))
        return out.float().div_(self.world)

    def step(self, step: int, a, teacher: torch.Tensor) -> None:
        self.gather_weights()
        x, y = batch(step, self.rank, a.batch, a.dim, teacher)
        self.gflat.zero_()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        g = self.reduce_grads()
        # Adam on the owned fp32 master shard.
        self.t += 1
        b1, b2 = 0.9, 0.999
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        mh, vh = self.m / (1 - b1**self.t), self.v / (1 - b2**self.t)
        self.master.addcdiv_(mh, vh.sqrt_().add_(1e-8), value=-self.lr)
        self.loss = loss.item()

    def state(self) -> dict:
        return {"master": self.master, "m": self.m, "v": self.v, "t": self.t}

    def load(self, st: dict) -> None:
        self.master.copy_(st["master"])
        self.m.copy_(st["m"])
        self.v.copy_(st["v"])
        self.t = st["t"]


def _ag(out, x):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x)


def _rs(out, x):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x)


# ---------------------------------------------------------------------------------------------- checkpoints
def save(ckpt: Path, step: int, reps: dict, rank: int, world: int) -> None:
    d = ckpt / f"step{step:06d}"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"rank{rank}.pt.tmp"
    torch.save({"step": step, "world": world, "modes": {k: r.state() for k, r in reps.items()}}, tmp)
    tmp.replace(d / f"rank{rank}.pt")
    dist.barrier()  # every shard is on disk before `latest` may point at this step
    if rank == 0:
        (ckpt / "latest.tmp").write_text(str(step))
        (ckpt / "latest.tmp").replace(ckpt / "latest")


def load(ckpt: Path, reps: dict, rank: int, world: int) -> int:
    """The step to start from (0 without a checkpoint)."""
    f = ckpt / "latest"
    if not f.exists():
        return 0
    step = int(f.read_text())
    st = torch.load(ckpt / f"step{step:06d}" / f"rank{rank}.pt")
    if st["world"] != world:
        raise SystemExit(
            f"checkpoint {ckpt} was written by {st['world']} ranks, this run has {world}: "
            "restart with the same world size"
        )
    for k, r in reps.items():
        r.load(st["modes"][k])
    return step


# ----------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="fp8", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the step-time medians")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-dir", default="", help="checkpoint + resume here (shared by all nodes)")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (makes kill timing easy)")
    p.add_argument("--json", default="", help="rank 0 writes step times and losses here")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {MODES}")
    torch.set_num_threads(a.threads)
    info = init_distributed(timeout_s=300)
    rank, world = info.rank, info.world_size
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    teacher = torch.randn(a.dim, a.dim, generator=torch.Generator().manual_seed(7)) / a.dim**0.5
    reps = {m: Replica(m, a, rank, world) for m in modes}
    ckpt = Path(a.ckpt_dir) if a.ckpt_dir else None
    start = load(ckpt, reps, rank, world) if ckpt else 0
    if rank == 0:
        n = reps[modes[0]].shard_n * world
        print(
            f"[train] {world} ranks ({world // info.local_world_size} nodes), {n / 1e6:.1f}M params, modes "
            f"{modes}, restart {restart}, " + (f"resumed from step {start}" if start else "starting at step 0"),
            flush=True,
        )
    times = {m: [] for m in modes}
    fc.reset_comm_stats()
    for step in range(start, a.steps):
        order = modes[step % len(modes) :] + modes[: step % len(modes)]
        dt = torch.zeros(len(modes), dtype=torch.float64)
        for m in order:
            dist.barrier()
            t0 = time.perf_counter()
            reps[m].step(step, a, teacher)
            dt[modes.index(m)] = time.perf_counter() - t0
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step - start >= a.warmup:
            for i, m in enumerate(modes):
                times[m].append(float(dt[i]))
        if rank == 0:
            print(
                f"[train] step {step + 1}/{a.steps} "
                + " ".join(f"{m}: loss {reps[m].loss:.5f} {dt[i] * 1e3:.0f} ms" for i, m in enumerate(modes)),
                flush=True,
            )
        if ckpt and (step + 1) % a.ckpt_every == 0:
            save(ckpt, step + 1, reps, rank, world)
        if a.step_delay:
            time.sleep(a.step_delay)
    # Replicas must agree: every rank decodes the same gathered bytes, so final weights are bit-identical.
    for m, r in reps.items():
        r.gather_weights()
        h = torch.tensor([float(r.flat.double().sum())], dtype=torch.float64)
        lo, hi = h.clone(), h.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if lo.item() != hi.item():
            raise SystemExit(f"mode {m}: ranks disagree on the weights after training")
    if rank == 0:
        out = {
            "world": world,
            "nodes": world // info.local_world_size,
            "start_step": start,
            "restart": restart,
            "steps": a.steps,
            "params": reps[modes[0]].shard_n * world,
            "modes": {
                m: {
                    "median_step_s": statistics.median(times[m]) if times[m] else None,
                    "step_times_s": times[m],
                    "final_loss": reps[m].loss,
                }
                for m in modes
            },
            "fp8_comm_stats": fc.comm_stats(),
        }
        print("[train] done: " + ", ".join(f"{m} loss {reps[m].loss:.5f}" for m in modes), flush=True)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=1))
    fp8comm.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
