"""Bytes on the inter-node link per node (fp8comm/tools/bench/ring.py, scaling.py): from fp8comm's statistics for
flat and two-level calls, from the algorithm for torch's gloo and the ring rows, and the counter-vs-model flag."""

from __future__ import annotations

import json

import pytest

from fp8comm.tools.bench import ring, scaling


def _stats(**ops):
    return {op.replace("__", "."): {"calls": c, "wire_bytes": w, "dtype_bytes": w} for op, (c, w) in ops.items()}


def test_cross_node_bytes_counts_the_chunks_for_other_nodes():
    # 2 nodes x 4 ranks, rank 5 (node 1): destinations 0-3 are on node 0
    per_dest = [10, 20, 30, 40, 1, 0, 2, 3]
    assert ring.cross_node_bytes(per_dest, 5, 4) == 100
    assert ring.cross_node_bytes(per_dest, 0, 4) == 6


@pytest.mark.parametrize(("g", "n"), [(2, 2), (4, 2), (2, 3), (8, 4)])
def test_flat_call_from_stats(g, n):
    """A flat call records every remote chunk (world-1 equal chunks); g*(n-1) of each rank's destinations are on
    other nodes, and every one of the node's g ranks sends alike: g * g(n-1)/(gn-1) of one rank's bytes."""
    world = g * n
    chunk = 1000
    st = _stats(reduce_scatter=(1, (world - 1) * chunk))
    assert ring.stats_link_bytes_per_node(st, "reduce_scatter", world, g) == g * g * (n - 1) * chunk
    # several calls in the stats: per invocation (4 async buckets = 1 invocation of 4 calls)
    # all_gather: the backend's ring, so one rank per node crosses with every chunk it sends (world-1)
    st = _stats(all_gather=(12, 3 * 4 * (world - 1) * chunk))
    assert ring.stats_link_bytes_per_node(st, "all_gather", world, g, invocations=3) == 4 * (world - 1) * chunk
    # all_reduce: its reduce-scatter half per destination, its all-gather half as a ring
    st = _stats(all_reduce=(1, 2 * (world - 1) * chunk))
    assert ring.stats_link_bytes_per_node(st, "all_reduce", world, g) == g * g * (n - 1) * chunk + (world - 1) * chunk


@pytest.mark.parametrize("g,n", [(1, 2), (2, 2), (4, 2), (2, 4), (8, 8)])
def test_baselines_agree_with_the_byte_model(g, n):
    """ring.py's closed forms (kept for A/B runs of older checkouts) are the byte model's (comm/linkmodel.py)."""
    from fp8comm.comm import linkmodel

    w, count = g * n, g * n * 4096
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        for isz, dt in ((2, "bf16"), (4, "fp32")):
            assert (
                ring.ring_link_bytes_per_node(op, count, isz, w, g)
                == linkmodel.bytes(op, "ring", dt, g, n, count).inter_node
            )
            assert (
                ring.torch_gloo_link_bytes_per_node(op, count, isz, w, g)
                == linkmodel.bytes(op, "gloo", dt, g, n, count).inter_node
            )
    assert (
        ring.torch_gloo_link_bytes_per_node("all_to_all", count, 2, w, g)
        == linkmodel.bytes("all_to_all", "gloo", "bf16", g, n, count).inter_node
    )


def test_two_level_call_from_stats():
    """Two-level: "X" is the rail phase (all of it crosses), "X.intra" stays inside the node."""
    st = _stats(reduce_scatter=(1, 3 * 500), reduce_scatter__intra=(1, 7777))
    assert ring.stats_link_bytes_per_node(st, "reduce_scatter", 16, 4) == 4 * 3 * 500
    assert ring.stats_link_bytes_per_node(st, "all_gather", 16, 4) == 0  # no such op recorded
    assert ring.stats_link_bytes_per_node(st, "reduce_scatter", 4, 4) == 0  # one node: nothing crosses


def test_algorithm_counts():
    count, W, g = 8 * 1024, 8, 4  # the full buffer; chunk = 1024 elements
    chunk = count // W * 2
    # ring: one rank per node sends on each of the world-1 steps of every phase
    assert ring.ring_link_bytes_per_node("reduce_scatter", count, 2, W, g) == 7 * chunk
    assert ring.ring_link_bytes_per_node("all_gather", count, 2, W, g) == 7 * chunk
    assert ring.ring_link_bytes_per_node("all_reduce", count, 2, W, g) == 14 * chunk
    assert ring.ring_link_bytes_per_node("reduce_scatter", count, 2, 4, 4) == 0
    # torch gloo: reduce-scatter = ring all-reduce (twice the ring reduce-scatter); all-to-all direct
    assert ring.torch_gloo_link_bytes_per_node("reduce_scatter", count, 2, W, g) == 14 * chunk
    assert ring.torch_gloo_link_bytes_per_node("all_gather", count, 2, W, g) == 7 * chunk
    assert ring.torch_gloo_link_bytes_per_node("all_to_all", count, 2, W, g) == g * g * chunk
    # the measured 2x2 figures of docs/benchmarks.md (64 MiB bf16 per rank): 100.9 MB for torch's reduce-scatter
    n = 32 << 20
    assert ring.torch_gloo_link_bytes_per_node("reduce_scatter", n, 2, 4, 2) == pytest.approx(100.9e6, rel=0.01)
    assert ring.torch_gloo_link_bytes_per_node("all_gather", 4 * n, 2, 4, 2) == pytest.approx(201.7e6, rel=0.01)


def test_scaling_model_and_flag():
    n, W, g = 4 * 4096 * 8, 8, 4
    assert scaling.model_link_bytes("rs.bf16_ring", n, W, g, None, 3) == 7 * (n // W) * 2
    assert scaling.model_link_bytes("ag.bf16_ring", n, W, g, None, 3) == 7 * n * 2
    assert scaling.model_link_bytes("rs.fp32", n, W, g, None, 3) == 14 * (n // W) * 4
    assert scaling.model_link_bytes("codec.rs", n, W, g, None, 3) is None
    st = _stats(reduce_scatter=(3, 3 * 7 * 100))
    assert scaling.model_link_bytes("rs.fp8", n, W, g, st, 3) == 4 * 4 * 100
    # beyond 10% (+ 32 KiB for the barrier and ACKs) of the model
    assert scaling.link_flag(10**6, 1.04e6) == "" and scaling.link_flag(10**6, 1.2e6) == "!"
    assert scaling.link_flag(139264, 153628) == ""  # a 1 MiB two-level rail phase: TCP/IP overhead, not a finding
    assert scaling.link_flag(8650752, 3809502) == "!"  # flat FP8 all-gather: stats per destination, gloo rings
    assert scaling.link_flag(None, 5) == "" and scaling.link_flag(1000, None) == ""


def test_refused_names_the_hierarchical_refusal():
    """4-bit two-level rows are skipped (with the reason) when this fp8comm refuses them; other errors propagate."""
    from fp8comm.errors import Fp8CommConfigError

    def refuse():
        raise Fp8CommConfigError("hierarchical mode has no 4-bit wire yet")

    def broken():
        raise Fp8CommConfigError("something else")

    assert "hierarchical mode has no 4-bit wire" in scaling._refused(refuse)
    assert scaling._refused(lambda: None) is None
    with pytest.raises(Fp8CommConfigError):
        scaling._refused(broken)


def test_report_shows_model_bytes_flags_and_names_baselines(tmp_path):
    meta = {
        "nodes": 2,
        "ranks_per_node": 4,
        "world": 8,
        "rate": "1gbit",
        "reps": 3,
        "warmup": 1,
        "threads": 1,
        "machine": "test",
        "date": "2026-01-01 00:00 UTC",
        "torch": "x",
        "load": "0.1",
    }

    def row(key, ms, link, model, flag=""):
        return {
            "key": key,
            "mib": 32.0,
            "elements": 32 << 19,
            "median_s": ms / 1e3,
            "times_s": [ms / 1e3] * 3,
            "link_tx_bytes": link,
            "model_link_bytes": model,
            "link_flag": flag,
        }

    rows = [
        row("rs.fp8", 200, 35e6, 34e6),
        row("rs.bf16", 900, 101e6, 100e6),
        row("rs.bf16_ring", 500, 51e6, 50e6),
        row("ag.fp8", 500, 104e6, 138e6, "!"),
        row("ag.bf16", 1000, 202e6, 201e6),
    ]
    (tmp_path / "coll_n2.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    text = scaling.report(tmp_path)
    assert "| rs.bf16 | 900 | **4.50x** | 35.0 / 101.0 |" in text
    assert "| 34.0 / 100.0 | ok | torch gloo bf16 (ring all-reduce) |" in text
    assert "| rs.bf16_ring | 500 | **2.50x** |" in text and "| bf16 ring |" in text
    assert "| 138.0 / 201.0 | ! FP8 differs | torch gloo bf16 (ring) |" in text
    assert "4 ranks per node" in text
