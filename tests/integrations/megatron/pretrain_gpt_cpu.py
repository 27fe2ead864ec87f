"""Run integrations/megatron/pretrain_gpt.py on CPU-only machines (gloo): the test-only CUDA shims, then main().

    launch/cluster.py run -- tests/integrations/megatron/pretrain_gpt_cpu.py <pretrain_gpt arguments>
    torchrun --nproc-per-node 2 tests/integrations/megatron/pretrain_gpt_cpu.py <pretrain_gpt arguments>
Test and benchmark use only: mcore_cpu rewrites CUDA device requests process-wide (see its docstring).
"""

import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron.core's __version__ would otherwise run git
warnings.filterwarnings("ignore")

import mcore_cpu  # noqa: E402

if __name__ == "__main__":
    mcore_cpu.install()
    from fp8comm.integrations.megatron.pretrain_gpt import end_job, main

    main()
    end_job()
