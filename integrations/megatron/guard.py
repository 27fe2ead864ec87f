"""The numerics guard for Megatron's FP8 buckets: one fp8comm Guard, a stable key per bucket, decided per step.

Buckets are keyed by kind and first-call order ("grad0", "param2", ...): Megatron issues its bucket collectives in
the same order on every rank, so every rank builds the same table. The optimizer's step() (wrapped, like error
feedback's skipped-step reset) ends each step with Guard.step(); a bucket the guard sends to BF16 calls
Megatron's own collective (the bucket's own dtype) until its cooldown ends. guard_state_dict() /
load_guard_state_dict() carry the guard's state through a checkpoint (the same on every rank).
"""

from __future__ import annotations

import weakref

import torch

from fp8comm.comm import Guard, GuardBucket

from .config import Fp8CommMegatronConfig, count

_GUARD: list[Guard] = []
_KEYS: dict[tuple[str, int], tuple[weakref.ref, str]] = {}  # (kind, id(buffer)) -> (weakref, key)


def configure(cfg: Fp8CommMegatronConfig) -> None:
    """Create the guard for an install with cfg.guard (install calls it)."""
    reset_state()
    if cfg.guard:
        _GUARD.append(Guard(cfg.guard_policy))


def reset_state() -> None:
    _GUARD.clear()
    _KEYS.clear()


def active() -> Guard | None:
    return _GUARD[0] if _GUARD else None


def route(kind: str, buffer: torch.Tensor) -> tuple[str, GuardBucket | None]:
    """("fp8", the bucket to count into) or ("bf16", None) for this bucket's next collective; ("fp8", None)
    without a guard. kind: "grad" or "param"; buffer: the bucket's persistent Megatron buffer."""
    g = active()
    if g is None:
        return "fp8", None
    ident = (kind, id(buffer))
    entry = _KEYS.get(ident)
    if entry is None or entry[0]() is not buffer:
        entry = _KEYS[ident] = (weakref.ref(buffer), f"{kind}{sum(1 for k in _KEYS if k[0] == kind)}")
    key = entry[1]
    if g.wire(key) == "bf16":
        count("guard", f"{kind}_bf16_calls")
        return "bf16", None
    return "fp8", g.bucket(key, buffer.device)


def on_step() -> None:
    """End of an optimizer step (the engine has synchronized for the grad norm / overflow check): decide."""
    g = active()
    if g is not None:
        before = sum(s.switches for s in g.states.values())
        g.step()
        count("guard", "switches", sum(s.switches for s in g.states.values()) - before)


def state_dict() -> dict:
    """The guard's state (the same on every rank): save it with a checkpoint."""
    g = active()
    return {} if g is None else g.state_dict()


def load_state_dict(sd: dict) -> None:
    g = active()
    if g is not None and sd:
        g.load_state_dict(sd)


def summary() -> dict:
    g = active()
    return {} if g is None else g.summary()
