"""Turning the config flag into per-engine hooks: deepspeed.initialize wrapper, engine guard, install/uninstall.

Order inside initialize(): validate the fp8_comm section -> check the DeepSpeed version, the hook targets and the
config combination -> install the process-wide dispatchers (once) -> convert linears (gemm) -> build the engine ->
check it (ZeRO stage, master weights separate from the gathered copy) -> attach: tag what DeepSpeed calls the hooks
with (parameters, flat buffers, MoE layers) and wrap this engine's optimizer instance -> one log line.

Scope is per engine: every engine gets exactly what its own config says. The dispatchers (DeepSpeed looks the
patched names up at call time, without engine context) route each call to the EngineState it belongs to and
call DeepSpeed's original for everything else, so engines with different sections, or none, share a process
(RLHF actor/critic/reference/reward). One model (parameters) cannot follow two settings: that is an error.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import weakref
from typing import Any

import torch
import torch.distributed as dist

from fp8comm.comm import Guard, GuardBucket, WireConfig, config_for, teardown
from fp8comm.errors import Fp8CommRuntimeError, Fp8CommStateError, Fp8CommUnsupportedError
from fp8comm.gemm import Fp8Linear, convert_to_fp8

from . import checkpoints, compat, levels, moe, planning, summary, zero3, zero12
from .config import SECTION, Fp8CommDeepSpeedConfig, parse
from .patching import PASSTHROUGH, TAG, Accounting, Patcher, log, tag, wrap_method
from .residuals import Residuals


class EngineState:
    """One engine's fp8comm: validated settings, byte accounting, per-object hooks, residuals, master storages.

    Hooks reach it through tags (patching.owner); detach() removes everything it put on DeepSpeed's objects."""

    _count = 0

    def __init__(self, cfg: Fp8CommDeepSpeedConfig) -> None:
        EngineState._count += 1
        self.number = EngineState._count
        self.cfg = cfg
        self.acct = Accounting()
        self.masters: set[int] = set()  # untyped-storage pointers of fp32 master partitions
        self.handles: list = []  # hook handles (forward pre-hooks, optimizer step hooks)
        self.undo: list = []  # callables removing tags and per-instance wrappers
        self.generation = 0  # bumped whenever the engine changes weights (step, checkpoint load)
        self.conversion: Any = None  # fp8comm.gemm ConversionReport
        self.summary: str = ""
        self.names: dict[int, str] = {}  # id(parameter) -> its name in engine.module (residual and guard keys)
        g = cfg.gradients
        self.residuals = Residuals(g.residual_dtype) if g.enabled and g.error_feedback else None
        self.updates: list | None = None  # ZeRO-1/2 weights.update_fmt: one fp8comm.comm.ReplicaUpdate per flat group
        self.guard = Guard(cfg.guard.policy()) if cfg.guard.enabled else None
        self.moe_keys: dict[int, str] = {}  # id(MOELayer) -> its guard key "moe.<i>"
        self.attached = False
        self._engine: weakref.ref | None = None
        self.splits: dict = {}  # global ranks of a group -> its fp8comm.comm.topology.Split (levels.py)
        self._flat_warned: set = set()
        self.grad_layouts: list[str] = []  # ZeRO-1/2: the gradient bucket layout lines logged (grad_reduce._Reducer)
        self.planner = planning.make(cfg, self._log)  # fp8_comm.planner (None: off)
        self.shapes: dict = {}  # global ranks of a group -> its planner GroupShape (planning.shape_of)

    def _log(self, msg: str) -> None:
        if self.cfg.log and dist.is_initialized() and dist.get_rank() == 0:
            _log_rank0(f"{msg} [engine {self.number}]")

    @property
    def engine(self):
        return None if self._engine is None else self._engine()

    def hier(self, group):
        """The HierarchicalGroups of `group` for a collective (None: flat), decided at build (levels.py)."""
        return levels.groups_for(self.splits, group, self._flat_warned)

    def name_of(self, p) -> str:
        n = self.names.get(id(p))
        if n is None:
            raise Fp8CommStateError(
                f"fp8comm engine {self.number}: a parameter of shape {tuple(p.shape)} is not in "
                "engine.module (added after the engine was built?); error feedback keys residuals "
                "by parameter name"
            )
        return n

    def route(self, key: str, device, fp4: bool = False) -> tuple[str, GuardBucket | None]:
        """("fp4" or "fp8", the guard bucket to count into, or None without a guard) or ("bf16", None) while the
        guard has `key` falling back: the hook then runs DeepSpeed's own collective (counted: hooks
        "guard.<key>.bf16"). fp4: the traffic is configured in 4 bits ("fp8" then means the guard demoted it;
        `wire_config` gives the call's config)."""
        g = self.guard
        if g is None:
            return ("fp4" if fp4 else "fp8"), None
        w = g.wire(key)
        if w == "bf16":
            self.acct.hit(f"guard.{key}.bf16")
            return "bf16", None
        if fp4 and w == "fp8":
            self.acct.hit(f"guard.{key}.fp8")
        return w, g.bucket(key, device, fp4=fp4)

    @staticmethod
    def wire_config(base: WireConfig, how: str) -> WireConfig:
        """The call's WireConfig under route()'s answer ("fp4"/"fp8"): a 4-bit `base` demoted to FP8 by the guard
        sends e4m3 with 1x128 fp32 scales (fp8comm.comm.config_for)."""
        return config_for(base, how)

    def check_not_master(self, t: torch.Tensor, what: str) -> None:
        if self.masters and t.untyped_storage().data_ptr() in self.masters:
            raise Fp8CommRuntimeError(
                f"fp8comm {what}: the gather output is the fp32 master weights' storage; a lossy "
                "FP8 gather would overwrite the master copy. Set fp8_comm.weights false for "
                "this setup."
            )

    def hook_stats(self) -> dict:
        out = self.acct.snapshot()
        if self.residuals is not None:
            out["error_feedback"] = {
                "residual_bytes": self.residuals.nbytes(),
                "residuals": self.residuals.count(),
                "dtype": self.cfg.gradients.residual_dtype,
                "skipped_step_resets": self.residuals.skipped_step_resets,
                "calls": dict(self.residuals.calls),  # resident / kept / copied calls, buffers moved back
            }
        if self.guard is not None:
            out["guard"] = self.guard.summary()
        if self.grad_layouts:  # ZeRO-1/2: which collective and format each bucket layout took
            out["grad_layouts"] = list(self.grad_layouts)
        if self.planner is not None:
            out["plans"] = [p.to_dict() for p in self.planner.plans]
            out["plan_trials"] = self.planner.trials()
            if self.planner.fallback:
                out["planner_fallback"] = self.planner.fallback
        return out

    def detach(self) -> None:
        """Remove this engine's tags, wrappers and hooks: from now on it runs DeepSpeed's own collectives."""
        self.attached = False
        for h in self.handles:
            h.remove()
        for fn in reversed(self.undo):
            fn()
        self.handles.clear()
        self.undo.clear()


_HOOKS = Patcher()  # the process-wide dispatchers (installed once per traffic role, shared by every engine)
_ROLES: set[str] = set()
_ENGINES: list[EngineState] = []  # attached engines
_LAST: list = [None]  # the most recently installed EngineState (summary())
_BUILDING: contextvars.ContextVar = contextvars.ContextVar("fp8comm_building", default=None)
_FLAG = Patcher()  # the config-flag patches (deepspeed.initialize, DeepSpeedEngine.__init__)
_ORIG_INIT = None


def engine_state(engine=None) -> EngineState | None:
    """The EngineState of `engine` (None: the most recently installed one); None when it has no fp8comm."""
    if engine is None:
        return _LAST[0]
    es = getattr(engine, TAG, None)
    return es if es is not None and es.attached else None


def engines() -> list[EngineState]:
    """Every attached engine's state, in build order (engines garbage-collected since drop out)."""
    _ENGINES[:] = [es for es in _ENGINES if es.attached and es.engine is not None]
    return list(_ENGINES)


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
def _install_dispatchers(cfg: Fp8CommDeepSpeedConfig) -> None:
    """Check and install the dispatchers of every traffic role `cfg` needs that is not installed yet."""
    want = [r for r in ("weights", "gradients", "moe") if getattr(cfg, r).enabled and r not in _ROLES]
    for role in want:
        compat.check_role(role)
    n = len(_HOOKS)
    try:
        for role in want:
            for mod in (zero3, zero12, moe):
                mod.install(_HOOKS, role)
            _ROLES.add(role)
    except BaseException:
        _HOOKS.restore(keep=n)
        raise


def install(ds_config: dict, model: torch.nn.Module | None = None) -> EngineState | None:
    """Validate `ds_config`'s fp8_comm section, install the dispatchers it needs and, with `model`, convert its
    linears (gemm); returns the EngineState for the engine about to be built (None: section absent or disabled).

    deepspeed.initialize calls this for you and attaches the state to the built engine."""
    cfg = parse(ds_config)
    if not cfg.enabled:
        return None
    version = compat.check_version()
    combo = compat.check_combination(ds_config, cfg, model)
    _install_dispatchers(cfg)
    es = EngineState(cfg)
    if es.planner is not None:
        planning.check(es)  # a calibration file from elsewhere is refused before the build moves any bytes
    if model is not None and cfg.gemm.enabled:
        g = cfg.gemm
        # ZeRO-3 holds a full weight only while it is gathered: keep no FP8 copy beyond its GEMM (Fp8Linear)
        es.conversion = convert_to_fp8(
            model,
            g.recipe,
            skip_first_blocks=g.skip_first_blocks,
            skip_last_blocks=g.skip_last_blocks,
            min_features=g.min_features,
            backend=g.backend,
            quant_backend=g.quant_backend,
            weight_cache="gathered" if combo["stage"] == 3 else "step",
        )
    es.summary = summary.describe(cfg, version, combo, model, es.conversion)
    _LAST[0] = es
    return es


def uninstall(engine=None) -> None:
    """With `engine`: detach that engine only (it runs DeepSpeed's own collectives from then on). Without: detach
    every engine and restore DeepSpeed entirely (deepspeed.initialize included); a no-op when nothing is in."""
    if engine is not None:
        es = engine_state(engine)
        if es is not None:
            es.detach()
            engine.__dict__.pop(TAG, None)
        engines()
        return
    for es in list(_ENGINES):
        es.detach()
        e = es.engine
        if e is not None:
            e.__dict__.pop(TAG, None)
    _ENGINES.clear()
    _LAST[0] = None
    _remove_dispatchers()
    for w in _FLAG.restore():
        log.warning(w)
    teardown("deepspeed")  # its own share only: node groups the caller prepared stay (fp8comm.shutdown() frees all)


def _remove_dispatchers() -> None:
    for w in _HOOKS.restore():
        log.warning(w)
    _ROLES.clear()
    PASSTHROUGH.reset()


# ------------------------------------------------------------------------------------------- after the build
def _check_model_free(model, cfg: Fp8CommDeepSpeedConfig) -> None:
    """A parameter is gathered and reduced by ONE engine's hooks: refuse a model attached to another fp8comm engine."""
    if model is None:
        return
    for p in model.parameters():
        other = getattr(p, TAG, None)
        if other is not None and other.attached and other.engine is None and other in _ENGINES:
            other.detach()  # its engine was garbage-collected: the model is free again
        if other is not None and other.attached:
            raise Fp8CommStateError(
                f"this model's parameters already belong to fp8comm engine {other.number}; a parameter follows one "
                f"engine's fp8_comm section ({'this config has its own' if cfg.enabled else 'this config has none'}). "
                "Build the second engine on a separate model copy, or call "
                "fp8comm.integrations.deepspeed.uninstall(other_engine) first."
            )


def _after_build(es: EngineState, engine) -> None:
    """Checks on the built engine, master-weight registry, per-engine tags and wrappers, weight-change tracking."""
    cfg = es.cfg
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    es._engine = weakref.ref(engine)
    es.names = {id(p): n for n, p in engine.module.named_parameters()}
    es.attached = True
    tag(es, engine)
    for p in engine.module.parameters():
        tag(es, p)
    if cfg.weights.enabled or cfg.gradients.enabled:
        masters = (
            getattr(opt, "fp32_partitioned_groups_flat", None)
            if stage == 3
            else getattr(opt, "single_partition_of_fp32_groups", None)
        )
        if masters is None:
            raise Fp8CommUnsupportedError(
                f"fp8comm: ZeRO-{stage} optimizer {type(opt).__name__} has no fp32 master "
                "partitions where expected; this optimizer is not supported"
            )
        es.masters |= {m.untyped_storage().data_ptr() for m in masters if m.numel()}
        if stage == 3:
            zero3.attach(es, engine)
        else:
            if cfg.weights.enabled:
                for flat in opt.bit16_groups_flat:
                    es.check_not_master(flat, "ZeRO-1/2 weight all-gather")
            zero12.attach(es, engine)
    if cfg.moe.enabled:
        moe.attach(es, engine.module)
    if (cfg.weights.enabled or cfg.gradients.enabled) and not cfg.measure_only:
        # Collective over the world, every rank at build: one gather, then the node groups in one order.
        es.splits = levels.prepare(engine, cfg.hierarchical)
    if es.planner is not None:
        planning.start(es, engine)  # collective over the world: the calibration every rank plans from
    if es.guard is not None:
        _guard_buckets(es, engine)
    if es.residuals is not None or es.guard is not None:
        _after_step(es, engine)
    if cfg.gemm.enabled:
        _track_weight_changes(es, engine)
    if es.residuals is not None or es.guard is not None or cfg.gemm.enabled or es.updates is not None:
        checkpoints.wrap(es, engine)
    _ENGINES.append(es)


def _guard_buckets(es: EngineState, engine) -> None:
    """The guard decides over the engine's data-parallel group; its buckets are registered here, in one fixed order
    on every rank: "weights", "gradients", then "moe.<i>" per MoE layer (module order)."""
    g = es.guard
    assert g is not None
    g.group = getattr(engine.optimizer, "dp_process_group", None)
    device = next(engine.module.parameters()).device
    cfg = es.cfg
    for key, on in (("weights", cfg.weights.enabled), ("gradients", cfg.gradients.enabled)):
        if on:
            g.bucket(key, device, fp4=key == "gradients" and cfg.gradients.is_fp4)
    for key in es.moe_keys.values():
        g.bucket(key, device)


def _after_step(es: EngineState, engine) -> None:
    """After each optimizer step (DeepSpeed's overflow check has run and synchronized the ranks): a step DeepSpeed
    skipped (inf/NaN, fp16 overflow) zeroes every residual; the guard takes its per-step decision."""
    opt = engine.optimizer

    def make(step):
        @functools.wraps(step)
        def wrapped(*a, **k):
            out = step(*a, **k)
            if es.residuals is not None and getattr(opt, "overflow", False):
                es.residuals.reset()
                es.acct.hit("error_feedback.skipped_step_reset")
            if es.guard is not None:
                before = sum(s.switches for s in es.guard.states.values())
                es.guard.step()
                switched = sum(s.switches for s in es.guard.states.values()) - before
                if switched:
                    es.acct.hit("guard.switches", switched)
            return out

        return wrapped

    wrap_method(es, opt, "step", make)


def _track_weight_changes(es: EngineState, engine) -> None:
    """Make Fp8Linear re-quantize its weight after every optimizer step and checkpoint load.

    Fp8Linear caches its FP8 weight keyed on (version counter, data_ptr). DeepSpeed updates weights through
    other views (ZeRO-1/2 gathers into the flat buffer) or swaps `.data` (ZeRO-3), neither of which moves the
    parameter's own version counter, so the cache would go stale; a generation counter closes that gap."""
    basic = getattr(engine, "basic_optimizer", None)
    if not isinstance(basic, torch.optim.Optimizer):
        raise Fp8CommUnsupportedError(
            f"fp8_comm.gemm needs a torch.optim.Optimizer underneath DeepSpeed, got {type(basic).__name__}"
        )

    def bump(*_):
        es.generation += 1

    es.handles.append(basic.register_step_post_hook(bump))

    def pre(m, _inputs):
        if getattr(m, "_fp8comm_generation", None) != es.generation:
            m.invalidate_weight_cache()
            m._fp8comm_generation = es.generation

    for m in engine.module.modules():
        if isinstance(m, Fp8Linear):
            es.handles.append(m.register_forward_pre_hook(pre))


# --------------------------------------------------------------------------------------------- initialize
def initialize(*args, **kwargs):
    """deepspeed.initialize that honours the fp8_comm section (same arguments and return value)."""
    import deepspeed

    orig = _ORIG_INIT or deepspeed.initialize
    bound = inspect.signature(orig).bind(*args, **kwargs)
    ds_config = _ds_config(bound)
    cfg = parse(ds_config)
    _check_model_free(bound.arguments.get("model"), cfg)
    if not cfg.enabled:
        return orig(*args, **kwargs)  # DeepSpeed alone: the dispatchers pass this engine's calls through
    # dist must be up before the checks (ranks in the log line, DeepSpeed's group helpers); DeepSpeed would do
    # exactly this first thing inside initialize anyway.
    _init_dist(bound)
    es = install(ds_config, bound.arguments.get("model"))
    token = _BUILDING.set(es)
    try:
        result = orig(*args, **kwargs)
        _after_build(es, result[0])
    except BaseException:
        es.detach()
        if not engines():
            _remove_dispatchers()  # nothing else uses them: DeepSpeed as before the failed build
        raise
    finally:
        _BUILDING.reset(token)
    if cfg.log:
        _log_rank0(f"{es.summary} [engine {es.number}]")
        for line in levels.describe(es.splits) if dist.get_rank() == 0 else []:  # one line per group, rank 0
            _log_rank0(f"{line} [engine {es.number}]")
    return result


def _init_dist(bound) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    a = bound.arguments
    kw = {
        "dist_backend": get_accelerator().communication_backend_name(),
        "dist_init_required": a.get("dist_init_required"),
    }
    if "distributed_port" in a:
        kw["distributed_port"] = a["distributed_port"]
    deepspeed.init_distributed(**kw)


def _log_rank0(msg: str) -> None:
    # DeepSpeed's logger shows WARNING and above by default; this line must show, so print it like DeepSpeed
    # prints its own always-on messages (rank 0 only), and also log it for programs that capture logging.
    from deepspeed.utils.logging import print_dist

    print_dist(msg, ranks=[0])
    log.info(msg)


# ------------------------------------------------------------------------------------------- config flag
def enable_config_flag() -> None:
    """Make deepspeed.initialize honour "fp8_comm" and guard every engine build against a bypassed flag."""
    global _ORIG_INIT
    import deepspeed

    if len(_FLAG):
        return
    compat.check_target(
        compat.Target(
            "initialize",
            "deepspeed",
            "initialize",
            (
                "args",
                "model",
                "optimizer",
                "model_parameters",
                "training_data",
                "lr_scheduler",
                "distributed_port",
                "mpu",
                "dist_init_required",
                "collate_fn",
                "config",
                "mesh_param",
                "config_params",
            ),
        )
    )
    _ORIG_INIT = deepspeed.initialize

    def make_init(orig):
        @functools.wraps(orig)
        def wrapped(*args, **kwargs):
            return initialize(*args, **kwargs)

        return wrapped

    _FLAG.set("deepspeed", "initialize", make_init)
    _FLAG.set("deepspeed.runtime.engine", "DeepSpeedEngine.__init__", _guarded_engine_init)


def _guarded_engine_init(orig):
    """Refuse an engine whose config enables fp8_comm but that is not being built by initialize() (no hooks)."""

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        cc = kwargs.get("config_class")
        raw = getattr(cc, "_param_dict", None) if cc is not None else kwargs.get("config")
        if isinstance(raw, dict):
            cfg = parse(raw)
            building = _BUILDING.get()
            if cfg.enabled and (building is None or building.cfg != cfg):
                raise Fp8CommStateError(
                    f"this engine's config enables {SECTION}, but its hooks are not installed: the engine was built "
                    "through a deepspeed.initialize bound before `import fp8comm.integrations.deepspeed` (e.g. "
                    "`from deepspeed import initialize`), or after uninstall(). Use "
                    "fp8comm.integrations.deepspeed.initialize(...)."
                )
        return orig(self, *args, **kwargs)

    return __init__
