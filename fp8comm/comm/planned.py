"""The planner inside an engine: the switch's settings, the calibration it plans from, the choice per collective,
the plan in the log, predicted and measured time in comm_stats(). The three adapters share this; each maps a
Choice onto its own call (the engine's own collective, or fp8comm's with a WireConfig, flat or two-level).

Checked by measurement: the model does not see every cost (an adapter's passes over the bucket, the CPU the levels
share). When the chosen option's measured time is above another option's prediction, that option runs for a few
calls too and the size class keeps the faster one as measured (a trial: at most TRIALS options besides the chosen
one, TRIAL_CALLS timed calls each after one left out). The group's members agree through the c10d store (each
member's timings, the max taken) at each decision, so every member runs the same option; the log says what was tried
and kept.

Calibration: a file written by `fp8comm calibrate` (checked: fp8comm version, device kind, ranks per node), or
measured once over the world when the engine is built (gloo only: calibrate()). A measurement that cannot finish
falls back, on every rank alike and with one warning, to the fixed choice: FP8, two levels where a group spans
nodes (the adapters' defaults). Every rank plans from the same numbers, so every rank chooses alike.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import Fp8CommConfigError, Fp8CommStateError
from . import topology
from .calibration import Calibration, device_kind
from .planner import NATIVE, GroupShape, Option, Plan, Planner, Policy, predict
from .stats import PROCESS_STATS

KEYS = ("allow_4bit", "calibration", "timeout_s", "trials")
FALLBACK = Option("fp8", "two_level")  # the fixed choice (two levels only where the group spans nodes)
TIMED_ON_GPU = 8  # calls timed per plan on a GPU (each timing synchronizes the device)
CHECK_AFTER, OFF_BY = 4, 2.0  # a plan measured off its prediction by more than OFF_BY x after CHECK_AFTER calls: logged
TRIAL_CALLS, TRIALS = 3, 2  # a trial: TRIAL_CALLS timed calls per option (after one left out), TRIALS options at most
NO_TRIALS: Any = object()  # RuntimePlanner.choose's group when the caller gives none: no trial
TRIAL_WAIT = 64  # calls a trial waits for its timings to arrive (async handles waited late) before it keeps the option


@dataclass(frozen=True)
class PlannerSettings:
    """The engine switch: allow_4bit (gradients in 4 bits: the validated recipe, mxfp4 with error feedback),
    calibration (an `fp8comm calibrate` file; None: measured over the world at build, gloo only), timeout_s (the
    measurement's deadline; past it, the fixed choice with one warning), trials (a plan measured slower than another
    option's prediction tries that option; off: the prediction alone, so a calibration file fixes every choice)."""

    allow_4bit: bool = False
    calibration: str | None = None
    timeout_s: float = 30.0
    trials: bool = True


def parse_settings(value: Any, where: str, *, four_bit: str = "") -> PlannerSettings | None:
    """`where`'s value as PlannerSettings: true (defaults), false / None (off), or an object with KEYS. four_bit:
    why this engine cannot take 4-bit gradients ("" when it can): allow_4bit is then an error naming it."""
    if value is None or value is False:
        return None
    if value is True:
        return PlannerSettings()
    if not isinstance(value, Mapping):
        raise Fp8CommConfigError(
            f"{where} = {value!r} is not valid; valid: true, false, or an object with keys {', '.join(KEYS)}"
        )
    bad = [k for k in value if k not in KEYS]
    if bad:
        raise Fp8CommConfigError(f"unknown key(s) {bad} in {where}; valid keys: {', '.join(KEYS)}")
    a4 = value.get("allow_4bit", False)
    if not isinstance(a4, bool):
        raise Fp8CommConfigError(f"{where}.allow_4bit must be true or false, got {a4!r}")
    if a4 and four_bit:
        raise Fp8CommConfigError(f"{where}.allow_4bit: {four_bit}")
    path = value.get("calibration")
    if path is not None and not isinstance(path, str):
        raise Fp8CommConfigError(f"{where}.calibration must be a file path (string) or null, got {path!r}")
    t = value.get("timeout_s", 30.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise Fp8CommConfigError(f"{where}.timeout_s must be a number > 0 (seconds), got {t!r}")
    trials = value.get("trials", True)
    if not isinstance(trials, bool):
        raise Fp8CommConfigError(f"{where}.trials must be true or false, got {trials!r}")
    return PlannerSettings(allow_4bit=a4, calibration=path, timeout_s=float(t), trials=trials)


@dataclass(frozen=True)
class Choice:
    """What one collective runs: `option` (wire NATIVE: the engine's own), `plan` (None: the fixed choice, no
    calibration), `two_level` (the option's levels where the group can take them)."""

    option: Option
    plan: Plan | None

    @property
    def native(self) -> bool:
        return self.option.native

    @property
    def two_level(self) -> bool:
        return self.option.levels == "two_level"


def keeps_feedback(choice: Choice | None) -> bool:
    """Whether a gradient call keeps the error feedback its config has: always without a plan; under one only on an
    option that carries it (the 4-bit recipe; FP8 where Policy.fp8_feedback), which is what the plan predicted."""
    return choice is None or choice.native or choice.option.feedback


def group_shape(split: topology.Split | None, size: int) -> GroupShape:
    """The GroupShape of a group: nodes x members per node when it splits evenly; otherwise one node of `size`
    members (uneven or unknown layouts run flat, and the node-local links are what a flat call on them pays)."""
    if split is not None and split.nodes:
        n = len(set(split.nodes))
        if size % n == 0 and all(split.nodes.count(x) == size // n for x in set(split.nodes)):
            return GroupShape(n, size // n)
    return GroupShape(1, max(1, size))


@dataclass
class _Trial:
    """One size class on one group while measurement checks its plan: the option running now, the calls issued on it
    (the same count on every member), this rank's measured/predicted ratio per timed call per option, and what the
    group agreed each option measured at the class's size (seconds, max over the members)."""

    current: Option
    serial: int  # this class's trials on this group so far, in this process (the same count on every member)
    issued: int = 0
    waited: int = 0
    rounds: int = 0
    ratios: dict[Option, list[float]] = field(default_factory=dict)
    measured: dict[Option, float] = field(default_factory=dict)
    done: bool = False


class RuntimePlanner:
    """One engine's planner: load or measure the calibration (start), then choose per collective (choose), log
    each plan once (rank 0, through `log`), and time the calls (timed)."""

    def __init__(self, settings: PlannerSettings, policy: Policy, log: Callable[[str], None], where: str) -> None:
        self.settings, self.policy, self.log, self.where = settings, policy, log, where
        self.calibration: Calibration | None = None
        self.fallback = ""  # why the fixed choice is used ("" while planning from a calibration)
        self._planners: dict[Policy, Planner] = {}
        self._logged: set[int] = set()
        self._timed: dict[tuple, int] = {}  # (op, id(plan), option) -> calls timed on a GPU (TIMED_ON_GPU)
        self._trials: dict[tuple[int, int], _Trial] = {}  # (id(plan), id(group)) -> its trial
        self._trial_of: dict[int, list[_Trial]] = {}  # id(plan) -> its trials (record() feeds them)
        self._checks: dict[tuple, tuple[int, float, float]] = {}  # (op, plan, option) -> calls, predicted, measured
        self._predictions: dict[tuple, float] = {}  # predicted(): seconds per (op, bytes, dtype, shape, option)
        self.started = False
        self.calibrate_s: float | None = None  # seconds the measurement took (None: from a file, or not started)

    # ------------------------------------------------------------------------------------------- calibration
    def check_file(self, device: torch.device | str, ranks_per_node: int | None) -> Calibration | None:
        """Load and check the calibration file (no communication: call before any bytes move)."""
        if self.settings.calibration is None:
            return None
        try:
            cal = Calibration.load(self.settings.calibration, device=device_kind(device), ranks_per_node=ranks_per_node)
        except Fp8CommConfigError as e:
            hint = " (write one with `fp8comm calibrate --out FILE`)" if "no such file" in str(e) else ""
            raise Fp8CommConfigError(
                f"{self.where}: calibration file {self.settings.calibration!r}: {e}{hint}"
            ) from None
        return cal

    def start(self, device: torch.device | str, group: Any = None) -> None:
        """Calibrate: the file, or a measurement over `group` (collective over its members; gloo only). Every rank
        ends with the same calibration, or the same fixed choice (one CalibrationWarning)."""
        from .calibrate import calibrate

        rpn = ranks_per_node()
        cal = self.check_file(device, rpn)
        if cal is None:
            if dist.get_backend(group) != "gloo":
                raise Fp8CommConfigError(
                    f"{self.where}: the planner measures links on gloo groups only; this job runs "
                    f"{dist.get_backend(group)!r}: give a calibration file (`fp8comm calibrate --out FILE` on the same "
                    "nodes) in the planner's 'calibration' setting"
                )
            t0 = time.monotonic()
            cal = calibrate(group, timeout_s=self.settings.timeout_s)
            took = self.calibrate_s = time.monotonic() - t0
            if cal is None:
                self.fallback = "calibration did not finish (see the warning)"
                self.log(f"fp8comm planner: {self.fallback}; fixed choice: FP8, two levels where a group spans nodes")
            else:
                self.log(f"fp8comm planner: calibrated in {took:.2f} s ({_describe(cal)})")
        else:
            self.log(f"fp8comm planner: calibration from {self.settings.calibration} ({_describe(cal)})")
        self.calibration = cal
        self.started = True

    # ------------------------------------------------------------------------------------------------ choices
    def choose(
        self,
        op: str,
        nbytes: int,
        dtype: torch.dtype | str,
        shape: GroupShape,
        *,
        two_level: bool,
        native_op: str | None = None,
        group: Any = NO_TRIALS,
    ) -> Choice:
        """The option for one collective of `nbytes` (its size class's plan). two_level: the group can run two
        levels (prepared node groups); native_op: the engine's own collective when it is another op than ours
        (ZeRO-1/2 all-reduces its buckets where fp8comm reduce-scatters to the owners); group: the collective's
        process group (None: the world, as in torch.distributed), where its members agree on a trial (not given:
        no trial, the prediction alone). Every member must call this for the same collectives in the same order."""
        if self.calibration is None:
            return Choice(FALLBACK if two_level else Option("fp8"), None)
        dtype = _two_bytes(dtype)
        pol = self.policy if two_level else replace(self.policy, two_level=False)
        planner = self._planners.get(pol)
        if planner is None:
            planner = self._planners[pol] = Planner(pol, self.calibration)
        p = planner.plan(op, nbytes, dtype, shape, native_op=native_op)
        if id(p) not in self._logged:
            self._logged.add(id(p))
            self.log("fp8comm plan: " + p.describe())
        if group is NO_TRIALS or not self.settings.trials:
            return Choice(p.chosen, p)
        return Choice(self._trial(p, group), p)

    # ------------------------------------------------------------------------------------------------- trials
    def _trial(self, p: Plan, group: Any) -> Option:
        """The option this call runs while measurement checks the plan (see the module's docstring)."""
        key = (id(p), id(group))  # id(None): the world
        t = self._trials.get(key)
        if t is None:
            n = (p.op, p.dtype, p.size_class, topology.group_ranks(group))
            _serials[n] = _serials.get(n, 0) + 1
            t = self._trials[key] = _Trial(p.chosen, _serials[n])
            self._trial_of.setdefault(id(p), []).append(t)
        if not t.done and t.issued >= 1 + TRIAL_CALLS:
            self._agree(p, t, group)
        t.issued += 1
        return t.current

    def _agree(self, p: Plan, t: _Trial, group: Any) -> None:
        """Once every member has TRIAL_CALLS timings of the running option past its first call: the group's max of
        the median measured/predicted ratio; then try the untried option expected fastest (its prediction, corrected
        by a tried option on its wire) if that beats the best measured, or keep the best measured (the plan's own
        choice on a tie)."""
        mine = t.ratios.get(t.current, [])[1:]
        have = len(mine) >= TRIAL_CALLS
        ratio = sorted(mine)[len(mine) // 2] if have else 0.0
        t.rounds += 1
        got = exchange(group, f"{p.op}/{p.dtype}/{p.size_class}/{t.serial}/{t.rounds}", [0.0 if have else 1.0, ratio])
        missing, ratio = max(v[0] for v in got), max(v[1] for v in got)
        if missing:
            t.waited += 1
            if t.waited >= TRIAL_WAIT:  # timings never came (a handle nobody waits): the best measured stands
                t.done, t.current = True, _best(t, p) if t.measured else t.current
            return
        t.measured[t.current] = ratio * (p.candidate(t.current).seconds or 0.0)
        best = _best(t, p)
        # an untried option's expected time: its prediction, corrected by what a tried option on the same wire
        # measured against its own (the model's error is mostly per codec: its passes over the bucket)
        off = {o.wire: t.measured[o] / (p.candidate(o).seconds or 1.0) for o in t.measured}
        untried = sorted(
            [
                (c.seconds * off.get(c.option.wire, 1.0), c.seconds, c.option)
                for c in p.candidates
                if not c.excluded and c.seconds is not None and c.option not in t.measured
            ],
            key=lambda u: u[:2],
        )
        untried = [u for u in untried if u[0] < t.measured[best]]
        if untried and len(t.measured) <= TRIALS:
            expect, pred, nxt = untried[0]
            self.log(
                f"fp8comm planner: {p.op} of {p.role} class {p.size_class}: "
                f"{t.current.label(p.dtype, p.backend)} measured {t.measured[t.current] * 1e3:.1f} ms "
                f"(predicted {(p.candidate(t.current).seconds or 0.0) * 1e3:.1f}); trying "
                f"{nxt.label(p.dtype, p.backend)} (predicted {pred * 1e3:.1f} ms, expected {expect * 1e3:.1f}) for "
                f"{1 + TRIAL_CALLS} calls"
            )
            t.current, t.issued = nxt, 0
            return
        t.done, t.current = True, best
        if len(t.measured) > 1:
            tried = ", ".join(f"{o.label(p.dtype, p.backend)} {s * 1e3:.1f} ms" for o, s in t.measured.items())
            self.log(
                f"fp8comm planner: {p.op} of {p.role} class {p.size_class}: measured {tried}; keeps "
                f"{best.label(p.dtype, p.backend)}"
            )

    def trials(self) -> list[dict]:
        """Every trial so far: the plan's class, the option running (final once done), each tried option's agreed
        measured ms at the class's size."""
        out = []
        for p in self.plans:
            for t in self._trial_of.get(id(p), []):
                out.append(
                    {
                        "op": p.op,
                        "role": p.role,
                        "size_class": p.size_class,
                        "planned": p.chosen.label(p.dtype, p.backend),
                        "running": t.current.label(p.dtype, p.backend),
                        "done": t.done,
                        "measured_ms": {o.label(p.dtype, p.backend): s * 1e3 for o, s in t.measured.items()},
                    }
                )
        return out

    @property
    def plans(self) -> list[Plan]:
        return [p for pl in self._planners.values() for p in pl.plans]

    @contextmanager
    def timed(
        self,
        op: str,
        choice: Choice,
        nbytes: int,
        dtype: torch.dtype | str,
        shape: GroupShape,
        device: torch.device | str,
        native_op: str | None = None,
    ) -> Iterator[None]:
        """Record this call's predicted and measured seconds in comm_stats()[op] (predicted_s, measured_s,
        timed_calls): measured is the wall time of the block. On GPUs the device is synchronized at both ends, which
        stops the overlap of communication with compute, so only the first TIMED_ON_GPU calls of each plan (size
        class) are timed there; on CPUs every call."""
        if choice.plan is None or self.calibration is None:
            yield
            return
        if torch.device(device).type == "cuda":
            key = (op, id(choice.plan), choice.option)
            n = self._timed.get(key, 0)
            if n >= TIMED_ON_GPU:
                yield
                return
            self._timed[key] = n + 1
        opt = choice.option
        dtype = _two_bytes(dtype)
        pred = self.predicted(native_op if (opt.native and native_op) else op, nbytes, dtype, shape, opt)
        _sync(device)
        t0 = time.perf_counter()
        yield
        _sync(device)
        self.record(op, choice, pred, time.perf_counter() - t0)

    def predicted(self, op: str, nbytes: int, dtype: torch.dtype | str, shape: GroupShape, option: Option) -> float:
        """planner.predict from this calibration, remembered per call shape: the same buckets recur every step, and
        the model's arithmetic would otherwise run in Python on every timed call."""
        key = (op, nbytes, str(_two_bytes(dtype)), shape, option)
        got = self._predictions.get(key)
        if got is None:
            assert self.calibration is not None
            got = self._predictions[key] = predict(op, nbytes, _two_bytes(dtype), shape, option, self.calibration)
        return got

    def record(self, op: str, choice: Choice, predicted_s: float, measured_s: float) -> None:
        """One timed call into comm_stats()[op]; once a plan's measured time is known (CHECK_AFTER calls past the
        first, which may compile), a plan measured at more than OFF_BY x or less than 1/OFF_BY x its prediction is
        logged once: the choice rests on that prediction, so the user should know it may be wrong."""
        PROCESS_STATS.record_time(op, predicted_s, measured_s)
        if choice.plan is None:
            return
        if predicted_s > 0:
            for t in self._trial_of.get(id(choice.plan), []):
                if not t.done:
                    t.ratios.setdefault(choice.option, []).append(measured_s / predicted_s)
        key = (op, id(choice.plan), choice.option)
        n, p, m = self._checks.get(key, (0, 0.0, 0.0))
        n += 1
        if n > 1:  # the first call of a plan may compile kernels: left out
            p, m = p + predicted_s, m + measured_s
        self._checks[key] = (n, p, m)
        if n == CHECK_AFTER + 1 and p > 0 and not (1 / OFF_BY <= m / p <= OFF_BY):
            k = CHECK_AFTER
            self.log(
                f"fp8comm planner: {op} of {_size(choice.plan.nbytes)} class {choice.plan.size_class} "
                f"({choice.option.label(choice.plan.dtype, choice.plan.backend)}): measured {m / k * 1e3:.1f} ms per "
                f"call over {k} calls, predicted {p / k * 1e3:.1f} ms ({m / p:.1f}x): the plan rests on that "
                "prediction and may not be the fastest; a calibration file from a quiet run of `fp8comm calibrate` "
                "on these nodes, or a fixed format, may do better"
            )


_serials: dict[tuple, int] = {}  # (op, dtype, class, group ranks) -> trials started in this process


def _best(t: _Trial, p: Plan) -> Option:
    """The option measured fastest (the plan's own on a tie)."""
    return min(t.measured, key=lambda o: (t.measured[o], o != p.chosen))


def exchange(group: Any, key: str, values: list[float]) -> list[list[float]]:
    """Every member's `values` under `key`, through the default group's c10d store: no collective, so it may run
    inside an engine's coalescing block (Megatron issues its buckets in one) and moves nothing on the group's links.
    Blocks up to the store's timeout (the process group's) for a member that never comes, as its collective would."""
    store = dist.distributed_c10d._get_default_store()
    ranks = topology.group_ranks(group)
    tag = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    kv = dist.PrefixStore(f"fp8comm-trial/{tag}/{key}/", store)
    kv.set(str(dist.get_rank()), json.dumps(values))
    got = []
    for r in ranks:
        try:
            got.append(json.loads(kv.get(str(r))))
        except (RuntimeError, dist.DistError) as e:  # the store's timeout (DistStoreError), or the store gone
            raise Fp8CommStateError(
                f"fp8comm planner: rank {r} did not report its timings for the trial {key!r} on group ranks "
                f"{list(ranks)} within the store's timeout ({type(e).__name__}: {e}); every member must issue the "
                "same collectives in the same order (or turn trials off: planner 'trials': false)"
            ) from e
    return got


def _size(n: int) -> str:
    for unit, b in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= b:
            return f"<= {n / b:g} {unit}"
    return f"<= {n} B"


def _two_bytes(dtype: torch.dtype | str) -> torch.dtype | str:
    """fp16 is planned as bf16: the same bytes on the wire and through the codecs (the planner names bf16/fp32)."""
    return "bf16" if dtype in (torch.float16, "fp16", "float16") else dtype


def _sync(device: torch.device | str) -> None:
    d = torch.device(device)
    if d.type == "cuda":
        torch.cuda.synchronize(d)


def ranks_per_node() -> int | None:
    """Ranks per node of the world (None: uneven); gathers the node table once per world (collective)."""
    table = topology.node_table()
    counts = {n: table.nodes.count(n) for n in set(table.nodes)}
    per = set(counts.values())
    return per.pop() if len(per) == 1 else None


def _describe(cal: Calibration) -> str:
    return (
        f"cross-node {cal.inter.bandwidth * 8 / 1e6:.0f} Mbit/s, node-local {cal.intra.bandwidth * 8 / 1e6:.0f} "
        f"Mbit/s, {cal.ranks_per_node} ranks per node, {cal.device}, {cal.backend}"
    )


__all__ = ["NATIVE", "Choice", "PlannerSettings", "RuntimePlanner", "group_shape", "parse_settings", "ranks_per_node"]
