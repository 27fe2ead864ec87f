"""Which compiled CPU paths this process can run, and the one warning 'auto' gives when it steps down from one.

inductor_problem() says why torch.compile's CPU backend cannot build here (None when it can); step_down() warns
once per cause. An explicit backend that cannot run raises Fp8CommRuntimeError instead (backend_problem()).
"""

from __future__ import annotations

import warnings
from functools import cache

import torch

from ..errors import Fp8CommFallbackWarning

_warned: set[str] = set()


@cache
def inductor_problem() -> str | None:
    """Why inductor cannot compile CPU kernels in this process (no C++ compiler), or None; probed once."""
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except ImportError as e:
        return f"torch.compile's CPU backend is not importable ({e})"
    except Exception as e:  # InvalidCxxCompiler and friends: inductor would fail at the first compiled call
        return f"torch.compile has no C++ compiler ({type(e).__name__}: {str(e).strip()[:200] or 'none found'})"
    return None


def step_down(cause: str, chosen: str) -> None:
    """One warning per cause and process: 'auto' runs `chosen` because of `cause`."""
    if cause in _warned:
        return
    _warned.add(cause)
    warnings.warn(f"fp8comm: {cause}; backend 'auto' uses {chosen} (same bits, slower)", Fp8CommFallbackWarning, 2)


def compiled_cpu_problem(device: torch.device) -> str | None:
    """Why the 'compiled' backend cannot run for a tensor on `device`, or None."""
    return inductor_problem() if device.type == "cpu" else None
