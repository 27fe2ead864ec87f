"""torchtitan's llama3 debugmodel, sharded by torchtitan's own FSDP2 code, with fp8comm's FP8 collectives (CPU, gloo).

    torchrun --nproc-per-node 2 examples/torchtitan_fsdp2.py --steps 20                # torchtitan FSDP2 + fp8comm
    torchrun --nproc-per-node 2 examples/torchtitan_fsdp2.py --plain                   # torchtitan FSDP2 alone
    torchrun --nproc-per-node 2 examples/torchtitan_fsdp2.py --bench --json out.json   # both: same weights, data

The model (torchtitan 0.3.0 `llama3` "debugmodel"), its sharding (`parallelize_llama` -> `apply_fsdp_to_decoder`:
fully_shard per block, ONE call for [norm, lm_head], the root), its initialization and its loss are torchtitan's,
built in the order torchtitan's Trainer uses: model on the meta device -> parallelize -> to_empty -> init_weights.
fp8comm adds one line after that: `fp8comm.integrations.fsdp2.enable(model)`.

torchtitan targets GPUs; on CPU this script changes four things, each marked "CPU:" where it happens:
  1. device type "cpu" (torchtitan picks "cuda" when it sees no accelerator; no setting exists: a visible patch),
  2. ScaledDotProductAttention instead of FlexAttention (no backward on CPU; a model-config change),
  3. spmd_backend="partial_dtensor" (the default "spmd_types" fails inside fully_shard; a config value),
  4. plain FSDP2 only: set_force_sum_reduction_for_comms(True), since torchtitan's gradient divide factor of 1.0
     makes FSDP2 reduce with PREMUL_SUM, which gloo refuses (same math; fp8comm's hook handles PREMUL_SUM itself).
Data: Python's own help texts as bytes (token ids < 256 of the 2048-entry vocabulary), the same batches for every
run with the same seed. Optimizer: AdamW with torchtitan's defaults, gradient clipping at 1.0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import fp8comm


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flavor", default="debugmodel", help="a torchtitan llama3 flavor")
    p.add_argument("--plain", action="store_true", help="torchtitan's FSDP2 only (no fp8comm)")
    p.add_argument("--bench", action="store_true", help="plain, then fp8comm, from the same weights on the same data")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default)")
    return p.parse_args(argv)


def use_cpu() -> None:
    """CPU: torchtitan.tools.utils sets device_type = "cuda" at import when no accelerator is visible, and
    ParallelDims builds its meshes from that name; torchtitan has no setting for it, so set both names here."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu
    parallel_dims.device_type = "cpu"


def model_config(args):
    """torchtitan's llama3 config for args.flavor, with the CPU attention and a RoPE table of args.seq."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry(args.flavor).model
    for layer in cfg.layers:
        # CPU: FlexAttention has no backward on CPU; SDPA is causal, as FlexAttention's mask is for these
        # batches (each a single document, no position ids).
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        # What torchtitan's Trainer does with training.seq_len (update_from_config): a RoPE table of that length.
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=args.seq)
    return cfg


def build(args, fp8: bool, enable_options: dict | None = None):
    """(model, enable() report or None): torchtitan's llama3 through parallelize_llama, then fp8comm or not."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    import fp8comm.integrations.fsdp2 as fp8_fsdp2

    # CPU: "spmd_types" (torchtitan's default) fails in fully_shard ("all parameters must be DTensors on the
    # full SPMD mesh"); "partial_dtensor" is torchtitan's DTensor-for-model-parallel-only backend.
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=args.batch_size, seq_len=args.seq)  # bf16 params, fp32 reduce
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    with torch.device("meta"):
        model = model_config(args).build()
    with tempfile.TemporaryDirectory() as dump:
        parallelize_llama(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder=dump,
        )
    model.to_empty(device="cpu")
    torch.manual_seed(args.seed)  # every run starts from the same weights
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if fp8:
        return model, fp8_fsdp2.enable(model, **(enable_options or {}))
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            # CPU: torchtitan sets the gradient divide factor to 1.0, so FSDP2 reduces with PREMUL_SUM, which
            # gloo refuses; force-sum reduces with SUM and divides by the same factor (1.0): the same math.
            m.set_force_sum_reduction_for_comms(True)
    return model, None


def load_tokens() -> torch.Tensor:
    from pydoc_data import topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batch(data: torch.Tensor, args, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    ix = torch.randint(len(data) - args.seq - 1, (args.batch_size,), generator=g)
    x = torch.stack([data[i : i + args.seq] for i in ix])
    return x, torch.stack([data[i + 1 : i + 1 + args.seq] for i in ix])


def train(args, data: torch.Tensor, fp8: bool, enable_options: dict | None = None, on_model=None) -> dict:
    """args.steps steps of torchtitan's loss (token sum / global tokens: FSDP2 sums the gradients, divide factor
    1.0), AdamW and clipping; losses are global means. Returns losses, step times, the model and fp8comm's
    report and hook counters (fp8). on_model(model) runs before the first step."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig

    import fp8comm.integrations.fsdp2 as fp8_fsdp2

    model, report = build(args, fp8, enable_options)
    if on_model is not None:
        on_model(model)
    loss_fn = CrossEntropyLoss.Config().build(compile_config=CompileConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    global_tokens = torch.tensor(float(args.batch_size * args.seq * world))
    fp8_fsdp2.reset_hook_stats()
    losses, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = batch(data, args, step, rank)
        loss, _ = loss_fn(model(x), y, global_valid_tokens=global_tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        times.append(time.perf_counter() - t0)
        losses.append(float(total))
    return {
        "losses": losses,
        "step_s": times,
        "model": model,
        "report": str(report) if report is not None else None,
        "stats": fp8_fsdp2.hook_stats(),
    }


def summarize(args, plain: dict | None, fp8: dict | None) -> dict:
    res: dict = {"world": dist.get_world_size(), "steps": args.steps, "flavor": args.flavor}
    for name, r in (("plain", plain), ("fp8", fp8)):
        if r is not None:
            res[name] = {
                "losses": r["losses"],
                "final_loss": r["losses"][-1],
                "median_step_s": statistics.median(r["step_s"][1:] or r["step_s"]),
            }
    if fp8 is not None:
        res["fp8"]["report"] = fp8["report"]
        for d, s in fp8["stats"].items():
            res["fp8"][f"{d}_ratio"] = s["ratio"]
            res["fp8"][f"{d}_fp8_calls"] = s["fp8_calls"]
            res["fp8"][f"{d}_passthrough_calls"] = s["passthrough_calls"]
    if plain is not None and fp8 is not None:
        res["final_loss_rel_diff"] = (fp8["losses"][-1] - plain["losses"][-1]) / plain["losses"][-1]
    return res


def main(argv=None) -> dict:
    """Run as the command line says; returns summarize()'s record (every rank). Starts (and ends) a gloo process
    group unless the caller has one."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cpu()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    try:
        data = load_tokens()
        plain = train(args, data, fp8=False) if (args.plain or args.bench) else None
        fp8 = train(args, data, fp8=True) if not args.plain else None
        res = summarize(args, plain, fp8)
        if dist.get_rank() == 0:
            if fp8 is not None:
                print(fp8["report"])
            for name in ("plain", "fp8"):
                if name in res:
                    r = res[name]
                    print(f"{name:<6} final loss {r['final_loss']:.4f}, median step {r['median_step_s'] * 1e3:.0f} ms")
            for d in ("weights", "gradients"):
                if f"{d}_ratio" in res.get("fp8", {}):
                    print(f"{d:<9} {res['fp8'][f'{d}_ratio']:.3f}x fewer bytes than torchtitan's FSDP2")
            if "final_loss_rel_diff" in res:
                print(f"final loss, fp8 vs plain: {res['final_loss_rel_diff'] * 100:+.2f}%")
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(res, fh, indent=1)
        return res
    finally:
        if own_group:
            plain = fp8 = None  # their models (FSDP2 state: reference cycles) hold the mesh; shutdown() collects them
            fp8comm.shutdown()  # what fp8comm holds on the groups goes before them
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
