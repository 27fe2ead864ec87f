"""The planner in Megatron's DDP hooks (--fp8comm-planner): per bucket-size class, Megatron's own collective, FP8 or
(--fp8comm-planner-allow-4bit) the 4-bit recipe, flat or two-level, predicted from a calibration (fp8comm.comm.planned).

install() makes the RuntimePlanner and checks the calibration file before any bucket moves (prepare), then loads it
or measures over the world, once (start; collective, every rank). The hooks ask route() per bucket collective:
every rank of a group sees the same bytes, dtype and group shape, so every rank takes the same choice. A bucket the
plan gives Megatron's own collective runs exactly Megatron's call (ddp_hooks._native, the guard's BF16 path). Each
call is timed into comm_stats()[op] (timed_calls, predicted_s, measured_s): Megatron issues its bucket collectives
inside a coalescing block and waits the block's handle later (overlap on: in finish_grad_sync / the next forward),
so the measured time runs from the issue to that wait, the overlap with compute included; a call made outside a
block and synchronously is timed around the call (RuntimePlanner.timed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp8comm.comm import topology
from fp8comm.comm.planned import Choice, RuntimePlanner, group_shape, ranks_per_node
from fp8comm.comm.planner import NATIVE, GroupShape, Option, Policy
from fp8comm.errors import Fp8CommConfigError

from .config import Fp8CommMegatronConfig, Fp8CommMegatronError
from .installation import installed

WHERE = "--fp8comm-planner"


def policy(cfg: Fp8CommMegatronConfig) -> Policy:
    """What the numerics allow: 4-bit gradients with --fp8comm-planner-allow-4bit (the recipe: mxfp4 with error
    feedback, its residual in --fp8comm-error-feedback-dtype); weights at most FP8 (4-bit weight updates are not
    planned); two levels unless --no-fp8comm-hierarchical."""
    return Policy(
        allow_4bit=cfg.planner_allow_4bit,
        allow_4bit_updates=False,
        replicas=True,
        two_level=cfg.hierarchical,
        residual_dtype=cfg.error_feedback_dtype,
        fp8_feedback=cfg.error_feedback and not cfg.planner_allow_4bit,  # the user's own (4 bits: the recipe's)
    )


def device() -> torch.device:
    """The device Megatron trains on (the calibration's device kind is checked against it)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def refusal(cfg: Fp8CommMegatronConfig) -> str:
    """Why the planner cannot start in this process ("" when it can); no communication."""
    if not (dist.is_available() and dist.is_initialized()):
        return (
            f"{WHERE}: torch.distributed is not initialized at install(); the planner reads the node layout and "
            "calibrates over the world there (call install() after init_process_group)"
        )
    if cfg.planner_calibration is None and dist.get_backend() != "gloo":
        return (
            f"{WHERE}: the planner measures links on gloo worlds only; this job runs {dist.get_backend()!r}: give "
            "--fp8comm-planner-calibration FILE (`fp8comm calibrate --out FILE` on the same nodes)"
        )
    return ""


def prepare(cfg: Fp8CommMegatronConfig, log: Callable[[str], None]) -> RuntimePlanner:
    """The RuntimePlanner, its calibration file (if any) checked against this fp8comm version, device kind and ranks
    per node. Collective over the world (the node table: one all_gather_object, cached), before any bucket moves."""
    settings = cfg.planner_settings
    assert settings is not None
    rp = RuntimePlanner(settings, policy(cfg), log, WHERE)
    try:
        rp.check_file(device(), ranks_per_node())
    except Fp8CommConfigError as e:
        raise Fp8CommMegatronError(f"fp8comm: {e}") from None
    return rp


def start(rp: RuntimePlanner) -> None:
    """Load the file or measure over the world (collective, every rank, once per install)."""
    try:
        rp.start(device(), None)
    except Fp8CommConfigError as e:
        raise Fp8CommMegatronError(f"fp8comm: {e}") from None


@dataclass(frozen=True)
class Route:
    """The plan for one bucket collective: its Choice and what it was predicted for."""

    choice: Choice
    op: str
    nbytes: int
    dtype: str
    shape: GroupShape

    @property
    def native(self) -> bool:
        return self.choice.native


def _dtype(t: torch.Tensor) -> str:
    """The planner's dtype of a bucket: fp32, or bf16 for 2-byte buckets (fp16 costs the same bytes)."""
    return "fp32" if t.element_size() == 4 else "bf16"


def shape_of(group) -> GroupShape:
    """The group's nodes x members per node, from the install's node table (no communication)."""
    inst = installed()
    ranks = topology.group_ranks(group)
    got = inst.shapes.get(ranks)
    if got is None:
        split = inst.node_groups.get(ranks)
        if split is None or not split.nodes:
            split = topology.split(ranks, inst.node_table) if inst.node_table is not None else None
        got = inst.shapes[ranks] = group_shape(split, len(ranks))
    return got


def route(op: str, t: torch.Tensor, group, two_level: bool) -> Route | None:
    """The plan's choice for a collective of bucket `t` (the reduce-scatter's / all-reduce's input, the all-gather's
    output) over `group`; None without the planner. two_level: this group runs two levels (its node groups)."""
    rp = installed().planner
    if rp is None:
        return None
    d = _dtype(t)
    nbytes = t.numel() * (4 if d == "fp32" else 2)
    shape = shape_of(group)
    return Route(rp.choose(op, nbytes, d, shape, two_level=two_level, group=group), op, nbytes, d, shape)


def ran(r: Route, config, two_level: bool) -> Option:
    """The option that actually runs: the plan's, unless the guard moved the bucket (config None: Megatron's own;
    a 4-bit config demoted to FP8)."""
    if config is None:
        return Option(NATIVE)
    wire = "mxfp4" if config.is_fp4 else "fp8"
    return Option(wire, "two_level" if two_level else "flat", feedback=config.error_feedback)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Timer:
    """Predicted vs measured seconds of one planned call, from now to stop() (recorded once)."""

    def __init__(self, r: Route, option: Option, dev: torch.device) -> None:
        rp = installed().planner
        assert rp is not None and rp.calibration is not None
        self.op, self.dev, self.done, self.planner = r.op, dev, False, rp
        self.ran = Choice(option, r.choice.plan)
        self.predicted = rp.predicted(r.op, r.nbytes, r.dtype, r.shape, option)
        _sync(dev)
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if not self.done:
            self.done = True
            _sync(self.dev)
            self.planner.record(self.op, self.ran, self.predicted, time.perf_counter() - self.t0)


def timer(r: Route | None, option: Option, dev: torch.device) -> Timer | None:
    """A Timer for a planned call (None: no plan, or the fixed choice without a calibration: nothing predicted)."""
    if r is None or r.choice.plan is None:
        return None
    return Timer(r, option, dev)


class TimedHandle:
    """An async collective's handle whose wait() also stops its Timer (issue-to-wait time)."""

    def __init__(self, inner, t: Timer) -> None:
        self.inner, self.timer = inner, t

    def wait(self, *args, **kwargs):
        out = self.inner.wait(*args, **kwargs) if self.inner is not None else None
        self.timer.stop()
        return out

    def is_completed(self) -> bool:
        return self.inner is None or self.inner.is_completed()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class TimerStop:
    """An item of a coalescing batch (ddp_hooks._Batch) that stops a Timer when Megatron waits the batch, after the
    real coalescing manager: Megatron's own collective issued inside the block, timed issue-to-wait."""

    def __init__(self, t: Timer) -> None:
        self.timer = t

    def launch(self) -> None:
        pass

    def wait(self, timeout=None) -> None:
        self.timer.stop()

    def is_completed(self) -> bool:
        return True


def summary() -> dict:
    """The active planner: its calibration source, the fallback reason, every plan decided so far (to_dict) and
    the plan lines it logged, on this rank ({} without the planner)."""
    from .installation import current

    inst = current()
    rp = None if inst is None else inst.planner
    if rp is None:
        return {}
    assert inst is not None
    return {
        "calibration": rp.settings.calibration or ("measured" if rp.calibration is not None else None),
        "fallback": rp.fallback,
        "plans": [p.to_dict() for p in rp.plans],
        "trials": rp.trials(),
        "log": list(inst.plan_log),
    }
