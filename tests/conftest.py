import os

import pytest
import torch

# Keep the 2-core CI machine responsive: one intra-op thread per test process.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def all_bf16() -> torch.Tensor:
    """Every bf16 bit pattern once (+-0, subnormals, max finite, +-inf, NaNs), as a [512, 128] tensor."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(512, 128)
