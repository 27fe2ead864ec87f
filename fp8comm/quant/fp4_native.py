"""The 4-bit CPU kernels (fp4_cpu.c): encode and decode in one pass over memory, bit for bit with fp4.py.

The library is built when the package is installed (setup.py's optional extension `fp8comm.quant._fp4_cpu`) and
loaded from the package. FP8COMM_NATIVE_JIT=1 also allows a build at first use into a private per-user cache (0700,
owner and mode checked on the opened file). `available()` says whether the kernels load, `problem()` why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from ..errors import Fp8CommError, Fp8CommRuntimeError
from . import fp4
from .layout import decode_e8m0

_SRC = Path(__file__).with_name("fp4_cpu.c")
EXTENSION = "_fp4_cpu"  # setup.py builds fp8comm.quant._fp4_cpu from fp4_cpu.c
# -ffp-contract=off: no fused multiply-adds (each product rounds, as torch's does); no fast-math anywhere. No
# -march=native: a build runs on any machine of its platform (the C file adds per-CPU clones where they pay).
CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math"]
JIT_ENV = "FP8COMM_NATIVE_JIT"
_PTR = ctypes.c_void_p
_I64 = ctypes.c_int64
_problem: str | None = None
_source: str | None = None  # "extension" or the JIT library's path, once loaded


@cache
def source_sha() -> str:
    """The sha256 of the fp4_cpu.c this package ships: a loaded library must report the same one."""
    return hashlib.sha256(_SRC.read_bytes()).hexdigest()


def _bind(lib: ctypes.CDLL, what: str) -> ctypes.CDLL:
    """Declare the entry points; refuse a library built from another source (a stale in-place build)."""
    lib.fp4_source_sha.restype = ctypes.c_char_p
    lib.fp4_source_sha.argtypes = []
    got = (lib.fp4_source_sha() or b"").decode()
    if got != source_sha():
        raise _Stale(f"{what} was built from another fp4_cpu.c (source {got[:12]}, shipped {source_sha()[:12]})")
    lib.fp4_encode.restype = None
    lib.fp4_encode.argtypes = [_PTR, ctypes.c_int, _I64, _I64, _I64, ctypes.c_int, _PTR, _I64, ctypes.c_int]
    lib.fp4_encode.argtypes += [ctypes.c_uint32]
    lib.fp4_encode.argtypes += [_I64, _PTR, _PTR, _PTR, _PTR]
    lib.fp4_decode.restype = None
    lib.fp4_decode.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int, _PTR, _PTR, ctypes.c_int]
    lib.fp4_decode.argtypes += [_PTR, _PTR, _I64]
    lib.fp4_decode_add_bf16.restype = None
    lib.fp4_decode_add_bf16.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int, _PTR, _PTR, _PTR, _I64]
    return lib


class _Unusable(Exception):
    """A library or cache that must not be loaded; its message is problem()'s text."""


class _Stale(_Unusable):
    """A library built from another fp4_cpu.c: the opt-in build replaces it, the installed one is refused."""


def _installed() -> Path | None:
    """The extension built at install, beside this file (None when the install had no C compiler)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = Path(__file__).with_name(EXTENSION + suffix)
        if p.is_file():
            return p
    return None


# ------------------------------------------------------------------------------ opt-in build at first use
def _cache_dir() -> Path:
    """FP8COMM_CACHE, else $XDG_CACHE_HOME/fp8comm, else ~/.cache/fp8comm; always an absolute path."""
    base = os.environ.get("FP8COMM_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        home = os.path.expanduser("~")
        if not xdg and not os.path.isabs(home):  # HOME unset and no password entry: "~" would be relative
            raise _Unusable(
                f"no home directory for uid {os.getuid()} (HOME unset, no password entry); set {JIT_ENV}"
                " off or FP8COMM_CACHE to a directory of your own"
            )
        base = os.path.join(xdg or os.path.join(home, ".cache"), "fp8comm")
    if not os.path.isabs(base):
        raise _Unusable(f"the kernel cache {base!r} is not an absolute path")
    return Path(base)


def _private(st: os.stat_result, what: str) -> None:
    """Refuse what another user owns or could have written: it would run its code in every training process."""
    if st.st_uid != os.getuid():
        raise _Unusable(f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Unusable(f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _open_dir(d: Path) -> int:
    """An fd of the cache directory (created 0700), checked to be this user's and private."""
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _Unusable(f"the kernel cache {str(d)!r} is unusable: {e}") from None
    try:
        _private(os.fstat(fd), f"the kernel cache {str(d)!r}")
    except _Unusable:
        os.close(fd)
        raise
    return fd


def _load_checked(dfd: int, name: str, d: Path) -> ctypes.CDLL:
    """dlopen the file `name` of the directory fd, checked on the opened file itself (no check-then-load race)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Unusable(f"{d / name} is not a regular file")
        _private(st, str(d / name))
        proc = f"/proc/self/fd/{fd}"  # the inode just checked, whatever the name points to by now
        lib = ctypes.CDLL(proc if os.path.exists(proc) else str(d / name))
    finally:
        os.close(fd)
    return _bind(lib, str(d / name))


def _compile(cc: str, out: Path) -> None:
    """Build the library into `out` (a new file, fsynced); a failed or killed build leaves nothing behind."""
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *CFLAGS, "-fPIC", "-shared", f'-DFP8COMM_SRC_SHA="{source_sha()}"', str(_SRC), "-o", tmp, "-lm"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise _Unusable(f"building {_SRC.name} failed: {e}") from None
        if p.returncode != 0:
            raise _Unusable(f"building {_SRC.name} failed: {p.stderr.strip()[-800:]}")
        with open(tmp, "rb") as f:  # a lost write must not leave a short file under the final name
            os.fsync(f.fileno())
        os.replace(tmp, out)
        tmp = ""
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _jit() -> ctypes.CDLL:
    """Build (once per source, flags and compiler) into the private cache and load; a broken file is rebuilt."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise _Unusable(f"no C compiler ({os.environ.get('CC', 'cc')!r} not on PATH)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unusable(f"{cc} --version failed: {e}") from None
    key = hashlib.sha256("\0".join([source_sha(), " ".join(CFLAGS), version, platform.machine()]).encode())
    d = _cache_dir()
    name = f"fp4_cpu-{key.hexdigest()[:20]}.so"
    dfd = _open_dir(d)
    try:
        for attempt in (0, 1):
            if attempt or not os.path.exists(d / name):
                _compile(cc, d / name)
            try:
                return _load_checked(dfd, name, d)
            except (OSError, _Stale) as e:  # truncated, corrupt ("file too short") or stale: rebuild once
                if attempt:
                    raise _Unusable(f"the rebuilt {d / name} does not load: {e}") from None
                os.unlink(d / name)
        raise AssertionError("unreachable")
    finally:
        os.close(dfd)


@cache
def _lib() -> ctypes.CDLL | None:
    global _problem, _source
    causes = []
    ext = _installed()
    if ext is not None:
        try:
            lib = _bind(ctypes.CDLL(str(ext)), f"the installed {ext.name}")
            _source = "extension"
            return lib
        except (OSError, _Unusable) as e:
            causes.append(str(e))
    else:
        causes.append(f"the extension {EXTENSION} was not built at install (no C compiler then?)")
    if os.environ.get(JIT_ENV, "0").strip().lower() in ("1", "true", "yes", "on"):
        try:
            lib = _jit()
            _source = "jit"
            return lib
        except (OSError, _Unusable) as e:
            causes.append(f"{JIT_ENV}=1: {e}")
    else:
        causes.append(f"{JIT_ENV}=1 would build it at first use")
    _problem = "; ".join(causes)
    return None


def available() -> bool:
    """Whether the kernels load: the installed extension, or (FP8COMM_NATIVE_JIT=1) a build in the private cache."""
    return _lib() is not None


def problem() -> str | None:
    """Why available() is False (None when it is True, or before the first try)."""
    return _problem


def source() -> str | None:
    """Where the loaded kernels came from: "extension" (built at install) or "jit"; None when not loaded."""
    return _source if _lib() is not None else None


def _need() -> ctypes.CDLL:
    lib = _lib()
    if lib is None:
        raise Fp8CommRuntimeError(f"4-bit backend 'native' is unavailable: {_problem}")
    return lib


@cache
def _tables(fmt: fp4.Fp4Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16 E2M1 values and the 256 scale-byte values, from the reference's own decoders."""
    vals = fp4.e2m1_values(torch.arange(16, dtype=torch.int32)).contiguous()
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales = fp4.decode_e4m3(b) if fmt.two_level else decode_e8m0(b)
    return vals, scales.float().contiguous()


def _check_bytes(t: torch.Tensor, n: int, what: str) -> None:
    """A contiguous CPU uint8 tensor of exactly n bytes (the kernels write every one and nothing past them)."""
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
        raise Fp8CommError(
            f"native kernels need {what} as {n} contiguous CPU uint8 bytes, got {t.dtype} {tuple(t.shape)} on "
            f"{t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


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
    _check_cpu(x)
    if k % fmt.block:
        raise Fp8CommError(f"native encode: row length {k} is not a multiple of {fmt.name}'s block {fmt.block}")
    ta = None if tensor_amax is None else tensor_amax.float().reshape(-1).contiguous()
    # The kernel trusts every size: a wrong one would read or write past a buffer, so each is checked here.
    _check_bytes(codes, m * k // 2, "codes")
    _check_bytes(sbytes, m * (k // fmt.block), "scale bytes")
    if fmt.two_level and (tscale is None or tscale.dtype != torch.float32 or tscale.numel() < m):
        raise Fp8CommError(f"nvfp4 encode needs a tensor-scale output of {m} fp32")
    if tscale is not None and not (tscale.device.type == "cpu" and tscale.is_contiguous()):
        raise Fp8CommError("native encode writes a contiguous CPU tensor-scale output")
    if ta is not None and (ta.device.type != "cpu" or ta.numel() not in (1, m)):
        raise Fp8CommError(f"native encode: tensor_amax needs 1 or {m} (one per row) CPU values, got {ta.numel()}")
    if counters is not None and counters.numel() < 3:
        raise Fp8CommError(f"native encode: counters need 3 int64 slots, got {counters.numel()}")
    cnt = None if counters is None else torch.zeros(2, dtype=torch.int64)
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
    if k % fmt.block:
        raise Fp8CommError(f"native decode: row length {k} is not a multiple of {fmt.name}'s block {fmt.block}")
    for c, s, t in chunks:
        _check_bytes(c, r * kh, "codes")
        _check_bytes(s, r * (k // fmt.block), "scale bytes")
        if c.shape != (r, kh) or s.shape != (r, k // fmt.block) or (fmt.two_level and t is None):
            raise Fp8CommError("native decode: chunks differ in shape or lack their tensor scale")
        if t is not None and (t.dtype != torch.float32 or t.numel() < 1 or t.device.type != "cpu"):
            raise Fp8CommError("native decode: a chunk's tensor scale must be one fp32 CPU value")
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


def decode_add(
    chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], fmt: fp4.Fp4Format, out: torch.Tensor
) -> torch.Tensor:
    """bf16 `out` [R, cols] += the decoded chunk (codes [R, K/2], scale bytes [R, K/B], fp32 tensor scale or
    None), cols <= K: each element `bf16(float(out) + decoded)`, rounded once (NaN as torch's CPU conversion
    writes it), in one pass: no fp32 decode in memory. out's rows may have their own stride (a column piece)."""
    lib = _need()
    c, s, t = chunk
    r, kh = c.shape
    k, cols = 2 * kh, out.shape[1]
    _check_cpu(out)
    if out.dtype != torch.bfloat16 or out.shape[0] != r or cols > k:
        raise Fp8CommError(f"native decode_add adds into bf16 [{r}, <= {k}], got {out.dtype} {tuple(out.shape)}")
    if k % fmt.block:
        raise Fp8CommError(f"native decode: row length {k} is not a multiple of {fmt.name}'s block {fmt.block}")
    _check_bytes(c, r * kh, "codes")
    _check_bytes(s, r * (k // fmt.block), "scale bytes")
    if fmt.two_level and (t is None or t.dtype != torch.float32 or t.numel() < 1 or t.device.type != "cpu"):
        raise Fp8CommError("native decode_add: an NVFP4 chunk needs its fp32 CPU tensor scale")
    if r == 0 or cols == 0:
        return out
    vals, scales = _tables(fmt)
    lib.fp4_decode_add_bf16(
        c.data_ptr(),
        s.data_ptr(),
        t.data_ptr() if fmt.two_level and t is not None else None,
        r,
        k,
        cols,
        int(fmt.two_level),
        vals.data_ptr(),
        scales.data_ptr(),
        out.data_ptr(),
        out.stride(0) if r > 1 else cols,
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
