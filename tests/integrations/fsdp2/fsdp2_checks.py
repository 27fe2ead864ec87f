"""FSDP2 training checks (run on every rank by fsdp2_harness): the small GPT of examples/fsdp2_train.py, plain
FSDP2 vs FSDP2 + enable() from the same weights and batches; replicas, losses, bytes, HSDP, accumulation, DCP.

Each check is check(rank, world, info); `info` carries the measured numbers to the pytest report.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import fsdp2_train as ex

import fp8comm.integrations.fsdp2 as f2

LOSS_TOL = 0.02  # the bound: loss within 2% of plain FSDP2
_CORPUS = None


def corpus():
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = ex.load_corpus()
    return _CORPUS


def gpt_args(*extra: str):
    """The test GPT: 2 blocks of width 128 (wide enough that block padding costs ~1%), 4 x 32 tokens per rank."""
    return ex.parse_args(
        [
            "--n-layer",
            "2",
            "--n-embd",
            "128",
            "--n-head",
            "4",
            "--batch-size",
            "4",
            "--seq",
            "32",
            "--lr",
            "1e-3",
            *extra,
        ]
    )


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def same_on_all_ranks(value: str, what: str) -> None:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    if len(set(got)) != 1:
        raise AssertionError(f"{what} differ across ranks: {got}")


def full_params(model) -> list[torch.Tensor]:
    return [p.full_tensor() for p in model.parameters()]


class GatheredWeights:
    """Digests of the unsharded parameters every leaf module computes with (the FP8-decoded gather)."""

    def __init__(self, model) -> None:
        self.seen: list[torch.Tensor] = []
        self.handles = [
            m.register_forward_pre_hook(self._pre)
            for m in model.modules()
            if not list(m.children()) and list(m.parameters(recurse=False))
        ]

    def _pre(self, mod, _inp):
        self.seen += [p.detach().clone() for p in mod.parameters(recurse=False)]

    def check_and_clear(self, step: int) -> None:
        same_on_all_ranks(digest(self.seen), f"gathered weights at step {step}")
        self.seen.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _replica_checker(state: dict):
    def on_step(step, model, loss):
        same_on_all_ranks(digest(full_params(model)), f"full_tensor() parameters after step {step}")
        if state.get("gathered") is not None:
            state["gathered"].check_and_clear(step)
        state["steps"] = step + 1

    return on_step


def _train(args, fp8: bool, replicas: bool = True, enable_options=None) -> dict:
    """ex.train; with `replicas`, full_tensor() parameters (and, with fp8, the gathered weights every module
    computed with) are compared across ranks after every step."""
    data, vocab = corpus()
    state: dict = {}

    def watch(model):
        if fp8 and replicas:
            state["gathered"] = GatheredWeights(model)

    try:
        return ex.train(
            args,
            data,
            vocab,
            ex.make_mesh(args),
            fp8,
            on_step=_replica_checker(state) if replicas else None,
            on_model=watch,
            enable_options=enable_options,
        )
    finally:
        if state.get("gathered") is not None:
            state["gathered"].remove()


def _compare(info: dict, plain: dict, fp8: dict) -> float:
    """Loss within 2% of plain FSDP2: the final step and every 5-step running mean (a single step's loss is one
    batch of 128 tokens per rank, so it carries batch noise the two trajectories do not share); the raw per-step
    differences are reported too."""
    a, b = fp8["losses"], plain["losses"]
    rel = [abs(x - y) / y for x, y in zip(a, b)]
    win = [
        abs(sum(a[max(0, i - 4) : i + 1]) - sum(b[max(0, i - 4) : i + 1])) / sum(b[max(0, i - 4) : i + 1])
        for i in range(len(a))
    ]
    info.update(
        loss_first=round(b[0], 4),
        loss_last_plain=round(b[-1], 4),
        loss_last_fp8=round(a[-1], 4),
        final_rel_loss_diff=round(rel[-1], 5),
        max_rel_loss_diff_5step_mean=round(max(win), 5),
        max_rel_loss_diff_single_step=round(max(rel), 5),
        rel_loss_diff_per_step=[round(r, 4) for r in rel],
    )
    assert rel[-1] <= LOSS_TOL and max(win) <= LOSS_TOL, (
        f"loss differs from plain FSDP2 by {rel[-1]:.4f} (final), {max(win):.4f} (5-step mean) > {LOSS_TOL}"
    )
    return max(win)


# ----------------------------------------------------------------------------------------------- checks
_PLAIN: dict = {}


def _plain(steps: int) -> dict:
    """Plain FSDP2's run of `steps` steps, trained once per launch (several checks compare against it)."""
    if steps not in _PLAIN:
        _PLAIN[steps] = _train(gpt_args("--steps", str(steps)), fp8=False, replicas=False)
    return _PLAIN[steps]


def train_gpt_vs_plain(rank, world, info):
    """30 steps, bf16 params / fp32 reduction: loss within 2%, replicas identical every step, byte ratios."""
    args = gpt_args("--steps", "30")
    plain = _plain(30)  # FSDP2's own replicas are not what is under test
    fp8 = _train(args, fp8=True)
    _compare(info, plain, fp8)
    w, g = fp8["stats"]["weights"], fp8["stats"]["gradients"]
    info.update(
        weights_ratio=round(w["ratio"], 4),
        gradients_ratio=round(g["ratio"], 4),
        weights_calls=w["calls"],
        gradients_calls=g["calls"],
        padding_weights=w["padding_elements"],
        elements_weights=w["elements"],
        check_bytes=w["check_bytes"] + g["check_bytes"],
        step_ms_plain=round(1e3 * sorted(plain["step_s"])[len(plain["step_s"]) // 2], 1),
        step_ms_fp8=round(1e3 * sorted(fp8["step_s"])[len(fp8["step_s"]) // 2], 1),
    )
    assert w["passthrough_calls"] == 0 and g["passthrough_calls"] == 0, (w, g)
    assert w["unaligned_calls"] == 0 and g["unaligned_calls"] == 0, (w, g)
    assert w["ratio"] >= 1.85, f"weight all-gather only {w['ratio']:.3f}x fewer bytes than FSDP2's bf16 gather"
    assert g["ratio"] >= 3.7, f"gradient reduce-scatter only {g['ratio']:.3f}x fewer bytes than FSDP2's fp32"
    # 3 FSDP2 modules (root + 2 blocks), reshard_after_forward=True: gathered in forward and again in backward
    assert w["calls"] == 30 * 6 and g["calls"] == 30 * 3, (w["calls"], g["calls"])


def train_gpt_fp4_gradients(rank, world, info):
    """gradients={"fmt": "mxfp4"} (weights stay FP8): 30 steps within 2% of plain FSDP2, replicas identical every
    step, gradient reduce-scatter >= 7x fewer bytes than FSDP2's fp32 one."""
    plain = _plain(30)
    fp4 = _train(gpt_args("--steps", "30"), fp8=True, enable_options={"gradients": {"fmt": "mxfp4"}})
    _compare(info, plain, fp4)
    g = fp4["stats"]["gradients"]
    info.update(gradients_ratio=round(g["ratio"], 4), gradients_calls=g["calls"])
    assert g["passthrough_calls"] == 0 and g["calls"] == 30 * 3, g
    assert g["ratio"] >= 7.0, f"4-bit gradient reduce-scatter only {g['ratio']:.3f}x fewer bytes than fp32"


def train_fp32_params_no_mp(rank, world, info):
    """No MixedPrecisionPolicy: fp32 parameters are gathered in FP8 (vs FSDP2's fp32 gather)."""
    args = gpt_args("--steps", "4", "--mp", "none")
    plain, fp8 = _train(args, fp8=False, replicas=False), _train(args, fp8=True)
    _compare(info, plain, fp8)
    w = fp8["stats"]["weights"]
    info.update(weights_ratio_vs_fp32=round(w["ratio"], 4))
    assert w["ratio"] >= 3.7, w


def reshard_after_forward_false(rank, world, info):
    """reshard_after_forward=False: one gather per module per step, and the same training as True, bit for bit
    (the backward re-gather of True decodes the same bytes)."""
    on = _train(gpt_args("--steps", "3"), fp8=True, replicas=False)
    off = _train(gpt_args("--steps", "3", "--no-reshard"), fp8=True)
    info.update(
        weight_calls_reshard=on["stats"]["weights"]["calls"],
        weight_calls_no_reshard=off["stats"]["weights"]["calls"],
        losses=off["losses"],
    )
    assert off["stats"]["weights"]["calls"] == 3 * 3 and on["stats"]["weights"]["calls"] == 3 * 6
    assert off["losses"] == on["losses"], (off["losses"], on["losses"])


def gradient_accumulation(rank, world, info):
    """set_requires_gradient_sync(False) on all but the last micro-batch: one FP8 reduce-scatter per module per
    step, of the accumulated gradient; loss within 2% of plain FSDP2 with the same accumulation."""
    args = gpt_args("--steps", "3", "--grad-accum", "2")
    plain, fp8 = _train(args, fp8=False, replicas=False), _train(args, fp8=True)
    _compare(info, plain, fp8)
    g = fp8["stats"]["gradients"]
    info.update(gradient_calls=g["calls"])
    assert g["calls"] == 3 * 3, g  # not 2 x that: the first micro-batch of every step reduces nothing


def hsdp_2d_mesh(rank, world, info):
    """HSDP (replicate 2 x shard world/2): the FP8 reduce-scatter runs over the shard group; FSDP2's replicate
    all-reduce stays in fp32 (no hook exists for it). Loss within 2%, replicas identical on all ranks."""
    args = gpt_args("--steps", "4", "--replicate", "2")
    plain = _train(args, fp8=False, replicas=False)
    fp8 = _train(args, fp8=True)
    _compare(info, plain, fp8)
    w, g = fp8["stats"]["weights"], fp8["stats"]["gradients"]
    shard = world // 2
    info.update(weights_ratio=round(w["ratio"], 4), gradients_ratio=round(g["ratio"], 4), shard_group=shard)
    assert f"HSDP shard {shard} x replicate 2" in fp8["report"] and "replicate group" in fp8["report"], fp8["report"]
    assert g["calls"] == 4 * 3 and g["ratio"] >= 3.7 and w["ratio"] >= 1.85, (w, g)


def disable_restores_fsdp2(rank, world, info):
    """enable() then disable(): FSDP2's own comm objects are back, training is bit-identical to never enabling,
    and fp8comm moves no bytes."""
    from torch.distributed.fsdp import FSDPModule

    import fp8comm.comm as fc

    args = gpt_args("--steps", "3")
    plain = _train(args, fp8=False, replicas=False)
    data, vocab = corpus()
    mesh = ex.make_mesh(args)
    model = ex.build(args, vocab, mesh)
    comms = [
        (g, g._all_gather_comm, g._reduce_scatter_comm)
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups
    ]
    f2.enable(model)
    assert all(f2.hooks.is_ours(g._all_gather_comm) for g, _, _ in comms)
    assert f2.disable(model) and not f2.disable(model)
    assert all(g._all_gather_comm is ag and g._reduce_scatter_comm is rs for g, ag, rs in comms)
    before = fc.comm_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        x, y = ex.batch(data, args, step, 0, rank)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    assert fc.comm_stats() == before, "fp8comm moved bytes after disable()"
    assert losses == plain["losses"], (losses, plain["losses"])
    assert digest(full_params(model)) == digest(full_params(plain["model"]))
    info.update(losses=losses)


def state_dict_and_dcp(rank, world, info):
    """enable() leaves state_dict() unchanged (keys, placements, values); a distributed checkpoint saved with
    hooks on loads into a fresh enabled model, which then trains exactly like the original."""
    import torch.distributed.checkpoint as dcp

    args = gpt_args("--steps", "2")
    data, vocab = corpus()
    mesh = ex.make_mesh(args)

    def local(sd):
        return {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in sd.items()}

    def step(model, opt, s):
        x, y = ex.batch(data, args, s, 0, rank)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    model = ex.build(args, vocab, mesh)
    sd0 = model.state_dict()
    f2.enable(model)
    sd1 = model.state_dict()
    assert list(sd0) == list(sd1) and all(sd0[k].placements == sd1[k].placements for k in sd0)
    assert digest(local(sd0).values()) == digest(local(sd1).values())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        step(model, opt, s)
    path = Path(os.environ["FSDP2_TEST_DIR"]) / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path))
    fresh = ex.build(args, vocab, mesh)
    f2.enable(fresh)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=str(path))
    fresh.load_state_dict(sd["model"])
    assert digest(full_params(fresh)) == digest(full_params(model))
    a = step(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    b = step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), 2)
    info.update(loss_original=a, loss_restored=b, keys=len(sd1))
    assert a == b, (a, b)
    f2.disable(model)
    f2.disable(fresh)
