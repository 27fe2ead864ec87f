"""Error feedback on Megatron's FP8 gradient reduce-scatter (2 gloo ranks, DP=2, several buckets).

What it shows: per-step gradient SQNR and the SQNR of the gradient SUMMED over all steps, against the exact
(fp64) reduction of the very same inputs, without and with error feedback (fp32, bf16 and compact fp8 residuals);
loss vs the baseline; residual memory; a skipped step zeroes the residuals; save -> restart -> load -> continue
equals the uninterrupted run bit for bit (fp32 and fp8 residuals); fp32 residuals of a checkpoint load into an fp8
installation, encoded by the reference, with a warning.
"""

from __future__ import annotations

import importlib
import io
import logging
import math

import mcore_checks as C
import mcore_train as T
import torch
import torch.distributed as dist
from mcore_probe import STEP_SQNR_MIN_DB, GradProbe

from fp8comm.quant.residual import encode_residual

PGB = "megatron.core.distributed.param_and_grad_buffer"
EF_KW = dict(overlap_grad_reduce=True, overlap_param_gather=True)  # several buckets, as gpt_dp2's overlap-on run
GRADS_ONLY = dict(grad_reduce=True)
# Bounds (measured values in the check's info; docs/megatron.md has them). Per-step SQNR: mcore_probe.
EF_CUMULATIVE_GAIN_DB = 6.0  # error feedback: the error of the summed gradient stays one step's residual


def _probed(hooks: dict, **kw) -> tuple[dict, dict]:
    probe = GradProbe()
    fm = C._fm()
    nbytes = {}

    def after(i):
        probe.per_step(i)
        nbytes["ef"] = fm.error_feedback_nbytes()

    run = C.run(EF_KW, hooks, train_kw={"after_backward": after}, on_install=probe.attach, **kw)
    return run, {**probe.summary(), "residual_bytes": nbytes.get("ef", 0)}


def _bucket_elements(model) -> int:
    return sum(b.grad_data.numel() for g in model.bucket_groups for b in g.buckets)


def gpt_dp2_error_feedback(rank, world, info):
    """Loss and gradient SQNR with and without error feedback; residual memory; bucket-keyed residuals."""
    T.init_parallel(tp=1)
    base = C.run(EF_KW, None)
    res = {}
    for tag, hooks in (
        ("no_ef", GRADS_ONLY),
        ("ef_fp32", dict(GRADS_ONLY, error_feedback=True)),
        ("ef_bf16", dict(GRADS_ONLY, error_feedback=True, error_feedback_dtype="bf16")),
        ("ef_fp8", dict(GRADS_ONLY, error_feedback=True, error_feedback_dtype="fp8")),
    ):
        f8, probe = _probed(hooks)
        C.check_parity(base, f8, info, tag)
        info[tag]["probe"] = probe
        res[tag] = (f8, probe)
    elements = _bucket_elements(res["no_ef"][0]["model"])
    info["bucket_elements"] = elements
    assert res["no_ef"][1]["residual_bytes"] == 0
    assert res["ef_fp32"][1]["residual_bytes"] == 4 * elements, (res["ef_fp32"][1], elements)
    assert res["ef_bf16"][1]["residual_bytes"] == 2 * elements, (res["ef_bf16"][1], elements)
    buckets = _bucket_count(res["no_ef"][0]["model"])
    assert res["ef_fp8"][1]["residual_bytes"] == elements + 4 * buckets, (res["ef_fp8"][1], elements, buckets)
    info["residual_bytes_per_rank"] = {t: res[t][1]["residual_bytes"] for t in ("ef_fp32", "ef_bf16", "ef_fp8")}
    for tag, (_, p) in res.items():
        assert p["step_sqnr_db_min"] >= STEP_SQNR_MIN_DB, f"{tag}: per-step gradient SQNR {p}"
    gain = res["ef_fp32"][1]["summed_grad_sqnr_db"] - res["no_ef"][1]["summed_grad_sqnr_db"]
    gain16 = res["ef_bf16"][1]["summed_grad_sqnr_db"] - res["no_ef"][1]["summed_grad_sqnr_db"]
    gain8 = res["ef_fp8"][1]["summed_grad_sqnr_db"] - res["no_ef"][1]["summed_grad_sqnr_db"]
    info["summed_grad_sqnr_gain_db"] = {"fp32": round(gain, 2), "bf16": round(gain16, 2), "fp8": round(gain8, 2)}
    assert min(gain, gain16, gain8) >= EF_CUMULATIVE_GAIN_DB, info["summed_grad_sqnr_gain_db"]
    C.check_replicas_identical(res["ef_fp32"][0]["params"], "ef_fp32")
    C.check_replicas_identical(res["ef_fp8"][0]["params"], "ef_fp8")
    sd32 = _checkpoint_resume(info, res["ef_fp32"][0], "fp32")
    _checkpoint_resume(info, res["ef_fp8"][0], "fp8")
    _fp32_checkpoint_into_fp8(info, sd32)
    _skipped_step(info)


def _checkpoint_resume(info, uninterrupted, dtype: str) -> dict:
    """Train ITERS/2 steps, save the residuals, uninstall (a restart), install, load, train the rest: equal.
    Returns the saved state dict."""
    fm = C._fm()
    half = C.ITERS // 2
    hooks = dict(GRADS_ONLY, error_feedback=True, error_feedback_dtype=dtype)
    model, opt, config = T.build(T.ddp_kwargs(**EF_KW))
    fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
    try:
        first = T.train(model, opt, config, half)
        buf = io.BytesIO()
        torch.save(fm.error_feedback_state_dict(model), buf)
    finally:
        fm.uninstall()
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    assert len(sd["residuals"]) == _bucket_count(model), (len(sd["residuals"]), _bucket_count(model))
    fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
    try:
        fm.load_error_feedback_state_dict(model, sd)
        rest = T.train(model, opt, config, C.ITERS - half, start=half)
    finally:
        fm.uninstall()
    loss, gnorm = first["loss"] + rest["loss"], first["grad_norm"] + rest["grad_norm"]
    info[f"checkpoint_resume_{dtype}"] = {
        "buckets": len(sd["residuals"]),
        "loss_last": loss[-1],
        "equal_loss": loss == uninterrupted["loss"],
        "equal_params": bool(torch.equal(T.param_vector(model), uninterrupted["params"])),
    }
    assert loss == uninterrupted["loss"] and gnorm == uninterrupted["grad_norm"], (loss, uninterrupted["loss"])
    assert torch.equal(T.param_vector(model), uninterrupted["params"]), "params differ after resume"
    bad = dict(sd, residuals={k: dict(v, bucket_numel=v["bucket_numel"] + 1) for k, v in sd["residuals"].items()})
    for installed, match in ((True, "same DP size and bucket layout"), (False, "needs an installation")):
        if installed:
            fm.install(ddp_config=model.ddp_config, transformer_config=config, **hooks)
        try:
            fm.load_error_feedback_state_dict(model, bad)
        except fm.Fp8CommMegatronError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"accepted: residuals for another bucket layout (installed: {installed})")
        finally:
            fm.uninstall()
    return sd


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fp32_checkpoint_into_fp8(info, sd32: dict) -> None:
    """A checkpoint written with float32 residuals loads into an installation keeping fp8 ones: every bucket's
    residual becomes the reference encoding of the saved one (bit for bit), each conversion is logged, training
    goes on; fp8 residuals refuse to load into a float32 installation (a clear error)."""
    fm = C._fm()
    model, opt, config = T.build(T.ddp_kwargs(**EF_KW))
    lines = _Lines()
    logging.getLogger("fp8comm.feedback").addHandler(lines)
    fm.install(
        ddp_config=model.ddp_config,
        transformer_config=config,
        **GRADS_ONLY,
        error_feedback=True,
        error_feedback_dtype="fp8",
    )
    try:
        fm.load_error_feedback_state_dict(model, sd32)
        sd8 = fm.error_feedback_state_dict(model)
        rest = T.train(model, opt, config, 1)
    finally:
        fm.uninstall()
        logging.getLogger("fp8comm.feedback").removeHandler(lines)
    assert set(sd8["residuals"]) == set(sd32["residuals"]) and sd32["residuals"], (sd8, sd32)
    for name, st in sd32["residuals"].items():
        assert st["dtype"] == "float32" and sd8["residuals"][name]["dtype"] == "fp8", (st["dtype"], name)
        codes, scales = encode_residual(st["residual"])
        got = sd8["residuals"][name]
        assert torch.equal(got["codes"], codes) and torch.equal(got["scales"], scales), f"{name}: not the reference"
    said = [m for m in lines.lines if "converted" in m and "float32" in m]
    assert len(said) == len(sd32["residuals"]), lines.lines
    assert math.isfinite(rest["loss"][0]), rest
    fm.install(ddp_config=model.ddp_config, transformer_config=config, **GRADS_ONLY, error_feedback=True)
    try:
        fm.load_error_feedback_state_dict(model, sd8)
    except fm.Fp8CommMegatronError as e:
        assert "saved as fp8, this run keeps float32" in str(e), e
    else:
        raise AssertionError("fp8 residuals loaded into a float32 installation")
    finally:
        fm.uninstall()
    info["fp32_checkpoint_into_fp8"] = {"buckets": len(sd32["residuals"]), "log_line": said[0]}


def _bucket_count(model) -> int:
    return sum(len(g.buckets) for g in model.bucket_groups + model.expert_parallel_bucket_groups)


def _skipped_step(info) -> None:
    """An inf in one rank's gradient: Megatron skips the step (constant loss scale 1.0 checks for inf/NaN), and
    fp8comm zeroes every residual (the step's gradients are dropped, so is their error); training continues."""
    fm = C._fm()
    model, opt, config = T.build(T.ddp_kwargs(**EF_KW), opt_kw={"loss_scale": 1.0})
    fm.install(ddp_config=model.ddp_config, transformer_config=config, **dict(GRADS_ONLY, error_feedback=True))
    pgb = importlib.import_module(PGB)
    inner, calls = pgb.dist_reduce_scatter_func, []

    def poison(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(1)
        if len(calls) == 1 + _bucket_count(model) and dist.get_rank() == 0:  # step 1, first bucket, rank 0 only
            input[0] = float("inf")
        return inner(output, input, op=op, group=group, async_op=async_op)

    pgb.dist_reduce_scatter_func = poison
    try:
        fm.hook_stats(reset=True)
        h = T.train(model, opt, config, 2, allow_skip=True)
        live = [ef for ref, ef in fm.installation().residuals.values() if ref() is not None]
        after_skip = [ef.nbytes() for ef in live]
        resets = fm.hook_stats().get("error_feedback", {}).get("skipped_step_resets", 0)
        h2 = T.train(model, opt, config, 1, start=2)
        after_next = sum(ef.norm() > 0 for ef in live)
    finally:
        fm.uninstall()
    info["skipped_step"] = {
        "skipped": h["skipped"],
        "resets": resets,
        "residual_bytes_after_skip": sum(after_skip),
        "buckets_with_residual_next_step": after_next,
        "loss": h["loss"] + h2["loss"],
    }
    assert h["skipped"] == [1] and resets == 1, info["skipped_step"]
    assert live and sum(after_skip) == 0, f"residuals survived a skipped step: {after_skip}"
    assert after_next == len(live) and math.isfinite(h2["loss"][0]) and not h2["skipped"], info["skipped_step"]
