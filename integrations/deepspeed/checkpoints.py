"""fp8comm's per-rank checkpoint file beside DeepSpeed's: error-feedback residuals, the guard's state, 4-bit replicas.

wrap(es, engine) wraps the engine's save_checkpoint/load_checkpoint; a load also bumps the engine's generation
(FP8 GEMM weight caches). A resume across a change of the two-level layout restarts the residuals from zero.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from fp8comm.errors import Fp8CommStateError

from . import levels, updates
from .patching import log, wrap_method
from .residuals import CHECKPOINT_FORMAT, checkpoint_file


def wrap(es, engine) -> None:
    """save_checkpoint/load_checkpoint carry this rank's residuals (and guard state) in a per-rank file next to
    DeepSpeed's (residuals differ by rank); a load also invalidates FP8 GEMM weight caches."""

    def make_save(save):
        @functools.wraps(save)
        def save_checkpoint(save_dir, tag=None, *a, **k):
            tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
            out = save(save_dir, tag, *a, **k)
            state = state_of(es)
            if state:
                path = checkpoint_file(save_dir, tag, dist.get_rank())
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(state, path)
            return out

        return save_checkpoint

    def make_load(load):
        @functools.wraps(load)
        def load_checkpoint(load_dir, tag=None, *a, **k):
            try:
                out = load(load_dir, tag, *a, **k)
            finally:
                es.generation += 1
            # DeepSpeed's order after tag: load_module_strict, load_optimizer_states, load_lr_scheduler_states,
            # load_module_only
            optim = k.get("load_optimizer_states", a[1] if len(a) > 1 else True)
            module_only = k.get("load_module_only", a[3] if len(a) > 3 else False)
            if out is not None and out[0] is not None and optim and not module_only:
                if tag is None:
                    with open(os.path.join(load_dir, "latest")) as f:
                        tag = f.read().strip()
                load_state(es, checkpoint_file(load_dir, tag, dist.get_rank()))
            return out

        return load_checkpoint

    if es.residuals is not None or es.guard is not None or es.updates is not None:
        wrap_method(es, engine, "save_checkpoint", make_save)
    wrap_method(es, engine, "load_checkpoint", make_load)


def state_of(es) -> dict:
    state: dict[str, Any] = {}
    if es.residuals is not None:
        # the two-level groups the residuals were kept for: a resume across the switch resets them (load_state)
        state["error_feedback"] = {**es.residuals.state_dict(), "levels": levels.signature(es.splits)}
    if es.guard is not None:
        state["guard"] = es.guard.state_dict()
    if es.updates is not None:
        state["replica_updates"] = updates.replica_state(es)
    return {"format": CHECKPOINT_FORMAT, **state} if state else {}


def load_state(es, path: str) -> None:
    if es.residuals is None and es.guard is None and es.updates is None:
        return
    if not os.path.exists(path):
        # Not an error (a checkpoint saved without error feedback or guard), but never silent.
        es.acct.hit("checkpoint.no_fp8comm_state")
        log.warning(
            f"fp8comm: {path} not found; error-feedback residuals start at zero, the guard from scratch, and "
            "weight replicas from DeepSpeed's gather of the fp32 master"
        )
        if es.residuals is not None:
            es.residuals.clear()
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    if es.residuals is not None:
        if "error_feedback" not in state:
            raise Fp8CommStateError(
                f"fp8comm: {path} holds no error-feedback residuals, but this engine has "
                "fp8_comm.gradients.error_feedback on"
            )
        saved = state["error_feedback"].get("levels", [])
        if saved != levels.signature(es.splits):
            # A residual is the quantization error of what this rank sent: its own chunks (flat) or its node's
            # sum on its rail (two-level). Across the switch it belongs to other data: start from zero.
            es.acct.hit("checkpoint.residuals_reset_levels")
            es.residuals.clear()
            if dist.get_rank() == 0:
                log.warning(
                    f"fp8comm: {path}: error-feedback residuals were saved with "
                    f"{_levels_text(saved)} collectives, this run uses {_levels_text(levels.signature(es.splits))} "
                    "(fp8_comm.hierarchical or the node layout changed): residuals restart from zero"
                )
        else:
            es.residuals.load_state_dict({k: v for k, v in state["error_feedback"].items() if k != "levels"})
    if es.guard is not None and "guard" in state:
        es.guard.load_state_dict(state["guard"])
    if es.updates is not None:
        if "replica_updates" in state:
            updates.load_replica_state(es, state["replica_updates"])
        else:  # DeepSpeed's load re-gathered the replicas from the master in full: consistent, not the saved ones
            es.acct.hit("checkpoint.no_replica_state")
            log.warning(f"fp8comm: {path} holds no weight-replica state; replicas restart from the fp32 master")
    es.acct.hit("checkpoint.fp8comm_state_loaded")


def _levels_text(sig: list) -> str:
    if not sig:
        return "flat"
    return "two-level (" + ", ".join(f"{len(r) // n} nodes x {n} over ranks {r}" for r, n in sig) + ")"
