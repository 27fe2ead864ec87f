"""How fp8comm's Triton kernels are launched: the host side every kernel module shares (FP8 and 4-bit alike).

launch() turns FMA contraction off (the reference rounds every product and sum) and bumps the autograd version of
the tensors a kernel writes; chunk_tables() keeps each wire layout's per-chunk row and byte offsets on the device,
cached, so the launches of a collective's steady state copy nothing from the host.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from .layout import Chunks

# kernel name -> {id: compiled kernel} of every variant launched on CUDA (launch/device_check.py inspects the PTX)
LAUNCHED: dict = {}
TABLES_MAX = 1024  # chunk-offset tables kept per process (least recently used dropped first)
_TABLES: OrderedDict = OrderedDict()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _p2_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1) if n >= 1 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _i32(v: int) -> int:
    """A uint32 value as the signed int32 with the same bits (kernels bitcast it back)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def launch(kernel, grid, *args, writes: tuple = (), num_warps: int = 4, **meta) -> None:
    """kernel[grid](*args, **meta); `writes`: the tensors the kernel stores into, whose autograd version counters
    are bumped, as a torch op's would be (autograd's in-place checks and version-keyed caches see the write)."""
    # FMA contraction off: the reference rounds every product and every sum separately (unpack_sum's acc + q*s).
    # The interpreter drops launch options it does not know.
    compiled = kernel[grid](*args, num_warps=num_warps, enable_fp_fusion=False, **meta)
    if writes:
        torch.autograd.graph.increment_version(writes)
    if not _interpreting() and compiled is not None:
        LAUNCHED.setdefault(kernel.fn.__name__, {})[id(compiled)] = compiled


def chunk_tables(layout: Chunks, device: torch.device):
    """Per-chunk first row (int32, + total), byte offset (int64, + total) and payload bytes (int64), cached (LRU).

    On CUDA a cache miss (every MoE step: its splits change) must not stall the host: the tables are built in
    pinned memory and copied asynchronously on the current stream (a pageable copy would synchronize). The
    pinned source stays referenced with the entry, as long as the device tables are cached (the copy may still
    be queued when this returns)."""
    key = (layout, device)
    entry = _TABLES.get(key)
    if entry is not None:
        _TABLES.move_to_end(key)
        return entry[0]
    n = len(layout.rows)
    pin = device.type == "cuda"
    host: tuple[torch.Tensor, ...] = (
        torch.tensor(list(layout.row_starts) + [layout.total_rows], dtype=torch.int32),
        torch.tensor(list(layout.offsets) + [layout.total_bytes], dtype=torch.int64),
        torch.tensor([layout.payload_bytes(c) for c in range(n)] or [0], dtype=torch.int64),
    )
    if pin:
        host = tuple(v.pin_memory() for v in host)
    t = tuple(v.to(device, non_blocking=True) for v in host) if device.type != "cpu" else host
    _TABLES[key] = (t, host)  # (the tables, their copy source): the source lives as long as the entry
    while len(_TABLES) > TABLES_MAX:
        _TABLES.popitem(last=False)
    return t
