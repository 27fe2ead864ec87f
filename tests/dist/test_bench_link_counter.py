"""`fp8comm bench comm`'s link counter (bytes node 0 sent during one call) counts that call only: a rank that is
through the closing barrier first must not start the next call's bytes before every rank has read the counter."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import dist_harness
import pytest

pytestmark = pytest.mark.dist


def _target(rank: int, world: int, port: int, outdir: str, env: dict, names) -> None:
    import torch.distributed as dist

    from fp8comm.tools.bench import comm as bench

    out = dist_harness.join(rank, world, port, outdir, 60.0, dist_harness.PG_TIMEOUT_S)
    sent = Path(outdir) / "next-call-started"
    rec: dict = {"check": "link-counter", "state": "done", "ok": True}
    try:

        def counter(ifname: str) -> int:  # the link's tx bytes: 1000 once the next call has started
            if rank == 0:
                time.sleep(0.3)  # rank 0 reads late (a loaded host)
            return 1000 if sent.exists() else 0

        bench._tx = counter
        _, got = bench._measured(lambda: None, "eth0")  # this call sends nothing
        if rank == world - 1:
            sent.touch()  # the next call's first bytes, as soon as this rank is through
        rec["bytes"] = got
    except BaseException as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
    out.write(json.dumps(rec) + "\n")
    out.close()
    dist.destroy_process_group()


def test_link_counter_counts_one_call(tmp_path):
    run = dist_harness.launch(2, tmp_path, target=_target, timeout=90)
    assert not run["timed_out"] and run["exitcodes"] == [0, 0], run
    recs = {rank: r[-1] for rank, r in run["results"].items()}
    assert all(r["ok"] for r in recs.values()), recs
    assert recs[0]["bytes"] == 0, f"rank 0 counted the next call's bytes: {recs}"
