"""E8M0 scale bytes decode per the OCP MX spec on every backend: byte b -> 2**(b - 127), byte 0 -> 2**-127 (an fp32
subnormal, never flushed), byte 255 -> NaN. fp8comm never emits 0 or 255, but buffers from other producers may
(TE and torchao write 0 for zero/tiny blocks, torchao 255 for non-finite ones).

The oracle is torch's own float8_e8m0fnu -> fp32 conversion and FP8 -> fp32 upcast; every backend (reference,
compiled, Triton under TRITON_INTERPRET=1) must equal it, bit for bit outside NaN payloads (which differ between
eager and compiled upcasts, docs/design.md), NaN positions exactly.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from fp8comm.quant import ChunkLayout, Fp8Tensor, Scaling, get_format, pack_chunks, unpack_chunks, unpack_sum
from fp8comm.quant.layout import align, decode_scales

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
E8M0 = Scaling(1, 256, "e8m0")
ALL = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _backends() -> list[str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return ["reference", "compiled"]
    return ["reference", "compiled", "triton"]


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    """Triton kernels built for the interpreter while this module runs (as tests/unit/test_triton.py does)."""
    try:
        from fp8comm.quant import triton_kernels
    except ImportError:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.reload(triton_kernels)
    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(triton_kernels)


def spec_scales(b: torch.Tensor) -> torch.Tensor:
    """The oracle: torch's float8_e8m0fnu conversion (2**(b-127), 0 -> 2**-127, 255 -> NaN)."""
    return b.contiguous().view(torch.float8_e8m0fnu).float()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer bits with every NaN made the same NaN (positions still compared, payloads not)."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).contiguous().view(torch.int32)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype}{tuple(got.shape)}"
    g, w = bits(got), bits(want)
    if not torch.equal(g, w):
        i = tuple((g != w).nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int((g != w).sum())} of {g.numel()} differ; first at {i}: got {got[i].item()!r} "
            f"({g[i].item():#x}), want {want[i].item()!r} ({w[i].item():#x})"
        )


def test_decode_scales_all_256_bytes():
    got = decode_scales(ALL, E8M0)
    assert got.dtype == torch.float32
    assert got.view(torch.int32)[0].item() == 0x00400000 and got[0].item() == 2.0**-127, "byte 0 must be 2**-127"
    assert torch.isnan(got[255]), f"byte 255 must be NaN, got {got[255].item()}"
    assert torch.equal(got[1:255], torch.exp2(torch.arange(1, 255, dtype=torch.float32) - 127))
    assert_same(got, spec_scales(ALL), "decode_scales vs float8_e8m0fnu")


def all_codes_rows(fmt, rows: torch.Tensor) -> torch.Tensor:
    """[len(rows), 256] uint8 codes: every FP8 code in each row, rotated by the row index."""
    j = torch.arange(256, dtype=torch.int32)
    return ((j[None, :] + rows.to(torch.int32)[:, None]) % 256).to(torch.uint8)


def expected(codes: torch.Tensor, scale_bytes: torch.Tensor, fmt) -> torch.Tensor:
    """code * scale in fp32 from torch's own conversions (one scale per row)."""
    return codes.view(fmt.dtype).float() * spec_scales(scale_bytes)[:, None]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8tensor_unpack_all_256_scale_bytes(fmt):
    """Fp8Tensor.unpack of a buffer whose 256 rows carry every code and scale bytes 0..255, dequantized on every
    backend: equal to the spec (and so to each other)."""
    f = get_format(fmt)
    codes = all_codes_rows(f, ALL)
    buf = torch.zeros(align(codes.numel()) + align(256), dtype=torch.uint8)
    buf[: codes.numel()] = codes.reshape(-1)
    buf[align(codes.numel()) : align(codes.numel()) + 256] = ALL
    t = Fp8Tensor.unpack(buf, (256, 256), torch.float32, f, E8M0)
    assert t.scale.shape == (256, 1)
    assert_same(t.scale[:, 0], spec_scales(ALL), "unpacked scales")
    want = expected(codes, ALL, f)
    for backend in _backends():
        assert_same(t.dequantize(torch.float32, backend=backend), want, f"{fmt} dequantize backend={backend}")
    assert torch.equal(t.pack(), buf), "pack(unpack(buf)) must give the same bytes (0 and 255 included)"


def wire_with_all_bytes(fmt) -> tuple[torch.Tensor, ChunkLayout, torch.Tensor, torch.Tensor]:
    """A packed wire buffer of two chunks of 128 rows: every code in each row, row r's scale byte is r (0..255)."""
    layout = ChunkLayout((128, 128), 256, E8M0)
    codes = all_codes_rows(fmt, ALL)
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for c in range(2):
        o, pb = layout.offsets[c], layout.payload_bytes(c)
        buf[o : o + 128 * 256] = codes[128 * c : 128 * (c + 1)].reshape(-1)
        buf[o + pb : o + pb + 128] = ALL[128 * c : 128 * (c + 1)]
    return buf, layout, codes, ALL


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_wire_decoders_all_256_scale_bytes(fmt):
    """The wire decoders (unpack_chunks into fp32 and bf16, unpack_sum) read E8M0 bytes 0 and 255 per the spec on
    every backend: the compiled graphs and the Triton kernels decode the bytes themselves."""
    f = get_format(fmt)
    buf, layout, codes, sbytes = wire_with_all_bytes(f)
    want = expected(codes, sbytes, f)
    want_sum = torch.zeros(128, 256) + want[:128] + want[128:]
    for backend in _backends():
        got = unpack_chunks(buf, layout, f, torch.float32, backend=backend)
        assert_same(got, want, f"{fmt} unpack_chunks fp32 backend={backend}")
        got16 = unpack_chunks(buf, layout, f, torch.bfloat16, backend=backend)
        assert_same(got16, want.to(torch.bfloat16), f"{fmt} unpack_chunks bf16 backend={backend}")
        assert_same(unpack_sum(buf, layout, f, backend=backend), want_sum, f"{fmt} unpack_sum backend={backend}")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_never_emits_0_or_255_and_nonfinite_stays_elementwise(fmt):
    """The encode side is unchanged: blocks that are all zero, subnormal, huge, or hold inf/NaN get scale bytes in
    [1, 254] on every backend, and after a round trip exactly the non-finite inputs are non-finite (E5M2 keeps
    the sign of inf), finite neighbours stay finite (docs/design.md, quantization bits)."""
    f = get_format(fmt)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)).clamp(-4, 4)
    x[0] = 0.0
    x[1] = 1e-45  # fp32 subnormal: the smallest E the scale clamps to
    x[2] = -3e-39
    x[3] *= 2e37  # up to ~2**126.3: the largest scales, every value still finite after the round trip
    x[4, :5] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0, -2.0])
    x[5] = float("nan")
    x[6] = float("inf")
    x[7, 7] = -float("inf")
    layout = ChunkLayout((3, 5), 256, Scaling(1, 256, "e8m0", margin=2))
    for backend in _backends():
        buf = pack_chunks(x, layout, f, backend=backend)
        for c in range(2):
            o, pb, rows = layout.offsets[c], layout.payload_bytes(c), layout.rows[c]
            s = buf[o + pb : o + pb + rows]
            assert int(s.min()) >= 1 and int(s.max()) <= 254, f"{backend}: scale bytes {s.tolist()}"
        y = unpack_chunks(buf, layout, f, torch.float32, backend=backend)
        assert torch.equal(torch.isfinite(y), torch.isfinite(x)), f"{backend}: non-finite positions changed"
        if f.has_inf:
            inf = torch.isinf(x)
            assert torch.equal(torch.isinf(y), inf) and torch.equal(y[inf], x[inf]), f"{backend}: inf signs"
        else:
            assert torch.isnan(y[~torch.isfinite(x)]).all(), f"{backend}: E4M3 non-finite must be NaN"
