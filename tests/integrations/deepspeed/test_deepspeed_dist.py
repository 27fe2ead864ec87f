"""Real DeepSpeed (CPU accelerator, gloo, 2 ranks) with fp8_comm on: one torchrun launch per scenario.

zero:   ZeRO-1/2/3 x bf16/fp32 parity over 30 steps, identical parameters across ranks, FP8 bytes and ratio; the
        flag through plain deepspeed.initialize and its uninstall; hpZ; measure mode; the qgZ path replaced; fp32
        accumulation of the ZeRO-1 and ZeRO-2 reduction, bit for bit; error feedback (summed-gradient SQNR); engines
        with different or no sections in one process, each getting exactly its own.
safety: an inf in one rank's gradient skips the step exactly as without fp8comm (with error feedback: residuals
        zeroed); checkpoint save/load resumes bit for bit (residuals and guard state included); the numerics guard
        falls a starved bucket back to BF16 on every rank at the same step; FP8 GEMMs keep ZeRO-3's memory promise.
moe:    deepspeed.moe with expert parallelism 2: one step's loss and per-parameter gradients of each MoE wire against
        the native one (bf16 combine bit-identical); FP8 dispatch, FP8 vs BF16 combine, FP8 backward, loss parity.

The broken variants each check must catch: ds_mutations.py (a script, not a test).
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (pip install deepspeed==0.19.8 torch==2.13.0)")

from ds_harness import failures, launch, summary

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("scenario", ["zero", "safety", "moe"])
def test_scenario(scenario, tmp_path):
    run = launch(scenario, tmp_path / scenario, timeout=600)  # catches hangs only; ~270 s of checks under load
    print(f"\n{scenario}:\n{summary(run)}")
    problems = failures(run)
    assert not problems, "\n".join(problems)
    assert run["results"][0], "no results written"
