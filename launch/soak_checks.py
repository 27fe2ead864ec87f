#!/usr/bin/env python3
"""Run named Megatron checks (tests/integrations/megatron) on 2 ranks again and again, to catch a crash that shows
once in tens of launches: each launch's failures, and where its ranks' logs are.

  .venv/bin/python launch/soak_checks.py --runs 60 gpt_dp2,gpt_dp2_error_feedback
  .venv/bin/python launch/soak_checks.py --runs 60 --malloc-check gpt_dp2,gpt_dp2_error_feedback
  .venv/bin/python launch/soak_checks.py --runs 30 --megatron-alone

--megatron-alone runs no check: each launch builds and trains Megatron-Core's own overlapped DDP (distributed
optimizer, overlap_grad_reduce and overlap_param_gather, gloo) --builds times for --steps steps, in ranks that
never import fp8comm (asserted), to tell a crash of torch's gloo or Megatron from one of fp8comm; --gloo-threads N
gives every gloo group N worker threads instead of torch's 2 (tests/dist/dist_harness.py gloo_worker_threads).

--malloc-check runs the ranks under glibc's checking allocator (libc_malloc_debug, glibc.malloc.check=3), which
aborts at the first corrupt free instead of somewhere later. Exit 1 when any launch failed, 0 otherwise.
--core-dumps lets a crashing rank write a core file (ulimit -c unlimited; the kernel's core_pattern says where).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak_checks.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "checks", nargs="?", default="", help="comma-separated check names (mcore_checks*.py), run in this order"
    )
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=400.0, help="per launch (a hang guard)")
    p.add_argument("--malloc-check", action="store_true", help="glibc's checking allocator in the ranks")
    p.add_argument("--core-dumps", action="store_true", help="a crashing rank writes a core file")
    p.add_argument("--megatron-alone", action="store_true", help="Megatron's own DDP, no fp8comm (see above)")
    p.add_argument("--builds", type=int, default=60, help="with --megatron-alone: models per launch")
    p.add_argument("--steps", type=int, default=10, help="with --megatron-alone: training steps per model")
    p.add_argument("--gloo-threads", type=int, default=0, help="with --megatron-alone: per gloo group (0: 2)")
    args = p.parse_args(argv)
    names = [n for n in args.checks.split(",") if n]
    counts = (args.runs, args.builds, args.steps, args.gloo_threads + 1)
    if min(counts) < 1 or bool(names) == args.megatron_alone:
        print("soak_checks.py: give check names or --megatron-alone (not both); --runs, --builds, --steps >= 1, "
              "--gloo-threads >= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.malloc_check and not Path(MALLOC_DEBUG).exists():
        print(f"soak_checks.py: --malloc-check needs {MALLOC_DEBUG}", file=sys.stderr)
        return 2
    saved, core = dict(os.environ), resource.getrlimit(resource.RLIMIT_CORE)
    if args.core_dumps:
        resource.setrlimit(resource.RLIMIT_CORE, (core[1], core[1]))
    # The loader reads LD_PRELOAD when a process starts: it must be in this process's environment before the ranks
    # are spawned (an env the ranks apply to themselves after starting, as the launch's env= does, loads nothing).
    os.environ.update(rank_env(args.malloc_check))
    try:
        return _soak(names, args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        resource.setrlimit(resource.RLIMIT_CORE, core)


def rank_env(malloc_check: bool) -> dict:
    """The environment the ranks must start with."""
    return {"LD_PRELOAD": MALLOC_DEBUG, "GLIBC_TUNABLES": "glibc.malloc.check=3"} if malloc_check else {}


def _soak(names: list[str], args) -> int:
    sys.path.insert(0, str(ROOT / "tests" / "integrations" / "megatron"))
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    import mcore_harness as H

    failed = 0
    for i in range(args.runs):
        out = Path(tempfile.mkdtemp(prefix="soak_"))
        t0 = time.monotonic()
        if args.megatron_alone:
            import dist_harness

            alone = {"builds": args.builds, "steps": args.steps, "gloo_threads": args.gloo_threads}
            run = dist_harness.launch(2, out, env=alone, names=[ALONE], target=megatron_alone, timeout=args.timeout)
            fails = dist_harness.failures(run, [ALONE])
        else:
            run = H.launch(2, names, out, timeout=args.timeout)
            fails = H.failures(run, names)
        failed += bool(fails)
        print(f"{time.strftime('%H:%M:%S')} run {i + 1}/{args.runs} {time.monotonic() - t0:.0f} s "
              f"{'FAILED' if fails else 'ok'} (logs: {out})", flush=True)  # fmt: skip
        for f in fails:
            print("    " + f.splitlines()[0][:300], flush=True)
    print(f"# {failed} of {args.runs} launches failed")
    return 1 if failed else 0


ALONE = "megatron_alone"


def megatron_alone(rank: int, world: int, port: int, outdir: str, env: dict, names: list[str]) -> None:
    """A rank of --megatron-alone (dist_harness's target): Megatron-Core and torch only; results as JSON lines."""
    import json

    for sub in ("tests/integrations/megatron", "tests/dist"):
        sys.path.insert(0, str(ROOT / sub))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), NO_VCS_VERSION="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import dist_harness

    out = dist_harness.join(rank, world, port, outdir, 120.0, 60.0, gloo_threads=env["gloo_threads"])
    import mcore_cpu
    import mcore_train as T

    mcore_cpu.install()
    T.init_parallel(tp=1)
    out.write(json.dumps({"check": ALONE, "state": "started"}) + "\n")
    t0 = time.perf_counter()
    for _ in range(env["builds"]):
        model, opt, config = T.build(T.ddp_kwargs(overlap_grad_reduce=True, overlap_param_gather=True))
        T.train(model, opt, config, env["steps"])
    rec = {"ok": "fp8comm" not in sys.modules, "error": "fp8comm was imported" if "fp8comm" in sys.modules else ""}
    rec.update(check=ALONE, state="done", seconds=round(time.perf_counter() - t0, 2), info={"builds": env["builds"]})
    out.write(json.dumps(rec) + "\n")
    out.close()
    os._exit(0)  # Megatron's groups still hold gloo threads; an interpreter teardown among them is its own lottery


if __name__ == "__main__":
    raise SystemExit(main())
