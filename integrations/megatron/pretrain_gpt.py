"""Example: a Megatron-LM style GPT pretraining entry point with the fp8comm plugin (synthetic data).

    NPROC_PER_NODE=8 launch/torchrun.sh -m fp8comm.integrations.megatron.pretrain_gpt \\
        --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 1024 --num-attention-heads 16 \\
        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 64 \\
        --train-iters 100 --lr 3e-4 --bf16 --use-distributed-optimizer --overlap-grad-reduce \\
        --overlap-param-gather --tokenizer-type NullTokenizer --vocab-size 32000 \\
        --fp8comm-grad-reduce --fp8comm-param-gather

The three fp8comm lines are what a real pretrain script needs: `extra_args_provider=add_args` when parsing,
`install(args)` after parsing and before the model is built, and (optionally) logging comm_stats(); at exit,
`shutdown()` before destroy_process_group() (end_job()) releases the groups Megatron keeps. Everything else
is plain Megatron-Core: GPTModel, Float16Module, DistributedDataParallel, get_megatron_optimizer and the
forward-backward schedule (pipeline stages too: --pipeline-model-parallel-size, no virtual stages).
Rank 0 ends with one `pretrain_gpt summary: {json}` line: median step time (warm-up excluded), bytes its node's
network interface sent per step (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / FP8COMM_LINK_IFNAME counters, when
set), first/last loss and fp8comm's per-collective wire bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from fp8comm.comm import comm_stats, format_comm_stats, reset_comm_stats
from fp8comm.distributed import link_bytes, link_ifname
from fp8comm.integrations.megatron import (
    add_args,
    error_feedback_nbytes,
    hook_stats,
    install,
    planner_summary,
    shutdown,
    uninstall,
)


def _init_distributed() -> None:
    """torch.distributed from whatever launched us (launch/torchrun.sh, launch/mpirun.sh, Slurm, cluster.py)."""
    try:
        from fp8comm.distributed import init_distributed  # exports RANK/WORLD_SIZE, which Megatron's args read
    except ImportError:  # an fp8comm without the launcher helper: torchrun's env:// variables only
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    else:
        init_distributed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _link_tx_bytes(ifname: str | None) -> int | None:
    counters = None if ifname is None else link_bytes(ifname)
    return None if counters is None else counters[0]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def model_provider(args, config):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    if args.transformer_impl == "local":
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def _fields_from_args(cls, args) -> dict:
    # What Megatron-LM's own builders do: copy every arg whose name is a field of the config class.
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


# DistributedDataParallelConfig fields whose Megatron-LM argument has another name (megatron.training's
# get_megatron_ddp_config maps them; that module needs Python >= 3.12, so the mapping is repeated here).
_DDP_RENAMED = {
    "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32",  # True for --bf16 unless --grad-reduce-in-bf16
    "check_for_nan_in_grad": "check_for_nan_in_loss_and_grad",
    "num_buckets": "ddp_num_buckets",
    "bucket_size": "ddp_bucket_size",
    "pad_buckets_for_high_nccl_busbw": "ddp_pad_buckets_for_high_nccl_busbw",
    "average_in_collective": "ddp_average_in_collective",
}


def ddp_config_kwargs(args, cls) -> dict:
    """The DistributedDataParallelConfig Megatron-LM's own trainer builds from `args` (same names, then renamed)."""
    kw = _fields_from_args(cls, args)
    fields = {f.name for f in dataclasses.fields(cls)}
    kw.update({f: getattr(args, a) for f, a in _DDP_RENAMED.items() if f in fields and hasattr(args, a)})
    return kw


def _batches(args, dp_rank: int):
    """Synthetic learnable sequences t[i+1] = (5 t[i] + 3) mod V, different per data-parallel rank."""
    g = torch.Generator().manual_seed(args.seed * 1000 + dp_rank)
    v, s = args.padded_vocab_size, args.seq_length
    while True:
        tok = torch.empty(args.micro_batch_size, s + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, v, (args.micro_batch_size,), generator=g)
        for i in range(s):
            tok[:, i + 1] = (5 * tok[:, i] + 3) % v
        yield {"tokens": tok[:, :-1].to(_device()), "labels": tok[:, 1:].to(_device())}


def forward_step(data_iterator, model):
    b = next(data_iterator)
    s = b["tokens"].shape[1]
    pos = torch.arange(s, device=b["tokens"].device).unsqueeze(0).expand_as(b["tokens"])
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=b["tokens"].device).tril().logical_not()
    out = model(b["tokens"], pos, mask, labels=b["labels"])

    def loss_func(output):
        total = output.float().sum()
        n = torch.tensor(output.numel(), device=output.device)
        return total, n.to(torch.int), {"lm loss": torch.stack([total.detach(), n.float()])}

    return out, loss_func


def main(argv: list[str] | None = None) -> dict:
    """Parse (Megatron-LM args + fp8comm), install, build, train args.train_iters steps; returns the history."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

    _init_distributed()  # first: Megatron's argument validation reads RANK / WORLD_SIZE
    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    try:
        args = parse_and_validate_args(extra_args_provider=add_args)  # 1. the fp8comm argument group
    finally:
        sys.argv = saved_argv
    if args.virtual_pipeline_model_parallel_size:
        raise SystemExit("this example builds one model chunk per stage; drop --num-layers-per-virtual-pipeline-stage")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    model_parallel_cuda_manual_seed(args.seed)

    install(args)  # 2. after argument parsing, before the model (and its DDP buckets) are built
    try:
        config = core_transformer_config_from_args(args)
        model = model_provider(args, config)
        if not args.use_cpu_initialization and torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(args, DistributedDataParallelConfig))
        model = DistributedDataParallel(config, ddp_config, model)
        model.broadcast_params()
        opt_cfg = OptimizerConfig(**_fields_from_args(OptimizerConfig, args))
        optimizer = get_megatron_optimizer(opt_cfg, [model])
        config.grad_scale_func = optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if ddp_config.overlap_grad_reduce:
            config.no_sync_func = model.no_sync
        if ddp_config.overlap_param_gather:
            config.param_sync_func = model.start_param_sync

        data = _batches(args, ps.get_data_parallel_rank())
        fb = get_forward_backward_func()
        history: dict[str, Any] = {"loss": [], "grad_norm": [], "step_s": [], "link_tx_bytes": []}
        history.update(start_s=[], start_tx=[], start_cpu=[])  # at every step's start: periods start to start
        ifname = link_ifname()
        reset_comm_stats()
        for it in range(args.train_iters):
            dist.barrier()  # every step starts together: its time and link bytes are this step's
            tx0, t0 = _link_tx_bytes(ifname), time.perf_counter()
            history["start_s"].append(t0)
            history["start_tx"].append(tx0)
            history["start_cpu"].append(time.process_time())  # this process, all its threads (gloo's too)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            out = fb(
                forward_step_func=forward_step,
                data_iterator=data,
                model=[model],
                num_microbatches=get_num_microbatches(),
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                forward_only=False,
            )
            ok, grad_norm, _ = optimizer.step()  # with overlap_param_gather, the next forward gathers (steady state)
            _sync()
            history["step_s"].append(time.perf_counter() - t0)
            tx1 = _link_tx_bytes(ifname)
            history["link_tx_bytes"].append(None if tx0 is None or tx1 is None else tx1 - tx0)
            # Only the last pipeline stage has losses: the others add zeros to one world-wide sum.
            s = torch.stack([o["lm loss"] for o in out]).sum(0) if out else torch.zeros(2, device=_device())
            dist.all_reduce(s)
            history["loss"].append(float(s[0] / s[1]))
            history["grad_norm"].append(float(grad_norm) if grad_norm is not None else float("nan"))
            if dist.get_rank() == 0 and (it + 1) % args.log_interval == 0:
                print(
                    f"iteration {it + 1}/{args.train_iters} | lm loss {history['loss'][-1]:.4f} | grad norm "
                    f"{history['grad_norm'][-1]:.4f} | step {history['step_s'][-1] * 1e3:.0f} ms | "
                    f"update {'ok' if ok else 'skipped'}",
                    flush=True,
                )
        if ddp_config.overlap_param_gather:
            model.start_param_sync(force_sync=True)  # the last step's gather, dispatched lazily otherwise
        history["grad_reduce_in_fp32"] = ddp_config.grad_reduce_in_fp32
        cs = history["start_cpu"][2 if len(history["start_cpu"]) >= 5 else 0 :]
        cpu_s = statistics.median([b - a for a, b in zip(cs, cs[1:])] or [0.0])
        mine = torch.tensor([cpu_s], dtype=torch.float64, device=_device())  # NCCL gathers device tensors only
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        history["cpu_s_per_period_by_rank"] = [round(float(c), 3) for c in every]
        history["comm_stats"] = comm_stats()
        history["hook_stats"] = hook_stats()
        history["error_feedback_bytes"] = error_feedback_nbytes()
        if dist.get_rank() == 0:
            print(format_comm_stats(), flush=True)  # 3. FP8 bytes moved per collective
            print("pretrain_gpt summary: " + json.dumps(_summary(history, args, ifname)), flush=True)
        return history
    finally:
        uninstall()


def _summary(h: dict, args, ifname: str | None) -> dict:
    """Step time and link bytes per step (medians without the warm-up: the first 2 steps of >= 5, else the first),
    loss, fp8comm wire bytes per step."""
    n = len(h["step_s"])
    later = slice(2 if n >= 5 else 1 if n > 1 else 0, None)
    link = [b for b in h["link_tx_bytes"][later] if b is not None]
    starts = h["start_s"][later]
    periods = [b - a for a, b in zip(starts, starts[1:])]
    txs = h["start_tx"][later]
    link_periods = [b - a for a, b in zip(txs, txs[1:]) if a is not None and b is not None]
    return {
        "fp8comm": {
            k: getattr(args, "fp8comm_" + k)
            for k in ("grad_reduce", "param_gather", "moe_dispatch", "moe_combine", "error_feedback")
        },
        "world": dist.get_world_size(),
        "grad_buckets": "fp32" if h["grad_reduce_in_fp32"] else "params dtype",
        "steps": len(h["loss"]),
        "step_time_s_median": round(statistics.median(h["step_s"][later]), 4),
        # start to start: the whole iteration, also what still runs after optimizer.step() returns (e.g. 4-bit
        # weight-update gathers started there and waited in the next forward)
        "step_period_s_median": round(statistics.median(periods), 4) if periods else None,
        "link": ifname,
        "link_tx_bytes_per_step_median": statistics.median(link) if link else None,
        # start to start: also the bytes sent after optimizer.step() returned (gathers started there)
        "link_tx_bytes_per_period_median": statistics.median(link_periods) if link_periods else None,
        # CPU seconds of each rank's process per period (start to start, median without the warm-up): with more
        # ranks than cores, their sum over the cores bounds the period from below
        "cpu_s_per_period_by_rank": h["cpu_s_per_period_by_rank"],
        "loss_first": round(h["loss"][0], 5),
        "loss_last": round(h["loss"][-1], 5),
        "error_feedback_bytes": h["error_feedback_bytes"],
        "fp8comm_wire_bytes_per_step": {
            k: v["wire_bytes"] // max(1, len(h["loss"])) for k, v in h["comm_stats"].items()
        },
        # every step, for medians over another warm-up (the planner's trials settle within its first steps)
        "step_times_s": [round(t, 4) for t in h["step_s"]],
        "step_periods_s": [round(b - a, 4) for a, b in zip(h["start_s"], h["start_s"][1:])],
        "planner": {k: v for k, v in planner_summary().items() if k in ("plans", "trials", "fallback")},
    }


def end_job() -> None:
    """After main(), on every rank: fp8comm's Megatron shutdown(), then destroy_process_group() (issue 27: gloo
    threads of a group something still holds run into interpreter teardown, which they can abort)."""
    shutdown()  # Megatron's destroy_model_parallel() and the group references it leaves, fp8comm's own
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_job()
