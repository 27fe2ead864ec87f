"""One rank (under torchrun, across simulated nodes) of the collectives checks in tests/dist/dist_checks*.py.

The same checks and the same per-check JSON-lines protocol as tests/dist/dist_harness.py, but the process group
comes from fp8comm.distributed.init_distributed() (torchrun's environment) instead of a parent-owned store, so
the ranks really sit on different nodes and the cross-node bytes cross a rate-limited veth link.
Usage (by tests/cluster/test_cluster.py): cluster_checks.py OUTDIR [CHECK ...]
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "dist"), str(HERE.parent.parent)]


def main() -> int:
    import torch
    import torch.distributed as dist

    from fp8comm.bench.scaling import link_bytes
    from fp8comm.distributed import init_distributed

    torch.set_num_threads(1)
    outdir, names = Path(sys.argv[1]), sys.argv[2:] or None
    info = init_distributed(timeout_s=60)
    import dist_checks

    rank, world = info.rank, info.world_size
    out = open(outdir / f"rank{rank}.jsonl", "w", buffering=1)
    tx0, rx0 = link_bytes()
    status_group = dist.new_group(backend="gloo")
    for fn in [c for c in dist_checks.CHECKS if names is None or c.__name__ in names]:
        ctx = dist_checks.Ctx(rank, world)
        out.write(json.dumps({"check": fn.__name__, "state": "started"}) + "\n")
        t0 = time.perf_counter()
        try:
            fn(ctx)
            rec = {"ok": True}
        except BaseException as e:  # noqa: BLE001 - reported by name
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        rec.update(check=fn.__name__, state="done", seconds=round(time.perf_counter() - t0, 3), info=ctx.info)
        out.write(json.dumps(rec, default=str) + "\n")
        flags = torch.zeros(world, dtype=torch.int64)
        flags[rank] = 0 if rec["ok"] else 1
        dist.all_reduce(flags, group=status_group)
        if int(flags.sum()):
            out.write(json.dumps({"check": "*", "state": "stopped", "after": fn.__name__}) + "\n")
            break
    dist.barrier(group=status_group)
    tx1, rx1 = link_bytes()
    out.write(json.dumps({"check": "*", "state": "link", "local_world": info.local_world_size,
                          "tx_bytes": tx1 - tx0, "rx_bytes": rx1 - rx0}) + "\n")
    dist.destroy_process_group()
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
