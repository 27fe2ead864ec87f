"""convert_to_fp8: swap a model's nn.Linear modules for Fp8Linear in place and report every decision.

Skipped, each with its reason in the report: the output head (by name, or tied to an embedding), layers with a
dimension below `min_features`, the first/last N transformer blocks on request, modules a user filter rejects.
Embeddings and norms are not linears; they are listed as kept in high precision so the report is complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..errors import Fp8CommError, Fp8CommTypeError
from .linear import WEIGHT_CACHES, Fp8Linear
from .recipes import Fp8Recipe, get_recipe

HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "classifier")


@dataclass
class ConversionReport:
    """What convert_to_fp8 did: converted module names, and skipped/kept modules with the reason."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        w = max([len(n) for n in self.converted + list(self.skipped)] + [6])
        lines = [
            f"convert_to_fp8 (recipe {self.recipe}): {len(self.converted)} converted, "
            f"{len(self.skipped)} kept in high precision"
        ]
        lines += [f"  {n:<{w}}  fp8" for n in self.converted]
        lines += [f"  {n:<{w}}  kept: {why}" for n, why in self.skipped.items()]
        return "\n".join(lines)


def _find_blocks(model: nn.Module) -> tuple[str, int] | None:
    """(name, length) of the transformer-block container: the first ModuleList/Sequential of >= 2 children that
    contain linears."""
    for name, m in model.named_modules():
        if (
            isinstance(m, (nn.ModuleList, nn.Sequential))
            and len(m) >= 2
            and all(any(isinstance(s, nn.Linear) for s in c.modules()) for c in m)
        ):
            return name, len(m)
    return None


def _is_norm(m: nn.Module) -> bool:
    return (
        isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._BatchNorm))
        or "norm" in type(m).__name__.lower()
    )


def convert_to_fp8(
    model: nn.Module,
    recipe: str | Fp8Recipe = "blockwise",
    *,
    skip_first_blocks: int = 0,
    skip_last_blocks: int = 0,
    min_features: int = 16,
    skip_output_head: bool = True,
    head_names: tuple[str, ...] = HEAD_NAMES,
    module_filter: Callable[[str, nn.Linear], bool] | None = None,
    backend: str = "auto",
    quant_backend: str = "auto",
    weight_cache: str = "step",
) -> ConversionReport:
    """Replace eligible nn.Linear modules of `model` (in place) by Fp8Linear sharing their Parameters.

    module_filter(name, linear) -> False skips a module ("user filter"); weight_cache: see Fp8Linear ("gathered"
    under ZeRO-3 / FSDP). Returns a ConversionReport.
    """
    if not isinstance(model, nn.Module):
        raise Fp8CommTypeError(f"convert_to_fp8 needs an nn.Module, got {type(model).__name__}")
    if weight_cache not in WEIGHT_CACHES:
        raise Fp8CommError(f"unknown weight_cache {weight_cache!r}; valid: {', '.join(WEIGHT_CACHES)}")
    if skip_first_blocks < 0 or skip_last_blocks < 0 or min_features < 0:
        raise Fp8CommError("skip_first_blocks, skip_last_blocks and min_features must be >= 0")
    rec = get_recipe(recipe)
    report = ConversionReport(rec.name)
    blocks = _find_blocks(model)
    if (skip_first_blocks or skip_last_blocks) and blocks is None:
        raise Fp8CommError("skip_first_blocks/skip_last_blocks given, but the model has no ModuleList of blocks")
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def reason(name: str, lin: nn.Linear) -> str | None:
        leaf = name.rsplit(".", 1)[-1]
        if skip_output_head and (leaf in head_names or id(lin.weight) in embedding_weights):
            return "output head" + (" (tied to an embedding)" if id(lin.weight) in embedding_weights else "")
        if min(lin.in_features, lin.out_features) < min_features:
            return f"below size threshold (min dim {min(lin.in_features, lin.out_features)} < {min_features})"
        if blocks is not None and name.startswith(blocks[0] + "."):
            idx = int(name[len(blocks[0]) + 1 :].split(".", 1)[0])
            if idx < skip_first_blocks:
                return f"first {skip_first_blocks} block(s) (block {idx})"
            if idx >= blocks[1] - skip_last_blocks:
                return f"last {skip_last_blocks} block(s) (block {idx})"
        if module_filter is not None and not module_filter(name, lin):
            return "user filter"
        return None

    targets = []
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            report.skipped[name] = f"already Fp8Linear ({m.recipe.name})"
        elif isinstance(m, nn.Linear):
            why = reason(name, m)
            if why is None:
                targets.append(name)
            else:
                report.skipped[name] = why
        elif isinstance(m, nn.Embedding):
            report.skipped[name] = "embedding"
        elif _is_norm(m) and any(True for _ in m.parameters(recurse=False)):
            report.skipped[name] = "norm"
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = Fp8Linear.from_linear(
            getattr(parent, child), rec, backend=backend, quant_backend=quant_backend, weight_cache=weight_cache
        )
        new.fp8_name = name
        setattr(parent, child, new)
        report.converted.append(name)
    if not targets and isinstance(model, nn.Linear) and not isinstance(model, Fp8Linear):
        raise Fp8CommError("convert_to_fp8 swaps submodules; wrap a bare nn.Linear (or use Fp8Linear.from_linear)")
    return report


def set_weight_cache(model: nn.Module, policy: str) -> int:
    """Set every Fp8Linear's weight_cache in `model` ("gathered" under ZeRO-3 / FSDP); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.weight_cache = policy
    return len(layers)
