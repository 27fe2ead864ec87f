"""The library is a library: `import fp8comm` loads no framework, plotting or console library; the layers import
downwards only (nothing in the core or integrations imports fp8comm.tools); the `fp8comm` command names the
missing 'tools' extra instead of a traceback; and the demo works from an installed wheel, not only a checkout.

Each check runs in a fresh interpreter (subprocess), because this pytest process has long imported everything.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("deepspeed", "megatron", "rich", "matplotlib", "transformer_engine")
LAYERS = {"fp8comm": REPO / "fp8comm", "fp8comm.integrations": REPO / "integrations"}  # package -> folder
# Installed as the first entry of sys.meta_path, this makes rich and matplotlib unimportable, as on a machine
# where fp8comm was installed without the 'tools' extra.
BLOCK_TOOLS_EXTRA = textwrap.dedent("""
    import sys

    class _NoToolsExtra:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("rich", "matplotlib"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoToolsExtra())
""")


def _py(code: str, *, cwd=None, env=None, args=(), timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def _modules_after(code: str) -> set[str]:
    r = _py(code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))")
    assert r.returncode == 0, r.stderr[-3000:]
    return set(json.loads(r.stdout.splitlines()[-1]))


def _heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in HEAVY)


def test_import_fp8comm_loads_no_framework_plotting_or_console_library():
    # `import fp8comm`, then the whole core API (every layer below the integrations): none of them, no tools.
    r = _py(
        "import json, sys\nimport fp8comm\nfirst = sorted(sys.modules)\n"
        "import fp8comm.quant, fp8comm.gemm, fp8comm.comm\nfrom fp8comm import *\n"
        "assert callable(quantize) and fp8comm.comm.all_gather is fp8comm.all_gather is all_gather\n"
        "print(json.dumps([first, sorted(sys.modules)]))"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for mods in map(set, json.loads(r.stdout.splitlines()[-1])):
        assert not _heavy(mods), _heavy(mods)
        assert not any(m.startswith("fp8comm.tools") for m in mods)
    assert "torch" in mods


def test_cli_help_imports_nothing_heavy():
    """`fp8comm --help` and `fp8comm bench --help` build their parser without importing torch or any extra."""
    for argv in (["--help"], ["bench", "--help"]):
        mods = _modules_after(
            "import sys\nfrom fp8comm.tools.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0\n"
        )
        assert not _heavy(mods) and "torch" not in mods, (argv, _heavy(mods))


def test_layers_never_import_the_tools():
    """quant <- gemm, comm <- integrations <- tools: no module outside fp8comm/tools imports it (statements,
    relative imports and module names in strings, as importlib.import_module would take them)."""
    bad = []
    for layer, folder in LAYERS.items():
        for f in sorted(folder.rglob("*.py")):
            if f.is_relative_to(REPO / "fp8comm" / "tools"):
                continue
            tree = ast.parse(f.read_text(), str(f))
            pkg = (layer + "." + ".".join(f.relative_to(folder).parent.parts)).rstrip(".")
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:  # relative: resolve against the file's package
                        parts = pkg.split(".")
                        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                    names = [base] + [f"{base}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names = [node.value]
                else:
                    continue
                if any(n == "fp8comm.tools" or n.startswith("fp8comm.tools.") for n in names):
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno}")
    assert not bad, bad


@pytest.mark.parametrize(
    "argv, needs",
    [(["demo", "--steps", "1"], "fp8comm demo"), (["bench", "quant", "--reps", "1"], "fp8comm bench quant")],
)
def test_command_without_tools_extra_names_the_extra(argv, needs):
    r = _py(BLOCK_TOOLS_EXTRA + "from fp8comm.tools.cli import main\nraise SystemExit(main(sys.argv[1:]))", args=argv)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"{needs} needs the 'tools' extra (rich, matplotlib): pip install 'fp8comm[tools]'" in r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    # `python -m fp8comm.tools.demo` (the module the workers run) answers the same way
    if argv[0] == "demo":
        r = _py(
            BLOCK_TOOLS_EXTRA + "import runpy\nrunpy.run_module('fp8comm.tools.demo', run_name='__main__')",
            args=["--steps", "1"],
        )
        assert r.returncode == 2 and "pip install 'fp8comm[tools]'" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_help_and_extra_free_benches_work_without_tools_extra():
    """Help texts need no extra; `bench comm` / `bench gemm` print plain text and need none either."""
    for argv in (["--help"], ["demo", "--help"], ["bench", "comm", "--help"]):
        r = _py(
            BLOCK_TOOLS_EXTRA + "from fp8comm.tools.cli import main\nraise SystemExit(main(sys.argv[1:]))", args=argv
        )
        assert r.returncode == 0 and "usage: fp8comm" in r.stdout, (argv, r.stderr[-2000:])


# ----------------------------------------------------------------------------------------- from a wheel
def _copy_source(dst: Path) -> None:
    """The checkout without its build products, environments and caches (the build must not write into it)."""
    skip_top = {".git", ".venv", ".whl", "runs", "build", "dist", "bench_out", ".pytest_cache", ".hypothesis"}

    def ignore(folder, names):
        top = Path(folder) == REPO
        return {n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (top and n in skip_top)}

    shutil.copytree(REPO, dst, ignore=ignore)


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> Path:
    """fp8comm built as a wheel and installed (no dependencies) into a folder of its own."""
    tmp = tmp_path_factory.mktemp("wheel")
    _copy_source(tmp / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    r = subprocess.run(
        pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(tmp / "src")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("fp8comm-*.whl")
    r = subprocess.run(
        pip + ["install", "--no-deps", "--no-compile", "--target", str(tmp / "site"), str(whl)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return tmp / "site"


def _installed_env(site_dir: Path) -> dict:
    # The wheel's folder first, then this interpreter's site-packages for torch, DeepSpeed, rich and matplotlib.
    # Run with -S (below): the venv's .pth files, among them the editable install's finder that maps fp8comm to
    # this checkout, are not processed.
    paths = [str(site_dir)] + [p for p in site.getsitepackages() if os.path.isdir(p)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return dict(env, PYTHONPATH=os.pathsep.join(paths), PYTHONNOUSERSITE="1")


WHEEL_CHECKS = textwrap.dedent("""
    import argparse, json, os, sys
    import fp8comm
    import fp8comm.tools.cli, fp8comm.tools.demo as demo
    from fp8comm.tools.gpt import GPT, GPTConfig
    import torch

    torch.manual_seed(0)
    _, loss = GPT(GPTConfig(11, 8, 1, 2, 16))(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    assert torch.isfinite(loss)
    p = argparse.ArgumentParser()
    demo.add_args(p)
    args = p.parse_args(["--device", "cpu", "--steps", "1"])
    args.ranks = 2
    problem = demo._preflight(args)  # what `fp8comm demo` checks before it launches anything
    if problem is None:  # DeepSpeed is here: the worker's imports, in the worker's order
        from fp8comm.integrations.deepspeed import cpu
        cpu.prepare()
        import deepspeed, fp8comm.integrations.deepspeed
    cmd, env = demo.launch_command(args, "/nonexistent")
    files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
    print(json.dumps({"problem": problem, "cmd": cmd, "pythonpath": env.get("PYTHONPATH"),
                      "my_pythonpath": os.environ.get("PYTHONPATH"), "files": files}))
""")


@pytest.mark.slow  # builds a wheel and runs the demo from it: ~25 s
def test_demo_runs_from_an_installed_wheel(wheel_site, tmp_path):
    """From outside the checkout, with fp8comm only from the wheel: the demo's launcher and worker modules, the
    model, the command; no module comes from the checkout and the worker command names a module, not a path."""
    env = _installed_env(wheel_site)
    r = subprocess.run(
        [sys.executable, "-S", "-c", WHEEL_CHECKS], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    venv = Path(sys.prefix).resolve()
    from_checkout = {
        n: f
        for n, f in out["files"].items()
        if f
        and os.path.isabs(f)
        and Path(f).resolve().is_relative_to(REPO)
        and not Path(f).resolve().is_relative_to(venv)
    }
    assert not from_checkout, from_checkout
    ours = {n: f for n, f in out["files"].items() if n == "fp8comm" or n.startswith("fp8comm.")}
    assert "fp8comm.tools.demo" in ours and "fp8comm.tools.gpt" in ours
    assert all(Path(f).resolve().is_relative_to(wheel_site.resolve()) for f in ours.values() if f), ours
    has_ds = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode == 0
    assert out["problem"] is None or not has_ds, out["problem"]
    cmd = out["cmd"]
    assert cmd[cmd.index("--worker") - 2 : cmd.index("--worker")] == ["-m", "fp8comm.tools.demo"], cmd
    assert out["pythonpath"] == out["my_pythonpath"], "the launcher must not add paths for its workers"
    for argv in (["fp8comm.tools.cli", "demo", "--help"], ["fp8comm.tools.demo", "--help"]):
        r = subprocess.run(
            [sys.executable, "-S", "-m", *argv], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
        )
        assert r.returncode == 0 and "usage: fp8comm demo" in r.stdout, (argv, r.stderr[-2000:])


def test_renamed_names_still_work_with_a_deprecation_warning():
    """0.1 names of the adapters' error and config classes resolve to the new objects for one release."""
    import fp8comm.integrations.deepspeed as fd
    import fp8comm.integrations.megatron as fm
    from fp8comm.errors import Fp8CommError, Fp8CommUnsupportedError

    for module, old, new in (
        (fd, "UnsupportedError", Fp8CommUnsupportedError),
        (fd, "Fp8CommConfig", fd.Fp8CommDeepSpeedConfig),
        (fm, "Fp8commConfig", fm.Fp8CommMegatronConfig),
        (fm, "Fp8commMegatronError", fm.Fp8CommMegatronError),
    ):
        with pytest.warns(FutureWarning, match=f"{old} is deprecated"):
            assert getattr(module, old) is new
    # one base class for everything fp8comm raises (and the built-in each one stands for)
    assert issubclass(fm.Fp8CommMegatronError, Fp8CommError) and issubclass(Fp8CommUnsupportedError, RuntimeError)
