"""The wire chosen by prediction: for one collective (op, bytes, dtype, group shape) predict every option's time
from a Calibration with the one byte and time model (linkmodel.time), and pick the fastest the numerics policy
allows, per bucket-size class, the same on every rank.

Options: the engine's own collective in its dtype (NCCL's ring on nccl, torch's gloo call on gloo: what DeepSpeed,
Megatron and FSDP2 run without fp8comm), or fp8comm's call on a quantized wire (fp8, fp8_e8m0, mxfp4, nvfp4), flat or
two-level. Pipelining is not an option but what fp8comm does: pieces from the call's size on CPU
(pieces.piece_count), one piece on GPUs. The policy: gradients in 4 bits only when allowed, and then only the
validated recipe (mxfp4 with error feedback, docs/collectives.md "Which 4-bit gradient recipe"); weights at most FP8
unless 4-bit updates are allowed, which only an engine that keeps weight replicas between steps can take. The
numerics guard still overrides a chosen wire per bucket at run time (guard.config_for); the plan is the start.

Size classes: class k holds the buckets of (2^(k-1), 2^k] bytes and is decided at 2^k bytes. A class is an integer
every rank computes alike from the byte count; each option's predicted time is close to affine in the bytes
(latency + bytes / bandwidth + elements / codec speed), so two options cross at most once per pair and a class can
hold a wrong pick only next to a crossover, where the options' times are close; an engine's buckets fall in one or
two classes (the full bucket, the tail), each decided once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..errors import Fp8CommConfigError
from . import linkmodel
from .calibration import WIRE_CONFIGS, Calibration
from .config import WireConfig, residual_dtype_name
from .pieces import GATHER_SPLIT, piece_count

OPS = ("reduce_scatter", "all_gather", "all_reduce")
ROLES = ("gradients", "weights")
ROLE_OF = {"reduce_scatter": "gradients", "all_reduce": "gradients", "all_gather": "weights"}
LEVELS = ("flat", "two_level")
NATIVE = "native"
DTYPES = {"bf16": 2, "fp32": 4}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float32": "fp32", torch.bfloat16: "bf16", torch.float32: "fp32"}
FP8_SCALES = {"fp32": "fp8", "e8m0": "fp8_e8m0"}  # Policy.fp8_scales -> codec
RECIPE_4BIT = "mxfp4"  # the validated 4-bit gradient recipe: mxfp4 + error feedback, nearest rounding, no transform


def _err(msg: str) -> Fp8CommConfigError:
    return Fp8CommConfigError(f"planner: {msg}")


def dtype_name(dtype: str | torch.dtype) -> str:
    """'bf16' or 'fp32' (aliases: bfloat16, float32, torch dtypes); anything else is an error naming the valid ones."""
    d = _DTYPE_ALIASES.get(dtype, dtype)
    if d not in DTYPES:
        raise _err(f"unknown dtype {dtype!r}; valid: bf16 (bfloat16), fp32 (float32)")
    return str(d)


@dataclass(frozen=True)
class GroupShape:
    """A process group's members: `nodes` nodes with `ranks_per_node` members each (node-major, as torchrun)."""

    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for k in ("nodes", "ranks_per_node"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _err(f"GroupShape.{k} must be an int >= 1, got {v!r}")

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def spans_nodes(self) -> bool:
        """Two levels apply: >= 2 nodes with >= 2 members on each (fp8comm's topology rule)."""
        return self.nodes > 1 and self.ranks_per_node > 1


@dataclass(frozen=True)
class Policy:
    """What the numerics allow. allow_4bit: 4-bit gradients (then the recipe: mxfp4 with error feedback, its residual
    in residual_dtype; residual_option names the engine's memory switch the recipe needs, e.g. DeepSpeed ZeRO-2's
    allow_unpartitioned_residuals, so the log can state it). allow_4bit_updates: 4-bit weight changes
    (ReplicaUpdate), only where the engine keeps weight replicas between steps (replicas=True: ZeRO-1/2, Megatron's
    distributed optimizer; ZeRO-3 and FSDP2 keep none). fp8_scales: the FP8 scale encodings that may be chosen.
    two_level: may choose two levels where a group spans nodes. fp8_feedback: the user asked for error feedback on
    FP8 gradients (4 bits not allowed): FP8 gradient options carry it, predicted with its cost and kept on the call;
    otherwise FP8 runs without it (with allow_4bit the residual belongs to the 4-bit recipe)."""

    allow_4bit: bool = False
    allow_4bit_updates: bool = False
    replicas: bool = True
    fp8_scales: tuple[str, ...] = ("fp32",)
    two_level: bool = True
    residual_dtype: str = "float32"
    residual_option: str = ""
    fp8_feedback: bool = False

    def __post_init__(self) -> None:
        for k in ("allow_4bit", "allow_4bit_updates", "replicas", "two_level", "fp8_feedback"):
            if not isinstance(getattr(self, k), bool):
                raise _err(f"Policy.{k} must be True or False, got {getattr(self, k)!r}")
        scales = (self.fp8_scales,) if isinstance(self.fp8_scales, str) else tuple(self.fp8_scales)
        bad = [s for s in scales if s not in FP8_SCALES]
        if bad or not scales:
            raise _err(f"Policy.fp8_scales: unknown {bad or 'empty'}; valid: {', '.join(FP8_SCALES)}")
        object.__setattr__(self, "fp8_scales", scales)
        object.__setattr__(self, "residual_dtype", residual_dtype_name(self.residual_dtype))
        if self.allow_4bit_updates and not self.replicas:
            raise _err(
                "allow_4bit_updates needs an engine that keeps weight replicas between steps (ZeRO-1/2, Megatron's "
                "distributed optimizer); this one keeps none (ZeRO-3, FSDP2): its weights travel in FP8 at most"
            )


@dataclass(frozen=True)
class Option:
    """One way to run a collective: wire NATIVE (the engine's own call in its dtype) or a codec name, flat or
    two-level, with or without error feedback (the 4-bit gradient recipe)."""

    wire: str
    levels: str = "flat"
    feedback: bool = False

    def __post_init__(self) -> None:
        if self.wire != NATIVE and self.wire not in WIRE_CONFIGS:
            raise _err(f"unknown wire {self.wire!r}; valid: {NATIVE}, {', '.join(WIRE_CONFIGS)}")
        if self.levels not in LEVELS:
            raise _err(f"unknown levels {self.levels!r}; valid: {', '.join(LEVELS)}")
        if self.wire == NATIVE and (self.levels != "flat" or self.feedback):
            raise _err("the engine's own collective is one flat call without error feedback")

    @property
    def native(self) -> bool:
        return self.wire == NATIVE

    def label(self, dtype: str = "", backend: str = "nccl") -> str:
        if self.native:
            algo = "NCCL ring" if backend == "nccl" else "torch gloo"
            return f"engine {dtype} ({algo})".replace("  ", " ")
        return f"{self.wire}{' +EF' if self.feedback else ''} {'two-level' if self.levels == 'two_level' else 'flat'}"

    def wire_config(self, residual_dtype: str = "float32") -> WireConfig | None:
        """The WireConfig fp8comm's call takes for this option (None: the engine's own call); two levels are the
        call's `hierarchical=` argument, not part of the config."""
        if self.native:
            return None
        extra: dict = {"error_feedback": True, "residual_dtype": residual_dtype} if self.feedback else {}
        return WireConfig(**WIRE_CONFIGS[self.wire], **extra)


def _wire(codec: str) -> WireConfig:
    return WireConfig(**WIRE_CONFIGS[codec])


def options(role: str, fp8_feedback: bool = False) -> tuple[Option, ...]:
    """Every option for a role, in the fixed order that breaks ties (the engine's own first: a tie keeps it).
    Gradients: the 4-bit recipe with error feedback; FP8 with it when fp8_feedback (Policy.fp8_feedback)."""
    if role not in ROLES:
        raise _err(f"unknown role {role!r}; valid: {', '.join(ROLES)}")
    out = [Option(NATIVE)]
    for wire in WIRE_CONFIGS:
        ef = role == "gradients" and (wire == RECIPE_4BIT or (fp8_feedback and wire in FP8_SCALES.values()))
        for levels in LEVELS:
            out.append(Option(wire, levels, feedback=ef))
    return tuple(out)


def _check(op: str, nbytes: int, dtype: str | torch.dtype) -> tuple[str, int]:
    if op not in OPS:
        raise _err(f"unknown op {op!r}; valid: {', '.join(OPS)}")
    d = dtype_name(dtype)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or nbytes % DTYPES[d]:
        raise _err(f"nbytes must be a positive multiple of {d}'s {DTYPES[d]} bytes, got {nbytes!r}")
    return d, nbytes // DTYPES[d]


def pieces(op: str, option: Option, elems: int, shape: GroupShape, device_type: str) -> int:
    """The pipelined pieces fp8comm cuts this call into (pieces.piece_count with automatic pipelining and nearest
    rounding): from the whole buffer for reduce-scatters, from the shard for a flat all-gather, from the rails'
    elements (nodes x shard) for a two-level all-gather, its pieces GATHER_SPLIT times smaller (as comm/core.py and
    comm/levels.py plan them); 1 on GPUs, for the engine's own call and for codecs whose scale spans the row (NVFP4)."""
    if option.native or not _wire(option.wire).spec.codec.pipelines:
        return 1
    numel = elems
    if op == "all_gather":
        shard = -(-elems // shape.size)
        numel = shard if option.levels == "flat" else shape.nodes * shard
    split = GATHER_SPLIT if (op == "all_gather" and option.levels == "two_level") else 1
    return piece_count(numel, torch.device(device_type), "nearest", 0, split)


def estimate(
    op: str, nbytes: int, dtype: str | torch.dtype, shape: GroupShape, option: Option, calibration: Calibration
) -> linkmodel.Estimate:
    """linkmodel.time for this option: seconds and the stages they come from. nbytes: the whole buffer in `dtype`
    (the reduce-scatter's input, the all-gather's output, as linkmodel's `elems`). Where the calibration timed this
    option as a large real call on this layout, the seconds are scaled toward it (anchored())."""
    d, elems = _check(op, nbytes, dtype)
    if option.levels == "two_level" and not shape.spans_nodes:
        raise _err(
            f"two levels need >= 2 nodes with >= 2 ranks each; the group is {shape.nodes}x{shape.ranks_per_node}"
        )
    return anchored(op, d, elems, shape, option, calibration, _model(op, d, elems, shape, option, calibration))


def _model(op: str, d: str, elems: int, shape: GroupShape, option: Option, calibration: Calibration):
    m = calibration.machine(shape.nodes, shape.ranks_per_node)
    if option.native:
        return linkmodel.time(op, "ring" if calibration.backend == "nccl" else "gloo", d, m, elems)
    p = pieces(op, option, elems, shape, calibration.device_type)
    # an all_reduce's all-gather phase plans its pieces as an all-gather of the same buffer does
    pg = pieces("all_gather", option, elems, shape, calibration.device_type) if op == "all_reduce" else None
    return linkmodel.time(
        op, option.levels, option.wire, m, elems, p, dtype=d, feedback=option.feedback, gather_pieces=pg
    )


def anchored(
    op: str, d: str, elems: int, shape: GroupShape, option: Option, cal: Calibration, est: linkmodel.Estimate
) -> linkmodel.Estimate:
    """`est` scaled by what this option's large real call measured against the model at that size (q): by 1 at the
    small call's size and below (the small call already sets that), q at the large call's size and above, q ** t
    between (t from 0 to 1 in log size). Unchanged without a large call for the option on this layout. The call was
    timed on a bf16 buffer without error feedback, so q compares it with that call's model, and scales this one's
    (an fp32 buffer's, error feedback's residual stage included).

    Why: with ranks sharing cores the per-stage speeds, timed one kernel at a time, miss the calls' contention
    (docs/planner.md, "Each option measured at a large size"); the factor is per option because the miss is."""
    if not cal.large_calls or not cal.timed_on(shape.nodes, shape.ranks_per_node) or elems <= cal.small_call_elems:
        return est
    algo = ("ring" if cal.backend == "nccl" else "gloo") if option.native else option.levels
    big = cal.large_calls.get(f"{op}/{algo}/{d if option.native else option.wire}")
    if big is None:
        return est
    # the model of the call that was timed: bf16 input for a quantized option (fp32 only for the engine's own fp32
    # call, a key of its own), no error feedback (smallcalls times the wires alone); q then scales this call's model
    timed = (d, option) if option.native else ("bf16", replace(option, feedback=False))
    at = _model(op, timed[0], cal.large_call_elems, shape, timed[1], cal).seconds
    q = big / at if at > 0 else 1.0
    lo, hi = math.log(cal.small_call_elems), math.log(cal.large_call_elems)
    t = min(1.0, (math.log(elems) - lo) / (hi - lo))
    return replace(est, seconds=est.seconds * q**t, measured_scale=q**t)


def predict(
    op: str, nbytes: int, dtype: str | torch.dtype, shape: GroupShape, option: Option, calibration: Calibration
) -> float:
    """Predicted seconds of one call (estimate(...).seconds)."""
    return estimate(op, nbytes, dtype, shape, option, calibration).seconds


# ---------------------------------------------------------------------------------------------- the choice
def size_class(nbytes: int) -> int:
    """The class of a bucket of `nbytes`: k such that 2^(k-1) < nbytes <= 2^k."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise _err(f"nbytes must be a positive int, got {nbytes!r}")
    return (nbytes - 1).bit_length()


def class_bytes(k: int, dtype: str | torch.dtype = "bf16") -> int:
    """The size a class is decided at: 2^k bytes (at least one element of `dtype`)."""
    return max(1 << k, DTYPES[dtype_name(dtype)])


def excluded(option: Option, role: str, shape: GroupShape, policy: Policy) -> str:
    """Why `option` may not be chosen for `role` ("" when it may): not applicable, policy, or numerics."""
    if option.levels == "two_level":
        if not shape.spans_nodes:
            return f"n/a: two levels need >= 2 nodes with >= 2 ranks each (group {shape.nodes}x{shape.ranks_per_node})"
        if not policy.two_level:
            return "policy: two levels off"
    if option.native:
        return ""
    if option.wire in FP8_SCALES.values():
        scale = next(s for s, c in FP8_SCALES.items() if c == option.wire)
        return "" if scale in policy.fp8_scales else f"policy: FP8 with {scale} scales not allowed (fp8_scales)"
    if role == "gradients":
        if option.wire != RECIPE_4BIT or not option.feedback:
            return f"numerics: not the validated 4-bit gradient recipe ({RECIPE_4BIT} with error feedback)"
        return "" if policy.allow_4bit else "policy: 4-bit gradients not allowed (allow_4bit)"
    if option.wire != RECIPE_4BIT:
        return f"numerics: 4-bit weight changes validated in {RECIPE_4BIT} only"
    if not policy.allow_4bit_updates:
        return "policy: weights at most FP8 (4-bit updates not allowed)"
    return ""


@dataclass(frozen=True)
class Candidate:
    """One option's predicted seconds at the class's size (None: not applicable) and why it is excluded ("": it
    may be chosen)."""

    option: Option
    seconds: float | None
    excluded: str = ""


@dataclass(frozen=True)
class Plan:
    """The choice for one size class of one collective: every option's prediction, the chosen one and why."""

    op: str
    role: str
    dtype: str
    shape: GroupShape
    size_class: int
    nbytes: int  # the size it was decided at (class_bytes)
    backend: str
    chosen: Option
    candidates: tuple[Candidate, ...]
    reason: str
    notes: tuple[str, ...] = field(default=())

    @property
    def seconds(self) -> float:
        return self.candidate(self.chosen).seconds or 0.0

    def candidate(self, option: Option) -> Candidate:
        for c in self.candidates:
            if c.option == option:
                return c
        raise _err(f"{option} is not an option of this plan")

    def describe(self) -> str:
        """Log lines: the class, each option's predicted ms (excluded ones with the reason), the choice."""
        head = (
            f"{self.op} of {self.role} ({self.dtype}), buckets <= {_human(self.nbytes)} (class {self.size_class}), "
            f"group {self.shape.nodes}x{self.shape.ranks_per_node}: {self.chosen.label(self.dtype, self.backend)}"
        )
        lines = [head, "  " + self.reason]
        for c in self.candidates:
            ms = "n/a" if c.seconds is None else f"{c.seconds * 1e3:.3f} ms"
            mark = "*" if c.option == self.chosen else " "
            tail = f"  [{c.excluded}]" if c.excluded else ""
            lines.append(f"  {mark} {c.option.label(self.dtype, self.backend):<28} {ms:>12}{tail}")
        lines += ["  " + n for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "role": self.role,
            "dtype": self.dtype,
            "group": [self.shape.nodes, self.shape.ranks_per_node],
            "size_class": self.size_class,
            "class_bytes": self.nbytes,
            "chosen": self.chosen.label(self.dtype, self.backend),
            "reason": self.reason,
            "notes": list(self.notes),
            "options": [
                {
                    "option": c.option.label(self.dtype, self.backend),
                    "wire": c.option.wire,
                    "levels": c.option.levels,
                    "error_feedback": c.option.feedback,
                    "ms": None if c.seconds is None else c.seconds * 1e3,
                    "excluded": c.excluded,
                }
                for c in self.candidates
            ],
        }


def _human(n: float) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n / s:g} {unit}"
    return f"{n:g} B"


def choose(
    op: str,
    nbytes: int,
    dtype: str | torch.dtype,
    shape: GroupShape,
    policy: Policy,
    calibration: Calibration,
    role: str | None = None,
    native_op: str | None = None,
) -> Plan:
    """The plan for the size class of a bucket of `nbytes`: every option predicted at class_bytes(), the fastest
    allowed one chosen (ties: the earlier in options()' fixed order, the engine's own first). Deterministic: the
    same inputs give the same plan on every rank. role: gradients or weights (default: the op's, ROLE_OF);
    native_op: the engine's own collective where it is another op (ZeRO-1/2 all-reduces what fp8comm
    reduce-scatters to the owners)."""
    d, _ = _check(op, nbytes, dtype)
    if native_op is not None:
        _check(native_op, nbytes, dtype)
    role = ROLE_OF[op] if role is None else role
    if role not in ROLES:
        raise _err(f"unknown role {role!r}; valid: {', '.join(ROLES)}")
    k = size_class(nbytes)
    at = class_bytes(k, d)
    at -= at % DTYPES[d]
    cands = []
    for opt in options(role, policy.fp8_feedback):
        why = excluded(opt, role, shape, policy)
        how = native_op if (opt.native and native_op) else op
        secs = None if why.startswith("n/a") else predict(how, at, d, shape, opt, calibration)
        cands.append(Candidate(opt, secs, why))
    allowed = [(c.seconds, i, c) for i, c in enumerate(cands) if not c.excluded and c.seconds is not None]
    best = min(allowed, key=lambda t: (t[0], t[1]))[2]  # the engine's own is always allowed: never empty
    native = cands[0]
    assert native.seconds is not None
    gain = native.seconds / best.seconds if best.seconds else 1.0
    reason = f"fastest allowed: {best.option.label(d, calibration.backend)} {best.seconds * 1e3:.3f} ms"  # type: ignore[operator]
    if not best.option.native:
        reason += f", {gain:.2f}x the engine's own ({native.seconds * 1e3:.3f} ms)"
    faster = [c for c in cands if c.excluded and c.seconds is not None and c.seconds < best.seconds]  # type: ignore[operator]
    if faster:
        f = min(faster, key=lambda c: c.seconds)  # type: ignore[arg-type,return-value]
        reason += (
            f"; faster but excluded: {f.option.label(d, calibration.backend)} {f.seconds * 1e3:.3f} ms ({f.excluded})"  # type: ignore[operator]
        )
    notes = []
    if native_op is not None and native_op != op:
        notes.append(f"the engine's own call: an {native_op.replace('_', '-')} of the same bytes")
    if best.option.feedback:
        rb = {"float32": 4, "bfloat16": 2, "fp8": 1}[policy.residual_dtype]
        what = "recipe" if best.option.wire == RECIPE_4BIT else "asked for"
        notes.append(
            f"{what}: {best.option.wire} with error feedback, nearest rounding: a {policy.residual_dtype} residual, "
            f"{rb} byte(s) per gradient element this rank quantizes"
            + (f"; needs {policy.residual_option}" if policy.residual_option else "")
        )
    return Plan(op, role, d, shape, k, at, calibration.backend, best.option, tuple(cands), reason, tuple(notes))


class Planner:
    """Plans per (op, role, dtype, group shape, size class), each decided once and kept: every bucket of a class
    gets the same plan, and every rank the same plans from the same calibration and policy."""

    def __init__(self, policy: Policy, calibration: Calibration) -> None:
        self.policy = policy
        self.calibration = calibration
        self._plans: dict[tuple, Plan] = {}

    def plan(
        self,
        op: str,
        nbytes: int,
        dtype: str | torch.dtype,
        shape: GroupShape,
        role: str | None = None,
        native_op: str | None = None,
    ) -> Plan:
        d, _ = _check(op, nbytes, dtype)
        key = (op, role or ROLE_OF[op], d, shape, size_class(nbytes), native_op)
        if key not in self._plans:
            self._plans[key] = choose(op, nbytes, d, shape, self.policy, self.calibration, role, native_op)
        return self._plans[key]

    @property
    def plans(self) -> tuple[Plan, ...]:
        """Every plan decided so far, in the order decided."""
        return tuple(self._plans.values())
