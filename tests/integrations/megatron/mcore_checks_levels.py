"""Two levels by default (issue 28 item 3), 4 ranks as 2 simulated nodes x 2: each check sets what torchrun sets
on two nodes (LOCAL_WORLD_SIZE=2, GROUP_RANK=rank // 2) before install(), which gathers the node facts once per
world (fp8comm.comm.topology). Run by test_megatron_levels.py."""

from __future__ import annotations

import os
import warnings

import mcore_train as T
import torch
import torch.distributed as dist
from mcore_checks import _fm, check_bytes, check_parity, run

from fp8comm.comm import topology

ITERS = 4


def _nodes(rank: int) -> None:
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    topology.forget()


def _decisions(on_install_seen: dict):
    from fp8comm.integrations.megatron.installation import installed

    def on_install(model):
        on_install_seen.update({str(list(r)): s.describe() for r, s in installed().node_groups.items()})

    return on_install


def gpt_dp4_levels_default_and_off(rank, world, info):
    """DP=4 over 2 nodes x 2: the default install() runs the gradient reduce-scatter and the parameter all-gather
    in two levels (".intra" records), the same decision on every rank; hierarchical=False runs them flat."""
    _nodes(rank)
    T.init_parallel(tp=1)
    kw = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    base = run(kw, None, iters=ITERS)
    seen: dict = {}
    on = run(kw, dict(grad_reduce=True, param_gather=True), iters=ITERS, on_install=_decisions(seen))
    off = run(kw, dict(grad_reduce=True, param_gather=True, hierarchical=False), iters=ITERS)
    check_parity(base, on, info, "dp4_two_level")
    check_parity(base, off, info, "dp4_flat")
    everyone: list = [None] * world
    dist.all_gather_object(everyone, seen)
    info.update(decisions=seen, loss_two_level=on["loss"], loss_flat=off["loss"], loss_bf16=base["loss"])
    assert all(e == everyone[0] for e in everyone), f"ranks decided differently: {everyone}"
    assert seen == {
        "[0, 1, 2, 3]": "group of 4 ranks [0, 1, 2, 3]: two-level (2 nodes x 2 ranks; 2 node(s) from torchrun's "
        "GROUP_RANK)"
    }, seen
    ci, cf = on["comm"], off["comm"]
    assert ci.get("reduce_scatter.intra", {}).get("calls", 0) > 0, ci
    assert ci.get("all_gather.intra", {}).get("calls", 0) > 0, ci
    assert not [k for k in cf if k.endswith(".intra")], cf
    check_bytes(off, "reduce_scatter", 4, "dp4_flat")
    _resume_across_the_switch(info)


def gpt_dp4_levels_4bit_updates(rank, world, info):
    """DP=4 over 2 nodes x 2, overlap on: the 4-bit weight-update gather runs in two levels by default (each
    rank's change crosses the node link once, ".intra" records) and gives the flat gather's bits (every rank decodes
    the same bytes): loss, grad norms and parameters equal with hierarchical=False, replicas equal across ranks.
    Gradients stay Megatron's own here, so only the update gather differs between the runs."""
    from mcore_checks import check_replicas_identical

    _nodes(rank)
    T.init_parallel(tp=1)
    kw = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    on = run(kw, dict(param_update_fmt="mxfp4"), iters=ITERS)
    off = run(kw, dict(param_update_fmt="mxfp4", hierarchical=False), iters=ITERS)
    pu = on["hooks"]["param_update"]
    info["dp4_4bit_updates"] = {
        "loss_two_level": on["loss"],
        "loss_flat": off["loss"],
        "intra_calls": on["comm"].get("all_gather.intra", {}).get("calls", 0),
        "param_update": pu,
    }
    assert on["comm"].get("all_gather.intra", {}).get("calls", 0) > 0, on["comm"]
    assert not [k for k in off["comm"] if k.endswith(".intra")], off["comm"]
    assert pu.get("update_calls", 0) > 0 and pu.get("taken_after_step", 0) > 0, pu
    assert on["loss"] == off["loss"] and on["grad_norm"] == off["grad_norm"], (on["loss"], off["loss"])
    assert torch.equal(on["params"], off["params"]), "two-level weight updates differ from flat ones"
    check_replicas_identical(on["params"], "dp4_4bit_updates")


def _resume_across_the_switch(info) -> None:
    """Error-feedback residuals saved under two levels hold the quantization error of the node's sum on this rank's
    rail (and have that size): loaded into the same layout they come back bit for bit, silently; loaded into a
    flat installation (--no-fp8comm-hierarchical), or flat ones into a two-level one, they restart from zero with
    a RuntimeWarning naming the switch, counted in hook_stats."""
    fm = _fm()
    ef = dict(grad_reduce=True, error_feedback=True)
    kw = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    saved = {}
    for hier in (True, False):
        model, opt, config = T.build(T.ddp_kwargs(**kw))
        fm.install(ddp_config=model.ddp_config, transformer_config=config, hierarchical=hier, **ef)
        try:
            T.train(model, opt, config, 2)
            saved[hier] = fm.error_feedback_state_dict(model)
        finally:
            fm.uninstall()
    assert saved[True]["levels"] == [[[0, 1, 2, 3], 2]] and saved[False]["levels"] == [], saved[True]["levels"]
    assert saved[True]["residuals"] and saved[False]["residuals"], "no residuals were kept"
    sizes = {h: sum(v["residual"].numel() for v in saved[h]["residuals"].values()) for h in saved}
    results = {}
    for into in (True, False):
        for came_from in (True, False):
            model, opt, config = T.build(T.ddp_kwargs(**kw))
            fm.install(ddp_config=model.ddp_config, transformer_config=config, hierarchical=into, **ef)
            fm.hook_stats(reset=True)
            try:
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    fm.load_error_feedback_state_dict(model, saved[came_from])
                now = fm.error_feedback_state_dict(model)
                resets = fm.hook_stats().get("error_feedback", {}).get("levels_resets", 0)
            finally:
                fm.uninstall()
            lines = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
            key = f"{'two-level' if came_from else 'flat'} -> {'two-level' if into else 'flat'}"
            results[key] = {"resets": resets, "warnings": lines, "buckets_after_load": len(now["residuals"])}
            if into == came_from:
                assert resets == 0 and not lines, (key, results[key])
                assert set(now["residuals"]) == set(saved[came_from]["residuals"]), key
                for name, st in saved[came_from]["residuals"].items():
                    assert torch.equal(now["residuals"][name]["residual"], st["residual"]), (key, name)
            else:
                assert resets == 1 and not now["residuals"], (key, results[key])
                assert len(lines) == 1 and "residuals restart from zero" in lines[0], (key, lines)
                assert ("two-level" in lines[0]) and ("flat" in lines[0]), lines[0]
    info["resume_across_switch"] = {"residual_elements": sizes, **results}
