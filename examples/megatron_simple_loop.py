"""A simple Megatron-Core training loop with fp8comm: a small GPT on synthetic batches, data parallel over all ranks.

    torchrun --nproc-per-node 2 examples/megatron_simple_loop.py                 # plain DDP: FP8 all-reduce
    torchrun --nproc-per-node 2 examples/megatron_simple_loop.py --distributed-optimizer
                                                # FP8 gradient reduce-scatter + FP8 parameter all-gather
    torchrun --nproc-per-node 2 examples/megatron_simple_loop.py --distributed-optimizer \
        --grad-format mxfp4 --error-feedback --param-update-format mxfp4
                                                # 4-bit gradients + 4-bit weight updates (replica += change)
    torchrun --nproc-per-node 2 examples/megatron_simple_loop.py --no-fp8comm    # Megatron alone, to compare

On a machine without a GPU, Megatron-Core needs CUDA stand-ins; this repository's test shims provide them:
    torchrun --nproc-per-node 2 tests/integrations/megatron/run_on_cpu.py examples/megatron_simple_loop.py

It follows the shape of Megatron-LM's examples/run_simple_mcore_train_loop.py (initialize, build a GPTModel, wrap
it in Megatron's DDP, loop over get_forward_backward_func) and adds the fp8comm calls: `install(...)` after the
parallel state exists and before the model is wrapped in DDP, and `shutdown()` at the end of the job, model dropped,
before destroy_process_group(). The rest is plain Megatron-Core. Data are synthetic (the megatron-core wheel's
dataset helpers need a compiled extension it does not ship).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

SEQ = 64
VOCAB = 128


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20, help="training iterations")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer state (ZeRO-1 style)")
    p.add_argument("--overlap", action="store_true", help="overlap the gradient reduction with the backward")
    p.add_argument("--no-fp8comm", action="store_true", help="Megatron's own collectives (the baseline)")
    p.add_argument(
        "--grad-format",
        default="e4m3",
        choices=("e4m3", "e5m2", "mxfp4", "nvfp4"),
        help="gradient wire: FP8 or 4 bits (default %(default)s)",
    )
    p.add_argument("--error-feedback", action="store_true", help="carry each bucket's gradient quantization error")
    p.add_argument(
        "--param-update-format",
        default=None,
        choices=("mxfp4", "nvfp4"),
        help="with --distributed-optimizer: gather 4-bit weight changes instead of FP8 weights",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def initialize() -> bool:
    """torch.distributed from torchrun's environment (NCCL on GPUs, gloo on CPU); True if this call started it."""
    started = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return started


def build_model(args):
    """A 2-layer GPT (hidden 64, local layer spec, bf16 weights): Megatron-Core's GPTModel and TransformerConfig."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    gpu = torch.cuda.is_available()
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,  # the same initial weights on every rank, GPU or not
        bf16=True,  # bf16 weights; Megatron's optimizer keeps fp32 master weights
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # no fused kernels: the plain PyTorch paths run everywhere (fusions are a GPU speed matter, not fp8comm's)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    if gpu:
        gpt.cuda()
    return Float16Module(config, gpt), config


def batches(args, dp_rank: int):
    """Synthetic sequences t[i+1] = (5 t[i] + 3) mod VOCAB from a random start (learnable: the loss falls fast),
    different on every data-parallel rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(args.seed + 1000 * dp_rank)
    while True:
        tok = torch.empty(args.micro_batch_size, SEQ + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, VOCAB, (args.micro_batch_size,), generator=g)
        for i in range(SEQ):
            tok[:, i + 1] = (5 * tok[:, i] + 3) % VOCAB
        yield tok[:, :-1].to(device), tok[:, 1:].to(device)


def forward_step(data_iterator, model):
    """Megatron's forward-step contract: (output, loss function); the loss function gives (sum, tokens, logs)."""
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand_as(tokens)
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=tokens.device).tril().logical_not()
    per_token_loss = model(tokens, positions, causal, labels=labels)

    def loss_func(output):
        total = output.float().sum()
        n = torch.tensor(output.numel(), device=output.device)
        return total, n.to(torch.int), {"lm loss": torch.stack([total.detach(), n.float()])}

    return per_token_loss, loss_func


def main(argv=None) -> dict:
    """Train; returns {"loss": [...], "hook_stats": ..., "comm_stats": ...} (the test reads it). Ends the job
    (fp8comm's Megatron shutdown(), destroy_process_group()) when it started torch.distributed itself."""
    import fp8comm.integrations.megatron as fp8comm_megatron

    args = parse_args(argv)
    started = initialize()
    try:
        return train(args)  # the model, optimizer and config live in train()'s frame: gone once it returns
    finally:
        if started:
            # End of the job: uninstall(), Megatron's destroy_model_parallel() and the group references Megatron
            # keeps after it (a rotary-embedding cache holds the model), fp8comm's own; then destroy_process_group()
            # stops every gloo thread before interpreter teardown, which running ones can abort (issue 27).
            fp8comm_megatron.shutdown()
            dist.destroy_process_group()
        else:  # the caller's process group (a test harness): it ends the job
            fp8comm_megatron.uninstall()
            fp8comm_megatron.release_groups()


def train(args: argparse.Namespace) -> dict:
    """Build, install fp8comm, train args.iters steps; the result of main()."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import fp8comm.integrations.megatron as fp8comm_megatron
    from fp8comm.comm import comm_stats, format_comm_stats, reset_comm_stats

    rank0 = dist.get_rank() == 0
    model, config = build_model(args)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=args.distributed_optimizer,
        grad_reduce_in_fp32=True,  # gradient buckets in fp32: FP8 moves ~3.9x fewer bytes
        overlap_grad_reduce=args.overlap,
        overlap_param_gather=args.overlap and args.distributed_optimizer,
        bucket_size=4096 if args.overlap else None,  # tiny model: small buckets so that there are several
    )
    if not args.no_fp8comm:
        # The fp8comm line: after the parallel state exists, before DDP builds its buckets. Gradients go FP8 or
        # 4-bit (reduce-scatter with the distributed optimizer, all-reduce without); parameters only with the
        # distributed optimizer (plain DDP gathers none): FP8 values, or 4-bit changes applied to every rank's
        # replica (--param-update-format). GEMMs are untouched.
        fp8comm_megatron.install(
            ddp_config=ddp_config,
            transformer_config=config,
            grad_reduce=True,
            grad_fmt=args.grad_format,
            error_feedback=args.error_feedback,
            param_gather=args.distributed_optimizer and args.param_update_format is None,
            param_update_fmt=args.param_update_format,
        )
    fp8comm_megatron.hook_stats(reset=True)
    reset_comm_stats()
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    if args.distributed_optimizer:
        model.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=args.distributed_optimizer,
            clip_grad=1.0,
        ),
        [model],
    )
    # What Megatron's schedule calls around the backward: loss scaling, the end-of-step gradient reduction,
    # and (with overlap) deferring the reduction to the last micro-batch and the parameter gather to the forward.
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap:
        config.no_sync_func = model.no_sync
        if args.distributed_optimizer:
            config.param_sync_func = model.start_param_sync

    data = batches(args, parallel_state.get_data_parallel_rank())
    forward_backward = get_forward_backward_func()
    losses = []
    for it in range(args.iters):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        s = torch.stack([o["lm loss"] for o in out]).sum(0)
        dist.all_reduce(s, group=parallel_state.get_data_parallel_group())  # mean over all ranks' tokens
        losses.append(float(s[0] / s[1]))
        if rank0:
            print(f"iteration {it + 1:3d} | loss {losses[-1]:.4f} | grad norm {float(grad_norm):.4f}", flush=True)
    if args.overlap and args.distributed_optimizer:
        model.start_param_sync(force_sync=True)  # the last step's gather is otherwise left to the next forward
    result = {
        "loss": losses,
        "hook_stats": fp8comm_megatron.hook_stats(),
        "comm_stats": comm_stats(),
        "params": torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]),
    }
    if rank0:
        print(f"fp8comm hooks: {result['hook_stats']}")
        print(format_comm_stats(), flush=True)
    return result


if __name__ == "__main__":
    main()
