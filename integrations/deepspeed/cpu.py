"""Running DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo) without its slow just-in-time op builds.

DeepSpeed's torch comm backend JIT-compiles a shared-memory op (deepspeed_shm_comm) when it starts: 60-100 s the
first time, an error without a C++ compiler. Only the inference all-reduce uses it; training never does. A config
"optimizer" section JIT-builds cpu fused Adam (~200 s); pass a torch.optim optimizer instead.
"""

from __future__ import annotations

import os
import sys

from fp8comm.errors import Fp8CommRuntimeError


def prepare(skip_shm_op: bool = True) -> None:
    """Select the CPU accelerator (unless DS_ACCELERATOR says otherwise) and skip the shared-memory op build."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  (imports deepspeed.comm.torch)

    if skip_shm_op:
        # `deepspeed.comm.torch` as an attribute is the torch module (deepspeed.comm re-exports it): go through
        # sys.modules to reach DeepSpeed's own module.
        mod = sys.modules["deepspeed.comm.torch"]
        if not hasattr(mod, "build_shm_op"):
            raise Fp8CommRuntimeError(
                "deepspeed.comm.torch.build_shm_op not found; this DeepSpeed release builds its CPU comm op elsewhere"
            )
        setattr(mod, "build_shm_op", lambda: None)  # noqa: B010 (mypy: not a declared attribute)
