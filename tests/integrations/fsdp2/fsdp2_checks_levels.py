"""Two levels by default (issue 28 item 3), on 4 gloo ranks laid out as 2 simulated nodes x 2 ranks: each check
sets what torchrun would (LOCAL_WORLD_SIZE=2, GROUP_RANK=rank // 2, LOCAL_RANK) before enable(), which gathers the
node facts once per world (fp8comm.comm.topology caches them).

- default: the one shard group (4 ranks, 2 per node) runs two-level: comm_stats() records "<op>.intra" calls, and
  the decision (report lines) is the same on every rank;
- hierarchical=False: flat, no ".intra" record;
- HSDP replicate 2 x shard 2: each shard group sits on one node, so it runs flat, with the log line saying why.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fp8comm.comm as fc
import fp8comm.integrations.fsdp2 as f2


def _nodes(rank: int) -> None:
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))


def _model(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model) -> float:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    loss.backward()
    return float(loss)


def _intra() -> dict:
    return {k: v["calls"] for k, v in fc.comm_stats().items() if k.endswith(".intra")}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _enable(model, **kw):
    log = logging.getLogger("fp8comm.integrations.fsdp2")
    h, level = _Lines(), log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        rep = f2.enable(model, **kw)
    finally:
        log.removeHandler(h)
        log.setLevel(level)
    return rep, [line.removeprefix("fp8comm FSDP2: ") for line in h.lines if line.startswith("fp8comm FSDP2: group")]


def levels_default_two_level(rank, world, info):
    _nodes(rank)
    model = _model(init_device_mesh("cpu", (world,)))
    fc.reset_comm_stats()
    rep, lines = _enable(model)
    try:
        loss = _step(model)
    finally:
        f2.disable(model)
    intra = _intra()
    seen: list = [None] * world
    dist.all_gather_object(seen, rep.levels)
    info.update(levels=rep.levels, intra=intra, loss=loss, log=lines)
    assert all(s == seen[0] for s in seen), f"ranks decided differently: {seen}"
    assert rep.levels == [
        "group of 4 ranks [0, 1, 2, 3]: two-level (2 nodes x 2 ranks; 2 node(s) from torchrun's GROUP_RANK)"
    ], rep.levels
    assert "hierarchical on" in str(rep), str(rep)
    assert intra.get("all_gather.intra", 0) > 0 and intra.get("reduce_scatter.intra", 0) > 0, intra
    assert (lines == rep.levels) if rank == 0 else not lines, lines  # one line per group, rank 0 only


def levels_off_is_flat(rank, world, info):
    _nodes(rank)
    model = _model(init_device_mesh("cpu", (world,)))
    fc.reset_comm_stats()
    rep, _ = _enable(model, hierarchical=False)
    try:
        _step(model)
    finally:
        f2.disable(model)
    info.update(levels=rep.levels, stats=sorted(fc.comm_stats()))
    assert rep.levels == ["group of 4 ranks [0, 1, 2, 3]: flat (two levels turned off)"], rep.levels
    assert "hierarchical off (flat)" in str(rep), str(rep)
    assert not _intra() and fc.comm_stats()["reduce_scatter"]["calls"] > 0, fc.comm_stats()


def levels_unsplittable_group_is_flat(rank, world, info):
    _nodes(rank)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # shard groups [0,1], [2,3]
    model = _model(mesh)
    fc.reset_comm_stats()
    rep, lines = _enable(model)
    try:
        _step(model)
    finally:
        f2.disable(model)
    info.update(levels=rep.levels, log=lines)
    why = "all members on one node; 2 node(s) from torchrun's GROUP_RANK"
    assert rep.levels == [f"group of 2 ranks [0, 1]: flat ({why})", f"group of 2 ranks [2, 3]: flat ({why})"], rep
    assert (lines == rep.levels) if rank == 0 else not lines, lines
    assert not _intra(), _intra()
