"""Reversible patches, per-engine routing tags and per-hook byte accounting shared by the hook modules.

Patches are recorded in install order and undone in reverse; a name that someone else re-patched after us is
reported, not silently clobbered. DeepSpeed looks the patched module globals up at call time without any engine
context, so each replacement is a dispatcher: it finds the engine through what it is called with (a tag on a
parameter, flat buffer or MoE layer; a per-instance wrapper of the engine's optimizer) and calls DeepSpeed's
original for anything that belongs to no fp8comm engine (counted in PASSTHROUGH). Byte accounting attributes
fp8comm.comm's own counters (bytes this rank sends to other ranks) to the engine and hook that caused them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from dataclasses import dataclass, field

from fp8comm.comm import comm_stats
from fp8comm.errors import Fp8CommRuntimeError

log = logging.getLogger("fp8comm.deepspeed")


def say_rank0(msg: str) -> None:
    """An always-on line on rank 0 only, printed as DeepSpeed prints its own (its logger hides INFO by default), and
    logged there for programs that capture logging."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    from deepspeed.utils.logging import print_dist

    print_dist(msg, ranks=[0])
    log.info(msg)


MARK = "_fp8comm_hook"  # set on every replacement, so a second install can tell ours from DeepSpeed's
TAG = "_fp8comm_engine"  # on parameters, flat buffers, MoE layers and the engine: the EngineState they belong to


def owner(obj):
    """The attached EngineState `obj` was tagged with, or None (DeepSpeed's original then runs)."""
    es = getattr(obj, TAG, None)
    return es if es is not None and es.attached else None


def tag(es, obj) -> None:
    """Mark `obj` as belonging to engine state `es` (undone by es.detach())."""
    setattr(obj, TAG, es)
    es.undo.append(lambda: obj.__dict__.pop(TAG, None) if getattr(obj, TAG, None) is es else None)


def wrap_method(es, obj, name: str, make) -> None:
    """Give `obj` (one optimizer instance) its own `name`: make(bound original) -> replacement; undone by detach()."""
    had, prev = name in obj.__dict__, obj.__dict__.get(name)
    replacement = make(getattr(obj, name))
    setattr(replacement, MARK, True)
    setattr(obj, name, replacement)

    def undo():
        if had:
            setattr(obj, name, prev)
        else:
            obj.__dict__.pop(name, None)

    es.undo.append(undo)


@dataclass
class _Patch:
    owner: object
    name: str
    original: object
    replacement: object


class Patcher:
    def __init__(self) -> None:
        self._patches: list[_Patch] = []

    @staticmethod
    def _locate(module: str, dotted: str):
        owner = importlib.import_module(module)
        *path, name = dotted.split(".")
        for p in path:
            owner = getattr(owner, p)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        return owner, name, original

    def original(self, module: str, dotted: str):
        """What `module.dotted` is now (raw: a plain function for methods), before patching it."""
        return self._locate(module, dotted)[2]

    def set(self, module: str, dotted: str, make) -> object:
        """Replace `module.dotted` ("name" or "Class.name") with make(original); returns the replacement."""
        owner, name, original = self._locate(module, dotted)
        if getattr(original, MARK, False):
            raise Fp8CommRuntimeError(
                f"{module}.{dotted} is already an fp8comm hook (installed twice without uninstall)"
            )
        replacement = make(original)
        try:
            setattr(replacement, MARK, True)
        except (AttributeError, TypeError):
            pass
        setattr(owner, name, replacement)
        self._patches.append(_Patch(owner, name, original, replacement))
        return replacement

    def restore(self, keep: int = 0) -> list[str]:
        """Undo every patch after the first `keep` (reverse order); returns warnings for names someone else changed
        after us."""
        warnings = []
        while len(self._patches) > keep:
            p = self._patches.pop()
            current = p.owner.__dict__.get(p.name) if isinstance(p.owner, type) else getattr(p.owner, p.name, None)
            if current is not p.replacement:
                warnings.append(
                    f"{getattr(p.owner, '__name__', p.owner)}.{p.name} was changed by someone else after "
                    "fp8comm patched it; restoring DeepSpeed's original anyway"
                )
            setattr(p.owner, p.name, p.original)
        return warnings

    def __len__(self) -> int:
        return len(self._patches)


# ------------------------------------------------------------------------------------------------ accounting
ROLES = ("weights", "gradients", "moe.dispatch", "moe.combine", "moe.backward")


@dataclass
class RoleStats:
    calls: int = 0
    wire_bytes: int = 0  # bytes this rank sent to other ranks (FP8 payload + scales, or the native dtype)
    dtype_bytes: int = 0  # what DeepSpeed's own collective moves for the same call (its dtype, its algorithm)
    fp8_calls: int = 0

    @property
    def ratio(self) -> float:
        return self.dtype_bytes / self.wire_bytes if self.wire_bytes else float("nan")

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "fp8_calls": self.fp8_calls,
            "wire_bytes": self.wire_bytes,
            "dtype_bytes": self.dtype_bytes,
            "ratio": self.ratio,
        }


@dataclass
class Accounting:
    """One engine's bytes per traffic role and calls per hook path (PASSTHROUGH: calls that belong to no engine)."""

    roles: dict = field(default_factory=dict)
    hooks: dict = field(default_factory=dict)  # hook path -> calls (which code paths actually ran)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, role: str, wire: int, baseline: int, fp8: bool) -> None:
        with self.lock:
            s = self.roles.setdefault(role, RoleStats())
            s.calls += 1
            s.fp8_calls += int(fp8)
            s.wire_bytes += int(wire)
            s.dtype_bytes += int(baseline)

    def hit(self, path: str, n: int = 1) -> None:
        with self.lock:
            self.hooks[path] = self.hooks.get(path, 0) + n

    @contextlib.contextmanager
    def fp8(self, role: str, baseline: int | None = None, fp8: bool = True):
        """Attribute what fp8comm.comm records inside the block to `role`.

        fp8=False: the call moved another encoding (e.g. an fp8comm bf16 wire). `baseline` overrides fp8comm's own
        same-call-in-dtype figure when DeepSpeed's collective is a different
        algorithm (ZeRO-1/2 all-reduces a bucket where fp8comm reduce-scatters it to the owners)."""
        before = totals()
        yield
        after = totals()
        wire, dtype = after[0] - before[0], after[1] - before[1]
        self.add(role, wire, dtype if baseline is None else baseline, fp8)

    def reset(self) -> None:
        with self.lock:
            self.roles.clear()
            self.hooks.clear()

    def snapshot(self) -> dict:
        with self.lock:
            out = {k: v.as_dict() for k, v in self.roles.items()}
            hooks = dict(self.hooks)
        if hooks:
            out["hooks"] = hooks
        return out


PASSTHROUGH = Accounting()  # dispatcher calls that belonged to no fp8comm engine: DeepSpeed's original ran


def totals(ops=None) -> tuple[int, int, int]:
    """fp8comm.comm's (wire bytes, dtype bytes, calls) summed over `ops` (all ops when None)."""
    s = comm_stats()
    keys = [k for k in s if (ops is None or k in ops)]
    return (
        sum(s[k]["wire_bytes"] for k in keys),
        sum(s[k]["dtype_bytes"] for k in keys),
        sum(s[k]["calls"] for k in keys),
    )
