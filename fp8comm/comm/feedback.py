"""ErrorFeedback: one gradient buffer's quantization residual, carried from one call to the next."""

from __future__ import annotations

import logging

import torch

from ..errors import Fp8CommError
from ..quant.residual import RESIDUAL_FORMATS, ResidualFormat, decode_residual, encode_residual
from .config import residual_dtype_name

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)  # the plain (uncompressed) residual dtypes
log = logging.getLogger("fp8comm.feedback")


class ErrorFeedback:
    """Error feedback state for one gradient buffer: this rank's quantization residual, added to the next call.

    Pass the same object on every call for the same buffer (one per bucket). The residual is laid out like the
    quantized (padded) input. `dtype`: torch.float32 (4 bytes per element of the buffer), torch.bfloat16 (2 bytes;
    the residual itself rounded to bf16), or "fp8" (compact: E5M2 codes with one power-of-two fp32 scale, n + 4
    bytes, fp8comm.quant.residual; a ResidualFormat picks another compact layout). The names of
    comm.config.RESIDUAL_DTYPES and their aliases ("fp32", "bf16") are accepted too. Non-finite residuals are
    zeroed so one overflowed step cannot poison later ones.

    A compact residual is decoded into an fp32 working tensor (`residual`) when a call takes it and encoded back,
    and the working tensor dropped, once the call has written its last residual column (commit()); between calls
    only the codes and scales are kept.
    """

    def __init__(
        self, dtype: torch.dtype | str | ResidualFormat = torch.float32, residual: torch.Tensor | None = None
    ) -> None:
        """residual: start from this one (flat, `dtype`, laid out like the next call's padded input), e.g. pieces
        of per-parameter residuals an engine assembled; the collective updates it in place (plain dtypes only)."""
        self.format: ResidualFormat | None = None
        if isinstance(dtype, ResidualFormat):
            self.format, dtype = dtype, torch.float32
        elif isinstance(dtype, (str, torch.dtype)):
            try:
                name = residual_dtype_name(dtype)
            except Fp8CommError:
                raise Fp8CommError(
                    f"error-feedback residuals are float32, bfloat16 or fp8 (aliases fp32, bf16), got {dtype!r}"
                ) from None
            if name in RESIDUAL_FORMATS:
                self.format = RESIDUAL_FORMATS[name]
            dtype = getattr(torch, name) if self.format is None else torch.float32
        else:
            raise Fp8CommError(f"error-feedback residuals are float32, bfloat16 or fp8, got {dtype!r}")
        if self.format is not None and residual is not None:
            raise Fp8CommError(
                f"a preset ErrorFeedback residual is a float32 or bfloat16 tensor; a compact ({self.format.name}) "
                "residual starts from zero or from load_state_dict()"
            )
        if residual is not None and (residual.dtype != dtype or residual.dim() != 1):
            raise Fp8CommError(
                f"an ErrorFeedback residual is a flat {dtype} tensor, got {residual.dtype} "
                f"of shape {tuple(residual.shape)}"
            )
        # dtype: what take() hands out (a compact residual's working tensor is fp32).
        self.dtype: torch.dtype = dtype
        self.residual: torch.Tensor | None = residual
        self.codes: torch.Tensor | None = None  # compact: uint8 [n]
        self.scales: torch.Tensor | None = None  # compact: uint8 scale bytes

    @property
    def kind(self) -> str:
        """The residual's name: float32, bfloat16, or the compact format's (fp8)."""
        return self.format.name if self.format is not None else str(self.dtype).removeprefix("torch.")

    @property
    def compact(self) -> bool:
        return self.format is not None

    def reset(self) -> None:
        self.residual = self.codes = self.scales = None

    def stored(self) -> bool:
        """Whether a residual is kept (False before the first call and after reset())."""
        return self.residual is not None or self.codes is not None

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """The residual for a quantized input of `numel` elements (zeros on first use or after a size change).

        Compact: the fp32 working tensor of the current call (decoded from the codes on the call's first take,
        the same tensor until commit())."""
        r = self.residual
        if r is not None and r.numel() == numel and r.device == device:
            return r
        if self.format is not None and self.codes is not None and self.codes.numel() == numel:
            assert self.scales is not None
            codes, scales = self.codes.to(device), self.scales.to(device)
            self.residual = r = decode_residual(codes, scales, self.format)
        else:
            self.residual = r = torch.zeros(numel, dtype=self.dtype, device=device)
        return r

    def commit(self) -> None:
        """The call has written the whole residual: a compact one is encoded and its working tensor dropped (no-op
        for plain dtypes, whose residual is the stored tensor itself)."""
        if self.format is None or self.residual is None:
            return
        self.codes, self.scales = encode_residual(self.residual, self.format)
        self.residual = None

    @property
    def numel(self) -> int:
        if self.codes is not None:
            return self.codes.numel()
        return 0 if self.residual is None else self.residual.numel()

    def nbytes(self) -> int:
        """Bytes kept between calls (compact: codes plus scales)."""
        if self.format is not None:
            return 0 if self.codes is None or self.scales is None else self.codes.numel() + self.scales.numel()
        return 0 if self.residual is None else self.residual.numel() * self.residual.element_size()

    def value(self) -> torch.Tensor | None:
        """The residual as fp32 values (decoded when compact), or None when none is kept."""
        if self.residual is not None:
            return self.residual.float()
        if self.codes is None or self.scales is None or self.format is None:
            return None
        return decode_residual(self.codes, self.scales, self.format)

    def norm(self) -> float:
        v = self.value()
        return 0.0 if v is None else float(v.norm())

    def state_dict(self) -> dict:
        if self.format is None:
            return {"dtype": self.kind, "residual": self.residual}
        self.commit()  # a working tensor left by an interrupted call is saved as what it holds
        return {"dtype": self.kind, "codes": self.codes, "scales": self.scales}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what state_dict() saved (bit-identical). A compact ErrorFeedback also loads a float32/bfloat16
        residual (a checkpoint written before the switch): encoded into its format, with a log line saying so."""
        saved = sd.get("dtype")
        if self.format is None:
            if "codes" in sd:
                raise Fp8CommError(
                    f"checkpointed residual is {saved} (compact), this ErrorFeedback keeps {self.dtype}: a compact "
                    "residual loads only into a compact one"
                )
            r = sd.get("residual")
            if r is not None and r.dtype != self.dtype:
                raise Fp8CommError(f"checkpointed residual is {r.dtype}, this ErrorFeedback keeps {self.dtype}")
            self.residual = None if r is None else r.clone()
            return
        self.residual = None
        if "codes" in sd:
            if saved != self.format.name:
                raise Fp8CommError(f"checkpointed residual is {saved}, this ErrorFeedback keeps {self.format.name}")
            c, s = sd.get("codes"), sd.get("scales")
            self.codes = None if c is None else c.clone()
            self.scales = None if s is None else s.clone()
            return
        r = sd.get("residual")
        if r is not None and r.dtype not in RESIDUAL_DTYPES:
            raise Fp8CommError(f"checkpointed residual is {r.dtype}; float32, bfloat16 or compact codes load here")
        self.codes, self.scales = (None, None) if r is None else encode_residual(r.reshape(-1), self.format)
        if r is not None:
            log.warning(
                "fp8comm error feedback: converted a checkpointed %s residual (%d elements) to %s (%s)",
                str(r.dtype).removeprefix("torch."),
                r.numel(),
                self.format.name,
                self.format.describe(),
            )
