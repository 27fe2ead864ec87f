"""Which DeepSpeed versions and configurations the hooks support, checked before anything is patched.

DeepSpeed has no comm-hook API: the hooks replace module globals and methods that DeepSpeed looks up at call time.
A release that renames one, changes its signature or stops calling it would turn the hook into a silent no-op, so
every target is checked at install: it exists, its parameters are the ones the hook was written for, and the
function that should call it still refers to it by that name. Any failure is an error naming what changed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import types
from dataclasses import dataclass

from fp8comm.errors import Fp8CommUnsupportedError

from .config import Fp8CommDeepSpeedConfig

# Tested: 0.19.8. Older 0.19.x releases predate the compact gradient-partition buffers the ZeRO-1/2 hook feeds.
SUPPORTED_MIN = "0.19.8"
SUPPORTED_BELOW = "0.20"
ANY_VERSION_ENV = "FP8COMM_DEEPSPEED_ANY_VERSION"  # =1: let the per-target checks alone decide (untested release)


@dataclass(frozen=True)
class Target:
    """One patched name: where it lives, the parameters the hook mirrors, and who must call it by that name."""

    key: str
    module: str
    attr: str  # "name" or "Class.name"
    params: tuple[str, ...]
    callers: tuple[str, ...] = ()  # "Class.method" (or "function") in `module` whose code must refer to attr's name
    caller_module: str | None = None
    role: str = ""
    patched: bool = True  # False: wrapped per optimizer instance (engine.py attach), the class is left alone


PP = "deepspeed.runtime.zero.partition_parameters"
S3 = "deepspeed.runtime.zero.stage3"
S12 = "deepspeed.runtime.zero.stage_1_and_2"
MOE = "deepspeed.moe.sharded_moe"

TARGETS = {
    t.key: t
    for t in (
        Target(
            "zero3.param_gather",
            PP,
            "_dist_allgather_fn",
            ("input_tensor", "output_tensor", "group"),
            ("Init._convert_to_deepspeed_param",),
            role="weights",
        ),
        Target(
            "zero3.grad_reduce",
            S3,
            "reduce_scatter_coalesced",
            ("tensors", "group"),
            ("DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",),
            role="gradients",
        ),
        Target(
            "zero3.grad_reduce_qgz",
            S3,
            "all_to_all_quant_reduce",
            ("tensors", "groups"),
            ("DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",),
            role="gradients",
        ),
        Target(
            "zero3.avg_scatter_grads",
            S3,
            "DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
            ("self", "params_to_reduce", "communication_data_type"),
            ("DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",),
            role="gradients",
            patched=False,
        ),
        Target(
            "zero12.grad_reduce",
            S12,
            "DeepSpeedZeroOptimizer.allreduce_and_scatter",
            ("self", "bucket", "communication_data_type", "numel_per_bucket", "log", "divide", "process_group"),
            ("DeepSpeedZeroOptimizer.average_tensor",),
            role="gradients",
            patched=False,
        ),
        Target(
            "zero12.average_tensor",
            S12,
            "DeepSpeedZeroOptimizer.average_tensor",
            ("self", "tensor", "communication_data_type"),
            ("DeepSpeedZeroOptimizer.reduce_ipg_grads",),
            role="gradients",
            patched=False,
        ),
        Target(
            "zero12.end_of_backward",  # the epilogue's reduce_ipg_grads(): coalesced gradients go out there
            S12,
            "DeepSpeedZeroOptimizer.reduce_ipg_grads",
            ("self", "comm_dtype"),
            ("DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue",),
            role="gradients",
            patched=False,
        ),
        Target(
            "zero12.param_gather",
            S12,
            "all_gather_dp_groups",
            (
                "groups_flat",
                "partitioned_param_groups",
                "dp_process_group",
                "start_alignment_factor",
                "allgather_bucket_size",
            ),
            ("DeepSpeedZeroOptimizer.step", "DeepSpeedZeroOptimizer.update_lp_params"),
            role="weights",
        ),
        Target(
            "moe.all_to_all", MOE, "_AllToAll.forward", ("ctx", "group", "input"), ("MOELayer.forward",), role="moe"
        ),
        Target("moe.layer_forward", MOE, "MOELayer.forward", ("self", "input", "kwargs"), role="moe"),
    )
}
# Methods the ZeRO-1/2 hook calls on the optimizer (it replaces one method and keeps DeepSpeed's bookkeeping).
ZERO12_HELPERS = (
    "_add_to_grad_partition_buffer",
    "dp_process_group",
    "gradient_average",
    "sequence_parallel_size",
    "ipg_buckets",
    "bit16_groups",
)


def _resolve(module: str, dotted: str):
    obj = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _refers_to(code: types.CodeType, name: str) -> bool:
    """True if `code` or any code object nested in it (closures, inner functions) looks up `name`."""
    if name in code.co_names or name in code.co_freevars:
        return True
    return any(isinstance(c, types.CodeType) and _refers_to(c, name) for c in code.co_consts)


def _unwrap(fn):
    """The function under decorators, including DeepSpeed's instrument_w_nvtx (a closure without __wrapped__)."""
    for _ in range(8):
        fn = inspect.unwrap(fn)
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        inner = [
            c.cell_contents
            for c in (getattr(fn, "__closure__", None) or ())
            if callable(getattr(c, "cell_contents", None)) and not isinstance(c.cell_contents, type)
        ]
        if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD] and len(inner) == 1:
            fn = inner[0]
            continue
        return fn
    return fn


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def check_version() -> str:
    """The installed DeepSpeed version; Fp8CommUnsupportedError outside the supported range (unless overridden)."""
    from packaging.version import Version

    try:
        v = deepspeed_version()
    except ImportError as e:
        raise Fp8CommUnsupportedError(
            f"fp8_comm needs DeepSpeed ({SUPPORTED_MIN} <= version < {SUPPORTED_BELOW}); "
            f"import failed: {e}. Install: pip install deepspeed=={SUPPORTED_MIN}"
        ) from e
    ok = Version(SUPPORTED_MIN) <= Version(v) < Version(SUPPORTED_BELOW)
    if not ok and os.environ.get(ANY_VERSION_ENV, "") != "1":
        raise Fp8CommUnsupportedError(
            f"DeepSpeed {v} is outside the range fp8comm supports ({SUPPORTED_MIN} <= version < "
            f"{SUPPORTED_BELOW}). Install deepspeed=={SUPPORTED_MIN}, or set {ANY_VERSION_ENV}=1 "
            "to let the per-hook signature checks decide (untested)."
        )
    return v


def check_target(t: Target) -> None:
    """Fp8CommUnsupportedError unless `t` exists with the expected parameters and its callers still use it by name."""
    where = f"{t.module}.{t.attr}"
    try:
        obj = _resolve(t.module, t.attr)
    except (ImportError, AttributeError) as e:
        raise Fp8CommUnsupportedError(
            f"fp8_comm hook {t.key}: {where} not found in DeepSpeed {deepspeed_version()} "
            f"({e}); this release is not supported"
        ) from e
    fn = obj if callable(obj) and not isinstance(obj, type) else None
    if fn is None:
        raise Fp8CommUnsupportedError(f"fp8_comm hook {t.key}: {where} is not a function")
    fn = _unwrap(fn)
    params = tuple(inspect.signature(fn).parameters)
    if params != t.params:
        raise Fp8CommUnsupportedError(
            f"fp8_comm hook {t.key}: {where} has parameters {params}, the hook was written for "
            f"{t.params} (DeepSpeed {deepspeed_version()}); not supported"
        )
    name = t.attr.rsplit(".", 1)[-1]
    if name == "forward" and "." in t.attr:  # a class used as a whole (autograd Function): callers name the class
        name = t.attr.split(".")[0]
    for c in t.callers:
        caller = _unwrap(_resolve(t.caller_module or t.module, c))
        code = getattr(caller, "__code__", None)
        if code is None or not _refers_to(code, name):
            raise Fp8CommUnsupportedError(
                f"fp8_comm hook {t.key}: {t.module}.{c} no longer calls {name!r} in DeepSpeed "
                f"{deepspeed_version()}; the hook would be a silent no-op, so this release is "
                "not supported"
            )


def check_role(role: str) -> None:
    """Check every target of one traffic role ("weights", "gradients", "moe") before its hooks are installed."""
    for t in TARGETS.values():
        if t.role == role:
            check_target(t)
    if role == "gradients":
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if not hasattr(DeepSpeedZeroOptimizer, "_add_to_grad_partition_buffer"):
            raise Fp8CommUnsupportedError(
                "fp8_comm hook zero12.grad_reduce: DeepSpeedZeroOptimizer has no "
                "_add_to_grad_partition_buffer in this DeepSpeed release; not supported"
            )


# ------------------------------------------------------------------------------------- configuration combinations
def _dtype_mode(ds: dict) -> str:
    for key in ("bf16", "bfloat16"):
        if ds.get(key, {}).get("enabled", False) is True:
            return "bf16"
    if ds.get("fp16", {}).get("enabled", False) is True:
        return "fp16"
    return "fp32"


def zero_config(ds: dict):
    """DeepSpeed's own parsed zero_optimization section (defaults filled in, its validation applied)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**ds.get("zero_optimization", {}))


def check_combination(ds: dict, cfg: Fp8CommDeepSpeedConfig, model=None) -> dict:
    """Fp8CommUnsupportedError for DeepSpeed settings the enabled hooks cannot serve; returns a summary for the log."""
    z = zero_config(ds)
    stage, mode = int(z.stage), _dtype_mode(ds)
    problems = []
    comm = cfg.weights.enabled or cfg.gradients.enabled
    if comm and stage == 0:
        problems.append(
            "fp8_comm.weights/gradients hook ZeRO's collectives, but zero_optimization.stage is 0; "
            'use stage 1, 2 or 3, or set "weights": false, "gradients": false'
        )
    offload = [
        n
        for n in ("offload_param", "offload_optimizer")
        if getattr(z, n) is not None and str(getattr(getattr(z, n), "device", "none")).split(".")[-1].lower() != "none"
    ]
    if comm and offload:
        problems.append(f"zero_optimization.{'/'.join(offload)} (CPU/NVMe offload) is not supported with fp8_comm")
    if comm and getattr(z, "mics_shard_size", -1) > 0:
        problems.append("MiCS (mics_shard_size) uses its own gather classes; not supported with fp8_comm")
    if comm and z.zenflow is not None:
        problems.append("ZenFlow has its own ZeRO optimizer; not supported with fp8_comm")
    if stage == 3 and cfg.weights.enabled:
        if z.zero_quantized_weights or z.zero_quantized_nontrainable_weights:
            problems.append(
                "zero_quantized_weights (ZeRO++ qwZ) and fp8_comm.weights both quantize the weight "
                "gather; enable one of them"
            )
        if z.use_all_reduce_for_fetch_params:
            problems.append(
                "stage3_use_all_reduce_for_fetch_params fetches weights with an all-reduce, which "
                'fp8_comm.weights does not hook; turn it off or set "weights": false'
            )
    if stage == 3 and cfg.weights.enabled and cfg.weights.update_fmt is not None:
        problems.append(
            f"fp8_comm.weights.update_fmt = {cfg.weights.update_fmt!r} sends each step's weight change to a full "
            "replica, which only ZeRO-1/2 keep; ZeRO-3 keeps FP8 weights (drop update_fmt; weights.fmt stays FP8)"
        )
    if stage in (1, 2) and cfg.gradients.enabled:
        for flag, why in (
            ("reduce_scatter", "the FP8 reduce-scatter to owners replaces the reduce_scatter path"),
            ("contiguous_gradients", "the non-contiguous fallback all-reduces outside the hook"),
            ("use_multi_rank_bucket_allreduce", "the per-owner reduce path is not hooked"),
        ):
            if not getattr(z, flag):
                problems.append(f"zero_optimization.{flag}=false is not supported with fp8_comm.gradients ({why})")
    grad_accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if stage == 1 and mode == "bf16" and grad_accum in ("fp32", "float32", "float") and comm:
        problems.append(
            "ZeRO-1 with bf16 and fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, which "
            "fp8_comm does not hook; drop data_types.grad_accum_dtype or use stage 2"
        )
    if comm and ((ds.get("compile") or {}).get("deepcompile")):
        problems.append("DeepCompile does its own gradient reduction; not supported with fp8_comm")
    if model is not None:
        kinds = {type(m).__name__ for m in model.modules()}
        if "PipelineModule" in kinds or type(model).__name__ == "PipelineModule":
            problems.append("pipeline parallelism (PipelineModule) is not supported with fp8_comm")
        if cfg.moe.enabled and "AutoEPMoELayer" in kinds:
            problems.append(
                "AutoEP MoE layers call all_to_all_single directly; fp8_comm.moe hooks only "
                'deepspeed.moe (set "moe": false)'
            )
    if cfg.gradients.enabled and cfg.gradients.error_feedback and not cfg.measure_only:
        problems += _error_feedback_problems(cfg, stage, mode, model)
    if cfg.guard.enabled:
        problems += _guard_problems(cfg)
    if problems:
        raise Fp8CommUnsupportedError("fp8_comm cannot run with this DeepSpeed config:\n  - " + "\n  - ".join(problems))
    return {
        "stage": stage,
        "dtype": mode,
        "qgz": bool(z.zero_quantized_gradients),
        "hpz": int(z.zero_hpz_partition_size),
    }


def _numel(model) -> int | None:
    if model is None:
        return None
    return sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters() if p.requires_grad)


def _error_feedback_problems(cfg: Fp8CommDeepSpeedConfig, stage: int, mode: str, model) -> list[str]:
    """Error feedback keeps this rank's residual of the WHOLE gradient: fine under ZeRO-1 (full gradients on every
    rank anyway), against ZeRO-2/3's gradient partitioning unless the user accepts the memory explicitly."""
    g, out = cfg.gradients, []
    per = {"float32": 4, "bfloat16": 2, "fp8": 1}[g.residual_dtype]
    per_txt = "1 byte per parameter plus 4 per parameter tensor" if per == 1 else f"{per} bytes per parameter"
    if mode == "fp16":
        out.append(
            "fp8_comm.gradients.error_feedback with fp16: residuals would be in loss-scaled units and DeepSpeed "
            "changes the loss scale between steps; use bf16 or fp32"
        )
    if stage in (2, 3) and not g.allow_unpartitioned_residuals:
        n = _numel(model)
        size = f"{per * n / 2**20:.1f} MiB for this model's {n:,} parameters" if n else per_txt
        # two levels quantize once per rail: a rank's residual covers its rail only (levels.rail_window)
        rail = (
            "; under two levels (on where a group spans nodes with several ranks on each) it covers only the "
            "rank's rail: 1/(ranks per node) of that when held as the call's buffer, the usual case"
            if cfg.hierarchical
            else ""
        )
        out.append(
            f"fp8_comm.gradients.error_feedback keeps each rank's quantization residual of the WHOLE gradient "
            f"({per_txt}, {g.residual_dtype}: {size}) on every rank{rail}, while ZeRO-{stage} keeps "
            "only 1/world of the gradients. Set fp8_comm.gradients.allow_unpartitioned_residuals true to "
            'accept that memory (residual_dtype "bfloat16" halves it, "fp8" quarters it), or use ZeRO-1, which '
            "keeps full "
            "gradients anyway"
        )
    return out


def _guard_problems(cfg: Fp8CommDeepSpeedConfig) -> list[str]:
    if not (cfg.weights.enabled or cfg.gradients.enabled or cfg.moe.enabled):
        return ["fp8_comm.guard is on but no FP8 traffic is (weights, gradients and moe all off)"]
    return []
