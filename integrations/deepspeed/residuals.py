"""Error-feedback residuals of one engine, kept per parameter, and the per-rank checkpoint file that carries them.

DeepSpeed regroups gradients between steps (the first step after a build buckets differently, ZeRO-1/2 merges
slices by owner), so a residual laid out like one call's send buffer would land on other parameters the next
step. Each parameter (keyed by its name in engine.module) owns one flat residual of its whole gradient; a hook
assembles the call's residual from the pieces it sends, hands it to the collective as an
fp8comm.comm.ErrorFeedback, and scatters the updated residual back.
"""

from __future__ import annotations

import os

import torch

from fp8comm.comm import ErrorFeedback
from fp8comm.errors import Fp8CommStateError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHECKPOINT_FORMAT = 1


def checkpoint_file(directory: str, tag: str, rank: int) -> str:
    """Where this rank's fp8comm state lives inside DeepSpeed's checkpoint folder `directory/tag`."""
    return os.path.join(directory, str(tag), f"fp8comm_rank{rank:05d}.pt")


class Residuals:
    """One residual per parameter (its whole flattened gradient, in `dtype`), created as zeros on first use.

    pieces for assemble/scatter: (key, param_numel, offset in the parameter, offset in the call's buffer, length)."""

    def __init__(self, dtype: str = "fp32") -> None:
        self.dtype = DTYPES[dtype]
        self.store: dict[str, torch.Tensor] = {}
        self.skipped_step_resets = 0

    def _get(self, key: str, numel: int, device) -> torch.Tensor:
        r = self.store.get(key)
        if r is None:
            r = self.store[key] = torch.zeros(numel, dtype=self.dtype, device=device)
        elif r.numel() != numel:
            raise Fp8CommStateError(
                f"fp8comm error feedback: parameter {key!r} has {numel} gradient elements but its "
                f"residual has {r.numel()} (a checkpoint of another model?)"
            )
        return r

    def assemble(self, pieces: list, total: int, device) -> ErrorFeedback:
        """An ErrorFeedback whose residual is laid out like the call's (padded) send buffer of `total` elements."""
        buf = torch.zeros(total, dtype=self.dtype, device=device)
        for key, numel, src, dst, n in pieces:
            buf[dst : dst + n].copy_(self._get(key, numel, device)[src : src + n])
        return ErrorFeedback(dtype=self.dtype, residual=buf)

    def scatter(self, ef: ErrorFeedback, pieces: list, total: int) -> None:
        """Store the residual the collective left in `ef` back under each parameter."""
        buf = ef.residual
        if buf is None or buf.numel() != total:
            raise Fp8CommStateError(
                f"fp8comm error feedback: the collective left a residual of "
                f"{None if buf is None else buf.numel()} elements for a buffer of {total}; its "
                "layout is no longer the send buffer's (fp8comm.comm changed?)"
            )
        for key, _, src, dst, n in pieces:
            self.store[key][src : src + n].copy_(buf[dst : dst + n])

    def reset(self) -> None:
        """Zero every residual: a step DeepSpeed skipped (inf/NaN) drops its gradients, and their error with them."""
        for r in self.store.values():
            r.zero_()
        self.skipped_step_resets += 1

    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.store.values())

    def norm(self) -> float:
        return float(sum(r.float().square().sum() for r in self.store.values()) ** 0.5) if self.store else 0.0

    def state_dict(self) -> dict:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "residuals": {k: r.clone() for k, r in self.store.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        want = str(self.dtype).removeprefix("torch.")
        if sd.get("dtype") != want:
            raise Fp8CommStateError(
                f"fp8comm error feedback: the checkpoint's residuals are {sd.get('dtype')}, this "
                f"engine keeps {want} (fp8_comm.gradients.residual_dtype differs)"
            )
        self.store = {k: r.clone() for k, r in sd["residuals"].items()}
