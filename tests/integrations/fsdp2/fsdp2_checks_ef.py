"""Error feedback on FSDP2's FP8 gradient reduce-scatter (run on every rank by fsdp2_harness): the memory gate
and the residual bytes the report states, and what it buys: the SQNR of the gradient SUMMED over the steps.

The probe (RsProbe) wraps the installed FP8 reduce-scatter through FSDP2's own set_custom_reduce_scatter: per call
it all-gathers every rank's input and sums it in fp64 (FSDP2's op applied), the exact reduction of the very same
input, and keeps it with the FP8 output. As in the DeepSpeed and Megatron checks, error feedback must bring the
summed gradient at least EF_SUM_GAIN_DB closer to the exact sum than the run without it.
"""

from __future__ import annotations

import math

import fsdp2_checks as C
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import fp8comm.integrations.fsdp2 as f2

# Bounds from measurement (2 ranks, the test GPT; the check's info has the numbers, docs/fsdp2.md the table).
# Per step, E4M3 1x128 fp32 scales: 32-34 dB without error feedback; 25.6-30 dB with it (a step's output also
# carries the previous step's residual, by design, so it is further from that step's exact reduction).
STEP_SQNR_MIN_DB = {"no_ef": 28.0, "ef_fp32": 20.0, "ef_bf16": 20.0, "ef_fp8": 20.0}
EF_SUM_GAIN_DB = 10.0  # summed gradient, error feedback minus none: 16.4-16.5 dB measured over 12 steps
EF_STEPS = 12
EF_ON = {"error_feedback": True, "allow_unpartitioned_residuals": True}


def _groups(model) -> list:
    """(module, param group) once per FSDP2 state that has parameters."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            st = m._get_fsdp_state()
            if id(st) not in seen and st._fsdp_param_groups:
                seen.add(id(st))
                out.append((m, st._fsdp_param_groups[0]))
    return out


def _expected_residual_bytes(model, world: int, itemsize: int, block: int = 128) -> int:
    """From the parameter shapes alone: FSDP2 pads dim 0 to a multiple of world; each rank's chunk of every
    parameter starts a new block on the wire; the residual holds world such rows."""
    total = 0
    for p in model.parameters():  # DTensors: .shape is the global (unsharded) shape
        rows = -(-p.shape[0] // world) * world
        chunk = rows * math.prod(p.shape[1:]) // world
        total += -(-chunk // block) * block
    return itemsize * world * total


def error_feedback_memory_gate(rank, world, info):
    """error_feedback=True alone is refused before anything is installed, naming allow_unpartitioned_residuals and
    the model's residual bytes; opted in, the report states the bytes (fp32 4 B, bf16 2 B per padded element of
    every group's whole gradient, fp8 1 B plus a 4-byte scale per group; the old spellings "fp32"/"bf16" too) and
    the residuals kept after a step are exactly that; a hook built by hand with error feedback and no opt-in is
    refused too."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 200))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (world,)), mp_policy=mp)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), mp_policy=mp)
    expected = _expected_residual_bytes(model, world, 4)
    try:
        f2.enable(model, gradients={"error_feedback": True})
        refused = ""
    except f2.Fp8CommFsdp2Error as e:
        refused = str(e)
    info.update(refused=refused, expected_fp32_bytes=expected)
    assert refused, "error_feedback without allow_unpartitioned_residuals was accepted"
    assert "allow_unpartitioned_residuals" in refused and f"{expected:,} bytes" in refused, refused
    assert not f2.is_enabled(model) and not any(f2.hooks.is_ours(pg._reduce_scatter_comm) for _, pg in _groups(model))
    groups = len(_groups(model))
    for dtype, want in (
        ("float32", expected),
        ("bf16", expected // 2),
        ("fp8", expected // 4 + 4 * groups),
    ):
        rep = f2.enable(model, gradients={**EF_ON, "residual_dtype": dtype})
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))
        model(x).float().square().mean().backward()
        efs = [pg._reduce_scatter_comm.error_feedback for _, pg in _groups(model)]
        allocated = sum(ef.nbytes() for ef in efs)
        info[dtype] = {"report_bytes": rep.residual_bytes, "allocated_bytes": allocated}
        assert rep.residual_bytes == allocated == want, (dtype, info[dtype], want)
        # between steps a compact residual keeps only its codes and scales (no fp32 working copy)
        assert all(ef.residual is None for ef in efs) == (dtype == "fp8"), (dtype, [ef.kind for ef in efs])
        assert f"error-feedback residuals: {allocated} bytes" in str(rep), str(rep)
        f2.disable(model)
        model.zero_grad(set_to_none=True)
    pg = _groups(model)[0][1]
    try:
        f2.Fp8ReduceScatter(pg, f2.GradientWire(error_feedback=True), None, True)
        raise AssertionError("a hand-built hook with error feedback and no opt-in was accepted")
    except f2.Fp8CommFsdp2Error as e:
        assert "allow_unpartitioned_residuals" in str(e), str(e)


class RsProbe(ReduceScatter):
    """Wraps one group's installed reduce-scatter: records (FP8 output, exact fp64 reduction of the same input)."""

    def __init__(self, inner, sink: list) -> None:
        self.inner, self.sink = inner, sink

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(input_tensor) for _ in range(world)]
        dist.all_gather(parts, input_tensor.contiguous(), group=group)  # before the hook (it may scale in place)
        kind, factor = f2.layout.reduce_op(op)
        total = torch.stack([p.double() for p in parts]).sum(0) * (1.0 if factor is None else factor)
        if kind == "avg":
            total /= world
        n = output_tensor.numel()
        work = self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op)
        if work is not None:
            work.wait()  # idempotent: FSDP2's own wait() later is a no-op
        self.sink.append((id(self), output_tensor.double().clone(), total[rank * n : (rank + 1) * n].clone()))
        return work


class SqnrProbe:
    """Per-step SQNR of the reduced gradients and the SQNR of their running sums, all groups, all ranks."""

    def __init__(self) -> None:
        self.pending: list = []
        self.cum: dict = {}
        self.step_db: list[float] = []

    def attach(self, model) -> None:
        for m, pg in _groups(model):
            m.set_custom_reduce_scatter(RsProbe(pg._reduce_scatter_comm, self.pending))

    @staticmethod
    def _db(pairs) -> float:
        t = torch.zeros(2, dtype=torch.float64)
        for got, exact in pairs:
            t[0] += exact.pow(2).sum()
            t[1] += (got - exact).pow(2).sum()
        dist.all_reduce(t)
        return 10 * math.log10(float(t[0] / t[1])) if t[1] > 0 else math.inf

    def per_step(self, step, model, loss) -> None:
        self.step_db.append(self._db([(g, e) for _, g, e in self.pending]))
        for key, got, exact in self.pending:
            acc = self.cum.setdefault(key, [torch.zeros_like(got), torch.zeros_like(exact)])
            acc[0] += got
            acc[1] += exact
        self.pending.clear()

    def summary(self) -> dict:
        return {
            "step_sqnr_db_min": round(min(self.step_db), 2),
            "step_sqnr_db_mean": round(sum(self.step_db) / len(self.step_db), 2),
            "summed_grad_sqnr_db": round(self._db([tuple(v) for v in self.cum.values()]), 2),
        }


def error_feedback_sqnr_gain(rank, world, info):
    """The test GPT, EF_STEPS AdamW steps, FP8 gradients without error feedback, with fp32, bf16 and fp8 (compact)
    residuals: per-step SQNR >= STEP_SQNR_MIN_DB[run]; the summed gradient's SQNR gains >= EF_SUM_GAIN_DB
    with error feedback (each step re-sends the previous step's quantization error, so the sum's error stays one
    step's residual instead of growing with the steps)."""
    data, vocab = C.corpus()
    args = C.gpt_args("--steps", str(EF_STEPS))
    res = {}
    for tag, grads in (
        ("no_ef", {}),
        ("ef_fp32", EF_ON),
        ("ef_bf16", {**EF_ON, "residual_dtype": "bfloat16"}),
        ("ef_fp8", {**EF_ON, "residual_dtype": "fp8"}),
    ):
        probe = SqnrProbe()
        out = C.ex.train(
            args,
            data,
            vocab,
            C.ex.make_mesh(args),
            True,
            on_step=probe.per_step,
            on_model=probe.attach,
            enable_options={"weights": False, "gradients": grads or True},
        )
        res[tag] = {**probe.summary(), "loss_last": round(out["losses"][-1], 4)}
    gain = {t: round(res[t]["summed_grad_sqnr_db"] - res["no_ef"]["summed_grad_sqnr_db"], 2) for t in res}
    info.update(runs=res, summed_grad_sqnr_gain_db=gain, steps=EF_STEPS)
    for tag, r in res.items():
        assert r["step_sqnr_db_min"] >= STEP_SQNR_MIN_DB[tag], f"{tag}: per-step gradient SQNR {r}"
    assert all(gain[t] >= EF_SUM_GAIN_DB for t in ("ef_fp32", "ef_bf16", "ef_fp8")), gain
