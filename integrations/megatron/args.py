"""Megatron-LM argument plugin: `parse_args(extra_args_provider=add_args)` adds the fp8comm argument group.

Megatron's DDP config builder only copies args whose names match DistributedDataParallelConfig fields, so these
args reach nothing by themselves: call `install(args)` after parsing and before the model is built.
"""

from __future__ import annotations

import argparse

from .config import CHECKS, EF_DTYPES, FORMATS, MOE_COMBINES, MOE_GRAD_WIRES, ROUNDINGS, SCALINGS, Fp8CommMegatronConfig

_D = Fp8CommMegatronConfig()  # one source of defaults for argparse, keywords and docs


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `fp8comm` group to a Megatron-LM parser and return it (the extra_args_provider contract)."""
    g = parser.add_argument_group(
        title="fp8comm",
        description="FP8 communication (fp8comm) for Megatron-Core: "
        "see docs/megatron.md; takes effect only through install(args)",
    )
    g.add_argument(
        "--fp8comm-grad-reduce",
        action="store_true",
        default=_D.grad_reduce,
        help="FP8 gradient reduction in DDP: the reduce-scatter of --use-distributed-optimizer, or plain "
        "DDP's all-reduce (FP8 reduce-scatter, fp32 sum, FP8 all-gather of the sums); each rank quantizes with "
        "its own block scales, the receiver sums in fp32",
    )
    g.add_argument(
        "--fp8comm-param-gather",
        action="store_true",
        default=_D.param_gather,
        help="FP8 parameter all-gather of the distributed optimizer (needs --bf16 or --fp16 params so "
        "the fp32 master weights are separate)",
    )
    g.add_argument(
        "--fp8comm-moe-dispatch",
        action="store_true",
        default=_D.moe_dispatch,
        help="FP8 token dispatch (1xB scales per token) in the alltoall or allgather MoE dispatcher; "
        "probs and routing stay in the model dtype",
    )
    g.add_argument(
        "--fp8comm-moe-combine",
        choices=MOE_COMBINES,
        default=_D.moe_combine,
        help="MoE combine (expert outputs back): native = Megatron's own collective, bf16 or fp8 "
        "through fp8comm (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-error-feedback",
        action="store_true",
        default=_D.error_feedback,
        help="error feedback for --fp8comm-grad-reduce: each bucket's quantization residual is added "
        "to the next step's gradients (+4 bytes per gradient element in fp32, +2 in bf16)",
    )
    g.add_argument(
        "--fp8comm-error-feedback-dtype",
        choices=EF_DTYPES,
        default=_D.error_feedback_dtype,
        help="dtype of the error-feedback residuals (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-guard",
        action="store_true",
        default=_D.guard,
        help="numerics guard: per bucket, count what FP8 could not hold (saturated, underflowed to "
        "zero); a bucket over --fp8comm-guard-threshold for --fp8comm-guard-patience steps sends "
        "Megatron's own bf16 collective for --fp8comm-guard-cooldown steps (docs/megatron.md)",
    )
    g.add_argument(
        "--fp8comm-guard-threshold",
        type=float,
        default=_D.guard_threshold,
        help="fraction of a bucket's elements per step (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-guard-patience",
        type=int,
        default=_D.guard_patience,
        help="steps over the threshold before falling back (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-guard-cooldown",
        type=int,
        default=_D.guard_cooldown,
        help="steps in bf16 before FP8 is tried again (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-format",
        dest="fp8comm_fmt",
        choices=FORMATS,
        default=_D.fmt,
        help="FP8 format for parameters and MoE tokens (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-grad-format",
        dest="fp8comm_grad_fmt",
        choices=FORMATS,
        default=_D.grad_fmt,
        help="FP8 format for gradients (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-block-size", type=int, default=_D.block_size, help="elements per scale (default %(default)s)"
    )
    g.add_argument(
        "--fp8comm-scaling",
        choices=SCALINGS,
        default=_D.scaling,
        help="scale encoding: fp32 (exact), pow2 or e8m0 (one-byte power of two) (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-rounding", choices=ROUNDINGS, default=_D.rounding, help="gradient rounding (default %(default)s)"
    )
    g.add_argument(
        "--fp8comm-hierarchical",
        action="store_true",
        default=_D.hierarchical,
        help="gradients and params: fp32/same-bytes inside a node, FP8 across nodes (node size from LOCAL_WORLD_SIZE)",
    )
    g.add_argument(
        "--fp8comm-check",
        choices=CHECKS,
        default=_D.check,
        help="cross-rank metadata check: on the first call per buffer, every call, or never (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-moe-grad-wire",
        choices=MOE_GRAD_WIRES,
        default=_D.moe_grad_wire,
        help="wire for the MoE backward (token gradients of a hooked dispatch/combine) (default %(default)s)",
    )
    return parser
