"""The flag alone: an installed fp8comm makes deepspeed.initialize honour "fp8_comm" with no import in the script.

Fresh venvs built here, offline: the package is installed with `pip install --no-deps --no-build-isolation` from a
copy of the sources, once as a regular install and once editable (-e). This test's venv (.venv) is itself a venv,
so `--system-site-packages` would expose the base interpreter's packages, not torch and DeepSpeed: the new venvs see
this venv's site-packages through a path line instead (a plain path line: its .pth files are not run, so this
venv's own fp8comm install plays no part). Then a script that never imports fp8comm trains a 1-rank CPU DeepSpeed
ZeRO-3 engine with the section, and the hook that engaged is shown to be the installed one (its module file, its
hand-over counter, fp8comm's hook counters). FP8COMM_AUTOLOAD=0 is the negative run.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (pip install deepspeed==0.19.8 torch==2.13.0)")

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("pyproject.toml", "setup.py", "_fp8comm_autoload.py", "README.md", "fp8comm", "integrations")
PTH = "fp8comm-autoload.pth"
ADAPTER = "fp8comm.integrations.deepspeed"

# Runs inside the fresh venv. "hook" and "off" never import fp8comm before their first engine; "explicit" imports
# the adapter before deepspeed (the documented way), to show the hook then stays out of the way.
SCRIPT = r"""
import json, os, sys
mode = sys.argv[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if mode == "explicit":
    import fp8comm.integrations.deepspeed  # noqa: F401
import torch
import deepspeed
from deepspeed import initialize as bound_early  # before anything of fp8comm ran: the hook's wrapper, if any

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # DeepSpeed's CPU shm op build: not needed here
ADAPTER = "fp8comm.integrations.deepspeed"
CFG = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
FP8 = {**CFG, "fp8_comm": {"enabled": True, "gemm": {"enabled": False}}}


def engine(init, cfg):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    eng, *_ = init(model=model, optimizer=torch.optim.AdamW(model.parameters(), 1e-3), config=cfg)
    losses = []
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        loss = eng(x).pow(2).mean()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    fd = sys.modules.get(ADAPTER)
    stats = fd.hook_stats(eng) if fd is not None and fd.engine_state(eng) is not None else None
    return {"losses": losses, "stats": stats, "adapter_loaded": fd is not None}


def hook_state():
    hook = sys.modules.get("_fp8comm_autoload")
    return None if hook is None else {**hook.state, "file": hook.__file__}


def flag_state():
    fd = sys.modules.get(ADAPTER)
    if fd is None:
        return None
    orig = fd.engine._ORIG_INIT
    return {
        "initialize_is_flag": bool(getattr(deepspeed.initialize, "_fp8comm_hook", False)),
        "flag_wraps_autoload_wrapper": bool(getattr(orig, "_fp8comm_autoload", False)),
        "flag_wraps_deepspeed_module_function": getattr(orig, "__module__", "") == "deepspeed",
        "fp8comm_file": sys.modules["fp8comm"].__file__,
    }


out = {"mode": mode, "hook_at_start": hook_state(), "runs": {}}
out["fp8comm_after_import_deepspeed"] = sorted(m for m in sys.modules if m.split(".")[0] == "fp8comm")
out["runs"]["section"] = engine(deepspeed.initialize, FP8)
out["hook_after_first"] = hook_state()
out["flag_after_first"] = flag_state()
if mode == "hook":  # a function bound before the hand-over still reaches fp8comm through the hook's wrapper
    out["runs"]["bound_early"] = engine(bound_early, FP8)
    out["runs"]["no_section"] = engine(deepspeed.initialize, CFG)
if mode == "off":  # with the hook off, the explicit import still works
    import fp8comm.integrations.deepspeed  # noqa: F401,E402
    out["runs"]["after_import"] = engine(deepspeed.initialize, FP8)
out["hook_end"] = hook_state()
out["flag_end"] = flag_state()
print("RESULT " + json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FP8COMM_AUTOLOAD")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def _make_venv(where: Path, src: Path, editable: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    py = where / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    parents = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "zz_test_parent_env.pth").write_text("".join(f"{p}\n" for p in parents))  # torch, deepspeed, pip
    cmd = [
        str(py),
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
    ]
    subprocess.run([*cmd, *(["-e"] if editable else []), str(src)], check=True, timeout=300, cwd=where, env=_env())
    return site


@pytest.fixture(scope="module")
def venvs(tmp_path_factory) -> dict:
    """{"regular": (python, site-packages, sources), "editable": ...}: each with its own copy of the sources."""
    out = {}
    for kind in ("regular", "editable"):
        base = tmp_path_factory.mktemp(f"autoload-{kind}")
        src = base / "src"
        src.mkdir()
        for name in SOURCES:
            p = ROOT / name
            if p.is_dir():
                shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(p, src / name)
        site = _make_venv(base / "venv", src, editable=(kind == "editable"))
        out[kind] = (base / "venv" / "bin" / "python", site, src)
    return out


def _start(py: Path, mode: str, cwd: Path, **env: str) -> subprocess.Popen:
    (cwd / "script.py").write_text(SCRIPT)
    port = str(_free_port())
    e = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", **env)
    return subprocess.Popen(
        [str(py), "script.py", mode], cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _result(p: subprocess.Popen, timeout: float = 420, restart=None) -> dict:
    """The process's RESULT line. restart(): a new process for the same run, used once when the store's port was
    taken between _free_port() and the bind (the processes run at once, and each one's gloo binds ephemeral ports:
    one of them can be the port handed to another; seen once in CI as EADDRINUSE)."""
    try:
        log, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        log, _ = p.communicate()
        raise AssertionError(f"timed out:\n{log[-4000:]}") from None
    if p.returncode and restart is not None and "EADDRINUSE" in log:
        return _result(restart(), timeout)
    lines = [x for x in log.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"exit {p.returncode}:\n{log[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _engaged(run: dict) -> int:
    """fp8comm's own counters for the engine: FP8 calls over every traffic kind (0 when fp8comm had no engine)."""
    stats = run["stats"] or {}
    return sum(v.get("fp8_calls", 0) for k, v in stats.items() if isinstance(v, dict) and k != "hooks")


# -------------------------------------------------------------------------------------------- the fresh venvs
@pytest.mark.slow  # builds two venvs and installs the package into each: ~20 s
def test_pth_installed_and_startup_imports_nothing(venvs):
    """The .pth is in site-packages (after the editable finder's .pth), and interpreter start loads the hook but
    none of torch, deepspeed, fp8comm."""
    probe = (
        "import json, sys; h = sys.modules.get('_fp8comm_autoload');"
        "print(json.dumps({'heavy': sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'deepspeed', 'fp8comm', 'numpy')), 'hook': h is not None and h.state['finder'],"
        "'file': h and h.__file__}))"
    )
    for kind, (py, site, src) in venvs.items():
        assert (site / PTH).read_text() == "import _fp8comm_autoload\n", kind
        names = sorted(n for n in os.listdir(site) if n.endswith(".pth"))
        if kind == "editable":  # the editable finder must be up before our line imports the module through it
            ed = [n for n in names if n.startswith("__editable__") and "fp8comm" in n]
            assert ed and names.index(ed[0]) < names.index(PTH), names
        got = json.loads(subprocess.check_output([str(py), "-c", probe], cwd=site.parent, env=_env(), text=True))
        assert got["heavy"] == [] and got["hook"], (kind, got)
        want = src if kind == "editable" else site
        assert Path(got["file"]).resolve().parent == want.resolve(), (kind, got)
        off = subprocess.check_output(
            [str(py), "-c", probe], cwd=site.parent, env=_env(FP8COMM_AUTOLOAD="0"), text=True
        )
        assert json.loads(off)["hook"] is False, (kind, off)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two venvs (when this test builds them) and four DeepSpeed processes on 2 shared cores
def test_the_flag_alone_engages_fp8comm(venvs):
    """Regular and editable installs: the section alone engages fp8comm through the installed hook (and only it);
    FP8COMM_AUTOLOAD=0 leaves the section ignored until the explicit import; the explicit import with the hook on
    installs the flag once, around DeepSpeed's own initialize. The four processes run at once (1 rank each)."""
    procs = {}
    for kind, mode, env in (
        ("regular", "hook", {}),
        ("editable", "hook", {}),
        ("editable", "explicit", {}),
        ("regular", "off", {"FP8COMM_AUTOLOAD": "0"}),
    ):
        py, site, _ = venvs[kind]
        cwd = site.parent.parent.parent / f"run-{mode}"  # venv/lib/pythonX.Y/site-packages -> venv/run-<mode>
        cwd.mkdir(exist_ok=True)
        procs[(kind, mode)] = (_start(py, mode, cwd, **env), functools.partial(_start, py, mode, cwd, **env))
    res = {k: _result(p, restart=again) for k, (p, again) in procs.items()}

    for kind in ("regular", "editable"):
        r = res[(kind, "hook")]
        py, site, src = venvs[kind]
        installed = (src if kind == "editable" else site).resolve()
        # the installed hook engaged: its file, its counter; the adapter it imported is the installed one
        assert Path(r["hook_at_start"]["file"]).resolve().parent == installed, r
        # `import deepspeed` wrapped its initialize and imported nothing of fp8comm
        assert r["hook_at_start"]["finder"] and r["hook_at_start"]["wrapped"], r
        assert r["fp8comm_after_import_deepspeed"] == [], r
        assert r["hook_after_first"]["handed_to_fp8comm"] == 1 and r["hook_after_first"]["released"], r
        assert Path(r["flag_after_first"]["fp8comm_file"]).resolve().is_relative_to(installed), r
        assert _engaged(r["runs"]["section"]) > 0, r["runs"]["section"]
        # the adapter's flag took deepspeed.initialize over, wrapping DeepSpeed's own function (no double install)
        f = r["flag_after_first"]
        assert f["initialize_is_flag"] and not f["flag_wraps_autoload_wrapper"], f
        assert f["flag_wraps_deepspeed_module_function"], f
        # `from deepspeed import initialize` bound before: still the hook's wrapper, handed to fp8comm once more
        assert _engaged(r["runs"]["bound_early"]) > 0 and r["hook_end"]["handed_to_fp8comm"] == 2, r
        # no section: DeepSpeed alone
        assert r["runs"]["no_section"]["stats"] is None, r["runs"]["no_section"]

    e = res[("editable", "explicit")]
    assert e["hook_end"]["released"] and not e["hook_end"]["finder"] and e["hook_end"]["handed_to_fp8comm"] == 0, e
    assert _engaged(e["runs"]["section"]) > 0, e
    assert not e["flag_end"]["flag_wraps_autoload_wrapper"] and e["flag_end"]["initialize_is_flag"], e

    o = res[("regular", "off")]
    assert o["hook_at_start"] == {**o["hook_at_start"], "finder": False, "wrapped": False}, o
    assert o["fp8comm_after_import_deepspeed"] == [], o
    assert not o["runs"]["section"]["adapter_loaded"] and o["runs"]["section"]["stats"] is None, o
    assert o["runs"]["section"]["losses"] == res[("regular", "hook")]["runs"]["no_section"]["losses"], (
        "the ignored section did not train like DeepSpeed alone"
    )
    assert _engaged(o["runs"]["after_import"]) > 0, o
    assert o["hook_end"]["handed_to_fp8comm"] == 0, o


# ------------------------------------------------------------------------------- the hook's logic, in-process
@pytest.fixture
def hook(monkeypatch):
    """A private copy of the hook module, loaded with FP8COMM_AUTOLOAD=0 so it puts nothing on sys.meta_path."""
    monkeypatch.setenv("FP8COMM_AUTOLOAD", "0")
    spec = importlib.util.spec_from_file_location("_fp8comm_autoload_under_test", ROOT / "_fp8comm_autoload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not mod.state["finder"]
    return mod


def _ds_signature(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=29500,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """deepspeed.initialize's parameters (0.19.8)."""


@pytest.mark.parametrize("value", ["off", "0", "False", "no"])
def test_autoload_env_values(hook, monkeypatch, value):
    monkeypatch.setenv("FP8COMM_AUTOLOAD", value)
    assert not hook.enabled()
    monkeypatch.setenv("FP8COMM_AUTOLOAD", "1")
    assert hook.enabled()


def test_which_calls_go_to_fp8comm(hook, tmp_path):
    """Every way DeepSpeed takes a config; only a config that mentions the section goes to fp8comm."""

    class Args:
        deepspeed_config = None

    on, off = {"fp8_comm": {"enabled": True}}, {"zero_optimization": {"stage": 3}}
    f_on, f_off = tmp_path / "on.json", tmp_path / "off.json"
    f_on.write_text(json.dumps(on))
    f_off.write_text(json.dumps(off))
    b64 = base64.urlsafe_b64encode(json.dumps(on).encode()).decode()
    ask = lambda *a, **k: hook.asks_for_fp8comm(_ds_signature, a, k)
    assert ask(config=on) and ask(config_params=on) and ask(config=str(f_on)) and ask(config=b64)
    assert not ask(config=off) and not ask(config=str(f_off)) and not ask(config=str(tmp_path / "missing.json"))
    a = Args()
    a.deepspeed_config = str(f_on)
    assert ask(a) and ask(args=a)
    a.deepspeed_config = str(f_off)
    assert not ask(args=a)
    positional = [None] * 10 + [on]
    assert ask(*positional)
    assert not ask(model=object()) and not ask(config=123)


def test_wrapper_hands_over_and_release_restores(hook, monkeypatch):
    """On a stand-in deepspeed module: no section -> DeepSpeed's own; section -> the adapter's initialize;
    release() gives the module its function back; an exception while importing the adapter propagates from
    initialize() (never from the import of deepspeed)."""
    import types

    calls = []

    def ds_init(args=None, model=None, optimizer=None, config=None, config_params=None):
        calls.append(("deepspeed", config))
        return "engine"

    ds = types.ModuleType("deepspeed")
    ds.initialize = ds_init
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    # An adapter imported by an earlier test in this process would take every call (by design): start without it.
    monkeypatch.delitem(sys.modules, ADAPTER, raising=False)
    hook.state["released"] = False
    hook._wrap(ds)
    wrapper = ds.initialize
    assert wrapper is not ds_init and wrapper.__wrapped__ is ds_init
    assert wrapper(config={"a": 1}) == "engine" and calls == [("deepspeed", {"a": 1})]

    adapter = types.ModuleType(ADAPTER)
    adapter.initialize = lambda *a, **k: calls.append(("fp8comm", k["config"])) or "fp8 engine"
    monkeypatch.setitem(sys.modules, ADAPTER, adapter)
    assert wrapper(config={"fp8_comm": {}}) == "fp8 engine" and calls[-1] == ("fp8comm", {"fp8_comm": {}})
    assert hook.state["handed_to_fp8comm"] == 1

    hook.release()
    assert ds.initialize is ds_init and hook.state["released"]
    hook._wrap(ds)  # released: never wraps again
    assert ds.initialize is ds_init
    hook.reattach()
    assert ds.initialize is not ds_init and getattr(ds.initialize, "_fp8comm_autoload", False)

    monkeypatch.delitem(sys.modules, ADAPTER)
    monkeypatch.setattr(hook, "ADAPTER", "fp8comm_no_such_adapter_module")
    with pytest.raises(ModuleNotFoundError):
        ds.initialize(config={"fp8_comm": {}})
