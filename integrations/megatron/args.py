"""Megatron-LM argument plugin: `parse_args(extra_args_provider=add_args)` adds the fp8comm argument group.

Megatron's DDP config builder only copies args whose names match DistributedDataParallelConfig fields, so these
args reach nothing by themselves: call `install(args)` after parsing and before the model is built.
"""

from __future__ import annotations

import argparse

from .config import (
    CHECKS,
    EF_DTYPES,
    FORMATS,
    GRAD_FORMATS,
    HADAMARD,
    MOE_COMBINES,
    MOE_GRAD_WIRES,
    PARAM_UPDATE_FORMATS,
    ROUNDINGS,
    SCALINGS,
    Fp8CommMegatronConfig,
)

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
        help="precision of the error-feedback residuals: float32 (4 bytes per gradient element), bfloat16 (2) or "
        "fp8 (1: E5M2 codes with one power-of-two scale per bucket); fp32 and bf16 are accepted aliases "
        "(default %(default)s)",
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
        help="FP8 format for parameters (--fp8comm-param-gather) and MoE tokens (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-grad-format",
        dest="fp8comm_grad_fmt",
        choices=GRAD_FORMATS,
        default=None,  # None: not given (the planner refuses a given format); Fp8CommMegatronConfig's default
        help="wire format of --fp8comm-grad-reduce: FP8 (e4m3, e5m2: --fp8comm-block-size and --fp8comm-scaling "
        "apply) or 4 bits, whose block and scale kind are fixed by the format (mxfp4: 1x32 blocks, E8M0 scales; "
        "nvfp4: 1x16 blocks, E4M3 scales + one fp32 scale per chunk); --fp8comm-rounding and "
        f"--fp8comm-error-feedback apply to all; an error with --fp8comm-planner (default {_D.grad_fmt})",
    )
    g.add_argument(
        "--fp8comm-hadamard",
        type=int,
        choices=HADAMARD,
        default=_D.hadamard,
        help="4-bit gradients only: random block Hadamard transform of this many elements before quantizing "
        "(spreads outliers over the block; signs from one seed on every rank, the receiver inverts its fp32 sum); "
        "must fit the format's block (mxfp4: 16 or 32, nvfp4: 16); 0: none (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-param-update-format",
        dest="fp8comm_param_update_fmt",
        choices=PARAM_UPDATE_FORMATS,
        default=_D.param_update_fmt,
        help="4-bit weight updates for --use-distributed-optimizer: the parameter all-gather sends each shard's "
        "change since the last gather (fp32 master minus replica) in this format and every rank adds the decoded "
        "change to its replica (bit-identical on every rank; the quantization error is sent with the next change). "
        "Block and scale kind fixed by the format, as for --fp8comm-grad-format; replaces "
        "--fp8comm-param-gather; needs bf16/fp16 params; an error with --fp8comm-planner (default: off, "
        "Megatron's gather)",
    )
    g.add_argument(
        "--fp8comm-block-size",
        type=int,
        default=_D.block_size,
        help="elements per scale of the FP8 wires (e4m3/e5m2); the 4-bit formats fix theirs, and a "
        "non-default value with no FP8 wire in use is an error (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-scaling",
        choices=SCALINGS,
        default=_D.scaling,
        help="scale encoding of the FP8 wires: fp32 (exact), pow2 or e8m0 (one-byte power of two); the 4-bit "
        "formats fix theirs (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-rounding",
        choices=ROUNDINGS,
        default=_D.rounding,
        help="gradient rounding, FP8 or 4-bit (parameters, weight updates and tokens: nearest) (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-hierarchical",
        action=argparse.BooleanOptionalAction,
        default=_D.hierarchical,
        help="gradients and params: two levels, fp32/same bytes inside a node, FP8/4-bit across nodes, for each "
        "data-parallel group that spans nodes with more than one member on each (others run flat; nodes from "
        "GROUP_RANK / LOCAL_WORLD_SIZE, else host names); --no-fp8comm-hierarchical: flat (default %(default)s)",
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
    g.add_argument(
        "--fp8comm-planner",
        action="store_true",
        default=_D.planner,
        help="choose each DDP bucket's wire by predicted time, per bucket-size class and identically on every "
        "rank: Megatron's own collective, FP8 or (--fp8comm-planner-allow-4bit) 4 bits, flat or two-level (two "
        "levels only for data-parallel groups that --fp8comm-hierarchical splits). Turns on the collectives it "
        "chooses for: the gradient reduce-scatter / all-reduce (--fp8comm-grad-reduce) and, with "
        "--use-distributed-optimizer and bf16/fp16 params, the FP8 parameter all-gather (--fp8comm-param-gather); "
        "an error with --fp8comm-grad-format or --fp8comm-param-update-format (the planner picks the format). Rank "
        "0 logs each size class's plan (predicted ms per option, the one chosen); comm_stats() gains predicted_s "
        "and measured_s per collective. Calibration: --fp8comm-planner-calibration, else measured over the world "
        "at install (gloo only)",
    )
    g.add_argument(
        "--fp8comm-planner-allow-4bit",
        action="store_true",
        default=_D.planner_allow_4bit,
        help="the planner may put gradient buckets on 4 bits: the validated recipe, mxfp4 with error feedback and "
        "nearest rounding (the residual: --fp8comm-error-feedback-dtype); weights stay at most FP8. Implies "
        "--fp8comm-planner; an error with --fp8comm-hadamard or --fp8comm-rounding stochastic",
    )
    g.add_argument(
        "--fp8comm-planner-calibration",
        metavar="FILE",
        default=_D.planner_calibration,
        help="the planner's calibration: a file written by `fp8comm calibrate --out FILE` on the same kind of "
        "device and ranks per node (checked at install, before any bytes move; needed on NCCL). Implies "
        "--fp8comm-planner (default: measured over the world at install, gloo only)",
    )
    g.add_argument(
        "--fp8comm-planner-timeout",
        dest="fp8comm_planner_timeout_s",
        type=float,
        default=_D.planner_timeout_s,
        help="seconds the planner's measurement at install may take; past it every rank uses the fixed choice "
        "(FP8, two levels where a group spans nodes) with one warning (default %(default)s)",
    )
    g.add_argument(
        "--fp8comm-planner-trials",
        action=argparse.BooleanOptionalAction,
        default=_D.planner_trials,
        help="a size class whose plan measures slower than another option's prediction runs that option for a few "
        "calls and keeps the faster as measured, agreed by every rank of the group (logged); "
        "--no-fp8comm-planner-trials: the prediction alone, so a calibration file fixes every choice "
        "(default %(default)s)",
    )
    return parser
