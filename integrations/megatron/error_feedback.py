"""Error feedback for the FP8 gradient reduce-scatter: one fp8comm ErrorFeedback residual per Megatron bucket.

Keyed by the bucket's gradient buffer (`_ParamAndGradBucket.grad_data`, the tensor Megatron passes to the
reduce-scatter): Megatron's buckets are built once with the DDP wrapper and reuse that tensor every step, so its
identity is a stable key. A step the optimizer skips (inf/NaN found) zeroes every residual; state_dict(model) /
load_state_dict(model, sd) save and restore the residuals with a checkpoint (per rank: residuals differ by rank).
"""

from __future__ import annotations

import weakref

import torch

from fp8comm.comm import ErrorFeedback

from .config import Fp8CommMegatronError, count

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# id(grad_data) -> (weakref to grad_data, its ErrorFeedback). The weakref guards against a reused id after a
# buffer was freed (a new model in the same process): a dead or different referent gets a fresh residual.
_RESIDUALS: dict[int, tuple[weakref.ref, ErrorFeedback]] = {}
_DTYPE: list[torch.dtype] = [torch.float32]


def configure(dtype: str) -> None:
    """Set the residual dtype ('fp32' or 'bf16') for the residuals created from now on (install calls it)."""
    _DTYPE[0] = _DTYPES[dtype]


def reset_state() -> None:
    """Forget every residual (uninstall calls it)."""
    _RESIDUALS.clear()


def for_bucket(grad_data: torch.Tensor) -> ErrorFeedback:
    """The residual of the bucket whose gradient buffer is `grad_data` (created, zero, on first use)."""
    entry = _RESIDUALS.get(id(grad_data))
    if entry is not None and entry[0]() is grad_data:
        return entry[1]
    ef = ErrorFeedback(dtype=_DTYPE[0])
    _RESIDUALS[id(grad_data)] = (weakref.ref(grad_data), ef)
    return ef


def _live() -> list[ErrorFeedback]:
    return [ef for ref, ef in _RESIDUALS.values() if ref() is not None]


def reset_residuals() -> None:
    """Zero every residual: what a skipped optimizer step does (its gradients, and so their error, are dropped)."""
    for ef in _live():
        ef.reset()


def nbytes() -> int:
    """Bytes held by residuals in this process (fp32: 4 per element of each padded bucket, bf16: 2)."""
    return sum(ef.nbytes() for ef in _live())


def make_optimizer_step(orig, after=None):
    """Wrap a Megatron optimizer's step(): when it reports a skipped update, zero every residual; then after().

    MegatronOptimizer.step() returns (update_successful, grad_norm, num_zeros); update_successful is False when
    the loss scaler found inf/NaN. That step's gradients were reduced (and their error recorded) but are dropped.
    after: the end-of-step work of the other hooks (the numerics guard's decision), once per optimizer step.
    """

    def fp8comm_optimizer_step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if isinstance(out, tuple) and out and out[0] is False and _RESIDUALS:
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
    sd = {}
    for name, grad_data, dp in _bucket_buffers(model):
        entry = _RESIDUALS.get(id(grad_data))
        if entry is not None and entry[0]() is grad_data and entry[1].residual is not None:
            sd[name] = {**entry[1].state_dict(), "bucket_numel": grad_data.numel(), "dp_size": dp}
    return {"format": FORMAT, "residuals": sd}


FORMAT = "fp8comm.megatron.error_feedback/1"


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
    buckets = {name: (grad_data, dp) for name, grad_data, dp in _bucket_buffers(model)}
    dtype = str(_DTYPE[0]).removeprefix("torch.")
    problems, ok = [], []
    for name, st in sd["residuals"].items():
        if name not in buckets:
            problems.append(f"{name}: no such bucket in this model")
        elif (st["bucket_numel"], st["dp_size"]) != (buckets[name][0].numel(), buckets[name][1]):
            problems.append(
                f"{name}: saved for a bucket of {st['bucket_numel']} elements over {st['dp_size']} DP "
                f"ranks, this one has {buckets[name][0].numel()} over {buckets[name][1]}"
            )
        elif st.get("dtype") != dtype:
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
