"""ErrorFeedback's preset residual: what an engine assembles from per-parameter pieces is what the next call uses."""

from __future__ import annotations

import pytest
import torch

import fp8comm.comm as fc


def test_preset_residual_is_used_and_validated():
    r = torch.full((256,), 0.25, dtype=torch.bfloat16)
    ef = fc.ErrorFeedback(torch.bfloat16, residual=r)
    assert ef.take(256, r.device) is r and ef.nbytes() == 512  # the call adds and updates this very tensor
    assert ef.take(128, r.device) is not r and ef.residual.abs().sum() == 0  # another size: fresh zeros
    with pytest.raises(fc.Fp8CommError, match="flat torch.float32 tensor, got torch.bfloat16"):
        fc.ErrorFeedback(torch.float32, residual=r)
    with pytest.raises(fc.Fp8CommError, match=r"shape \(16, 16\)"):
        fc.ErrorFeedback(torch.bfloat16, residual=r.view(16, 16))
