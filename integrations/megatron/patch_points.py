"""What install() patches in Megatron-Core, and the checks that every patched name is still there and still used.

A PatchPoint names a module attribute fp8comm replaces and the Megatron functions that must still reference it
(their bytecode's co_names); check_patch_points() lists what an upgrade broke, check_version() the supported series.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

from .config import Fp8CommMegatronError

logger = logging.getLogger("fp8comm.integrations.megatron")

# Megatron-Core minor series this adapter was read against and tested with (on CPU/gloo: 0.19.2).
SUPPORTED_SERIES = ((0, 19),)
ALLOW_UNTESTED_ENV = "FP8COMM_MEGATRON_ALLOW_UNTESTED"

PGB = "megatron.core.distributed.param_and_grad_buffer"
TD = "megatron.core.transformer.moe.token_dispatcher"
OPT = "megatron.core.optimizer.optimizer"
DISTOPT = "megatron.core.optimizer.distrib_optimizer"


@dataclass(frozen=True)
class PatchPoint:
    """A module attribute fp8comm replaces, and the Megatron functions that must still call it by that name."""

    feature: str  # "ddp" (either DDP hook), "grad", "param", "update" (4-bit weight updates), "ef" (error
    # feedback), "moe" (alltoall dispatcher), "moe_ag" (allgather dispatcher), "flex" (the refusal wrapper, when the
    # dispatcher type is unknown at install)
    module: str
    name: str  # attribute of `module` (a "Class.method" for methods)
    users: tuple[str, ...]  # "Class.method" in `module` (or "other.module:Class.method") that must reference `name`
    calls: tuple[str, ...] = ()  # names the patched function itself must still reference (what its wrapper takes)


PATCH_POINTS = (
    PatchPoint(
        "ddp",
        PGB,
        "_coalescing_manager",
        ("_ParamAndGradBucketGroup.start_grad_sync", "_ParamAndGradBucketGroup.start_param_sync"),
    ),
    PatchPoint("grad", PGB, "dist_reduce_scatter_func", ("_ParamAndGradBucketGroup.start_grad_sync",)),
    # _ParamAndGradBucketGroup.__init__ rebinds dist_reduce_scatter_func to this name when
    # ddp_config.reduce_scatter_with_fp32_accumulation is on; patching it keeps FP8 in that mode too.
    PatchPoint("grad", PGB, "reduce_scatter_with_fp32_accumulation", ("_ParamAndGradBucketGroup.__init__",)),
    PatchPoint("param", PGB, "dist_all_gather_func", ("_ParamAndGradBucketGroup.start_param_sync",)),
    # 4-bit weight updates: the same gather, and the distributed optimizer's copy of the fp32 master into the
    # owner's slice of the parameter buffer (it writes the staging shard instead; replica_update.py). What the
    # replacement reads of the optimizer must still be what Megatron's own copy reads.
    PatchPoint("update", PGB, "dist_all_gather_func", ("_ParamAndGradBucketGroup.start_param_sync",)),
    PatchPoint(
        "update",
        DISTOPT,
        "DistributedOptimizer._copy_main_params_to_model_params",
        (f"{OPT}:MixedPrecisionOptimizer.step_with_ready_grads",),
        calls=(
            "shard_fp32_from_float16_groups",
            "model_float16_groups",
            "shard_fp32_groups",
            "model_fp32_groups",
            "_get_model_param_range_map",
            "model_param_gbuf_map",
            "buffers",
            "param_data",
        ),
    ),
    # MXFP8 params stage the master into a gradient buffer reused for the gather (zeroed every step): refused.
    PatchPoint(
        "update",
        DISTOPT,
        "DistributedOptimizer._copy_main_params_to_param_buffer",
        (f"{OPT}:MixedPrecisionOptimizer.step_with_ready_grads",),
    ),
    # Plain DDP (and force_all_reduce): start_grad_sync calls torch.distributed.all_reduce(bucket.grad_data, ...)
    # directly inside its coalescing block; the wrapper takes those calls for the duration of the method.
    PatchPoint(
        "grad", PGB, "_ParamAndGradBucketGroup.start_grad_sync", (), calls=("all_reduce", "_coalescing_manager")
    ),
    PatchPoint(
        "moe",
        TD,
        "all_to_all",
        ("MoEAlltoAllTokenDispatcher.token_dispatch", "MoEAlltoAllTokenDispatcher.token_combine"),
    ),
    PatchPoint("moe", TD, "MoEAlltoAllTokenDispatcher.token_dispatch", ()),
    PatchPoint("moe", TD, "MoEAlltoAllTokenDispatcher.token_combine", ()),
    PatchPoint("moe_ag", TD, "gather_from_sequence_parallel_region", ("MoEAllGatherTokenDispatcher.token_dispatch",)),
    PatchPoint(
        "moe_ag", TD, "reduce_scatter_to_sequence_parallel_region", ("MoEAllGatherTokenDispatcher.token_combine",)
    ),
    PatchPoint("moe_ag", TD, "MoEAllGatherTokenDispatcher.token_dispatch", ()),
    PatchPoint("moe_ag", TD, "MoEAllGatherTokenDispatcher.token_combine", ()),
    PatchPoint("flex", TD, "MoEFlexTokenDispatcher.token_dispatch", ()),
    # A step that reports a skipped update resets the error-feedback residuals. DistributedOptimizer and
    # Float16OptimizerWithFloat16Params inherit MixedPrecisionOptimizer.step; ChainedOptimizer.step does not call
    # its members' step().
    PatchPoint("ef", OPT, "MixedPrecisionOptimizer.step", ()),
    PatchPoint("ef", OPT, "FP32Optimizer.step", ()),
    PatchPoint("ef", OPT, "ChainedOptimizer.step", ()),
)

# DistributedDataParallelConfig fields the checks read (a rename would make a check silently pass).
DDP_FIELDS = (
    "use_distributed_optimizer",
    "num_distributed_optimizer_instances",
    "fp8_param_gather",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "reduce_scatter_with_fp32_accumulation",
)


def megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        from megatron.core import package_info

        return package_info.__shortversion__


def check_version(allow_untested: bool = False) -> str:
    v = megatron_version()
    try:
        series = tuple(int(x) for x in v.split("+")[0].split(".")[:2])
    except ValueError:
        series = None
    if series in SUPPORTED_SERIES:
        return v
    if allow_untested or os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        logger.warning(
            "fp8comm: megatron-core %s is untested (supported: %s); every patched name was still checked",
            v,
            _series_text(),
        )
        return v
    raise Fp8CommMegatronError(
        f"fp8comm: megatron-core {v} is not a supported version (supported: "
        f"{_series_text()}); set {ALLOW_UNTESTED_ENV}=1 or install(..., "
        "allow_untested_version=True) to try it (all patched names are still checked)"
    )


def _series_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)


def _resolve(module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_user(point: PatchPoint, user: str):
    """The function a PatchPoint user names: "Class.method" in the point's module, or "module:Class.method"."""
    mod, _, name = user.rpartition(":")
    return _resolve(importlib.import_module(mod or point.module), name)


def _code_names(fn) -> set[str]:
    """Global names a function's code (and its nested functions) references."""
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    return names


def check_patch_points(features=("ddp", "grad", "param", "update", "ef", "moe", "moe_ag", "flex")) -> list[str]:
    """Problems with the patch points of the given features ([] = every name is present and still used)."""
    problems = []
    for p in PATCH_POINTS:
        if p.feature not in features:
            continue
        try:
            mod = importlib.import_module(p.module)
        except Exception as e:
            problems.append(f"cannot import {p.module}: {type(e).__name__}: {e}")
            continue
        try:
            target = _resolve(mod, p.name)
        except AttributeError:
            problems.append(f"{p.module}.{p.name} is missing")
            continue
        if "." in p.name:
            cls, meth = p.name.rsplit(".", 1)
            if meth not in vars(_resolve(mod, cls)):  # inherited: patching the subclass would shadow, not wrap
                problems.append(f"{p.module}.{p.name} is no longer defined by {cls} itself")
                continue
        if not callable(target):
            problems.append(f"{p.module}.{p.name} is not callable")
        missing = [c for c in p.calls if c not in _code_names(target)]
        if missing:
            problems.append(f"{p.module}.{p.name} no longer calls {', '.join(missing)}: wrapping it would do nothing")
        for user in p.users:
            where = user.replace(":", ".") if ":" in user else f"{p.module}.{user}"
            try:
                fn = resolve_user(p, user)
            except (AttributeError, ImportError):
                problems.append(f"{where} (which calls {p.name}) is missing")
                continue
            if p.name.split(".")[-1] not in _code_names(fn):
                problems.append(f"{where} no longer references {p.name}: patching it would do nothing")
    if {"ddp", "grad", "param", "update"} & set(features):
        from megatron.core.distributed import DistributedDataParallelConfig

        missing = [f for f in DDP_FIELDS if f not in DistributedDataParallelConfig.__dataclass_fields__]
        if missing:
            problems.append(f"DistributedDataParallelConfig lacks {missing}")
    return problems
