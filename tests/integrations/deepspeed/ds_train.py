"""Models, data and a training loop for the DeepSpeed checks (run inside torchrun workers, gloo, CPU).

Every run of a configuration sees the same initial weights and the same batches (seeded by step and rank), so a
baseline and an FP8 run differ only by what fp8comm changes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fp8comm.integrations.deepspeed as fd
from fp8comm.tools.gpt import GPT, GPTConfig

BLOCK = 32
BATCH = 8
LR = 3e-3
MOE_HIDDEN = 64


def corpus() -> tuple[torch.Tensor, int]:
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))[:200_000]
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(vocab)


DATA, VOCAB = corpus()


def batch(step: int, rank: int, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * step + rank)
    ix = torch.randint(len(DATA) - BLOCK - 1, (batch_size,), generator=g)
    x = torch.stack([DATA[i : i + BLOCK] for i in ix])
    return x, torch.stack([DATA[i + 1 : i + 1 + BLOCK] for i in ix])


def tiny_gpt(n_layer: int = 2, n_embd: int = 64) -> nn.Module:
    return GPT(GPTConfig(VOCAB, BLOCK, n_layer, 4, n_embd))


class MoEModel(nn.Module):
    """Embedding -> DeepSpeed MoE layer (2 experts, expert parallel 2) -> head: a char-level next-token model."""

    def __init__(self, hidden: int = MOE_HIDDEN, ep_size: int = 2, num_experts: int = 2):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.wte = nn.Embedding(VOCAB, hidden)
        self.wpe = nn.Embedding(BLOCK, hidden)
        expert = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
        # capacity_factor 2 + min_capacity: few tokens dropped, and a fixed capacity (padding) per expert.
        self.moe = MoE(
            hidden,
            expert,
            num_experts=num_experts,
            ep_size=ep_size,
            k=1,
            capacity_factor=2.0,
            min_capacity=8,
            use_rts=False,
        )
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, idx, targets):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        out, l_aux, _ = self.moe(h)
        logits = self.head(self.ln(h + out))
        return None, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1)) + 0.01 * l_aux


def ds_config(stage: int, dtype: str, fp8: dict | None = None, **zero) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **zero},
        "wall_clock_breakdown": False,
    }
    if stage == 3:  # gather every parameter through the hook (DeepSpeed keeps tiny ones resident otherwise)
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if fp8 is not None:
        cfg["fp8_comm"] = fp8
    return cfg


@dataclass
class Run:
    losses: list = field(default_factory=list)  # mean over ranks, per step
    skipped: int = 0
    engine: object = None
    stats: dict = field(default_factory=dict)


def build(cfg: dict, model_fn=tiny_gpt, seed: int = 0, init=None):
    """(engine, model): the same initial weights on every call with the same seed."""
    torch.manual_seed(seed)
    model = model_fn()
    params = model.parameters()
    if any(type(m).__name__ == "MoE" for m in model.modules()):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}
        )
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    engine, *_ = (init or fd.initialize)(model=model, optimizer=opt, config=cfg)
    return engine, model


def train(engine, steps: range, on_step=None) -> Run:
    run = Run(engine=engine)
    rank = dist.get_rank()
    for step in steps:
        x, y = batch(step, rank)
        _, loss = engine(x, y)
        engine.backward(loss)
        if on_step is not None:
            on_step(step)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        run.losses.append(mean.item() / dist.get_world_size())
    run.skipped = int(getattr(engine, "skipped_steps", 0))
    run.stats = fd.hook_stats(engine)
    return run


def destroy(engine) -> None:
    if hasattr(engine, "destroy"):
        engine.destroy()


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def rank_digests(digest: str) -> list[str]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest)
    return out


def full_params_digest(engine) -> str:
    """Digest of the parameters as forward sees them (ZeRO-3: FP8-gathered, captured inside a forward)."""
    if engine.zero_optimization_stage() < 3:
        return _digest(p for p in engine.module.parameters())
    seen = {}

    def grabber(name):
        def grab(m, _inp):
            for n, p in m.named_parameters(recurse=False):
                seen[f"{name}.{n}"] = p.detach().clone()

        return grab

    hooks = [m.register_forward_pre_hook(grabber(name)) for name, m in engine.module.named_modules()]
    try:
        with torch.no_grad():
            engine(*batch(0, 0))
    finally:
        for h in hooks:
            h.remove()
    return _digest(seen[k] for k in sorted(seen))


def rel_diff(a: list, b: list, last: int = 10) -> float:
    ma, mb = sum(a[-last:]) / last, sum(b[-last:]) / last
    return abs(ma - mb) / mb
