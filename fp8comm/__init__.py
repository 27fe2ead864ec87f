"""fp8comm: FP8 training GEMMs and FP8 collectives (weights, gradients, MoE tokens) for LLM pretraining.

The top-level names are loaded on first use (PEP 562 module __getattr__): `import fp8comm` itself imports nothing,
not even torch, so the `fp8comm` command (fp8comm.tools.cli, which Python can only reach through this package)
prints its help without paying for torch. `fp8comm.quantize`, `from fp8comm import Fp8Linear`, `import
fp8comm.comm` and `fp8comm.comm.X` work as with eager imports. This package never imports fp8comm.tools.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__ as __version__
from .errors import (
    CommMismatchError,
    Fp8CommCaptureError,
    Fp8CommConfigError,
    Fp8CommError,
    Fp8CommFallbackWarning,
    Fp8CommNotImplementedError,
    Fp8CommRuntimeError,
    Fp8CommStateError,
    Fp8CommTypeError,
    Fp8CommUnsupportedError,
)

__all__ = [
    "quantize",
    "dequantize",
    "Fp8Tensor",
    "Scaling",
    "TensorScaling",
    "RowScaling",
    "BlockScaling",
    "MXScaling",
    "DelayedScaling",
    "all_gather",
    "all_gather_into",
    "reduce_scatter",
    "reduce_scatter_into",
    "all_reduce",
    "all_reduce_into",
    "all_to_all",
    "comm_stats",
    "reset_comm_stats",
    "format_comm_stats",
    "shutdown",
    "Fp8Linear",
    "convert_to_fp8",
    "ConversionReport",
    "Fp8Recipe",
    "get_recipe",
    "WireConfig",
    "Buffer",
    "ErrorFeedback",
    "Fp8CommError",
    "Fp8CommConfigError",
    "CommMismatchError",
    "Fp8CommTypeError",
    "Fp8CommRuntimeError",
    "Fp8CommNotImplementedError",
    "Fp8CommUnsupportedError",
    "Fp8CommStateError",
    "Fp8CommCaptureError",
    "Fp8CommFallbackWarning",
]
_FROM = {  # subpackage -> the names this package re-exports from it
    "comm": (
        "all_gather",
        "all_gather_into",
        "all_reduce",
        "all_reduce_into",
        "all_to_all",
        "comm_stats",
        "format_comm_stats",
        "reduce_scatter",
        "reduce_scatter_into",
        "reset_comm_stats",
        "shutdown",
        "WireConfig",
        "Buffer",
        "ErrorFeedback",
    ),
    "gemm": ("ConversionReport", "Fp8Linear", "Fp8Recipe", "convert_to_fp8", "get_recipe"),
    "quant": (
        "BlockScaling",
        "DelayedScaling",
        "Fp8Tensor",
        "MXScaling",
        "RowScaling",
        "Scaling",
        "TensorScaling",
        "dequantize",
        "quantize",
    ),
}
_WHERE = {name: sub for sub, names in _FROM.items() for name in names}


def __getattr__(name: str):
    if name in _FROM:  # `import fp8comm; fp8comm.comm.all_gather(...)`
        return importlib.import_module(f"{__name__}.{name}")
    sub = _WHERE.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_FROM))


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager form
    from .comm import (
        Buffer,
        ErrorFeedback,
        WireConfig,
        all_gather,
        all_gather_into,
        all_reduce,
        all_reduce_into,
        all_to_all,
        comm_stats,
        format_comm_stats,
        reduce_scatter,
        reduce_scatter_into,
        reset_comm_stats,
        shutdown,
    )
    from .gemm import ConversionReport, Fp8Linear, Fp8Recipe, convert_to_fp8, get_recipe
    from .quant import (
        BlockScaling,
        DelayedScaling,
        Fp8Tensor,
        MXScaling,
        RowScaling,
        Scaling,
        TensorScaling,
        dequantize,
        quantize,
    )
