"""Pipeline parallelism (PP=2 x DP=2 on 4 gloo ranks): FP8 gradient reduce-scatter and parameter all-gather with
Megatron's 1F1B schedule (p2p activations over gloo isend/irecv), the distributed optimizer and overlapped grad
reduce and param gather, against the same run without fp8comm."""

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
    f8 = C.run(kw, dict(grad_reduce=True, param_gather=True), train_kw=tk)
    tag = "pp2_dp2_overlap_on"
    C.check_parity(base, f8, info, tag)
    info[tag]["stage"] = ps.get_pipeline_model_parallel_rank()
    h = f8["hooks"]
    assert h["grad_reduce_scatter"]["fp8_calls"] > 0 and h["param_all_gather"]["fp8_calls"] > 0, h
    C.check_bytes(f8, "reduce_scatter", 4, tag)  # fp32 gradient buckets
    C.check_bytes(f8, "all_gather", 2, tag)  # bf16 parameter buffers
    C.check_replicas_identical(f8["params"], tag)  # the DP group of this stage
