"""Compact (fp8) error-feedback residuals in DeepSpeed: a checkpoint written with float32 residuals loads into an
engine configured with residual_dtype "fp8" (each residual encoded by the reference, a warning says so), and the
residual memory per rank before and after (the safety scenario; bit-exact resume of fp8 residuals is
ds_worker._checkpoint's)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import ds_train as T
import torch
import torch.distributed as dist

import fp8comm.integrations.deepspeed as fd
from fp8comm.quant.residual import COMPACT, encode_residual

EF = {"error_feedback": True, "allow_unpartitioned_residuals": True}  # ZeRO-2: the memory accepted


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def checkpoint_fp32_residuals_into_fp8(info):
    """Save at step 3 with float32 residuals ("fp32", the old spelling); load into an "fp8" engine: every
    parameter's residual becomes encode_residual(saved float32 residual) bit for bit, one warning names the
    conversion, training goes on (finite losses); residual bytes per rank: 4 per element before, 1 per element
    plus a 4-byte scale per parameter after."""
    ck = Path(os.environ["FP8COMM_TEST_OUT"]) / "ckpt_fp32_to_fp8"
    eng, _ = T.build(T.ds_config(2, "bf16", {"gemm": False, "gradients": {**EF, "residual_dtype": "fp32"}}))
    T.train(eng, range(0, 3))
    es = fd.engine_state(eng)
    saved = {k: r.clone() for k, r in es.residuals.store.items()}
    bytes32 = es.residuals.nbytes()
    eng.save_checkpoint(str(ck), tag="step3")
    T.destroy(eng)
    fd.uninstall()
    elements = sum(r.numel() for r in saved.values())
    assert saved and all(r.dtype == torch.float32 for r in saved.values()) and bytes32 == 4 * elements
    assert sum(float(r.norm()) > 0 for r in saved.values()) == len(saved), "a residual was zero at the save"

    handler = _Lines()
    logging.getLogger("fp8comm.deepspeed").addHandler(handler)
    try:
        eng2, _ = T.build(T.ds_config(2, "bf16", {"gemm": False, "gradients": {**EF, "residual_dtype": "fp8"}}), seed=1)
        eng2.load_checkpoint(str(ck), tag="step3")
    finally:
        logging.getLogger("fp8comm.deepspeed").removeHandler(handler)
    es2 = fd.engine_state(eng2)
    assert es2.residuals.name == "fp8" and set(es2.residuals.store) == set(saved)
    for k, r in saved.items():
        codes, scales = es2.residuals.store[k]
        want_codes, want_scales = encode_residual(r, COMPACT)
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales), f"{k}: not the reference's bits"
    bytes8 = es2.residuals.nbytes()
    assert bytes8 == elements + 4 * len(saved), (bytes8, elements, len(saved))
    said = [m for m in handler.lines if "converted" in m and "float32" in m and "fp8" in m]
    assert len(said) == 1, handler.lines
    rest = T.train(eng2, range(3, 6))
    assert all(math.isfinite(x) for x in rest.losses), rest.losses
    after = es2.residuals.nbytes()
    assert after == bytes8, (after, bytes8)  # the steps after the load keep the compact size
    info.update(
        rank=dist.get_rank(),
        parameters=len(saved),
        residual_elements=elements,
        residual_bytes_fp32=bytes32,
        residual_bytes_fp8=bytes8,
        log_line=said[0],
        losses_after=rest.losses,
    )
    T.destroy(eng2)
    fd.uninstall()
