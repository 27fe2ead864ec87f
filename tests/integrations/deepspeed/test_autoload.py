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

import argparse
import base64
import functools
import importlib.util
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
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
                # never this checkout's in-place build: each venv's install must build its own extension
                shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
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
def test_installed_extension_loads_without_a_compiler(venvs, tmp_path):
    """Both installs built the 4-bit CPU kernels (setup.py's extension); at run time they load from the package
    with no compiler on PATH, and give the reference's bits through a public collective."""
    empty = tmp_path / "bin"
    empty.mkdir()
    probe = textwrap.dedent(
        """
        import json, torch, torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        import fp8comm
        from fp8comm.quant import fp4_native
        x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
        auto = fp8comm.reduce_scatter(x, fmt="mxfp4")
        same = torch.equal(auto, fp8comm.reduce_scatter(x, fmt="mxfp4", backend="reference"))
        print(json.dumps({"source": fp4_native.source(), "problem": fp4_native.problem(), "same": same,
                          "file": fp4_native.__file__}))
        """
    )
    for kind, (py, site, src) in venvs.items():
        env = _env(PATH=str(empty), FP8COMM_NATIVE_JIT="0")
        env.pop("CC", None)
        out = subprocess.run([str(py), "-c", probe], cwd=site.parent, env=env, capture_output=True, text=True)
        assert out.returncode == 0, (kind, out.stderr[-3000:])
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["source"] == "extension" and got["same"], (kind, got)
        where = src if kind == "editable" else site
        assert Path(got["file"]).resolve().is_relative_to(where.resolve()), (kind, got)
        assert list((Path(got["file"]).parent).glob("_fp4_cpu*.so")), (kind, got)


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
    monkeypatch.setitem(hook.state, "enabled", True)  # an active hook: release()/reattach() act
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


# The section's values and whether the adapter's rule (config.parse, docs/deepspeed.md) turns the section on.
SECTIONS = [
    (True, True),
    (False, False),
    ({}, True),
    ({"enabled": True}, True),
    ({"enabled": False}, False),
    ({"gemm": {"enabled": True}}, True),
    ({"mode": "measure", "log": False}, True),
    ({"enabled": False, "gemm": True}, False),
    # sections fp8comm refuses count as on: fp8comm reports them instead of DeepSpeed silently ignoring them
    (None, True),
    ("on", True),
    (1, True),
    ({"enabled": "no"}, True),
    ({"enabled": 0}, True),
    ({"blok_size": 128}, True),
]
# Configs that only mention the section: never on.
MENTIONS = [
    {},
    {"description": "a run without fp8_comm"},
    {"fp8_communication": {"enabled": True}},
    {"comm": {"fp8_comm": {"enabled": True}}},
]


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def _call_forms(cfg: dict, where: Path) -> dict:
    """Every way deepspeed.initialize takes `cfg`: {label: (args, kwargs)}."""
    text = json.dumps(cfg)
    hjson_text = "# fp8_comm: an HJSON comment\n" + text  # HJSON reads JSON; the comment is HJSON's own syntax
    f, h = where / "c.json", where / "c.hjson"
    f.write_text(text)
    h.write_text(hjson_text)
    return {
        "dict": ((), {"config": cfg}),
        "config_params": ((), {"config_params": cfg}),
        "positional": ((None,) * 10 + (cfg,), {}),
        "json file": ((), {"config": str(f)}),
        "hjson file": ((), {"config": str(h)}),
        "base64 json": ((), {"config": _b64(text)}),
        "base64 hjson": ((), {"config_params": _b64(hjson_text)}),
        "args.deepspeed_config": ((argparse.Namespace(deepspeed_config=str(h)),), {}),
        "args.deepscale_config": ((), {"args": argparse.Namespace(deepspeed_config=None, deepscale_config=str(f))}),
    }


def _adapter_engages(*args, **kwargs) -> bool:
    """The adapter's own decision for a deepspeed.initialize call: its config loader (DeepSpeed's) and parse()."""
    from fp8comm.errors import Fp8CommConfigError
    from fp8comm.integrations.deepspeed import config as section
    from fp8comm.integrations.deepspeed import engine

    try:
        ds_config = engine._ds_config(inspect.signature(_ds_signature).bind(*args, **kwargs))
    except Exception:  # DeepSpeed's loader refuses the config: DeepSpeed reports it, fp8comm plays no part
        return False
    try:
        return section.parse(ds_config).enabled
    except Fp8CommConfigError:
        return True  # fp8comm reports the bad section


def test_hook_rule_matches_the_adapter(hook, tmp_path):
    """For every section value and every way DeepSpeed takes a config, the hook hands the call to fp8comm exactly
    when the adapter's rule turns the section on; mentions and configs DeepSpeed cannot read never engage."""
    table = [({"train_batch_size": 1, "fp8_comm": value}, on) for value, on in SECTIONS]
    table += [({"train_batch_size": 1, **cfg}, False) for cfg in MENTIONS]
    wrong = []
    for i, (cfg, on) in enumerate(table):
        where = tmp_path / str(i)
        where.mkdir()
        for label, (a, k) in _call_forms(cfg, where).items():
            got = (hook.asks_for_fp8comm(_ds_signature, a, k), _adapter_engages(*a, **k))
            if got != (on, on):
                wrong.append((cfg, label, "hook, adapter:", got, "want:", on))
    on = json.dumps({"fp8_comm": {"enabled": True}})
    dup, bad = tmp_path / "dup.json", tmp_path / "bad.hjson"
    dup.write_text('{"fp8_comm": {"enabled": true}, "fp8_comm": {"enabled": true}}')  # DeepSpeed refuses it
    bad.write_text(on + "}")
    unreadable = {
        "duplicate keys": str(dup),
        "bad hjson file": str(bad),
        "bad hjson base64": _b64(on + "}"),
        "not a path nor base64": "fp8_comm.json",
        "pathlib.Path": tmp_path / "0" / "c.json",  # DeepSpeed takes str paths only
        "bytes": _b64(on).encode(),
    }
    for label, cfg in unreadable.items():
        got = (hook.asks_for_fp8comm(_ds_signature, (), {"config": cfg}), _adapter_engages(config=cfg))
        if got != (False, False):
            wrong.append((label, "hook, adapter:", got, "want: False"))
    assert not wrong, "\n".join(map(str, wrong))


def test_hook_finds_a_config_behind_catch_all_parameters(hook):
    """A DeepSpeed whose initialize takes (*args, **kwargs), or a wrapper with that signature: a config given by
    name is still read, so the section is not silently ignored (fp8comm then refuses that DeepSpeed itself)."""

    def initialize(*args, **kwargs):
        """Another DeepSpeed's signature."""

    on, off = {"fp8_comm": {"enabled": True}}, {"fp8_comm": {"enabled": False}}
    assert hook.asks_for_fp8comm(initialize, (), {"config": on})
    assert hook.asks_for_fp8comm(initialize, (argparse.Namespace(deepspeed_config=None),), {"config": on})
    assert not hook.asks_for_fp8comm(initialize, (), {"config": off})


# Runs in a fresh interpreter started with FP8COMM_AUTOLOAD=0, so that an installed .pth hook does nothing; it then
# loads the hook file under test as _fp8comm_autoload with FP8COMM_AUTOLOAD=argv[2], as the .pth would: before torch
# and deepspeed. "on": configs that do not turn the section on, then one that does; "off": the hook stays out.
CONFIG_SCRIPT = r"""
import argparse, base64, importlib.util, json, os, sys
hook_file, autoload, tmp = sys.argv[1:4]
os.environ["FP8COMM_AUTOLOAD"] = autoload
spec = importlib.util.spec_from_file_location("_fp8comm_autoload", hook_file)
hook = importlib.util.module_from_spec(spec)
sys.modules["_fp8comm_autoload"] = hook
spec.loader.exec_module(hook)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
import deepspeed
from deepspeed.runtime.engine import DeepSpeedEngine

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # DeepSpeed's CPU shm op build: not needed here
ADAPTER = "fp8comm.integrations.deepspeed"
DS_OWN = getattr(deepspeed.initialize, "_fp8comm_autoload_original", deepspeed.initialize)
BASE = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6}


def path(name, text):
    p = os.path.join(tmp, name)
    with open(p, "w") as f:
        f.write(text)
    return p


def b64(text):
    return base64.urlsafe_b64encode(text.encode()).decode()


def build(**kw):
    # DeepSpeed's own errors (an unreadable config) are results here, like an engine
    try:
        eng, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), **kw)
        return type(eng).__name__
    except Exception as e:
        return type(e).__name__


def deepspeed_as_is():
    init = deepspeed.initialize
    return {
        "adapter_imported": ADAPTER in sys.modules,
        "initialize_is_deepspeeds": getattr(init, "_fp8comm_autoload_original", init) is DS_OWN,
        "engine_init_patched": hasattr(DeepSpeedEngine.__init__, "__wrapped__"),
        "handed_to_fp8comm": hook.state["handed_to_fp8comm"],
    }


out = {"state_at_start": dict(hook.state), "hook_wrapped": bool(getattr(deepspeed.initialize, hook.MARK, False))}
if autoload == "1":
    out["cases"] = {}
    for name, kw in {
        "dict enabled false": {"config": {**BASE, "fp8_comm": {"enabled": False}}},
        "config_params false": {"config_params": {**BASE, "fp8_comm": False}},
        "json file, description": {"config": path("d.json", json.dumps({**BASE, "description": "no fp8_comm"}))},
        "json file, fp8_communication": {
            "config": path("s.json", json.dumps({**BASE, "fp8_communication": {"enabled": True}}))
        },
        "hjson file enabled false": {
            "config": path("h.hjson", "# fp8_comm stays off\n{\n  train_micro_batch_size_per_gpu: 1\n"
                           "  fp8_comm: {enabled: false}\n}\n")
        },
        "base64 enabled false": {"config": b64(json.dumps({**BASE, "fp8_comm": {"enabled": False}}))},
        "args.deepspeed_config enabled false": {
            "args": argparse.Namespace(local_rank=0, deepspeed_config=path(
                "a.json", json.dumps({**BASE, "fp8_comm": {"enabled": False}})))
        },
        "json file, duplicate keys": {
            "config": path("dup.json", '{"train_micro_batch_size_per_gpu": 1, "fp8_comm": {}, "fp8_comm": {}}')
        },
        "base64, bad hjson": {"config": b64('{"fp8_comm": {"enabled": true}}}')},
    }.items():
        out["cases"][name] = {"result": build(**kw), **deepspeed_as_is()}
    model = torch.nn.Linear(4, 4)
    on = path("on.hjson", "{\n  train_micro_batch_size_per_gpu: 1\n  zero_optimization: {stage: 3}\n"
              "  fp8_comm: {gemm: false}  # on\n}\n")
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=on)
    out["on"] = {"fp8comm_engine": sys.modules[ADAPTER].engine_state(eng) is not None, **deepspeed_as_is()}
else:
    # A DeepSpeed whose initialize the adapter refuses (a newer signature): the explicit import fails
    def newer_initialize(*args, tp_plan=None, **kwargs):
        return DS_OWN(*args, **kwargs)

    deepspeed.initialize = newer_initialize
    try:
        import fp8comm.integrations.deepspeed  # noqa: F401
        out["import"] = "ok"
    except Exception as e:
        out["import"] = type(e).__name__
    out["initialize_untouched"] = deepspeed.initialize is newer_initialize
    out["state_after_import"] = dict(hook.state)
    out["section_ignored"] = build(config={**BASE, "fp8_comm": {"enabled": True}})
    out["adapter_imported"] = ADAPTER in sys.modules
print("RESULT " + json.dumps(out))
"""


def _start_config_script(hook_file: Path, autoload: str, where: Path) -> subprocess.Popen:
    (where / "script.py").write_text(CONFIG_SCRIPT)
    e = _env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        FP8COMM_AUTOLOAD="0",
    )
    return subprocess.Popen(
        [sys.executable, "script.py", str(hook_file), autoload, str(where)],
        cwd=where,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow  # two fresh interpreters with DeepSpeed: ~20 s
@pytest.mark.timeout(300)
def test_only_an_enabled_section_engages(tmp_path):
    """Real DeepSpeed, fresh interpreters (run at once). Hook on: configs that do not turn the section on (off,
    mentions, unreadable) leave DeepSpeed as it is: adapter not imported, nothing patched; an HJSON file with the
    section on still engages fp8comm. FP8COMM_AUTOLOAD=0: a failed explicit import leaves initialize untouched."""
    hook_file = ROOT / "_fp8comm_autoload.py"
    procs = {}
    for autoload in ("1", "0"):
        where = tmp_path / f"autoload-{autoload}"
        where.mkdir()
        start = functools.partial(_start_config_script, hook_file, autoload, where)
        procs[autoload] = (start(), start)
    res = {k: _result(p, timeout=240, restart=again) for k, (p, again) in procs.items()}

    r = res["1"]
    assert r["state_at_start"]["finder"] and r["hook_wrapped"], r
    untouched = {"adapter_imported": False, "initialize_is_deepspeeds": True, "engine_init_patched": False}
    wrong = {k: v for k, v in r["cases"].items() if v != {**v, **untouched, "handed_to_fp8comm": 0}}
    assert not wrong, json.dumps(wrong, indent=1)
    built = {k: v["result"] for k, v in r["cases"].items()}
    assert built.pop("json file, duplicate keys") == "ValueError", r  # DeepSpeed's own errors
    assert built.pop("base64, bad hjson") == "ValueError", r
    assert set(built.values()) == {"DeepSpeedEngine"}, built
    assert r["on"] == {**r["on"], "fp8comm_engine": True, "adapter_imported": True, "handed_to_fp8comm": 1}, r

    o = res["0"]
    off = {"enabled": False, "finder": False, "wrapped": False, "released": False, "handed_to_fp8comm": 0}
    assert o["state_at_start"] == off and not o["hook_wrapped"], o
    assert o["import"] == "Fp8CommUnsupportedError", o
    assert o["initialize_untouched"] and o["state_after_import"] == off, o
    assert o["section_ignored"] == "DeepSpeedEngine" and not o["adapter_imported"], o
