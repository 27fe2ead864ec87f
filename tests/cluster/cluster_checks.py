"""One rank (under torchrun, across simulated nodes) of the collectives checks in tests/dist/dist_checks*.py.

The same checks and the same per-check JSON-lines protocol as tests/dist/dist_harness.py, but the process group
comes from fp8comm.distributed.init_distributed() (torchrun's environment) instead of a parent-owned store, so
the ranks really sit on different nodes and the cross-node bytes cross a rate-limited veth link.
Usage (by tests/cluster/test_cluster.py): cluster_checks.py OUTDIR [CHECK ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "dist"), str(HERE.parent.parent)]


def main() -> int:
    import torch
    import torch.distributed as dist

    from fp8comm.distributed import init_distributed, link_bytes

    torch.set_num_threads(1)
    outdir, names = Path(sys.argv[1]), sys.argv[2:] or None
    info = init_distributed(timeout_s=60)
    import dist_checks
    import dist_harness

    rank, world = info.rank, info.world_size
    out = open(outdir / f"rank{rank}.jsonl", "w", buffering=1)
    tx0, rx0 = link_bytes() or (0, 0)
    dist_harness.run_checks(dist_checks, rank, world, out, names)
    tx1, rx1 = link_bytes() or (0, 0)
    out.write(
        json.dumps(
            {
                "check": "*",
                "state": "link",
                "local_world": info.local_world_size,
                "tx_bytes": tx1 - tx0,
                "rx_bytes": rx1 - rx0,
            }
        )
        + "\n"
    )
    dist.destroy_process_group()
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
