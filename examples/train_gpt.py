"""Train a small char-level GPT in BF16 and with FP8 recipes, several seeds each, and compare validation loss.

    python examples/train_gpt.py                                   # the default table (CPU, minutes per run)
    python examples/train_gpt.py --recipes bf16,blockwise --seeds 0 --steps 100   # a quick look

Corpus: pydoc_data.topics (Python's own help texts, ~465k characters; ships with Python). "bf16" is the baseline:
every nn.Linear in bfloat16 autocast. Every other name is an fp8comm recipe applied with convert_to_fp8 (the
output head, embeddings and norms stay high precision); the rest of the model runs under the same autocast.
`fp8_noscale` (a plain cast to FP8 with scale 1) is the negative control. Each (recipe, seed) pair sees the same
initial weights and the same batches, so differences come from the GEMM numerics alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import fp8comm.gemm as fg
from fp8comm.tools.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    block_size: int = 64
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_batches: int = 16
    threads: int = 1  # torch threads: 1 avoids OpenMP stalls on small, busy CPUs (0: torch default)
    quant_backend: str = "auto"  # fp8comm.quantize backend (auto: compiled on big CPU tensors, Triton on CUDA)
    device: str = "cpu"


def load_corpus() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(train ids, validation ids, vocabulary): the last 10% of the text is validation."""
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return data[:n], data[n:], vocab


def get_batch(data: torch.Tensor, cfg: TrainConfig, g: torch.Generator):
    ix = torch.randint(len(data) - cfg.block_size - 1, (cfg.batch_size,), generator=g)
    x = torch.stack([data[i : i + cfg.block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + cfg.block_size] for i in ix])
    return x.to(cfg.device), y.to(cfg.device)


@torch.no_grad()
def evaluate(model, val: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean loss over a fixed set of validation batches (the same for every run)."""
    model.eval()
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = get_batch(val, cfg, g)
        with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16):
            losses.append(model(x, y)[1].item())
    model.train()
    return sum(losses) / len(losses)


def train_one(
    recipe: str, seed: int, cfg: TrainConfig, corpus=None, telemetry: fg.Telemetry | None = None, log=print
) -> dict:
    """Train one model; returns {"recipe", "seed", "val_loss", "train_curve", "val_curve", "seconds"}."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    train, val, vocab = corpus or load_corpus()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(len(vocab), cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd)).to(cfg.device)
    if recipe != "bf16":
        report = fg.convert_to_fp8(model, recipe, quant_backend=cfg.quant_backend)
        if seed == 0:
            log(str(report))
        if telemetry is not None:
            telemetry.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(seed)
    train_curve, val_curve = [], []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        # linear warmup, then cosine decay to 10%
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = get_batch(train, cfg, g)
        with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if telemetry is not None:
            telemetry.step()
        train_curve.append(loss.item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            val_curve.append((step + 1, evaluate(model, val, cfg)))
            log(f"  {recipe:>12} seed {seed} step {step + 1:5d}  train {loss.item():.4f}  val {val_curve[-1][1]:.4f}")
    return dict(
        recipe=recipe,
        seed=seed,
        val_loss=val_curve[-1][1],
        train_curve=train_curve,
        val_curve=val_curve,
        seconds=time.perf_counter() - t0,
        params=model.num_params(),
    )


def table(results: list[dict], baseline: str = "bf16") -> str:
    """Markdown table: mean final val loss per recipe, relative difference to the baseline and its seed spread."""
    by = {}
    for r in results:
        by.setdefault(r["recipe"], []).append(r["val_loss"])
    base = by.get(baseline)
    bmean = statistics.mean(base) if base else float("nan")
    blo, bhi = (min(base), max(base)) if base else (float("nan"),) * 2
    lines = [
        f"| recipe | seeds | final val loss (mean) | per seed | rel. diff vs {baseline} | within {baseline} "
        "seed range |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in by.items():
        m = statistics.mean(v)
        rel = (m - bmean) / bmean if base else float("nan")
        within = "-" if name == baseline or not base else ("yes" if blo <= m <= bhi else "no")
        lines.append(
            f"| {name} | {len(v)} | {m:.4f} | {', '.join(f'{x:.4f}' for x in v)} | {rel * 100:+.2f}% | {within} |"
        )
    if base:
        lines.append(
            f"\n{baseline} seed spread (max - min): {bhi - blo:.4f} ({(bhi - blo) / bmean * 100:.2f}% of the mean)"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(dict.fromkeys(r["recipe"] for r in results))
    for i, name in enumerate(names):
        rs = [r for r in results if r["recipe"] == name]
        c = plt.get_cmap("tab10")(i)
        for j, r in enumerate(rs):
            w = 20  # moving average of the training loss
            tc = torch.tensor(r["train_curve"])
            sm = torch.nn.functional.avg_pool1d(tc.view(1, 1, -1), w, 1).view(-1) if len(tc) >= w else tc
            a1.plot(
                range(len(tc) - len(sm) + 1, len(tc) + 1), sm, color=c, lw=1, alpha=0.8, label=name if j == 0 else None
            )
            s, v = zip(*r["val_curve"])
            a2.plot(s, v, "o-", color=c, ms=3, lw=1, alpha=0.8, label=name if j == 0 else None)
    a1.set(title="training loss (20-step moving average)", xlabel="step", ylabel="loss")
    a2.set(title="validation loss", xlabel="step", ylabel="loss")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    top = max(max(r["val_curve"][0][1] for r in results), 1.0)
    a2.set_ylim(top=min(top * 1.1, 5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--recipes",
        default="bf16,fp8_amax,blockwise,fp8_noscale",
        help=f"comma list: bf16 and any of {', '.join(fg.RECIPES)}",
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="runs/train_gpt", help="folder for PNGs and results.json")
    p.add_argument("--telemetry", action="store_true", help="record scale telemetry of seed 0 (slower) and plot it")
    p.add_argument("--merge", default="", help="comma list of --out folders: print their combined table, no training")
    for f, v in asdict(TrainConfig()).items():
        p.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    args = p.parse_args(argv)
    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        if r != "bf16":
            fg.get_recipe(r)  # fail fast on a typo
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.out, exist_ok=True)
    if args.merge:  # runs split over several processes (one per recipe) come back together here
        results = []
        for d in args.merge.split(","):
            with open(os.path.join(d, "results.json")) as f:
                results += json.load(f)
        return report(results, args.out)
    corpus = load_corpus()
    print(f"corpus: {len(corpus[0]) + len(corpus[1])} characters, vocab {len(corpus[2])}; config {cfg}")
    results = []
    for name in recipes:
        for seed in seeds:
            tel = fg.Telemetry(interval=10) if args.telemetry and seed == seeds[0] and name != "bf16" else None
            r = train_one(name, seed, cfg, corpus, telemetry=tel)
            print(f"{name} seed {seed}: val {r['val_loss']:.4f} ({r['seconds']:.0f} s, {r['params']} params)")
            results.append(r)
            with open(os.path.join(args.out, "results.json"), "w") as f:  # after every run: partial results count
                json.dump(results, f)
            if tel is not None:
                tel.plot(os.path.join(args.out, f"scales_{name}.png"), f"{name}: scale bias per layer")
                tel.to_jsonl(os.path.join(args.out, f"telemetry_{name}.jsonl"))
    return report(results, args.out)


def report(results: list[dict], out: str) -> int:
    print()
    print(table(results))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f)
    try:
        plot(results, os.path.join(out, "loss_curves.png"))
        print(f"\nwrote {out}/loss_curves.png and results.json")
    except ImportError as e:  # a bare GPU image may lack matplotlib: the table and JSON still count
        print(f"\nno plot ({e}); wrote {out}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
