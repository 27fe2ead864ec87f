"""fp8comm's Megatron-Core integration against real megatron-core: names, settings, plugin, and gloo training.

The single-process tests need only `import megatron.core`; the two launches (2 and 4 gloo ranks) run the training
checks in mcore_checks*.py (DP/TP/hierarchical and the plugin, error feedback, MoE dispatchers, pipeline), each
printing its measured deviations and byte counts.
"""

from __future__ import annotations

import argparse
import json
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (see docs/megatron.md: install)")

import importlib

import fp8comm.integrations.megatron as fm

inst = importlib.import_module("fp8comm.integrations.megatron.install")  # the module (the package exports the function)
points = importlib.import_module("fp8comm.integrations.megatron.patch_points")

PGB = points.PGB
TD = points.TD


def _module(name):
    return importlib.import_module(name)


def _snapshot() -> dict:
    """Current value of every patchable name (identity), to prove install/uninstall touch exactly these."""
    out = {}
    for p in fm.PATCH_POINTS:
        mod = _module(p.module)
        if "." in p.name:
            cls, meth = p.name.split(".")
            out[p.name] = getattr(mod, cls).__dict__[meth]
        else:
            out[p.name] = getattr(mod, p.name)
    return out


def _ddp(**kw):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**{"use_distributed_optimizer": True, **kw})


def _moe_tc(**kw):
    base = dict(
        params_dtype=torch.bfloat16,
        num_moe_experts=4,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=2,
    )
    return types.SimpleNamespace(**{**base, **kw})


@pytest.fixture(autouse=True)
def _clean():
    fm.uninstall()
    yield
    fm.uninstall()


# ------------------------------------------------------------------------------------- names and versions
def test_every_patched_name_exists_and_is_still_used():
    """Fails when a megatron-core upgrade renames or stops calling a patched name (the hook would do nothing)."""
    assert fm.check_patch_points() == []
    assert fm.check_version()  # the installed version is a supported one
    for p in fm.PATCH_POINTS:
        for user in p.users:
            fn = points.resolve_user(p, user)
            assert p.name.split(".")[-1] in points._code_names(fn), f"{user} does not call {p.name}"


def _install_kwargs_for(feature: str) -> dict:
    """install() keywords that need the patch points of `feature` (see install._features)."""
    return {
        "ddp": dict(grad_reduce=True),
        "grad": dict(grad_reduce=True),
        "param": dict(param_gather=True),
        "update": dict(param_update_fmt="mxfp4"),
        "ef": dict(grad_reduce=True, error_feedback=True),
        "moe": dict(moe_dispatch=True),
        "moe_ag": dict(moe_dispatch=True, transformer_config=_moe_tc(moe_token_dispatcher_type="allgather")),
        "flex": dict(moe_dispatch=True, transformer_config=None),
    }[feature]


@pytest.mark.parametrize("point", points.PATCH_POINTS, ids=lambda p: p.name)
def test_missing_name_is_an_install_error(point, monkeypatch):
    mod = _module(point.module)
    if "." in point.name:
        cls, meth = point.name.split(".")
        monkeypatch.delattr(getattr(mod, cls), meth)
    else:
        monkeypatch.delattr(mod, point.name)
    with pytest.raises(fm.Fp8CommMegatronError, match=point.name.split(".")[-1]):
        fm.install(**{"ddp_config": _ddp(), "transformer_config": _moe_tc(), **_install_kwargs_for(point.feature)})
    assert fm.active_config() is None


def test_call_site_that_bypasses_a_name_is_an_install_error(monkeypatch):
    """A start_grad_sync that no longer goes through dist_reduce_scatter_func must be caught, not patched."""
    mod = _module(PGB)

    def start_grad_sync(self, force_all_reduce=False):  # an "upgraded" version calling torch directly
        torch.distributed.reduce_scatter_tensor(None, None)

    monkeypatch.setattr(mod._ParamAndGradBucketGroup, "start_grad_sync", start_grad_sync)
    before = _snapshot()
    with pytest.raises(fm.Fp8CommMegatronError, match="no longer references dist_reduce_scatter_func"):
        fm.install(ddp_config=_ddp(), grad_reduce=True)
    assert _snapshot() == before  # nothing patched


def test_unsupported_version_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(points, "megatron_version", lambda: "0.99.0")
    monkeypatch.delenv(points.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(fm.Fp8CommMegatronError, match="0.99.0 is not a supported version"):
        fm.install(ddp_config=_ddp(), grad_reduce=True)
    cfg = fm.install(ddp_config=_ddp(), grad_reduce=True, allow_untested_version=True)
    assert cfg.grad_reduce and fm.active_config() == cfg


# ------------------------------------------------------------------------------------- install/uninstall
def test_install_patches_and_uninstall_restores_everything():
    before = _snapshot()
    # No transformer_config: the dispatcher type is unknown, so both hooked dispatchers and the flex refusal go in.
    cfg = fm.install(
        ddp_config=_ddp(),
        grad_reduce=True,
        param_gather=True,
        moe_dispatch=True,
        moe_combine="fp8",
        error_feedback=True,
        fmt="e5m2",
        scaling="e8m0",
        block_size=64,
    )
    after = _snapshot()
    # The distributed optimizer's copy is replaced only for 4-bit weight updates, which replace the FP8 gather.
    assert all(after[k] is not before[k] for k in before if k not in UPDATE_ONLY), "every patch point is replaced"
    assert (cfg.fmt, cfg.scaling, cfg.block_size) == ("e5m2", "e8m0", 64)
    with pytest.raises(fm.Fp8CommMegatronError, match="already installed with other settings"):
        fm.install(ddp_config=_ddp(), grad_reduce=True)
    fm.uninstall()
    assert all(_snapshot()[k] is before[k] for k in before), "uninstall restores the original objects"
    fm.install(ddp_config=_ddp(), grad_reduce=True, grad_fmt="nvfp4", param_update_fmt="mxfp4")
    assert all(_snapshot()[k] is not before[k] for k in UPDATE_ONLY | {"dist_all_gather_func"})
    fm.uninstall()
    assert all(_snapshot()[k] is before[k] for k in before), "uninstall restores the original objects"
    fm.uninstall()  # idempotent
    assert fm.active_config() is None


UPDATE_ONLY = {
    "DistributedOptimizer._copy_main_params_to_model_params",
    "DistributedOptimizer._copy_main_params_to_param_buffer",
}


def test_install_again_with_the_same_settings_is_a_no_op():
    """Megatron-LM calls model_provider once per virtual pipeline stage: install(args) placed there runs again
    with the same args. That is a no-op (same config, nothing wrapped twice, one uninstall restores Megatron);
    other settings are still an error that names both."""
    args = fm.add_args(argparse.ArgumentParser()).parse_args(["--fp8comm-grad-reduce", "--fp8comm-param-gather"])
    args.use_distributed_optimizer, args.bf16 = True, True
    before = _snapshot()
    cfg = fm.install(args)
    patched, inst_obj = _snapshot(), fm.installation()
    for _ in range(3):  # e.g. --num-virtual-stages-per-pipeline-rank 4
        assert fm.install(args) == cfg
    assert _snapshot() == patched and fm.installation() is inst_obj, "a second install wrapped the hooks again"
    other = fm.add_args(argparse.ArgumentParser()).parse_args(["--fp8comm-grad-reduce"])
    other.use_distributed_optimizer = True
    with pytest.raises(fm.Fp8CommMegatronError, match="other settings.*param_gather=True.*requested: grad_reduce"):
        fm.install(other)
    fm.uninstall()
    assert _snapshot() == before and fm.active_config() is None


def test_only_requested_hooks_are_patched():
    before = _snapshot()
    fm.install(ddp_config=_ddp(), grad_reduce=True)
    after = _snapshot()
    changed = {k for k in before if after[k] is not before[k]}
    assert changed == {
        "_coalescing_manager",
        "dist_reduce_scatter_func",
        "reduce_scatter_with_fp32_accumulation",
        "_ParamAndGradBucketGroup.start_grad_sync",
    }


def test_4bit_weight_updates_patch_the_gather_and_the_optimizer_copy():
    before = _snapshot()
    fm.install(ddp_config=_ddp(), param_update_fmt="nvfp4")
    after = _snapshot()
    assert {k for k in before if after[k] is not before[k]} == {"_coalescing_manager", "dist_all_gather_func"} | (
        UPDATE_ONLY
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    with pytest.raises(fm.Fp8CommMegatronError, match="reuse_grad_buf_for_mxfp8_param_ag"):
        DistributedOptimizer._copy_main_params_to_param_buffer(object())


def test_nothing_enabled_is_a_logged_no_op(capsys):
    before = _snapshot()
    cfg = fm.install(ddp_config=_ddp())
    assert not cfg.any and _snapshot() == before and fm.active_config() is None
    assert "no hook enabled" in capsys.readouterr().err


def test_one_log_line_says_what_is_active(capsys):
    fm.install(ddp_config=_ddp(), grad_reduce=True, param_gather=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FP8 grad reduce-scatter, param all-gather active" in err[0], err
    assert "GEMMs untouched" in err[0], err


def test_defaults_are_communication_only(capsys):
    """Issue 20 s3: nothing is on by default, and no setting turns on FP8 GEMMs: every hook, all of them on,
    patches only communication names (DDP buckets, MoE dispatcher, the optimizer's step); the line says so."""
    assert not fm.Fp8CommMegatronConfig().any
    assert not [f for f in fm.Fp8CommMegatronConfig.__dataclass_fields__ if "gemm" in f or "linear" in f]
    # DISTOPT: the distributed optimizer's copy of the master into the gathered buffer (4-bit weight updates)
    assert {p.module for p in fm.PATCH_POINTS} == {points.PGB, points.TD, points.OPT, points.DISTOPT}
    fm.install(ddp_config=_ddp())
    assert "no hook enabled" in capsys.readouterr().err
    before = _snapshot()
    fm.install(
        ddp_config=_ddp(),
        grad_reduce=True,
        param_gather=True,
        moe_dispatch=True,
        moe_combine="fp8",
        error_feedback=True,
        guard=True,
    )
    err = capsys.readouterr().err
    assert "GEMMs untouched" in err, err
    touched = {(getattr(o, "__module__", None) or o.__name__) for o, _, _ in fm.installation().saved}
    assert touched == {points.PGB, points.TD, points.OPT}, touched
    assert {k for k in before if _snapshot()[k] is not before[k]} <= {p.name for p in fm.PATCH_POINTS}


def test_plain_ddp_gradients_are_all_reduced_in_fp8(capsys):
    """Issue 21 s4: no distributed optimizer is accepted (FP8 all-reduce); the log line names the path."""
    fm.install(ddp_config=_ddp(use_distributed_optimizer=False), grad_reduce=True)
    assert "FP8 grad all-reduce active" in capsys.readouterr().err
    fm.uninstall()
    fm.install(ddp_config=None, grad_reduce=True)
    assert "FP8 grad reduce-scatter/all-reduce active" in capsys.readouterr().err


class _Bucket:
    def __init__(self, n):
        self.grad_data = torch.zeros(n)


class _BucketGroup:
    """What fp8comm's start_grad_sync wrapper reads of Megatron's _ParamAndGradBucketGroup."""

    def __init__(self, dist_opt: bool):
        self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=dist_opt)
        self.buckets = [_Bucket(4), _Bucket(8)]
        self.data_parallel_group = object()
        self.intra_distributed_optimizer_instance_group = object()


def test_start_grad_sync_takes_only_its_own_bucket_all_reduces(monkeypatch):
    """The wrapper takes all_reduce(grad_data of one of ITS buckets, its DP group) and nothing else: another
    tensor, another group, the reduce-scatter path; torch.distributed.all_reduce is restored afterwards."""
    from fp8comm.integrations.megatron import ddp_hooks

    taken, passed = [], []
    monkeypatch.setattr(
        torch.distributed, "all_reduce", lambda t, op=None, group=None, async_op=False: passed.append(t)
    )
    monkeypatch.setattr(ddp_hooks, "_fp8_all_reduce", lambda orig, cfg, t, op, g, a: taken.append((t, g, a)))
    real = torch.distributed.all_reduce
    other = torch.zeros(4)

    def megatron_start_grad_sync(self, force_all_reduce=False):  # what megatron-core 0.19 does, in short
        for b in self.buckets:
            torch.distributed.all_reduce(b.grad_data, op=None, group=self.data_parallel_group, async_op=True)
        torch.distributed.all_reduce(other, group=self.data_parallel_group)  # e.g. a NaN check's flag
        torch.distributed.all_reduce(self.buckets[0].grad_data, group=object())  # another group
        return "done"

    start = ddp_hooks.make_start_grad_sync(megatron_start_grad_sync, fm.Fp8CommMegatronConfig(grad_reduce=True))
    plain = _BucketGroup(dist_opt=False)
    assert start(plain) == "done" and torch.distributed.all_reduce is real
    assert [(t, g, a) for t, g, a in taken] == [(b.grad_data, plain.data_parallel_group, True) for b in plain.buckets]
    assert passed == [other, plain.buckets[0].grad_data]
    taken.clear(), passed.clear()
    start(_BucketGroup(dist_opt=True))  # reduce-scatter path: every all_reduce is Megatron's own
    assert not taken and len(passed) == 4
    passed.clear()
    start(_BucketGroup(dist_opt=True), force_all_reduce=True)
    assert len(taken) == 2 and torch.distributed.all_reduce is real


def test_bucket_group_that_stops_calling_all_reduce_is_an_install_error(monkeypatch):
    mod = _module(PGB)
    orig = mod._ParamAndGradBucketGroup.start_grad_sync

    def start_grad_sync(self, force_all_reduce=False):  # an "upgraded" version reducing some other way
        with mod._coalescing_manager(None):
            mod.dist_reduce_scatter_func(None, None)
            torch.distributed.all_reduce_coalesced(None)

    monkeypatch.setattr(mod._ParamAndGradBucketGroup, "start_grad_sync", start_grad_sync)
    with pytest.raises(fm.Fp8CommMegatronError, match="start_grad_sync no longer calls all_reduce"):
        fm.install(ddp_config=_ddp(use_distributed_optimizer=False), grad_reduce=True)
    assert mod._ParamAndGradBucketGroup.start_grad_sync is start_grad_sync and orig is not start_grad_sync


class _Group:
    def __init__(self, ranks):
        self.ranks = list(ranks)


def test_hierarchical_node_groups_are_created_alike_on_every_rank(monkeypatch):
    """Issue 20 s2 / issue 28: TP=2 x DP=4 on 2 nodes x 4 ranks has two strided DP groups, [0, 2, 4, 6] and
    [1, 3, 5, 7], two members on each node. Every rank must make the same dist.new_group calls (members, order);
    the old lazy per-group creation made each rank create only its own group's. Simulated rank by rank (mocked
    dist; the one all_gather_object carries every rank's node facts and DP groups)."""
    from megatron.core import parallel_state as ps

    from fp8comm.comm import hierarchical as hier
    from fp8comm.comm import topology
    from fp8comm.integrations.megatron import ddp_hooks

    world, tp = 8, 2
    dp_of = {r: _Group(range(r % tp, world, tp)) for r in range(world)}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda g: list(g.ranks))
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)

    def all_gather_object(out, obj):
        for r in range(world):  # what every rank contributes (this rank's own must be what it passed)
            out[r] = ((str(r // 4), "4", "same-host"), [tuple(dp_of[r].ranks)])
        assert obj[1] == out[me][1], (obj, out[me])

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    seqs = {}
    for me in range(world):
        calls: list = []
        monkeypatch.setattr(hier, "_CACHE", {})  # a fresh process per simulated rank
        monkeypatch.setattr(topology, "_TABLE", None)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, me=me: me)
        monkeypatch.setattr(torch.distributed, "new_group", lambda ranks, *a, calls=calls, **k: calls.append(ranks))
        monkeypatch.setattr(ps, "get_data_parallel_group", lambda *a, me=me, **k: dp_of[me])
        monkeypatch.setattr(ps, "get_expert_data_parallel_group", lambda *a, me=me, **k: dp_of[me])
        fm.install(ddp_config=_ddp(), grad_reduce=True)  # two levels: the default
        at_install = len(calls)
        hg = ddp_hooks.hierarchical_groups(dp_of[me])  # what the reduce-scatter hook asks for
        assert (hg.nodes, hg.local, hg.node, hg.local_rank) == (2, 2, me // 4, (me % 4) // 2), hg
        assert len(calls) == at_install, f"rank {me}: the hook created groups lazily: {calls[at_install:]}"
        with pytest.raises(fm.Fp8CommMegatronError, match="not one of the data-parallel groups"):
            ddp_hooks.hierarchical_groups(_Group([0, 1]))
        fm.uninstall()
        seqs[me] = [list(c) for c in calls]
    assert all(seqs[r] == seqs[0] for r in seqs), f"new_group calls differ across ranks: {seqs}"
    assert seqs[0] == [[0, 2], [4, 6], [0, 4], [2, 6], [1, 3], [5, 7], [1, 5], [3, 7]], seqs[0]


def test_install_without_parallel_state_runs_flat_and_says_why(capsys):
    """Two levels are the default; an install() before initialize_model_parallel (or without torch.distributed)
    cannot see the data-parallel groups: every group runs flat, with one line saying why (never an error)."""
    from fp8comm.integrations.megatron import ddp_hooks

    fm.install(ddp_config=_ddp(), grad_reduce=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every data-parallel group runs flat: torch.distributed is not initialized" in err[0]
    assert "hierarchical on" in err[0], err
    assert ddp_hooks.hierarchical_groups(_Group([0, 1])) is None


def test_hierarchical_flag_defaults_on_and_no_flag_turns_it_off():
    p = fm.add_args(argparse.ArgumentParser())
    assert p.parse_args([]).fp8comm_hierarchical is True
    assert p.parse_args(["--fp8comm-hierarchical"]).fp8comm_hierarchical is True
    assert p.parse_args(["--no-fp8comm-hierarchical"]).fp8comm_hierarchical is False
    assert fm.Fp8CommMegatronConfig().hierarchical is True
    with pytest.raises(fm.Fp8CommMegatronError, match="hierarchical must be True or False, got 'yes'"):
        fm.Fp8CommMegatronConfig(hierarchical="yes")


# ------------------------------------------------------------------------------------- invalid combinations
@pytest.mark.parametrize(
    "kwargs, ddp_kw, match",
    [
        (dict(param_gather=True), dict(use_distributed_optimizer=False), "only it all-gathers"),
        (dict(grad_reduce=True), dict(num_distributed_optimizer_instances=2), "several distributed optimizer"),
        (dict(param_gather=True), dict(fp8_param_gather=True), "Transformer Engine"),
        (dict(param_gather=True, params_dtype=torch.float32), {}, "master weights"),
        (dict(grad_reduce=True), dict(use_megatron_fsdp=True), "not FSDP"),
        (dict(moe_dispatch=True, transformer_config=_moe_tc(num_moe_experts=None)), {}, "without MoE layers"),
        (
            dict(moe_dispatch=True, transformer_config=_moe_tc(moe_token_dispatcher_type="flex")),
            {},
            "flex dispatcher runs DeepEP/HybridEP .*supported dispatchers: alltoall, allgather",
        ),
        (
            dict(moe_combine="fp8", transformer_config=_moe_tc(moe_token_dispatcher_type="flex")),
            {},
            "--fp8comm-moe-combine fp8 with --moe-token-dispatcher-type flex",
        ),
        (dict(moe_dispatch=True, transformer_config=_moe_tc(expert_model_parallel_size=1)), {}, "never leave"),
        (
            dict(
                moe_combine="bf16",
                transformer_config=_moe_tc(moe_token_dispatcher_type="allgather", expert_model_parallel_size=1),
            ),
            {},
            "tensor x expert",
        ),
        (dict(moe_combine="fp8", transformer_config=_moe_tc(num_moe_experts=None)), {}, "combine fp8 without MoE"),
        (dict(param_gather=True, error_feedback=True), {}, "--fp8comm-error-feedback needs --fp8comm-grad-reduce"),
        (dict(grad_reduce=True, error_feedback_dtype="bf16"), {}, "would do nothing"),
        (dict(error_feedback=True), {}, "--fp8comm-error-feedback needs --fp8comm-grad-reduce"),  # nothing else on
        (dict(param_update_fmt="mxfp4"), dict(use_distributed_optimizer=False), "needs --use-distributed-optimizer"),
        (dict(param_update_fmt="mxfp4", param_gather=True), {}, "both replace .*choose one"),
        (dict(param_update_fmt="nvfp4", params_dtype=torch.float32), {}, "no separate master"),
        (dict(param_update_fmt="mxfp4"), dict(fp8_param_gather=True), "Transformer Engine gathers"),
        (dict(param_update_fmt="mxfp4"), dict(use_megatron_fsdp=True), "not FSDP"),
        (dict(param_update_fmt="mxfp4"), dict(num_distributed_optimizer_instances=2), "several distributed"),
        (dict(grad_fmt="mxfp4"), {}, "--fp8comm-grad-format mxfp4 without --fp8comm-grad-reduce"),
        (dict(grad_fmt="nvfp4", param_update_fmt="nvfp4"), {}, "without --fp8comm-grad-reduce"),
        (
            dict(grad_reduce=True, grad_fmt="mxfp4", block_size=32),
            {},
            "block-size 32: these apply to FP8 wires only.*mxfp4: 1x32",
        ),
        (
            dict(param_update_fmt="mxfp4", scaling="e8m0"),
            {},
            "- --fp8comm-scaling e8m0: these apply to FP8 wires",
        ),
        (dict(moe_dispatch=False, guard=True), {}, "--fp8comm-guard watches the quantized DDP buckets"),
        (dict(grad_reduce=True, hadamard=16), {}, "--fp8comm-hadamard 16 applies to 4-bit gradients.*here: e4m3"),
        (dict(param_update_fmt="mxfp4", hadamard=32), {}, "applies to 4-bit gradients.*here: not hooked"),
    ],
)
def test_invalid_combination_is_refused_with_the_reason(kwargs, ddp_kw, match):
    before = _snapshot()
    with pytest.raises(fm.Fp8CommMegatronError, match=match):
        fm.install(ddp_config=_ddp(**ddp_kw), **kwargs)
    assert _snapshot() == before and fm.active_config() is None


def test_fp32_param_buffer_is_refused_at_runtime():
    """Megatron-Core users who gave no params_dtype: the first gather into an fp32 buffer raises, never writes."""
    from fp8comm.integrations.megatron import ddp_hooks

    gather = ddp_hooks.make_all_gather(lambda *a, **k: pytest.fail("original called"), fm.Fp8CommMegatronConfig())
    out = torch.zeros(8)
    with pytest.raises(fm.Fp8CommMegatronError, match="master weights"):
        gather(out, out[:4], group=None, async_op=False)
    assert torch.equal(out, torch.zeros(8))


def test_4bit_weight_update_leaves_fp32_buffers_and_one_rank_groups_to_megatron(monkeypatch):
    """An fp32 parameter buffer's slice IS the fp32 master, and a one-rank group has nothing to send: both keep
    Megatron's own gather (counted as pass-through), no ReplicaUpdate state is created."""
    from fp8comm.integrations.megatron import ddp_hooks

    seen = []
    monkeypatch.setattr(
        importlib.import_module(PGB), "dist_all_gather_func", lambda o, i, group=None, async_op=False: seen.append(o)
    )
    fm.install(ddp_config=_ddp(), param_update_fmt="mxfp4")
    gather = importlib.import_module(PGB).dist_all_gather_func
    fm.hook_stats(reset=True)
    fp32 = torch.zeros(8)
    monkeypatch.setattr(ddp_hooks, "_size", lambda group: 2)
    gather(fp32, fp32[:4], group=None)
    bf16 = torch.zeros(8, dtype=torch.bfloat16)
    monkeypatch.setattr(ddp_hooks, "_size", lambda group: 1)
    gather(bf16, bf16[:8], group=None)
    assert seen == [fp32, bf16] and not fm.installation().replicas
    assert fm.hook_stats()["param_update"]["passthrough_calls"] == 2


def test_bad_option_values_are_refused():
    for kw, match in (
        (dict(fmt="e3m4"), "fmt"),
        (dict(block_size=0), "block_size"),
        (dict(check="sometimes"), "check"),
        (dict(moe_grad_wire="fp4"), "moe_grad_wire"),
        (dict(scaling="int8"), "scaling"),
        (dict(moe_combine="fp4"), r"moe_combine='fp4' is not one of \('native', 'bf16', 'fp8'\)"),
        (
            dict(error_feedback_dtype="fp16"),
            r"error_feedback_dtype='fp16' is not one of \('float32', 'bfloat16', 'fp8', 'fp32', 'bf16'\)",
        ),
        (dict(error_feedback="yes"), "error_feedback must be True or False"),
        (dict(fmt="mxfp4"), r"fmt='mxfp4' is not one of \('e4m3', 'e5m2'\)"),  # params/tokens: FP8 only
        (dict(grad_fmt="int4"), r"grad_fmt='int4' is not one of \('e4m3', 'e5m2', 'mxfp4', 'nvfp4'\)"),
        (dict(param_update_fmt="e4m3"), r"param_update_fmt='e4m3' is not one of \('mxfp4', 'nvfp4'\)"),
        (dict(hadamard=8), r"hadamard=8 is not one of \(0, 16, 32\)"),
        (dict(grad_fmt="nvfp4", hadamard=32), "hadamard=32 does not fit inside one 16-element nvfp4 block"),
    ):
        with pytest.raises(fm.Fp8CommMegatronError, match=match):
            fm.install(ddp_config=_ddp(), grad_reduce=True, **kw)


def test_dispatchers_patch_what_they_use():
    """alltoall patches only the alltoall names, allgather only its two mappings and methods; combine alone too."""
    before = _snapshot()
    for tc, combine, expect in (
        (_moe_tc(), "native", {"all_to_all", "MoEAlltoAllTokenDispatcher.token_dispatch"}),
        (_moe_tc(), "fp8", {"all_to_all", "MoEAlltoAllTokenDispatcher.token_combine"}),
        (
            _moe_tc(moe_token_dispatcher_type="allgather"),
            "native",
            {"gather_from_sequence_parallel_region", "MoEAllGatherTokenDispatcher.token_dispatch"},
        ),
        (
            _moe_tc(moe_token_dispatcher_type="allgather"),
            "bf16",
            {"reduce_scatter_to_sequence_parallel_region", "MoEAllGatherTokenDispatcher.token_combine"},
        ),
    ):
        fm.install(ddp_config=_ddp(), transformer_config=tc, moe_dispatch=combine == "native", moe_combine=combine)
        after = _snapshot()
        assert {k for k in before if after[k] is not before[k]} == expect, (tc, combine)
        fm.uninstall()
        assert _snapshot() == before


def test_flex_dispatcher_unknown_at_install_is_refused_at_run_time():
    """A Megatron-Core install without transformer_config cannot see the dispatcher: flex raises before moving."""
    td = _module(TD)
    fm.install(ddp_config=_ddp(), moe_dispatch=True)
    with pytest.raises(fm.Fp8CommMegatronError, match="flex.*supported dispatchers: alltoall, allgather"):
        td.MoEFlexTokenDispatcher.token_dispatch(object(), torch.zeros(2, 2), torch.zeros(2, 2))


def test_skipped_optimizer_step_zeroes_error_feedback_residuals():
    """The optimizer-step wrapper: (False, None, None) zeroes every residual and is counted; success keeps them."""
    ef_mod = importlib.import_module("fp8comm.integrations.megatron.error_feedback")
    inst_mod = importlib.import_module("fp8comm.integrations.megatron.installation")
    inst = inst_mod.begin(fm.Fp8CommMegatronConfig(grad_reduce=True, error_feedback=True))
    try:
        bucket = torch.zeros(256)
        ef = ef_mod.for_bucket(bucket)
        assert ef_mod.for_bucket(bucket) is ef and ef_mod.for_bucket(torch.zeros(256)) is not ef  # by identity
        assert fm.installation() is inst and len(inst.residuals) == 2  # the installation holds them
        ef.take(256, bucket.device).fill_(0.5)
        results = iter([(True, 1.0, 0), (False, None, None)])
        step = ef_mod.make_optimizer_step(lambda self: next(results))
        fm.hook_stats(reset=True)
        assert step(None) == (True, 1.0, 0) and ef.norm() > 0, "a successful step keeps the residuals"
        assert step(None) == (False, None, None) and ef.residual is None, "a skipped step zeroes them"
        assert fm.hook_stats()["error_feedback"]["skipped_step_resets"] == 1
    finally:
        inst_mod.end()
    assert fm.installation() is None and ef_mod.nbytes() == 0  # uninstalling drops every residual with it


# ------------------------------------------------------------------------------------- argument plugin
def test_add_args_defaults_match_the_config_and_parse():
    p = fm.add_args(argparse.ArgumentParser())
    args = p.parse_args([])
    assert fm.Fp8CommMegatronConfig.from_args(args) == fm.Fp8CommMegatronConfig()
    args = p.parse_args(
        [
            "--fp8comm-grad-reduce",
            "--fp8comm-param-gather",
            "--fp8comm-moe-dispatch",
            "--fp8comm-format",
            "e5m2",
            "--fp8comm-grad-format",
            "e5m2",
            "--fp8comm-block-size",
            "32",
            "--fp8comm-scaling",
            "pow2",
            "--fp8comm-rounding",
            "stochastic",
            "--fp8comm-hierarchical",
            "--fp8comm-check",
            "always",
            "--fp8comm-moe-grad-wire",
            "fp8",
            "--fp8comm-moe-combine",
            "fp8",
            "--fp8comm-error-feedback",
            "--fp8comm-error-feedback-dtype",
            "bf16",
            "--fp8comm-guard",
            "--fp8comm-guard-threshold",
            "0.05",
            "--fp8comm-guard-patience",
            "2",
            "--fp8comm-guard-cooldown",
            "7",
        ]
    )
    cfg = fm.Fp8CommMegatronConfig.from_args(args)
    assert cfg == fm.Fp8CommMegatronConfig(
        grad_reduce=True,
        param_gather=True,
        moe_dispatch=True,
        fmt="e5m2",
        grad_fmt="e5m2",
        block_size=32,
        scaling="pow2",
        rounding="stochastic",
        hierarchical=True,
        check="always",
        moe_grad_wire="fp8",
        moe_combine="fp8",
        error_feedback=True,
        error_feedback_dtype="bf16",
        guard=True,
        guard_threshold=0.05,
        guard_patience=2,
        guard_cooldown=7,
    )
    assert (cfg.guard_policy.threshold, cfg.guard_policy.patience, cfg.guard_policy.cooldown) == (0.05, 2, 7)
    d = cfg.describe()
    assert "MoE dispatch, MoE combine" in d and "error feedback bfloat16 residuals" in d and "MoE backward fp8" in d, d
    # the old flag values are aliases of the names every adapter shares; fp8 is the compact residual
    assert cfg.error_feedback_dtype == "bfloat16" and cfg.wire("grad").residual_dtype == "bfloat16"
    for given, name in (("fp32", "float32"), ("float32", "float32"), ("bf16", "bfloat16"), ("fp8", "fp8")):
        c = fm.Fp8CommMegatronConfig(grad_reduce=True, error_feedback=True, error_feedback_dtype=given)
        assert c.error_feedback_dtype == name and c.wire("grad").residual_dtype == name, (given, c)
        flag = p.parse_args(
            ["--fp8comm-grad-reduce", "--fp8comm-error-feedback", "--fp8comm-error-feedback-dtype", given]
        )
        assert fm.Fp8CommMegatronConfig.from_args(flag).error_feedback_dtype == name, given
    assert "guard (bf16 fallback above 5.00% for 2 steps, 7 steps)" in d, d
    for bad in (
        ["--fp8comm-format", "int8"],
        ["--fp8comm-moe-combine", "fp16"],
        ["--fp8comm-error-feedback-dtype", "fp16"],
        ["--fp8comm-guard-patience", "1.5"],
        ["--fp8comm-guard-threshold", "many"],
    ):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    for bad, match in (
        (["--fp8comm-guard-threshold", "1.5"], "threshold"),
        (["--fp8comm-guard-cooldown", "-1"], "cooldown"),
    ):
        with pytest.raises(fm.Fp8CommMegatronError, match=match):
            fm.Fp8CommMegatronConfig.from_args(p.parse_args(["--fp8comm-guard", *bad]))


def test_guard_flags_reach_the_installed_guard():
    """--fp8comm-guard* through add_args and install(args): the installed guard runs with the parsed policy."""
    args = fm.add_args(argparse.ArgumentParser()).parse_args(
        [
            "--fp8comm-grad-reduce",
            "--fp8comm-guard",
            "--fp8comm-guard-threshold",
            "0.25",
            "--fp8comm-guard-patience",
            "4",
            "--fp8comm-guard-cooldown",
            "9",
        ]
    )
    args.use_distributed_optimizer = True
    fm.install(args)
    g = fm.installation().guard
    assert g is not None and (g.policy.threshold, g.policy.patience, g.policy.cooldown) == (0.25, 4, 9), g


def test_4bit_flags_parse_and_reach_the_installation(capsys):
    """--fp8comm-grad-format {mxfp4,nvfp4} and --fp8comm-param-update-format through add_args and install(args):
    the installed config and the WireConfigs the hooks pass; FP8-only flags refuse the 4-bit names."""
    p = fm.add_args(argparse.ArgumentParser())
    args = p.parse_args(
        [
            "--fp8comm-grad-reduce",
            "--fp8comm-grad-format",
            "nvfp4",
            "--fp8comm-rounding",
            "stochastic",
            "--fp8comm-error-feedback",
            "--fp8comm-param-update-format",
            "mxfp4",
            "--fp8comm-hadamard",
            "16",
        ]
    )
    args.use_distributed_optimizer, args.bf16 = True, True
    cfg = fm.install(args)
    assert fm.active_config() == cfg and (cfg.grad_fmt, cfg.param_update_fmt) == ("nvfp4", "mxfp4")
    line = capsys.readouterr().err
    assert "nvfp4 grad reduce-scatter (1x16 blocks, E4M3 scales + one fp32 scale per chunk, Hadamard 1x16)" in line
    assert "mxfp4 weight-update all-gather (replica += change, 1x32 blocks, E8M0 scales)" in line, line
    assert "1x128" not in line, "the FP8 block size is named although no FP8 wire is on: " + line
    g = cfg.wire("grad")
    assert g.is_fp4 and (g.fmt, g.rounding, g.error_feedback, g.hadamard) == ("nvfp4", "stochastic", True, 16), g
    u = cfg.wire("update")
    assert u.is_fp4 and (u.fmt, u.rounding, u.error_feedback) == ("mxfp4", "nearest", False), u
    # FP8 params beside 4-bit grads: --fp8comm-block-size reaches the FP8 wire only
    mixed = fm.Fp8CommMegatronConfig(grad_reduce=True, grad_fmt="mxfp4", param_gather=True, block_size=64)
    assert mixed.wire("param").block_size == 64 and mixed.wire("grad").fmt == "mxfp4"
    for bad in (
        ["--fp8comm-format", "mxfp4"],
        ["--fp8comm-grad-format", "int4"],
        ["--fp8comm-param-update-format", "e4m3"],
        ["--fp8comm-hadamard", "8"],
    ):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    help_text = p.format_help()
    assert "block and scale kind are fixed by the format" in " ".join(help_text.split()), help_text


def test_guard_demotes_a_4bit_gradient_bucket_to_fp8_then_bf16(monkeypatch):
    """With --fp8comm-guard, a 4-bit gradient bucket goes to the guard as a 4-bit bucket; while the guard holds
    it on FP8 the hook sends E4M3 1x128 (same rounding and error feedback), while on BF16 Megatron's own call."""
    from fp8comm.integrations.megatron import ddp_hooks

    calls = []

    class Done:
        def wait(self, timeout=None):
            return None

    def fp8comm_rs(*a, **kw):
        calls.append(("fp8comm", kw["config"], kw["guard"]))
        return Done()

    def megatron_rs(output, input, op=None, group=None, async_op=False):
        calls.append(("megatron", None, None))

    monkeypatch.setattr(ddp_hooks, "_size", lambda group: 2)
    monkeypatch.setattr(ddp_hooks.fcomm, "reduce_scatter_into", fp8comm_rs)
    monkeypatch.setattr(importlib.import_module(PGB), "dist_reduce_scatter_func", megatron_rs)  # what the hook wraps
    fm.install(ddp_config=_ddp(), grad_reduce=True, grad_fmt="mxfp4", error_feedback=True, guard=True, check="never")
    rs = importlib.import_module(PGB).dist_reduce_scatter_func
    grad, out = torch.zeros(256), torch.zeros(128)
    g = fm.installation().guard
    for state in (None, "fp8", "bf16"):
        if state == "fp8":
            g.states["grad0"].fp8_left = 5
        elif state == "bf16":
            g.states["grad0"].fp8_left, g.states["grad0"].bf16_left = 0, 5
        rs(out, grad, group=object(), async_op=False)
    (w1, c1, b1), (w2, c2, b2) = calls[0], calls[1]
    assert w1 == w2 == "fp8comm" and b1 is b2 and b1.key == "grad0" and g.states["grad0"].fp4
    assert (c1.fmt, c1.error_feedback) == ("mxfp4", True), c1
    assert (c2.fmt, c2.block_size, c2.scaling, c2.error_feedback) == ("e4m3", 128, "fp32", True), c2
    assert calls[2] == ("megatron", None, None) and len(calls) == 3, "BF16: Megatron's own reduce-scatter"


def test_install_from_args_without_add_args_is_an_error():
    with pytest.raises(fm.Fp8CommMegatronError, match="extra_args_provider"):
        fm.install(argparse.Namespace(use_distributed_optimizer=True))


def test_install_from_args_checks_megatron_args():
    args = fm.add_args(argparse.ArgumentParser()).parse_args(["--fp8comm-grad-reduce", "--fp8comm-param-gather"])
    args.use_distributed_optimizer, args.bf16 = True, True
    fm.install(args)
    assert fm.active_config().grad_reduce and fm.active_config().param_gather
    fm.uninstall()
    args.use_distributed_optimizer = False
    with pytest.raises(fm.Fp8CommMegatronError, match="--use-distributed-optimizer"):
        fm.install(args)


# ------------------------------------------------------------------------------------- gloo training
def _launch(world, names, tmp_path, env=None, timeout=300):
    import mcore_harness as H

    run = H.launch(world, names, tmp_path, env=env, timeout=timeout)
    for n in names:
        print(f"[{world} ranks, {run['seconds']} s] {n}: {json.dumps(H.info(run, n))}")
    fails = H.failures(run, names)
    assert not fails, "\n".join(fails)
    return run


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_dp2_error_feedback_moe_ep2_plugin_plain_ddp_example_and_4bit(tmp_path):
    # gpt_dp2 first: its overlap-on baseline is reused by gpt_dp2_error_feedback (mcore_checks.run).
    _launch(
        2,
        [
            "gpt_dp2",
            "gpt_dp2_error_feedback",
            "gpt_dp2_guard",
            "gpt_dp2_fp32_accumulation",
            "moe_ep2",
            "moe_ep2_guard",
            "moe_ep2_allgather",
            "plugin_end_to_end",
            "gpt_dp2_plain_ddp",
            "megatron_simple_loop",
            # 4-bit gradients and weight updates (issue 23): after gpt_dp2 / gpt_dp2_plain_ddp / moe_ep2, whose
            # baselines they reuse
            "gpt_dp2_fp4",
            "gpt_dp2_fp4_resume",
            "gpt_dp2_fp4_overlapped_updates",
            "gpt_dp2_fp4_update_guard",
            "gpt_dp2_plain_ddp_fp4",
            "moe_ep2_fp4",
        ],
        tmp_path,
        timeout=480,  # a hang guard, not a time limit: ~250 s on a loaded 2-core machine (2026-12-02)
    )


@pytest.mark.dist
@pytest.mark.slow
def test_four_ranks_tp2_dp2_pp2_dp2_and_hierarchical(tmp_path):
    # 4 ranks = 2 simulated nodes x 2 (LOCAL_WORLD_SIZE) for the hierarchical checks (TP=2 x DP=2: two DP groups).
    _launch(
        4,
        ["gpt_tp2_dp2", "gpt_tp2_dp2_hierarchical", "gpt_pp2_dp2", "gpt_pp2_dp2_guard", "gpt_dp4_hierarchical"],
        tmp_path,
        env={"LOCAL_WORLD_SIZE": "2"},
    )
