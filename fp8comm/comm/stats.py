"""Per-op communication counters: calls, bytes on the wire, and what the same call would move in its input dtype.

"Bytes on the wire" are the bytes this rank sends to OTHER ranks (its own chunk never crosses a link), padding and
scales included; the baseline uses the same definition for the input dtype, so the ratio is the saving. Every
Buffer keeps its own Stats; each record also adds to the process totals that comm_stats() reports.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class OpStats:
    calls: int = 0
    wire_bytes: int = 0  # FP8 payload + scales (+ alignment) sent to other ranks
    dtype_bytes: int = 0  # what the same call moves in its input dtype
    check_bytes: int = 0  # metadata-check descriptors sent to other ranks
    plan_bytes: int = 0  # token counts sent to plan an all-to-all's pieces (CPU, given splits, unchecked calls)
    elements: int = 0  # elements quantized by this rank
    timed_calls: int = 0  # calls the planner timed (planned.RuntimePlanner.timed), any wire, the engine's own too
    predicted_s: float = 0.0  # the planner's predicted seconds of those calls
    measured_s: float = 0.0  # their measured wall seconds

    @property
    def ratio(self) -> float:
        return self.dtype_bytes / self.wire_bytes if self.wire_bytes else float("nan")

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "wire_bytes": self.wire_bytes,
            "dtype_bytes": self.dtype_bytes,
            "check_bytes": self.check_bytes,
            "plan_bytes": self.plan_bytes,
            "elements": self.elements,
            "ratio": self.ratio,
            "timed_calls": self.timed_calls,
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
        }


class Stats:
    """{op: OpStats} with a lock; `parent` (the process totals) receives every record too."""

    def __init__(self, parent: Stats | None = None) -> None:
        self.ops: dict[str, OpStats] = {}
        self.parent = parent
        self._lock = threading.Lock()

    def record(
        self,
        op: str,
        wire_bytes: int,
        dtype_bytes: int,
        elements: int = 0,
        check_bytes: int = 0,
        calls: int = 1,
        plan_bytes: int = 0,
    ) -> None:
        with self._lock:
            s = self.ops.setdefault(op, OpStats())
            s.calls += calls
            s.wire_bytes += int(wire_bytes)
            s.dtype_bytes += int(dtype_bytes)
            s.check_bytes += int(check_bytes)
            s.plan_bytes += int(plan_bytes)
            s.elements += int(elements)
        if self.parent is not None:
            self.parent.record(op, wire_bytes, dtype_bytes, elements, check_bytes, calls, plan_bytes)

    def record_time(self, op: str, predicted_s: float, measured_s: float) -> None:
        """One planned call: its predicted and measured seconds."""
        with self._lock:
            s = self.ops.setdefault(op, OpStats())
            s.timed_calls += 1
            s.predicted_s += float(predicted_s)
            s.measured_s += float(measured_s)
        if self.parent is not None:
            self.parent.record_time(op, predicted_s, measured_s)

    def snapshot(self, reset: bool = False) -> dict[str, dict]:
        """{op: {calls, wire_bytes, dtype_bytes, check_bytes, plan_bytes, elements, ratio}}; reset=True clears this."""
        with self._lock:
            out = {k: v.as_dict() for k, v in sorted(self.ops.items())}
            if reset:
                self.ops.clear()
        return out

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()


PROCESS_STATS = Stats()  # every Buffer's records, summed: what this process sent


def comm_stats(reset: bool = False) -> dict[str, dict]:
    """{op: {calls, wire_bytes, dtype_bytes, check_bytes, plan_bytes, elements, ratio, timed_calls, predicted_s,
    measured_s}} for this process (the times: calls an engine's planner chose, the engine's own ones included);
    reset=True clears."""
    return PROCESS_STATS.snapshot(reset)


def reset_comm_stats() -> None:
    PROCESS_STATS.reset()


def format_comm_stats(stats: dict | None = None) -> str:
    """A plain-text table of comm_stats() for logs."""
    stats = comm_stats() if stats is None else stats
    timed = any(s.get("timed_calls") for s in stats.values())
    head = f"{'op':<28}{'calls':>8}{'wire MB':>12}{'dtype MB':>12}{'saved':>8}"
    rows = [head + (f"{'planned':>9}{'pred ms':>10}{'meas ms':>10}" if timed else "")]
    for op, s in stats.items():
        row = f"{op:<28}{s['calls']:>8}{s['wire_bytes'] / 1e6:>12.3f}{s['dtype_bytes'] / 1e6:>12.3f}{s['ratio']:>7.3f}x"
        if timed:
            n = s.get("timed_calls", 0)
            row += f"{n:>9}{s['predicted_s'] * 1e3:>10.1f}{s['measured_s'] * 1e3:>10.1f}" if n else f"{'-':>9}"
        rows.append(row)
    return "\n".join(rows)
