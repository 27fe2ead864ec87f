"""GEMM telemetry: routing counters (always on, host-side) and per-layer, per-role quantization statistics.

Counters (`count`, `counters`, `reset_counters`) record every GEMM routing decision (backend, padding, fallback)
so a fallback is never silent. `Telemetry` is opt-in (it reads values back from the device): attach it to a model
and each quantization of an input, weight or gradient records amax, the scales (as log2, the seed paper's "scale
bias" up to sign), the fraction that underflowed to zero, the fraction that saturated, and inf/NaN counts.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

import torch

from ..errors import Fp8CommError
from .linear import Fp8Linear
from .routing import ROUTING


def count(key: str, n: int = 1) -> None:
    ROUTING.count(key, n)


def counters(prefix: str = "") -> dict[str, int]:
    """A snapshot of the routing and telemetry counters whose key starts with `prefix`."""
    return ROUTING.snapshot(prefix)


def reset_counters() -> None:
    ROUTING.reset(counters_only=True)


@dataclass
class Record:
    """One quantization of one tensor: `scale_log2_*` summarize log2 of its dequant scales over the blocks that
    hold a non-zero value."""

    step: int
    layer: str
    role: str
    fmt: str
    amax: float
    scale_log2_min: float
    scale_log2_median: float
    scale_log2_max: float
    underflow: float  # fraction of finite non-zero inputs that became zero
    overflow: float  # fraction of finite inputs beyond fmt.max * scale (saturated)
    nonfinite: int  # inf/NaN elements in the input (they stay inf/NaN in the codes)
    numel: int


class Telemetry:
    """Per-layer, per-role statistics, sampled every `interval` steps (call `step()` once per optimizer step)."""

    def __init__(self, interval: int = 1, roles: tuple[str, ...] = ("input", "weight", "grad")):
        if interval < 1:
            raise Fp8CommError(f"interval must be >= 1, got {interval}")
        self.interval = interval
        self.roles = roles
        self.step_count = 0
        self.records: list[Record] = []
        self.nonfinite: Counter = Counter()  # (layer, role) -> inf/NaN elements seen, counted at every sample

    def attach(self, model: torch.nn.Module) -> Telemetry:
        """Record for every Fp8Linear in `model` (named by its module path)."""
        n = 0
        for name, m in model.named_modules():
            if isinstance(m, Fp8Linear):
                m.telemetry, m.fp8_name = self, name or m.fp8_name
                n += 1
        if n == 0:
            raise Fp8CommError("attach: the model has no Fp8Linear modules (convert it with convert_to_fp8 first)")
        return self

    def step(self) -> None:
        self.step_count += 1

    def active(self, role: str) -> bool:
        return role in self.roles and self.step_count % self.interval == 0

    @torch.no_grad()
    def record(self, layer: str, role: str, x: torch.Tensor, q) -> None:
        """Statistics of quantizing `x` into Fp8Tensor `q` (same [rows, K] view)."""
        from ..quant.reference import expand_scale

        x2 = x.reshape(q.data.shape).float()
        finite = torch.isfinite(x2)
        nonfinite = int((~finite).sum())
        self.nonfinite[(layer, role)] += nonfinite
        if nonfinite:
            count(f"nonfinite.{role}", nonfinite)
        codes = q.data.float()
        nz = finite & (x2 != 0)
        n_nz = int(nz.sum())
        under = int((nz & (codes == 0)).sum()) / n_nz if n_nz else 0.0
        m, k = x2.shape
        lim = expand_scale(q.scale.float(), m, k, q.scaling) * q.fmt.max if x2.numel() else x2
        n_fin = int(finite.sum())
        over = int((finite & (x2.abs() > lim)).sum()) / n_fin if n_fin else 0.0
        ls = q.scale.float().reshape(-1)
        if q.amax is not None and q.amax.numel() == ls.numel():  # all-zero blocks get scale 1 by convention:
            ls = ls[q.amax.reshape(-1) > 0]  # they carry no information, leave them out
        ls = torch.log2(ls)
        if ls.numel() == 0:
            ls = torch.zeros(1)
        amax = float(q.amax.max()) if q.amax is not None and q.amax.numel() else 0.0
        self.records.append(
            Record(
                self.step_count,
                layer,
                role,
                q.fmt.name,
                amax,
                float(ls.min()),
                float(ls.median()),
                float(ls.max()),
                under,
                over,
                nonfinite,
                x2.numel(),
            )
        )

    def to_jsonl(self, path: str) -> None:
        with open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps(asdict(r)) + "\n")

    def summary(self) -> list[dict]:
        """One row per (layer, role): sample count, last amax and scale, mean under/overflow, inf/NaN total."""
        groups = defaultdict(list)
        for r in self.records:
            groups[(r.layer, r.role)].append(r)
        rows = []
        for (layer, role), rs in groups.items():
            rows.append(
                dict(
                    layer=layer,
                    role=role,
                    samples=len(rs),
                    amax=rs[-1].amax,
                    scale_log2=rs[-1].scale_log2_median,
                    underflow=sum(r.underflow for r in rs) / len(rs),
                    overflow=sum(r.overflow for r in rs) / len(rs),
                    nonfinite=self.nonfinite[(layer, role)],
                )
            )
        return rows

    def plot(self, path: str, title: str = "") -> None:
        """Scale bias (-log2 of the dequant scale, the seed paper's bias) over training, one panel per role and
        one line per layer (block recipes: the median over blocks with the min-max band)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        roles = [r for r in self.roles if any(rec.role == r for rec in self.records)]
        if not roles:
            raise Fp8CommError("no telemetry records to plot (was the Telemetry attached and the model run?)")
        fig, axes = plt.subplots(1, len(roles), figsize=(5 * len(roles), 3.8), squeeze=False)
        layers = list(dict.fromkeys(r.layer for r in self.records))
        cmap = plt.get_cmap("viridis")
        for ax, role in zip(axes[0], roles):
            for i, layer in enumerate(layers):
                rs = [r for r in self.records if r.layer == layer and r.role == role]
                if not rs:
                    continue
                c = cmap(i / max(len(layers) - 1, 1))
                steps = [r.step for r in rs]
                ax.plot(steps, [-r.scale_log2_median for r in rs], color=c, lw=1, label=layer)
                if any(r.scale_log2_min != r.scale_log2_max for r in rs):
                    ax.fill_between(
                        steps,
                        [-r.scale_log2_max for r in rs],
                        [-r.scale_log2_min for r in rs],
                        color=c,
                        alpha=0.15,
                        lw=0,
                    )
            ax.set_title(f"{role} ({rs[0].fmt if rs else ''})")
            ax.set_xlabel("step")
            ax.set_ylabel("scale bias  -log2(scale)")
            ax.grid(alpha=0.3)
        if len(layers) <= 12:
            axes[0][-1].legend(fontsize=6, loc="best")
        fig.suptitle(title or "FP8 scale bias per layer over training")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
