"""Pipelining inside one call (CPU): how a big call is cut into pieces that quantize, travel and decode in turn.

Every rank must cut the same pieces (each is its own collective), so the plan depends only on sizes and options
every rank agrees on (checked by the metadata check when it runs).
"""

from __future__ import annotations

import torch

# Pipelining inside one call (CPU): pieces of at least this many elements, at most PIPELINE_MAX of them. Pieces
# >= COMPILE_MIN_NUMEL elements keep the compiled kernels; 8 pieces of a 16 Mi-element message measured
# best on the 2-core machine (docs/benchmarks.md).
PIPELINE_PIECE = 1 << 21
PIPELINE_MAX = 8
# A two-level all-gather ends with its last piece's node-local gather and decode (world x piece elements) after the
# link is done: pieces GATHER_SPLIT times smaller shorten that tail. They are planned from the rails' elements
# (nodes x shard), not the whole output: on CPU every piece costs each rank of a node a gather and one decode call
# per node-mate, on cores the node's ranks share (a 16 MiB bf16 call at 2x4: 2 pieces, not 8; docs/benchmarks.md).
GATHER_SPLIT = 2


def piece_count(numel: int | None, device: torch.device, rounding: str, pipeline: int, split: int = 1) -> int:
    """How many pipelined pieces one call travels in: 1 unless on CPU (where the codec costs as much as the wire;
    a GPU codec takes microseconds) with nearest rounding (stochastic rounding hashes the element index within
    one piece's layout). The same on every rank: it depends only on sizes and options the metadata check compares.
    split: automatic pieces this many times smaller than PIPELINE_PIECE elements of numel.
    """
    if device.type != "cpu" or rounding != "nearest":
        return 1
    # numel None: no size every rank agrees on (an all-to-all with its own splits, planned without sizes): one piece.
    auto = min(PIPELINE_MAX, numel * split // PIPELINE_PIECE) if numel is not None else 1
    return max(1, pipeline or auto)


def sized_plan(device: torch.device, rounding: str, pipeline: int) -> bool:
    """Whether piece_count depends on the message size here (CPU, nearest rounding, automatic pipelining): then
    every rank needs the same size, e.g. the all-to-all's largest message, exchanged when the splits are given."""
    return device.type == "cpu" and rounding == "nearest" and not pipeline


def plan_pieces(
    k: int,
    block: int | None,
    numel: int | None,
    device: torch.device,
    rounding: str,
    pipeline: int,
    split: int = 1,
) -> list[tuple[int, int]]:
    """Column ranges [a, b) of the K dim that travel as separate pieces: whole blocks each, equal but the last."""
    if k == 0 or block is None:
        return [(0, k)]
    nb = -(-k // block)
    p = min(piece_count(numel, device, rounding, pipeline, split), nb)
    if p == 1:
        return [(0, k)]
    w = -(-nb // p) * block
    return [(a, min(a + w, k)) for a in range(0, k, w)]


def row_part(n: int, p: int, pieces: int) -> tuple[int, int]:
    """Rows [a, b) of a chunk of n rows that travel in piece p of `pieces` (near-equal; sender and receiver agree)."""
    return n * p // pieces, n * (p + 1) // pieces
