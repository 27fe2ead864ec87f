"""TEST-ONLY shims that let real megatron-core 0.19.x run forward/backward/DDP/optimizer on CPU with gloo.

Megatron-Core assumes CUDA in a few places that have nothing to do with fp8comm: torch.cuda RNG/stream/event
calls, hard-coded device='cuda' / torch.cuda.current_device() allocations, `param.type() == 'torch.cuda.FloatTensor'`
checks, and MoE split sizes that only become host lists on CUDA. These shims stub exactly those; the collectives,
DDP buckets, distributed optimizer and MoE dispatcher that fp8comm hooks into run unmodified. Never import this
module from library code: it rewrites devices process-wide.
"""

from __future__ import annotations

import contextlib
import typing

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _is_cuda_device(d) -> bool:
    if isinstance(d, int) and not isinstance(d, bool):
        return True  # torch.cuda.current_device() returns an int; on this machine that means "the device" = CPU
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, torch.device) and d.type == "cuda"


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU and answers Megatron's CUDA type checks for CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "record_stream":
            return None
        if name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            # distrib_optimizer / optimizer / clip_grads accept only 'torch.cuda.*Tensor' parameters.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            args = tuple(
                "cpu" if i and _is_cuda_device(a) and not isinstance(a, int) else a for i, a in enumerate(args)
            )
        return func(*args, **kwargs)


class _FakeStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _FakeEvent()

    def __eq__(self, other):
        return isinstance(other, _FakeStream)

    def __hash__(self):
        return 0


class _FakeEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def install() -> None:
    """Apply every shim once per process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    # megatron.training uses typing.override (Python 3.12); alias it on 3.11.
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override

    cuda = torch.cuda
    # A device object, not an index: `device=torch.cuda.current_device()` then means CPU even where the
    # function mode below is not active (autograd runs custom backward functions outside it).
    cuda.current_device = lambda: torch.device("cpu")
    cuda.current_stream = lambda *a, **k: _FakeStream()
    cuda.default_stream = lambda *a, **k: _FakeStream()
    cuda.Stream = _FakeStream
    cuda.Event = _FakeEvent
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 1
    # CUDA RNG -> the CPU generator (the tiny test models use dropout 0, so this only keeps the tracker working).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly, never recurse.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    torch.Tensor.record_stream = lambda self, *a, **k: None

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()

    # On CUDA the MoE split sizes are copied to the host as numpy; on CPU they stay tensors, which
    # all_to_all_single rejects. Return host lists, as the CUDA path effectively does.
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as td

    orig_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    if hasattr(td, "maybe_move_tensor_to_cpu"):
        td.maybe_move_tensor_to_cpu = move_to_cpu

    _CpuDeviceMode().__enter__()  # process-wide for the rest of the (test) process
