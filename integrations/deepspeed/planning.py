"""The planner in a DeepSpeed engine ("fp8_comm": {"planner": ...}): calibrated once at build, then asked per
collective which wire a bucket takes (DeepSpeed's own, FP8 or the 4-bit recipe, flat or two-level).

The hooks call decide() where they used to ask the guard alone: the plan comes first (per size class, the same on
every rank), the guard may then demote a quantized bucket further (to FP8, or to DeepSpeed's own while it falls
back). A bucket the plan gives DeepSpeed's own collective runs exactly DeepSpeed's call, counted as
"planner.<role>.native". Calls are timed (comm_stats: predicted_s, measured_s) where they complete in the hook;
ZeRO-3's asynchronous weight gather is timed from issue to its handle's wait (the overlap with compute included).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from fp8comm.comm import topology
from fp8comm.comm.planned import Choice, RuntimePlanner, group_shape, keeps_feedback
from fp8comm.comm.planner import NATIVE, GroupShape, Option, Policy


def make(cfg, log) -> RuntimePlanner | None:
    """The engine's RuntimePlanner (None: planner off); the file, if any, is checked later, at start()."""
    s = cfg.planner
    if s is None:
        return None
    g = cfg.gradients
    policy = Policy(
        allow_4bit=s.allow_4bit,
        replicas=False,  # 4-bit weight updates are not planned here (weights.update_fmt is not allowed beside it)
        two_level=cfg.hierarchical,
        residual_dtype=g.residual_dtype,
        residual_option="fp8_comm.gradients.allow_unpartitioned_residuals (set by the planner)" if s.allow_4bit else "",
        fp8_feedback=g.error_feedback and not s.allow_4bit,  # the user's own, kept on FP8 (4 bits: the recipe's)
    )
    return RuntimePlanner(s, policy, log, "fp8_comm.planner")


def accelerator_device() -> torch.device:
    """The device DeepSpeed will put the engine on (the model may still be on the CPU before the build)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def check(es) -> None:
    """Refuse a calibration file from another version, device kind or ranks per node, before the build."""
    from fp8comm.comm.planned import ranks_per_node

    es.planner.check_file(accelerator_device(), ranks_per_node())


def start(es, engine) -> None:
    """Load or measure the calibration (collective over the world, every rank at build)."""
    es.planner.start(next(engine.module.parameters()).device, None)


@dataclass(frozen=True)
class Decision:
    """One collective's route: how ("bf16": DeepSpeed's own; "fp8"; "fp4"), the guard bucket, the node groups
    (None: flat), and the plan's Choice (None: planner off)."""

    how: str
    guard: Any
    hier: Any
    choice: Choice | None
    shape: GroupShape | None = None


def shape_of(es, group) -> GroupShape:
    ranks = topology.group_ranks(group)
    got = es.shapes.get(ranks)
    if got is None:
        got = es.shapes[ranks] = group_shape(topology.split(ranks, topology.node_table()), len(ranks))
    return got


def decide(
    es, role: str, device, fp4: bool, *, op: str, nbytes: int, dtype, group, native_op: str | None = None
) -> Decision:
    """The plan (if on), then the guard. `nbytes`: the bucket in `dtype`; `group`: the collective's group."""
    hg = es.hier(group)
    rp = es.planner
    if rp is None or not rp.started:
        how, gb = es.route(role, device, fp4)
        return Decision(how, gb, hg, None)
    shape = shape_of(es, group)
    c = rp.choose(op, nbytes, dtype, shape, two_level=hg is not None, native_op=native_op, group=group)
    if c.native:
        es.acct.hit(f"planner.{role}.native")
        return Decision("bf16", None, None, c, shape)
    how, gb = es.route(role, device, fp4)
    if how == "fp4" and c.option.wire == "fp8":
        how = "fp8"  # the plan puts this size class on FP8 (e4m3, 1x128 fp32 scales: fp8comm.comm.config_for)
    if how != "bf16":
        es.acct.hit(f"planner.{role}.{c.option.wire}.{c.option.levels}")
    return Decision(how, gb, hg if c.two_level else None, c, shape)


def ran(d: Decision) -> Choice:
    """The option that actually runs: the plan's, unless the guard demoted it (FP8, or DeepSpeed's own)."""
    assert d.choice is not None
    levels = "two_level" if d.hier is not None else "flat"
    if d.how == "bf16":
        return Choice(Option(NATIVE), d.choice.plan)
    if d.how == "fp8":  # a 4-bit bucket the guard demoted keeps its error feedback
        return Choice(Option("fp8", levels, feedback=keeps_feedback(d.choice)), d.choice.plan)
    return d.choice


def timed(es, d: Decision, op: str, nbytes: int, dtype, device, native_op: str | None = None):
    """A context manager timing one call into comm_stats (a no-op without a plan)."""
    if d.choice is None or d.shape is None or es.planner is None:
        return nullcontext()
    return es.planner.timed(op, ran(d), nbytes, dtype, d.shape, device, native_op=native_op)


class TimedHandle:
    """Wraps an async collective's handle: records issue-to-wait seconds against the plan's prediction."""

    def __init__(self, inner, es, d: Decision, op: str, nbytes: int, dtype, device) -> None:
        self.inner, self.done = inner, False
        self._ran, self._planner = ran(d), es.planner
        self._pred = es.planner.predicted(op, nbytes, dtype, d.shape, self._ran.option)
        self._op, self._device = op, torch.device(device)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._t0 = time.perf_counter()

    def wait(self, *args, **kwargs):
        out = self.inner.wait(*args, **kwargs) if self.inner is not None else None
        if not self.done:
            self.done = True
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self._planner.record(self._op, self._ran, self._pred, time.perf_counter() - self._t0)
        return out

    def is_completed(self) -> bool:
        return self.inner is None or self.inner.is_completed()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def handle(h, es, d: Decision, op: str, nbytes: int, dtype, device):
    """`h` timed from now to its wait (TimedHandle), or `h` itself without a plan."""
    if d.choice is None or d.shape is None or es.planner is None or es.planner.calibration is None:
        return h
    return TimedHandle(h, es, d, op, nbytes, dtype, device)


def feedback(d: Decision | None) -> bool:
    """Error feedback on this call (when the engine keeps residuals): as the plan predicted it (keeps_feedback; a
    bucket the guard demotes from 4 bits keeps it, as without the planner)."""
    return d is None or keeps_feedback(d.choice)


def call_config(es, base, d: Decision):
    """The call's WireConfig: the guard's demotion (EngineState.wire_config), error feedback off where the plan's FP8
    has none."""
    cfg = es.wire_config(base, d.how)
    if cfg is not None and cfg.error_feedback and not feedback(d):
        cfg = cfg.replace(error_feedback=False)
    return cfg
