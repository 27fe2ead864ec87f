"""Train a small GPT with PyTorch FSDP2 (fully_shard per block, torchtitan style) and fp8comm's FP8 collectives.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --steps 30            # FSDP2 + fp8comm (FP8 comm)
    torchrun --nproc-per-node 2 examples/fsdp2_train.py --plain               # plain FSDP2, for comparison
    torchrun --nproc-per-node 2 examples/fsdp2_train.py --bench --steps 20    # both in one run, side by side

--bench trains plain FSDP2 and then FSDP2 + enable() from the same initial weights on the same batches and
prints median step time, final loss and their ratio, and bytes per step sent by this rank for weights and
gradients (fp8comm's FP8 bytes vs FSDP2's own for the same calls); --json writes it on rank 0. Mixed precision
is FSDP2's MixedPrecisionPolicy (bf16 params, fp32 gradient reduction) unless --mp none. --fp8-gemm converts the
blocks' linears to Fp8Linear (convert_to_fp8) before sharding. Corpus: pydoc_data.topics, character level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import fp8comm
from fp8comm.tools.gpt import GPT, GPTConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--seq", type=int, default=64, help="context length")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (no gradient sync until the last)")
    p.add_argument("--mp", choices=("bf16", "none"), default="bf16", help="bf16: param_dtype bf16, reduce_dtype fp32")
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    p.add_argument("--replicate", type=int, default=1, help="HSDP: replicate degree (2-D mesh replicate x shard)")
    p.add_argument("--fp8-gemm", action="store_true", help="convert_to_fp8(blocks, 'blockwise') before sharding")
    p.add_argument("--grad-fmt", default="e4m3", choices=("e4m3", "e5m2"))
    p.add_argument("--scaling", default="fp32", choices=("fp32", "pow2", "e8m0"))
    p.add_argument("--plain", action="store_true", help="plain FSDP2 only (no fp8comm hooks)")
    p.add_argument("--bench", action="store_true", help="plain FSDP2, then FSDP2 + fp8comm, same weights and data")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step-time median")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default)")
    return p.parse_args(argv)


def load_corpus() -> tuple[torch.Tensor, int]:
    """(token ids, vocabulary size) of Python's own help texts, character level."""
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(vocab)


def batch(data: torch.Tensor, args, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch: the same for every run with the same seed (plain and FP8 see identical data)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + micro * 101 + rank)
    ix = torch.randint(len(data) - args.seq - 1, (args.batch_size,), generator=g)
    x = torch.stack([data[i : i + args.seq] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + args.seq] for i in ix])
    return x, y


def build(args, vocab: int, mesh) -> GPT:
    """The GPT with every block fully_shard-ed, then the root (embeddings, final norm, tied head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(args.seed)
    model = GPT(
        GPTConfig(vocab_size=vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    )
    if args.fp8_gemm:
        import fp8comm

        fp8comm.convert_to_fp8(model.h, "blockwise")
        # Under FSDP2 a cached FP8 weight can go stale (docs/fsdp2.md): the plain run needs this too.
        fp8comm.gemm.set_weight_cache(model, "gathered")
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.mp == "bf16"
        else MixedPrecisionPolicy()
    )
    kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=not args.no_reshard)
    for block in model.h:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def make_mesh(args):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if args.replicate > 1:
        if world % args.replicate:
            raise SystemExit(f"--replicate {args.replicate} does not divide the world size {world}")
        return init_device_mesh("cpu", (args.replicate, world // args.replicate), mesh_dim_names=("dp_rep", "dp_shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))


def train(
    args, data: torch.Tensor, vocab: int, mesh, fp8: bool, on_step=None, on_model=None, enable_options=None
) -> dict:
    """Train args.steps steps; returns losses (mean over ranks), step times and, with fp8, the hook counters.

    on_model(model) runs once before training, on_step(step, model, loss) after every optimizer step (the tests
    check replicas there); enable_options replace the command line's for enable()."""
    import fp8comm.integrations.fsdp2 as f2

    model = build(args, vocab, mesh)
    report = (
        f2.enable(
            model,
            **(
                enable_options
                or {"gradients": {"fmt": args.grad_fmt, "scaling": args.scaling}, "weights": {"scaling": args.scaling}}
            ),
        )
        if fp8
        else None
    )
    if on_model is not None:
        on_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rank = dist.get_rank()
    f2.reset_hook_stats()
    losses, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = torch.zeros(())
        for micro in range(args.grad_accum):
            last = micro == args.grad_accum - 1
            model.set_requires_gradient_sync(last)
            x, y = batch(data, args, step, micro, rank)
            _, loss = model(x, y)
            (loss / args.grad_accum).backward()
            total += loss.detach() / args.grad_accum
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        times.append(time.perf_counter() - t0)
        losses.append(float(total) / dist.get_world_size())
        if on_step is not None:
            on_step(step, model, losses[-1])
    out = {"losses": losses, "step_s": times, "stats": f2.hook_stats(), "model": model}
    if report is not None:
        out["report"] = str(report)
        f2.disable(model)
    return out


def summarize(args, plain: dict | None, fp8: dict | None) -> dict:
    """One comparable record: step time (median after warmup), final loss, bytes per step, ratios."""
    res = {
        "world": dist.get_world_size(),
        "steps": args.steps,
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
    }
    for name, r in (("plain", plain), ("fp8", fp8)):
        if r is None:
            continue
        t = r["step_s"][args.warmup :] or r["step_s"]
        res[name] = {"final_loss": r["losses"][-1], "median_step_s": statistics.median(t), "losses": r["losses"]}
    if fp8 is not None:
        for d, s in fp8["stats"].items():
            res["fp8"][f"{d}_bytes_per_step"] = (s["wire_bytes"] + s["check_bytes"]) / args.steps
            res["fp8"][f"{d}_fsdp2_bytes_per_step"] = s["baseline_bytes"] / args.steps
            res["fp8"][f"{d}_ratio"] = s["ratio"]
            res["fp8"][f"{d}_passthrough_calls"] = s["passthrough_calls"]
    if plain is not None and fp8 is not None:
        res["loss_rel_diff"] = abs(fp8["losses"][-1] - plain["losses"][-1]) / plain["losses"][-1]
        res["step_time_ratio"] = res["fp8"]["median_step_s"] / res["plain"]["median_step_s"]
    return res


def print_table(res: dict) -> None:
    rows = [f"FSDP2 GPT, {res['world']} ranks, {res['steps']} steps (torch {torch.__version__}, gloo)"]
    for name in ("plain", "fp8"):
        if name in res:
            r = res[name]
            ms = r["median_step_s"] * 1e3
            rows.append(f"  {name:<6} final loss {r['final_loss']:.4f}   median step {ms:8.1f} ms")
    for d in ("weights", "gradients"):
        if f"{d}_ratio" in res.get("fp8", {}):
            r = res["fp8"]
            rows.append(
                f"  {d:<9} bytes/step/rank: FSDP2 {r[f'{d}_fsdp2_bytes_per_step'] / 1e6:9.3f} MB   fp8comm "
                f"{r[f'{d}_bytes_per_step'] / 1e6:9.3f} MB   {r[f'{d}_ratio']:.3f}x fewer"
            )
    if "loss_rel_diff" in res:
        rows.append(
            f"  final loss relative difference {res['loss_rel_diff'] * 100:.3f}%, step time fp8/plain "
            f"{res['step_time_ratio']:.3f}"
        )
    print("\n".join(rows), flush=True)


def run(args) -> None:
    data, vocab = load_corpus()
    mesh = make_mesh(args)
    plain = train(args, data, vocab, mesh, fp8=False) if (args.plain or args.bench) else None
    fp8 = train(args, data, vocab, mesh, fp8=True) if not args.plain else None
    res = summarize(args, plain, fp8)
    if dist.get_rank() == 0:
        if fp8 is not None:
            print(fp8["report"], flush=True)
        print_table(res)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        run(args)  # the mesh and models live in run(): gone before the groups are destroyed
    finally:
        fp8comm.shutdown()  # what fp8comm (and torch's DTensor caches) hold on the groups goes before them
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
