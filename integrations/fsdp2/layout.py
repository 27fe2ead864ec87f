"""How FSDP2 lays out its flat collective buffers, and the FSDP2 internals fp8comm reads to know it.

All-gather input (one rank): every parameter's padded shard back to back (`all_gather_copy_in`), in
`fsdp_params` order; output [world, n] row r = rank r's input. Reduce-scatter input [world, L]: row r holds rank
r's chunk of every parameter that has a gradient (`chunk_cat` of each gradient padded along dim 0 to a multiple
of world), so the chunks in a row are the padded sharded sizes; output = row `rank` of the reduction.
`spans` maps these onto a wire layout where every parameter starts a new 1 x block_size block.
"""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import ReduceOp

from .config import Fp8CommFsdp2Error

# Private FSDP2 names read here and in enable.py; check_fsdp2_internals() fails loudly when torch renames one.
FSDP2_INTERNALS = {
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup": (
        "fsdp_params",
        "mesh_info",
        "mp_policy",
        "_all_gather_comm",
        "_reduce_scatter_comm",
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam": (
        "sharded_state",
        "padded_sharded_param_size",
        "_sharded_param_data",
        "sharded_param",
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState": ("_fsdp_param_groups",),
    "torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo": (),
}


def check_fsdp2_internals() -> list[str]:
    """Missing FSDP2 names this adapter depends on ([] when the installed torch has them all)."""
    import importlib
    import inspect

    missing = []
    for path, attrs in FSDP2_INTERNALS.items():
        mod, _, cls_name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), cls_name)
        except (ImportError, AttributeError):
            missing.append(path)
            continue
        src = inspect.getsource(cls)
        missing += [f"{path}.{a}" for a in attrs if f"self.{a}" not in src and f"def {a}" not in src]
    return missing


def ag_sizes(param_group, n: int) -> list[int] | None:
    """Per-parameter element counts of an n-element all-gather input of `param_group` (None: unknown layout)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    sizes = []
    for fp in param_group.fsdp_params:
        if fp.sharded_state == ShardedState.SHARDED:
            sizes.append(fp._sharded_param_data.numel())
        else:  # SHARDED_POST_FORWARD (reshard_after_forward=int): the smaller post-forward shard
            data = getattr(fp, "_sharded_post_forward_param_data", None)
            if data is None:
                return None
            sizes.append(data.numel())
    return sizes if sum(sizes) == n else None


def rs_sizes(param_group, L: int) -> list[int] | None:
    """Per-parameter chunk sizes of one row (L elements) of `param_group`'s reduce-scatter input (None: unknown).

    FSDP2 reduces only parameters that got a gradient: all of them, or (frozen parameters excluded) those that
    require one; any other subset cannot be told from the sizes, and the call travels unaligned (counted)."""
    params = param_group.fsdp_params
    for subset in (params, [fp for fp in params if fp.sharded_param.requires_grad]):
        sizes = [fp.padded_sharded_param_size.numel() for fp in subset]
        if sum(sizes) == L:
            return sizes
    return None


def spans(sizes: list[int], block: int, align: bool) -> tuple[list[tuple[int, int, int]], int]:
    """([(offset, wire offset, size)], wire length): each size starts a new block when `align`, else one run."""
    total = sum(sizes)
    if not align:
        return [(0, 0, total)], total
    out, off, woff = [], 0, 0
    for n in sizes:
        out.append((off, woff, n))
        off += n
        woff += -(-n // block) * block
    return out, woff


def is_identity(sp: list[tuple[int, int, int]], n: int, wire_n: int) -> bool:
    return wire_n == n and all(o == w for o, w, _ in sp)


def pack_rows(src: torch.Tensor, sp, wire_n: int, factor: float | None = None) -> torch.Tensor:
    """src [rows, n] -> a zero-padded [rows, wire_n] copy in the wire layout (times `factor` when given)."""
    out = torch.zeros(src.shape[0], wire_n, dtype=src.dtype, device=src.device)
    for off, woff, k in sp:
        out[:, woff : woff + k].copy_(src[:, off : off + k])
    if factor is not None:
        out.mul_(factor)
    return out


def unpack_rows(dst: torch.Tensor, src: torch.Tensor, sp) -> None:
    """dst [rows, n] <- src [rows, wire_n] in the wire layout (padding dropped)."""
    for off, woff, k in sp:
        dst[:, off : off + k].copy_(src[:, woff : woff + k])


def reduce_op(op) -> tuple[str, float | None]:
    """("sum" | "avg", premultiply factor or None) for the op FSDP2 passes; Fp8CommFsdp2Error for any other op.

    FSDP2 passes AVG, SUM (then divides before/after itself), or PREMUL_SUM(1/factor) from
    set_gradient_divide_factor: NCCL multiplies every input by the factor before summing, so do we."""
    kind, factor = op, None
    if not isinstance(op, ReduceOp.RedOpType) and isinstance(op, ReduceOp):  # a ReduceOp object (PREMUL_SUM)
        kind = op.op  # type: ignore[attr-defined]  # the stubs omit it
        if kind == ReduceOp.PREMUL_SUM:
            factor = getattr(op, "factor", None)
            if not isinstance(factor, float):
                raise Fp8CommFsdp2Error(
                    f"PREMUL_SUM with a tensor factor ({type(factor).__name__}) is not supported "
                    "by the fp8comm FSDP2 reduce-scatter; pass a float gradient divide factor"
                )
            return "sum", factor
    if kind == ReduceOp.SUM:
        return "sum", None
    if kind == ReduceOp.AVG:
        return "avg", None
    raise Fp8CommFsdp2Error(
        f"the fp8comm FSDP2 reduce-scatter supports SUM, AVG and PREMUL_SUM; FSDP2 passed {op!r} "
        "(disable the gradient hook with enable(model, gradients=False) for this setup)"
    )
