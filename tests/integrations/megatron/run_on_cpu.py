"""Run a Megatron-Core script on a CPU-only machine (gloo): the test-only CUDA shims, then the script as __main__.

    torchrun --nproc-per-node 2 tests/integrations/megatron/run_on_cpu.py examples/megatron_simple_loop.py [args]
Test and example use only: mcore_cpu rewrites CUDA device requests process-wide (see its docstring).
"""

import os
import runpy
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron.core's __version__ would otherwise run git
warnings.filterwarnings("ignore")

import mcore_cpu  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT [ARGS...]")
    mcore_cpu.install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
