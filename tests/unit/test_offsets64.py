"""Byte and element offsets past 2^31 in the Triton kernels (under TRITON_INTERPRET=1, which wraps int32 like a GPU).

A real > 2 GiB reduce-scatter or a 140k-token GEMM is far too slow for the interpreter, so each check places a few
tiny operands 2^30 bytes apart in one big lazily-committed allocation (only the touched pages become memory) and
launches the production kernel on them: the same offset arithmetic as the full-size call, a few programs of work.
Each runs in a subprocess because a wrapped offset is an out-of-bounds load, which can crash the interpreter.
launch/gpu_ready_check.py runs the full-size versions on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[triton])")

STRIDE = (1 << 30) + 16  # chunk stride in bytes: 16-aligned, int32 itself, but 2 * STRIDE is not


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.slow  # compile- or memory-bound (5-20 s on 2 cores): out of the fast tier, in the full run
def test_unpack_sum_chunk_offsets_past_2gib():
    """unpack_sum's kernel reads chunk ci at ci * chunk_stride bytes: three 1x128 chunks 2^30 + 16 bytes apart
    put the third at 2^31 + 32, which int32 arithmetic wraps to a negative offset."""
    r = _run(f"""
        import torch
        from fp8comm.quant import backend_reference as br, backend_triton as bt, triton_kernels as tk
        from fp8comm.quant.formats import E4M3
        from fp8comm.quant.scaling import Scaling
        from fp8comm.quant.wire import ChunkLayout

        S, n, k = {STRIDE}, 3, 128
        one = ChunkLayout((1,), k, Scaling(1, 128))
        g = torch.Generator().manual_seed(0)
        big = torch.empty(S * (n - 1) + one.total_bytes, dtype=torch.uint8)  # ~2 GiB of address space
        tight = torch.empty(n * one.total_bytes, dtype=torch.uint8)
        for ci in range(n):
            x = torch.randn(1, k, generator=g) * 10 ** ci
            chunk = br.pack_chunks(x, one, E4M3, "nearest", 0, torch.empty(one.total_bytes, dtype=torch.uint8))
            big[ci * S:ci * S + one.total_bytes] = chunk
            tight[ci * one.total_bytes:(ci + 1) * one.total_bytes] = chunk
        want = br.unpack_sum(tight, one.with_rows((1,) * n), E4M3, torch.empty(1, k))
        _, _, pbytes = bt.chunk_tables(one, big.device)
        out = torch.empty(1, k)
        p = bt.plan(1, k, 1, 128)
        bt.launch(tk.dequant_kernel, p.grid, big, big, out, pbytes, pbytes, pbytes, n, S, 1, k, 1, 128, 1, big, 0, 0,
                   MODE=2, SCALE_BYTES=4, NCH_STEPS=0, K16=True, OUT_BF16=False, num_warps=p.num_warps,
                   **p.meta(), **bt.decode_meta(E4M3, big.device))
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (out[0, :4], want[0, :4])
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.mark.slow  # compile- or memory-bound (5-20 s on 2 cores): out of the fast tier, in the full run
def test_gemm_row_offsets_past_2_31():
    """The Triton GEMM addresses row m of A at m * stride_am: rows 2^30 bytes apart put row 2 at 2^31, which
    int32 arithmetic wraps (the full-size case: M = 140000 tokens x K = 16384)."""
    r = _run(f"""
        import torch
        from fp8comm.gemm.backends import emulate
        from fp8comm.gemm.triton_gemm import triton_gemm
        from fp8comm.quant import Fp8Tensor, Scaling, quantize

        S, m, k, n = {STRIDE - 16}, 3, 128, 64
        g = torch.Generator().manual_seed(1)
        qa = quantize(torch.randn(m, k, generator=g), "e4m3", scaling=Scaling(1, 128), backend="reference")
        qb = quantize(torch.randn(n, k, generator=g), "e4m3", scaling=Scaling(128, 128), backend="reference")
        big = torch.zeros(S * (m - 1) + k, dtype=torch.uint8)
        rows = big.as_strided((m, k), (S, 1))
        rows.copy_(qa.data.view(torch.uint8))
        a = Fp8Tensor(rows.view(torch.float8_e4m3fn), qa.scale, qa.fmt, qa.scaling, qa.dtype)
        assert a.data.stride() == (S, 1)
        got, want = triton_gemm(a, qb, torch.float32), emulate(qa, qb, torch.float32)
        err = float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())
        assert err < 1e-5, err
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def test_gemm_b_column_offsets_past_2_31():
    """The Triton GEMM addresses column n of B (a row of the [N, K] weight) at n * stride_bn: weight rows 2^30 bytes
    apart put row 2 at 2^31, which int32 arithmetic wraps (the full-size case: a 140000-row vocabulary projection)."""
    r = _run(f"""
        import torch
        from fp8comm.gemm.backends import emulate
        from fp8comm.gemm.triton_gemm import triton_gemm
        from fp8comm.quant import Fp8Tensor, Scaling, quantize

        S, m, k, n = {STRIDE - 16}, 64, 128, 3
        g = torch.Generator().manual_seed(2)
        qa = quantize(torch.randn(m, k, generator=g), "e4m3", scaling=Scaling(1, 128), backend="reference")
        qb = quantize(torch.randn(n, k, generator=g), "e4m3", scaling=Scaling(1, 128), backend="reference")
        big = torch.zeros(S * (n - 1) + k, dtype=torch.uint8)
        rows = big.as_strided((n, k), (S, 1))
        rows.copy_(qb.data.view(torch.uint8))
        b = Fp8Tensor(rows.view(torch.float8_e4m3fn), qb.scale, qb.fmt, qb.scaling, qb.dtype)
        assert b.data.stride() == (S, 1)
        got, want = triton_gemm(qa, b, torch.float32), emulate(qa, qb, torch.float32)
        err = float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())
        assert err < 1e-5, err
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
