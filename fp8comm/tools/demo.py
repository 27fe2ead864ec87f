"""`fp8comm demo`: a real DeepSpeed ZeRO-3 training run, BF16 communication vs FP8 GEMMs + FP8 communication.

torchrun starts `--ranks` processes: on a CUDA machine one per GPU (NCCL, FP8 GEMMs on the tensor cores), else
CPU processes (gloo, DeepSpeed's CPU accelerator; `--device cpu` forces that). Each run trains the tiny GPT of
fp8comm.tools.gpt on Python's own help texts (pydoc_data, ships with Python) from the same initial weights on the
same batches:

  baseline  ZeRO-3, bf16, DeepSpeed's own collectives. fp8comm runs in "measure" mode: its hooks count the bytes
            DeepSpeed sends and change nothing.
  fp8       the same config plus "fp8_comm": FP8 weight all-gathers and gradient reduce-scatters (1x128 block
            scales) and FP8 GEMMs (convert_to_fp8 with --recipe).

At the end: final loss of both and their relative difference, bytes on the wire per step (weights, gradients)
and their ratio, step time; loss-curve PNGs and report.json in the run folder. Step times on CPU are NOT
representative of GPUs: FP8 GEMMs run as an exact emulation here, and bytes, not time, are what this shows.

Needs the 'tools' extra (rich, matplotlib) and DeepSpeed; everything it runs is imported from the installed
package (the workers start as `python -m fp8comm.tools.demo --worker ...`), so it works from a wheel as from a
source checkout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = {  # n_layer, n_head, n_embd, block, micro-batch per rank
    "tiny": (2, 4, 64, 64, 8),
    "small": (4, 4, 128, 64, 16),
    "medium": (6, 6, 192, 128, 16),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = (__doc__ or "").strip().splitlines()[0]
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default 150)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): one rank per GPU on NCCL when CUDA is available, else CPU ranks on gloo",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="torchrun processes (default: 2 on CPU, every GPU on CUDA; NCCL takes at most one per GPU)",
    )
    p.add_argument(
        "--size",
        choices=list(SIZES),
        default="tiny",
        help="model size: "
        + ", ".join(f"{k} ({v[0]} layers x {v[2]})" for k, v in SIZES.items())
        + " (default tiny: both runs finish in ~3 minutes on 2 cores)",
    )
    p.add_argument(
        "--recipe",
        default="blockwise",
        help="FP8 GEMM recipe for the fp8 run, or 'none' for FP8 communication only (default blockwise)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/deepspeed_demo", help="parent folder of the run folder")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the launch is stopped")


# ------------------------------------------------------------------------------------------------- launcher
def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=max(Console().width, 110))
    args.device = _device(args.device)
    if args.ranks is None:
        args.ranks = _cuda_count() if args.device == "cuda" else 2
    problem = _preflight(args)
    if problem:
        console.print(f"[red]fp8comm demo: {problem}[/red]")
        return 2
    folder = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    cmd, env = launch_command(args, folder)
    where = f"{args.ranks} GPU rank(s) (NCCL)" if args.device == "cuda" else f"{args.ranks} CPU ranks (gloo)"
    console.print(
        f"[bold]fp8comm demo[/bold]: DeepSpeed ZeRO-3 on {where}, tiny GPT ({args.size}), "
        f"{args.steps} steps x 2 runs; log: {folder / 'log.txt'}"
    )
    log = open(folder / "log.txt", "w")
    progress = folder / "progress.jsonl"
    # Ranks share torchrun's stdout and their lines interleave, so rank 0 reports progress through its own file.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    tasks, seen = {}, 0
    try:
        with Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
            tasks["setup"] = bar.add_task("start-up", total=None, loss="-")
            while True:
                done = proc.poll() is not None
                text = progress.read_text() if progress.exists() else ""
                complete = text[: text.rfind("\n") + 1]
                for line in complete[seen:].splitlines():
                    ev = json.loads(line)
                    if "setup" in tasks:
                        bar.remove_task(tasks.pop("setup"))
                    if ev["run"] not in tasks:
                        tasks[ev["run"]] = bar.add_task(ev["run"], total=ev["steps"], loss="-")
                    bar.update(tasks[ev["run"]], completed=ev["step"], loss=f"{ev['loss']:.4f}")
                seen = len(complete)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the demo ran past --timeout {args.timeout:.0f} s")
                time.sleep(0.25)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # torchrun and its workers: the session started above
        raise
    finally:
        log.close()
    rc = proc.wait()
    report_path = folder / "report.json"
    if rc != 0 or not report_path.exists():
        tail = (folder / "log.txt").read_text()[-3000:]
        console.print(f"[red]the training launch failed (exit {rc}); end of {folder / 'log.txt'}:[/red]\n{tail}")
        return 1
    report = json.loads(report_path.read_text())
    _plots(report, folder)
    console.print(_table(report))
    console.print(report["fp8"]["summary"])
    console.print(f"run folder: {folder} (report.json, loss_curves.png, loss_diff.png, log.txt)")
    return 0


def launch_command(args: argparse.Namespace, folder: Path) -> tuple[list[str], dict]:
    """torchrun's command line and environment. The workers run this module by name (`-m`) with this
    interpreter: whatever installed fp8comm here (a wheel, an editable checkout) serves them too; no paths."""
    threads = max(1, (os.cpu_count() or 2) // args.ranks)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        "-m",
        "fp8comm.tools.demo",
        "--worker",
        json.dumps({**vars(args), "folder": str(folder)}),
    ]
    return cmd, env


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(choice: str) -> str:
    return ("cuda" if _cuda_count() else "cpu") if choice == "auto" else choice


def _preflight(args) -> str | None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return (
            "DeepSpeed is not installed: pip install 'fp8comm[deepspeed]' (deepspeed==0.19.8; keep your torch "
            "pin, e.g. torch==2.13.0 on CPU)"
        )
    if args.device == "cuda":
        n = _cuda_count()
        if not n:
            return "--device cuda, but torch sees no CUDA device"
        if not 1 <= args.ranks <= n:
            return f"--ranks {args.ranks} on {n} GPU(s): NCCL takes one rank per GPU (1..{n})"
    elif args.ranks < 2:
        return "--ranks must be >= 2 on CPU (one rank has nothing to communicate)"
    if args.recipe != "none":
        from fp8comm.gemm import RECIPES

        if args.recipe not in RECIPES:
            return f"unknown recipe {args.recipe!r}; valid: none, {', '.join(RECIPES)}"
    return None


def _table(report: dict):
    from rich.table import Table

    b, f = report["baseline"], report["fp8"]
    t = Table(
        title=f"DeepSpeed ZeRO-3, {report['ranks']} ranks, {report['steps']} steps: BF16 communication vs "
        f"FP8 GEMMs ({report['recipe']}) + FP8 communication"
    )
    t.add_column("")
    t.add_column("baseline (bf16)", justify="right")
    t.add_column("fp8", justify="right")
    t.add_column("fp8 vs baseline", justify="right")
    for key, label in (("final_train_loss", "final train loss (mean of last 10)"), ("val_loss", "validation loss")):
        rel = (f[key] - b[key]) / b[key]
        t.add_row(label, f"{b[key]:.4f}", f"{f[key]:.4f}", f"{rel * 100:+.2f}%")
    for role in ("weights", "gradients"):
        bb, fb = b["bytes_per_step"].get(role, 0), f["bytes_per_step"].get(role, 0)
        t.add_row(f"{role} bytes on the wire / step / rank", _mb(bb), _mb(fb), f"{bb / fb:.2f}x fewer" if fb else "-")
    how = "FP8 GEMMs on the tensor cores" if report.get("device") == "cuda" else "FP8 GEMMs emulated on CPU"
    t.add_row(
        f"step time (median; {how})",
        f"{b['step_s'] * 1e3:.0f} ms",
        f"{f['step_s'] * 1e3:.0f} ms",
        f"{f['step_s'] / b['step_s']:.2f}x the time",
    )
    return t


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _plots(report: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, f = report["baseline"]["losses"], report["fp8"]["losses"]
    w = max(1, min(10, len(b) // 10))

    def smooth(x):
        return [sum(x[max(0, i - w + 1) : i + 1]) / len(x[max(0, i - w + 1) : i + 1]) for i in range(len(x))]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, len(b) + 1), smooth(b), label="baseline: bf16 GEMMs + bf16 communication")
    ax.plot(range(1, len(f) + 1), smooth(f), label=f"fp8: {report['recipe']} GEMMs + FP8 communication")
    ax.set(
        title=f"DeepSpeed ZeRO-3, {report['ranks']} ranks: training loss ({w}-step moving average)",
        xlabel="step",
        ylabel="loss",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "loss_curves.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    d = [(y - x) / x * 100 for x, y in zip(smooth(b), smooth(f))]
    ax.plot(range(1, len(d) + 1), d)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(title="fp8 vs baseline: relative difference of the smoothed training loss", xlabel="step", ylabel="%")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "loss_diff.png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- worker
def _worker(opts: dict) -> int:
    on_cuda = opts.get("device") == "cuda"
    if not on_cuda:
        from fp8comm.integrations.deepspeed import cpu

        cpu.prepare()
    import deepspeed
    import torch
    import torch.distributed as dist

    import fp8comm.integrations.deepspeed as fd
    from fp8comm.tools.gpt import GPT, GPTConfig

    if on_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    deepspeed.init_distributed("nccl" if on_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    n_layer, n_head, n_embd, block, micro = SIZES[opts["size"]]
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]

    def batch(src, step, r):
        g = torch.Generator().manual_seed(1_000_003 * step + r)
        ix = torch.randint(len(src) - block - 1, (micro,), generator=g)
        return (
            torch.stack([src[i : i + block] for i in ix]).to(dev),
            torch.stack([src[i + 1 : i + 1 + block] for i in ix]).to(dev),
        )

    steps, lr = opts["steps"], opts["lr"]
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    recipe = opts["recipe"]
    runs = {
        "baseline": {"mode": "measure", "gemm": False},
        # FP8 GEMMs are opt-in in the section: the demo asks for them explicitly (its claim is GEMMs + communication)
        "fp8": {"gemm": {"enabled": True, "recipe": recipe} if recipe != "none" else False},
    }
    report = {
        "ranks": world,
        "steps": steps,
        "recipe": recipe,
        "size": opts["size"],
        "device": dev.type,
        "model": {
            "n_layer": n_layer,
            "n_head": n_head,
            "n_embd": n_embd,
            "block": block,
            "micro_batch": micro,
            "vocab": len(vocab),
        },
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
    }
    for name, section in runs.items():
        torch.manual_seed(opts["seed"])
        model = GPT(GPTConfig(len(vocab), block, n_layer, n_head, n_embd))
        params = model.num_params()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        engine, *_ = fd.initialize(model=model, optimizer=opt, config={**ds, "fp8_comm": section})
        fd.reset_hook_stats()
        losses, times = [], []
        for step in range(steps):
            for g in opt.param_groups:  # linear warmup, cosine decay to 10% (as examples/train_gpt.py)
                g["lr"] = (
                    lr
                    * min(1.0, (step + 1) / max(1, steps // 10))
                    * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
                )
            t0 = time.perf_counter()
            x, y = batch(train, step, rank)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if on_cuda:
                torch.cuda.synchronize()  # step time includes the GPU work
            times.append(time.perf_counter() - t0)
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if rank == 0:
                with open(Path(opts["folder"]) / "progress.jsonl", "a") as pf:
                    pf.write(json.dumps({"run": name, "step": step + 1, "steps": steps, "loss": losses[-1]}) + "\n")
        stats = fd.hook_stats()
        engine.eval()
        with torch.no_grad():
            vl = torch.tensor([engine(*batch(val, 10**6 + i, rank))[1].float().item() for i in range(8)]).mean()
        vl = vl.to(loss.device)  # NCCL reduces device tensors only
        dist.all_reduce(vl)
        report[name] = {
            "losses": losses,
            "final_train_loss": sum(losses[-10:]) / min(10, len(losses)),
            "val_loss": vl.item() / world,
            "step_s": statistics.median(times[len(times) // 5 :]),
            "bytes_per_step": {k: v["wire_bytes"] / steps for k, v in stats.items() if k != "hooks"},
            "hook_stats": stats,
            "summary": fd.summary(),
            "params": params,
        }
        if hasattr(engine, "destroy"):
            engine.destroy()
        fd.uninstall()
        # Drop this run's engine: it holds DeepSpeed's groups, and so do the last loss and logits (their autograd
        # graph reaches the ZeRO-3 module and its hooks); fd.shutdown() warns about an engine still alive.
        del engine, _, opt, model, loss, x, y
    if rank == 0:
        (Path(opts["folder"]) / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    fd.shutdown()  # fp8comm's and DeepSpeed's own references to the groups (fp8comm.shutdown() included) go first
    dist.destroy_process_group()  # in order, before interpreter teardown destroys gloo's threads at random
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker(json.loads(sys.argv[2])))
    from fp8comm.tools.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))  # the same checks (the tools extra) as `fp8comm demo`
