"""Launch W gloo ranks on 127.0.0.1 once, run many named checks in each, and bring per-check results back.

The parent owns the TCPStore (port 0: no port races). Every rank appends one JSON line per check to its own file
as it goes, so a hang or crash still tells which check it was in. Every launch has a hard timeout.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path

# gloo collectives give up after this long; the metadata check must answer far sooner than that.
PG_TIMEOUT_S = 45


def run_checks(dist_checks, rank: int, world: int, out, names: list[str] | None) -> None:
    """Run the named checks (default all) on this rank, one JSON line each; stop everywhere after a failure."""
    import torch
    import torch.distributed as dist

    # A separate group for the per-check status exchange: its sequence never mixes with a failed check's ops.
    status_group = dist.new_group(backend="gloo")
    for fn in [c for c in dist_checks.CHECKS if names is None or c.__name__ in names]:
        ctx = dist_checks.Ctx(rank, world)
        out.write(json.dumps({"check": fn.__name__, "state": "started"}) + "\n")
        t0 = time.perf_counter()
        try:
            fn(ctx)
            rec = {"ok": True}
        except BaseException as e:
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        rec.update(check=fn.__name__, state="done", seconds=round(time.perf_counter() - t0, 3), info=ctx.info)
        out.write(json.dumps(rec, default=str) + "\n")
        flags = torch.zeros(world, dtype=torch.int64)
        flags[rank] = 0 if rec["ok"] else 1
        dist.all_reduce(flags, group=status_group)
        if int(flags.sum()):
            # Collectives may now be out of step across ranks; later checks would only report noise.
            out.write(json.dumps({"check": "*", "state": "stopped", "after": fn.__name__}) + "\n")
            break
    dist.barrier(group=status_group)


def join(
    rank: int, world: int, port: int, outdir: str, store_timeout_s: float, pg_timeout_s: float, gloo_threads: int = 0
):
    """Join the parent's group as `rank` (1 thread: W ranks share 2 cores); returns this rank's result file.

    The backend is gloo, or FP8COMM_TEST_BACKEND=staged (staged_pg.py: gloo on host copies of device tensors, so
    several ranks can share one GPU). gloo_threads > 0: every gloo group of this process runs that many worker
    threads (torch's default: 2 per device) -- see gloo_worker_threads."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if gloo_threads:
        gloo_worker_threads(gloo_threads)
    backend = os.environ.get("FP8COMM_TEST_BACKEND", "gloo")
    if backend == "staged":
        import staged_pg  # noqa: F401 - registers the backend
    out = open(Path(outdir) / f"rank{rank}.jsonl", "w", buffering=1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=store_timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s)
    )
    return out


def gloo_worker_threads(n: int) -> None:
    """Make every gloo group created from now on in this process run `n` worker threads.

    For soak runs (launch/soak_checks.py --gloo-threads): Megatron-Core's overlapped DDP on gloo corrupted the heap
    once in 30 launches with torch's 2 worker threads per group, in ranks that never import fp8comm (docs/launch.md,
    "Soak runs"); with 1, a group's collectives run one at a time. torch builds its gloo groups through
    distributed_c10d.ProcessGroupGloo(store, rank, size, timeout=...): this swaps in a subclass that passes options
    instead, with the devices torch would pick (GLOO_SOCKET_IFNAME's interfaces, else the default one)."""
    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_fp8comm_threads", None) == n:
        return
    base = getattr(base, "_fp8comm_base", base)

    class Gloo(base):  # type: ignore[misc, valid-type]
        _fp8comm_base, _fp8comm_threads = base, n

        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            opts = base._Options()
            ifnames = [x for x in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if x]
            opts._devices = [base.create_device(interface=i) for i in ifnames] or [base.create_default_device()]
            opts._timeout, opts._threads = timeout, n
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = Gloo


def worker(rank: int, world: int, port: int, outdir: str, env: dict, names: list[str] | None) -> None:
    os.environ.update(env)
    sys.path.insert(0, str(Path(__file__).parent))
    out = join(rank, world, port, outdir, 60.0, PG_TIMEOUT_S)
    import dist_checks
    import torch.distributed as dist

    run_checks(dist_checks, rank, world, out, names)
    dist.destroy_process_group()
    out.close()


def _rank_main(target, errpath: str, *args) -> None:
    """A rank's entry: its stderr (fd 2: C++ aborts write there too) goes to `errpath`, which failures() quotes;
    a fatal signal (an abort, a segfault) also writes every thread's Python stack there."""
    import faulthandler

    err = os.open(errpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(err)
    faulthandler.enable(all_threads=True)
    target(*args)


def launch(
    world: int,
    outdir: Path,
    env: dict | None = None,
    names: list[str] | None = None,
    timeout: float = 300.0,
    target=None,
    store_timeout_s: float = 60.0,
) -> dict:
    """Run `target(rank, world, port, outdir, env, names)` (default: this module's checks) on `world` ranks.

    Returns {"exitcodes", "timed_out", "seconds", "results": {rank: [JSON-line records]}}.
    """
    import torch.distributed as dist

    outdir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=store_timeout_s)
    )
    env = dict(env or {})
    ctx = mp.get_context("spawn")
    t0 = time.monotonic()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(target or worker, str(outdir / f"rank{r}.err"), r, world, store.port, str(outdir), env, names),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results, stderr = {}, {}
    for r in range(world):
        f = outdir / f"rank{r}.jsonl"
        results[r] = [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
        e = outdir / f"rank{r}.err"
        stderr[r] = e.read_text(errors="replace") if e.exists() else ""
    del store
    return {
        "exitcodes": [p.exitcode for p in procs],
        "stderr": stderr,
        "timed_out": timed_out,
        "results": results,
        "seconds": round(time.monotonic() - t0, 1),
    }


def failures(run: dict, names: list[str] | None = None) -> list[str]:
    """Human-readable failures: failed checks (by rank), checks that never finished (or, of `names`, never
    started), bad exit codes, a timeout."""
    msgs = []
    for r, recs in run["results"].items():
        started = [x["check"] for x in recs if x.get("state") == "started"]
        done = {x["check"] for x in recs if x.get("state") == "done"}
        for x in recs:
            if x.get("state") == "done" and not x["ok"]:
                msgs.append(f"rank {r}: {x['check']}: {x['error']}\n{x.get('trace', '')}")
        for c in started + [n for n in names or () if n not in started]:
            if c not in done:
                msgs.append(f"rank {r}: {c} never finished ({'timeout' if run['timed_out'] else 'crash'})")
    if run["timed_out"]:
        msgs.append("launch timed out")
    for r, code in enumerate(run["exitcodes"]):
        if code != 0:
            msgs.append(f"rank {r} exited with {exit_reason(code)}{stderr_tail(run, r)}")
    return msgs


def exit_reason(code: int | None) -> str:
    """'1', or for a rank a signal ended: '-6 (SIGABRT)'."""
    if code is None or code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def stderr_tail(run: dict, rank: int, lines: int = 6) -> str:
    """What `rank` last wrote to stderr, on the failure's own line (CI logs keep only that line): after a fatal
    signal, the lines before faulthandler's report (a C++ or allocator message) and the aborting thread's innermost
    Python frame; otherwise the last non-empty lines."""
    text = [x.strip() for x in run.get("stderr", {}).get(rank, "").splitlines() if x.strip()]
    fatal = next((i for i, x in enumerate(text) if x.startswith("Fatal Python error")), None)
    if fatal is not None:
        frames = [x for x in text[fatal:] if x.startswith("File ")]
        text = text[max(0, fatal - lines + 2) : fatal + 1] + frames[:1]
    tail = text[-lines:]
    return "; stderr ends: " + " | ".join(tail) if tail else "; stderr empty"
