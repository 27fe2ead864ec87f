"""Checks run inside mcore_harness launches: real megatron-core on gloo ranks, baseline vs fp8comm hooks.

Tolerances (also in docs/megatron.md):
- ITERS training iterations from identical weights and data; per-iteration loss within LOSS_RTOL of the baseline.
  FP8 perturbs every step a little (E4M3 rounds each value within 2^-4 relative) and the runs drift apart
  chaotically; measured max deviation ~1% at 20 iterations, 2x margin, while a broken hook (stale, zero,
  misplaced or double-counted gradients, a wrong shard) moves the loss by tens of percent within a few steps.
- grad norm: the FIRST step (same weights, only the gradient quantization differs) within the E4M3 bound 2^-4;
  later steps within GNORM_RTOL (the trajectories have diverged; measured <= 10%), and the mean deviation over
  all steps within GNORM_MEAN_RTOL.
- bytes: each hook's wire/dtype byte ratio within [ALIGN_SLACK, 1] x the ideal itemsize / (1 + scale/block).
- parameters bit-identical across data-parallel replicas after training (FP8 gathers decode the same bytes).
- element-wise: every FP8 run's gradient reduction, per step and bucket, against the exact fp64 reduction of the
  same inputs (mcore_probe.GradProbe): SQNR >= 25 dB on every step, on every DP group (TP rank, pipeline stage).
"""

from __future__ import annotations

import os

import mcore_train as T
import torch
import torch.distributed as dist
from mcore_probe import GradProbe

ITERS = 20
E4M3_REL = 2.0**-4
LOSS_RTOL = 0.02
GNORM_RTOL = 0.2
GNORM_MEAN_RTOL = 0.06
ALIGN_SLACK = 0.9  # wire chunks are 16-byte aligned: small buckets pay a little padding
MOE_LOSS_RTOL = E4M3_REL / 8  # one forward: dispatched tokens carry E4M3 error, the loss averages it down
MOE_GRAD_RTOL = E4M3_REL  # relative L2 error of all gradients after one backward through FP8-dispatched tokens


def _fm():
    import fp8comm.integrations.megatron as fm

    return fm


def _stats():
    from fp8comm.comm import comm_stats, reset_comm_stats

    return comm_stats, reset_comm_stats


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


_BASELINES: dict = {}  # (layout, settings) -> a baseline run's loss/grad_norm, shared by the checks of a launch


def _layout() -> tuple:
    from megatron.core import parallel_state as ps

    return (
        dist.get_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )


def run(
    ddp_kw: dict,
    hooks: dict | None,
    iters: int = ITERS,
    moe: bool = False,
    train_kw: dict | None = None,
    opt_kw: dict | None = None,
    on_install=None,
    cfg_over: dict | None = None,
) -> dict:
    """Train a fresh model (same seed) with `hooks` installed (None: baseline); stats and params of the run.

    on_install(model): called right after install (e.g. to wrap the installed hook with a probe). cfg_over:
    TransformerConfig overrides (e.g. the MoE token dispatcher).
    A plain baseline (no hooks, no options) is run once per layout and settings and then reused.
    """
    key = (_layout(), tuple(sorted(ddp_kw.items())), iters, moe, tuple(sorted((cfg_over or {}).items())))
    plain = hooks is None and not train_kw and not opt_kw and on_install is None
    if plain and key in _BASELINES:
        return _BASELINES[key]
    comm_stats, reset_comm_stats = _stats()
    fm = _fm()
    fm.hook_stats(reset=True)
    reset_comm_stats()
    model, opt, config = T.build(T.ddp_kwargs(**ddp_kw), moe=moe, opt_kw=opt_kw, **(cfg_over or {}))
    if hooks is not None:
        fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
        if on_install is not None:
            on_install(model)
    try:
        hist = T.train(model, opt, config, iters, **(train_kw or {}))
    finally:
        fm.uninstall()
    hist.update(
        comm=comm_stats(),
        hooks=fm.hook_stats(reset=True),
        params=T.param_vector(model),
        bucket_groups=len(model.bucket_groups),
        model=model,
        optimizer=opt,
        config=config,
    )
    if plain:
        _BASELINES[key] = hist
    return hist


def check_parity(base: dict, f8: dict, info: dict, tag: str) -> None:
    n = len(f8["loss"])  # a shorter FP8 run compares with the baseline's first n iterations
    lb, l8, gb, g8 = base["loss"][:n], f8["loss"], base["grad_norm"][:n], f8["grad_norm"]
    assert lb[-1] < lb[0], f"{tag}: baseline did not learn ({lb[0]} -> {lb[-1]})"
    dl = [_rel(a, b) for a, b in zip(l8, lb)]
    dg = [_rel(a, b) for a, b in zip(g8, gb)]
    info[tag] = {
        "loss_base": [round(x, 4) for x in (lb[0], lb[-1])],
        "loss_fp8": [round(x, 4) for x in (l8[0], l8[-1])],
        "max_loss_rel": round(max(dl), 5),
        "gnorm_rel_step1": round(dg[0], 5),
        "max_gnorm_rel": round(max(dg), 4),
        "mean_gnorm_rel": round(sum(dg) / len(dg), 4),
        "buckets": f8["bucket_groups"],
        "comm": {
            k: {"calls": v["calls"], "wire": v["wire_bytes"], "ratio": round(v["ratio"], 3)}
            for k, v in f8["comm"].items()
        },
        "hooks": f8["hooks"],
    }
    assert max(dl) <= LOSS_RTOL, f"{tag}: loss deviates by {max(dl):.4f} > {LOSS_RTOL}: {l8} vs {lb}"
    assert dg[0] <= E4M3_REL, f"{tag}: first-step grad norm deviates by {dg[0]:.4f} > 2^-4"
    assert max(dg) <= GNORM_RTOL, f"{tag}: grad norm deviates by {max(dg):.4f} > {GNORM_RTOL}: {g8} vs {gb}"
    assert sum(dg) / len(dg) <= GNORM_MEAN_RTOL, f"{tag}: mean grad norm deviation {sum(dg) / len(dg):.4f}"
    assert l8 != lb or g8 != gb, f"{tag}: FP8 run is bit-identical to the baseline: no hook changed anything"


def check_bytes(f8: dict, op: str, itemsize: int, tag: str) -> None:
    """The hook moved FP8 bytes, at the saving the wire format promises (payload 1 B + one scale per block)."""
    s = f8["comm"].get(op)
    assert s and s["calls"] > 0 and s["wire_bytes"] > 0, f"{tag}: no FP8 {op} recorded: {f8['comm']}"
    ideal = itemsize / (1 + 4 / 128)  # fp32 scales, 1x128 blocks (the defaults)
    assert ALIGN_SLACK * ideal <= s["ratio"] <= ideal * (1 + 1e-9), f"{tag}: {op} ratio {s['ratio']} vs {ideal}"


def check_replicas_identical(params: torch.Tensor, tag: str) -> None:
    """Every data-parallel replica (same TP rank) holds bit-identical parameters."""
    from megatron.core import parallel_state as ps

    g = ps.get_data_parallel_group()
    allp = [torch.empty_like(params) for _ in range(dist.get_world_size(g))]
    dist.all_gather(allp, params, group=g)
    bad = [i for i, p in enumerate(allp) if not torch.equal(p, params)]
    assert not bad, f"{tag}: parameters differ from data-parallel peers {bad}"


def probed_run(
    ddp_kw: dict, hooks: dict, tag: str, train_kw: dict | None = None, on_install=None, **kw
) -> tuple[dict, dict]:
    """run() with a GradProbe on the FP8 gradient reduction: every step's element-wise SQNR checked."""
    probe = GradProbe()
    tk = dict(train_kw or {})
    after = tk.get("after_backward")
    tk["after_backward"] = lambda i: (probe.per_step(i), after and after(i))
    if ddp_kw.get("use_distributed_optimizer", True):

        def attach(model):
            probe.attach(model)
            if on_install is not None:
                on_install(model)

        f8 = run(ddp_kw, hooks, train_kw=tk, on_install=attach, **kw)
    else:  # plain DDP: fp8comm's bucket all-reduce
        with probe.all_reduce():
            f8 = run(ddp_kw, hooks, train_kw=tk, on_install=on_install, **kw)
    return f8, probe.check(tag, kw.get("iters", ITERS))


def _dense_pair(rank, world, info, tp: int, overlaps=(False, True), hierarchical: bool = False) -> None:
    T.init_parallel(tp=tp)
    for ov in overlaps:
        tag = f"tp{tp}_dp{world // tp}_overlap_{'on' if ov else 'off'}" + ("_hier" if hierarchical else "")
        kw = dict(overlap_grad_reduce=ov, overlap_param_gather=ov)
        base = run(kw, None)
        f8, probe = probed_run(kw, dict(grad_reduce=True, param_gather=True, hierarchical=hierarchical), tag)
        check_parity(base, f8, info, tag)
        info[tag]["probe"] = probe
        if ov:
            assert f8["bucket_groups"] > 1, f"{tag}: expected several buckets, got {f8['bucket_groups']}"
        h = f8["hooks"]
        assert h["grad_reduce_scatter"]["fp8_calls"] > 0 and h["param_all_gather"]["fp8_calls"] > 0, h
        if not hierarchical:
            check_bytes(f8, "reduce_scatter", 4, tag)  # grad_reduce_in_fp32: fp32 gradient buckets
            check_bytes(f8, "all_gather", 2, tag)  # bf16 parameter buffers
        check_replicas_identical(f8["params"], tag)


# ------------------------------------------------------------------------------------------------ 2 ranks
def gpt_dp2(rank, world, info):
    """DP=2, distributed optimizer, overlap off (one bucket, Megatron's rule) and on (several buckets)."""
    _dense_pair(rank, world, info, tp=1)


def gpt_dp2_fp32_accumulation(rank, world, info):
    """reduce_scatter_with_fp32_accumulation=True: Megatron swaps in that name; fp8comm's version must win."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    T.init_parallel(tp=1)
    kw = dict(
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        reduce_scatter_with_fp32_accumulation=True,
        grad_reduce_in_fp32=False,
    )
    # Megatron rebinds the module global dist_reduce_scatter_func for the rest of the process when a bucket group
    # is built with this flag; a later model without the flag would then drop its reduce-scatter handle.
    # Restore it so the checks that follow in this process see stock Megatron again.
    saved = pgb.dist_reduce_scatter_func
    try:
        base = run(kw, None)
        f8 = run(kw, dict(grad_reduce=True))
    finally:
        pgb.dist_reduce_scatter_func = saved
    check_parity(base, f8, info, "fp32_accumulation")
    assert f8["hooks"]["grad_reduce_scatter"]["fp8_calls"] > 0, f8["hooks"]
    check_bytes(f8, "reduce_scatter", 2, "fp32_accumulation")  # bf16 gradient buckets


def plugin_end_to_end(rank, world, info):
    """megatron.training parse_and_validate_args(extra_args_provider=add_args) -> install -> train (example)."""
    from megatron.core import parallel_state as ps

    import fp8comm.integrations.megatron.pretrain_gpt as example

    ps.destroy_model_parallel()
    common = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "127",
        "--transformer-impl",
        "local",
        "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-masked-softmax-fusion",
        "--no-persist-layer-norm",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--lr",
        "3e-3",
        "--log-interval",
        "1",
    ]
    hist = example.main(
        common
        + [
            "--train-iters",
            "4",
            "--bf16",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--fp8comm-grad-reduce",
            "--fp8comm-param-gather",
            "--fp8comm-scaling",
            "e8m0",
            "--fp8comm-error-feedback",
            "--fp8comm-error-feedback-dtype",
            "bf16",
        ]
    )
    info["example"] = {
        "loss": [round(x, 4) for x in hist["loss"]],
        "hooks": hist["hook_stats"],
        "comm": {k: v["wire_bytes"] for k, v in hist["comm_stats"].items()},
        "error_feedback_bytes": hist["error_feedback_bytes"],
    }
    assert hist["hook_stats"]["grad_reduce_scatter"]["fp8_calls"] > 0, hist["hook_stats"]
    assert hist["error_feedback_bytes"] > 0, "the --fp8comm-error-feedback flag did not reach the gradient hook"
    assert hist["hook_stats"]["param_all_gather"]["fp8_calls"] > 0, hist["hook_stats"]
    assert hist["loss"][-1] < hist["loss"][0], hist["loss"]
    # --bf16 without --grad-reduce-in-bf16: Megatron-LM's trainer reduces gradients in fp32 buckets; so must its example
    assert hist["grad_reduce_in_fp32"] is True, "the example built bf16 gradient buckets where Megatron-LM uses fp32"
    assert _fm().active_config() is None, "the example must uninstall on exit"
    # Invalid combinations: the parsed args reach install(), which refuses with the reason.
    from megatron.training.arguments import parse_args

    errors = {}
    for extra, needle in (
        (
            ["--bf16", "--fp8comm-grad-reduce", "--fp8comm-param-gather"],
            "--fp8comm-param-gather needs --use-distributed",
        ),
        (["--use-distributed-optimizer", "--fp8comm-param-gather"], "master weights"),
        (["--bf16", "--use-distributed-optimizer", "--fp8comm-moe-dispatch"], "--num-experts"),
        (
            ["--bf16", "--use-distributed-optimizer", "--fp8comm-param-gather", "--fp8comm-error-feedback"],
            "--fp8comm-error-feedback needs --fp8comm-grad-reduce",
        ),
        (["--bf16", "--fp8comm-param-update-format", "mxfp4"], "needs --use-distributed-optimizer"),
        (["--use-distributed-optimizer", "--fp8comm-param-update-format", "nvfp4"], "no separate master"),
        (
            [
                "--bf16",
                "--use-distributed-optimizer",
                "--fp8comm-param-gather",
                "--fp8comm-param-update-format",
                "mxfp4",
            ],
            "choose one",
        ),
        (
            ["--bf16", "--fp8comm-grad-reduce", "--fp8comm-grad-format", "mxfp4", "--fp8comm-block-size", "64"],
            "apply to FP8 wires only",
        ),
        (
            [
                "--bf16",
                "--use-distributed-optimizer",
                "--num-experts",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                "flex",
                "--fp8comm-moe-combine",
                "fp8",
            ],
            "supported dispatchers: alltoall, allgather",
        ),
    ):
        import sys

        saved, sys.argv = sys.argv, ["pretrain_gpt.py"] + common + extra
        try:
            args = parse_args(extra_args_provider=_fm().add_args)
        finally:
            sys.argv = saved
        try:
            _fm().install(args)
        except _fm().Fp8CommMegatronError as e:
            errors[" ".join(extra)] = str(e)
            assert needle in str(e), f"error for {extra} does not mention {needle!r}: {e}"
        else:
            raise AssertionError(f"install accepted the invalid combination {extra}")
        assert _fm().active_config() is None
    info["errors"] = errors


# ------------------------------------------------------------------------------------------------ 4 ranks
def gpt_tp2_dp2(rank, world, info):
    """TP=2 x DP=2, distributed optimizer, overlap off and on."""
    _dense_pair(rank, world, info, tp=2)


def gpt_dp4_hierarchical(rank, world, info):
    """DP=4 as 2 nodes x 2 ranks (LOCAL_WORLD_SIZE=2): fp32 inside a node, FP8 across nodes."""
    _dense_pair(rank, world, info, tp=1, overlaps=(True,), hierarchical=True)
    c = info["tp1_dp4_overlap_on_hier"]["comm"]
    assert c.get("reduce_scatter.intra", {}).get("calls", 0) > 0 and c["reduce_scatter"]["wire"] > 0, c
    # Error feedback in hierarchical mode: the residual is the inter-node (FP8) phase's, on the node-reduced chunk.
    # Half the iterations (parity is checked on those against the first half of the baseline): it only has to
    # show the combination trains and what the residual costs.
    kw = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    held = {}
    ef = run(
        kw,
        dict(grad_reduce=True, hierarchical=True, error_feedback=True),
        iters=ITERS // 2,
        train_kw={"after_backward": lambda i: held.update(bytes=_fm().error_feedback_nbytes())},
    )
    check_parity(run(kw, None), ef, info, "tp1_dp4_overlap_on_hier_ef")
    elements = sum(b.grad_data.numel() for g in ef["model"].bucket_groups for b in g.buckets)
    info["tp1_dp4_overlap_on_hier_ef"]["residual_bytes"] = held["bytes"]
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    assert held["bytes"] == 4 * elements // local, (held, elements)  # fp32, 1/LOCAL_WORLD_SIZE of each bucket


def gpt_dp2_plain_ddp(rank, world, info):
    """Plain DDP (no distributed optimizer): Megatron all-reduces each bucket; fp8comm's FP8 all-reduce (FP8
    reduce-scatter, fp32 sum, FP8 all-gather of the sums) takes it. Overlap off (1 bucket) and on (several);
    parity, bytes, the element-wise probe, replicas bit-identical; error feedback on the all-reduce path."""
    T.init_parallel(tp=1)
    for ov in (False, True):
        tag = f"plain_ddp_overlap_{'on' if ov else 'off'}"
        kw = dict(use_distributed_optimizer=False, overlap_grad_reduce=ov)
        base = run(kw, None)
        f8, probe = probed_run(kw, dict(grad_reduce=True), tag)
        check_parity(base, f8, info, tag)
        info[tag]["probe"] = probe
        h = f8["hooks"]
        assert h["grad_all_reduce"]["fp8_calls"] > 0 and "grad_reduce_scatter" not in h, h
        buckets = sum(len(g.buckets) for g in f8["model"].bucket_groups)
        assert h["grad_all_reduce"]["fp8_calls"] == ITERS * buckets, (h, buckets)
        if ov:
            assert f8["bucket_groups"] > 1, f"{tag}: expected several buckets, got {f8['bucket_groups']}"
        check_bytes(f8, "all_reduce", 4, tag)  # fp32 gradient buckets, both phases on the wire
        assert set(f8["comm"]) == {"all_reduce"}, f8["comm"]  # no other fp8comm collective ran
        check_replicas_identical(f8["params"], tag)
    kw = dict(use_distributed_optimizer=False, overlap_grad_reduce=True)
    held: dict = {}
    ef = run(
        kw,
        dict(grad_reduce=True, error_feedback=True),
        iters=ITERS // 2,
        train_kw={"after_backward": lambda i: held.update(bytes=_fm().error_feedback_nbytes())},
    )
    check_parity(run(kw, None), ef, info, "plain_ddp_ef")
    elements = sum(b.grad_data.numel() for g in ef["model"].bucket_groups for b in g.buckets)
    info["plain_ddp_ef"]["residual_bytes"] = held["bytes"]
    assert held["bytes"] == 4 * elements, (held, elements)  # fp32: one residual per bucket, its padded size
    check_replicas_identical(ef["params"], "plain_ddp_ef")


def gpt_tp2_dp2_hierarchical(rank, world, info):
    """TP=2 x DP=2 as 2 nodes x 2 ranks, hierarchical on: two DP groups ([0, 2], [1, 3]), one member per node each,
    so nothing can be summed inside a node: both run flat, with that reason, and install() creates no group.
    Mechanism: every dist.new_group call of the run (install + training) is exchanged across all ranks as it
    happens and must have the same members on every rank; none may happen during install or after it. Then
    parity, bytes and the probe, as for the flat runs."""
    from fp8comm.integrations.megatron.installation import installed

    T.init_parallel(tp=2)
    calls: list = []
    mark: dict = {}
    real = dist.new_group

    def new_group(ranks=None, *a, **k):
        seen: list = [None] * world
        dist.all_gather_object(seen, None if ranks is None else sorted(ranks))  # the world is every rank's group
        calls.append(seen[rank])
        assert all(s == seen[0] for s in seen), f"new_group call {len(calls)} differs across ranks: {seen}"
        return real(ranks, *a, **k)

    def on_install(m):
        mark.update(at_install=len(calls), why={str(list(r)): s.describe() for r, s in installed().node_groups.items()})

    kw = dict(overlap_grad_reduce=True, overlap_param_gather=True)
    tag = "tp2_dp2_overlap_on_hier"
    base = run(kw, None)
    dist.new_group = new_group
    try:
        f8, probe = probed_run(
            kw, dict(grad_reduce=True, param_gather=True, hierarchical=True), tag, on_install=on_install
        )
    finally:
        dist.new_group = real
    check_parity(base, f8, info, tag)
    info[tag].update(probe=probe, new_group_calls=calls, decisions=mark["why"])
    assert mark["at_install"] == 0 and not calls, f"node groups created for groups that run flat: {calls}"
    assert sorted(mark["why"]) == ["[0, 2]", "[1, 3]"], mark["why"]
    assert all("flat (one member per node" in v for v in mark["why"].values()), mark["why"]
    h = f8["hooks"]
    assert h["grad_reduce_scatter"]["fp8_calls"] > 0 and h["param_all_gather"]["fp8_calls"] > 0, h
    assert not [k for k in f8["comm"] if k.endswith(".intra")], f"{tag}: a group that cannot be split ran two-level"
    check_bytes(f8, "reduce_scatter", 4, tag)  # one member per node: everything crosses nodes in FP8
    check_bytes(f8, "all_gather", 2, tag)
    check_replicas_identical(f8["params"], tag)
