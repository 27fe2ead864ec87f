"""Overlapped 4-bit weight updates (scenario "safety"): ZeRO-2's update gather starts in the optimizer step and is
waited at the first forward use of the group's parameters (updates.OVERLAP_UPDATES), with the same bits as the
synchronous gather.

- zero2_bf16_fp4_updates_overlap: overlapped vs synchronous, 8 steps: losses and parameters bit-identical (and the
  same on every rank); every step's gather is still in flight when the step returns and when the forward starts,
  and is waited by the forward pre-hook of the first module owning the group's parameters (hooks
  "waited_in_forward"); a checkpoint saved right after a step (a gather in flight: waited before DeepSpeed reads the
  weights) resumes bit for bit in a fresh engine; engine.module.state_dict() waits what is in flight.
- zero2_bf16_fp4_updates_guard: the numerics guard on the update bucket ("update0"): forced to FP8 for two steps and
  to a full bf16 gather for one, overlapped and synchronous give the same bits.

Imported by ds_worker.py after cpu.prepare().
"""

from __future__ import annotations

import os
from pathlib import Path

import ds_train as T
import torch
import torch.distributed as dist

import fp8comm.integrations.deepspeed as fd
from fp8comm.integrations.deepspeed import updates

STEPS_UPD = 8
SAVE_AT = 4
FP4 = {"gemm": False, "gradients": {"fmt": "mxfp4"}, "weights": {"update_fmt": "mxfp4"}}


def _state_digest(engine) -> str:
    """Digest of engine.module.state_dict() (its pre-hook waits any gather in flight)."""
    sd = engine.module.state_dict()
    return T._digest(sd[k] for k in sorted(sd))


class _Probe:
    """Per step: was the update gather in flight right after engine.step(), and still when the forward started (a
    forward pre-hook on the root module, which owns no parameter itself: it runs before the adapter's hooks)?"""

    def __init__(self, engine) -> None:
        self.es = fd.engine_state(engine)
        self.after_step: list[bool] = []
        self.at_forward: list[bool] = []
        self.after_forward: list[bool] = []
        root = engine.module
        assert not list(root.parameters(recurse=False)), "the probe needs a root module without parameters"
        self.handles = [
            root.register_forward_pre_hook(lambda *_: self.at_forward.append(self._in_flight())),
            root.register_forward_hook(lambda *_: self.after_forward.append(self._in_flight())),
        ]

    def _in_flight(self) -> bool:
        pend = getattr(self.es, "z12_pending", None) or []
        return any(h is not None and not h.is_completed() for h in pend)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _train(engine, steps: range, probe: _Probe | None = None) -> list[float]:
    rank, losses = dist.get_rank(), []
    for step in steps:
        x, y = T.batch(step, rank)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if probe is not None:
            probe.after_step.append(probe._in_flight())
        losses.append(loss.item())
    return losses


def _run(overlap: bool, fp8: dict, on_step=None) -> tuple[list[float], str, dict]:
    old = updates.OVERLAP_UPDATES
    updates.OVERLAP_UPDATES = overlap
    try:
        eng, _ = T.build(T.ds_config(2, "bf16", fp8))
        losses = []
        for step in range(STEPS_UPD):
            if on_step is not None:
                on_step(eng, step)
            losses += _train(eng, range(step, step + 1))
        digest = _state_digest(eng)
        hooks = fd.hook_stats(eng)["hooks"]
        T.destroy(eng)
        fd.uninstall()
    finally:
        updates.OVERLAP_UPDATES = old
    return losses, digest, hooks


def zero2_bf16_fp4_updates_overlap(info):
    assert updates.OVERLAP_UPDATES, "overlapped weight updates are off by default"
    ck = Path(os.environ["FP8COMM_TEST_OUT"]) / "ckpt_updates_overlap"
    cfg = T.ds_config(2, "bf16", FP4)
    eng, _ = T.build(cfg)
    es = fd.engine_state(eng)
    probe = _Probe(eng)
    losses = _train(eng, range(SAVE_AT), probe)
    assert probe._in_flight(), "no update gather in flight right after the step"
    api_waited = fd.finish_updates(eng)  # what a user calls before reading the parameters between step and forward
    still = probe._in_flight()
    eng.save_checkpoint(str(ck), tag="upd")
    losses += _train(eng, range(SAVE_AT, STEPS_UPD), probe)
    probe.remove()
    hooks = dict(fd.hook_stats(eng)["hooks"])
    digest = _state_digest(eng)
    after_sd = fd.hook_stats(eng)["hooks"]
    T.destroy(eng)
    fd.uninstall()
    info.update(
        hooks=hooks,
        in_flight_after_step=probe.after_step,
        in_flight_at_forward=probe.at_forward,
        in_flight_after_forward=probe.after_forward,
    )
    groups = len(es.updates)
    # every step's gather left the step in flight, was still in flight when the next forward began (except after
    # the save, which waited it) and was done when the forward ended: waited inside the forward (the pre-hook of
    # the first module owning its parameters)
    assert all(probe.after_step), probe.after_step
    want = [step not in (0, SAVE_AT) for step in range(STEPS_UPD)]
    assert probe.at_forward == want, probe.at_forward
    assert not any(probe.after_forward), probe.after_forward
    assert hooks.get("zero12.param_update.started_in_step") == STEPS_UPD * groups, hooks
    assert hooks.get("zero12.param_update.waited_in_forward") == (STEPS_UPD - 2) * groups, hooks
    assert api_waited == groups and not still, (api_waited, still)  # finish_updates() waited them all
    assert hooks.get("zero12.param_update.waited_at_api") == groups, hooks
    assert "zero12.param_update.waited_at_save" not in hooks, hooks  # finish_updates() left nothing for the save
    assert "zero12.param_update.waited_at_step" not in hooks, hooks  # every forward took its gather
    assert after_sd.get("zero12.param_update.waited_at_state_dict") == groups, after_sd
    assert (
        hooks.get("zero12.param_update.full") == groups
        and hooks.get("zero12.param_update.change") == (STEPS_UPD - 1) * groups
    ), hooks

    # the same run, each gather finished inside its step: the same bits
    sync_losses, sync_digest, sync_hooks = _run(False, FP4)
    info.update(losses=losses, sync_losses=sync_losses)
    assert "zero12.param_update.started_in_step" not in sync_hooks, sync_hooks
    assert sync_losses == losses, ("overlapped and synchronous updates differ", losses, sync_losses)
    assert sync_digest == digest, "parameters after overlapped and synchronous updates differ"
    digests = T.rank_digests(digest)
    assert len(set(digests)) == 1, f"parameters differ across ranks: {digests}"

    # resume from the checkpoint saved while a gather was in flight: the same steps, the same bits
    eng2, _ = T.build(cfg, seed=123)
    eng2.load_checkpoint(str(ck), tag="upd")
    resumed = _train(eng2, range(SAVE_AT, STEPS_UPD))
    rhooks = fd.hook_stats(eng2)["hooks"]
    resumed_digest = _state_digest(eng2)
    T.destroy(eng2)
    fd.uninstall()
    info.update(resumed=resumed)
    assert rhooks.get("checkpoint.replica_restored") == 1, rhooks
    assert resumed == losses[SAVE_AT:], ("resumed training differs from uninterrupted training", resumed)
    assert resumed_digest == digest, "resumed parameters differ from the uninterrupted run's"


def zero2_bf16_fp4_updates_guard(info):
    """The guard's answer for "update0" applies to the overlapped gather: FP8 at steps 2-3, the values in bf16 at
    step 5 (a full gather), 4 bits otherwise; overlapped and synchronous identical."""
    fp8 = {**FP4, "guard": {"enabled": True, "patience": 1000}}

    def force(eng, step):
        st = fd.engine_state(eng).guard.states
        if step == 2:
            st["update0"].fp8_left = 2
        if step == 5:
            st["update0"].bf16_left = 1

    losses, digest, hooks = _run(True, fp8, force)
    sync_losses, sync_digest, sync_hooks = _run(False, fp8, force)
    info.update(hooks=hooks, losses=losses, sync_losses=sync_losses)
    for h in (hooks, sync_hooks):
        assert h.get("guard.update0.fp8") == 2 and h.get("guard.update0.bf16") == 1, h
        assert h.get("zero12.param_update.full") == 2 and h.get("zero12.param_update.change") == STEPS_UPD - 2, h
    assert hooks.get("zero12.param_update.started_in_step") == STEPS_UPD, hooks
    assert sync_losses == losses, ("overlapped and synchronous updates differ under the guard", losses, sync_losses)
    assert sync_digest == digest, "parameters after overlapped and synchronous updates differ under the guard"
    digests = T.rank_digests(digest)
    assert len(set(digests)) == 1, f"parameters differ across ranks: {digests}"
    assert all(torch.isfinite(torch.tensor(losses))), losses


CHECKS = [zero2_bf16_fp4_updates_overlap, zero2_bf16_fp4_updates_guard]
