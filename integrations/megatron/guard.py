"""The numerics guard for Megatron's FP8 and 4-bit buckets: one fp8comm Guard, a stable key per bucket, decided
per step (4-bit gradient buckets fall back to FP8, then to Megatron's own collective).

Buckets are keyed by kind and first-call order ("grad0", "param2", ...; "moe0" for the first MoE layer's token
traffic): Megatron issues these collectives in the same order on every rank of a pipeline stage, so those ranks
build the same table; the guard decides over them (tensor x data x context parallel group), each stage on its own.
The optimizer's step() (wrapped, like error feedback's skipped-step reset) ends each step with Guard.step(); a
bucket the guard sends to BF16 calls Megatron's own collective (the bucket's own dtype) until its cooldown ends.
guard_state_dict() / load_guard_state_dict() carry the guard's state through a checkpoint (the same on every rank).
"""

from __future__ import annotations

import weakref

import torch

from fp8comm.comm import Guard, GuardBucket

from .config import count
from .installation import current, installed


def active() -> Guard | None:
    """The installation's guard (None: not installed, or installed without --fp8comm-guard)."""
    inst = current()
    return None if inst is None else inst.guard


def route(kind: str, owner, device: torch.device | None = None, fp4: bool = False) -> tuple[str, GuardBucket | None]:
    """(wire, the bucket to count into) for this bucket's next collective: "fp8" (or "fp4" for a bucket configured
    in 4 bits, fp4=True), "fp8" for a 4-bit bucket the guard demoted, or ("bf16", None); without a guard the
    configured wire and None. kind: "grad" or "param" (owner: the bucket's persistent Megatron buffer) or "moe"
    (owner: the MoE layer's token dispatcher, whose dispatch and combine share one bucket; device: the tokens')."""
    inst = installed()
    g = inst.guard
    if g is None:
        return ("fp4" if fp4 else "fp8"), None
    if g.group is None:
        g.group = _stage_group()
    keys = inst.guard_keys
    ident = (kind, id(owner))
    entry = keys.get(ident)
    if entry is None or entry[0]() is not owner:
        entry = keys[ident] = (weakref.ref(owner), f"{kind}{sum(1 for k in keys if k[0] == kind)}")
    key = entry[1]
    bucket = g.bucket(key, owner.device if device is None else device, fp4=fp4)
    wire = g.wire(key)
    if wire == "bf16":
        count("guard", f"{kind}_bf16_calls")
        return "bf16", None
    if fp4 and wire == "fp8":
        count("guard", f"{kind}_fp8_calls")  # a 4-bit bucket demoted to FP8 for its cooldown
    return wire, bucket


def _stage_group():
    """The ranks the guard decides over: every rank of this pipeline stage (tensor x data x context parallel).

    They hold the same layers, hence the same bucket table, and every bucket collective (DP buckets, expert-DP
    buckets) runs inside it; other stages have other buckets under the same keys, so a world-wide guard would sum
    unrelated counts (or refuse: different bucket counts). None (the world) without Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)


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
