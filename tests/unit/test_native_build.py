"""The native 4-bit CPU kernels: built at install, loaded from the package; the opt-in build at first use
(FP8COMM_NATIVE_JIT=1) only from a private cache; every failure steps down to a path that works, with one warning.

Each case runs in a fresh interpreter over a copy of the package without the installed extension (what an install
without a compiler leaves), on a 1-rank gloo world, through the public collectives with 2^20-element buffers (the
size at which 'auto' would pick the compiled path). CXX names no compiler where inductor must be unavailable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # fresh interpreters and a 2^20-element collective per case: 20-30 s

PRELUDE = """
import json, os, sys, warnings
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
import fp8comm
from fp8comm.quant import fp4_native, toolchain
from fp8comm import Fp8CommFallbackWarning
warnings.simplefilter("always", Fp8CommFallbackWarning)  # count fp8comm's once-per-cause rule, not Python's
X = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))

def rs(**kw):
    return fp8comm.reduce_scatter(X, **kw)

def fallbacks(w):
    return [str(m.message) for m in w if issubclass(m.category, Fp8CommFallbackWarning)]

def fresh():  # forget what this process found, as a new process would
    fp4_native._lib.cache_clear()
    toolchain._warned.clear()
"""


@pytest.fixture(scope="module")
def bare_package(tmp_path_factory) -> Path:
    """A copy of the fp8comm package without the extension built at install."""
    dst = tmp_path_factory.mktemp("bare") / "fp8comm"
    shutil.copytree(ROOT / "fp8comm", dst, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dst.parent


def run(body: str, pythonpath: Path, cwd: Path, **env: str | None) -> dict:
    """PRELUDE + body in a fresh interpreter; returns the JSON it prints last."""
    e = {k: v for k, v in os.environ.items() if k not in ("FP8COMM_NATIVE_JIT", "FP8COMM_CACHE", "CC", "CXX")}
    e["PYTHONPATH"] = str(pythonpath)
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    p = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=300,
        env=e,
        cwd=cwd,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_no_compiler_anywhere_steps_down_with_one_warning(bare_package, tmp_path):
    """No extension and no compiler on PATH, opt-in build asked for: 'auto' runs the reference for FP8 and 4 bits
    (inductor has no compiler either, so 'compiled' would fail mid-training), one warning per cause, the reference's
    bits; an explicit 'compiled' is refused by the collective before any bytes move, naming the cause."""
    empty = tmp_path / "bin"
    empty.mkdir()
    got = run(
        """
        with warnings.catch_warnings(record=True) as w:
            a4, b4, a8, b8 = rs(fmt="mxfp4"), rs(fmt="mxfp4"), rs(), rs()
        out = {"warnings": fallbacks(w), "problem": fp4_native.problem()}
        out["same4"] = torch.equal(a4, rs(fmt="mxfp4", backend="reference")) and torch.equal(a4, b4)
        out["same8"] = torch.equal(a8, rs(backend="reference")) and torch.equal(a8, b8)
        try:
            rs(backend="compiled")
            out["compiled"] = None
        except fp8comm.Fp8CommError as e:
            out["compiled"] = str(e)
        try:
            fp8comm.quant.quantize_fp4(X.view(-1, 32), "mxfp4", backend="native")
            out["native"] = None
        except fp8comm.Fp8CommError as e:
            out["native"] = str(e)
        print(json.dumps(out))
        """,
        bare_package,
        tmp_path,
        PATH=str(empty),
        FP8COMM_NATIVE_JIT="1",
        FP8COMM_CACHE=str(tmp_path / "cache"),
    )
    assert got["same4"] and got["same8"], got
    assert len(got["warnings"]) == 2, got["warnings"]  # one per cause: no native kernels, no C++ compiler
    assert any("native 4-bit CPU kernels are unavailable" in m and "no C compiler" in m for m in got["warnings"])
    assert any("C++ compiler" in m for m in got["warnings"]), got["warnings"]
    assert got["compiled"] and "'compiled' cannot run here" in got["compiled"], got
    assert got["native"] and "no C compiler" in got["native"] and "not built at install" in got["native"], got


PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""

FAKE_CC = """#!/bin/sh
# A compiler that reports a version, starts writing its output, then dies by SIGKILL (an OOM kill, a timeout).
[ "$1" = "--version" ] && { echo "fake-cc 1.0"; exit 0; }
for a; do [ -n "$next" ] && { printf 'partial' > "$a"; break; }; [ "$a" = "-o" ] && next=1; done
kill -9 $$
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="builds a library with the system C compiler")
def test_opt_in_build_only_from_a_private_cache(bare_package, tmp_path):
    """FP8COMM_NATIVE_JIT=1 without the extension: each failure of the cache steps down (bits unchanged, one warning,
    no crash) and an explicit 'native' names it; a good cache is made 0700 and loads; a truncated library is
    rebuilt; a killed build leaves no file behind; a library or directory another user could have written is never
    loaded (its constructor never runs)."""
    cc = shutil.which("cc")
    marker = tmp_path / "planted-ran"
    plant = tmp_path / "plant.so"
    src = tmp_path / "plant.c"
    src.write_text(PLANT)
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(plant)], check=True)
    fake = tmp_path / "fake-cc"
    fake.write_text(FAKE_CC)
    fake.chmod(0o755)
    (tmp_path / "a-file").write_text("")
    cases = f"""
        import pwd, shutil, stat
        tmp, cc = {str(tmp_path)!r}, {cc!r}
        out = {{}}
        ref = rs(fmt="mxfp4", backend="reference")

        def case(name, cache=None, env=None):
            fresh()
            os.environ.pop("FP8COMM_CACHE", None)
            if cache:
                os.environ["FP8COMM_CACHE"] = cache
            os.environ.update(env or {{}})
            with warnings.catch_warnings(record=True) as w:
                y = rs(fmt="mxfp4")
            r = {{"ok": fp4_native.available(), "source": fp4_native.source(), "problem": fp4_native.problem(),
                  "warnings": fallbacks(w), "same": torch.equal(y, ref)}}
            try:
                fp8comm.quant.quantize_fp4(X[:64].view(2, 32), "mxfp4", backend="native")
                r["explicit"] = None
            except fp8comm.Fp8CommError as e:
                r["explicit"] = str(e)
            out[name] = r
            return r

        os.environ["CC"] = cc
    """
    first = run(
        cases
        + """
        case("file_in_the_way", tmp + "/a-file/cache")
        home = os.environ.pop("HOME")
        real = pwd.getpwuid
        def missing(uid):
            raise KeyError(uid)
        pwd.getpwuid = missing  # a uid without a password entry
        case("no_home")
        pwd.getpwuid = real
        os.environ["HOME"] = home
        out["tilde_made"] = os.path.exists("~")

        case("killed_build", tmp + "/c2", {"CC": tmp + "/fake-cc"})
        out["left_in_c2"] = sorted(os.listdir(tmp + "/c2"))
        os.environ["CC"] = cc

        os.makedirs(tmp + "/c3")
        os.chmod(tmp + "/c3", 0o777)
        case("shared_dir", tmp + "/c3")

        case("fresh_build", tmp + "/c1")
        (lib,) = [p for p in os.listdir(tmp + "/c1") if p.endswith(".so")]
        out["path"] = tmp + "/c1/" + lib
        out["dir_mode"] = oct(stat.S_IMODE(os.stat(tmp + "/c1").st_mode))
        out["lib_mode"] = oct(stat.S_IMODE(os.stat(out["path"]).st_mode))
        print(json.dumps(out))
        """,
        bare_package,
        tmp_path,
        FP8COMM_NATIVE_JIT="1",
        CXX="no-such-c++-compiler",  # inductor unavailable: the step-down goes to the reference
    )
    path = Path(first["path"])
    path.write_bytes(b"")  # a lost write (os.replace before the data reached the disk): zero bytes, final name
    # A new process: the dynamic loader hands a process the library it already loaded under the same path name.
    second = run(
        cases
        + f"""
        path = {str(path)!r}
        case("truncated", tmp + "/c1")
        out["rebuilt_size"] = os.path.getsize(path)
        shutil.copy(tmp + "/plant.so", path + ".new")  # planted under the name the cache computes
        os.chmod(path + ".new", 0o666)
        os.replace(path + ".new", path)
        case("planted_writable", tmp + "/c1")
        if os.getuid() == 0:
            os.chmod(path, 0o755)
            os.chown(path, 4242, 4242)
            case("planted_foreign", tmp + "/c1")
        out["marker"] = os.path.exists({str(marker)!r})
        print(json.dumps(out))
        """,
        bare_package,
        tmp_path,
        FP8COMM_NATIVE_JIT="1",
        CXX="no-such-c++-compiler",
    )
    got = {**first, **second}
    for name in ("file_in_the_way", "no_home", "killed_build", "shared_dir", "planted_writable"):
        r = got[name]
        assert not r["ok"] and r["same"], (name, r)
        assert len(r["warnings"]) == 1 and "C++ compiler" in r["warnings"][0], (name, r)
        assert r["explicit"] and "'native' is unavailable" in r["explicit"], (name, r)
    assert "unusable" in got["file_in_the_way"]["problem"]
    assert "no home directory" in got["no_home"]["problem"] and not got["tilde_made"], got["no_home"]
    assert got["fresh_build"]["ok"] and got["fresh_build"]["source"] == "jit" and got["fresh_build"]["same"]
    assert got["fresh_build"]["explicit"] is None and not any("4-bit" in m for m in got["fresh_build"]["warnings"])
    assert got["dir_mode"] == "0o700" and int(got["lib_mode"], 8) & 0o022 == 0, got
    assert got["truncated"]["ok"] and got["truncated"]["same"] and got["rebuilt_size"] > 1000, got
    assert "building fp4_cpu.c failed" in got["killed_build"]["problem"], got["killed_build"]
    assert got["left_in_c2"] == [], got["left_in_c2"]
    assert "writable by group or others" in got["shared_dir"]["problem"]
    assert "writable by group or others" in got["planted_writable"]["problem"]
    if os.getuid() == 0:
        assert "owned by uid 4242" in got["planted_foreign"]["problem"], got["planted_foreign"]
        assert not got["planted_foreign"]["ok"] and got["planted_foreign"]["same"]
    assert not got["marker"], "the planted library's constructor ran"
