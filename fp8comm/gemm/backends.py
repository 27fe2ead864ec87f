"""Scaled FP8 GEMM backends behind one dispatch: torch._scaled_mm, a Triton block-scaled GEMM, CPU emulation.

Contract of every backend: `out = a @ b.T` for FP8 operands a [M, K] and b [N, K] whose scales (Fp8Tensor.scale,
laid out by Fp8Tensor.scaling over each operand's own [rows, K] view) are constant within each K block; products
are exact, accumulation is fp32 within a K block, and each block's partial sum is promoted (scaled and added in
fp32), the DeepSeek-V3 scheme. The emulation is the reference; the others are tested against it.

Routing is never silent (routing.py): every GEMM increments a counter `gemm.<backend>[.<why>]` (padding, fallbacks),
and each new routing decision is logged once at DEBUG on the "fp8comm.gemm" logger (a failed backend at WARNING).
There is no BF16 fallback: when no FP8 backend can take a GEMM, the exact emulation runs.
"""

from __future__ import annotations

import math
import os

import torch

from ..errors import Fp8CommError, Fp8CommNotImplementedError
from ..quant import Fp8Tensor
from . import block_scaled_mm
from .operands import check_operands, pad_to, round_up, row_scales, scale_kind, transpose
from .routing import ROUTING, log

__all__ = [
    "BACKENDS",
    "gemm",
    "emulate",
    "emulate_f64",
    "scaled_mm",
    "scale_kind",
    "transpose",
    "check_operands",
    "row_scales",
]

BACKENDS = ("auto", "emulation", "scaled_mm", "triton")


def emulate(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: FP8 codes upcast exactly to fp32, one fp32 matmul per K block, scales applied per block."""
    check_operands(a, b)
    m, k = a.shape
    n = b.shape[0]
    sa, ca = row_scales(a)
    sb, cb = row_scales(b)
    if k == 0 or m == 0 or n == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.data.device)
    if sa.shape[1] == 1 and sb.shape[1] == 1:  # scales constant along K: one matmul, scale the result
        return (a.data.float() @ b.data.float().t()).mul_(sa).mul_(sb.t()).to(out_dtype)
    kblk = math.gcd(min(ca, k), min(cb, k))
    nk = -(-k // kblk)
    # [nk, rows, kblk] stacks of K blocks (zero codes pad a partial last block: they add exactly nothing)
    a3 = pad_to(a.data, m, nk * kblk).float().view(m, nk, kblk).transpose(0, 1)
    b3 = pad_to(b.data, n, nk * kblk).float().view(n, nk, kblk).permute(1, 2, 0)
    # scales per K block: [nk, m, 1] and [nk, 1, n] (a scale column spans ca // kblk K blocks)
    sa_t = (sa if ca == kblk else sa.repeat_interleave(ca // kblk, 1)[:, :nk]).t().unsqueeze(2)
    sb_t = (sb if cb == kblk else sb.repeat_interleave(cb // kblk, 1)[:, :nk]).t().unsqueeze(1)
    out: torch.Tensor | None = None
    g = max(1, (1 << 24) // max(m * n, 1))  # K blocks per batched matmul: bounds the [g, m, n] temporary
    for k0 in range(0, nk, g):
        part = torch.bmm(a3[k0 : k0 + g], b3[k0 : k0 + g])  # fp32 accumulation within each K block
        part = part.mul_(sa_t[k0 : k0 + g]).mul_(sb_t[k0 : k0 + g]).sum(0)  # in place: CPU broadcasts are slow
        out = part if out is None else out.add_(part)
    assert out is not None  # nk >= 1
    return out.to(out_dtype)


def emulate_f64(a: Fp8Tensor, b: Fp8Tensor) -> torch.Tensor:
    """float64 product of the dequantized operands (the ground truth the backends are tested against)."""

    def deq(q):
        s, c = row_scales(q)
        return q.data.double() * s.double().repeat_interleave(c, 1)[:, : q.shape[1]]

    return deq(a) @ deq(b).t()


# ---------------------------------------------------------------------------------------------------- scaled_mm
def blockwise_layout(device: torch.device, pair: str) -> block_scaled_mm.Layout | None:
    """The block-scaled GEMM layout for 1x128 x `pair` ("block128x128" or "block1x128") on `device`, probed once
    per device and pair against the emulation (block_scaled_mm); None when no layout agrees or runs."""
    key = f"{device}/{pair}"
    if key not in ROUTING.blockwise_probe:
        ROUTING.blockwise_probe[key] = block_scaled_mm.probe(device, pair, emulate) or False
    return ROUTING.blockwise_probe[key] or None


def scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch._scaled_mm for tensorwise, rowwise and (CUDA, when available) 1x128 x 128x128 / 1x128 x 1x128 blocks.

    Dims it cannot take (K or N not a multiple of 16; K not a multiple of 128 for blocks) are zero-padded: zero
    codes add exactly nothing, padded rows are sliced off.
    """
    check_operands(a, b)
    ka, kb_ = scale_kind(a), scale_kind(b)
    m, k = a.shape
    n = b.shape[0]
    blockwise = ka == "block1x128" and kb_ in block_scaled_mm.PAIRS
    if not ((ka == kb_ and ka in ("tensor", "row")) or blockwise):
        raise Fp8CommNotImplementedError(f"_scaled_mm takes tensorwise, rowwise or 1x128 blocks, not {ka} x {kb_}")
    if blockwise:
        lay = blockwise_layout(a.data.device, kb_)
        if lay is None:
            raise Fp8CommNotImplementedError(f"this torch/GPU has no block-scaled GEMM for 1x128 x {kb_[5:]}")
        if (round_up(m, 16), round_up(n, 16), round_up(k, lay.kmult)) != (m, n, k):
            ROUTING.count("gemm.scaled_mm.pad")
        return block_scaled_mm.matmul(lay, a, b, kb_, out_dtype)
    mp, np_, kp = round_up(max(m, 1), 16), round_up(max(n, 1), 16), round_up(max(k, 1), 16)
    if (mp, np_, kp) != (m, n, k):
        ROUTING.count("gemm.scaled_mm.pad")
    ad = pad_to(a.data.contiguous(), mp, kp)
    bd = pad_to(b.data.contiguous(), np_, kp)
    if ka == "tensor":
        sa, sb = a.scale.reshape(1, 1).float(), b.scale.reshape(1, 1).float()
    else:
        sa = pad_to(a.scale.float(), mp, 1, 1.0).contiguous()
        sb = pad_to(b.scale.float(), np_, 1, 1.0).reshape(1, np_).contiguous()
    out = torch._scaled_mm(ad, bd.t(), sa, sb, out_dtype=out_dtype)
    return out[:m, :n] if (mp, np_) != (m, n) else out


# ---------------------------------------------------------------------------------------------------- dispatch
def _triton_ok(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def candidates(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> list[tuple[str, str]]:
    """Backends to try, best first, each with the reason it is (or is not) the first choice."""
    dev = a.data.device
    ka, kb_ = scale_kind(a), scale_kind(b)
    cands: list[tuple[str, str]] = []
    if dev.type == "cuda":
        fp8_pair_ok = not (a.fmt.name == "e5m2" and b.fmt.name == "e5m2")  # cuBLAS has no e5m2 x e5m2
        if ka == kb_ == "tensor" and fp8_pair_ok:
            cands.append(("scaled_mm", ""))
        elif ka == kb_ == "row" and a.fmt.name == b.fmt.name == "e4m3" and out_dtype == torch.bfloat16:
            cands.append(("scaled_mm", ""))
        elif (
            ka == "block1x128"
            and kb_ in ("block128x128", "block1x128")
            and a.fmt.name == b.fmt.name == "e4m3"
            and out_dtype == torch.bfloat16
            and blockwise_layout(dev, kb_) is not None
        ):
            cands.append(("scaled_mm", ""))
        if _triton_ok(dev):
            cands.append(("triton", "" if not cands else "fallback"))
        cands.append(("emulation", "no-fp8-kernel"))
    else:
        cands.append(("emulation", ""))
    return cands


def gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """a @ b.T from FP8 operands, fp32 accumulation, output in `out_dtype`; `backend` picks or forces one."""
    if backend not in BACKENDS:
        raise Fp8CommError(f"unknown GEMM backend {backend!r}; valid: {', '.join(BACKENDS)}")
    check_operands(a, b)
    if backend == "auto":
        cands = candidates(a, b, out_dtype)
    else:
        cands = [(backend, "forced")]
    sig = (str(a.data.device), scale_kind(a), scale_kind(b), a.fmt.name, b.fmt.name, str(out_dtype))
    compiling = torch.compiler.is_compiling()
    for i, (name, why) in enumerate(cands):
        if (name, sig) in ROUTING.failed and backend == "auto":
            continue
        if not compiling:
            key = f"gemm.{name}" + (f".{why}" if why else "")
            ROUTING.count(key)
            if (key, sig) not in ROUTING.logged:
                ROUTING.logged.add((key, sig))
                log.debug(
                    "GEMM %s x %s (%s x %s, out %s) -> %s%s",
                    scale_kind(a),
                    scale_kind(b),
                    a.fmt,
                    b.fmt,
                    out_dtype,
                    name,
                    f" ({why})" if why else "",
                )
        fn = _BACKEND_FNS[name]
        if compiling or backend != "auto" or i == len(cands) - 1:
            return fn(a, b, out_dtype)
        try:
            return fn(a, b, out_dtype)
        except (RuntimeError, NotImplementedError) as e:  # record, warn once, route to the next backend
            ROUTING.failed[(name, sig)] = str(e)
            ROUTING.count(f"gemm.{name}.failed")
            log.warning(
                "FP8 GEMM backend %s failed for %s; routing to %s from now on: %s",
                name,
                sig,
                cands[i + 1][0],
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
    raise AssertionError("unreachable: emulation is always a candidate")


def _triton(a, b, out_dtype):
    if not _triton_ok(a.data.device):
        raise Fp8CommNotImplementedError(
            f"the Triton GEMM needs CUDA tensors or TRITON_INTERPRET=1 (got {a.data.device})"
        )
    from .triton_gemm import triton_gemm

    return triton_gemm(a, b, out_dtype)


_BACKEND_FNS = {"emulation": emulate, "scaled_mm": scaled_mm, "triton": _triton}
