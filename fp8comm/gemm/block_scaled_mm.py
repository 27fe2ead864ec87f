"""torch's block-scaled FP8 GEMM (cuBLASLt, Hopper): the scale layouts it takes, trusted only after a probe agrees.

A is 1x128-scaled [M, K] row-major, B is W [N, K] (128x128 or 1x128 blocks) passed as W.t(); scales are
dequantization factors (Fp8Tensor.scale is one). cuBLASLt reads each scale tensor in one layout (docs/gemm.md,
"Blockwise on cuBLASLt"): the activation scale [M, K/128] outer-dim-major (strides (1, M)), the weight scale K-major
with its K-blocks padded to a multiple of 4. A layout it misreads gives SILENTLY wrong numbers, so no candidate
here is used until `probe` has compared it with the emulation on that device, for that operand pair, at a K whose
block count (3) is not a multiple of 4. Each output element is judged against its own magnitude (|A| @ |B|.T), not
the product's largest value, so a misread confined to small-scale blocks cannot hide under the large ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..quant import E4M3, Fp8Tensor, Scaling, quantize
from .operands import pad_to, round_up
from .routing import log

PAIRS = ("block128x128", "block1x128")  # the B operand's blocks; A always has 1x128


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous().t()  # same shape, strides (1, rows)


def _row_major(s: torch.Tensor) -> torch.Tensor:
    return s.contiguous()


def _k_major(s: torch.Tensor) -> torch.Tensor:
    return s.contiguous().t()  # [KB, rows] read column by column: strides (1, KB)


def _k_major_pad4(s: torch.Tensor) -> torch.Tensor:
    return pad_to(s, s.shape[0], round_up(s.shape[1], 4), 1.0).contiguous().t()  # [pad4(KB), rows], strides (1, ·)


def _n_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous()  # [KB, rows] row-major


@dataclass(frozen=True)
class Layout:
    """One way to call torch's block-scaled GEMM: which API, K padding, and how each scale tensor is laid out.

    scale_a takes A's padded scales [Mp, KB]; scale_b takes B's [rows_b, KB] (rows_b: Np for 1x128, Np/128)."""

    name: str
    api: str  # "v2": torch.nn.functional.scaled_mm with explicit ScalingType; "legacy": torch._scaled_mm
    kmult: int  # K zero-padded to a multiple of this (legacy: 512, so that K/128 is a multiple of 4)
    scale_a: Callable[[torch.Tensor], torch.Tensor]
    scale_b: Callable[[torch.Tensor], torch.Tensor]

    def call(self, ad, bd, sa, sb, pair: str, out_dtype: torch.dtype) -> torch.Tensor:
        if self.api == "legacy":
            return torch._scaled_mm(ad, bd.t(), sa, sb, out_dtype=out_dtype)
        st = F.ScalingType
        rb = st.BlockWise128x128 if pair == "block128x128" else st.BlockWise1x128
        return F.scaled_mm(ad, bd.t(), sa, st.BlockWise1x128, sb, rb, output_dtype=out_dtype)


def candidates(pair: str) -> list[Layout]:
    """Every layout to try for `pair`, the documented one first (v2 API, outer-major A, K-major padded B)."""
    if pair == "block128x128":
        bs = [("k-major-pad4", _k_major_pad4), ("k-major", _k_major), ("n-major", _n_major)]
    else:
        bs = [("outer-major", _outer_major), ("k-major", _k_major), ("row-major", _row_major), ("n-major", _n_major)]
    out = []
    for api, kmult in (("v2", 128), ("legacy", 512)):
        for an, fa in (("outer-major", _outer_major), ("row-major", _row_major)):
            for bn, fb in bs:
                if api == "legacy" and bn == "k-major-pad4":
                    continue  # the legacy API infers the recipe from the scale shapes: padded K-blocks change them
                out.append(Layout(f"{api} a:{an} b:{bn}", api, kmult, fa, fb))
    return out


def matmul(lay: Layout, a: Fp8Tensor, b: Fp8Tensor, pair: str, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b.T through `lay`: M zero-padded to a multiple of 16, N to 16 (128 for 128x128 B blocks), K to lay.kmult;
    padded rows sliced off."""
    m, k = a.shape
    n = b.shape[0]
    # torch 2.13's shape rules (its meta kernel, which torch.compile's fake tensors run) want the 128x128 scale as
    # [pad4(K/128), N // 128]: floor, so an N that is not a multiple of 128 is refused there (the CUDA check rounds up)
    nmult = 128 if pair == "block128x128" else 16
    mp, np_, kp = round_up(max(m, 1), 16), round_up(max(n, 1), nmult), round_up(max(k, 1), lay.kmult)
    ad = pad_to(a.data.contiguous(), mp, kp)
    bd = pad_to(b.data.contiguous(), np_, kp)
    kb = kp // 128
    sa = lay.scale_a(pad_to(a.scale.float(), mp, kb, 1.0))
    rows_b = np_ if pair == "block1x128" else -(-np_ // 128)
    sb = lay.scale_b(pad_to(b.scale.float(), rows_b, kb, 1.0))
    out = lay.call(ad, bd, sa, sb, pair, out_dtype)
    return out[:m, :n] if (mp, np_) != (m, n) else out


def _magnitude_operand(q: Fp8Tensor) -> Fp8Tensor:
    """q with every code's sign bit cleared (|q| exactly; NaN codes stay NaN): for |A| @ |B|.T."""
    return replace(q, data=(q.data.view(torch.uint8) & 0x7F).view(q.data.dtype))


def disagreement(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> float:
    """max over elements of |got - want| / magnitude, where magnitude = |A| @ |B|.T (the sum of the absolute
    products that form each element): every block row is judged on its own scale; NaN anywhere gives NaN."""
    err = (got.float() - want.float()).abs() / magnitude.float().clamp_min(torch.finfo(torch.float32).tiny)
    return float(err.max().item()) if err.numel() else 0.0  # host read: the probe runs once per device and pair


def refusal(lay: Layout, pair: str, m: int = 256, k: int = 384, n: int = 256) -> str | None:
    """torch's own shape/stride verdict on `lay` for an m x k x n product, from meta tensors (no device, no
    values): None when torch's checks accept the call, else the first line of its error."""
    data = torch.empty(0, dtype=torch.float8_e4m3fn, device="meta")
    b_rows = 128 if pair == "block128x128" else 1
    qa = Fp8Tensor(
        data.new_empty(m, k), torch.empty(m, -(-k // 128), device="meta"), E4M3, Scaling(1, 128), torch.bfloat16
    )
    qb = Fp8Tensor(
        data.new_empty(n, k),
        torch.empty(-(-n // b_rows), -(-k // 128), device="meta"),
        E4M3,
        Scaling(b_rows, 128),
        torch.bfloat16,
    )
    try:
        matmul(lay, qa, qb, pair, torch.bfloat16)
    except Exception as e:  # torch._check raises RuntimeError; other torch versions may raise ValueError
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def probe(
    device: torch.device,
    pair: str,
    reference: Callable[[Fp8Tensor, Fp8Tensor], torch.Tensor],
    layouts: list[Layout] | None = None,
) -> Layout | None:
    """The first layout whose 256 x 384 x 256 product equals `reference` (the emulation, fp32) within 1e-2 of each
    element's own magnitude (`disagreement`), or None. Block scales vary by powers of two (2^-6 .. 2^6), so that a
    misread scale cannot agree by luck, and per element so that small-scale blocks count as much as large ones."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def operand(rows: int, scaling: Scaling) -> Fp8Tensor:
        x = torch.randn(rows, 384, generator=g)
        r = 1 if scaling.rows == 1 else 128
        x *= 2.0 ** torch.randint(-6, 7, (rows // r, 3), generator=g).repeat_interleave(r, 0).repeat_interleave(128, 1)
        return quantize(x.to(device), "e4m3", scaling=scaling, backend="reference")

    qa = operand(256, Scaling(1, 128))
    qb = operand(256, Scaling(128, 128) if pair == "block128x128" else Scaling(1, 128))
    want = reference(qa, qb)
    magnitude = reference(_magnitude_operand(qa), _magnitude_operand(qb))
    for lay in candidates(pair) if layouts is None else layouts:
        try:
            got = matmul(lay, qa, qb, pair, torch.bfloat16)
            err = disagreement(got, want, magnitude)
        except Exception as e:  # an API or layout this torch/GPU refuses: try the next
            log.debug("block-scaled GEMM probe %s (%s): %s", lay.name, pair, e)
            continue
        if err < 1e-2:
            log.info("block-scaled GEMM on %s for 1x128 x %s: %s", device, pair[5:], lay.name)
            return lay
        log.warning("block-scaled GEMM layout %s disagrees with the emulation (rel err %.3g)", lay.name, err)
    return None
