"""Launch W gloo ranks once and run a list of named FSDP2 checks in each (tests/dist/dist_harness.py's launcher).

Checks live in fsdp2_checks.py (training), fsdp2_checks_hooks.py (hooks, options, bad input), fsdp2_checks_groups.py
(shared param groups, defaults) and fsdp2_checks_ef.py (error feedback); each is called as
check(rank, world, info) and records its measured numbers in `info`. One JSON line per check per rank; after a
failure the remaining checks are skipped (collectives may be out of step). Hooks are disabled between checks.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
PG_TIMEOUT_S = 45


EXTRA = "FSDP2_EXTRA_CHECKS"  # env: "<folder>:<module>" of more checks (tests/integrations/titan uses it)


def _find(name: str):
    import importlib

    import fsdp2_checks
    import fsdp2_checks_ef
    import fsdp2_checks_groups
    import fsdp2_checks_hooks
    import fsdp2_checks_levels

    mods = [fsdp2_checks, fsdp2_checks_hooks, fsdp2_checks_groups, fsdp2_checks_ef, fsdp2_checks_levels]
    if os.environ.get(EXTRA):
        folder, _, module = os.environ[EXTRA].rpartition(":")
        sys.path.insert(0, folder)
        mods.append(importlib.import_module(module))
    for mod in mods:
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"no check named {name}")


def worker(rank: int, world: int, port: int, outdir: str, env: dict, names: list[str]) -> None:
    os.environ.update(env)
    os.environ["FSDP2_TEST_DIR"] = outdir
    warnings.filterwarnings("ignore")  # FSDP2's and c10d's deprecation warnings drown the report
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parents[1] / "dist"))
    import dist_harness

    out = dist_harness.join(rank, world, port, outdir, 60.0, PG_TIMEOUT_S)
    import torch
    import torch.distributed as dist

    status_group = dist.new_group(backend="gloo")
    for name in names:
        info: dict = {}
        out.write(json.dumps({"check": name, "state": "started"}) + "\n")
        t0 = time.perf_counter()
        try:
            _find(name)(rank, world, info)
            rec = {"ok": True}
        except BaseException as e:
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
        rec.update(check=name, state="done", seconds=round(time.perf_counter() - t0, 2), info=info)
        out.write(json.dumps(rec, default=str) + "\n")
        flags = torch.zeros(world, dtype=torch.int64)
        flags[rank] = 0 if rec["ok"] else 1
        dist.all_reduce(flags, group=status_group)
        if int(flags.sum()):
            out.write(json.dumps({"check": "*", "state": "stopped", "after": name}) + "\n")
            break
    dist.barrier(group=status_group)
    dist.destroy_process_group()
    out.close()


def launch(world: int, names: list[str], outdir: Path, env: dict | None = None, timeout: float = 180.0) -> dict:
    sys.path.insert(0, str(HERE.parents[1] / "dist"))
    import dist_harness

    return dist_harness.launch(world, outdir, env=env, names=names, timeout=timeout, target=worker)


def failures(run: dict, names: list[str]) -> list[str]:
    """Failed checks (by rank), checks that never ran or never finished, bad exit codes, a timeout."""
    sys.path.insert(0, str(HERE.parents[1] / "dist"))
    import dist_harness

    return dist_harness.failures(run, names)


def record(run: dict, name: str, rank: int = 0) -> dict | None:
    for x in run["results"].get(rank, []):
        if x.get("check") == name and x.get("state") == "done":
            return x
    return None
