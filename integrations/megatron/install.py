"""install() / uninstall(): validate versions, patched names and settings, then patch Megatron-Core.

Nothing is patched until every check passed, so a failed install leaves Megatron exactly as it was. Every patched
name is checked at install: the module attribute must exist, and the Megatron function that calls it must still
reference it by that name (its bytecode's co_names); an upgrade that renames or bypasses a name is an error here,
never a silently disabled hook.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from fp8comm.comm import teardown as fcomm_teardown
from fp8comm.comm import topology

from . import ddp_hooks, error_feedback, guard, moe_hooks, planning, replica_update
from .config import FP4_LAYOUT, HOOKED_DISPATCHERS, Fp8CommMegatronConfig, Fp8CommMegatronError
from .installation import begin, current, end
from .patch_points import DISTOPT, OPT, PGB, TD, check_patch_points, check_version

logger = logging.getLogger("fp8comm.integrations.megatron")


@dataclass
class _Facts:
    """What the combination checks know about the run (None = unknown; checked at runtime where possible)."""

    dist_opt: bool | None = None
    instances: int | None = None
    fsdp: str | None = None
    te_quantized: str | None = None
    params_dtype: torch.dtype | None = None
    moe_known: bool = False  # False: nothing known about MoE (Megatron-Core install without transformer_config)
    num_experts: int | None = None
    dispatcher: str | None = None
    ep: int | None = None
    tp: int | None = None


def _facts_from_args(args) -> _Facts:
    g = lambda n, d=None: getattr(args, n, d)
    dtype = g("params_dtype")
    if not isinstance(dtype, torch.dtype):  # set by validate_args; derive it if validation has not run yet
        dtype = torch.bfloat16 if g("bf16") else torch.float16 if g("fp16") else torch.float32
    return _Facts(
        dist_opt=bool(g("use_distributed_optimizer", False)),
        instances=int(g("num_distributed_optimizer_instances", 1) or 1),
        fsdp=next((n for n in ("use_megatron_fsdp", "use_custom_fsdp", "use_torch_fsdp2") if g(n)), None),
        te_quantized=next(
            (n for n in ("fp8_param_gather", "fp4_param_gather", "reuse_grad_buf_for_mxfp8_param_ag") if g(n)), None
        ),
        params_dtype=dtype,
        moe_known=True,
        num_experts=g("num_experts"),
        dispatcher=g("moe_token_dispatcher_type"),
        ep=int(g("expert_model_parallel_size", 1) or 1),
        tp=int(g("tensor_model_parallel_size", 1) or 1),
    )


def _facts_from_configs(ddp_config, transformer_config, params_dtype) -> _Facts:
    f = _Facts()
    if ddp_config is not None:
        f.dist_opt = bool(ddp_config.use_distributed_optimizer)
        f.instances = int(ddp_config.num_distributed_optimizer_instances)
        f.fsdp = next((n for n in ("use_megatron_fsdp", "use_custom_fsdp") if getattr(ddp_config, n, False)), None)
        f.te_quantized = next(
            (
                n
                for n in ("fp8_param_gather", "fp4_param_gather", "reuse_grad_buf_for_mxfp8_param_ag")
                if getattr(ddp_config, n, False)
            ),
            None,
        )
    if transformer_config is not None:
        f.params_dtype = transformer_config.params_dtype
        f.moe_known = True
        f.num_experts = transformer_config.num_moe_experts
        f.dispatcher = transformer_config.moe_token_dispatcher_type
        f.ep = transformer_config.expert_model_parallel_size
        f.tp = getattr(transformer_config, "tensor_model_parallel_size", 1)
    if params_dtype is not None:
        f.params_dtype = params_dtype
    return f


def planned(cfg: Fp8CommMegatronConfig, f: _Facts) -> Fp8CommMegatronConfig:
    """What install() runs: cfg, or under the planner the hooks it chooses for turned on (Fp8CommMegatronConfig.
    planned: the FP8 parameter gather only where the distributed optimizer gathers bf16/fp16 params)."""
    return cfg.planned(f.dist_opt, f.params_dtype == torch.float32, bool(f.te_quantized))


def planner_conflicts(cfg: Fp8CommMegatronConfig, given: Collection[str] = ()) -> list[str]:
    """Settings the planner decides, given beside it (given: fields set explicitly, e.g. `--fp8comm-grad-format
    e4m3`, which equals the default), and what the 4-bit recipe excludes. No communication."""
    if not cfg.planner:
        return []
    errs = []
    if "grad_fmt" in given or cfg.grad_fmt != Fp8CommMegatronConfig().grad_fmt:
        errs.append(
            f"--fp8comm-planner and --fp8comm-grad-format {cfg.grad_fmt} both choose the gradients' wire: drop one "
            "(the planner picks Megatron's own, FP8 or, with --fp8comm-planner-allow-4bit, mxfp4 with error feedback "
            "per bucket-size class)"
        )
    if cfg.param_update_fmt is not None:
        errs.append(
            f"--fp8comm-planner and --fp8comm-param-update-format {cfg.param_update_fmt} both choose the parameter "
            "all-gather's wire: drop one (the planner gathers weights in FP8 at most; 4-bit weight updates are not "
            "planned)"
        )
    if cfg.planner_allow_4bit and cfg.hadamard:
        errs.append(
            f"--fp8comm-planner-allow-4bit with --fp8comm-hadamard {cfg.hadamard}: the validated 4-bit gradient "
            "recipe the planner may choose is mxfp4 with error feedback and no transform; drop --fp8comm-hadamard"
        )
    if cfg.planner_allow_4bit and cfg.rounding != "nearest":
        errs.append(
            f"--fp8comm-planner-allow-4bit with --fp8comm-rounding {cfg.rounding}: the validated 4-bit gradient "
            "recipe rounds to nearest (with error feedback); drop --fp8comm-rounding"
        )
    why = planning.refusal(cfg)
    if why:
        errs.append(why)
    return errs


def validate(cfg: Fp8CommMegatronConfig, f: _Facts, given: Collection[str] = ()) -> list[str]:
    """Settings that would corrupt training or make a hook silently do nothing (under the planner: its conflicts,
    then the checks of what it turns on). given: the fields set explicitly (planner_conflicts)."""
    errs = planner_conflicts(cfg, given)
    cfg = planned(cfg, f)
    fp8_ddp = cfg.grad_reduce or cfg.param_gather  # the hooks --fp8comm-hierarchical applies to
    ddp = fp8_ddp or cfg.param_update
    if ddp and f.fsdp:
        errs.append(f"{f.fsdp}: fp8comm hooks Megatron's DDP bucket groups, not FSDP; the hooks would do nothing")
    if ddp and f.instances is not None and f.instances > 1:
        errs.append(
            f"num_distributed_optimizer_instances={f.instances}: several distributed optimizer instances "
            "add an inter-instance all-reduce on a separate CUDA stream that fp8comm does not cover; use 1"
        )
    if cfg.param_gather and f.dist_opt is False:
        errs.append("--fp8comm-param-gather needs --use-distributed-optimizer (only it all-gathers parameters)")
    if cfg.param_gather and f.te_quantized:
        errs.append(
            f"--fp8comm-param-gather with {f.te_quantized}: Transformer Engine already gathers its "
            "quantized parameters (raw FP8 storage in a uint8 buffer); quantizing again would corrupt them"
        )
    if cfg.param_gather and f.params_dtype == torch.float32:
        errs.append(
            "--fp8comm-param-gather with fp32 parameters: the distributed optimizer's fp32 master weights "
            "are a view of the parameter buffer, so the FP8 gather would overwrite them; use --bf16/--fp16"
        )
    if cfg.param_update:
        flag = f"--fp8comm-param-update-format {cfg.param_update_fmt}"
        if f.dist_opt is False:
            errs.append(f"{flag} needs --use-distributed-optimizer (only it gathers parameters into replicas)")
        if cfg.param_gather:
            errs.append(
                f"{flag} with --fp8comm-param-gather: both replace the distributed optimizer's parameter "
                "all-gather (4-bit changes vs FP8 values); choose one"
            )
        if f.te_quantized:
            errs.append(
                f"{flag} with {f.te_quantized}: Transformer Engine gathers its quantized parameters itself "
                "(raw quantized storage, or the reused gradient buffer, which keeps no replica)"
            )
        if f.params_dtype == torch.float32:
            errs.append(
                f"{flag} with fp32 parameters: the distributed optimizer's fp32 master weights are the parameter "
                "buffer itself, so there is no separate master to send the change from; use --bf16/--fp16"
            )
    if cfg.hadamard and not (cfg.grad_reduce and cfg.grad_fp4):
        errs.append(
            f"--fp8comm-hadamard {cfg.hadamard} applies to 4-bit gradients (--fp8comm-grad-reduce with "
            f"--fp8comm-grad-format mxfp4/nvfp4); gradients here: "
            f"{cfg.grad_fmt if cfg.grad_reduce else 'not hooked'}"
        )
    if cfg.grad_fp4 and not cfg.grad_reduce:
        errs.append(f"--fp8comm-grad-format {cfg.grad_fmt} without --fp8comm-grad-reduce: it would do nothing")
    defaults = Fp8CommMegatronConfig()
    fp8_only = [
        f"--fp8comm-{name.replace('_', '-')} {getattr(cfg, name)}"
        for name in ("block_size", "scaling")
        if getattr(cfg, name) != getattr(defaults, name)
    ]
    if cfg.any and not cfg.uses_fp8_blocks and fp8_only:
        fixed = "; ".join(f"{k}: {v}" for k, v in FP4_LAYOUT.items())
        errs.append(
            f"{' and '.join(fp8_only)}: these apply to FP8 wires only and none is on; the 4-bit formats fix "
            f"their block and scale kind ({fixed}): drop them"
        )
    if cfg.error_feedback and not cfg.grad_reduce:
        errs.append(
            "--fp8comm-error-feedback needs --fp8comm-grad-reduce: the residuals are the FP8 gradient "
            "reduce-scatter's quantization error"
        )
    if cfg.guard and not (fp8_ddp or cfg.param_update):
        errs.append(
            "--fp8comm-guard watches the quantized DDP buckets: it needs --fp8comm-grad-reduce, "
            "--fp8comm-param-gather or --fp8comm-param-update-format"
        )
    if cfg.error_feedback_dtype != "float32" and not cfg.error_feedback:
        errs.append(
            f"--fp8comm-error-feedback-dtype {cfg.error_feedback_dtype} without --fp8comm-error-feedback: "
            "it would do nothing"
        )
    if cfg.moe and f.moe_known:
        flags = " / ".join(
            n
            for n, on in (
                ("--fp8comm-moe-dispatch", cfg.moe_dispatch),
                (f"--fp8comm-moe-combine {cfg.moe_combine}", cfg.moe_combine != "native"),
            )
            if on
        )
        if not f.num_experts:
            errs.append(f"{flags} without MoE layers (--num-experts): nothing to dispatch")
        elif f.dispatcher == "flex":
            errs.append(
                f"{flags} with --moe-token-dispatcher-type flex: the flex dispatcher runs DeepEP/HybridEP "
                "fused kernels (CUDA only), which fp8comm does not hook; supported dispatchers: "
                f"{', '.join(HOOKED_DISPATCHERS)}"
            )
        elif f.dispatcher is not None and f.dispatcher not in HOOKED_DISPATCHERS:
            errs.append(
                f"{flags}: --moe-token-dispatcher-type {f.dispatcher!r} is not hooked; supported "
                f"dispatchers: {', '.join(HOOKED_DISPATCHERS)}"
            )
        elif f.dispatcher == "alltoall" and f.ep is not None and f.ep == 1:
            errs.append(
                f"{flags} with --expert-model-parallel-size 1 and the alltoall dispatcher: tokens never leave the rank"
            )
        elif f.dispatcher == "allgather" and f.ep is not None and f.ep * (f.tp or 1) == 1:
            errs.append(
                f"{flags} with the allgather dispatcher and tensor x expert parallel size 1: tokens never "
                "leave the rank"
            )
    return errs


def install(
    args=None,
    *,
    ddp_config=None,
    transformer_config=None,
    params_dtype=None,
    grad_reduce=False,
    param_gather=False,
    moe_dispatch=False,
    allow_untested_version=False,
    **options,
) -> Fp8CommMegatronConfig:
    """Turn the fp8comm hooks on: install(args) after Megatron-LM parses args (add_args) and before the model
    is built, or install(ddp_config=..., transformer_config=..., grad_reduce=True, ...) for Megatron-Core.

    `options` are Fp8CommMegatronConfig fields (fmt, grad_fmt, block_size, scaling, rounding, hierarchical, check,
    moe_grad_wire, moe_combine, error_feedback, error_feedback_dtype, guard*, param_update_fmt, planner,
    planner_allow_4bit, planner_calibration, planner_timeout_s). Raises Fp8CommMegatronError, with nothing patched,
    on an unsupported version, a missing Megatron name, a combination that would corrupt training or silently do
    nothing, or a planner calibration file from another fp8comm version, device kind or ranks per node. Called again
    while installed: the same settings are a no-op (Megatron-LM calls model_provider once per virtual pipeline
    stage), other settings an error. Returns the settings it runs (under the planner: the hooks it turned on).
    With the planner, install() is collective over the world (the node table, and the measurement when no
    calibration file is given).
    """
    if args is not None:
        if (
            grad_reduce
            or param_gather
            or moe_dispatch
            or options
            or ddp_config is not None
            or transformer_config is not None
            or params_dtype is not None
        ):
            # The args carry both the fp8comm settings and the Megatron facts the checks read: one source only.
            raise Fp8CommMegatronError("fp8comm: pass either args (from add_args) or keywords, not both")
        cfg = Fp8CommMegatronConfig.from_args(args)
        facts = _facts_from_args(args)
        given = Fp8CommMegatronConfig.given_in_args(args)
    else:
        cfg = Fp8CommMegatronConfig(
            grad_reduce=bool(grad_reduce), param_gather=bool(param_gather), moe_dispatch=bool(moe_dispatch), **options
        )
        facts = _facts_from_configs(ddp_config, transformer_config, params_dtype)
        given = set(options)
    # also when no hook is on: e.g. --fp8comm-error-feedback alone would do nothing
    errs = validate(cfg, facts, given)
    cfg = planned(cfg, facts)  # under the planner: the hooks it chooses for turned on
    active = current()
    if active is not None:
        # Megatron-LM calls model_provider once per virtual pipeline stage: an install() placed there runs again
        # with the same settings, which is a no-op; other settings need uninstall() first.
        if active.cfg != cfg:
            raise Fp8CommMegatronError(
                "fp8comm: already installed with other settings; call uninstall() first (installed: "
                f"{_changed(active.cfg)}; requested: {_changed(cfg)})"
            )
        if errs:
            raise Fp8CommMegatronError("fp8comm: refusing to install:\n  - " + "\n  - ".join(errs))
        return active.cfg
    if not cfg.any and not errs:
        _log(cfg.describe(facts.dist_opt))
        return cfg
    version = check_version(allow_untested_version)
    features = _features(cfg, facts)
    problems = check_patch_points(features)
    if problems:
        raise Fp8CommMegatronError(
            f"fp8comm: megatron-core {version} does not match what fp8comm patches:\n  - " + "\n  - ".join(problems)
        )
    if errs:
        raise Fp8CommMegatronError("fp8comm: refusing to install:\n  - " + "\n  - ".join(errs))
    patches = _patches(cfg, features)
    plan_log: list[str] = []

    def log_plan(line: str) -> None:  # every rank keeps its lines (planner_summary); rank 0 prints them
        plan_log.append(line)
        _log(line)

    # The planner's calibration file is checked against this version, device kind and ranks per node (the node
    # table: one all_gather_object over the world) before anything is created or patched.
    rp = planning.prepare(cfg, log_plan) if cfg.planner else None
    # Two-level node groups (the default): decided and created now, on every rank in one order (collective over
    # the world), never lazily by a hook that only the members of one data-parallel group reach.
    node_groups = ddp_hooks.prepare_node_groups() if cfg.hierarchical and fp8_hooks(cfg) else {}
    if rp is not None:
        try:
            planning.start(rp)  # the file, or a measurement over the world (collective, once)
        except BaseException:
            fcomm_teardown(ddp_hooks.HOLDER)  # the node groups just taken: nothing stays behind a failed install
            raise
    inst = begin(cfg)
    inst.node_groups.update(node_groups)
    if rp is not None:
        inst.planner, inst.plan_log, inst.node_table = rp, plan_log, topology.node_table()  # cached: no communication
    for split in node_groups.values():
        _log("fp8comm: data-parallel " + split.describe())
    flat = ""
    if cfg.hierarchical and fp8_hooks(cfg) and not node_groups:
        flat = f"; two levels: every data-parallel group runs flat: {ddp_hooks.why_flat()}"
    for obj, name, new in patches:
        inst.saved.append((obj, name, getattr(obj, name) if not isinstance(obj, type) else obj.__dict__[name]))
        setattr(obj, name, new)
    _log(cfg.describe(facts.dist_opt) + f" [megatron-core {version}]{flat}")
    return cfg


def fp8_hooks(cfg: Fp8CommMegatronConfig) -> bool:
    """The DDP hooks that issue two-level collectives are on (gradient reduction, the FP8 parameter gather or the
    4-bit weight-update gather; the MoE all-to-all runs flat)."""
    return cfg.grad_reduce or cfg.param_gather or bool(cfg.param_update)


def _changed(cfg: Fp8CommMegatronConfig) -> str:
    """The settings that differ from the defaults, for messages ("defaults" when none)."""
    d = Fp8CommMegatronConfig()
    diff = [f"{k}={v!r}" for k, v in vars(cfg).items() if getattr(d, k) != v]
    return ", ".join(diff) or "defaults"


def _features(cfg: Fp8CommMegatronConfig, facts: _Facts) -> set[str]:
    """The patch-point features this configuration needs (MoE: by dispatcher type; both when it is unknown)."""
    f = set()
    if cfg.grad_reduce or cfg.param_gather or cfg.param_update:
        f.add("ddp")
    if cfg.grad_reduce:
        f.add("grad")
    if cfg.param_gather:
        f.add("param")
    if cfg.param_update:
        f.add("update")
    if cfg.error_feedback or cfg.guard:
        f.add("ef")
    if cfg.moe:
        known = facts.dispatcher if facts.moe_known else None
        if known in (None, "alltoall"):
            f.add("moe")
        if known in (None, "allgather"):
            f.add("moe_ag")
        if known is None:
            f.add("flex")  # refuse at run time what install could not see
    return f


def _patches(cfg: Fp8CommMegatronConfig, features: set[str]) -> list[tuple[Any, str, object]]:
    """(object, attribute, replacement) for every name to patch; nothing is patched yet."""
    patches: list[tuple[Any, str, object]] = []
    if features & {"grad", "param", "update"}:
        pgb = importlib.import_module(PGB)
        patches.append((pgb, "_coalescing_manager", ddp_hooks.make_coalescing_manager(pgb._coalescing_manager)))
        if cfg.grad_reduce:
            patches.append(
                (pgb, "dist_reduce_scatter_func", ddp_hooks.make_reduce_scatter(pgb.dist_reduce_scatter_func, cfg))
            )
            patches.append(
                (
                    pgb,
                    "reduce_scatter_with_fp32_accumulation",
                    ddp_hooks.make_reduce_scatter(pgb.reduce_scatter_with_fp32_accumulation, cfg),
                )
            )
            bg = pgb._ParamAndGradBucketGroup
            patches.append((bg, "start_grad_sync", ddp_hooks.make_start_grad_sync(bg.__dict__["start_grad_sync"], cfg)))
        if cfg.param_gather or cfg.param_update:
            patches.append((pgb, "dist_all_gather_func", ddp_hooks.make_all_gather(pgb.dist_all_gather_func, cfg)))
    if "update" in features:
        dopt = importlib.import_module(DISTOPT).DistributedOptimizer
        for name, make in (
            ("_copy_main_params_to_model_params", replica_update.make_copy_main_params),
            ("_copy_main_params_to_param_buffer", replica_update.make_copy_to_param_buffer),
        ):
            patches.append((dopt, name, make(dopt.__dict__[name])))
    if "ef" in features:  # the optimizer step: error feedback's skipped-step reset, the guard's decision
        opt = importlib.import_module(OPT)
        for cls in (opt.MixedPrecisionOptimizer, opt.FP32Optimizer, opt.ChainedOptimizer):
            patches.append((cls, "step", error_feedback.make_optimizer_step(cls.__dict__["step"], guard.on_step)))
    td: Any = importlib.import_module(TD) if features & {"moe", "moe_ag", "flex"} else None
    combine = cfg.moe_combine != "native"
    if "moe" in features:
        cls = td.MoEAlltoAllTokenDispatcher
        patches.append((td, "all_to_all", moe_hooks.make_all_to_all(td.all_to_all, cfg)))
        if cfg.moe_dispatch:
            patches.append((cls, "token_dispatch", moe_hooks.make_token_dispatch(cls.__dict__["token_dispatch"])))
        if combine:
            patches.append((cls, "token_combine", moe_hooks.make_token_combine(cls.__dict__["token_combine"])))
    if "moe_ag" in features:
        cls = td.MoEAllGatherTokenDispatcher
        if cfg.moe_dispatch:
            patches.append(
                (
                    td,
                    "gather_from_sequence_parallel_region",
                    moe_hooks.make_gather_from_sequence_parallel_region(td.gather_from_sequence_parallel_region, cfg),
                )
            )
            patches.append((cls, "token_dispatch", moe_hooks.make_ag_token_dispatch(cls.__dict__["token_dispatch"])))
        if combine:
            patches.append(
                (
                    td,
                    "reduce_scatter_to_sequence_parallel_region",
                    moe_hooks.make_reduce_scatter_to_sequence_parallel_region(
                        td.reduce_scatter_to_sequence_parallel_region, cfg
                    ),
                )
            )
            patches.append((cls, "token_combine", moe_hooks.make_ag_token_combine(cls.__dict__["token_combine"])))
    if "flex" in features:
        cls = td.MoEFlexTokenDispatcher
        patches.append((cls, "token_dispatch", moe_hooks.make_flex_refusal(cls.__dict__["token_dispatch"])))
    return patches


def uninstall() -> None:
    """Restore every patched Megatron name (a no-op when nothing is installed)."""
    replica_update.finish_all()  # 4-bit weight updates started after the last step reach the weights
    inst = end()
    while inst is not None and inst.saved:
        obj, name, orig = inst.saved.pop()
        setattr(obj, name, orig)
    moe_hooks.reset_marks()
    fcomm_teardown(ddp_hooks.HOLDER)  # the node groups install() took; a caller's stay (fp8comm.shutdown(): all)


def active_config() -> Fp8CommMegatronConfig | None:
    inst = current()
    return None if inst is None else inst.cfg


def _log(msg: str) -> None:
    """One line: through logging when the application configured it, else on stderr from rank 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(msg)
    else:
        print(msg, file=sys.stderr, flush=True)
