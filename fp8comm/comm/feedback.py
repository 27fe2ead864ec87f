"""ErrorFeedback: one gradient buffer's quantization residual, carried from one call to the next."""

from __future__ import annotations

import torch

from ..errors import Fp8CommError

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)


class ErrorFeedback:
    """Error feedback state for one gradient buffer: this rank's quantization residual, added to the next call.

    Pass the same object on every call for the same buffer (one per bucket). `residual` is laid out like the
    quantized (padded) input, in `dtype`: fp32 (4 bytes per element of the buffer) or bf16 (2 bytes; the residual
    itself rounded to bf16). Non-finite residuals are zeroed so one overflowed step cannot poison later ones.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, residual: torch.Tensor | None = None) -> None:
        """residual: start from this one (flat, `dtype`, laid out like the next call's padded input), e.g. pieces
        of per-parameter residuals an engine assembled; the collective updates it in place."""
        if dtype not in RESIDUAL_DTYPES:
            raise Fp8CommError(f"error-feedback residuals are float32 or bfloat16, got {dtype}")
        if residual is not None and (residual.dtype != dtype or residual.dim() != 1):
            raise Fp8CommError(
                f"an ErrorFeedback residual is a flat {dtype} tensor, got {residual.dtype} "
                f"of shape {tuple(residual.shape)}"
            )
        self.dtype = dtype
        self.residual: torch.Tensor | None = residual

    def reset(self) -> None:
        self.residual = None

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """The residual for a quantized input of `numel` elements (zeros on first use or after a size change)."""
        r = self.residual
        if r is None or r.numel() != numel or r.device != device:
            self.residual = r = torch.zeros(numel, dtype=self.dtype, device=device)
        return r

    def nbytes(self) -> int:
        return 0 if self.residual is None else self.residual.numel() * self.residual.element_size()

    def norm(self) -> float:
        return 0.0 if self.residual is None else float(self.residual.float().norm())

    def state_dict(self) -> dict:
        return {"dtype": str(self.dtype).removeprefix("torch."), "residual": self.residual}

    def load_state_dict(self, sd: dict) -> None:
        r = sd.get("residual")
        if r is not None and r.dtype != self.dtype:
            raise Fp8CommError(f"checkpointed residual is {r.dtype}, this ErrorFeedback keeps {self.dtype}")
        self.residual = None if r is None else r.clone()
