"""Error feedback for the FP8 gradient reduce-scatter: one fp8comm ErrorFeedback residual per Megatron bucket.

Keyed by the bucket's gradient buffer (`_ParamAndGradBucket.grad_data`, the tensor Megatron passes to the
reduce-scatter): Megatron's buckets are built once with the DDP wrapper and reuse that tensor every step, so its
identity is a stable key. A step the optimizer skips (inf/NaN found) zeroes every residual; state_dict(model) /
load_state_dict(model, sd) save and restore the residuals with a checkpoint (per rank: residuals differ by rank).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from fp8comm.comm import ErrorFeedback

from .config import Fp8CommMegatronError, count
from .installation import current, installed


def for_bucket(grad_data: torch.Tensor) -> ErrorFeedback:
    """The residual of the bucket whose gradient buffer is `grad_data` (created, zero, on first use).

    Kept by the installation, keyed by id(grad_data) with a weak reference: a dead or different referent (a new
    model in the same process reusing the id) gets a fresh residual."""
    inst = installed()
    entry = inst.residuals.get(id(grad_data))
    if entry is not None and entry[0]() is grad_data:
        return entry[1]
    ef = ErrorFeedback(dtype=inst.residual_dtype)
    inst.residuals[id(grad_data)] = (weakref.ref(grad_data), ef)
    return ef


def _live() -> list[ErrorFeedback]:
    inst = current()
    return [] if inst is None else [ef for ref, ef in inst.residuals.values() if ref() is not None]


def reset_residuals() -> None:
    """Zero every residual: what a skipped optimizer step does (its gradients, and so their error, are dropped)."""
    for ef in _live():
        ef.reset()


def nbytes() -> int:
    """Bytes held by residuals in this process (float32: 4 per element of each padded bucket, bfloat16: 2, fp8: 1
    plus a 4-byte scale per bucket)."""
    return sum(ef.nbytes() for ef in _live())


def make_optimizer_step(orig, after=None):
    """Wrap a Megatron optimizer's step(): when it reports a skipped update, zero every residual; then after().

    MegatronOptimizer.step() returns (update_successful, grad_norm, num_zeros); update_successful is False when
    the loss scaler found inf/NaN. That step's gradients were reduced (and their error recorded) but are dropped.
    after: the end-of-step work of the other hooks (the numerics guard's decision), once per optimizer step.
    """

    def fp8comm_optimizer_step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if isinstance(out, tuple) and out and out[0] is False and installed().residuals:
            reset_residuals()
            count("error_feedback", "skipped_step_resets")
        if after is not None:
            after()
        return out

    fp8comm_optimizer_step.__wrapped__ = orig
    return fp8comm_optimizer_step


def _bucket_buffers(model) -> list[tuple[str, torch.Tensor, int]]:
    """(stable name, grad_data, DP size) of every bucket of every DDP model chunk, in Megatron's order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for c, chunk in enumerate(chunks):
        for kind in ("bucket_groups", "expert_parallel_bucket_groups"):
            if not hasattr(chunk, kind):
                raise Fp8CommMegatronError(
                    f"fp8comm: error feedback state needs Megatron's DistributedDataParallel "
                    f"model chunks (with .{kind}); got {type(chunk).__name__}"
                )
            for g, group in enumerate(getattr(chunk, kind)):
                for k, bucket in enumerate(group.buckets):
                    out.append(
                        (
                            f"chunk{c}.{kind}{g}.bucket{k}",
                            bucket.grad_data,
                            int(group.intra_distributed_optimizer_instance_size),
                        )
                    )
    return out


def state_dict(model) -> dict:
    """This rank's residuals, keyed by bucket position ('chunk0.bucket_groups3.bucket0'): save one per rank."""
    sd: dict = {}
    inst = current()
    residuals = {} if inst is None else inst.residuals
    for name, grad_data, dp in _bucket_buffers(model):
        entry = residuals.get(id(grad_data))
        if entry is not None and entry[0]() is grad_data and entry[1].stored():
            sd[name] = {**entry[1].state_dict(), "bucket_numel": grad_data.numel(), "dp_size": dp}
    return {"format": FORMAT, "residuals": sd, "levels": levels_signature()}


def levels_signature() -> list:
    """The two-level data-parallel groups and their node size (empty: every group flat): a residual is the
    quantization error of this rank's own chunks (flat) or of its node's sum on its rail (two-level), so it only
    means something under the layout it was kept for."""
    inst = current()
    splits = {} if inst is None else inst.node_groups
    return sorted([list(s.ranks), s.local] for s in splits.values() if getattr(s, "two_level", False))


FORMAT = "fp8comm.megatron.error_feedback/1"


def _levels_text(sig: list) -> str:
    if not sig:
        return "flat"
    return "two-level (" + ", ".join(f"{len(r) // n} nodes x {n} over ranks {r}" for r, n in sig) + ")"


def load_state_dict(model, sd: dict, strict: bool = True) -> None:
    """Restore residuals saved by state_dict() for the same model layout (DP size, buckets) on the same rank.

    strict: a residual for a bucket this model lacks, of another size or dtype is an error (strict=False drops
    it: that bucket starts from zero). Buckets absent from `sd` start from zero either way.
    """
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise Fp8CommMegatronError(
            f"fp8comm: not an error-feedback state dict from state_dict() (format "
            f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r})"
        )
    inst = current()
    if inst is None or not inst.cfg.error_feedback:
        raise Fp8CommMegatronError(
            "fp8comm: load_error_feedback_state_dict needs an installation with error feedback on: "
            "install(..., error_feedback=True) (or --fp8comm-error-feedback) first, then load"
        )
    saved, now = sd.get("levels", []), levels_signature()
    if saved != now:
        # Across the two-level switch a residual belongs to other data (and has another size): start from zero.
        reset_residuals()
        count("error_feedback", "levels_resets")
        warnings.warn(
            f"fp8comm: error-feedback residuals were saved with {_levels_text(saved)} gradient collectives, this run "
            f"uses {_levels_text(now)} (--fp8comm-hierarchical or the node layout changed): residuals restart from "
            "zero",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    buckets = {name: (grad_data, dp) for name, grad_data, dp in _bucket_buffers(model)}
    dtype = inst.residual_dtype
    # float32/bfloat16 residuals (a checkpoint from before a switch to fp8) load into fp8 ones, converted
    convertible = ("float32", "bfloat16") if dtype == "fp8" else ()
    problems, ok = [], []
    for name, st in sd["residuals"].items():
        if name not in buckets:
            problems.append(f"{name}: no such bucket in this model")
        elif (st["bucket_numel"], st["dp_size"]) != (buckets[name][0].numel(), buckets[name][1]):
            problems.append(
                f"{name}: saved for a bucket of {st['bucket_numel']} elements over {st['dp_size']} DP "
                f"ranks, this one has {buckets[name][0].numel()} over {buckets[name][1]}"
            )
        elif st.get("dtype") != dtype and st.get("dtype") not in convertible:
            problems.append(
                f"{name}: residual saved as {st.get('dtype')}, this run keeps {dtype} (--fp8comm-error-feedback-dtype)"
            )
        else:
            ok.append(name)
    if problems and strict:
        raise Fp8CommMegatronError(
            "fp8comm: error-feedback state does not match this model (same DP size and "
            "bucket layout needed; strict=False starts those buckets from zero):\n  - " + "\n  - ".join(problems)
        )
    for name in ok:
        for_bucket(buckets[name][0]).load_state_dict(sd["residuals"][name])
