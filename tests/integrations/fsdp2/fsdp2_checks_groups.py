"""FSDP2 checks on how enable() sees the model (run on every rank by fsdp2_harness): one param group shared by
several modules (`fully_shard([norm, lm_head])`, as torchtitan does), and what enable() turns on by default.

Each check is check(rank, world, info); `info` carries the measured numbers to the pytest report.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8comm.comm as fc
import fp8comm.integrations.fsdp2 as f2


class Head(nn.Module):
    """A body, then a final norm and an output head: torchtitan shards the last two in ONE fully_shard call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 32)

    def forward(self, x):
        return self.lm_head(self.norm(self.body(x)))


def _mesh():
    import torch.distributed as dist

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _step(model, seed: int) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def shared_param_group(rank, world, info):
    """torch's own fully_shard([norm, lm_head]): one FSDP2 param group, two modules. enable() lists it once as
    "norm+lm_head"; after disable() FSDP2's own comm objects are back on it and a step makes no fp8comm call;
    enable() works again and hooks each group once."""
    torch.manual_seed(0)
    model = Head()
    fully_shard([model.norm, model.lm_head], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    pg = model.norm._get_fsdp_state()._fsdp_param_groups[0]
    originals = (pg._all_gather_comm, pg._reduce_scatter_comm)
    rep = f2.enable(model)
    f2.disable(model)
    f2.reset_hook_stats()
    before = fc.comm_stats()
    _step(model, 0)
    after = fc.comm_stats()
    info.update(
        report_names=[m.name for m in rep.modules],
        header=str(rep).splitlines()[0],
        hook_stats_after_disable=f2.hook_stats(),
        comms_after_disable=[type(c).__name__ for c in (pg._all_gather_comm, pg._reduce_scatter_comm)],
    )
    assert f2.hook_stats() == {} and after == before, (
        f"fp8comm ran after disable(): hook_stats {f2.hook_stats()}, comm_stats {before} -> {after}"
    )
    assert pg._all_gather_comm is originals[0] and pg._reduce_scatter_comm is originals[1], info
    assert info["report_names"] == ["<root>", "norm+lm_head"], info["report_names"]
    assert "2 of 2 FSDP2 modules" in info["header"], info["header"]
    f2.enable(model)  # the group carries no hook of ours, so enabling again is allowed
    f2.reset_hook_stats()
    _step(model, 1)
    s = f2.hook_stats()
    info.update(calls_reenabled={d: x["fp8_calls"] for d, x in s.items()})
    f2.disable(model)
    # one reduce-scatter per group; gathers: the root once (FSDP2 keeps the root unsharded after forward),
    # norm+lm_head in forward and again in backward (reshard_after_forward=True)
    assert info["calls_reenabled"] == {"gradients": 2, "weights": 3}, info["calls_reenabled"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def defaults_are_communication_only(rank, world, info):
    """enable() with defaults changes communication only: every Linear stays an nn.Linear (FP8 GEMMs are
    fp8comm.convert_to_fp8, a separate opt-in), error feedback is off; its report, also logged on
    "fp8comm.integrations.fsdp2", says both directions' formats and that FP8 GEMMs are off."""
    import fp8comm
    from fp8comm.gemm import Fp8Linear

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    log = logging.getLogger("fp8comm.integrations.fsdp2")
    rec, level = _Records(), log.level
    log.addHandler(rec)
    log.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
        fully_shard(model, mesh=_mesh(), mp_policy=mp)
        rep = f2.enable(model)
        kinds = sorted({type(m).__name__ for m in model if isinstance(m, nn.Linear)})
        header = str(rep).splitlines()[0]
        f2.disable(model)
        opted = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
        fp8comm.convert_to_fp8(opted, "blockwise", skip_output_head=False)
        fully_shard(opted, mesh=_mesh(), mp_policy=mp)
        rep2 = f2.enable(opted)
        f2.disable(opted)
    finally:
        log.removeHandler(rec)
        log.setLevel(level)
    d = f2.defaults()
    info.update(linear_types=kinds, header=header, logged=rec.lines[:1], header_opted_in=str(rep2).splitlines()[0])
    assert kinds == ["Linear"] and not any(isinstance(m, Fp8Linear) for m in model.modules()), kinds
    assert "FP8 GEMMs off" in header and "weights e4m3 1x128 fp32 scales" in header, header
    assert "gradients e4m3 1x128 fp32 scales, fp32 accumulation;" in header, header  # no error feedback
    # one report per enable(), plus one line per shard group saying flat or two levels (and why)
    reports = [line for line in rec.lines if not line.startswith("fp8comm FSDP2: group of ")]
    assert len(reports) == 2 and reports[0] == str(rep), rec.lines
    assert sum("flat (all members on one node" in line for line in rec.lines) == (2 if rank == 0 else 0), rec.lines
    assert d["gradients"]["error_feedback"] is False and d["gradients"]["allow_unpartitioned_residuals"] is False
    assert "FP8 GEMMs in 2 Fp8Linear layers converted by the caller" in info["header_opted_in"], info
