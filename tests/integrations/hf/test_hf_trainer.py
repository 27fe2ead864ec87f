"""examples/hf_trainer_deepspeed.py as shipped: transformers.Trainer + DeepSpeed ZeRO-3, 2 CPU ranks (gloo), fp32.

One torchrun launch trains the example's small Llama twice (without the "fp8_comm" section, then with it) for 30
steps; the example never imports fp8comm, so the section is honoured only through the installed autoload hook
(fp8comm-autoload.pth, see tests/integrations/deepspeed/test_autoload.py). Then a fresh process reloads what
`trainer.save_model()` wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (pip install deepspeed==0.19.8 torch==2.13.0)")
pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[hf])")
pytest.importorskip("accelerate", reason="accelerate not installed (pip install -e .[hf])")

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "hf_trainer_deepspeed.py"
STEPS = 30
TOL = 0.02  # the mean of the last 10 losses, relative to the run without the section

RELOAD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
out = {}
for d in sys.argv[1:]:
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    s = sq = 0.0
    for p in m.parameters():
        t = p.detach().double()
        s += t.sum().item()
        sq += (t * t).sum().item()
    x = torch.arange(64).remainder(256).unsqueeze(0)
    loss = m(input_ids=x, labels=x).loss.item()
    out[d] = {"digest": [s, sq], "finite_loss": loss == loss and abs(loss) != float("inf"),
              "n_params": sum(p.numel() for p in m.parameters())}
print("RESULT " + json.dumps(out))
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FP8COMM_AUTOLOAD"}  # the hook must be on
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", ACCELERATE_USE_DEEPSPEED="true")
    return env


def _mean_last(losses: list[float], n: int = 10) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


@pytest.mark.timeout(1500)  # two trainings + a reload: start-up dominates, and the 2-core CI machine is shared
def test_hf_trainer_zero3_with_the_section_alone(tmp_path):
    probe = "import sys; h = sys.modules.get('_fp8comm_autoload'); print(bool(h and h.state['finder']))"
    on = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, cwd=tmp_path)
    assert on.stdout.strip() == "True", (
        "fp8comm's autoload hook is not active in this interpreter (the example relies on it): reinstall the "
        f"package (pip install -e .) so that fp8comm-autoload.pth is in site-packages\n{on.stdout}{on.stderr}"
    )
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(EXAMPLE),
        "--steps",
        str(STEPS),
        "--variants",
        "plain,fp8",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-8000:]
    report = json.loads((out / "report.json").read_text())
    plain, fp8 = report["plain"], report["fp8"]

    # the installed hook handed the Trainer's deepspeed.initialize to fp8comm (the example imports no fp8comm)
    assert report["autoload"] is not None, (
        "fp8comm's autoload hook is not active in this interpreter: reinstall the package (pip install -e .) so "
        "that fp8comm-autoload.pth is in site-packages"
    )
    assert report["autoload"]["handed_to_fp8comm"] == 1, report["autoload"]
    assert plain["stats"] is None, "fp8comm engaged in the run without the section"
    # fp8comm's hook counters: FP8 weight gathers and gradient reduce-scatters in every one of the 30 steps
    st = fp8["stats"]
    assert st["weights"]["fp8_calls"] > 0 and st["gradients"]["fp8_calls"] >= STEPS, st
    assert st["hooks"].get("zero3.grad_reduce.plain", 0) >= STEPS, st["hooks"]
    assert st["gradients"]["ratio"] > 0.9 * 4 / (1 + 4 / 128), st  # fp32 payload vs FP8 + one fp32 scale per 128
    assert "fp8comm: DeepSpeed" in log and "ZeRO-3 fp32, 2 ranks" in log, "no fp8comm summary line"

    # training: both ran the 30 steps, learned, and the FP8 run stays within 2% of the plain one
    assert len(plain["losses"]) == len(fp8["losses"]) == STEPS, (len(plain["losses"]), len(fp8["losses"]))
    assert _mean_last(plain["losses"]) < 0.8 * plain["losses"][0], plain["losses"]
    rel = abs(_mean_last(fp8["losses"]) / _mean_last(plain["losses"]) - 1)
    print(
        f"\nloss (mean of the last 10): plain {_mean_last(plain['losses']):.4f}, fp8 "
        f"{_mean_last(fp8['losses']):.4f}, {rel:.3%}; gradient ratio {st['gradients']['ratio']:.2f}x, "
        f"weights {st['weights']['ratio']:.2f}x"
    )
    assert rel < TOL, (rel, plain["losses"], fp8["losses"])
    assert plain["losses"] != fp8["losses"], "FP8 communication changed nothing: was it really on?"

    # save_model() wrote an ordinary checkpoint: a fresh process reloads it, and its weights are the exact fp32
    # weights of the trained engine (gathered exactly, not through the FP8 gather)
    dirs = [plain["saved"], fp8["saved"]]
    r = subprocess.run(
        [sys.executable, "-c", RELOAD, *dirs], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    got = json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :])
    for run in (plain, fp8):
        g = got[run["saved"]]
        assert g["finite_loss"] and g["n_params"] > 0, g
        assert g["digest"] == pytest.approx(run["digest"], rel=1e-9, abs=1e-9), (g["digest"], run["digest"])
