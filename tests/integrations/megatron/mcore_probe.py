"""GradProbe: element-wise check of Megatron's FP8 gradient reduction against the exact (fp64) reduction.

Wraps the installed FP8 reduce-scatter (distributed optimizer) or fp8comm's FP8 all-reduce of a bucket (plain
DDP) and records, per call, the output and the exact reduction of the very same inputs; per_step() then gives the
step's SQNR over all buckets and all ranks of the group. The checks hold it >= STEP_SQNR_MIN_DB on every step.
"""

from __future__ import annotations

import contextlib
import importlib
import math

import torch
import torch.distributed as dist

PGB = "megatron.core.distributed.param_and_grad_buffer"
STEP_SQNR_MIN_DB = 25.0  # E4M3 with 1x128 fp32 scales: ~31 dB per step on these gradients (reduce-scatter)


class GradProbe:
    """The exact reduction comes from a list all_gather of the same input (it runs at once, even inside Megatron's
    coalescing block); per_step() compares after forward-backward, when every FP8 handle has been waited."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cum: dict[tuple[int, int], list[torch.Tensor]] = {}  # output -> [sum of outputs, of exact]
        self.step_db: list[float] = []
        self.group = None

    def _exact(self, input: torch.Tensor, op, group) -> torch.Tensor:
        self.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(input) for _ in range(world)]
        dist.all_gather(parts, input.contiguous(), group=group)
        total = torch.stack([p.double() for p in parts]).sum(0)
        if op == dist.ReduceOp.AVG:
            total /= world
        return total

    def attach(self, model=None) -> None:
        """After install: wrap the installed reduce-scatter (uninstall() restores Megatron's own function)."""
        pgb = importlib.import_module(PGB)
        inner = pgb.dist_reduce_scatter_func

        def probe(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            total = self._exact(input, op, group)
            n, rank = output.numel(), dist.get_rank(group)
            self.pending.append((output, total[rank * n : (rank + 1) * n].clone()))
            return inner(output, input, op=op, group=group, async_op=async_op)

        pgb.dist_reduce_scatter_func = probe

    @contextlib.contextmanager
    def all_reduce(self):
        """Around a plain-DDP run: wrap fp8comm's FP8 bucket all-reduce (the tensor is reduced in place)."""
        from fp8comm.integrations.megatron import ddp_hooks

        inner = ddp_hooks._fp8_all_reduce

        def probe(orig, cfg, tensor, op, group, async_op):
            self.pending.append((tensor, self._exact(tensor, op, group)))
            return inner(orig, cfg, tensor, op, group, async_op)

        ddp_hooks._fp8_all_reduce = probe
        try:
            yield self
        finally:
            ddp_hooks._fp8_all_reduce = inner

    def _db(self, pairs) -> float:
        t = torch.zeros(2, dtype=torch.float64)
        for out, exact in pairs:
            t[0] += exact.pow(2).sum()
            t[1] += (out - exact).pow(2).sum()
        dist.all_reduce(t, group=self.group)
        return 10 * math.log10(float(t[0] / t[1])) if t[1] > 0 else math.inf

    def per_step(self, _i: int) -> None:
        """After forward-backward: this step's SQNR (all buckets, all ranks of the group); add to the running sums."""
        assert self.pending, "the probe saw no FP8 gradient reduction this step"
        pairs = [(o.double(), e) for o, e in self.pending]
        self.step_db.append(self._db(pairs))
        for (out, _), (o, e) in zip(self.pending, pairs):  # buckets may reduce in another order each step
            acc = self.cum.setdefault((out.data_ptr(), out.numel()), [torch.zeros_like(e), torch.zeros_like(e)])
            acc[0] += o
            acc[1] += e
        self.pending.clear()

    def summary(self) -> dict:
        return {
            "steps": len(self.step_db),
            "step_sqnr_db_mean": round(sum(self.step_db) / len(self.step_db), 2),
            "step_sqnr_db_min": round(min(self.step_db), 2),
            "summed_grad_sqnr_db": round(self._db([tuple(v) for v in self.cum.values()]), 2),
        }

    def check(self, tag: str, iters: int) -> dict:
        """Every step probed, each at >= STEP_SQNR_MIN_DB; returns the summary."""
        s = self.summary()
        assert s["steps"] == iters, f"{tag}: probed {s['steps']} of {iters} steps"
        assert s["step_sqnr_db_min"] >= STEP_SQNR_MIN_DB, f"{tag}: per-step gradient SQNR {self.step_db}"
        return s
