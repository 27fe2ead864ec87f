"""Hugging Face Trainer + DeepSpeed ZeRO-3 with FP8 communication from fp8comm's config section alone.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/hf_trainer_deepspeed.py --steps 30

A small Llama built from a LlamaConfig (no downloaded weights) learns the bytes of Python's own help texts on 2
CPU ranks (gloo); `--variants plain,fp8` trains the same run without and with the "fp8_comm" section, one after the
other in this one launch, and writes `report.json` (losses, fp8comm's counters, where each model was saved).

This script never imports fp8comm to train (only at exit, to release DeepSpeed's process groups): the installed
package's autoload hook (docs/deepspeed.md, "The flag alone") makes `deepspeed.initialize`, which accelerate calls
for the Trainer, honour the section. With the hook off (FP8COMM_AUTOLOAD=0) add `import fp8comm.integrations.deepspeed`
before the Trainer is built.

CPU notes: the Trainer refuses `bf16=True` without an accelerator ("Your setup doesn't support bf16/gpu"), so this
runs in fp32 (on GPUs use `bf16=True` and the config's "bf16" section). Without an accelerator, accelerate would start
a world of size 1; creating `PartialState(backend="gloo")` first, with ACCELERATE_USE_DEEPSPEED=true, and passing
`accelerator_config={"use_configured_state": True}` makes the Trainer use the 2-rank gloo world.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (gloo) when there is no GPU
os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")  # the PartialState below is then a DeepSpeed one

import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments, set_seed

SEQ = 64

# The one addition to a DeepSpeed config. "gemm" is stated explicitly: FP8 GEMMs (Fp8Linear) are off here, so only
# the ZeRO-3 weight all-gathers and gradient reduce-scatters move FP8.
FP8_COMM = {"enabled": True, "gemm": {"enabled": False}}


def ds_config(fp8: bool) -> dict:
    """HF's ZeRO-3 template ("auto": filled in from TrainingArguments), plus the fp8_comm section."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**6,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto",
            # save_model() writes one ordinary checkpoint gathered from the shards (without it: ZeRO shards only)
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    if fp8:
        cfg["fp8_comm"] = FP8_COMM
    return cfg


def model_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


class Bytes(torch.utils.data.Dataset):
    """Windows of SEQ bytes of Python's help texts (stdlib pydoc_data): a corpus that needs no download."""

    def __init__(self, n: int) -> None:
        from pydoc_data import topics

        text = "".join(topics.topics[k] for k in sorted(topics.topics)).encode()[:200_000]
        self.data = torch.tensor(list(text), dtype=torch.long)
        g = torch.Generator().manual_seed(1234)
        self.starts = torch.randint(len(self.data) - SEQ, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        x = self.data[self.starts[i] : self.starts[i] + SEQ]
        return {"input_ids": x, "labels": x.clone()}


def skip_cpu_shm_op_build() -> None:
    """DeepSpeed's CPU comm backend JIT-compiles a shared-memory op at start-up (60-100 s, needs a compiler) that
    only inference all-reduce uses; training on CPU does not need it."""
    import deepspeed  # noqa: F401

    mod = sys.modules["deepspeed.comm.torch"]
    if hasattr(mod, "build_shm_op"):
        mod.build_shm_op = lambda: None


def exact_weights_digest(model) -> list[float]:
    """Sum and sum of squares (float64) of every parameter's exact fp32 value, gathered from the ZeRO-3 shards
    (DeepSpeed's GatheredParameters: an exact gather, never fp8comm's FP8 one). Every rank must call it."""
    import deepspeed

    s = sq = 0.0
    for p in model.parameters():
        with deepspeed.zero.GatheredParameters([p]):
            t = p.detach().double()
            s += t.sum().item()
            sq += (t * t).sum().item()
    return [s, sq]


def train(variant: str, steps: int, out: Path, lr: float) -> dict:
    set_seed(0)
    args = TrainingArguments(
        output_dir=str(out / variant),
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,  # no accelerator: pinning only warns
        deepspeed=ds_config(fp8=variant == "fp8"),  # a dict: HF passes the fp8_comm key on to deepspeed.initialize
        accelerator_config={"use_configured_state": True},
    )
    # After TrainingArguments (which registers the ZeRO-3 config): built under DeepSpeed's zero.Init, sharded at once.
    model = AutoModelForCausalLM.from_config(model_config())
    trainer = Trainer(model=model, args=args, train_dataset=Bytes(steps * 4 * PartialState().num_processes))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    digest = exact_weights_digest(trainer.model_wrapped.module)
    trainer.save_model()  # rank 0 writes model.safetensors + config.json under output_dir

    # The autoload hook imported fp8comm's adapter when the config asked for it; read its counters without
    # importing fp8comm here (None: fp8comm had no part in this run).
    fd = sys.modules.get("fp8comm.integrations.deepspeed")
    engine = trainer.model_wrapped
    stats = fd.hook_stats(engine) if fd is not None and fd.engine_state(engine) is not None else None
    engine.destroy()
    AcceleratorState._reset_state(reset_partial_state=False)  # the next variant builds its own Accelerator
    return {"losses": losses, "stats": stats, "digest": digest, "saved": str(out / variant)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--variants", default="fp8", help="comma list of plain (no section) and fp8")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="runs/hf_trainer_deepspeed")
    a = ap.parse_args()

    state = PartialState(backend="gloo")  # the 2-rank world the Trainer will use (use_configured_state)
    if not torch.cuda.is_available():
        skip_cpu_shm_op_build()
    out = Path(a.out)
    report = {v: train(v, a.steps, out, a.lr) for v in a.variants.split(",")}
    if state.is_main_process:
        autoload = sys.modules.get("_fp8comm_autoload")
        report["autoload"] = None if autoload is None else dict(autoload.state)
        (out / "report.json").write_text(json.dumps(report, indent=1))
        for v, r in report.items():
            if v != "autoload":
                last = r["losses"][-10:]
                print(f"{v}: loss {r['losses'][0]:.4f} -> {sum(last) / len(last):.4f} (mean of the last 10 steps)")
    # Destroy the groups before exit, as torch asks: gloo threads left running into interpreter teardown can abort
    # it ("terminate called without an active exception", seen in CI here). DeepSpeed keeps its groups in module
    # globals that destroy_process_group() cannot free; fp8comm's adapter releases them (and fp8comm's own
    # references), so it is imported here for that, training done, even when no variant used the section.
    import fp8comm.integrations.deepspeed as fd

    fd.shutdown()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
