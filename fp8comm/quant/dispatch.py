"""Which kernels run a quantization: the torch reference, torch.compile (CPU) or Triton (CUDA, or the interpreter).

resolve_backend(name, device, numel) returns the backend module; "auto" picks Triton on CUDA and the compiled path
for big CPU tensors (the reference, with one warning, where inductor has no C++ compiler). Every backend implements
the same functions and is tested bit-exact against the reference.
"""

from __future__ import annotations

import os

import torch

from ..errors import Fp8CommError, Fp8CommRuntimeError
from . import backend_compiled, backend_reference
from .toolchain import compiled_cpu_problem, step_down

BACKENDS = ("reference", "compiled", "triton")
# Below this many elements CPU tensors take the torch reference. Once compiled, the compiled FP8 pack is faster at
# every size (3.4x at 64 Ki elements, 7.3x at 512 Ki, 9.5x at 1 Mi: launch/kernel_switch.py; decode-and-sum from
# about 64 Ki), but the first calls cost each process 2-3 s (about 10 s with inductor's cache cold), which the small
# tensors of tests and short tools do not repay: at 256 Ki the suite's multi-rank tests crossed it and the suite took
# 15% longer; from 512 Ki a pack saves >= 3 ms (docs/benchmarks.md, "The CPU kernel switch").
COMPILE_MIN_NUMEL = 1 << 19


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(name: str, device: torch.device, numel: int | None = None):
    """Return the backend module for `name`; 'auto' picks Triton on CUDA, compiled torch for big CPU tensors."""
    if name == "auto":
        if device.type == "cuda" and triton_available(device):
            name = "triton"
        elif device.type == "cpu" and numel is not None and numel >= COMPILE_MIN_NUMEL:
            problem = compiled_cpu_problem(device)
            name = "compiled" if problem is None else "reference"
            if problem is not None:
                step_down(problem, "the torch reference for big CPU tensors")
        else:
            name = "reference"
    if name == "reference":
        return backend_reference
    if name in ("compiled", "triton") and (problem := backend_problem(name, device)) is not None:
        raise Fp8CommRuntimeError(problem)
    if name == "compiled":
        return backend_compiled
    if name == "triton":
        from . import backend_triton  # triton is an optional dependency: imported on first use

        return backend_triton
    raise Fp8CommError(f"unknown backend {name!r}; valid: auto, {', '.join(BACKENDS)}")


def backend_problem(name: str, device: torch.device) -> str | None:
    """Why an explicit kernel backend cannot run for tensors on `device` (None: it can, or it is 'auto')."""
    if name == "compiled" and (problem := compiled_cpu_problem(device)) is not None:
        return f"backend 'compiled' cannot run here: {problem}"
    if name == "triton" and not triton_available(device):
        return f"backend 'triton' needs a CUDA tensor or TRITON_INTERPRET=1 (tensor on {device})"
    return None


def backend_name(name: str, device: torch.device, numel: int | None = None) -> str:
    """The name of the backend resolve_backend would return ("auto" resolved)."""
    return resolve_backend(name, device, numel).name
