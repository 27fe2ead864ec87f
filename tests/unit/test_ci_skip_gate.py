"""The CI skip gate in tests/conftest.py: with CI=true an unlisted skip fails the run; without CI it does not."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SAMPLE = """
import pytest
pytest.importorskip("no_such_module_fp8comm", reason="stands for a broken install")
"""

SAMPLE_RUN = """
import pytest
def test_skips():
    pytest.skip("nope")
def test_passes():
    pass
"""


def _run(tmp_path: Path, ci: bool, body: str, workers: int = 0) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(body)
    (tmp_path / "test_other.py").write_text("def test_ok():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)]
        + (["-n", str(workers), "--dist", "loadgroup"] if workers else []),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])
def test_unlisted_skip_fails_in_ci(tmp_path, workers):
    """test.sh runs on pytest-xdist workers: the gate must see their skips too."""
    r = _run(tmp_path, True, SAMPLE_RUN, workers)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "test_sample.py::test_skips: Skipped: nope" in r.stdout


@pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])
def test_module_level_importorskip_fails_in_ci(tmp_path, workers):
    r = _run(tmp_path, True, SAMPLE, workers)
    assert r.returncode == 1, r.stdout + r.stderr  # 1 passed, 1 skipped module: the gate, not "no tests" (5)
    assert "stands for a broken install" in r.stdout


def test_skip_is_fine_outside_ci(tmp_path):
    r = _run(tmp_path, False, SAMPLE_RUN)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed, 1 skipped" in r.stdout
