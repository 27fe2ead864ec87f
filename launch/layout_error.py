#!/usr/bin/env python3
"""Where docs/gemm.md's "old probe off by 59x" stands on CPU: `PYTHONPATH=. python3 launch/layout_error.py`.

The old probe (before 1c381a2) tried torch._scaled_mm (legacy) on a 256 x 384 x 256 product, 1x128 x 128x128 blocks,
plain randn operands, with each scale "as-is" (contiguous) or "outer-major"; on the H200 (torch 2.11) one candidate
ran and was off by 59x (max |got - want| / max |want|). This prints (1) torch 2.13's own verdict on each candidate
(its meta kernel: shapes only for the legacy API), and (2) the error of the candidate that ran under the hypothesis
of the sources (cuBLASLt reads the 128x128 scale K-major with leading dimension pad4(K/128) = 4, so the second
column starts one element late and its last element lies past the tensor's end): the figure depends entirely on
what that unread element holds, so it cannot confirm the hypothesis; (3) the new probe's verdict on that result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8comm.gemm import backends, block_scaled_mm
from fp8comm.quant import Scaling, quantize

OLD = {"as-is": lambda s: s.contiguous(), "outer-major": lambda s: s.t().contiguous().t()}


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _operands():
    g = torch.Generator(device="cpu").manual_seed(0)  # the old probe's operands
    x = torch.randn(256, 384, generator=g)
    w = torch.randn(256, 384, generator=g)
    qa = quantize(x, "e4m3", scaling=Scaling(1, 128), backend="reference")
    qb = quantize(w, "e4m3", scaling=Scaling(128, 128), backend="reference")
    return qa, qb


def misread(qa, qb, fill: float) -> torch.Tensor:
    """The outer-major/outer-major candidate's product if the [3, 2] K-major weight scale is read with leading
    dimension 4: column j = memory[4j : 4j + 3], `fill` standing for the element past the end (bf16 out)."""
    sb = OLD["outer-major"](qb.scale.t())  # [KB, N/128], strides (1, KB)
    mem = sb.t().reshape(-1)  # its memory order
    nb, ld, kb = sb.shape[1], 4, sb.shape[0]
    mem = torch.cat([mem, torch.full((nb * ld - mem.numel(),), fill)])
    grid = mem.view(nb, ld)[:, :kb]  # [N/128, KB] as read
    da = qa.data.float() * qa.scale.repeat_interleave(128, 1)
    db = qb.data.float() * grid.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (da @ db.t()).to(torch.bfloat16)


def old_probe_errors() -> dict:
    qa, qb = _operands()
    want = backends.emulate(qa, qb, torch.float32)
    top = want.abs().max().item()
    accepts = []
    for na, fa in OLD.items():
        for nb, fb in OLD.items():
            sa, sb = fa(qa.scale), fb(qb.scale.t())
            try:
                torch._scaled_mm(_meta(qa.data), _meta(qb.data).t(), _meta(sa), _meta(sb), out_dtype=torch.bfloat16)
                accepts.append(f"{na}/{nb}")
            except Exception:
                pass
    out: dict = {"meta_accepts": accepts}
    fills = {"fill=1.0": 1.0, "fill=0.0": 0.0, "fill=neighbour": float(qb.scale.mean())}
    for label, fill in fills.items():
        out[label] = ((misread(qa, qb, fill).float() - want).abs().max() / top).item()
    mag = backends.emulate(block_scaled_mm._magnitude_operand(qa), block_scaled_mm._magnitude_operand(qb))
    out["new_probe_error_fill=neighbour"] = block_scaled_mm.disagreement(
        misread(qa, qb, fills["fill=neighbour"]), want, mag
    )
    out["new_probe_refuses"] = out["new_probe_error_fill=neighbour"] >= 1e-2
    return out


def main() -> int:
    r = old_probe_errors()
    print(
        f"torch {torch.__version__}: legacy torch._scaled_mm meta kernel accepts {len(r['meta_accepts'])} of 4 "
        f"old candidates ({', '.join(r['meta_accepts'])}): it checks scale shapes only"
    )
    print("old probe's measure (max |got - want| / max |want|) for outer-major/outer-major read with ld 4:")
    for k in ("fill=1.0", "fill=0.0", "fill=neighbour"):
        print(f"  element past the end = {k[5:]:>9}: {r[k]:.3g}x")
    print(
        f"new probe's measure (per element, against |A| @ |B|.T) at fill=neighbour: "
        f"{r['new_probe_error_fill=neighbour']:.3g} -> {'refused' if r['new_probe_refuses'] else 'ACCEPTED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
