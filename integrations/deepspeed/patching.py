"""Reversible patches and per-hook byte accounting shared by the hook modules.

Patches are recorded in install order and undone in reverse; a name that someone else re-patched after us is
reported, not silently clobbered. Byte accounting attributes fp8comm.comm's own counters (bytes this rank sends to
other ranks) to the DeepSpeed hook that caused them, so "weights" and "gradients" can be reported separately.
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
MARK = "_fp8comm_hook"  # set on every replacement, so a second install can tell ours from DeepSpeed's


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
            raise Fp8CommRuntimeError(f"{module}.{dotted} is already an fp8comm hook (installed twice without uninstall)")
        replacement = make(original)
        try:
            setattr(replacement, MARK, True)
        except (AttributeError, TypeError):
            pass
        setattr(owner, name, replacement)
        self._patches.append(_Patch(owner, name, original, replacement))
        return replacement

    def restore(self) -> list[str]:
        """Undo every patch (reverse order); returns warnings for names someone else changed after us."""
        warnings = []
        while self._patches:
            p = self._patches.pop()
            current = p.owner.__dict__.get(p.name) if isinstance(p.owner, type) else getattr(p.owner, p.name, None)
            if current is not p.replacement:
                warnings.append(f"{getattr(p.owner, '__name__', p.owner)}.{p.name} was changed by someone else after "
                                "fp8comm patched it; restoring DeepSpeed's original anyway")
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
        return {"calls": self.calls, "fp8_calls": self.fp8_calls, "wire_bytes": self.wire_bytes,
                "dtype_bytes": self.dtype_bytes, "ratio": self.ratio}


@dataclass
class Accounting:
    roles: dict = field(default_factory=dict)
    hooks: dict = field(default_factory=dict)  # hook path -> calls (which code paths actually ran)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _backward_base: tuple[int, int, int] = (0, 0, 0)

    def add(self, role: str, wire: int, baseline: int, fp8: bool) -> None:
        with self.lock:
            s = self.roles.setdefault(role, RoleStats())
            s.calls += 1
            s.fp8_calls += int(fp8)
            s.wire_bytes += int(wire)
            s.dtype_bytes += int(baseline)

    def hit(self, path: str) -> None:
        with self.lock:
            self.hooks[path] = self.hooks.get(path, 0) + 1

    @contextlib.contextmanager
    def fp8(self, role: str, baseline: int | None = None):
        """Attribute what fp8comm.comm records inside the block to `role`.

        `baseline` overrides fp8comm's own same-call-in-dtype figure when DeepSpeed's collective is a different
        algorithm (ZeRO-1/2 all-reduces a bucket where fp8comm reduce-scatters it to the owners)."""
        before = _totals()
        yield
        after = _totals()
        wire, dtype = after[0] - before[0], after[1] - before[1]
        self.add(role, wire, dtype if baseline is None else baseline, True)

    def reset(self) -> None:
        with self.lock:
            self.roles.clear()
            self.hooks.clear()
            self._backward_base = _totals(("all_to_all.backward",))

    def snapshot(self) -> dict:
        with self.lock:
            out = {k: v.as_dict() for k, v in self.roles.items()}
            hooks = dict(self.hooks)
        # The MoE backward all-to-all runs inside autograd, outside any hook call: read fp8comm's own counter.
        w, d, c = _totals(("all_to_all.backward",))
        bw, bd, bc = self._backward_base
        if c - bc:
            out["moe.backward"] = RoleStats(c - bc, w - bw, d - bd, c - bc).as_dict()
        if hooks:
            out["hooks"] = hooks
        return out


def _totals(ops=None) -> tuple[int, int, int]:
    s = comm_stats()
    keys = [k for k in s if (ops is None or k in ops)]
    return (sum(s[k]["wire_bytes"] for k in keys), sum(s[k]["dtype_bytes"] for k in keys),
            sum(s[k]["calls"] for k in keys))
