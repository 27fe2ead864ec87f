"""The Triton backend under TRITON_INTERPRET=1 (CPU) against the reference backend, byte for byte.

Codes, wire buffers and fp32 values compare as integers (NaN bits included); bf16 outputs compare with NaN
canonicalised, since torch's own CPU fp32->bf16 NaN pattern is implementation-specific. Interpreter cost grows
with the number of programs, so tensors stay small (the largest is the 65536 bf16 bit patterns as [512, 128]).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[triton])")

from fp8comm.quant import backend_reference as br
from fp8comm.quant.formats import E4M3, E5M2
from fp8comm.quant.scaling import Scaling
from fp8comm.quant.wire import ChunkLayout

pytestmark = [
    # the interpreter runs numpy, which warns where the kernels deliberately overflow to inf or make NaN
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
FORMATS = [E4M3, E5M2]


@pytest.fixture(scope="module", autouse=True)
def bt():
    """backend_triton with its kernels built for the interpreter while this module runs, then restored.

    @triton.jit picks interpreter or compiler when a function is decorated, so the kernel module is re-executed
    with TRITON_INTERPRET=1 (triton may already have been imported, e.g. by torch.compile; the kernels use none
    of triton's own @jit helpers, so that does not matter)."""
    from fp8comm.quant import backend_triton, triton_kernels

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.reload(triton_kernels)
    yield backend_triton
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(triton_kernels)


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def same(a: torch.Tensor, b: torch.Tensor, what: str, canon_nan: bool = False) -> None:
    """Assert identical dtype, shape and bits (with canon_nan: identical NaN positions, other bits identical)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if canon_nan and a.is_floating_point():
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb), f"{what}: NaN positions differ ({int((na != nb).sum())} elements)"
        a, b = torch.where(na, torch.zeros((), dtype=a.dtype), a), torch.where(nb, torch.zeros((), dtype=b.dtype), b)
    x, y = _bits(a), _bits(b)
    if not torch.equal(x, y):
        bad = (x != y).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {x.numel()} differ; first at {i}: "
            f"{x[i].item():#x} (triton) vs {y[i].item():#x} (reference)"
        )


def same_quant(got, want, what: str) -> None:
    for name, a, b in zip(("codes", "scale", "amax"), got, want):
        same(a, b, f"{what} {name}")


def bf16_patterns() -> torch.Tensor:
    """Every bf16 bit pattern once (inf, NaN, subnormals, +-0 included) as [512, 128]."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(512, 128)


def mixed(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Values over ~80 binades with fp32 subnormals, +-0, +-inf and NaN sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-40, 40, (m, k), generator=g).float())
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-45, 3e38, -448.0, 57344.0])
    pick = torch.rand(m, k, generator=g) < 0.03
    x[pick] = special[torch.randint(0, special.numel(), (int(pick.sum()),), generator=g)]
    return x.to(dtype)


def given_scales(mb: int, kb: int, pow2: bool) -> torch.Tensor:
    """Several caller scales cycled over the blocks: tiny, huge, ~1, non-power-of-two (fp32 only)."""
    vals = [1.0, 2.0**-126, 2.0**100, 2.0**-20, 0.0625] + ([] if pow2 else [3.7e-3, 1.2345e20, 0.7, 1e-37])
    return torch.tensor(vals, dtype=torch.float32).repeat(mb * kb // len(vals) + 1)[: mb * kb].reshape(mb, kb)


# --- quantize_2d on all 65536 bf16 patterns -----------------------------------------------------------------------
EXHAUSTIVE = [  # (scaling, rounding, seed, caller scales?)
    (Scaling(1, 32), "nearest", 0, False),
    (Scaling(1, 128, "e8m0"), "stochastic", 1, False),
    (Scaling(1, 128, "pow2", margin=2), "stochastic", 2**40 + 5, False),
    (Scaling(None, None), "nearest", 0, False),
    (Scaling(128, 128), "nearest", 0, False),
    (Scaling(1, None, "e8m0", margin=-3), "nearest", 0, False),
    (Scaling(1, 128), "nearest", 0, True),
    (Scaling(1, 64, "pow2"), "stochastic", 1, True),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("case", EXHAUSTIVE, ids=lambda c: f"{c[0].describe()}-{c[1]}{'-given' if c[3] else ''}")
def test_quantize_all_bf16_patterns(bt, fmt, case):
    sc, rnd, seed, given = case
    x = bf16_patterns()
    scale = given_scales(*sc.scale_shape(*x.shape), sc.encoding != "fp32") if given else None
    same_quant(bt.quantize_2d(x, fmt, sc, rnd, seed, scale), br.quantize_2d(x, fmt, sc, rnd, seed, scale), "bf16")


ODD_SCALINGS = [
    (Scaling(1, 32), "nearest"),
    (Scaling(1, 100, "e8m0"), "stochastic"),
    (Scaling(128, 128), "nearest"),
    (Scaling(None, None, "pow2", margin=4), "stochastic"),
    (Scaling(1, None), "nearest"),
    (Scaling(16, 24, "e8m0", margin=-1), "nearest"),
]
TINY_2D = (Scaling(2, 3, "pow2"), "stochastic")  # 2-D blocks run one block-row per program: tiny shapes only


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(
    "shape,dtype",
    [((1, 1), torch.float32), ((3, 200), torch.float16), ((130, 257), torch.float32), ((7, 33), torch.float64)],
)
def test_quantize_odd_shapes(bt, fmt, shape, dtype):
    x = mixed(*shape, seed=shape[1], dtype=dtype)
    for sc, rnd in ODD_SCALINGS + ([TINY_2D] if shape[0] < 8 else []):
        same_quant(bt.quantize_2d(x, fmt, sc, rnd, 9), br.quantize_2d(x, fmt, sc, rnd, 9), f"{shape} {sc.describe()}")


def test_stochastic_index_base_wraps(bt):
    """The SR counter is (index_base + flat index) mod 2**32, as in the reference."""
    x = mixed(3, 200, seed=4)
    for base in (12345, 2**32 - 300, 2**33 + 7):
        want = br.quantize_2d(x, E4M3, Scaling(1, 32), "stochastic", 3, index_base=base)
        same_quant(bt.quantize_2d(x, E4M3, Scaling(1, 32), "stochastic", 3, index_base=base), want, f"base {base}")
    other = br.quantize_2d(x, E4M3, Scaling(1, 32), "stochastic", 3, index_base=0)[0]
    assert not torch.equal(other, want[0]), "index_base had no effect on the reference: the test would prove nothing"


PER_TENSOR = [
    (Scaling(None, None), "nearest"),
    (Scaling(None, None, "pow2", margin=4), "stochastic"),
    (Scaling(None, None, "e8m0", margin=-3), "nearest"),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantize_with_transpose_per_tensor(bt, fmt, monkeypatch):
    """One pass gives codes, the same codes transposed, scale and amax equal to the reference, with caller
    scales too; a smaller interpreter tile forces several programs and ragged tile edges."""
    monkeypatch.setattr(bt, "INTERP_TILE", 4096)
    for shape, dtype in [
        ((1, 1), torch.float32),
        ((70, 33), torch.bfloat16),
        ((3, 200), torch.float16),
        ((130, 257), torch.float32),
    ]:
        x = mixed(*shape, seed=shape[0], dtype=dtype)
        for sc, rnd in PER_TENSOR:
            for scale in (None, torch.tensor([[3.7e-3 if sc.encoding == "fp32" else 0.0625]])):
                c, s, a = br.quantize_2d(x, fmt, sc, rnd, 5, scale)
                got = bt.quantize_2d_t(x, fmt, sc, rnd, 5, scale)
                for part, g, w in zip(("codes", "codes_t", "scale", "amax"), got, (c, c.t().contiguous(), s, a)):
                    same(g, w, f"{shape} {dtype} {sc.describe()} {rnd} given={scale is not None} {part}")
    with pytest.raises(ValueError, match="per tensor only"):
        bt.quantize_2d_t(torch.ones(4, 128), fmt, Scaling(128, 128))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantize_rows_and_cols_in_one_pass(bt, fmt):
    """1xB blocks of x and of x^T from one read equal quantize(x) and quantize(x.t()), stochastic rounding (each
    layout's own flat index) included; ragged tiles on both dims."""
    for (m, k), dtype, sc, rnd in [
        ((130, 257), torch.float32, Scaling(1, 128), "nearest"),
        ((70, 33), torch.bfloat16, Scaling(1, 32, "e8m0"), "stochastic"),
        ((40, 96), torch.float16, Scaling(1, 16, "pow2", margin=2), "nearest"),
        ((512, 128), torch.bfloat16, Scaling(1, 128), "stochastic"),
    ]:
        x = bf16_patterns() if (m, k) == (512, 128) else mixed(m, k, seed=m, dtype=dtype)
        got, got_t = bt.quantize_2d_rowcol(x, fmt, sc, rnd, 7)
        same_quant(got, br.quantize_2d(x, fmt, sc, rnd, 7), f"{(m, k)} {sc.describe()} x")
        same_quant(got_t, br.quantize_2d(x.t(), fmt, sc, rnd, 7), f"{(m, k)} {sc.describe()} x^T")
    for bad in (Scaling(1, 256), Scaling(1, 100), Scaling(1, None), Scaling(128, 128)):
        with pytest.raises(ValueError, match="1xB blocks"):
            bt.quantize_2d_rowcol(torch.ones(4, 256), fmt, bad)


def test_two_pass_path(bt, monkeypatch):
    """Blocks larger than a tile (amax kernel, then per-element block lookup) give the same bits."""
    monkeypatch.setattr(bt, "INTERP_TILE", 1024)
    monkeypatch.setattr(bt, "INTERP_FIT", 64)
    x = mixed(12, 300, seed=5)
    for sc, rnd, given in [
        (Scaling(None, None), "nearest", False),
        (Scaling(1, None, "pow2", 5), "stochastic", False),
        (Scaling(128, 128, "e8m0"), "nearest", False),
        (Scaling(1, 128), "stochastic", True),
        (Scaling(None, None), "nearest", True),
    ]:
        br_, bc_ = sc.block_shape(*x.shape)
        assert not bt.plan(*x.shape, br_, bc_).fit, "the small tile limits did not force the two-pass path"
        scale = given_scales(*sc.scale_shape(*x.shape), sc.encoding != "fp32") if given else None
        for fmt in FORMATS:
            same_quant(
                bt.quantize_2d(x, fmt, sc, rnd, 1, scale),
                br.quantize_2d(x, fmt, sc, rnd, 1, scale),
                f"two-pass {sc.describe()} {fmt.name}",
            )
            q = br.quantize_2d(x, fmt, sc, "nearest")
            same(
                bt.dequantize_2d(q[0], q[1], fmt, sc, torch.float32),
                br.dequantize_2d(q[0], q[1], fmt, sc, torch.float32),
                f"two-pass dequant {sc.describe()}",
            )
    layout = ChunkLayout((5, 0, 7), 300, Scaling(1, None, "e8m0"))
    _check_pack(bt, x, layout, E4M3, "stochastic", 2)


def test_empty(bt):
    for shape, sc in [
        ((0, 64), Scaling(1, 32)),
        ((4, 0), Scaling(1, 32)),
        ((0, 0), Scaling(None, None)),
        ((0, 5), Scaling(None, None, "e8m0")),
    ]:
        x = torch.empty(shape)
        got, want = bt.quantize_2d(x, E4M3, sc), br.quantize_2d(x, E4M3, sc)
        same_quant(got, want, f"empty {shape}")
        same(
            bt.dequantize_2d(got[0], got[1], E4M3, sc, torch.bfloat16),
            br.dequantize_2d(want[0], want[1], E4M3, sc, torch.bfloat16),
            f"empty dequant {shape}",
        )
    layout = ChunkLayout((0, 0), 64, Scaling(1, 32))
    buf = torch.full((16,), 0xAB, dtype=torch.uint8)
    assert torch.equal(bt.pack_chunks(torch.empty(0, 64), layout, E4M3, "nearest", 0, buf.clone()), buf)
    out = torch.full((0, 64), 1.0)
    assert bt.unpack_chunks(buf, layout, E4M3, out).shape == (0, 64)
    assert bt.unpack_sum(buf, layout, E4M3, torch.full((0, 64), 1.0)).shape == (0, 64)


# --- dequantize_2d ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sc",
    [Scaling(1, 32), Scaling(128, 128), Scaling(None, None), Scaling(1, None), Scaling(16, 50, "e8m0")],
    ids=lambda s: s.describe(),
)
def test_dequantize_every_code(bt, sc):
    m, k = 64, 260
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(m * k // 256 + 1)[: m * k].reshape(m, k)
    mb, kb = sc.scale_shape(m, k)
    g = torch.Generator().manual_seed(mb * 1000 + kb)
    scale = torch.exp2(torch.randint(-126, 128, (mb, kb), generator=g).float())  # tiny (subnormal products) to inf
    if sc.encoding == "fp32":
        scale = scale * (1 + torch.rand(mb, kb, generator=g))
    for fmt in FORMATS:
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            same(
                bt.dequantize_2d(codes, scale, fmt, sc, dt),
                br.dequantize_2d(codes, scale, fmt, sc, dt),
                f"dequant {fmt.name} {dt}",
                canon_nan=dt != torch.float32,
            )


# --- wire: pack / unpack / unpack_sum ---------------------------------------------------------------------------------
def _check_pack(bt, x, layout, fmt, rnd, seed):
    """pack (over a buffer pre-filled with garbage, so padding must be zeroed), then unpack into fp32 and bf16."""
    want = torch.full((layout.total_bytes + 13,), 0xAB, dtype=torch.uint8)
    got = want.clone()
    br.pack_chunks(x, layout, fmt, rnd, seed, want)
    bt.pack_chunks(x, layout, fmt, rnd, seed, got)
    same(got, want, f"pack {layout.rows} k={layout.k} {layout.scaling.describe()} {fmt.name} {rnd}")
    for dt in (torch.float32, torch.bfloat16):
        shape = (layout.total_rows, layout.k)
        o1, o2 = torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt)
        same(
            bt.unpack_chunks(want, layout, fmt, o1),
            br.unpack_chunks(want, layout, fmt, o2),
            f"unpack {dt}",
            canon_nan=dt != torch.float32,
        )


PACK_CASES = [  # (rows per chunk, k, scaling, fmt, rounding)
    ((3, 0, 5, 1, 0), 200, Scaling(1, 32), E4M3, "nearest"),
    ((0, 4, 4, 4), 128, Scaling(1, 128, "e8m0"), E5M2, "stochastic"),
    ((2, 7), 96, Scaling(1, None, "pow2", margin=1), E4M3, "stochastic"),
    ((5,), 17, Scaling(1, 8), E4M3, "nearest"),
    ((1, 2, 3, 4, 5, 6, 7, 8, 9), 40, Scaling(1, 16, "e8m0"), E5M2, "nearest"),
]


@pytest.mark.parametrize("case", PACK_CASES, ids=lambda c: f"{c[0]}-k{c[1]}-{c[2].describe()}")
def test_pack_unpack_uneven_chunks(bt, case):
    rows, k, sc, fmt, rnd = case
    layout = ChunkLayout(rows, k, sc)
    _check_pack(bt, mixed(layout.total_rows, k, seed=k), layout, fmt, rnd, 11)


@pytest.mark.parametrize("sc", [Scaling(1, 128), Scaling(1, 128, "e8m0")], ids=lambda s: s.describe())
def test_pack_all_bf16_patterns_world8(bt, sc):
    x = bf16_patterns()
    for fmt in FORMATS:
        _check_pack(bt, x, ChunkLayout((64,) * 8, 128, sc), fmt, "nearest", 0)
    _check_pack(bt, x, ChunkLayout((64,) * 8, 128, sc), E4M3, "stochastic", 5)


def guard_inputs():
    """Blocks that fit, blocks whose outlier pushes the rest to zero, saturating and non-finite values."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, 320, generator=g)
    x[2:5, ::128] = 1e9  # one outlier per 1x128 block: the rest of the block underflows
    x[7, 5], x[8, 9], x[9, 300] = float("inf"), float("nan"), -float("inf")
    x[10:12] = 0.0  # zeros never count as underflow
    return x


@pytest.mark.parametrize("margin", [0, -3, 24], ids=["fit", "saturate", "underflow"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_pack_counts_for_the_guard(bt, fmt, margin):
    """The packing kernel's [saturated, underflow, nonfinite] counts equal reference.fit_counts, and the bytes are
    the same as without counting (the guard adds nothing to the wire)."""
    from fp8comm.quant.reference import fit_counts

    x = guard_inputs()
    sc = Scaling(1, 128, "fp32", margin=margin)
    layout = ChunkLayout((3, 4, 5), 320, sc)
    want = torch.zeros(3, dtype=torch.int64)
    for c, rows in enumerate(layout.rows):
        r0 = layout.row_starts[c]
        codes, scale, _ = br.quantize_2d(x[r0 : r0 + rows], fmt, sc)
        want += fit_counts(x[r0 : r0 + rows], scale, codes, sc, fmt)
    got = torch.zeros(3, dtype=torch.int64)
    buf = bt.pack_chunks(x, layout, fmt, "nearest", 0, torch.empty(layout.total_bytes, dtype=torch.uint8), got)
    ref_buf = br.pack_chunks(x, layout, fmt, "nearest", 0, torch.empty(layout.total_bytes, dtype=torch.uint8))
    assert torch.equal(buf, ref_buf)
    assert got.tolist() == want.tolist(), (got, want)
    assert want[2] == 3 and (want[0] > 0) == (margin < 0) and want[1] > 0  # each count is exercised


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_unpack_sum(bt, n):
    """Chunks summed in order from +0.0 without FMA, inf + -inf = NaN included (exact bits, NaNs too)."""
    for sc, fmt in [(Scaling(1, 32), E5M2), (Scaling(1, 64, "e8m0"), E4M3)]:
        layout = ChunkLayout((6,) * n, 160, sc)
        x = mixed(6 * n, 160, seed=n)
        x[0, :3] = torch.tensor([float("inf"), -float("inf"), 5.0])
        x[6 * (n - 1), :3] = torch.tensor([-float("inf"), float("nan"), -5.0])  # with n=1 these overwrite the above
        x[1::6, 0] = -0.0  # every chunk sends -0 here: the sum starts at +0.0, so the result is +0.0
        buf = torch.empty(layout.total_bytes, dtype=torch.uint8)
        br.pack_chunks(x, layout, fmt, "nearest", 0, buf)
        got = bt.unpack_sum(buf, layout, fmt, torch.full((6, 160), 7.0))
        want = br.unpack_sum(buf, layout, fmt, torch.empty(6, 160))
        same(got, want, f"unpack_sum n={n} {sc.describe()} {fmt.name}")
        assert got[1, 0].view(torch.int32) == 0, "a sum of -0 contributions must be +0.0 (accumulator starts at +0)"
        if n > 1 and fmt.has_inf:
            assert torch.isnan(got[0, 0]), "inf + -inf must be NaN"


@pytest.mark.parametrize("case", PACK_CASES[:3], ids=lambda c: f"{c[0]}-k{c[1]}-{c[2].describe()}")
def test_residual_in_one_pass(bt, case):
    """Error feedback's residual in one launch from the wire (Fp8Codec.residual on Triton) equals the decode then the
    subtraction in torch, non-finite differences 0: fp32 and bf16 inputs, strided rows in and out (column slices)."""
    from fp8comm.quant.codec import Fp8Codec, subtract_into

    rows, k, sc, fmt, rnd = case
    layout = ChunkLayout(rows, k, sc)
    m = layout.total_rows
    wide = mixed(m, k + 24, seed=k + 1)
    wide[m // 2, 3] = float("inf")
    buf = br.pack_chunks(
        wide[:, 8 : 8 + k].contiguous(), layout, fmt, rnd, 3, torch.empty(layout.total_bytes, dtype=torch.uint8)
    )
    codec = Fp8Codec(fmt, sc)
    for x in (wide[:, 8 : 8 + k], wide[:, 8 : 8 + k].bfloat16()):
        deq = br.unpack_chunks(buf, layout, fmt, torch.empty(m, k))
        want = torch.empty(m, k)
        subtract_into(x, deq, want)
        out = torch.full((m, k + 10), 5.0)
        codec.residual(buf, layout, x, out[:, 4 : 4 + k], kernel="triton")
        same(out[:, 4 : 4 + k].contiguous(), want, f"residual {x.dtype}")
        assert (out[:, :4] == 5).all() and (out[:, 4 + k :] == 5).all(), "wrote outside its columns"


def test_api_routes_to_triton(bt):
    """fp8comm.quant.quantize/dequantize with backend='triton' equal the reference end to end."""
    from fp8comm.quant import dequantize, quantize

    x = mixed(4, 96, seed=3, dtype=torch.bfloat16)
    a, b = quantize(x, "e4m3", 32, backend="triton"), quantize(x, "e4m3", 32, backend="reference")
    same(a.data.view(torch.uint8), b.data.view(torch.uint8), "api codes")
    same(dequantize(a, backend="triton"), dequantize(b, backend="reference"), "api dequant")


# --- autograd version counters: kernel stores must bump them as torch ops do -------------------------------------
def test_kernel_writes_bump_version_counters(bt):
    """Every caller-visible tensor a kernel stores into (pack buffer, guard counters, unpack / unpack_sum outputs,
    also when the output is a view of a bigger tensor or bf16 stored as int16 bits) has its _version bumped."""
    sc, fmt = Scaling(1, 32), E4M3
    layout = ChunkLayout((3, 5), 64, sc)
    x = mixed(8, 64, seed=5)
    buf = torch.empty(layout.total_bytes, dtype=torch.uint8)
    counters = torch.zeros(3, dtype=torch.int64)
    v_buf, v_cnt = buf._version, counters._version
    bt.pack_chunks(x, layout, fmt, "nearest", 0, buf, counters)
    assert buf._version > v_buf, "pack_chunks wrote the send buffer without bumping its version"
    assert counters._version > v_cnt, "pack_chunks added to the guard counters without bumping their version"
    for dt in (torch.float32, torch.bfloat16):
        big = torch.empty(12, 64, dtype=dt)
        out = big[2:10]  # one piece of a bigger output (contiguous view)
        v = big._version
        bt.unpack_chunks(buf, layout, fmt, out)
        assert big._version > v, f"unpack_chunks ({dt}) wrote the output without bumping its version"
    eq = ChunkLayout((4, 4), 64, sc)
    wire = bt.pack_chunks(x, eq, fmt, "nearest", 0, torch.empty(eq.total_bytes, dtype=torch.uint8))
    acc = torch.empty(4, 64)
    v = acc._version
    bt.unpack_sum(wire, eq, fmt, acc)
    assert acc._version > v, "unpack_sum wrote the output without bumping its version"


@pytest.fixture
def gloo_one_rank():
    """A one-rank gloo default group for the test (the collectives' real path, no second process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_all_gather_out_bumps_version_like_reference(bt, gloo_one_rank):
    """all_gather(out=) through the Triton backend moves out._version like the reference backend does (autograd's
    in-place checks and Fp8Linear's version-keyed step cache rely on it)."""
    import fp8comm.comm as fc

    x = mixed(4, 128, seed=9)
    got = {}
    for backend in ("reference", "triton"):
        out = torch.empty(4, 128)
        v = out._version
        fc.all_gather(x, out=out, backend=backend, check=False)
        got[backend] = out._version - v
    assert got["reference"] >= 1, got
    assert got["triton"] >= 1, f"the Triton all_gather(out=) left out._version unchanged: {got}"


TRITON_GEMM_VERSION = """
import torch
from fp8comm.gemm.triton_gemm import triton_gemm
from fp8comm.quant import Scaling, quantize
a = quantize(torch.randn(16, 64), "e4m3", scaling=Scaling(1, 32, "e8m0"))
b = quantize(torch.randn(16, 64), "e4m3", scaling=Scaling(1, 32, "e8m0"))
print("version", triton_gemm(a, b)._version)
"""


def test_triton_gemm_output_version_bumped():
    """The Triton GEMM's output is written by a kernel: its version is bumped like a torch op's output write."""
    import subprocess
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", TRITON_GEMM_VERSION], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "version 0" not in r.stdout and "version " in r.stdout, r.stdout


# --- chunk tables: the pinned copy source lives as long as the cached device tables ------------------------------
def test_chunk_tables_keep_pinned_source_with_entry(bt, monkeypatch):
    """On CUDA the tables are copied asynchronously from pinned host tensors: those stay referenced by the cache
    entry (not only by the caching host allocator), and go when the entry does. CUDA is mocked: pin_memory and
    the copy to a cuda device return CPU clones; the pinned sources are watched by weak references."""
    import gc
    import weakref

    pinned: list = []
    real_to = torch.Tensor.to

    def fake_pin(self):
        c = self.clone()
        pinned.append(weakref.ref(c))
        return c

    def fake_to(self, *args, **kwargs):
        dev = args[0] if args else kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return self.clone()
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    dev = torch.device("cuda", 0)
    layout = ChunkLayout((3, 1, 4), 48, Scaling(1, 16))
    tables = bt.chunk_tables(layout, dev)
    gc.collect()
    assert [t.tolist() for t in tables] == [[0, 3, 4, 8], list(layout.offsets) + [layout.total_bytes], [144, 48, 192]]
    assert len(pinned) == 3
    assert all(r() is not None for r in pinned), "the pinned copy sources were freed while their entry is cached"
    assert bt.chunk_tables(layout, dev) is tables and len(pinned) == 3  # a hit: no new copy
    del bt._TABLES[(layout, dev)]
    del tables
    gc.collect()
    assert all(r() is None for r in pinned), "the pinned sources outlive their cache entry"


# --- launch/device_check.py: the parts that run without a GPU ---------------------------------------------------
def _device_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / "device_check.py"
    spec = importlib.util.spec_from_file_location("fp8comm_device_check", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_device_check_compare_verdicts():
    dc = _device_check()
    a = torch.tensor([1.0, -0.0, float("nan"), 3.0])
    assert dc.compare(a, a.clone()) == ("exact", 0)
    other_nan = a.clone()
    other_nan.view(torch.int32)[2] = 0x7FFFFFFF  # CUDA's canonical NaN vs the reference's payload
    assert dc.compare(other_nan, a) == ("nan-bits", 1)
    plus_zero = a.clone()
    plus_zero[1] = 0.0  # -0 vs +0 is a real difference
    assert dc.compare(plus_zero, a) == ("FAIL", 1)
    moved = a.clone()
    moved[2], moved[3] = 3.0, float("nan")
    assert dc.compare(moved, a)[0] == "FAIL"
    codes = torch.arange(4, dtype=torch.uint8)
    assert dc.compare(codes ^ 1, codes) == ("FAIL", 4)


def test_device_check_sections_isolated_and_json(tmp_path, monkeypatch):
    dc = _device_check()
    assert [n for n, _ in dc.SECTIONS][:4] == ["env", "triton_bitexact", "triton_ptx", "triton_bandwidth"]

    @dc.section("broken")
    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setenv("OUT", str(tmp_path))
    assert dc.main(["--only", "env,broken", "--device", "cpu"]) == 1
    import json

    doc = json.loads((tmp_path / "device_check.json").read_text())
    assert doc["sections"]["env"]["status"] == "ok" and doc["sections"]["env"]["torch"] == torch.__version__
    assert doc["sections"]["broken"]["status"] == "error" and "boom" in doc["sections"]["broken"]["error"]
