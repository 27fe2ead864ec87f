"""4-bit gradients and 4-bit weight updates on real megatron-core (2 gloo ranks, DP=2, distributed optimizer).

What it shows, per format (mxfp4, nvfp4; gradients with error feedback, weight updates replica += change):
- final loss within FP4_FINAL_LOSS_RTOL of Megatron alone (fp32 gradient buckets, bf16 gathers), same seed/data;
- parameters bit-identical across the DP replicas after training;
- replica drift from the fp32 master bounded at every step, element by element: after a gather,
  |master - replica| <= amax(|change sent|) over the element's wire block / 3 (the largest E2M1 rounding step at
  the fitting scale) + a tiny chunk-relative term (NVFP4 block scales near E4M3's smallest) + one bf16 rounding;
- wire bytes: gradient reduce-scatter >= 7x fewer than the fp32 buckets, weight-update gather >= 3.5x fewer
  than the bf16 gather (first gathers, sent in bf16 so replicas start equal, counted apart);
- a restart (uninstall, install, load the replica-update and error-feedback state) continues bit-identically.
"""

from __future__ import annotations

import io
import math

import mcore_checks as C
import mcore_train as T
import torch

FP4_FINAL_LOSS_RTOL = 0.02  # issue 23: a Megatron DP=2 run within 2% of the final loss without fp8comm
GRAD_RS_MIN_RATIO = 7.0  # fp32 gradient buckets vs the 4-bit reduce-scatter
UPDATE_AG_MIN_RATIO = 3.5  # bf16 parameter gather vs the 4-bit change gather
BLOCK = {"mxfp4": 32, "nvfp4": 16}
OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)  # several buckets, gpt_dp2's baseline
SYNC = dict(overlap_grad_reduce=False, overlap_param_gather=False)


def hooks_4bit(fmt: str, **over) -> dict:
    return dict(grad_reduce=True, grad_fmt=fmt, error_feedback=True, param_update_fmt=fmt, **over)


class DriftProbe:
    """After each forward-backward (the previous step's gathers are done): this rank's slice of every bucket, the
    change the last gather sent (staging - replica before it) and the drift left (staging - replica after it)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.before: dict[int, torch.Tensor] = {}
        self.max_rel: list[float] = []  # per step: max |master - replica| / max |master| over this rank's slices
        self.worst_ratio = 0.0  # max over steps and elements of drift / bound (<= 1 required)
        self.steps = 0
        self.staging_bytes = 0

    def __call__(self, _i: int) -> None:
        from megatron.core import parallel_state as ps

        import fp8comm.integrations.megatron as fm

        rank = ps.get_data_parallel_rank()
        num, den = 0.0, 0.0
        for key, (ref, state) in fm.installation().replicas.items():
            param_data = ref()
            if param_data is None or state.shard is None:
                continue
            n = state.shard.numel()
            now = param_data.view(-1)[rank * n : (rank + 1) * n].float()
            prev = self.before.get(key)
            if prev is not None:
                sent = state.shard - prev  # what ReplicaUpdate computed: shard.float() - mine.float()
                drift = (state.shard - now).abs()
                self.worst_ratio = max(self.worst_ratio, float((drift / self._bound(sent, now)).max()))
            num = max(num, float((state.shard - now).abs().max()))
            den = max(den, float(state.shard.abs().max()))
            self.before[key] = now.clone()
        if den > 0:
            self.max_rel.append(num / den)
        self.steps += 1
        self.staging_bytes = fm.replica_update_nbytes()

    def _bound(self, sent: torch.Tensor, replica: torch.Tensor) -> torch.Tensor:
        n, b = sent.numel(), self.block
        pad = (-n) % b
        a = torch.nn.functional.pad(sent.abs(), (0, pad)).view(-1, b).amax(1, keepdim=True)
        blk = a.expand(-1, b).reshape(-1)[:n]
        chunk = float(sent.abs().max()) * 2.0**-16  # NVFP4 block scales below E4M3's normal range
        # one bf16 rounding of the replica (half an ulp <= 2^-8 |x|), fp32 slack; tiny floor so zeros pass
        return blk / 3 + chunk + replica.abs() * (2.0**-8 * 1.01) + 1e-30


def _ratio(stats: dict, op: str) -> float:
    s = stats[op]
    return s["dtype_bytes"] / s["wire_bytes"]


def gpt_dp2_fp4(rank, world, info):
    """mxfp4 and nvfp4 gradients (error feedback on) + weight updates vs Megatron alone; overlap on."""
    T.init_parallel(tp=1)
    base = C.run(OVERLAP, None)
    for fmt in ("mxfp4", "nvfp4"):
        probe = DriftProbe(BLOCK[fmt])
        f4 = C.run(OVERLAP, hooks_4bit(fmt), train_kw={"after_backward": probe})
        lb, l4 = base["loss"], f4["loss"]
        rel_final = abs(l4[-1] - lb[-1]) / lb[-1]
        h = f4["hooks"]
        pu = h["param_update"]
        rs_ratio = _ratio(f4["comm"], "reduce_scatter")
        ag_ratio = pu["dtype_bytes"] / pu["wire_bytes"]
        info[fmt] = {
            "loss_base": [round(x, 4) for x in (lb[0], lb[-1])],
            "loss_4bit": [round(x, 4) for x in (l4[0], l4[-1])],
            "final_loss_rel": round(rel_final, 5),
            "max_loss_rel": round(max(abs(a - b) / b for a, b in zip(l4, lb)), 5),
            "grad_rs_ratio_vs_fp32": round(rs_ratio, 3),
            "update_ag_ratio_vs_bf16": round(ag_ratio, 3),
            "drift_max_rel": round(max(probe.max_rel), 6),
            "drift_over_bound_max": round(probe.worst_ratio, 4),
            "staging_bytes": probe.staging_bytes,
            "hooks": h,
            "buckets": f4["bucket_groups"],
        }
        assert lb[-1] < 0.8 * lb[0], f"{fmt}: the baseline did not learn: {lb}"
        assert rel_final <= FP4_FINAL_LOSS_RTOL, f"{fmt}: final loss {l4[-1]} vs {lb[-1]} ({rel_final:.4f})"
        assert h["grad_reduce_scatter"]["fp8_calls"] > 0, h
        assert pu.get("update_calls", 0) > 0 and pu.get("full_calls", 0) > 0, pu
        assert "param_all_gather" not in h, f"{fmt}: the FP8 parameter gather ran too: {h}"
        assert rs_ratio >= GRAD_RS_MIN_RATIO, f"{fmt}: gradient reduce-scatter only {rs_ratio:.3f}x fewer than fp32"
        assert ag_ratio >= UPDATE_AG_MIN_RATIO, f"{fmt}: weight-update gather only {ag_ratio:.3f}x fewer than bf16"
        assert probe.steps == C.ITERS and len(probe.max_rel) >= C.ITERS - 1, (probe.steps, probe.max_rel)
        assert probe.worst_ratio <= 1.0, f"{fmt}: replica drift exceeds its bound by {probe.worst_ratio:.3f}x"
        C.check_replicas_identical(f4["params"], f"{fmt}_replicas")
        assert l4 != lb, f"{fmt}: bit-identical to the baseline: fp8comm changed nothing"


def gpt_dp2_fp4_resume(rank, world, info):
    """Half the steps, save the replica-update and error-feedback state, uninstall (a restart), install, load, the
    other half: loss, grad norms and parameters equal the uninterrupted run bit for bit. Overlap off, and on
    (there the first half ends with Megatron's forced parameter sync, as Megatron-LM does before it saves)."""
    import fp8comm.integrations.megatron as fm

    T.init_parallel(tp=1)
    iters, half = 10, 5
    hooks = hooks_4bit("mxfp4")
    for mode, kw in (("sync", SYNC), ("overlap", OVERLAP)):
        full = C.run(kw, hooks, iters=iters)
        model, opt, config = T.build(T.ddp_kwargs(**kw))
        fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
        try:
            first = T.train(model, opt, config, half)
            buf = io.BytesIO()
            torch.save({"replica": fm.replica_update_state_dict(model), "ef": fm.error_feedback_state_dict(model)}, buf)
        finally:
            fm.uninstall()
        buf.seek(0)
        sd = torch.load(buf, weights_only=False)
        assert sd["replica"]["buckets"] and all(b["primed"] for b in sd["replica"]["buckets"].values()), sd
        fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
        fm.hook_stats(reset=True)
        try:
            fm.load_replica_update_state_dict(model, sd["replica"])
            fm.load_error_feedback_state_dict(model, sd["ef"])
            rest = T.train(model, opt, config, iters - half, start=half)
            with_state = fm.hook_stats()["param_update"]
        finally:
            fm.uninstall()
        loss, gnorm = first["loss"] + rest["loss"], first["grad_norm"] + rest["grad_norm"]
        info[mode] = {
            "buckets": len(sd["replica"]["buckets"]),
            "loss_last": loss[-1],
            "equal_loss": loss == full["loss"],
            "equal_params": bool(torch.equal(T.param_vector(model), full["params"])),
            "full_gathers_after_resume": with_state.get("full_calls", 0),
        }
        assert loss == full["loss"] and gnorm == full["grad_norm"], (mode, loss, full["loss"])
        assert torch.equal(T.param_vector(model), full["params"]), f"{mode}: params differ after resume"
        assert with_state.get("full_calls", 0) == 0 and with_state["update_calls"] > 0, (mode, with_state)
    bad = {**sd["replica"], "buckets": {k: {**v, "numel": v["numel"] + 1} for k, v in sd["replica"]["buckets"].items()}}
    for installed, match in ((True, "does not match this model's parameter buckets"), (False, "needs an installation")):
        if installed:
            fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
        try:
            fm.load_replica_update_state_dict(model, bad)
        except fm.Fp8CommMegatronError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"accepted: replica-update state for another bucket layout (installed: {installed})")
        finally:
            fm.uninstall()


def gpt_dp2_fp4_overlapped_updates(rank, world, info):
    """Overlap on (10 buckets): the 4-bit update gathers start right after the optimizer step and are waited in the
    next forward's pre-hooks. Loss, grad norms and parameters equal those of the gathers started where Megatron's
    forward asks for them (the path before, replica_update.START_AFTER_STEP = False) bit for bit; replicas equal
    across ranks; with the numerics guard on (gradient buckets, healthy data) the same bits again."""
    import fp8comm.integrations.megatron.replica_update as ru

    T.init_parallel(tp=1)
    hooks = hooks_4bit("mxfp4")
    runs = {}
    for tag, after_step, over in (
        ("after_step", True, {}),
        ("at_forward", False, {}),
        ("guard", True, {"guard": True}),
    ):
        ru.START_AFTER_STEP = after_step
        try:
            runs[tag] = C.run(OVERLAP, {**hooks, **over})
        finally:
            ru.START_AFTER_STEP = True
    a, b, g = runs["after_step"], runs["at_forward"], runs["guard"]
    pa, pb = a["hooks"]["param_update"], b["hooks"]["param_update"]
    info["overlapped_updates"] = {
        "after_step": {k: pa.get(k, 0) for k in ("started_after_step", "taken_after_step", "update_calls")},
        "at_forward": {k: pb.get(k, 0) for k in ("started_after_step", "taken_after_step", "update_calls")},
        "equal": a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"],
        "guard": g["hooks"].get("guard"),
    }
    steps_after_first = C.ITERS - 1  # the first step's gathers are the full ones, issued by the first forward
    assert pa.get("started_after_step", 0) >= steps_after_first and pa["taken_after_step"] == pa["started_after_step"]
    assert pb.get("started_after_step", 0) == 0 and pa["update_calls"] == pb["update_calls"], (pa, pb)
    for tag, r in (("at_forward", b), ("guard", g)):
        assert r["loss"] == a["loss"] and r["grad_norm"] == a["grad_norm"], (tag, r["loss"], a["loss"])
        assert torch.equal(r["params"], a["params"]), f"{tag}: parameters differ from the overlapped run"
        C.check_replicas_identical(r["params"], f"overlapped_updates_{tag}")
    C.check_replicas_identical(a["params"], "overlapped_updates")
    assert g["hooks"]["guard"]["switches"] == 0 and g["hooks"]["param_update"]["taken_after_step"] > 0, g["hooks"]


def gpt_dp2_fp4_update_guard(rank, world, info):
    """The numerics guard on 4-bit weight-update buckets (overlap on, updates started after the step): from
    iteration 2 every element of bucket "update1"'s change is reported flushed to zero (added to the counters its
    packing kernel fills; the bytes sent are the real ones). Both ranks demote update1 to FP8 (the change in E4M3)
    at the same step, then to BF16 (Megatron's own gather of the values: full gathers), the other buckets stay 4-bit,
    replicas stay identical and the loss tracks Megatron alone."""
    import fp8comm.comm.updates as upd

    T.init_parallel(tp=1)
    base = C.run(OVERLAP, None)
    state = {"iteration": 0, "injected": 0}
    orig = upd.all_gather_add

    def injected(*a, **kw):
        out = orig(*a, **kw)
        b = kw.get("guard")
        if b is not None and b.key == "update1" and state["iteration"] >= 2:
            b.counters[1] += a[1].numel()  # underflow: every element of this change
            state["injected"] += 1
        return out

    def after_backward(i: int) -> None:
        state["iteration"] = i + 1

    guard = dict(guard=True, guard_threshold=0.05, guard_patience=2, guard_cooldown=100)
    upd.all_gather_add = injected
    try:
        f4 = C.run(OVERLAP, {**hooks_4bit("mxfp4"), **guard}, train_kw={"after_backward": after_backward})
    finally:
        upd.all_gather_add = orig
    g, pu = f4["hooks"]["guard"], f4["hooks"]["param_update"]
    lb, l4 = base["loss"], f4["loss"]
    rel = max(abs(a - b) / b for a, b in zip(l4, lb))
    info["update_guard"] = {"guard": g, "param_update": pu, "injected": state["injected"], "max_loss_rel": rel}
    assert state["injected"] > 0 and g.get("switches", 0) == 2, g  # update1: 4 bits -> FP8 -> BF16
    assert g.get("update_fp8_calls", 0) > 0 and g.get("update_bf16_calls", 0) > 0, g
    assert pu["full_calls"] > 10 and pu["update_calls"] > 0, pu  # 10 first gathers + update1's BF16 ones
    assert rel <= FP4_FINAL_LOSS_RTOL, (l4, lb)
    C.check_replicas_identical(f4["params"], "update_guard")


def gpt_dp2_plain_ddp_fp4(rank, world, info):
    """Plain DDP (no distributed optimizer): the bucket all-reduce in mxfp4 (reduce-scatter + all-gather of the
    sums, both 4-bit) with the 32-element Hadamard transform, error feedback on the first phase; a short run
    tracks Megatron alone, replicas identical."""
    T.init_parallel(tp=1)
    kw = dict(use_distributed_optimizer=False, overlap_grad_reduce=True)
    iters = C.ITERS // 2
    base = C.run(kw, None)  # gpt_dp2_plain_ddp's baseline (ITERS steps); compared over the first `iters`
    f4 = C.run(kw, dict(grad_reduce=True, grad_fmt="mxfp4", error_feedback=True, hadamard=32), iters=iters)
    lb, l4 = base["loss"][:iters], f4["loss"]
    rel_final = abs(l4[-1] - lb[-1]) / lb[-1]
    info["plain_ddp_mxfp4"] = {
        "loss_base": [round(x, 4) for x in (lb[0], lb[-1])],
        "loss_4bit": [round(x, 4) for x in (l4[0], l4[-1])],
        "final_loss_rel": round(rel_final, 5),
        "all_reduce_ratio_vs_fp32": round(_ratio(f4["comm"], "all_reduce"), 3),
        "hooks": f4["hooks"],
    }
    assert f4["hooks"]["grad_all_reduce"]["fp8_calls"] > 0, f4["hooks"]
    assert rel_final <= FP4_FINAL_LOSS_RTOL and math.isfinite(l4[-1]), info["plain_ddp_mxfp4"]
    C.check_replicas_identical(f4["params"], "plain_ddp_mxfp4")


def gpt_dp2_fp4_ablation(rank, world, info):
    """A measurement, not in the test launches (docs/megatron.md quotes it): final-loss deviation of 4-bit
    gradients without error feedback, with stochastic rounding, with both, with the Hadamard transform, nvfp4,
    each with 4-bit weight updates of the same format (DP=2, overlap on, ITERS steps).

    Run: .venv/bin/python tests/integrations/megatron/mcore_measure.py gpt_dp2_fp4_ablation"""
    T.init_parallel(tp=1)
    base = C.run(OVERLAP, None)
    for tag, fmt, over in (
        ("mxfp4_no_ef", "mxfp4", dict(error_feedback=False)),
        ("mxfp4_ef", "mxfp4", {}),
        ("mxfp4_sr", "mxfp4", dict(error_feedback=False, rounding="stochastic")),
        ("mxfp4_ef_sr", "mxfp4", dict(rounding="stochastic")),
        ("nvfp4_no_ef", "nvfp4", dict(error_feedback=False)),
        ("nvfp4_ef", "nvfp4", {}),
        ("mxfp4_grads_only_ef", "mxfp4", dict(param_update_fmt=None, param_gather=False)),
        ("mxfp4_ef_hadamard32", "mxfp4", dict(hadamard=32)),
        ("mxfp4_hadamard32", "mxfp4", dict(hadamard=32, error_feedback=False)),
        ("nvfp4_ef_hadamard16", "nvfp4", dict(hadamard=16)),
    ):
        hooks = {**hooks_4bit(fmt), **over}
        f4 = C.run(OVERLAP, hooks)
        lb, l4 = base["loss"], f4["loss"]
        info[tag] = {
            "final_loss": round(l4[-1], 4),
            "final_loss_rel": round((l4[-1] - lb[-1]) / lb[-1], 5),
            "max_abs_loss_rel": round(max(abs(a - b) / b for a, b in zip(l4, lb)), 5),
        }
    info["baseline_final_loss"] = round(base["loss"][-1], 4)


def moe_ep2_fp4(rank, world, info):
    """MoE, EP=2 on 2 ranks: the expert buckets' data-parallel group has one rank (their gathers pass through).
    Their weights must still follow the master: dense and expert parameters each move from the initial weights as
    in the baseline (relative difference of the total update), and the loss tracks it."""
    T.init_parallel(tp=1, ep=2)
    base = C.run(OVERLAP, None, moe=True)  # moe_ep2's baseline
    f4 = C.run(OVERLAP, hooks_4bit("mxfp4"), moe=True)
    init, _, _ = T.build(T.ddp_kwargs(**OVERLAP), moe=True)  # same seed: the initial weights of both runs

    def by_kind(model) -> dict:
        out: dict = {"expert": [], "dense": []}
        for name, p in model.named_parameters():
            out["expert" if ".experts." in name else "dense"].append(p.detach().float().reshape(-1))
        return {k: torch.cat(v) for k, v in out.items()}

    w0, wb, w4 = by_kind(init), by_kind(base["model"]), by_kind(f4["model"])
    rel = {k: float((w4[k] - wb[k]).norm() / (wb[k] - w0[k]).norm()) for k in w0}
    lb, l4 = base["loss"], f4["loss"]
    info["moe_ep2_mxfp4"] = {
        "update_rel_diff_vs_baseline": {k: round(v, 4) for k, v in rel.items()},
        "final_loss_rel": round(abs(l4[-1] - lb[-1]) / lb[-1], 5),
        "hooks": f4["hooks"],
    }
    assert f4["hooks"]["param_update"]["passthrough_calls"] > 0, f4["hooks"]  # the one-rank expert groups
    assert all(v < 0.5 for v in rel.values()), f"parameters do not follow the master: {rel}"
    assert abs(l4[-1] - lb[-1]) / lb[-1] <= FP4_FINAL_LOSS_RTOL, (l4, lb)
