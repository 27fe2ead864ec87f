"""The bf16 ring baselines of the benchmarks (fp8comm/tools/bench/ring.py) give exactly torch's result.

Integer-valued bf16 inputs (|x| <= 8, so every partial sum of up to 4 ranks is exact in bf16): the ring
reduce-scatter, all-gather and all-reduce must equal torch.distributed's reduce_scatter / all_gather / all_reduce
bit for bit, at 3 and 4 ranks (gloo on 127.0.0.1), called twice on the same Ring (its buffers are reused).
"""

from __future__ import annotations

import json
import traceback

import dist_harness
import pytest

pytestmark = pytest.mark.dist


def _ring_target(rank: int, world: int, port: int, outdir: str, env: dict, names) -> None:
    import torch
    import torch.distributed as dist

    from fp8comm.tools.bench.ring import Ring

    out = dist_harness.join(rank, world, port, outdir, 60.0, dist_harness.PG_TIMEOUT_S)
    rec: dict = {"check": "ring", "state": "done", "ok": True, "errors": []}
    try:
        chunk = 1000 + 3  # not a multiple of anything in particular
        n = world * chunk
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        r_full = Ring(n, torch.bfloat16)
        for trial in range(2):
            g = torch.Generator().manual_seed(100 * trial + rank)
            x = torch.randint(-8, 9, (n,), generator=g).to(torch.bfloat16)
            # reduce-scatter
            want = torch.empty(chunk, dtype=torch.bfloat16)
            rs(want, x.clone())
            got = torch.full((chunk,), float("nan"), dtype=torch.bfloat16)
            r_full.reduce_scatter(got, x)
            if not torch.equal(got, want):
                rec["errors"].append(f"trial {trial}: reduce_scatter differs at {int((got != want).sum())} places")
            # all-gather (of this rank's chunk of x)
            shard = x[:chunk].clone()
            want = torch.empty(n, dtype=torch.bfloat16)
            ag(want, shard)
            got = torch.full((n,), float("nan"), dtype=torch.bfloat16)
            r_full.all_gather(got, shard)
            if not torch.equal(got, want):
                rec["errors"].append(f"trial {trial}: all_gather differs at {int((got != want).sum())} places")
            # all-reduce (ring reduce-scatter then ring all-gather)
            want = x.clone()
            dist.all_reduce(want)
            got = torch.empty(n, dtype=torch.bfloat16)
            r_full.all_reduce(got, x)
            if not torch.equal(got, want):
                rec["errors"].append(f"trial {trial}: all_reduce differs at {int((got != want).sum())} places")
        rec["ok"] = not rec["errors"]
    except BaseException as e:
        rec.update(ok=False, errors=[f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:]])
    out.write(json.dumps(rec) + "\n")
    out.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 4])
def test_ring_matches_torch_exactly(world, tmp_path):
    run = dist_harness.launch(world, tmp_path, target=_ring_target, timeout=90)
    assert not run["timed_out"] and run["exitcodes"] == [0] * world, run
    for rank, recs in run["results"].items():
        assert recs and recs[-1]["ok"], (rank, recs)
