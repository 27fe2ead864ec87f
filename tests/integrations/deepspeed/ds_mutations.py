"""Mutations behind docs/deepspeed.md's "fails on a broken variant" claims (not a test; the checks themselves are).

    .venv/bin/python tests/integrations/deepspeed/ds_mutations.py [NAME ...]    # default: every mutation

Each mutation breaks one thing in-process (a monkeypatch applied by ds_worker.py before its checks run, selected by
the FP8COMM_DS_MUTATION environment variable) and names the checks that must then fail. The script launches each
(mutation, check) pair alone through ds_harness (torchrun, 2 gloo ranks, real DeepSpeed on CPU), prints one line
per pair with the first error line, and exits 1 if a check passed under its mutation (it could not fail).
Under the 2-core machine's usual load one launch takes 30-80 s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "FP8COMM_DS_MUTATION"


def _bf16_decode():
    """ZeRO-1/2 gradients: every contribution decoded into bf16 (8 mantissa bits) before the fp32 sum, as up to
    be321a2 (decoded into the communication dtype); for ZeRO-1 bf16 the same as accumulating in bf16. On the
    all-to-all path the float32 out receives bf16 decodes; on the reduce-scatter path (balanced buckets) the sum is
    delivered in the communication dtype (bf16) instead of fp32."""
    import torch

    from fp8comm.integrations.deepspeed import grad_reduce

    real = grad_reduce.fc

    class Comm:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def all_to_all(tokens, *a, out=None, **k):
            if out is None or out.dtype != torch.float32 or tokens.dtype == torch.float32:
                return real.all_to_all(tokens, *a, out=out, **k)
            low = torch.empty_like(out, dtype=tokens.dtype)
            real.all_to_all(tokens, *a, out=low, **k)
            return out.copy_(low)

        @staticmethod
        def reduce_scatter_into(output, input, *a, **k):
            low = torch.empty_like(output, dtype=input.dtype)
            real.reduce_scatter_into(low, input, *a, **k)
            return output.copy_(low)

    grad_reduce.fc = Comm()


def _rs_sum_in_bf16():
    """ZeRO-1/2 gradients, balanced buckets only: the reduce-scatter delivers its sum in the communication dtype
    (bf16) instead of fp32 (the all-to-all path untouched)."""
    import torch

    from fp8comm.integrations.deepspeed import grad_reduce

    real = grad_reduce.fc

    class Comm:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def reduce_scatter_into(output, input, *a, **k):
            low = torch.empty_like(output, dtype=input.dtype)
            real.reduce_scatter_into(low, input, *a, **k)
            return output.copy_(low)

    grad_reduce.fc = Comm()


def _fp4_a2a_as_fp8():
    """ZeRO-1/2 4-bit gradients: the all-to-all to the owners silently sends FP8 (e4m3, 1x128 fp32 scales) instead,
    as before this check existed; the hook's own counters still say mxfp4."""
    from fp8comm.comm import config_for
    from fp8comm.integrations.deepspeed import grad_reduce

    real = grad_reduce.fc

    class Comm:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def all_to_all(tokens, *a, config=None, **k):
            if config is not None and config.is_fp4:
                config = config_for(config, "fp8")
            return real.all_to_all(tokens, *a, config=config, **k)

    grad_reduce.fc = Comm()


def _whole_slices():
    """ZeRO-1/2 gradients: each slice laid out whole instead of per-parameter pieces (be321a2's layout): sender and
    owner merge slices differently, so their rows disagree."""
    from fp8comm.integrations.deepspeed import grad_reduce

    grad_reduce._segments = lambda t, cur: [(0, t.numel(), None, 0, 0)]


def _residual_not_stored():
    """Error feedback: the residual a call leaves is never stored (every step re-sends zeros)."""
    from fp8comm.integrations.deepspeed import residuals

    residuals.Residuals.scatter = lambda self, ef, pieces, total, window=None: None


def _no_generation_counter():
    """FP8 GEMMs: no generation counter after optimizer steps, so Fp8Linear keeps its stale FP8 weight."""
    from fp8comm.integrations.deepspeed import engine

    engine._track_weight_changes = lambda es, eng: None


def _state_not_loaded():
    """Checkpoints: fp8comm's per-rank file (residuals, the guard's state) is written but never loaded."""
    from fp8comm.integrations.deepspeed import checkpoints

    checkpoints.load_state = lambda es, path: None


def _guard_ignored():
    """The guard: its decisions are counted, but the hooks always send FP8."""
    from fp8comm.integrations.deepspeed import engine

    real = engine.EngineState.route

    def route(self, key, device, fp4=False):
        how, bucket = real(self, key, device, fp4)
        return ("fp8", self.guard.bucket(key, device)) if how == "bf16" else (how, bucket)

    engine.EngineState.route = route


def _process_wide():
    """Per-engine scope: ZeRO-1/2 weight gathers and MoE layers of an engine without a section are served by the
    first fp8comm engine's hooks, as when the hooks were process-wide (up to be321a2)."""
    from fp8comm.integrations.deepspeed import engine, moe, zero12

    real = zero12.owner

    def owner(obj):
        es = real(obj)
        if es is None:
            es = next((e for e in engine._ENGINES if e.attached and e.cfg.weights.enabled), None)
        return es

    zero12.owner = moe.owner = owner


def _owner_slice_from_master():
    """4-bit weight updates: DeepSpeed's write of bf16(master) into the owner's slice is kept (not restored to the
    replica before the update is applied): the owner's slice no longer equals what the other ranks hold."""
    from fp8comm.integrations.deepspeed import updates

    def stash_step(es, opt, orig):
        def step(*a, **k):
            es.z12_stash = [p for _, p in updates._own_partitions(opt)]  # live views: the "restore" is a no-op
            es.z12_in_step = True
            try:
                return orig(*a, **k)
            finally:
                es.z12_in_step = False

        return step

    updates._stash_step = stash_step


def _replica_not_restored():
    """Checkpoints with 4-bit weight updates: the replica is not restored, it stays DeepSpeed's re-gather of the
    fp32 master (bf16(master)), which differs from what the gathered changes made of it."""
    from fp8comm.integrations.deepspeed import updates

    updates.load_replica_state = lambda es, state: None


def _updates_not_applied():
    """4-bit weight updates: every change after the first gather travels but is not applied (the replica is put
    back): replicas stay identical across ranks and fall behind the fp32 master step after step."""
    import fp8comm.comm as fc

    real = fc.ReplicaUpdate.gather

    class _PutBack:  # an asynchronous gather: the replica is put back when it is waited
        def __init__(self, inner, replica, before) -> None:
            self.inner, self.replica, self.before = inner, replica, before

        def wait(self, *a, **k):
            out = self.inner.wait(*a, **k)
            self.replica.copy_(self.before)
            return out

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def gather(self, replica, shard, group=None, **kw):
        if not self.primed:
            return real(self, replica, shard, group, **kw)
        before = replica.clone()
        h = real(self, replica, shard, group, **kw)
        if kw.get("async_op") and h is not None:
            return _PutBack(h, replica, before)
        return replica.copy_(before)

    fc.ReplicaUpdate.gather = gather


# name -> (apply, scenario, checks that must fail under it)
MUTATIONS = {
    "bf16_decode": (_bf16_decode, "zero", ["zero2_bf16_fp32_accumulation", "zero1_bf16_fp32_accumulation"]),
    "rs_sum_in_bf16": (_rs_sum_in_bf16, "zero", ["zero2_bf16_fp32_accumulation"]),
    "whole_slices": (_whole_slices, "zero", ["zero2_bf16_fp32_accumulation"]),
    "fp4_a2a_as_fp8": (_fp4_a2a_as_fp8, "zero", ["zero2_bf16_fp4_small_buckets"]),
    "residual_not_stored": (_residual_not_stored, "zero", ["zero1_fp32_error_feedback"]),
    "no_generation_counter": (_no_generation_counter, "zero", ["gemm_zero2_bf16_reduce_bucket_size"]),
    "state_not_loaded": (
        _state_not_loaded,
        "safety",
        ["checkpoint_zero3_bf16_error_feedback_bf16", "checkpoint_zero2_bf16_gemm_error_feedback_fp32_guard"],
    ),
    "guard_ignored": (_guard_ignored, "safety", ["guard_fallback"]),
    "process_wide": (_process_wide, "zero", ["engines_per_scope"]),
    "owner_slice_from_master": (_owner_slice_from_master, "zero", ["zero2_bf16_fp4"]),
    "updates_not_applied": (_updates_not_applied, "zero", ["zero2_bf16_fp4"]),
    "replica_not_restored": (_replica_not_restored, "safety", ["checkpoint_zero2_bf16_fp4"]),
}


def apply_from_env() -> str | None:
    """Called by ds_worker.py: apply the mutation FP8COMM_DS_MUTATION names (None: no mutation)."""
    name = os.environ.get(ENV)
    if not name:
        return None
    if name not in MUTATIONS:
        raise SystemExit(f"{ENV}={name!r}: unknown mutation; known: {', '.join(MUTATIONS)}")
    MUTATIONS[name][0]()
    return name


def main(names: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    import tempfile

    from ds_harness import failures, launch

    bad = [n for n in names if n not in MUTATIONS]
    if bad:
        print(f"unknown mutations {bad}; known: {', '.join(MUTATIONS)}")
        return 2
    could_not_fail = 0
    out = Path(tempfile.mkdtemp(prefix="ds_mutations_"))
    for name in names or list(MUTATIONS):
        _, scenario, checks = MUTATIONS[name]
        for check in checks:
            os.environ[ENV] = name
            try:
                run = launch(scenario, out / name / check, timeout=360, only=[check])
            finally:
                os.environ.pop(ENV, None)
            msgs = failures(run)
            mine = [m for m in msgs if f": {check}: " in m]
            if mine:
                first = mine[0].split("\n")[0].split(f": {check}: ", 1)[1]
                print(f"{name:<22} {check:<54} FAILS (as it must): {first[:300]}", flush=True)
            else:
                could_not_fail += 1
                why = msgs[0].split("\n")[0] if msgs else "the check passed"
                print(f"{name:<22} {check:<54} NOT CAUGHT: {why[:300]}", flush=True)
    print(f"logs: {out}")
    return 1 if could_not_fail else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
