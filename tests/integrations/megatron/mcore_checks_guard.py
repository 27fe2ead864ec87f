"""The numerics guard on Megatron's FP8 buckets (2 gloo ranks, DP=2, several buckets).

One gradient bucket's data is made to stop fitting FP8 (a huge scale margin on that bucket's reduce-scatter, so
nearly every element underflows to zero, as outliers inside its blocks would do) from iteration 2 on: the guard
must send that bucket through Megatron's own collective on every rank at the same step, keep every other bucket
in FP8, and the loss must track the baseline; without the guard the same injection leaves the bucket's gradients
mostly zero and the loss drifts away. A healthy run never falls back.
"""

from __future__ import annotations

import logging

import mcore_checks as C
import mcore_train as T
import torch.distributed as dist

import fp8comm.comm as fcomm
from fp8comm.quant import Scaling

KW = dict(overlap_grad_reduce=True, overlap_param_gather=True)  # several buckets
GUARD = dict(guard=True, guard_threshold=0.05, guard_patience=2, guard_cooldown=100)
HOOKS = dict(grad_reduce=True, param_gather=True)
START = 2  # first iteration whose bucket "grad1" no longer fits


class Injection:
    """Wraps fp8comm.comm.<fn> (what the hook calls: reduce_scatter_into for gradient buckets, all_to_all for MoE
    tokens): bucket `key` gets a 2^20 scale margin from iteration START on (the guard's key when a guard runs,
    else the same bucket found by call order: the n-th gradient buffer met, or MoE layers taking turns)."""

    def __init__(self, key: str = "grad1", fn: str = "reduce_scatter_into", moe_layers: int = 2) -> None:
        self.key, self.fn, self.moe_layers = key, fn, moe_layers
        self.iteration, self.calls, self.injected = 0, {}, 0
        self.orig = getattr(fcomm, fn)

    def __enter__(self):
        def wrapped(*a, **kw):
            bucket = kw.get("guard")
            key = bucket.key if bucket is not None else self._key(a)
            if key == self.key and self.iteration >= START:
                kw["config"] = kw["config"].replace(scaling=Scaling(1, 128, "fp32", margin=20))
                self.injected += 1
            return self.orig(*a, **kw)

        setattr(fcomm, self.fn, wrapped)
        return self

    def _key(self, args) -> str:
        if self.fn == "all_to_all":  # fresh tokens each call: one dispatch per layer per micro-batch, in layer order
            n = self.calls["dispatches"] = self.calls.get("dispatches", 0) + 1
            return f"moe{(n - 1) % self.moe_layers}"
        return self.calls.setdefault(id(args[1]), f"grad{len(self.calls)}")

    def after_backward(self, i: int) -> None:
        self.iteration = i + 1

    def __exit__(self, *exc):
        setattr(fcomm, self.fn, self.orig)


def _run(hooks: dict, inject: bool, log_lines: list | None = None) -> dict:
    handler = None
    if log_lines is not None:
        handler = logging.Handler()
        handler.emit = lambda rec: log_lines.append(rec.getMessage())
        logging.getLogger("fp8comm.guard").addHandler(handler)
    try:
        if not inject:
            return C.run(KW, hooks, iters=C.ITERS)
        with Injection() as inj:
            run = C.run(KW, hooks, iters=C.ITERS, train_kw={"after_backward": inj.after_backward})
        run["injected_calls"] = inj.injected
        return run
    finally:
        if handler is not None:
            logging.getLogger("fp8comm.guard").removeHandler(handler)


def gpt_dp2_guard(rank, world, info):
    """Guard on: the injected bucket falls back on every rank at the same step, the others stay FP8, the loss
    tracks the baseline; guard off: the same injection costs loss; healthy data: no fallback."""
    T.init_parallel(tp=1)
    base = C.run(KW, None)
    healthy = _run(dict(HOOKS, **GUARD), inject=False)
    lines: list = []
    guarded = _run(dict(HOOKS, **GUARD), inject=True, log_lines=lines)
    unguarded = _run(HOOKS, inject=True)
    summary = guarded["hooks"].get("guard", {})
    info.update(
        healthy_switches=healthy["comm"].get("guard.to_bf16", {}).get("calls", 0),
        guard_hooks=summary,
        log=lines[:4],
        injected=guarded["injected_calls"],
        loss_base=[round(x, 4) for x in base["loss"][::4]],
        loss_guarded=[round(x, 4) for x in guarded["loss"][::4]],
        loss_unguarded=[round(x, 4) for x in unguarded["loss"][::4]],
    )
    rel_g = max(C._rel(a, b) for a, b in zip(guarded["loss"], base["loss"]))
    rel_u = max(C._rel(a, b) for a, b in zip(unguarded["loss"], base["loss"]))
    info.update(max_loss_rel_guarded=round(rel_g, 4), max_loss_rel_unguarded=round(rel_u, 4))
    hg = healthy["hooks"].get("guard", {})
    assert info["healthy_switches"] == 0 and not hg.get("switches") and not hg.get("grad_bf16_calls"), hg
    assert guarded["comm"]["guard.to_bf16"]["calls"] == 1, guarded["comm"]  # one bucket, once
    # the fallback happened on every rank at the same step: the same number of bf16 calls everywhere
    counts = [None] * world
    dist.all_gather_object(counts, summary)
    assert all(c == summary for c in counts), counts
    assert summary.get("grad_bf16_calls", 0) >= C.ITERS - START - 3, summary  # patience 2 + one step of lag
    assert guarded["hooks"]["grad_reduce_scatter"]["fp8_calls"] > 0  # the other buckets stayed FP8
    assert guarded["injected_calls"] <= 4 * guarded["bucket_groups"], guarded["injected_calls"]
    if rank == 0:
        assert any("grad1 -> BF16" in m for m in lines), lines
    C.check_replicas_identical(guarded["params"], "guard")
    assert rel_g <= C.LOSS_RTOL, f"guarded loss deviates by {rel_g:.4f}"
    assert rel_u > rel_g, f"the injection did not hurt without the guard ({rel_u:.4f} vs {rel_g:.4f})"
