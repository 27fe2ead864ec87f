"""launch/setup_env.sh (run by both README commands): quiet on a fresh machine, and rebuilt when the kernels change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "launch" / "setup_env.sh").read_text()

HIDE_NUMPY = "import sys; sys.modules['numpy'] = None\n"  # a venv before the extras bring numpy


def test_no_torch_import_before_the_extras():
    """`import torch` before numpy is installed prints torch's "Failed to initialize NumPy" on a fresh clone's first
    run; the set-up reads torch's version from package metadata instead, which prints nothing."""
    before = SCRIPT[: SCRIPT.index('-e "$root[$extras]"')]
    code = "\n".join(line for line in before.splitlines() if not line.lstrip().startswith("#"))
    assert "import torch" not in code, "setup_env.sh imports torch before the extras (numpy) are installed"
    warned = subprocess.run([sys.executable, "-c", HIDE_NUMPY + "import torch"], capture_output=True, text=True)
    assert "Failed to initialize NumPy" in warned.stderr  # the hazard is real on this torch
    probe = "import importlib.metadata as m; print(m.version('torch'))"
    quiet = subprocess.run([sys.executable, "-c", HIDE_NUMPY + probe], capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.strip(), quiet
    assert probe.replace("'", '"') in SCRIPT


def test_kernel_sources_are_in_the_stamp():
    """The 4-bit CPU kernels are built at install: an edit of their source or of setup.py must reinstall."""
    stamp = next(line for line in SCRIPT.splitlines() if line.startswith("want="))
    stamp += SCRIPT.split(stamp, 1)[1].splitlines()[0]
    for name in ("pyproject.toml", "setup.py", "fp8comm/quant/fp4_cpu.c"):
        assert name in stamp, name
