"""Error-feedback residuals of one engine, kept per parameter, and the per-rank checkpoint file that carries them.

DeepSpeed regroups gradients between steps (the first step after a build buckets differently, ZeRO-1/2 merges
slices by owner), so a residual laid out like one call's send buffer would land on other parameters the next
step. Each parameter (keyed by its name in engine.module) owns one flat residual of its whole gradient; a hook
assembles the call's residual from the pieces it sends, hands it to the collective as an
fp8comm.comm.ErrorFeedback, and scatters the updated residual back.
"""

from __future__ import annotations

import logging
import os

import torch

from fp8comm.comm import ErrorFeedback, residual_dtype_name
from fp8comm.errors import Fp8CommStateError
from fp8comm.quant.residual import RESIDUAL_FORMATS, ResidualFormat, decode_residual, encode_residual

CHECKPOINT_FORMAT = 1
log = logging.getLogger("fp8comm.deepspeed")


def checkpoint_file(directory: str, tag: str, rank: int) -> str:
    """Where this rank's fp8comm state lives inside DeepSpeed's checkpoint folder `directory/tag`."""
    return os.path.join(directory, str(tag), f"fp8comm_rank{rank:05d}.pt")


class Residuals:
    """One residual per parameter (its whole flattened gradient), created as zeros on first use.

    dtype (gradients.residual_dtype, any accepted spelling): float32 / bfloat16 keep a tensor per parameter; fp8
    keeps its compact codes and scales (fp8comm.quant.residual: E5M2 codes, one power-of-two fp32 scale per
    parameter), decoded into the call's fp32 buffer by assemble() and encoded again by scatter().
    pieces for assemble/scatter: (key, param_numel, offset in the parameter, offset in the call's buffer, length)."""

    def __init__(self, dtype: str = "float32") -> None:
        self.name = residual_dtype_name(dtype)
        self.format: ResidualFormat | None = RESIDUAL_FORMATS.get(self.name)
        # the dtype of the call's assembled buffer (a compact residual is summed in fp32 by the collective)
        self.dtype = torch.float32 if self.format is not None else getattr(torch, self.name)
        self.store: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        self.skipped_step_resets = 0

    def _check(self, key: str, numel: int, have: int) -> None:
        if have != numel:
            raise Fp8CommStateError(
                f"fp8comm error feedback: parameter {key!r} has {numel} gradient elements but its "
                f"residual has {have} (a checkpoint of another model?)"
            )

    def _get(self, key: str, numel: int, device) -> torch.Tensor:
        """The parameter's residual values (compact: decoded, a new fp32 tensor; zeros when it has none yet)."""
        r = self.store.get(key)
        if r is None:
            r = torch.zeros(numel, dtype=self.dtype, device=device)
            if self.format is None:
                self.store[key] = r
            return r
        if isinstance(r, tuple):
            assert self.format is not None
            self._check(key, numel, r[0].numel())
            return decode_residual(r[0].to(device), r[1].to(device), self.format)
        self._check(key, numel, r.numel())
        return r

    def assemble(self, pieces: list, total: int, device) -> ErrorFeedback:
        """An ErrorFeedback whose residual is laid out like the call's (padded) send buffer of `total` elements."""
        buf = torch.zeros(total, dtype=self.dtype, device=device)
        values: dict[str, torch.Tensor] = {}
        for key, numel, src, dst, n in pieces:
            if key not in values:
                values[key] = self._get(key, numel, device)
            buf[dst : dst + n].copy_(values[key][src : src + n])
        return ErrorFeedback(dtype=self.dtype, residual=buf)

    def scatter(self, ef: ErrorFeedback, pieces: list, total: int) -> None:
        """Store the residual the collective left in `ef` back under each parameter (compact: re-encoded, once per
        parameter; a parameter only partly in this call keeps its other elements' values)."""
        buf = ef.residual
        if buf is None or buf.numel() != total:
            raise Fp8CommStateError(
                f"fp8comm error feedback: the collective left a residual of "
                f"{None if buf is None else buf.numel()} elements for a buffer of {total}; its "
                "layout is no longer the send buffer's (fp8comm.comm changed?)"
            )
        if self.format is None:
            for key, _, src, dst, n in pieces:
                r = self.store[key]
                assert isinstance(r, torch.Tensor)
                r[src : src + n].copy_(buf[dst : dst + n])
            return
        values: dict[str, torch.Tensor] = {}
        for key, numel, src, dst, n in pieces:
            if key not in values:
                whole = src == 0 and n == numel  # the whole parameter is in this call: nothing to keep
                values[key] = (
                    torch.empty(numel, dtype=torch.float32, device=buf.device)
                    if whole
                    else self._get(key, numel, buf.device)
                )
            values[key][src : src + n].copy_(buf[dst : dst + n])
        for key, v in values.items():
            self.store[key] = encode_residual(v, self.format)

    def reset(self) -> None:
        """Zero every residual: a step DeepSpeed skipped (inf/NaN) drops its gradients, and their error with them."""
        for r in self.store.values():
            (r[0] if isinstance(r, tuple) else r).zero_()  # FP8 code 0 is +0 whatever the scale
        self.skipped_step_resets += 1

    def nbytes(self) -> int:
        parts = [t for r in self.store.values() for t in (r if isinstance(r, tuple) else (r,))]
        return sum(t.numel() * t.element_size() for t in parts)

    def norm(self) -> float:
        if not self.store:
            return 0.0
        return float(sum(self._values(k).square().sum() for k in self.store) ** 0.5)

    def _values(self, key: str) -> torch.Tensor:
        r = self.store[key]
        if isinstance(r, tuple):
            assert self.format is not None
            return decode_residual(r[0], r[1], self.format)
        return r.float()

    def state_dict(self) -> dict:
        """{"dtype": name, "residuals": {key: tensor}}; compact: {key: {"codes": uint8, "scales": uint8}}."""
        res: dict = {}
        for k, r in self.store.items():
            res[k] = {"codes": r[0].clone(), "scales": r[1].clone()} if isinstance(r, tuple) else r.clone()
        return {"dtype": self.name, "residuals": res}

    def load_state_dict(self, sd: dict) -> None:
        """Bit-identical restore of state_dict(); a compact engine also loads float32/bfloat16 residuals (written
        before the switch), encoding them with a log line that says so."""
        saved = str(sd.get("dtype"))
        got = RESIDUAL_DTYPES_SAVED.get(saved, saved)
        if got == self.name:
            self.store = {
                k: (r["codes"].clone(), r["scales"].clone()) if isinstance(r, dict) else r.clone()
                for k, r in sd["residuals"].items()
            }
            return
        if self.format is not None and got in ("float32", "bfloat16"):
            self.store = {k: encode_residual(r.reshape(-1), self.format) for k, r in sd["residuals"].items()}
            log.warning(
                "fp8comm: converted %d error-feedback residuals from the checkpoint's %s to %s (%s), %d -> %d bytes",
                len(self.store),
                got,
                self.name,
                self.format.describe(),
                sum(r.numel() * r.element_size() for r in sd["residuals"].values()),
                self.nbytes(),
            )
            return
        raise Fp8CommStateError(
            f"fp8comm error feedback: the checkpoint's residuals are {saved}, this engine keeps {self.name} "
            "(fp8_comm.gradients.residual_dtype differs; only float32/bfloat16 -> fp8 is converted)"
        )


# dtype names a checkpoint may carry -> today's names
RESIDUAL_DTYPES_SAVED = {"fp32": "float32", "bf16": "bfloat16"}
