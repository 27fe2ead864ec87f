"""The 4-bit wire layout (fp8comm.quant.wire4): chunk sections byte for byte, equal to the 4-bit reference per
chunk, stochastic rounding independent of the chunking, the guard's counts, the fp32 receive-side sum."""

import pytest
import torch

from fp8comm.errors import Fp8CommError
from fp8comm.quant import MXFP4, NVFP4, dequantize_fp4, quantize_fp4
from fp8comm.quant.fp4 import decode_2d, hadamard_inverse
from fp8comm.quant.wire4 import fp4_layout, pack_fp4, unpack_fp4, unpack_fp4_sum


def rows(m, k, seed=0):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_layout_sections_and_bytes_per_element(fmt):
    lay = fp4_layout((3, 0, 5), 64, fmt)
    per = [r * 32 for r in (3, 0, 5)], [r * 64 // fmt.block for r in (3, 0, 5)]
    al = lambda n: -(-n // 16) * 16
    ts = 16 if fmt is NVFP4 else 0
    assert lay.chunk_bytes == tuple(al(p) + al(s) + ts for p, s in zip(*per))
    assert lay.offsets == (0, lay.chunk_bytes[0], lay.chunk_bytes[0] + lay.chunk_bytes[1])
    # A 1M-element destination chunk: what the byte targets rest on (payload + scales + tensor scale).
    n = 1 << 20
    big = fp4_layout((1,), n, fmt).total_bytes
    assert 4 * n / big >= 7.0 and 2 * n / big >= 3.5, (fmt.name, 4 * n / big, 2 * n / big)
    with pytest.raises(Fp8CommError, match="multiple of"):
        fp4_layout((1,), 40, fmt)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_each_chunk_is_the_reference_quantization_of_its_rows(fmt, rounding):
    x = rows(6, 96, 1) * torch.logspace(-3, 3, 6).reshape(6, 1)  # rows of very different magnitude
    x[4, 7] = float("nan")
    lay = fp4_layout((2, 1, 3), 96, fmt)
    buf = pack_fp4(x, lay, rounding, seed=11)
    for c, (r0, n) in enumerate(zip(lay.row_starts, lay.rows)):
        codes, scales, ts = lay.sections(buf, c)
        # The reference on the chunk alone, with its flat index offset: the same uniforms as one whole-tensor call.
        q = quantize_fp4(x[r0 : r0 + n], fmt, rounding=rounding, seed=11, index_base=r0 * 96)
        assert torch.equal(codes, q.codes) and torch.equal(scales, q.scales), c
        if fmt.two_level:
            assert torch.equal(ts, q.tensor_scale), c  # NVFP4's second level: one per chunk
    dec = unpack_fp4(buf, lay)
    ref = torch.cat(
        [
            dequantize_fp4(quantize_fp4(x[a : a + n], fmt, rounding=rounding, seed=11, index_base=a * 96))
            for a, n in zip(lay.row_starts, lay.rows)
        ]
    )
    assert torch.equal(dec.isnan(), ref.isnan()) and torch.equal(dec.nan_to_num(), ref.nan_to_num())
    assert dec[4].isnan().sum() == fmt.block  # the NaN's whole block, nothing else


@pytest.mark.parametrize("fmt,h", [(MXFP4, 32), (MXFP4, 16), (NVFP4, 16)])
def test_sum_inverts_the_transform_once(fmt, h):
    w, k = 3, 64
    x = rows(w, k, 2)
    x[1, 5] = 40.0  # an outlier the transform spreads
    lay = fp4_layout((1,) * w, k, fmt)
    buf = pack_fp4(x, lay, hadamard=h, hadamard_seed=7)
    out = unpack_fp4_sum(buf, lay, hadamard=h, hadamard_seed=7)
    # Expected: every chunk decoded in the transform domain, summed in fp32 in chunk order, inverted once.
    acc = None
    for c in range(w):
        v = decode_2d(*[t if t is not None else torch.ones(1) for t in lay.sections(buf, c)], fmt)
        acc = v if acc is None else acc + v
    assert torch.equal(out, hadamard_inverse(acc, h, 7))
    # Heavy-tailed data (Student t, 3 dof): the transform spreads each block's outliers, so MXFP4's power-of-two
    # scales fit the typical magnitude (measured: relative error of the sum 0.148 -> 0.113 at [3, 4096]). NVFP4's
    # E4M3 block scales already fit closely, and there the transform gains nothing (0.098 -> 0.101).
    torch.manual_seed(0)
    t = torch.distributions.StudentT(3.0).sample((w, 4096))
    big = fp4_layout((1,) * w, 4096, fmt)
    true = t.sum(0, keepdim=True)
    plain = (unpack_fp4_sum(pack_fp4(t, big), big) - true).norm() / true.norm()
    mixed = (unpack_fp4_sum(pack_fp4(t, big, hadamard=h, hadamard_seed=7), big, h, 7) - true).norm() / true.norm()
    if fmt is MXFP4:
        assert mixed < 0.85 * plain, (float(plain), float(mixed))
    else:
        assert mixed < 1.1 * plain, (float(plain), float(mixed))
    with pytest.raises(Fp8CommError, match="equal chunks"):
        unpack_fp4_sum(buf, fp4_layout((1, 2), k, fmt))


def test_guard_counts_flushed_and_nonfinite():
    x = torch.zeros(1, 64)
    x[0, 0] = 6.0
    x[0, 1:9] = 0.01  # far below amax / 24: flushed to zero
    x[0, 40] = float("inf")
    x[0, 41] = 1e-3  # in the inf's block: scaled from the block's finite amax (its scale byte is NaN): not flushed
    counters = torch.zeros(3, dtype=torch.int64)
    pack_fp4(x, fp4_layout((1,), 64, MXFP4), counters=counters)
    assert counters.tolist() == [0, 8, 1]


def test_bad_input_is_refused():
    lay = fp4_layout((2,), 32, MXFP4)
    with pytest.raises(Fp8CommError, match="input shape"):
        pack_fp4(torch.zeros(3, 32), lay)
    with pytest.raises(Fp8CommError, match="out must be"):
        pack_fp4(torch.zeros(2, 32), lay, out=torch.empty(4, dtype=torch.uint8))
    with pytest.raises(Fp8CommError, match="wire buffer"):
        unpack_fp4(torch.empty(4, dtype=torch.uint8), lay)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_alignment_padding_is_zero(fmt):
    """The 16-byte alignment after each section travels as zeros, not as whatever the scratch held (the same input
    gives the same wire bytes on every backend and carries no stale memory)."""
    lay = fp4_layout((1, 1), 64, fmt)  # 32 code bytes + 16 (nvfp4) or 2 (mxfp4) scale bytes + the tensor scale
    out = torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8)
    pack_fp4(rows(2, 64, 3), lay, out=out)
    for c in range(2):
        o, pb, sb = lay.offsets[c], lay.payload_bytes(c), lay.scale_bytes(c)
        assert (out[o + 32 : o + pb] == 0).all() and (out[o + pb + 64 // fmt.block : o + pb + sb] == 0).all()
        if fmt.two_level:
            assert (out[o + pb + sb + 4 : o + lay.chunk_bytes[c]] == 0).all()


@pytest.fixture(scope="module")
def interpreted():
    """fp4_triton with its kernels built for the interpreter while this module runs (as tests/unit/test_fp4.py)."""
    import importlib
    import os

    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[triton])")
    from fp8comm.quant import fp4_triton

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.reload(fp4_triton)
    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(fp4_triton)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_triton_wire_bit_exact(interpreted, fmt):
    """The Triton path of the wire (one launch per buffer; NVFP4 one per chunk) byte for byte against the reference,
    and its decode and fp32 sum bit for bit: both roundings, with and without the transform, wide magnitudes and a
    non-finite block."""
    x = rows(4, 256, 4) * torch.logspace(-6, 6, 4).reshape(4, 1)
    x[2, 100] = float("inf")
    lay = fp4_layout((1,) * 4, 256, fmt)
    for rounding in ("nearest", "stochastic"):
        for h in (0, 16):
            want = pack_fp4(x, lay, rounding, 9, h, 3, backend="reference")
            got = pack_fp4(x, lay, rounding, 9, h, 3, backend="triton")
            assert torch.equal(got, want), (rounding, h)
            for fn in (unpack_fp4, unpack_fp4_sum):
                a, b = fn(got, lay, h, 3, backend="triton"), fn(want, lay, h, 3, backend="reference")
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), fn


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_triton_wire_kernel_reads_the_buffer_in_place(interpreted, fmt):
    """The fused Triton wire kernels (the encoder into the sections; decode, fp32 sum, error-feedback residual
    from them) bit for bit against the reference: multi-row and zero-row chunks (NVFP4's per-chunk scale),
    partial-width and strided outputs (a column slice of a wider accumulator), wide magnitudes, a non-finite block."""
    from fp8comm.quant.wire4 import residual_fp4

    def same(a, b, what):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), what

    x = rows(6, 224, 5) * torch.logspace(-6, 6, 6).reshape(6, 1)  # 224: 7 / 14 scale bytes per row, padded
    x[2, 100] = float("inf")
    x[4, 3] = -0.0
    for chunking in ((2, 0, 1, 3), (3, 3)):
        lay = fp4_layout(chunking, 224, fmt)
        buf = pack_fp4(x, lay, "nearest", backend="reference")
        for rounding in ("nearest", "stochastic"):  # the encoder: one launch, NVFP4's scale per chunk as a row's
            want = pack_fp4(x, lay, rounding, 5, backend="reference")
            assert torch.equal(pack_fp4(x, lay, rounding, 5, backend="triton"), want), (chunking, rounding)
        full = unpack_fp4(buf, lay, backend="reference")
        same(unpack_fp4(buf, lay, backend="triton"), full, (chunking, "unpack"))
        wide = torch.full((6, 300), 7.0)  # out = the first 200 columns, a strided view
        unpack_fp4(buf, lay, out=wide[:, 50:250], backend="triton")
        same(wide[:, 50:250], full[:, :200], (chunking, "partial"))
        assert (wide[:, :50] == 7).all() and (wide[:, 250:] == 7).all(), "wrote outside its columns"
        r = torch.full((6, 200), 5.0)
        residual_fp4(buf, lay, x[:, :200].contiguous(), r, "triton")
        ref = x[:, :200] - full[:, :200]
        assert torch.equal(r, ref.masked_fill(~torch.isfinite(ref), 0.0)), (chunking, "residual")
        xb = x[:, :200].bfloat16()  # bf16 gradients: widened exactly, then subtracted in fp32
        residual_fp4(buf, lay, xb, r, "triton")
        ref = xb.float() - full[:, :200]
        assert torch.equal(r, ref.masked_fill(~torch.isfinite(ref), 0.0)), (chunking, "residual bf16")
        if len(set(chunking)) == 1:
            acc = torch.full((3, 480), 9.0)
            unpack_fp4_sum(buf, lay, out=acc[:, 128:352], backend="triton")
            same(acc[:, 128:352], unpack_fp4_sum(buf, lay, backend="reference"), (chunking, "sum"))
            assert (acc[:, :128] == 9).all() and (acc[:, 352:] == 9).all(), "sum wrote outside its columns"
    k13 = 13 * fmt.block  # 13 scale bytes a row; NVFP4's 104 code bytes leave payload padding after odd rows
    lay = fp4_layout((3, 0, 1, 2), k13, fmt)
    xs = rows(6, k13, 6)
    stale = pack_fp4(xs, lay, "nearest", out=torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8), backend="triton")
    assert torch.equal(stale, pack_fp4(xs, lay, "nearest", backend="reference")), "alignment bytes not zeroed"
    one = fp4_layout((4,), 224, fmt)  # one chunk: its -0.0 survives the sum (the reference copies chunk 0)
    b1 = pack_fp4(torch.full((4, 224), -0.0), one, "nearest", backend="reference")
    s1 = unpack_fp4_sum(b1, one, backend="triton")
    assert torch.equal(s1.view(torch.int32), unpack_fp4_sum(b1, one, backend="reference").view(torch.int32))


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_triton_wire_writes_bump_version_counters(interpreted, fmt):
    """The Triton wire kernels' outputs see their write as a torch op's would (autograd's in-place checks and
    version-keyed caches), like the FP8 kernels' (tests/unit/test_triton.py)."""
    lay = fp4_layout((2, 1), 64, fmt)
    buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    v = buf._version
    pack_fp4(rows(3, 64), lay, out=buf, backend="triton")
    assert buf._version > v, "pack"
    dec = torch.zeros(3, 64)
    v = dec._version
    unpack_fp4(buf, lay, out=dec, backend="triton")
    assert dec._version > v, "unpack"


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_native_wire_bit_exact(fmt):
    """The native CPU path of the wire byte for byte against the reference: one-row and multi-row chunks (NVFP4's
    per-chunk scale), both roundings, with and without the transform, wide magnitudes, a non-finite block; its
    decode, fp32 sum, partial-width decode and error-feedback residual bit for bit, and the guard's counts."""
    from fp8comm.quant import fp4_native
    from fp8comm.quant.wire4 import residual_fp4

    assert fp4_native.available(), fp4_native.problem()
    x = rows(6, 256, 4) * torch.logspace(-6, 6, 6).reshape(6, 1)
    x[2, 100] = float("inf")
    x[4, 3] = 1e-30  # flushed next to the row's big values
    for chunking in ((1,) * 6, (2, 1, 3)):
        lay = fp4_layout(chunking, 256, fmt)
        for rounding in ("nearest", "stochastic"):
            for h in (0, 16):
                cw, cg = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
                want = pack_fp4(x, lay, rounding, 9, h, 3, backend="reference", counters=cw)
                got = pack_fp4(x, lay, rounding, 9, h, 3, backend="native", counters=cg)
                assert torch.equal(got, want), (chunking, rounding, h)
                assert cg.tolist() == cw.tolist() and cw[1] > 0 and cw[2] == (1 if h == 0 else h), (cg, cw)
                xb = x.bfloat16()  # bf16 rows: widened inside the kernel
                cb = pack_fp4(xb, lay, rounding, 9, h, 3, backend="native")
                assert torch.equal(cb, pack_fp4(xb, lay, rounding, 9, h, 3, backend="reference")), "bf16"
                fns = [unpack_fp4] + ([unpack_fp4_sum] if len(set(chunking)) == 1 else [])
                for fn in fns:
                    a, b = fn(got, lay, h, 3, backend="native"), fn(want, lay, h, 3, backend="reference")
                    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), fn
        part = torch.full((6, 200), 7.0)  # the first 200 columns only: the padding's decode stays behind
        full = unpack_fp4(want, lay, backend="reference")
        unpack_fp4(want, lay, out=part, backend="native")
        assert torch.equal(part.nan_to_num(), full[:, :200].nan_to_num())
        r = torch.empty(6, 200)
        residual_fp4(want, lay, x[:, :200].contiguous(), r)
        ref = x[:, :200] - full[:, :200]
        assert torch.equal(r, ref.masked_fill(~torch.isfinite(ref), 0.0))
    with pytest.raises(Fp8CommError, match="residual_fp4"):
        residual_fp4(want, lay, torch.zeros(5, 200), torch.zeros(5, 200))


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_empty_chunk_travels_as_zeros(backend):
    """An NVFP4 chunk of 0 rows still owns its 16-byte tensor-scale section; no encoder writes it, so it must be
    zeroed: the same input gives the same bytes whatever the scratch held before."""
    lay = fp4_layout((2, 0, 1), 64, NVFP4)
    assert lay.chunk_bytes[1] == 16
    x = rows(3, 64, 5)
    a = pack_fp4(x, lay, out=torch.full((lay.total_bytes,), 0xAB, dtype=torch.uint8), backend=backend)
    b = pack_fp4(x, lay, out=torch.full((lay.total_bytes,), 0x5C, dtype=torch.uint8), backend=backend)
    assert torch.equal(a, b)
    o = lay.offsets[1]
    assert (a[o : o + lay.chunk_bytes[1]] == 0).all()


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4])
def test_native_entry_points_check_every_size(fmt):
    """The C kernels trust their sizes, so the Python entry points refuse wrong ones (never an out-of-bounds read or
    write): codes, scale bytes, the tensor-scale output, tensor_amax, the counters, and decode's chunks."""
    from fp8comm.quant import fp4_native

    assert fp4_native.available(), fp4_native.problem()
    m, k = 4, 64
    x = rows(m, k, 1)
    kb = k // fmt.block

    def enc(codes=None, sb=None, ts=None, ta=None, counters=None):
        codes = torch.empty(m, k // 2, dtype=torch.uint8) if codes is None else codes
        sb = torch.empty(m, kb, dtype=torch.uint8) if sb is None else sb
        ts = (torch.empty(m) if fmt.two_level else None) if ts is None else ts
        fp4_native.encode_into(x, fmt, codes, sb, ts, None, 0, ta, counters)

    enc()  # the right sizes pass
    bad = [
        dict(codes=torch.empty(m, k // 2 - 1, dtype=torch.uint8)),
        dict(codes=torch.empty(1, dtype=torch.uint8)),
        dict(codes=torch.empty(m, k // 2, dtype=torch.int16)),
        dict(sb=torch.empty(m, kb - 1, dtype=torch.uint8)),
        dict(sb=torch.empty(m * kb + 64, dtype=torch.uint8)),
        dict(counters=torch.zeros(1, dtype=torch.int64)),
    ]
    if fmt.two_level:
        bad += [dict(ts=torch.empty(m - 1)), dict(ta=torch.ones(m - 1)), dict(ta=torch.ones(m + 3))]
    for kw in bad:
        with pytest.raises(Fp8CommError):
            enc(**kw)
    codes, sb = torch.empty(m, k // 2, dtype=torch.uint8), torch.empty(m, kb, dtype=torch.uint8)
    ts = torch.ones(1)
    enc(codes, sb, torch.empty(m) if fmt.two_level else None)
    out = torch.empty(m, k)
    fp4_native.decode([(codes, sb, ts if fmt.two_level else None)], fmt, out)
    for chunk in [
        (codes[:, :-1].contiguous(), sb, ts),
        (codes, sb[:, :-1].contiguous() if kb > 1 else sb[:-1], ts),
        (codes.reshape(-1)[1:].view(1, -1), sb, ts),
    ]:
        with pytest.raises(Fp8CommError):
            fp4_native.decode([chunk], fmt, out)
    if fmt.two_level:
        with pytest.raises(Fp8CommError):
            fp4_native.decode([(codes, sb, torch.ones(1, dtype=torch.float64))], fmt, out)
    with pytest.raises(Fp8CommError):
        fp4_native.decode([(codes, sb, ts)], fmt, torch.empty(m + 1, k))
