"""Two levels by default (issue 28 item 3) on 4 ranks laid out as 2 simulated nodes x 2 (what torchrun sets on
two nodes: LOCAL_WORLD_SIZE=2, GROUP_RANK=rank // 2; torchrun --standalone here says one node of 4, so each check
sets them before the engine is built). The "levels" scenario of ds_worker.py."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

import ds_train as T
import torch.distributed as dist

import fp8comm.comm as fc
import fp8comm.integrations.deepspeed as fd
from fp8comm.comm import topology

STEPS = 3


def _nodes() -> None:
    r = dist.get_rank()
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(r // 2), LOCAL_RANK=str(r % 2))
    topology.forget()  # the table gathered under torchrun's one-node view is not this layout


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def captured(name: str = "fp8comm.deepspeed"):
    """The lines logger `name` logs (INFO and up) while the block runs."""
    log = logging.getLogger(name)
    h, level = _Lines(), log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        yield h.lines
    finally:
        log.removeHandler(h)
        log.setLevel(level)


def _build(cfg):
    with captured() as lines:
        eng, _ = T.build(cfg)
    return eng, lines


def _intra() -> dict:
    return {k: v["calls"] for k, v in fc.comm_stats().items() if k.endswith(".intra")}


def _same_everywhere(x) -> None:
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, x)
    assert all(s == seen[0] for s in seen), f"ranks decided differently: {seen}"


def _run(info, stage: int, fp8: dict, **zero):
    _nodes()
    fc.reset_comm_stats()
    eng, lines = _build(T.ds_config(stage, "bf16", fp8, **zero))
    run = T.train(eng, range(STEPS))
    es = fd.engine_state(eng)
    decisions = {str(list(r)): s.describe() for r, s in es.splits.items()}
    info.update(losses=run.losses, intra=_intra(), decisions=decisions, summary=es.summary)
    _same_everywhere(decisions)
    group_lines = [ln for ln in lines if ln.startswith("fp8comm: group")]
    if dist.get_rank() == 0:  # one line per group, rank 0 only
        assert len(group_lines) == len(es.splits), lines
    else:
        assert not group_lines, group_lines
    T.destroy(eng)
    fd.uninstall()
    return es, decisions


def levels_zero2_default(info):
    es, d = _run(info, 2, {})
    assert d == {
        "[0, 1, 2, 3]": "group of 4 ranks [0, 1, 2, 3]: two-level (2 nodes x 2 ranks; 2 node(s) from "
        "torchrun's GROUP_RANK)"
    }, d
    assert "hierarchical on" in es.summary and "all-to-all" in es.summary, es.summary
    i = info["intra"]
    assert i.get("reduce_scatter.intra", 0) >= STEPS and i.get("all_gather.intra", 0) >= STEPS, i


def levels_zero3_hpz_default(info):
    """ZeRO-3 with hpZ 2: the DP group (4 ranks, 2 per node) runs two-level, each secondary group ([0, 1], [2, 3]:
    one node each) flat with its reason."""
    es, d = _run(info, 3, {}, zero_hpz_partition_size=2)
    assert "two-level (2 nodes x 2 ranks" in d["[0, 1, 2, 3]"], d
    assert "flat (all members on one node" in d["[0, 1]"] and "flat (all members on one node" in d["[2, 3]"], d
    i = info["intra"]
    assert i.get("reduce_scatter.intra", 0) >= STEPS and i.get("all_gather.intra", 0) > 0, i


def levels_off_is_flat(info):
    es, d = _run(info, 2, {"hierarchical": False})
    assert all("flat (two levels turned off)" in v for v in d.values()), d
    assert "hierarchical off (flat)" in es.summary, es.summary
    assert not info["intra"], info["intra"]


def levels_zero2_4bit_default(info):
    """4-bit gradients keep their node groups (the comm layer's 4-bit two-level mode; refused there until it lands)."""
    es, d = _run(info, 2, {"gradients": {"fmt": "mxfp4"}})
    assert "two-level" in d["[0, 1, 2, 3]"], d
    assert info["intra"].get("reduce_scatter.intra", 0) >= STEPS, info["intra"]


def _resume(info, save_hier: bool, load_hier: bool):
    _nodes()
    ef = {"gradients": {"error_feedback": True, "allow_unpartitioned_residuals": True}}
    ck = Path(os.environ["FP8COMM_TEST_OUT"]) / f"ckpt_levels_{save_hier}_{load_hier}"
    eng, _ = T.build(T.ds_config(2, "bf16", {**ef, "hierarchical": save_hier}))
    T.train(eng, range(0, 3))
    norm = fd.engine_state(eng).residuals.norm()
    eng.save_checkpoint(str(ck), tag="step3")
    T.destroy(eng)
    fd.uninstall()
    eng2, _ = T.build(T.ds_config(2, "bf16", {**ef, "hierarchical": load_hier}), seed=123)
    eng2.load_checkpoint(str(ck), tag="step3")
    es = fd.engine_state(eng2)
    after_load = es.residuals.norm()
    resumed = T.train(eng2, range(3, 6))
    info.update(
        residual_norm_at_save=norm,
        residual_norm_after_load=after_load,
        resumed=resumed.losses,
        hooks=resumed.stats["hooks"],
    )
    assert norm > 0
    if save_hier == load_hier:
        assert after_load == norm and "checkpoint.residuals_reset_levels" not in resumed.stats["hooks"]
    else:
        assert after_load == 0.0 and resumed.stats["hooks"].get("checkpoint.residuals_reset_levels") == 1
    assert all(x == x for x in resumed.losses), resumed.losses  # finite training after the switch
    T.destroy(eng2)
    fd.uninstall()


def levels_resume_flat_to_two_level(info):
    _resume(info, False, True)


def levels_resume_two_level_to_flat(info):
    _resume(info, True, False)


def levels_resume_two_level_to_two_level(info):
    _resume(info, True, True)


def levels_zero2_4bit_exact(info):
    """4-bit gradients on both ZeRO-2 paths, two levels: small buckets (coalesced, still unbalanced: the all-to-all
    to the owners) and DeepSpeed's default bucket (the padded reduce-scatter). What lands in each owner's fp32
    partition is, bit for bit, the sum over nodes (node order) of each node's fp32 partial sum quantized in MXFP4
    per parameter piece and decoded in fp32: the configured format on every path, never FP8 in its place."""
    from ds_checks_grad import _fp32_accumulation_once
    from ds_common import SMALL_BUCKET

    _nodes()
    paths: dict = {}
    for bucket in (SMALL_BUCKET, None):
        one = _fp32_accumulation_once(2, bucket, "mxfp4", local=2)
        for k, v in one.pop("paths").items():
            paths[k] = paths.get(k, 0) + v
        for k, v in one.items():
            info[k] = info.get(k, 0) + v
    info["paths"] = paths
    a2a, rs = paths.get("zero12.grad_reduce.all_to_all", 0), paths.get("zero12.grad_reduce.reduce_scatter", 0)
    assert a2a and rs, f"both reduction paths must be checked: {paths}"
    assert paths.get("zero12.grad_reduce.fmt.mxfp4") == a2a + rs and "zero12.grad_reduce.fmt.e4m3" not in paths, paths
    assert paths.get("zero12.grad_reduce.two_level") == a2a + rs, paths


def levels_zero2_4bit_updates_two_level(info):
    """ZeRO-2's 4-bit weight-update gather takes the DP group's node groups (issue 29 item 2: as Megatron's): its
    node-local phase runs in the wait at the group's first forward use, and the replicas, parameters and losses are
    bit-identical to the flat gather's (every rank decodes the same bytes either way). Gradients stay DeepSpeed's
    own here, so the two runs differ in the update gather alone."""
    import torch

    fp8 = {"gemm": False, "gradients": {"enabled": False}, "weights": {"update_fmt": "mxfp4"}}
    runs = {}
    for hier in (False, True):
        _nodes()
        fc.reset_comm_stats()
        eng, _ = _build(T.ds_config(2, "bf16", {**fp8, "hierarchical": hier}))
        run = T.train(eng, range(STEPS))
        # state_dict waits the update gathers still in flight (the last step's): the replicas as they end
        params = torch.cat([v.detach().float().reshape(-1) for v in eng.module.state_dict().values()])
        es = fd.engine_state(eng)
        runs[hier] = (run.losses, params, _intra(), es.summary, dict(run.stats["hooks"]))
        T.destroy(eng)
        fd.uninstall()
    (l_flat, p_flat, i_flat, _, _), (l_two, p_two, i_two, summary, hooks) = runs[False], runs[True]
    info.update(losses_flat=l_flat, losses_two_level=l_two, intra=i_two, hooks=hooks)
    assert hooks.get("zero12.param_update.change", 0) >= STEPS - 1, hooks
    assert not i_flat, i_flat
    # every change gather after the first (full) one ran its node-local phase
    assert i_two.get("all_gather.intra", 0) >= hooks["zero12.param_update.change"], i_two
    assert l_flat == l_two, (l_flat, l_two)
    assert torch.equal(p_flat, p_two), (p_flat - p_two).abs().max().item()
    _same_everywhere(p_two.sum().item())
    assert "4-bit weight updates" not in summary or "stay flat" not in summary, summary


def levels_error_feedback(info):
    """Error feedback under two levels on both ZeRO-2 paths (the padded reduce-scatter at DeepSpeed's default
    bucket, the coalesced all-to-all to the owners at a small bucket; ZeRO-3 takes the reduce-scatter's window,
    levels.rail_window, and GradSqnr cannot read its partitioned weights): each rank keeps the
    residual of what it quantizes across the nodes only (its rail: half the send layout at 2 ranks per node), and
    over the first SQNR_STEPS steps the running sum of the reduced gradients tracks the exact sum at least 6 dB
    closer than without error feedback (mxfp4, whose error error feedback must carry)."""
    from ds_common import SMALL_BUCKET, SQNR_STEPS, GradSqnr

    for tag, stage, zero in (
        ("zero2_rs", 2, {}),
        ("zero2_a2a", 2, {"reduce_bucket_size": SMALL_BUCKET}),
    ):
        got = {}
        for ef in (False, True):
            _nodes()
            grads = {"fmt": "mxfp4", "error_feedback": ef, "allow_unpartitioned_residuals": ef}
            eng, _ = _build(T.ds_config(stage, "fp32", {"gemm": False, "gradients": grads}, **zero))
            sq = GradSqnr(SQNR_STEPS)
            run = T.train(eng, range(SQNR_STEPS), on_step=lambda step, eng=eng, sq=sq: sq(eng, step))
            hooks = run.stats["hooks"]
            if stage == 2:
                path = "reduce_scatter" if not zero else "all_to_all"
                assert hooks.get(f"zero12.grad_reduce.{path}") and hooks.get("zero12.grad_reduce.two_level"), hooks
            got[ef] = (sq.sum_db[-1], run.stats.get("error_feedback"))
            T.destroy(eng)
            fd.uninstall()
        (plain, _), (fed, stats) = got[False], got[True]
        n = stats["residual_bytes"] // 4
        info[tag] = {"sum_sqnr_db": round(fed, 2), "plain_sum_sqnr_db": round(plain, 2), **stats}
        assert fed >= plain + 6, f"{tag}: error feedback {fed:.1f} dB vs {plain:.1f} dB without"
        # the rail only: about half of the whole gradient's 4 bytes per parameter at 2 ranks per node
        params = sum(p.numel() for p in T.tiny_gpt().parameters())
        assert n <= 0.6 * params, (tag, n, params)


CHECKS = [
    levels_zero2_default,
    levels_zero3_hpz_default,
    levels_off_is_flat,
    levels_resume_flat_to_two_level,
    levels_resume_two_level_to_flat,
    levels_resume_two_level_to_two_level,
    levels_zero2_4bit_default,
    levels_zero2_4bit_exact,
    levels_zero2_4bit_updates_two_level,
    levels_error_feedback,
]
