"""Launch W gloo ranks once, run a list of named checks (mcore_checks) in each, bring per-check results back.

Megatron-Core takes ~10 s of CPU to import per process, so each scenario group is ONE launch that runs several
checks. Each rank appends a JSON line per check as it goes (a hang or crash still names the check); the parent
owns the TCPStore (port 0: no port races) and kills the launch at a hard timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

PG_TIMEOUT_S = 60  # gloo gives up on a stuck collective after this long
# Modules whose functions are the named checks (a name is looked up in this order).
CHECK_MODULES = (
    "mcore_checks",
    "mcore_checks_ef",
    "mcore_checks_moe",
    "mcore_checks_pp",
    "mcore_checks_guard",
    "mcore_checks_example",
    "mcore_checks_fp4",
    "mcore_checks_levels",
)


def worker(rank: int, world: int, port: int, outdir: str, env: dict, names: list[str]) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % int(env.get("LOCAL_WORLD_SIZE", world))),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron.core's __version__ would otherwise run git
    warnings.filterwarnings("ignore")  # Megatron's deprecation warnings drown the report
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
    import dist_harness

    out = dist_harness.join(rank, world, port, outdir, 120.0, PG_TIMEOUT_S)
    import mcore_cpu
    import torch
    import torch.distributed as dist

    mcore_cpu.install()
    import importlib

    modules = [importlib.import_module(m) for m in CHECK_MODULES]
    status_group = dist.new_group(backend="gloo")
    for name in names:
        info: dict = {}
        out.write(json.dumps({"check": name, "state": "started"}) + "\n")
        t0 = time.perf_counter()
        try:
            next(getattr(m, name) for m in modules if hasattr(m, name))(rank, world, info)
            rec = {"ok": True}
        except BaseException as e:
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
        finally:
            import fp8comm.integrations.megatron as fm

            fm.uninstall()  # a failed check must not leave hooks on for the next one
        rec.update(check=name, state="done", seconds=round(time.perf_counter() - t0, 2), info=info)
        out.write(json.dumps(rec, default=str) + "\n")
        flags = torch.zeros(world, dtype=torch.int64)
        flags[rank] = 0 if rec["ok"] else 1
        dist.all_reduce(flags, group=status_group)
        if int(flags.sum()):
            out.write(json.dumps({"check": "*", "state": "stopped", "after": name}) + "\n")
            break  # collectives may be out of step now; later checks would only report noise
    dist.barrier(group=status_group)
    del status_group
    sys.modules["mcore_checks"]._BASELINES.clear()  # its cached baseline runs keep their models, and so their groups
    import fp8comm.integrations.megatron as fm

    fm.shutdown()  # Megatron's and fp8comm's references to the groups go first: else their gloo threads outlive
    dist.destroy_process_group()  # them, and interpreter teardown meets running threads (an abort, at random)
    out.close()


def launch(world: int, names: list[str], outdir: Path, env: dict | None = None, timeout: float = 240.0) -> dict:
    """Run the named checks on `world` ranks through the shared launcher in tests/dist/dist_harness.py."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
    import dist_harness

    return dist_harness.launch(
        world, outdir, env=env, names=names, timeout=timeout, target=worker, store_timeout_s=120.0
    )


def failures(run: dict, names: list[str]) -> list[str]:
    """Failed checks (by rank), checks that never ran or never finished, bad exit codes, a timeout."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
    import dist_harness

    return dist_harness.failures(run, names)


def info(run: dict, name: str, rank: int = 0) -> dict:
    for x in run["results"].get(rank, []):
        if x.get("check") == name and x.get("state") == "done":
            return x.get("info", {})
    return {}
