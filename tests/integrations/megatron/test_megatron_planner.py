"""The planner switch for Megatron-Core (issue 30, items 3 and 6): the flags and their errors in one process, then
ONE launch of 4 gloo ranks as 2 simulated nodes x 2 (mcore_checks_planner.py): calibration files with chosen
numbers make the plan pick Megatron's own collective (bit-identical to Megatron alone) or a quantized wire (FP8
two-level; mxfp4 + error feedback with allow_4bit), comm_stats holds predicted and measured seconds, and foreign
calibration files are refused on every rank before anything moves."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fp8comm.integrations.megatron as fm
from fp8comm.comm import linkmodel as lm
from fp8comm.comm.calibration import Calibration, Link

NAMES = [
    "gpt_dp4_planner_fast_link_is_megatrons_own",
    "gpt_dp4_planner_slow_link_quantizes",
    "planner_bad_inputs_and_measurement",
]


@pytest.fixture(autouse=True)
def _clean():
    fm.uninstall()
    yield
    fm.uninstall()


def _ddp(**kw):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**{"use_distributed_optimizer": True, **kw})


def _parse(*argv: str):
    return fm.add_args(argparse.ArgumentParser()).parse_args(list(argv))


# ------------------------------------------------------------------------------------- flags, in one process
def test_planner_flags_parse_and_imply_the_planner(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at hyphens otherwise
    p = fm.add_args(argparse.ArgumentParser())
    assert fm.Fp8CommMegatronConfig.from_args(p.parse_args([])) == fm.Fp8CommMegatronConfig()
    cfg = fm.Fp8CommMegatronConfig.from_args(p.parse_args(["--fp8comm-planner"]))
    assert cfg.planner and not cfg.planner_allow_4bit and cfg.planner_calibration is None
    # --fp8comm-planner-allow-4bit and --fp8comm-planner-calibration imply --fp8comm-planner
    cfg = fm.Fp8CommMegatronConfig.from_args(p.parse_args(["--fp8comm-planner-allow-4bit"]))
    assert cfg.planner and cfg.planner_allow_4bit
    cfg = fm.Fp8CommMegatronConfig.from_args(
        p.parse_args(["--fp8comm-planner-calibration", "cal.json", "--fp8comm-planner-timeout", "5"])
    )
    assert cfg.planner and cfg.planner_calibration == "cal.json" and cfg.planner_settings.timeout_s == 5.0
    help_text = " ".join(p.format_help().split())
    assert "Turns on the collectives it chooses for: the gradient reduce-scatter / all-reduce" in help_text
    assert "the FP8 parameter all-gather (--fp8comm-param-gather)" in help_text
    assert "an error with --fp8comm-grad-format or --fp8comm-param-update-format" in help_text
    assert "Implies --fp8comm-planner" in help_text


def test_planned_settings_turn_on_what_the_planner_chooses():
    """The planner turns the gradient hook on, the FP8 parameter gather where the distributed optimizer gathers
    bf16/fp16 params; with allow_4bit the gradients' base config is mxfp4 with error feedback, nearest rounding."""
    cfg = fm.Fp8CommMegatronConfig(planner=True)
    on = cfg.planned(dist_opt=True)
    assert on.grad_reduce and on.param_gather and on.grad_fmt == "e4m3" and not on.error_feedback
    assert not cfg.planned(dist_opt=False).param_gather and not cfg.planned(params_fp32=True).param_gather
    assert not cfg.planned(te_quantized=True).param_gather
    four = fm.Fp8CommMegatronConfig(planner_allow_4bit=True, error_feedback_dtype="bf16").planned()
    g = four.wire("grad")
    assert (g.fmt, g.error_feedback, g.rounding, g.hadamard, g.residual_dtype) == (
        "mxfp4",
        True,
        "nearest",
        0,
        "bfloat16",
    ), g
    from fp8comm.comm import config_for

    f8 = config_for(g, "fp8")
    assert (f8.fmt, f8.block_size, f8.scaling, f8.error_feedback) == ("e4m3", 128, "fp32", True), f8
    assert four.wire("param").fmt == "e4m3" and not four.wire("param").is_fp4  # weights at most FP8
    d = on.describe(dist_opt=True)
    assert "grad reduce-scatter and param all-gather PLANNED per bucket-size class" in d, d
    assert "calibration: measured over the world at install" in d, d


@pytest.mark.parametrize(
    "argv, kw, match",
    [
        (
            ["--fp8comm-planner", "--fp8comm-grad-format", "e4m3"],
            None,
            r"--fp8comm-planner and --fp8comm-grad-format e4m3 both choose the gradients' wire",
        ),
        (None, dict(planner=True, grad_fmt="mxfp4"), r"--fp8comm-planner and --fp8comm-grad-format mxfp4"),
        (
            ["--fp8comm-planner-allow-4bit", "--fp8comm-param-update-format", "mxfp4"],
            None,
            r"--fp8comm-planner and --fp8comm-param-update-format mxfp4 both choose the parameter all-gather's wire",
        ),
        (None, dict(planner_allow_4bit=True, hadamard=32), r"--fp8comm-planner-allow-4bit with --fp8comm-hadamard 32"),
        (
            None,
            dict(planner_allow_4bit=True, rounding="stochastic"),
            r"--fp8comm-planner-allow-4bit with --fp8comm-rounding stochastic",
        ),
        # no torch.distributed in this process: the planner reads the node layout at install
        (["--fp8comm-planner"], None, r"--fp8comm-planner: torch.distributed is not initialized at install"),
    ],
)
def test_planner_conflicts_are_errors_before_anything_is_patched(argv, kw, match):
    if argv is not None:
        args = _parse(*argv)
        args.use_distributed_optimizer, args.bf16 = True, True
        with pytest.raises(fm.Fp8CommMegatronError, match=match):
            fm.install(args)
    else:
        with pytest.raises(fm.Fp8CommMegatronError, match=match):
            fm.install(ddp_config=_ddp(), **kw)
    assert fm.active_config() is None


@pytest.mark.parametrize(
    "value, match",
    [
        (dict(planner="yes"), r"planner must be True or False, got 'yes'"),
        (dict(planner_allow_4bit=1), r"planner_allow_4bit must be True or False"),
        (dict(planner_calibration=3), r"planner_calibration must be a file path or None"),
        (dict(planner=True, planner_timeout_s=0), r"--fp8comm-planner.timeout_s must be a number > 0"),
    ],
)
def test_bad_planner_values_are_refused(value, match):
    with pytest.raises(fm.Fp8CommMegatronError, match=match):
        fm.Fp8CommMegatronConfig(**value)


def test_a_foreign_calibration_file_is_refused_by_name(tmp_path):
    """Checked before anything moves: another fp8comm version, or another device kind (without torch.distributed
    the layout is unknown here; ranks per node is checked in the launch below)."""
    from fp8comm.integrations.megatron import planning

    s = lm.CodecSpeed(pack=1e9, unpack_sum=2e9, unpack=2e9)
    for name, over, match in (
        ("old", dict(version="0.0.1"), r"taken with fp8comm 0\.0\.1"),
        ("gpu", dict(device="cuda:NVIDIA H100"), r"taken on device kind 'cuda:NVIDIA H100', this job runs on 'cpu'"),
    ):
        path = tmp_path / f"{name}.json"
        kw = {"device": "cpu", "ranks_per_node": 2, "backend": "gloo", **over}
        path.write_text(Calibration(Link(1e9, 1e-5), Link(1e10, 1e-6), {"*": s}, **kw).to_json())
        cfg = fm.Fp8CommMegatronConfig(planner_calibration=str(path))
        rp = planning.RuntimePlanner(cfg.planner_settings, planning.policy(cfg), lambda s: None, planning.WHERE)
        with pytest.raises(Exception, match=match):
            rp.check_file("cpu", None)


# ------------------------------------------------------------------------------------- one 4-rank launch
@pytest.mark.dist
def test_four_ranks_the_plan_picks_megatrons_own_or_a_quantized_wire(tmp_path):
    import mcore_checks_planner as P
    import mcore_harness as H

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
    import dist_harness

    run = dist_harness.launch(
        4,
        tmp_path,
        env={"LOCAL_WORLD_SIZE": "2"},
        names=NAMES,
        timeout=300,  # a hang guard
        target=P.worker,
        store_timeout_s=120.0,
    )
    for n in NAMES:
        print(f"[4 ranks, {run['seconds']} s] {n}: {json.dumps(H.info(run, n), default=str)[:6000]}")
    fails = H.failures(run, NAMES)
    assert not fails, "\n".join(fails)
