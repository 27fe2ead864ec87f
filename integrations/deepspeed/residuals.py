"""Error-feedback residuals of one engine, kept per parameter, and the per-rank checkpoint file that carries them.

DeepSpeed regroups gradients between steps (the first step after a build buckets differently, ZeRO-1/2 merges
slices by owner), so a residual laid out like one call's send buffer would land on other parameters the next
step. Each parameter (keyed by its name in engine.module) owns one flat residual of its whole gradient; a hook
assembles the call's residual from the pieces it sends, hands it to the collective as an
fp8comm.comm.ErrorFeedback, and scatters the updated residual back.

The bucket layout is the same from one step to the next almost always, so a float32/bfloat16 call buffer whose
parameters lie wholly inside it stays resident after the call: it IS those parameters' residual storage (their
per-parameter tensors are dropped, no memory is added), the next call with the same layout gets it back with only
its gaps zeroed, and nothing is copied either way (before: a fresh zeroed buffer, every piece copied in and out,
three passes over 4 bytes per parameter per step). Anything else that needs a parameter's residual (another
layout, a checkpoint, `store`) moves it back into its own tensor first. A two-level call quantizes only its rail's
part of the send buffer across the nodes (`window`), so its residual, resident or not, is that part alone: the
parameters' values outside it are zero (another rank makes and keeps that error).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

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
        self._store: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        # resident call buffers (float32/bfloat16 only): layout -> (buffer, gaps), and where each key lives
        self._resident: dict[tuple, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
        self._home: dict[str, _Layout] = {}
        self._layouts: dict[tuple, _Layout] = {}
        # calls that found their buffer resident / left it resident / copied in and out; buffers moved back
        self.calls = {"resident": 0, "kept": 0, "copied": 0, "moved_back": 0}
        self.skipped_step_resets = 0

    @property
    def store(self) -> dict:
        """{parameter key: its residual} (compact: (codes, scales)); resident buffers are moved back first."""
        for lay in {id(v): v for v in self._home.values()}.values():
            if lay.key in self._resident:
                self._evict(lay)
        return self._store

    def count(self) -> int:
        """How many parameters have a residual (without moving resident buffers back)."""
        return len(self._store) + len(self._home)

    def clear(self) -> None:
        """Drop every residual (they restart from zero)."""
        self._store.clear()
        self._resident.clear()
        self._home.clear()

    def _layout(self, pieces: list, total: int, window) -> _Layout:
        key = (total, tuple(pieces), tuple(window or ()))
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > 64:  # layouts repeat; a run that never repeats must not grow this
                self._layouts.clear()
            lay = self._layouts[key] = _Layout.of(pieces, total, window)
        return lay

    def _evict(self, lay: _Layout) -> None:
        """Move a resident buffer's values back into per-parameter tensors (zero outside the window) and forget it."""
        buf, _ = self._resident.pop(lay.key)
        self.calls["moved_back"] += 1
        for key, numel in lay.numels.items():
            self._store[key] = torch.zeros(numel, dtype=self.dtype, device=buf.device)
            self._home.pop(key, None)
        for key, _, src, dst, n in lay.kept:
            r = self._store[key]
            assert isinstance(r, torch.Tensor)
            r[src : src + n].copy_(buf[dst : dst + n])

    def _check(self, key: str, numel: int, have: int) -> None:
        if have != numel:
            raise Fp8CommStateError(
                f"fp8comm error feedback: parameter {key!r} has {numel} gradient elements but its "
                f"residual has {have} (a checkpoint of another model?)"
            )

    def _get(self, key: str, numel: int, device) -> torch.Tensor:
        """The parameter's residual values (compact: decoded, a new fp32 tensor; zeros when it has none yet)."""
        if key in self._home:
            self._evict(self._home[key])
        r = self._store.get(key)
        if r is None:
            r = torch.zeros(numel, dtype=self.dtype, device=device)
            if self.format is None:
                self._store[key] = r
            return r
        if isinstance(r, tuple):
            assert self.format is not None
            self._check(key, numel, r[0].numel())
            return decode_residual(r[0].to(device), r[1].to(device), self.format)
        self._check(key, numel, r.numel())
        return r

    def assemble(self, pieces: list, total: int, device, window=None) -> ErrorFeedback:
        """An ErrorFeedback for the call: its residual laid out like the call's (padded) send buffer of `total`
        elements, or, with `window` ([(start, end, to)]: the send-buffer ranges this rank's quantization covers,
        e.g. its rail under two levels), only those ranges, packed (range i at `to`); the parameters' values
        outside the window are zero once the call is scattered back (another rank keeps their error)."""
        lay = self._layout(pieces, total, window)
        got = self._resident.get(lay.key)
        if got is not None:  # the same layout as a call that left its buffer resident: zero its gaps only
            self.calls["resident"] += 1
            buf, gaps = got
            for a, b in gaps:
                buf[a:b].zero_()
            return ErrorFeedback(dtype=self.dtype, residual=buf)
        buf = torch.zeros(lay.size, dtype=self.dtype, device=device)
        values: dict[str, torch.Tensor] = {}
        for key, numel, src, dst, n in lay.kept:
            if key not in values:
                values[key] = self._get(key, numel, device)
            buf[dst : dst + n].copy_(values[key][src : src + n])
        return ErrorFeedback(dtype=self.dtype, residual=buf)

    def scatter(self, ef: ErrorFeedback, pieces: list, total: int, window=None) -> None:
        """Store the residual the collective left in `ef` back under each parameter (compact: re-encoded, once per
        parameter; a parameter only partly in this call keeps its other elements' values). `window`: assemble's."""
        lay = self._layout(pieces, total, window)
        buf = ef.residual
        if buf is None or buf.numel() != lay.size:
            raise Fp8CommStateError(
                f"fp8comm error feedback: the collective left a residual of "
                f"{None if buf is None else buf.numel()} elements for a buffer of {lay.size}; its "
                "layout is no longer the send buffer's (fp8comm.comm changed?)"
            )
        if self.format is None:
            got = self._resident.get(lay.key)
            if got is not None:  # updated in place (or handed back as another tensor: that one stays)
                self._resident[lay.key] = (buf, got[1])
                return
            if lay.gaps is not None and buf.dtype == self.dtype:
                for key in lay.numels:
                    if key in self._home:
                        self._evict(self._home[key])
                    self._store.pop(key, None)
                    self._home[key] = lay
                self._resident[lay.key] = (buf, lay.gaps)
                self.calls["kept"] += 1
                return
            values = {key: self._get(key, numel, buf.device) for key, numel, *_ in lay.pieces}
        else:
            values = {}
            for key, numel, src, _, n in lay.pieces:
                if key not in values:
                    whole = src == 0 and n == numel  # the whole parameter is in this call: nothing to keep
                    values[key] = (
                        torch.zeros(numel, dtype=torch.float32, device=buf.device)
                        if whole
                        else self._get(key, numel, buf.device)
                    )
        self.calls["copied"] += 1
        if lay.windowed:
            for key, _, src, _, n in lay.pieces:
                values[key][src : src + n].zero_()
        for key, _, src, dst, n in lay.kept:
            values[key][src : src + n].copy_(buf[dst : dst + n])
        if self.format is not None:
            for key, v in values.items():
                self._store[key] = encode_residual(v, self.format)

    def reset(self) -> None:
        """Zero every residual: a step DeepSpeed skipped (inf/NaN) drops its gradients, and their error with them."""
        for r in self._store.values():
            (r[0] if isinstance(r, tuple) else r).zero_()  # FP8 code 0 is +0 whatever the scale
        for buf, _ in self._resident.values():
            buf.zero_()
        self.skipped_step_resets += 1

    def nbytes(self) -> int:
        parts = [t for r in self._store.values() for t in (r if isinstance(r, tuple) else (r,))]
        parts += [buf for buf, _ in self._resident.values()]
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
        self.clear()
        if got == self.name:
            self._store = {
                k: (r["codes"].clone(), r["scales"].clone()) if isinstance(r, dict) else r.clone()
                for k, r in sd["residuals"].items()
            }
            return
        if self.format is not None and got in ("float32", "bfloat16"):
            self._store = {k: encode_residual(r.reshape(-1), self.format) for k, r in sd["residuals"].items()}
            log.warning(
                "fp8comm: converted %d error-feedback residuals from the checkpoint's %s to %s (%s), %d -> %d bytes",
                len(self._store),
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


@dataclass(frozen=True)
class _Layout:
    """One call's residual layout: its pieces in the send buffer, the window the call's residual covers, the
    pieces inside it in the residual buffer's coordinates (`kept`), and the buffer's gaps when it may stay resident
    (every parameter wholly in the call, no overlaps, at most a quarter gaps; None otherwise)."""

    key: tuple
    pieces: tuple
    kept: tuple
    size: int
    windowed: bool
    numels: dict
    gaps: list | None

    @staticmethod
    def of(pieces: list, total: int, window) -> _Layout:
        ranges = list(window) if window else [(0, total, 0)]
        kept = []
        for key, numel, src, dst, n in pieces:
            for a, b, to in ranges:
                lo, hi = max(dst, a), min(dst + n, b)
                if lo < hi:
                    kept.append((key, numel, src + lo - dst, to + lo - a, hi - lo))
        size = max((to + b - a for a, b, to in ranges), default=0)
        numels: dict[str, int] = {}
        covered: dict[str, int] = {}
        for key, numel, _, _, n in pieces:
            numels[key] = numel
            covered[key] = covered.get(key, 0) + n
        return _Layout(
            (total, tuple(pieces), tuple(window or ())),
            tuple(pieces),
            tuple(kept),
            size,
            bool(window),
            numels,
            _gaps(kept, size) if all(covered[k] == numels[k] for k in numels) and _disjoint(pieces) else None,
        )


def _disjoint(pieces) -> bool:
    spans = sorted((dst, dst + n) for _, _, _, dst, n in pieces)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _gaps(kept: list, size: int) -> list[tuple[int, int]] | None:
    """The ranges of [0, size) no kept piece covers, or None when they are over a quarter of it (per-parameter
    tensors then use less memory than the buffer)."""
    gaps, pos = [], 0
    for a, b in sorted((dst, dst + n) for _, _, _, dst, n in kept):
        if a < pos:
            return None
        if a > pos:
            gaps.append((pos, a))
        pos = b
    if pos > size:
        return None
    if pos < size:
        gaps.append((pos, size))
    if 4 * sum(b - a for a, b in gaps) > size:
        return None
    return gaps


# dtype names a checkpoint may carry -> today's names
RESIDUAL_DTYPES_SAVED = {"fp32": "float32", "bf16": "bfloat16"}
