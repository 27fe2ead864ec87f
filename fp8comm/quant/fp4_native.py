"""The 4-bit CPU kernels (fp4_cpu.c): encode and decode in one pass over memory, bit for bit with fp4.py.

Built on first use with the system C compiler (the one torch.compile's CPU backend needs too) into a per-user
cache, keyed by source, flags, compiler and CPU; `available()` says whether that worked and `problem()` why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from ..errors import Fp8CommError
from . import fp4
from .layout import decode_e8m0

_SRC = Path(__file__).with_name("fp4_cpu.c")
# -ffp-contract=off: no fused multiply-adds (each product rounds, as torch's does); no fast-math anywhere
_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
if platform.machine() in ("x86_64", "AMD64"):
    _FLAGS.append("-march=native")  # the cache key holds the CPU's flags: a build never meets another CPU
_PTR = ctypes.c_void_p
_I64 = ctypes.c_int64
_problem: str | None = None


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    base = os.environ.get("FP8COMM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fp8comm"
    )
    return Path(base)


@cache
def _lib() -> ctypes.CDLL | None:
    global _problem
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        _problem = f"no C compiler ({os.environ.get('CC', 'cc')!r} not on PATH)"
        return None
    src = _SRC.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        _problem = f"{cc} --version failed: {e}"
        return None
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(), version.encode(), _cpu_id().encode()]))
    so = _cache_dir() / f"fp4_cpu-{key.hexdigest()[:20]}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)  # ranks build at once: each its own file, then
        os.close(fd)  # an atomic rename
        p = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            os.unlink(tmp)
            _problem = f"building {_SRC.name} failed: {p.stderr.strip()[-800:]}"
            return None
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.fp4_encode.restype = None
    lib.fp4_encode.argtypes = [_PTR, ctypes.c_int, _I64, _I64, _I64, ctypes.c_int, _PTR, _I64, ctypes.c_int]
    lib.fp4_encode.argtypes += [ctypes.c_uint32]
    lib.fp4_encode.argtypes += [_I64, _PTR, _PTR, _PTR, _PTR]
    lib.fp4_decode.restype = None
    lib.fp4_decode.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int, _PTR, _PTR, ctypes.c_int]
    lib.fp4_decode.argtypes += [_PTR, _PTR, _I64]
    return lib


def available() -> bool:
    """Whether the kernels are built (or can be): a C compiler on PATH and a successful build."""
    return _lib() is not None


def problem() -> str | None:
    """Why available() is False (None when it is True, or before the first try)."""
    return _problem


def _need() -> ctypes.CDLL:
    lib = _lib()
    if lib is None:
        raise Fp8CommError(f"4-bit backend 'native' is unavailable: {_problem}")
    return lib


@cache
def _tables(fmt: fp4.Fp4Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16 E2M1 values and the 256 scale-byte values, from the reference's own decoders."""
    vals = fp4.e2m1_values(torch.arange(16, dtype=torch.int32)).contiguous()
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales = fp4.decode_e4m3(b) if fmt.two_level else decode_e8m0(b)
    return vals, scales.float().contiguous()


def _check_cpu(*ts: torch.Tensor) -> None:
    """CPU tensors whose rows are contiguous (a row stride of their own is fine: column pieces of a buffer)."""
    for t in ts:
        if t.device.type != "cpu" or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise Fp8CommError(
                f"4-bit backend 'native' needs CPU rows of contiguous elements, got {t.device} "
                f"{tuple(t.shape)} strides {t.stride()}"
            )


def encode_into(
    x2: torch.Tensor,
    fmt: fp4.Fp4Format,
    codes: torch.Tensor,
    sbytes: torch.Tensor,
    tscale: torch.Tensor | None,
    key: int | None = None,
    index_base: int = 0,
    tensor_amax: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """fp4.encode_2d of x2 [M, K] written into codes [M, K/2] and sbytes [M, K/B] (contiguous uint8 views);
    NVFP4: tscale fp32 [M] gets each row's scale, from tensor_amax ([1] or [M]) or else the row's own amax.
    key: seed_key of the seed for stochastic rounding, None for nearest. counters: int64 [3] += the guard's
    [0, flushed, non-finite]."""
    lib = _need()
    x = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()  # bf16 is widened in the kernel
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        x = x.contiguous()
    m, k = x.shape
    ta = None if tensor_amax is None else tensor_amax.float().reshape(-1).contiguous()
    if fmt.two_level and (tscale is None or tscale.numel() < m):
        raise Fp8CommError(f"nvfp4 encode needs a tensor-scale output of {m} fp32")
    cnt = None if counters is None else torch.zeros(2, dtype=torch.int64)
    _check_cpu(x)
    if not (codes.is_contiguous() and sbytes.is_contiguous()):
        raise Fp8CommError("native encode writes contiguous codes and scale bytes")
    lib.fp4_encode(
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        m,
        k,
        x.stride(0) if m > 1 else k,
        int(fmt.two_level),
        None if ta is None else ta.data_ptr(),
        0 if ta is None or ta.numel() == 1 else 1,
        int(key is not None),
        0 if key is None else int(key),
        int(index_base),
        codes.data_ptr(),
        sbytes.data_ptr(),
        None if tscale is None else tscale.data_ptr(),
        None if cnt is None else cnt.data_ptr(),
    )
    if counters is not None and cnt is not None:
        counters[1:] += cnt.to(counters.device)


def encode_2d(x2, fmt, key=None, index_base=0, tensor_amax=None, row_scales=False):
    """fp4.encode_2d on the native kernels (same arguments, same bits)."""
    m, k = x2.shape
    codes = torch.empty(m, k // 2, dtype=torch.uint8)
    sb = torch.empty(m, k // fmt.block, dtype=torch.uint8)
    if not fmt.two_level:
        encode_into(x2, fmt, codes, sb, None, None if key is None else int(key), index_base)
        return codes, sb, torch.ones(1, dtype=torch.float32)
    if tensor_amax is None and not row_scales:  # one scale for the whole tensor: its finite amax
        xf = x2.float()
        tensor_amax = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax().reshape(1) if x2.numel() else None
        tensor_amax = tensor_amax if tensor_amax is not None else torch.zeros(1)
    ts = torch.empty(max(m, 1), dtype=torch.float32)
    encode_into(x2, fmt, codes, sb, ts, None if key is None else int(key), index_base, tensor_amax)
    per_row = row_scales or (tensor_amax is not None and tensor_amax.numel() > 1)
    return codes, sb, (ts[:m] if per_row else ts[:1].clone())


def _ptrs(ts: list[torch.Tensor | None]) -> torch.Tensor:
    return torch.tensor([0 if t is None else t.data_ptr() for t in ts], dtype=torch.int64)


def decode(
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    fmt: fp4.Fp4Format,
    out: torch.Tensor,
    mode: str = "rows",
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode chunks [(codes [R, K/2], scale bytes [R, K/B], fp32 tensor scale [1] or None), ...] of R rows each
    into fp32 `out` (its first `cols` columns, cols = out.shape[1] <= K):
    "rows": chunk c into out rows c*R .. (c+1)*R; "sum": out [R, cols] = the chunks' sum in chunk order;
    "residual" (one chunk): out = x - decoded, non-finite differences 0 (error feedback)."""
    lib = _need()
    r, kh = chunks[0][0].shape
    k, cols = 2 * kh, out.shape[1]
    if mode == "residual" and (x is None or x.shape != out.shape or x.dtype != torch.float32 or len(chunks) != 1):
        raise Fp8CommError("native residual needs one chunk and an fp32 x shaped like out")
    _check_cpu(out, *([x] if x is not None else []))
    if x is not None and out.shape[0] > 1 and x.stride(0) != out.stride(0):
        raise Fp8CommError("native residual: x and out need the same row stride")
    rows_out = r * len(chunks) if mode == "rows" else r
    if out.dtype != torch.float32 or cols > k or out.shape[0] != rows_out:
        raise Fp8CommError(f"native decode writes fp32 [{rows_out}, <= {k}], got {out.dtype} {tuple(out.shape)}")
    for c, s, t in chunks:
        if not (c.is_contiguous() and s.is_contiguous()):
            raise Fp8CommError("native decode reads contiguous codes and scale bytes")
        if c.shape != (r, kh) or s.shape != (r, k // fmt.block) or (fmt.two_level and t is None):
            raise Fp8CommError("native decode: chunks differ in shape or lack their tensor scale")
    vals, scales = _tables(fmt)
    cp, sp, tp = _ptrs([c for c, _, _ in chunks]), _ptrs([s for _, s, _ in chunks]), _ptrs([t for *_, t in chunks])
    lib.fp4_decode(
        cp.data_ptr(),
        sp.data_ptr(),
        tp.data_ptr(),
        len(chunks),
        r,
        k,
        cols,
        int(fmt.two_level),
        vals.data_ptr(),
        scales.data_ptr(),
        {"rows": 0, "sum": 1, "residual": 2}[mode],
        None if x is None else x.data_ptr(),
        out.data_ptr(),
        out.stride(0) if out.shape[0] > 1 else cols,
    )
    return out


def decode_2d(packed, sbytes, tscale, fmt):
    """fp4.decode_2d on the native kernels (same bits; NaN payloads aside)."""
    m, kh = packed.shape
    out = torch.empty(m, 2 * kh, dtype=torch.float32)
    if m == 0:
        return out
    packed, sbytes = packed.contiguous(), sbytes.contiguous()
    if fmt.two_level and tscale.numel() > 1:  # a tensor scale per row: each row a chunk
        ts = tscale.float().reshape(-1).contiguous()
        return decode([(packed[i : i + 1], sbytes[i : i + 1], ts[i : i + 1]) for i in range(m)], fmt, out)
    ts = tscale.float().reshape(-1)[:1].contiguous() if fmt.two_level else None
    return decode([(packed, sbytes, ts)], fmt, out)
