"""fp8comm's FSDP2 integration against PyTorch's own fully_shard on CPU (gloo): options, layout, and two launches.

Single-process tests cover the option parser, the wire layout and the reduce-op mapping. One launch per world
size (2 and 4 ranks) runs the checks in fsdp2_checks*.py (training, hooks, shared param groups and defaults, error
feedback); each test below asserts one check and prints its
measured numbers (loss deltas, byte ratios). The example is run once through torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp

import fp8comm.integrations.fsdp2 as f2
from fp8comm.comm import WireConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))
import fsdp2_harness as H  # noqa: E402

WORLD2 = [
    "train_gpt_vs_plain",
    "train_gpt_fp4_gradients",
    "train_fp32_params_no_mp",
    "reshard_after_forward_false",
    "gradient_accumulation",
    "disable_restores_fsdp2",
    "state_dict_and_dcp",
    "reduce_ops_honoured",
    "block_alignment",
    "nonfinite_gradients_arrive",
    "uint8_gather_passes_through",
    "async_handles",
    "options_and_check_policy",
    "bad_inputs_are_refused",
    "fp8linear_weight_never_stale",
    "fp8linear_weight_cache_gathered",
    "shared_param_group",
    "defaults_are_communication_only",
    "error_feedback_memory_gate",
    "error_feedback_sqnr_gain",
]
WORLD4 = ["train_gpt_vs_plain", "hsdp_2d_mesh", "reduce_ops_honoured", "block_alignment"]
ENV = {"OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------------------- one process
def test_defaults_and_parse():
    d = f2.defaults()
    assert d["weights"] == {"enabled": True, "fmt": "e4m3", "scaling": "fp32", "block_size": 128}
    assert d["gradients"]["rounding"] == "nearest" and d["gradients"]["error_feedback"] is False
    assert d["gradients"]["allow_unpartitioned_residuals"] is False
    assert d["check"] is None and d["align_blocks"] is True
    cfg = f2.parse(weights=False, gradients={"fmt": "e5m2", "error_feedback": True}, check=False)
    assert not cfg.weights.enabled and cfg.gradients.fmt == "e5m2" and cfg.gradients.error_feedback
    assert cfg.gradients.wire(cfg.check) == WireConfig(
        fmt="e5m2", rounding="nearest", check="never", error_feedback=True
    )
    # residual_dtype: the names every adapter shares, and DeepSpeed's / Megatron's older spellings as aliases
    for given, name in (("float32", "float32"), ("fp32", "float32"), ("bf16", "bfloat16"), ("fp8", "fp8")):
        g = f2.parse(gradients={"error_feedback": True, "residual_dtype": given}).gradients
        assert g.residual_dtype == name and g.wire(None).residual_dtype == name, given


@pytest.mark.parametrize(
    "options, match",
    [
        ({"weight": True}, "did you mean 'weights'"),
        ({"gradients": {"rouding": "stochastic"}}, "did you mean 'rounding'"),
        ({"weights": {"rounding": "stochastic"}}, "unknown key weights"),
        ({"gradients": {"fmt": "e3m4"}}, "not valid"),
        ({"gradients": {"residual_dtype": "fp16"}}, "'float32', 'bfloat16', 'fp8', 'fp32', 'bf16'"),
        ({"weights": {"block_size": 100}}, "power of two"),
        ({"weights": {"block_size": True}}, "must be int"),
        ({"check": "always"}, "check must be None, True or False"),
        ({"align_blocks": 1}, "align_blocks must be True or False"),
        ({"gradients": {"allow_unpartitioned_residuals": "yes"}}, "must be bool"),
        ({"gradients": {"allow_unpartitioned": True}}, "did you mean 'allow_unpartitioned_residuals'"),
        ({"weights": "yes"}, "must be True/False, a dict"),
        ({"weights": {"fmt": "mxfp4"}}, "keeps no weight replica"),
        ({"gradients": {"fmt": "nvfp4", "hadamard": 32}}, "does not fit inside one 16-element"),
        ({"gradients": {"fmt": "e4m3", "hadamard": 16}}, "applies to the 4-bit formats"),
        ({"gradients": {"fmt": "mxfp4", "block_size": 64}}, "1x32 blocks"),
        ({"weights": False, "gradients": False}, "nothing to enable"),
    ],
)
def test_bad_options_name_the_problem(options, match):
    with pytest.raises(f2.Fp8CommFsdp2Error, match=match):
        f2.parse(**options)


def test_every_fsdp2_internal_we_read_exists(monkeypatch):
    assert f2.check_fsdp2_internals() == []
    key = next(iter(f2.FSDP2_INTERNALS))
    monkeypatch.setitem(f2.FSDP2_INTERNALS, key, ("renamed_in_a_future_torch",))
    assert f2.check_fsdp2_internals() == [f"{key}.renamed_in_a_future_torch"]


def test_spans_start_every_parameter_on_a_block():
    sp, n = f2.layout.spans([150, 50, 256, 1], 128, align=True)
    assert sp == [(0, 0, 150), (150, 256, 50), (200, 384, 256), (456, 640, 1)] and n == 768
    assert f2.layout.spans([150, 50], 128, align=False) == ([(0, 0, 200)], 200)
    src = torch.arange(2 * 200, dtype=torch.float32).view(2, 200)
    wire = f2.layout.pack_rows(src, *f2.layout.spans([150, 50], 128, True), factor=0.5)
    assert wire.shape == (2, 384) and wire[:, 150:256].abs().sum() == 0 and wire[:, 384 - 128 + 50 :].sum() == 0
    back = torch.empty_like(src)
    f2.layout.unpack_rows(back, wire, f2.layout.spans([150, 50], 128, True)[0])
    assert torch.equal(back, src * 0.5)


def test_reduce_ops_map_to_sum_avg_and_premultiply():
    assert f2.layout.reduce_op(ReduceOp.SUM) == ("sum", None)
    assert f2.layout.reduce_op(ReduceOp.AVG) == ("avg", None)
    kind, factor = f2.layout.reduce_op(ReduceOp.PREMUL_SUM(0.25))
    assert kind == "sum" and factor == 0.25
    for op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BAND):
        with pytest.raises(f2.Fp8CommFsdp2Error, match="supports SUM, AVG and PREMUL_SUM"):
            f2.layout.reduce_op(op)


def test_work_handle_is_a_torch_work_and_finishes_once():
    calls = []

    class Inner:
        def wait(self):
            calls.append("inner")

    w = f2.Fp8Work(Inner(), lambda: calls.append("after"))
    assert isinstance(w, torch.distributed.Work) and not w.is_completed()
    w.wait()
    w.wait()
    assert calls == ["inner", "after"] and w.is_completed()


# ------------------------------------------------------------------------------------------------ launches
def _launch(world: int, names: list[str], tmp_path_factory) -> dict:
    run = H.launch(world, names, tmp_path_factory.mktemp(f"fsdp2_w{world}"), env=ENV, timeout=420)  # a hang guard
    run["names"] = names
    return run


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _launch(2, WORLD2, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(4, WORLD4, tmp_path_factory)


def _assert_check(run: dict, name: str) -> dict:
    msgs = [m for m in H.failures(run, run["names"]) if f": {name}" in m or "exited" in m or "timed out" in m]
    rec = H.record(run, name)
    print(f"\n{name} ({run['seconds']} s launch): {json.dumps(rec and rec['info'], default=str)}")
    assert not msgs, "\n".join(msgs)
    return rec["info"]


@pytest.mark.dist
@pytest.mark.parametrize("name", WORLD2)
def test_world2(world2, name):
    _assert_check(world2, name)


@pytest.mark.dist
@pytest.mark.parametrize("name", WORLD4)
def test_world4(world4, name):
    _assert_check(world4, name)


@pytest.mark.dist
def test_example_under_torchrun(tmp_path):
    """examples/fsdp2_train.py --bench through torchrun: plain FSDP2 and FSDP2 + fp8comm, same data, one JSON."""
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(REPO / "examples" / "fsdp2_train.py"),
        "--bench",
        "--steps",
        "4",
        "--n-layer",
        "2",
        "--n-embd",
        "128",
        "--batch-size",
        "4",
        "--seq",
        "32",
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    print("\n" + r.stdout[-1500:])
    assert res["world"] == 2 and len(res["plain"]["losses"]) == 4 and res["loss_rel_diff"] < 0.02
    assert res["fp8"]["weights_ratio"] > 1.85 and res["fp8"]["gradients_ratio"] > 3.7
