"""Input validation and the cross-rank metadata check that turns would-be hangs into errors on every rank.

Local problems (dtype, contiguity, split sums) are found first. A checked call then all-gathers a small int64
descriptor (op, dtype, format, scaling, shape, splits, local error code) on every rank and compares all of them;
any disagreement or local error raises the same error on every rank before any payload moves. Cost per checked
call: one all_gather of (16 + 2*world) int64 plus reading it on the host (a device sync on GPU).

Which calls are checked: the check policy (WireConfig.check, default from FP8COMM_CHECK), decided by
CommState.should_check: "first" (default) checks the first 3 calls of each op on each group, then none, so steady
state has no extra collective and no host sync; "always" checks every call (debugging), "never" none.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import CommMismatchError, Fp8CommError
from ..quant.formats import FLOAT8_DTYPES
from ..quant.layout import view_2d
from ..quant.scaling import ENCODINGS
from ..quant.tensor import Fp8Tensor
from .config import WireSpec

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_to_all.backward")
ERROR_KINDS = ("", "dtype", "contiguity", "shape", "splits", "device", "option", "group")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAGIC = 0xF8C0
_FIXED = 17
WIRE_NAMES = ("e4m3", "e5m2", "mxfp4", "nvfp4")


def tensor_problem(t, what: str, allow_0d: bool = False) -> tuple[str, str] | None:
    """(kind, message) if `t` cannot go through an FP8 collective, else None."""
    if not isinstance(t, torch.Tensor):
        return "dtype", f"{what} must be a torch.Tensor, got {type(t).__name__}"
    if t.dtype in FLOAT8_DTYPES:
        return "dtype", (
            f"{what} is {t.dtype}: pass the bf16/fp16/fp32 tensor and fp8comm quantizes it (FP8 "
            f"crosses the wire as uint8 bytes with its scales; gloo rejects float8 tensors outright)"
        )
    if t.dtype not in _DTYPES:
        return "dtype", f"{what} must be float32, bfloat16, float16 or float64, got {t.dtype}"
    if not t.is_contiguous():
        return (
            "contiguity",
            f"{what} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); call "
            ".contiguous() first (fp8comm never copies a buffer silently)",
        )
    if t.dim() == 0 and not allow_0d:
        return "shape", f"{what} is 0-d; collectives work along dim 0 (reshape it to [1])"
    return None


def out_problem(out, shape: tuple, dtype, device, fp8_spec=None) -> tuple[str, str] | None:
    """Problems of a caller-supplied output: a tensor (shape, dtype, contiguous, device) or, for FP8 outputs
    (fp8_spec given), an Fp8Tensor whose codes, scales, format and block scaling match what the call produces."""
    shape = tuple(shape)
    if fp8_spec is not None:
        if not isinstance(out, Fp8Tensor):
            return "dtype", f"out must be an Fp8Tensor for fp8_out=True, got {type(out).__name__}"
        want = fp8_spec.scaling.scale_shape(*view_2d(shape))
        if tuple(out.shape) != shape or tuple(out.scale.shape) != want:
            return "shape", (
                f"out has shape {tuple(out.shape)} with scales {tuple(out.scale.shape)}, expected {shape}"
                f" with scales {want}"
            )
        if out.fmt.name != fp8_spec.fmt.name or out.scaling != fp8_spec.scaling:
            return "option", (
                f"out is {out.fmt.name} with {out.scaling.describe()} scales, the call produces "
                f"{fp8_spec.fmt.name} with {fp8_spec.scaling.describe()}"
            )
        if out.scale.dtype != torch.float32 or not out.data.is_contiguous() or not out.scale.is_contiguous():
            return "contiguity", "out needs contiguous codes and contiguous fp32 scales"
        if out.data.device != device or out.scale.device != device:
            return "device", f"out is on {out.data.device}, the input on {device}"
        return None
    if not isinstance(out, torch.Tensor):
        return "dtype", f"out must be a torch.Tensor, got {type(out).__name__}"
    if tuple(out.shape) != shape or out.dtype != dtype:
        return "shape", f"out is {out.dtype} {tuple(out.shape)}, expected {dtype} {shape}"
    if not out.is_contiguous():
        return "contiguity", "out is not contiguous"
    if out.device != device:
        return "device", f"out is on {out.device}, the input on {device}"
    if out.requires_grad:
        return "option", "out requires grad; outputs written in place cannot carry autograd history"
    return None


def group_rank_size(group) -> tuple[int, int]:
    """(rank in group, group size); clear errors when torch.distributed is not ready or we are not a member."""
    if not dist.is_available() or not dist.is_initialized():
        raise Fp8CommError("torch.distributed is not initialized; call dist.init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise Fp8CommError(f"this process (global rank {dist.get_rank()}) is not a member of the group it passed")
    return rank, dist.get_world_size(group)


def meta_device(group) -> torch.device:
    """Where the descriptor lives: CPU for gloo/mpi groups, the current CUDA device for NCCL-only groups."""
    be = str(dist.get_backend(group)).lower()
    if "nccl" in be and "gloo" not in be and "mpi" not in be:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Meta:
    """What one rank is about to do; compared across ranks by `exchange`."""

    op: str
    spec: WireSpec | None = None
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    reduce_op: int = 0  # 0 sum, 1 avg; for all_to_all the wire mode
    hier: int = 0  # node size in hierarchical mode, 0 when flat
    pipeline: int = 0  # pieces per call (0 auto, 1 none): ranks must cut the same pieces
    in_splits: list[int] = field(default_factory=list)
    out_splits: list[int] = field(default_factory=list)
    error: tuple[str, str] | None = None  # (kind, message) of a local problem
    table: list | None = None  # every rank's descriptor after a checked exchange (None when the check is off)

    def max_tokens(self, world: int) -> tuple[int, int] | None:
        """(max over ranks of tokens sent, of tokens received) from the exchanged splits; None without a check."""
        if self.table is None:
            return None
        return (
            max(sum(r[_FIXED : _FIXED + world]) for r in self.table),
            max(sum(r[_FIXED + world : _FIXED + 2 * world]) for r in self.table),
        )

    def fail(self, problem: tuple[str, str] | None) -> None:
        if problem is not None and self.error is None:
            self.error = problem

    def encode(self, world: int) -> torch.Tensor:
        v = [0] * (_FIXED + 2 * world)
        v[0], v[1] = _MAGIC, OPS.index(self.op)
        v[2] = ERROR_KINDS.index(self.error[0]) if self.error else 0
        if self.error is None:
            v[3] = _DTYPES.index(self.dtype) + 1 if self.dtype in _DTYPES else 0
            if self.spec is not None:
                s = self.spec
                v[4] = 1 + WIRE_NAMES.index(s.wire_name)
                v[16] = (s.hadamard << 32) | s.hadamard_seed if s.hadamard else 0
                v[5] = 1 + ENCODINGS.index(s.scaling.encoding)
                v[6] = s.scaling.cols or 0
                v[7] = s.scaling.margin + 100
                v[8] = 1 + ("nearest", "stochastic").index(s.rounding)
            numel = 1
            for d in self.shape:
                numel *= d
            v[9] = numel
            v[10] = self.shape[0] if self.shape else 0
            v[11] = numel // self.shape[0] if self.shape and self.shape[0] else 0
            v[12] = zlib.crc32(repr(tuple(self.shape[1:])).encode())
            v[13] = self.reduce_op
            v[14] = self.hier
            v[15] = self.pipeline
            v[_FIXED : _FIXED + len(self.in_splits)] = self.in_splits
            v[_FIXED + world : _FIXED + world + len(self.out_splits)] = self.out_splits
        return torch.tensor(v, dtype=torch.int64)


_FIELD_NAMES = {
    3: "input dtype",
    4: "wire format",
    5: "scale encoding",
    6: "block size",
    7: "scale margin",
    8: "rounding",
    13: "reduce op / wire mode",
    14: "hierarchical node size",
    15: "pipeline pieces",
    16: "Hadamard transform (size << 32 | sign seed)",
}


def exchange(
    meta: Meta, group, rank: int, world: int, check: bool, defer: bool = False
) -> tuple[int, Callable[[], None]]:
    """Raise a clear error on every rank if any rank's input is bad or ranks disagree; returns (bytes sent, settle).

    defer=True (and no local problem): the table travels while the caller quantizes its first piece; settle()
    waits for it and raises exactly like the undeferred check. Call it before the first payload collective.
    Otherwise the check is done on return and settle() does nothing.
    """
    name = f"fp8comm.{meta.op}"
    if not check:
        if meta.error:
            raise Fp8CommError(f"{name}: {meta.error[1]}")
        return 0, settled
    mine = meta.encode(world)
    dev = meta_device(group)
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=dev)
    defer = defer and meta.error is None
    work = _all_gather_flat(table, mine.to(dev), group, async_op=defer)

    def settle() -> None:
        if work is not None:
            work.wait()
        rows = table.view(world, -1).cpu().tolist()  # the host sync this check costs on GPU
        _compare(meta, rows, rank, name)
        meta.table = rows

    if not defer:
        settle()
        settle = settled
    return mine.numel() * 8 * (world - 1), settle


def exchange_sizes(values: list[int], group, world: int) -> tuple[list[list[int]], int]:
    """Every rank's `values` (the same count on each rank), by one small all_gather; (rows by rank, bytes sent).

    For plans every rank must agree on (the all-to-all's piece count) when the metadata check's table is absent.
    It reads the result on the host: callers use it where that is no device sync (CPU groups)."""
    mine = torch.tensor(values, dtype=torch.int64)
    dev = meta_device(group)
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=dev)
    _all_gather_flat(table, mine.to(dev), group)
    return table.view(world, -1).cpu().tolist(), mine.numel() * 8 * (world - 1)


def settled() -> None:
    """The settle() of a check that is already done (or off)."""


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    # all_gather_into_tensor is deprecated in torch 2.13 in favour of all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _compare(meta: Meta, rows: list[list[int]], rank: int, name: str) -> None:
    world = len(rows)
    if any(r[0] != _MAGIC for r in rows) or len({r[1] for r in rows}) > 1:
        ops = [OPS[r[1]] if r[0] == _MAGIC and 0 <= r[1] < len(OPS) else "?" for r in rows]
        raise CommMismatchError(
            f"{name}: ranks are running different collectives ({ops} by rank); every rank "
            "of the group must make the same fp8comm calls in the same order"
        )
    bad = [i for i, r in enumerate(rows) if r[2]]
    if bad:
        if meta.error:
            raise Fp8CommError(f"{name}: {meta.error[1]}")
        kinds = {i: ERROR_KINDS[rows[i][2]] for i in bad}
        raise Fp8CommError(
            f"{name}: rank(s) {bad} rejected their input ({kinds}); see the error on those ranks. No data was sent."
        )
    hint = " (found by the metadata check before any data moved; it can be disabled with check=False)"
    for idx, label in _FIELD_NAMES.items():
        vals = [r[idx] for r in rows]
        if len(set(vals)) > 1:
            raise CommMismatchError(f"{name}: ranks disagree on the {label} (per rank: {_decode(idx, vals)}){hint}")
    if meta.op == "all_to_all" or meta.op == "all_to_all.backward":
        widths = [r[11] for r in rows if r[10]]
        if len(set(widths)) > 1:
            raise CommMismatchError(
                f"{name}: ranks disagree on the token width (elements per row, per rank with tokens: {widths}){hint}"
            )
        send = [r[_FIXED : _FIXED + world] for r in rows]
        recv = [r[_FIXED + world : _FIXED + 2 * world] for r in rows]
        for i in range(world):
            for j in range(world):
                if send[i][j] != recv[j][i]:
                    raise CommMismatchError(
                        f"{name}: rank {i} sends {send[i][j]} rows to rank {j}, which expects {recv[j][i]} "
                        f"(input_split_sizes[{j}] on rank {i} must equal output_split_sizes[{i}] on rank {j}){hint}"
                    )
    else:
        numels = [r[9] for r in rows]
        if len(set(numels)) > 1:
            raise CommMismatchError(
                f"{name}: ranks disagree on the input size (numel per rank: {numels}); every "
                f"rank must pass a tensor of the same shape{hint}"
            )
        shapes = [(r[10], r[11], r[12]) for r in rows]
        if len(set(shapes)) > 1:
            raise CommMismatchError(
                f"{name}: ranks pass the same number of elements in different shapes (dim 0 "
                f"per rank: {[s[0] for s in shapes]}){hint}"
            )


def _decode(idx: int, vals: list[int]) -> list:
    if idx == 3:
        return [str(_DTYPES[v - 1]) if v else "?" for v in vals]
    if idx == 4:
        return [WIRE_NAMES[v - 1] if v else "?" for v in vals]
    if idx == 5:
        return [ENCODINGS[v - 1] if v else "?" for v in vals]
    if idx == 8:
        return [("nearest", "stochastic")[v - 1] if v else "?" for v in vals]
    if idx == 7:
        return [v - 100 for v in vals]
    return vals


def split_problem(splits, world: int, total: int | None, what: str) -> tuple[str, str] | None:
    """(kind, message) if `splits` is not `world` non-negative ints (summing to `total` when given)."""
    if len(splits) != world:
        return "splits", f"{what} has {len(splits)} entries, the group has {world} ranks"
    if any(s < 0 for s in splits):
        return "splits", f"{what} has negative entries: {list(splits)}"
    if total is not None and sum(splits) != total:
        return "splits", f"{what} sums to {sum(splits)} but the tensor has {total} rows: {list(splits)}"
    return None


def as_int_list(splits) -> list[int] | None:
    """Split sizes from a list/tuple/tensor (host values; a device tensor costs one sync)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(v) for v in splits.reshape(-1).tolist()]
    return [int(v) for v in splits]
