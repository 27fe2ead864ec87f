"""fp8comm.comm as the dist checks see it: the module itself, or (FP8COMM_TEST_DEVICE=cuda) a proxy that runs every
collective on device copies of its tensor arguments and hands host results back.

The checks build inputs and exact references on the host; through the proxy the same checks drive the CUDA paths
(Triton pack / unpack / unpack_sum meeting several senders, with the staged backend: staged_pg.py). Outputs a
check passes in (out=, the *_into outputs, in-place all_reduce) get the device result copied back, so identity
checks (`all_gather_into(o, x) is o`) and in-place semantics hold; autograd flows through the host<->device copies.
"""

from __future__ import annotations

import os

import torch

COLLECTIVES = (
    "all_gather",
    "all_gather_into",
    "reduce_scatter",
    "reduce_scatter_into",
    "all_reduce",
    "all_reduce_into",
    "all_to_all",
)


def test_device() -> torch.device:
    return torch.device(os.environ.get("FP8COMM_TEST_DEVICE", "cpu"))


def comm_under_test(module):
    """The module itself on CPU; the proxy for another device (or with FP8COMM_TEST_PROXY=1, on CPU copies: how
    the proxy itself is tested without a GPU)."""
    dev = test_device()
    proxy = dev.type != "cpu" or os.environ.get("FP8COMM_TEST_PROXY") == "1"
    return _OnDevice(module, dev) if proxy else module


class _OnDevice:
    def __init__(self, target, device: torch.device) -> None:
        self._target, self._dev = target, device

    def __getattr__(self, name):
        f = getattr(self._target, name)
        if name == "Buffer":
            return lambda *a, **k: _OnDevice(f(*a, **k), self._dev)
        if name not in COLLECTIVES:
            return f
        return lambda *a, **k: _call(f, name, self._dev, a, k)


def _outputs(name: str, args, kwargs) -> set[int]:
    """ids of the host tensors a call writes: out= (tensor or Fp8Tensor parts) and the *_into outputs."""
    outs = [kwargs.get("out"), kwargs.get("output")]
    if name.endswith("_into") and args:
        outs.append(args[0])
    ids = set()
    for o in outs:
        if isinstance(o, torch.Tensor):
            ids.add(id(o))
        elif _is_fp8(o):
            ids |= {id(o.data), id(o.scale)}
    return ids


def _call(f, name, dev, args, kwargs):
    moved: dict[int, tuple] = {}  # id(host tensor) -> (host, device copy)

    def to_dev(v):
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            if id(v) not in moved:
                moved[id(v)] = (v, v.to(dev, copy=True) if v.requires_grad else v.detach().to(dev, copy=True))
            return moved[id(v)][1]
        if _is_fp8(v):
            return type(v)(
                to_dev(v.data), to_dev(v.scale), v.fmt, v.scaling, v.dtype, None if v.amax is None else to_dev(v.amax)
            )
        return v

    a = [to_dev(v) for v in args]
    k = {n: to_dev(v) for n, v in kwargs.items()}
    res = f(*a, **k)
    outs = _outputs(name, args, kwargs)
    if hasattr(res, "wait") and not isinstance(res, torch.Tensor):
        return _Handle(res, lambda r: _back(r, moved, outs, kwargs))
    return _back(res, moved, outs, kwargs)


def _is_fp8(v) -> bool:
    return type(v).__name__ == "Fp8Tensor"


def _back(res, moved: dict, outs: set, kwargs: dict):
    """The host object for a device result: the host tensor it was moved from (updated), or a host copy."""
    for key, (host, d) in moved.items():  # outputs written in place on the device
        if key in outs and d is not host:
            host.copy_(d)
    if _is_fp8(res):
        out = kwargs.get("out")
        if _is_fp8(out):  # a caller-provided FP8 output: its host tensors were updated above
            return out
        return type(res)(
            res.data.cpu(),
            res.scale.cpu(),
            res.fmt,
            res.scaling,
            res.dtype,
            None if res.amax is None else res.amax.cpu(),
        )
    if isinstance(res, torch.Tensor):
        for host, d in moved.values():
            if res is d:
                return host
        return res.to("cpu")
    return res


class _Handle:
    """An async handle whose results come back to the host on wait()."""

    def __init__(self, inner, back) -> None:
        self._inner, self._back, self._res, self._done = inner, back, None, False

    def wait(self, timeout=None):
        if not self._done:
            self._res = self._back(self._inner.wait())
            self._done = True
        return self._res

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._inner.is_completed():
            self.wait()
            return True
        return False
