"""Wire options shared by every collective (format, block scales, rounding, kernel backend) and error feedback."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..quant.formats import Fp8Format, get_format
from ..quant.reference import mix32
from ..quant.scaling import ENCODINGS, PRESETS, Scaling

ROUNDINGS = ("nearest", "stochastic")
KERNEL_BACKENDS = ("auto", "reference", "compiled", "triton")
# On CPU the torch.compile kernels are ~2.5x faster but cost seconds to compile once per process; only worth it
# for big buffers (same threshold as fp8comm.quant's own "auto").
COMPILE_MIN_NUMEL = 1 << 20


@dataclass(frozen=True)
class WireSpec:
    """How one collective quantizes: FP8 format, 1xB block scaling, rounding and kernel backend."""

    fmt: Fp8Format
    scaling: Scaling
    rounding: str
    backend: str

    def kernel_backend(self, device: torch.device, numel: int) -> str:
        """The quant-core backend for a buffer of `numel` elements on `device` ('auto' resolved here)."""
        if self.backend != "auto":
            return self.backend
        if device.type == "cpu":
            return "compiled" if numel >= COMPILE_MIN_NUMEL else "reference"
        return "auto"


def get_wire_scaling(scaling: "Scaling | str", block_size: int | None = 128) -> Scaling:
    """A Scaling with 1-row blocks from a Scaling, a preset name, or a scale encoding ('fp32', 'pow2', 'e8m0')."""
    if isinstance(scaling, str) and scaling in ENCODINGS:
        sc = Scaling(1, block_size, scaling)
    elif isinstance(scaling, Scaling):
        sc = scaling
    elif isinstance(scaling, str) and scaling in PRESETS:
        sc = PRESETS[scaling]
    else:
        raise ValueError(f"unknown scaling {scaling!r}; valid: a Scaling, a scale encoding "
                         f"({', '.join(ENCODINGS)}) or a preset ({', '.join(PRESETS)})")
    if sc.rows != 1:
        raise ValueError(f"collectives quantize 1xB blocks of the flat buffer (rows=1); got {sc.describe()}")
    return sc


def wire_spec(fmt="e4m3", scaling="fp32", rounding="nearest", backend="auto", block_size=128) -> WireSpec:
    """The validated WireSpec for these options (cached: options are resolved once per configuration)."""
    try:
        return _wire_spec(fmt, scaling, rounding, backend, block_size)
    except TypeError as e:  # an unhashable option value (e.g. a list) is simply a bad value
        raise ValueError(f"invalid wire option ({e}): fmt={fmt!r}, scaling={scaling!r}, rounding={rounding!r}, "
                         f"backend={backend!r}, block_size={block_size!r}") from None


@lru_cache(maxsize=256)
def _wire_spec(fmt, scaling, rounding, backend, block_size) -> WireSpec:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(KERNEL_BACKENDS)}")
    return WireSpec(get_format(fmt), get_wire_scaling(scaling, block_size), rounding, backend)


OPTIONS = ("fmt", "scaling", "block_size", "rounding", "seed", "backend", "check", "buffer", "pipeline")

# Pipelining inside one call (CPU): pieces of at least this many elements, at most PIPELINE_MAX of them. Pieces
# >= 1 Mi elements keep the compiled kernels (COMPILE_MIN_NUMEL); 8 pieces of a 16 Mi-element message measured
# best on the 2-core machine (docs/benchmarks.md).
PIPELINE_PIECE = 1 << 21
PIPELINE_MAX = 8


def pipeline_option(v) -> int:
    """pipeline=None/'auto' (0: pieces from the size), False or 1 (one piece: no pipelining), or a piece count."""
    if v is None or v == "auto" or v is True:
        return 0
    if v is False:
        return 1
    if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1024:
        return v
    raise ValueError(f"pipeline must be None/'auto', False, or a piece count 1..1024, got {v!r}")


def piece_count(numel: int | None, device: torch.device, rounding: str, pipeline: int) -> int:
    """How many pipelined pieces one call travels in: 1 unless on CPU (where the codec costs as much as the wire;
    a GPU codec takes microseconds) with nearest rounding (stochastic rounding hashes the element index within
    one piece's layout). The same on every rank: it depends only on sizes and options the metadata check compares.
    """
    if device.type != "cpu" or rounding != "nearest":
        return 1
    # numel None: no size every rank agrees on (an all-to-all with its own splits and the check off): one piece.
    auto = min(PIPELINE_MAX, numel // PIPELINE_PIECE) if numel is not None else 1
    return max(1, pipeline or auto)


def plan_pieces(k: int, block: int | None, numel: int | None, device: torch.device, rounding: str,
                pipeline: int) -> list[tuple[int, int]]:
    """Column ranges [a, b) of the K dim that travel as separate pieces: whole blocks each, equal but the last."""
    if k == 0 or block is None:
        return [(0, k)]
    nb = -(-k // block)
    p = min(piece_count(numel, device, rounding, pipeline), nb)
    if p == 1:
        return [(0, k)]
    w = -(-nb // p) * block
    return [(a, min(a + w, k)) for a in range(0, k, w)]


def row_part(n: int, p: int, pieces: int) -> tuple[int, int]:
    """Rows [a, b) of a chunk of n rows that travel in piece p of `pieces` (near-equal; sender and receiver agree)."""
    return n * p // pieces, n * (p + 1) // pieces


def unknown_options(kw: dict, extra: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """An ("option", message) problem for keywords no collective knows (a typo must not be silently ignored)."""
    bad = sorted(set(kw) - set(OPTIONS) - set(extra))
    if bad:
        return "option", f"unknown option(s) {bad}; valid: {', '.join(OPTIONS + extra)}"
    return None


CHECK_POLICIES = ("first", "always", "never")
CHECK_ENV = "FP8COMM_CHECK"
_CHECK_ALIASES = {"": "first", "first": "first", "always": "always", "1": "always", "on": "always", "true": "always",
                  "yes": "always", "never": "never", "0": "never", "off": "never", "false": "never", "no": "never"}


def default_check_policy() -> str:
    """The metadata-check policy when a call passes check=None: FP8COMM_CHECK=first (default), always or never."""
    raw = os.environ.get(CHECK_ENV, "").strip().lower()
    if raw not in _CHECK_ALIASES:
        raise ValueError(f"{CHECK_ENV}={raw!r} is not a check policy; valid: {', '.join(CHECK_POLICIES)} "
                         "(or 1/0 for always/never)")
    return _CHECK_ALIASES[raw]


def check_policy(check) -> str:
    """A call's check option as a policy: None -> the FP8COMM_CHECK default, True/False -> always/never."""
    if check is None:
        return default_check_policy()
    if check is True or check is False:
        return "always" if check else "never"
    if check in CHECK_POLICIES:
        return check
    raise ValueError(f"check must be None, True, False or one of {CHECK_POLICIES}, got {check!r}")


_call_counter = 0


def next_seed(seed: int | None, rank: int, rounding: str = "stochastic") -> int:
    """Per-call stochastic-rounding seed: distinct per rank and (when seed is None) per call. Pure host integer
    arithmetic; for nearest rounding (no seed used) only the call counter moves, so seeds of later stochastic
    calls do not depend on which calls rounded to nearest."""
    global _call_counter
    if seed is None:
        _call_counter += 1
        seed = _call_counter
    if rounding != "stochastic":
        return 0
    # mix32 hashes a 32-bit value; folding the rank in keeps ranks' rounding decisions independent.
    return int(mix32((int(seed) * 0x9E3779B1 + rank * 0x85EBCA77) & 0xFFFFFFFF))


RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)


class ErrorFeedback:
    """Error feedback state for one gradient buffer: this rank's quantization residual, added to the next call.

    Pass the same object on every call for the same buffer (one per bucket). `residual` is laid out like the
    quantized (padded) input, in `dtype`: fp32 (4 bytes per element of the buffer) or bf16 (2 bytes; the residual
    itself rounded to bf16). Non-finite residuals are zeroed so one overflowed step cannot poison later ones.
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"error-feedback residuals are float32 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.residual: torch.Tensor | None = None

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
            raise ValueError(f"checkpointed residual is {r.dtype}, this ErrorFeedback keeps {self.dtype}")
        self.residual = None if r is None else r.clone()
