"""Pipeline parallelism (PP=2 x DP=2 on 4 gloo ranks): FP8 gradient reduce-scatter and parameter all-gather with
Megatron's 1F1B schedule (p2p activations over gloo isend/irecv), the distributed optimizer and overlapped grad
reduce and param gather, against the same run without fp8comm; each stage's gradient reduction element-wise
against the exact one (mcore_probe.GradProbe, >= 25 dB every step)."""

from __future__ import annotations

import mcore_checks as C
import mcore_train as T


def gpt_pp2_dp2(rank, world, info):
    """PP=2 x DP=2, one transformer layer per stage, 4 micro-batches of 1 sequence per step (1F1B, warm-up)."""
    from megatron.core import parallel_state as ps

    T.init_parallel(tp=1, pp=2)
    assert ps.get_pipeline_model_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 2
    kw = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    tk = {"micro": 1, "num_micro": 4}  # the same tokens per step as the other runs, a 4-deep pipeline
    base = C.run(kw, None, train_kw=tk)
    tag = "pp2_dp2_overlap_on"
    # The probe compares each stage's own buckets over that stage's DP group, element by element.
    f8, probe = C.probed_run(kw, dict(grad_reduce=True, param_gather=True), tag, train_kw=tk)
    C.check_parity(base, f8, info, tag)
    info[tag].update(stage=ps.get_pipeline_model_parallel_rank(), probe=probe)
    h = f8["hooks"]
    assert h["grad_reduce_scatter"]["fp8_calls"] > 0 and h["param_all_gather"]["fp8_calls"] > 0, h
    C.check_bytes(f8, "reduce_scatter", 4, tag)  # fp32 gradient buckets
    C.check_bytes(f8, "all_gather", 2, tag)  # bf16 parameter buffers
    C.check_replicas_identical(f8["params"], tag)  # the DP group of this stage


def gpt_pp2_dp2_guard(rank, world, info):
    """The numerics guard under PP=2 x DP=2: each pipeline stage decides over its own ranks. Stage 0's bucket
    "grad1" stops fitting FP8 (the injection of mcore_checks_guard): it falls back on both of stage 0's ranks at the
    same step, while stage 1, whose buckets carry the same keys ("grad0", "grad1", ...), never falls back."""
    import mcore_checks_guard as G
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    T.init_parallel(tp=1, pp=2)
    stage = ps.get_pipeline_model_parallel_rank()
    kw = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    with G.Injection("grad1" if stage == 0 else "none") as inj:
        tk = {"micro": 1, "num_micro": 4, "after_backward": inj.after_backward}
        run = C.run(kw, dict(G.HOOKS, **G.GUARD), train_kw=tk)
    summary = run["hooks"].get("guard", {})
    switched = run["comm"].get("guard.to_bf16", {}).get("calls", 0)
    info[f"stage{stage}"] = dict(guard=summary, to_bf16=switched, injected=inj.injected)
    everyone = [None] * world
    dist.all_gather_object(everyone, (stage, summary))
    assert all(s == summary for st, s in everyone if st == stage), f"stage {stage}'s ranks disagree: {everyone}"
    if stage == 0:
        assert inj.injected > 0 and switched == 1, (inj.injected, run["comm"])
        assert summary.get("grad_bf16_calls", 0) >= C.ITERS - G.START - 3, summary
    else:
        assert switched == 0 and not summary.get("grad_bf16_calls"), f"stage 1 fell back with healthy data: {summary}"
    assert run["hooks"]["grad_reduce_scatter"]["fp8_calls"] > 0, run["hooks"]
    C.check_replicas_identical(run["params"], "pp2_dp2_guard")
