"""Test helpers: a tiny Megatron-Core GPT (local layer spec, optional MoE), DDP + optimizer, a training loop.

Everything is real megatron-core (GPTModel, Float16Module, DistributedDataParallel, get_megatron_optimizer,
the forward-backward schedule, finalize_model_grads); only CUDA-only calls are stubbed (mcore_cpu).
"""

from __future__ import annotations

import dataclasses

import torch

VOCAB = 128
SEQ = 32


def init_parallel(tp: int = 1, ep: int = 1, pp: int = 1) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp
    )
    model_parallel_cuda_manual_seed(1234)


def transformer_config(moe: bool = False, **over):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        init_method_std=0.02,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    if moe:
        from megatron.core import parallel_state as ps

        kw.update(
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
            ffn_hidden_size=128,
            moe_ffn_hidden_size=128,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
            add_bias_linear=False,
        )  # expert bias + TP=1 hits an in-place-on-custom-Function-view error
    kw.update(over)
    return TransformerConfig(**kw)


def build(ddp_kw: dict, moe: bool = False, seed: int = 1234, opt_kw: dict | None = None, **cfg_over):
    """A fresh model with identical initial weights for the same seed: [DDP(Float16Module(GPT))], optimizer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1:
        cfg_over.setdefault("pipeline_model_parallel_size", pp)
    config = transformer_config(moe=moe, **cfg_over)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    model = Float16Module(config, gpt) if config.bf16 else gpt
    ddp_config = DistributedDataParallelConfig(**ddp_kw)
    model = DistributedDataParallel(config, ddp_config, model)
    if ddp_config.use_distributed_optimizer:
        model.broadcast_params()
    okw = dict(
        optimizer="adam",
        lr=3e-3,
        weight_decay=0.0,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        clip_grad=1.0,
    )
    okw.update(opt_kw or {})
    opt = get_megatron_optimizer(OptimizerConfig(**okw), [model])
    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = model.no_sync
    if ddp_config.overlap_param_gather and ddp_config.use_distributed_optimizer:
        config.param_sync_func = model.start_param_sync
    return model, opt, config


def batches(n: int, micro: int, dp_rank: int, seed: int = 7):
    """n deterministic micro-batches for this DP rank (the same on every TP/EP peer of the rank).

    Sequences follow t[i+1] = (5 t[i] + 3) mod VOCAB from a random start: learnable, so the loss falls steeply
    over a few iterations and a parity check compares real training trajectories, not noise around log(VOCAB).
    """
    g = torch.Generator().manual_seed(seed * 1000 + dp_rank)
    out = []
    for _ in range(n):
        tok = torch.empty(micro, SEQ + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, VOCAB, (micro,), generator=g)
        for i in range(SEQ):
            tok[:, i + 1] = (5 * tok[:, i] + 3) % VOCAB
        out.append({"tokens": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()})
    return out


def forward_step(data_iterator, model):
    b = next(data_iterator)
    pos = torch.arange(SEQ).unsqueeze(0).expand_as(b["tokens"])
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    out = model(b["tokens"], pos, mask, labels=b["labels"])
    loss_mask = torch.ones_like(b["labels"], dtype=torch.float32)

    def loss_func(output):
        losses = output.float().view(-1)
        total = (losses * loss_mask.view(-1)).sum()
        n = loss_mask.sum()
        return total, n.to(torch.int), {"lm loss": torch.stack([total.detach(), n])}

    return out, loss_func


def train(
    model,
    opt,
    config,
    iters: int,
    micro: int = 2,
    num_micro: int = 2,
    start: int = 0,
    after_backward=None,
    allow_skip: bool = False,
) -> dict:
    """Megatron's train_step loop on synthetic tokens: per-iteration global loss and grad norm.

    start: first iteration (its data; a resumed run continues the same data stream). after_backward(i): called
    after forward-backward (gradients reduced), before the optimizer step. allow_skip: a skipped step is recorded
    in "skipped" instead of failing.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_rank()
    data = batches((start + iters) * num_micro, micro, dp)[start * num_micro :]
    it = iter(data)
    losses, norms, skipped = [], [], []
    for i in range(start, start + iters):
        model.zero_grad_buffer()
        opt.zero_grad()
        out = fb(
            forward_step_func=forward_step,
            data_iterator=it,
            model=[model],
            num_microbatches=num_micro,
            seq_length=SEQ,
            micro_batch_size=micro,
            forward_only=False,
        )
        if after_backward is not None:
            after_backward(i)
        ok, gnorm, _ = opt.step()
        assert ok or allow_skip, "optimizer step skipped (non-finite gradients)"
        if not ok:
            skipped.append(i)
        s = torch.stack([o["lm loss"] for o in out]).sum(0) if out else torch.zeros(2)
        # Only the last pipeline stage has losses: the other stages add zeros (one world-wide sum when PP > 1).
        torch.distributed.all_reduce(s, group=ps.get_data_parallel_group() if pp == 1 else None)
        losses.append(float(s[0] / s[1]))
        norms.append(float(gnorm) if gnorm is not None else float("nan"))
    if getattr(model.ddp_config, "overlap_param_gather", False):
        # The last step's gather is dispatched lazily by the next forward; finish it so params are current.
        model.start_param_sync(force_sync=True)
    return {"loss": losses, "grad_norm": norms, "skipped": skipped}


def param_vector(model) -> torch.Tensor:
    """All model parameters (in registration order) as one fp32 vector."""
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def ddp_kwargs(**over) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig

    names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    kw = dict(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        bucket_size=4096,
    )
    kw.update(over)
    assert set(kw) <= names, set(kw) - names
    return kw
