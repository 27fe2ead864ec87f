"""Per-engine scope (scenario "zero"): engines with different fp8_comm sections, or none, in one process.

Imported by ds_worker.py after cpu.prepare().
"""

from __future__ import annotations

import ds_train as T
from ds_common import SMALL_BUCKET, baseline

import fp8comm.comm as fc
import fp8comm.integrations.deepspeed as fd


def engines_per_scope(info):
    """Engines with different fp8_comm sections, or none, in one process (RLHF builds actor, critic, reference and
    reward engines): each gets exactly its own config. Unflagged engines are built before and after the flagged
    ones; steps interleave. Every engine's losses equal the same engine trained alone (the unflagged ones: without
    fp8comm at all), the unflagged ones never call fp8comm.comm, and each flagged one calls it with its own format."""
    steps = 5
    cfgs = {
        "plain3": T.ds_config(3, "bf16"),  # built first, no section (be321a2 sent FP8 for it)
        "fp8_3": T.ds_config(3, "bf16", {"gemm": False}),
        "e5m2_2": T.ds_config(
            2, "bf16", {"gemm": False, "weights": False, "gradients": {"fmt": "e5m2"}}, reduce_bucket_size=SMALL_BUCKET
        ),
        "plain2": T.ds_config(2, "bf16", reduce_bucket_size=SMALL_BUCKET),
    }  # built last (be321a2 refused it)
    alone = {}
    for name, cfg in cfgs.items():
        if name.startswith("plain"):  # DeepSpeed alone: the cached baseline run of the same config (30 steps)
            alone[name] = baseline(cfg)[:steps]
            continue
        eng, _ = T.build(cfg)
        alone[name] = T.train(eng, range(steps)).losses
        T.destroy(eng)
        fd.uninstall()
    calls = {name: {} for name in cfgs}
    phase = [None]
    originals = {f: getattr(fc, f) for f in ("all_gather_into", "reduce_scatter_into", "all_to_all")}

    def spy(f):
        def call(*a, **k):
            key = f"{f}:{k['config'].fmt}"
            calls[phase[0]][key] = calls[phase[0]].get(key, 0) + 1
            return originals[f](*a, **k)

        return call

    engines = {name: T.build(cfg)[0] for name, cfg in cfgs.items()}
    losses = {name: [] for name in cfgs}
    try:
        for f in originals:
            setattr(fc, f, spy(f))
        for step in range(steps):
            for name, eng in engines.items():
                phase[0] = name
                before = sum(v["calls"] for v in fc.comm_stats().values())
                losses[name] += T.train(eng, range(step, step + 1)).losses
                if name.startswith("plain"):
                    assert sum(v["calls"] for v in fc.comm_stats().values()) == before, f"{name} called fp8comm"
    finally:
        for f, fn in originals.items():
            setattr(fc, f, fn)
    stats = {name: fd.hook_stats(eng) for name, eng in engines.items()}
    info.update(
        calls=calls, passthrough=fd.passthrough_stats(), summaries={n: fd.summary(e) for n, e in engines.items()}
    )
    assert calls["plain3"] == {} and calls["plain2"] == {} and stats["plain3"] == stats["plain2"] == {}, calls
    assert set(calls["fp8_3"]) == {"all_gather_into:e4m3", "reduce_scatter_into:e4m3"}, calls["fp8_3"]
    assert set(calls["e5m2_2"]) == {"all_to_all:e5m2"}, calls["e5m2_2"]  # gradients only, in its own format
    assert "weights" in stats["fp8_3"] and "weights" not in stats["e5m2_2"], stats
    passed = info["passthrough"]
    assert (
        passed.get("zero3.param_gather", 0) > 0
        and passed.get("zero3.grad_reduce.plain", 0) > 0
        and passed.get("zero12.param_gather", 0) > 0
    ), passed  # the unflagged engines' calls, visible
    for name in cfgs:
        assert losses[name] == alone[name], (
            f"{name} interleaved differs from {name} alone: {losses[name]} vs {alone[name]}"
        )
    # uninstall(engine) detaches one engine: it runs DeepSpeed's own collectives from then on, the others keep FP8
    fd.uninstall(engines["fp8_3"])
    before = fc.comm_stats().get("all_gather", {}).get("calls", 0)
    T.train(engines["fp8_3"], range(steps, steps + 1))
    assert fc.comm_stats().get("all_gather", {}).get("calls", 0) == before and fd.is_installed()
    T.train(engines["e5m2_2"], range(steps, steps + 1))
    assert fd.hook_stats(engines["e5m2_2"])["gradients"]["fp8_calls"] > stats["e5m2_2"]["gradients"]["fp8_calls"]
    for eng in engines.values():
        T.destroy(eng)
    fd.uninstall()
