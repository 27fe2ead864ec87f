"""Turning the config flag into installed hooks: deepspeed.initialize wrapper, engine guard, install/uninstall.

Order inside initialize(): validate the fp8_comm section -> check the DeepSpeed version, every hook target and the
config combination -> patch -> convert linears (gemm) -> build the engine (DeepSpeed builds its optimizer here, so
every hook is already in place) -> check the built engine (ZeRO stage, master weights separate from the gathered
copy) -> one log line. Any failure undoes the patches before the error propagates.

The hooks are process-wide (DeepSpeed looks the patched names up at call time), so one process runs engines with
ONE fp8_comm setting at a time: building an engine with a different (or no) fp8_comm section while hooks are
installed is an error, not a silent mix. uninstall() restores everything, deepspeed.initialize included.
"""
from __future__ import annotations

import functools
import inspect

import torch

from . import compat, moe, zero3, zero12
from fp8comm.comm import default_check_policy
from fp8comm.errors import Fp8CommStateError, Fp8CommUnsupportedError
from fp8comm.gemm import Fp8Linear, convert_to_fp8

from .config import SECTION, Fp8CommDeepSpeedConfig, parse
from .patching import Accounting, Patcher, log
from fp8comm.errors import Fp8CommRuntimeError


class State:
    """What is installed: the validated settings, patches, byte accounting, master-weight storages, gemm hooks."""

    def __init__(self, cfg: Fp8CommDeepSpeedConfig) -> None:
        self.cfg = cfg
        self.patcher = Patcher()
        self.acct = Accounting()
        self.masters: set[int] = set()  # untyped-storage pointers of fp32 master partitions
        self.handles: list = []  # hook handles (forward pre-hooks, optimizer step hooks)
        self.undo: list = []  # callables restoring per-object patches (ZeRO-3 parameter wrappers)
        self.generation = 0  # bumped whenever the engine changes weights (step, checkpoint load)
        self.conversion = None  # fp8comm.gemm ConversionReport
        self.summary: str = ""

    def check_not_master(self, t: torch.Tensor, what: str) -> None:
        if self.masters and t.untyped_storage().data_ptr() in self.masters:
            raise Fp8CommRuntimeError(f"fp8comm {what}: the gather output is the fp32 master weights' storage; a lossy FP8 "
                               "gather would overwrite the master copy. Set fp8_comm.weights false for this setup.")


_STATE: State | None = None
_FLAG = Patcher()  # the config-flag patches (deepspeed.initialize, DeepSpeedEngine.__init__)
_ORIG_INIT = None


def state() -> State | None:
    return _STATE


def _ds_config(bound: inspect.BoundArguments) -> dict | None:
    """The config deepspeed.initialize will use, as a dict (same precedence as DeepSpeed)."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    a = bound.arguments
    cfg = a.get("config")
    if cfg is None:
        cfg = a.get("config_params")
    args = a.get("args")
    if cfg is None and args is not None:
        cfg = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    return None if cfg is None else load_ds_config(cfg)


# ----------------------------------------------------------------------------------------------- install
def install(ds_config: dict, model: torch.nn.Module | None = None) -> State | None:
    """Validate `ds_config`'s fp8_comm section and install its hooks; with `model`, also convert its linears (gemm).

    Returns None (installs nothing) when the section is absent or disabled. Call before building the engine (for
    zero.Init users: before building the model too). deepspeed.initialize calls this for you."""
    global _STATE
    cfg = parse(ds_config)
    if not cfg.enabled:
        return None
    if _STATE is not None and _STATE.cfg != cfg:
        raise Fp8CommStateError("fp8comm hooks are already installed with different fp8_comm settings; call "
                                "fp8comm.integrations.deepspeed.uninstall() first")
    version = compat.check_version()
    combo = compat.check_combination(ds_config, cfg, model)
    st = _STATE
    if st is None:
        compat.check_targets(cfg)
        st = State(cfg)
        try:
            for mod in (zero3, zero12, moe):
                mod.install(st.patcher, st)
        except BaseException:
            st.patcher.restore()
            raise
        st.acct.reset()
        _STATE = st
    if model is not None and cfg.gemm.enabled:
        g = cfg.gemm
        # ZeRO-3 holds a full weight only while it is gathered: keep no FP8 copy beyond its GEMM (Fp8Linear)
        st.conversion = convert_to_fp8(model, g.recipe, skip_first_blocks=g.skip_first_blocks,
                                       skip_last_blocks=g.skip_last_blocks, min_features=g.min_features,
                                       backend=g.backend, quant_backend=g.quant_backend,
                                       weight_cache="gathered" if combo["stage"] == 3 else "step")
    st.summary = _describe(cfg, version, combo, model, st.conversion)
    return st


def uninstall() -> None:
    """Remove every hook and restore DeepSpeed (deepspeed.initialize included); a no-op when nothing is in."""
    global _STATE
    st, _STATE = _STATE, None
    if st is not None:
        _undo_objects(st)
        for w in st.patcher.restore():
            log.warning(w)
    for w in _FLAG.restore():
        log.warning(w)


def _undo_objects(st: State) -> None:
    for h in st.handles:
        h.remove()
    for fn in reversed(st.undo):
        fn()
    st.handles.clear()
    st.undo.clear()


# ------------------------------------------------------------------------------------------- after the build
def _after_build(st: State, engine) -> None:
    """Checks on the built engine, master-weight registry, weight-change tracking for Fp8Linear caches."""
    cfg = st.cfg
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if cfg.weights.enabled or cfg.gradients.enabled:
        masters = getattr(opt, "fp32_partitioned_groups_flat", None) if stage == 3 else \
            getattr(opt, "single_partition_of_fp32_groups", None)
        if masters is None:
            raise Fp8CommUnsupportedError(f"fp8comm: ZeRO-{stage} optimizer {type(opt).__name__} has no fp32 master "
                                          "partitions where expected; this optimizer is not supported")
        st.masters |= {m.untyped_storage().data_ptr() for m in masters if m.numel()}
        if stage == 3 and cfg.weights.enabled and not cfg.measure_only:
            zero3.wrap_params(st, engine.module)
        if stage in (1, 2) and cfg.weights.enabled:
            for flat in opt.bit16_groups_flat:
                st.check_not_master(flat, "ZeRO-1/2 weight all-gather")
    if cfg.gemm.enabled:
        _track_weight_changes(st, engine)


def _track_weight_changes(st: State, engine) -> None:
    """Make Fp8Linear re-quantize its weight after every optimizer step and checkpoint load.

    Fp8Linear caches its FP8 weight keyed on (version counter, data_ptr). DeepSpeed updates weights through
    other views (ZeRO-1/2 gathers into the flat buffer) or swaps `.data` (ZeRO-3), neither of which moves the
    parameter's own version counter, so the cache would go stale; a generation counter closes that gap."""
    basic = getattr(engine, "basic_optimizer", None)
    if not isinstance(basic, torch.optim.Optimizer):
        raise Fp8CommUnsupportedError(f"fp8_comm.gemm needs a torch.optim.Optimizer underneath DeepSpeed, got "
                                      f"{type(basic).__name__}")

    def bump(*_):
        st.generation += 1

    st.handles.append(basic.register_step_post_hook(bump))

    def pre(m, _inputs):
        if getattr(m, "_fp8comm_generation", None) != st.generation:
            m.invalidate_weight_cache()
            m._fp8comm_generation = st.generation

    for m in engine.module.modules():
        if isinstance(m, Fp8Linear):
            st.handles.append(m.register_forward_pre_hook(pre))
    load = engine.load_checkpoint

    @functools.wraps(load)
    def load_checkpoint(*a, **k):
        try:
            return load(*a, **k)
        finally:
            bump()

    engine.load_checkpoint = load_checkpoint


def _describe(cfg: Fp8CommDeepSpeedConfig, version: str, combo: dict, model, conversion) -> str:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else "?"
    head = f"fp8comm: DeepSpeed {version}, ZeRO-{combo['stage']} {combo['dtype']}, {world} ranks"
    if cfg.measure_only:
        return head + ": MEASURE mode - DeepSpeed's own collectives run unchanged, fp8comm only counts bytes"
    parts = []
    if cfg.weights.enabled:
        parts.append(f"weight all-gather FP8 ({cfg.weights.describe()}{', hpZ' if combo['hpz'] > 1 else ''})")
    if cfg.gradients.enabled:
        how = "reduce-scatter" if combo["stage"] == 3 else "reduce to owners"
        parts.append(f"gradient {how} FP8 ({cfg.gradients.describe()}{', replaces qgZ' if combo['qgz'] else ''})")
    if cfg.moe.enabled:
        n = sum(type(m).__name__ == "MOELayer" for m in model.modules()) if model is not None else "?"
        parts.append(f"MoE dispatch FP8 (MoE layers: {n}; combine {cfg.moe.combine}, backward {cfg.moe.grad})")
    if cfg.gemm.enabled and conversion is not None:
        parts.append(f"GEMMs FP8 {conversion.recipe} ({len(conversion.converted)} linears)")
    if cfg.check is None:
        check = {"first": "on the first calls per group", "always": "on every call (FP8COMM_CHECK=always)",
                 "never": "off (FP8COMM_CHECK=never)"}[default_check_policy()]
    else:
        check = "on every call" if cfg.check else "off"
    return head + ": " + ("; ".join(parts) or "nothing enabled") + f"; metadata check {check}"


# --------------------------------------------------------------------------------------------- initialize
def initialize(*args, **kwargs):
    """deepspeed.initialize that honours the fp8_comm section (same arguments and return value)."""
    import deepspeed

    orig = _ORIG_INIT or deepspeed.initialize
    bound = inspect.signature(orig).bind(*args, **kwargs)
    ds_config = _ds_config(bound)
    cfg = parse(ds_config)
    if not cfg.enabled:
        if _STATE is not None:
            raise Fp8CommStateError(_MIXED)
        return orig(*args, **kwargs)
    # dist must be up before the checks (ranks in the log line, DeepSpeed's group helpers); DeepSpeed would do
    # exactly this first thing inside initialize anyway.
    _init_dist(bound)
    fresh = _STATE is None
    st = install(ds_config, bound.arguments.get("model"))
    try:
        result = orig(*args, **kwargs)
        _after_build(st, result[0])
    except BaseException:
        if fresh:
            _uninstall_hooks()
        raise
    if cfg.log:
        _log_rank0(st.summary)
    return result


def _uninstall_hooks() -> None:
    """Remove the comm hooks but keep deepspeed.initialize honouring the flag."""
    global _STATE
    st, _STATE = _STATE, None
    if st is not None:
        _undo_objects(st)
        st.patcher.restore()


def _init_dist(bound) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    a = bound.arguments
    kw = {"dist_backend": get_accelerator().communication_backend_name(),
          "dist_init_required": a.get("dist_init_required")}
    if "distributed_port" in a:
        kw["distributed_port"] = a["distributed_port"]
    deepspeed.init_distributed(**kw)


def _log_rank0(msg: str) -> None:
    # DeepSpeed's logger shows WARNING and above by default; this line must show, so print it like DeepSpeed
    # prints its own always-on messages (rank 0 only), and also log it for programs that capture logging.
    from deepspeed.utils.logging import print_dist

    print_dist(msg, ranks=[0])
    log.info(msg)


_MIXED = ("fp8comm hooks are installed (process-wide) for another engine, and this engine's config has no enabled "
          "fp8_comm section: it would silently get FP8 communication. Call "
          "fp8comm.integrations.deepspeed.uninstall() before building it.")


# ------------------------------------------------------------------------------------------- config flag
def enable_config_flag() -> None:
    """Make deepspeed.initialize honour "fp8_comm" and guard every engine build against a bypassed flag."""
    global _ORIG_INIT
    import deepspeed

    if len(_FLAG):
        return
    compat.check_target(compat.Target("initialize", "deepspeed", "initialize", (
        "args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port",
        "mpu", "dist_init_required", "collate_fn", "config", "mesh_param", "config_params")))
    _ORIG_INIT = deepspeed.initialize

    def make_init(orig):
        @functools.wraps(orig)
        def wrapped(*args, **kwargs):
            return initialize(*args, **kwargs)
        return wrapped

    _FLAG.set("deepspeed", "initialize", make_init)
    _FLAG.set("deepspeed.runtime.engine", "DeepSpeedEngine.__init__", _guarded_engine_init)


def _guarded_engine_init(orig):
    """Refuse an engine whose config and the installed hooks disagree (see the module docstring)."""

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        cc = kwargs.get("config_class")
        raw = getattr(cc, "_param_dict", None) if cc is not None else kwargs.get("config")
        if isinstance(raw, dict):
            cfg = parse(raw)
            if cfg.enabled and (_STATE is None or _STATE.cfg != cfg):
                raise Fp8CommStateError(
                    f"this engine's config enables {SECTION}, but its hooks are not installed: the engine was built "
                    "through a deepspeed.initialize bound before `import fp8comm.integrations.deepspeed` (e.g. "
                    "`from deepspeed import initialize`), or after uninstall(). Use "
                    "fp8comm.integrations.deepspeed.initialize(...).")
            if not cfg.enabled and _STATE is not None:
                raise Fp8CommStateError(_MIXED)
        return orig(self, *args, **kwargs)

    return __init__
