"""A very small version of examples/train_gpt.py: FP8 recipes track BF16, the unscaled cast does not.

The full 3-seed table (bigger model, more steps) is produced by the example and recorded in docs/benchmarks.md.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train_gpt

CFG = train_gpt.TrainConfig(
    steps=80,
    batch_size=16,
    block_size=32,
    n_layer=2,
    n_head=2,
    n_embd=64,
    lr=3e-3,
    warmup=10,
    eval_every=80,
    eval_batches=4,
    threads=1,
    quant_backend="reference",
)


@pytest.fixture(scope="module")
def losses():
    threads = torch.get_num_threads()
    corpus = train_gpt.load_corpus()
    try:
        return {
            r: train_gpt.train_one(r, 0, CFG, corpus, log=lambda *a: None)["val_loss"]
            for r in ("bf16", "blockwise", "fp8_noscale")
        }  # fp8_amax: in the example's table
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # trains the tiny GPT once per recipe: ~20 s
def test_fp8_recipes_track_bf16(losses):
    # measured (2 layers, 80 steps): bf16 2.716, blockwise 2.747 (+1.1%), fp8_noscale 2.908 (+7.1%)
    assert abs(losses["blockwise"] - losses["bf16"]) / losses["bf16"] < 0.03, losses


def test_negative_control_is_visibly_worse(losses):
    assert losses["fp8_noscale"] > losses["bf16"] * 1.05, losses
    assert losses["fp8_noscale"] > losses["blockwise"] * 1.03, losses


def test_table_reports_relative_difference():
    res = [dict(recipe="bf16", val_loss=2.0), dict(recipe="bf16", val_loss=2.2), dict(recipe="x", val_loss=2.1)]
    t = train_gpt.table(res)
    assert "| x | 1 | 2.1000 | 2.1000 | +0.00% | yes |" in t
    assert "seed spread (max - min): 0.2000" in t
