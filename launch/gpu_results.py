"""Rows of docs/results/gpu.json, written by the GPU scripts themselves (never typed by hand), and the driver that
runs a GPU script's sections within one hard time budget.

Schema (the GPU-speed work's): a list of {"name", "value", "target", "unit", "date", "commit", "device"}; a run
replaces the rows it measured (by name) and keeps the others. Every write is atomic (a temporary file in the same
folder, then os.replace), and the driver writes each row as it is measured: a crash mid-run loses nothing written.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = ROOT / "docs" / "results" / "gpu.json"


@functools.lru_cache(maxsize=1)
def commit() -> str:
    # the device machine gets the working tree without .git: the command passes the commit in FP8COMM_COMMIT
    if os.environ.get("FP8COMM_COMMIT"):
        return os.environ["FP8COMM_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def result_row(name: str, value, target, unit: str, device: str) -> dict:
    return {
        "name": name,
        "value": value,
        "target": target,
        "unit": unit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "device": device,
    }


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as JSON into `path` through a temporary file and os.replace: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj, indent=1, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def merge(rows: list[dict], path: Path = PATH, quiet: bool = False) -> None:
    """Write `rows` into `path` (atomically), replacing earlier rows of the same names."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else []
    names = {r["name"] for r in rows}
    write_json_atomic(path, [r for r in old if r["name"] not in names] + rows)
    if not quiet:
        print(f"wrote {len(rows)} rows into {path}", flush=True)


# ------------------------------------------------------------------------------------------------ budgeted driver
@contextlib.contextmanager
def _no_alarm():
    """Hold SIGALRM while a file is written (main thread): a cut lands after the write, never inside it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


class SectionCut(Exception):
    """Raised inside a section when its deadline passes (SIGALRM in the main thread, or a subprocess timeout)."""


@dataclass(frozen=True)
class Section:
    """One unit of a GPU script: `fn(runner) -> dict` (may carry "status": ok | fail | error | skipped).

    cap_s: the most this section may take (the run's deadline may cut it sooner); min_s: not started with less
    time than this left (it could not finish)."""

    name: str
    fn: Callable
    cap_s: float = 120.0
    min_s: float = 5.0


STATUS_UNIT = "section status: ok | fail | error | cut | skipped | running (running after the run = it died there)"


class Runner:
    """Runs sections in order against one deadline; each row goes into `rows_path` the moment it is measured and
    each section's status row before it starts ("running") and when it ends, so a crash loses nothing written.

    Hard budget: an in-process section is interrupted by SIGALRM at its deadline (SectionCut); a subprocess started
    through `run_sub` is killed with its process group; a section stuck in C code that ignores the alarm is ended by
    a watchdog `grace_s` later, which records the cut and exits the process (status 124)."""

    def __init__(
        self,
        budget_s: float,
        device: str = "unknown",
        rows_path: Path | None = PATH,
        doc_path: Path | None = None,
        grace_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.t0 = clock()
        self.deadline = self.t0 + budget_s
        self.budget_s = budget_s
        self.device = device
        self.rows_path = rows_path
        self.doc_path = doc_path
        self.grace_s = grace_s
        self.rows: list[dict] = []
        self.results: dict[str, dict] = {}
        self.children: set[int] = set()  # process groups of live subprocesses (killed on cut or watchdog exit)
        self.spawned: list[int] = []  # every subprocess started, in order
        self._section_deadline = self.deadline
        self._current: str | None = None
        self._lock = threading.Lock()

    # -- rows and records
    def left(self) -> float:
        """Seconds to the current section's deadline (never beyond the run's)."""
        return self._section_deadline - self.clock()

    def row(self, name: str, value, target=None, unit: str = "") -> dict:
        r = result_row(name, value, target, unit, self.device)
        with self._lock, _no_alarm():
            self.rows.append(r)
            if self.rows_path is not None:
                merge([r], self.rows_path, quiet=True)
        print(f"  {name} = {value} {unit}" + (f" (target {target})" if target is not None else ""), flush=True)
        return r

    def _record(self, name: str, res: dict) -> None:
        self.results[name] = res
        unit = STATUS_UNIT + (f"; {res['seconds']} s" if "seconds" in res else "")
        if res.get("reason"):
            unit += f"; {res['reason']}"
        self.row(f"section_{name}", res["status"], "ok", unit)
        self.write_doc()

    def write_doc(self) -> None:
        if self.doc_path is None:
            return
        doc = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": commit(),
            "device": self.device,
            "budget_s": self.budget_s,
            "elapsed_s": round(self.clock() - self.t0, 1),
            "sections": self.results,
            "rows": self.rows,
        }
        with self._lock, _no_alarm():
            write_json_atomic(self.doc_path, doc)

    # -- subprocesses
    def run_sub(self, cmd: list[str], *, cwd=None, env=None, tail: int = 4000) -> dict:
        """Run `cmd` in its own process group, echoing its output; killed (group) at the section's deadline, which
        then raises SectionCut. Returns {"rc", "seconds", "tail"}."""
        t0 = self.clock()
        lines: list[str] = []
        proc: subprocess.Popen | None = None
        reader: threading.Thread | None = None
        try:
            # The alarm may land anywhere in here (a held one lands right after _no_alarm): once the child exists,
            # every cut goes through the except below and kills it.
            with _no_alarm():
                proc = subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
                self.children.add(proc.pid)
                self.spawned.append(proc.pid)

            def pump(p: subprocess.Popen = proc) -> None:
                assert p.stdout is not None
                for line in p.stdout:
                    lines.append(line)
                    print("    | " + line.rstrip(), flush=True)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            proc.wait(timeout=max(self.left(), 0.01))
        except (subprocess.TimeoutExpired, SectionCut) as e:
            if proc is None:
                raise
            try:
                with _no_alarm():
                    if threading.current_thread() is threading.main_thread():
                        signal.setitimer(signal.ITIMER_REAL, 0)  # the section ends here: no second cut later
                    self._kill(proc.pid)
                    proc.wait()
            except SectionCut:
                pass  # the section's alarm, pending while held, lands here: the child is already dead
            raise SectionCut(f"{Path(cmd[1] if len(cmd) > 1 else cmd[0]).name}: killed at the deadline") from e
        finally:
            if proc is not None:
                self.children.discard(proc.pid)
            if reader is not None:
                reader.join(timeout=5)
        return {"rc": proc.returncode, "seconds": round(self.clock() - t0, 1), "tail": "".join(lines)[-tail:]}

    @staticmethod
    def _kill(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    # -- the loop
    def _alarm(self, signum, frame) -> None:
        raise SectionCut(f"past the deadline ({self.budget_s:g} s run budget or the section's cap)")

    def _watchdog(self, stop: threading.Event) -> None:
        while not stop.wait(0.2):
            if self._current is not None and self.clock() > self._section_deadline + self.grace_s:
                name = self._current
                for pg in list(self.children):
                    self._kill(pg)
                self._record(
                    name,
                    {
                        "status": "cut",
                        "seconds": round(self.clock() - self._started, 1),
                        "reason": f"did not return {self.grace_s:g} s after its deadline: process ended",
                    },
                )
                print(f"== {name}: cut, hung past its deadline; exiting", flush=True)
                os._exit(124)

    def run(self, sections: list[Section], only: set[str] | None = None) -> dict[str, dict]:
        stop = threading.Event()
        dog = threading.Thread(target=self._watchdog, args=(stop,), daemon=True)
        dog.start()
        main_thread = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGALRM, self._alarm) if main_thread else None
        try:
            for s in sections:
                if only and s.name not in only:
                    continue
                self._run_one(s, main_thread)
        finally:
            stop.set()
            if main_thread:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
        return self.results

    def _run_one(self, s: Section, alarm: bool) -> None:
        now = self.clock()
        left = self.deadline - now
        if left < s.min_s:
            self._record(s.name, {"status": "skipped", "reason": f"{max(left, 0):.0f} s left < {s.min_s:g} s needed"})
            print(f"== {s.name}: skipped ({max(left, 0):.0f} s left)", flush=True)
            return
        self._section_deadline = min(self.deadline, now + s.cap_s)
        self._started = now
        self._record(s.name, {"status": "running"})
        print(f"== {s.name} (up to {self._section_deadline - now:.0f} s)", flush=True)
        self._current = s.name
        try:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, max(self._section_deadline - now, 0.001))
            res = s.fn(self) or {}
        except SectionCut as e:
            res = {"status": "cut", "reason": str(e)}
        except Exception as e:
            traceback.print_exc()
            res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            self._current = None
        res.setdefault("status", "ok")
        res["seconds"] = round(self.clock() - now, 1)
        self._section_deadline = self.deadline
        self._record(s.name, res)
        print(f"== {s.name}: {res['status']} ({res['seconds']} s)", flush=True)

    def failed(self) -> list[str]:
        return [k for k, v in self.results.items() if v["status"] in ("fail", "error", "cut", "running")]
