"""tests/dist/dist_harness.py's gloo_threads: every gloo group of a rank runs that many worker threads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
import dist_harness


def _runloops() -> int:
    return sum(1 for t in Path("/proc/self/task").iterdir() if (t / "comm").read_text().strip() == "pt_gloo_runloop")


def _rank(rank, world, port, outdir, env, names) -> None:
    import torch
    import torch.distributed as dist

    out = dist_harness.join(rank, world, port, outdir, 60.0, 60.0, gloo_threads=env["threads"])
    group = dist.new_group(backend="gloo")
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    info = {"runloops": _runloops(), "sum": t.tolist()}
    out.write(json.dumps({"check": "threads", "state": "done", "ok": True, "info": info}) + "\n")
    dist.destroy_process_group()
    out.close()


def test_gloo_threads_sets_every_groups_worker_count(tmp_path):
    run = dist_harness.launch(2, tmp_path, env={"threads": 1}, target=_rank, timeout=120)
    assert not dist_harness.failures(run, ["threads"]), dist_harness.failures(run, ["threads"])
    infos = [x["info"] for r in (0, 1) for x in run["results"][r] if x.get("check") == "threads"]
    assert [i["sum"] for i in infos] == [[3.0] * 3] * 2  # the collective still works
    # the default group and one new group, one worker each (torch's own default runs 2 each: 4)
    assert [i["runloops"] for i in infos] == [2, 2], infos
