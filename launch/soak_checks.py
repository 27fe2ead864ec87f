#!/usr/bin/env python3
"""Run named Megatron checks (tests/integrations/megatron) on 2 ranks again and again, to catch a crash that shows
once in tens of launches: each launch's failures, and where its ranks' logs are.

  .venv/bin/python launch/soak_checks.py --runs 60 gpt_dp2,gpt_dp2_error_feedback
  .venv/bin/python launch/soak_checks.py --runs 60 --malloc-check gpt_dp2,gpt_dp2_error_feedback

--malloc-check runs the ranks under glibc's checking allocator (libc_malloc_debug, glibc.malloc.check=3), which
aborts at the first corrupt free instead of somewhere later. Exit 1 when any launch failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak_checks.py", description=__doc__.splitlines()[0])
    p.add_argument("checks", help="comma-separated check names (mcore_checks*.py), run in this order per launch")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=400.0, help="per launch (a hang guard)")
    p.add_argument("--malloc-check", action="store_true", help="glibc's checking allocator in the ranks")
    args = p.parse_args(argv)
    names = [n for n in args.checks.split(",") if n]
    if not names or args.runs < 1:
        print("soak_checks.py: give check names and --runs >= 1", file=sys.stderr)
        return 2
    env = {}
    if args.malloc_check:
        if not Path(MALLOC_DEBUG).exists():
            print(f"soak_checks.py: --malloc-check needs {MALLOC_DEBUG}", file=sys.stderr)
            return 2
        env = {"LD_PRELOAD": MALLOC_DEBUG, "GLIBC_TUNABLES": "glibc.malloc.check=3"}
    sys.path.insert(0, str(ROOT / "tests" / "integrations" / "megatron"))
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    import mcore_harness as H

    failed = 0
    for i in range(args.runs):
        out = Path(tempfile.mkdtemp(prefix="soak_"))
        t0 = time.monotonic()
        run = H.launch(2, names, out, env=env, timeout=args.timeout)
        fails = H.failures(run, names)
        failed += bool(fails)
        print(f"{time.strftime('%H:%M:%S')} run {i + 1}/{args.runs} {time.monotonic() - t0:.0f} s "
              f"{'FAILED' if fails else 'ok'} (logs: {out})", flush=True)  # fmt: skip
        for f in fails:
            print("    " + f.splitlines()[0][:300], flush=True)
    print(f"# {failed} of {args.runs} launches failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
