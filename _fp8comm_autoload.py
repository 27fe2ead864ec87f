"""The DeepSpeed config flag without code changes: makes `deepspeed.initialize` honour an "fp8_comm" section.

Run at interpreter start by the one-line `fp8comm-autoload.pth` in site-packages; standard library only (sys, os).
Costs nothing at start: it imports neither torch, nor deepspeed, nor fp8comm; it puts a finder on sys.meta_path that
answers only for `deepspeed` and, once deepspeed's own module has run, replaces `deepspeed.initialize` with a wrapper.
The wrapper reads the call's config as DeepSpeed does (dict, JSON/HJSON file, base64 string) and hands the call to
`fp8comm.integrations.deepspeed.initialize` only when the section is on by the adapter's rule (present at the top
level, not false, not "enabled": false), importing fp8comm then; every other call, and a config it cannot read,
goes straight to DeepSpeed with nothing of fp8comm imported or patched. Nothing here raises during
`import deepspeed`: refusals (a DeepSpeed version fp8comm does not support, a bad section) come from fp8comm inside
initialize(). `FP8COMM_AUTOLOAD=0` (also false/no/off) at interpreter start turns all of this off, release() and
reattach() included. Importing fp8comm.integrations.deepspeed calls release(): its own config flag then wraps
DeepSpeed's original, once.

This is a top-level module, not fp8comm._autoload, so that interpreter start does not import the fp8comm package.
"""

import os
import sys

SECTION = "fp8_comm"
TARGET = "deepspeed"
ADAPTER = "fp8comm.integrations.deepspeed"
MARK = "_fp8comm_autoload"  # attribute set on the wrapper: tells it apart from DeepSpeed's own and fp8comm's flag

# What the hook did in this process (tests and `python -c` diagnostics read it): on (FP8COMM_AUTOLOAD at interpreter
# start), finder on, deepspeed.initialize wrapped, and how many initialize() calls it handed to fp8comm.
state = {"enabled": False, "finder": False, "wrapped": False, "handed_to_fp8comm": 0, "released": False}


def enabled() -> bool:
    """False when FP8COMM_AUTOLOAD is 0/false/no/off (read at interpreter start)."""
    return os.environ.get("FP8COMM_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off")


# ------------------------------------------------------------------------------------------ the import hook
class _Finder:
    """A sys.meta_path finder for `deepspeed` only: it lets the other finders find it and wraps their loader."""

    def __init__(self) -> None:
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET or self._busy:
            return None
        self._busy = True  # the finders asked below may ask the meta path again: answer None then
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        except Exception:  # never break `import deepspeed`: let the normal machinery look again without us
            return None
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader:
    """DeepSpeed's own loader; after its module has run, wrap its initialize and step out of the module's spec."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name):  # get_resource_reader, is_package, get_filename ...: DeepSpeed's loader answers
        if name == "_loader":  # not set yet (a copy in progress): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)  # DeepSpeed's own errors propagate unchanged
        try:
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader
            _wrap(module)
        except Exception:  # a DeepSpeed without initialize, a read-only module...: the explicit import still works
            pass


# ------------------------------------------------------------------------------------------- the wrapper
def _wrap(ds) -> None:
    orig = getattr(ds, "initialize", None)
    if orig is None or state["released"] or getattr(orig, MARK, False) or not callable(orig):
        return
    import functools

    @functools.wraps(orig)
    def initialize(*args, **kwargs):
        adapter = sys.modules.get(ADAPTER)
        if adapter is None:
            if not asks_for_fp8comm(orig, args, kwargs):
                return orig(*args, **kwargs)
            import importlib

            # Importing the adapter makes its own flag take over deepspeed.initialize (release() below); version,
            # signature and section errors are raised here, inside the caller's initialize().
            adapter = importlib.import_module(ADAPTER)
        state["handed_to_fp8comm"] += 1
        return adapter.initialize(*args, **kwargs)

    setattr(initialize, MARK, True)
    initialize._fp8comm_autoload_original = orig  # type: ignore[attr-defined]
    ds.initialize = initialize
    state["wrapped"] = True


def asks_for_fp8comm(orig, args: tuple, kwargs: dict) -> bool:
    """Whether this call of DeepSpeed's `orig` turns the section on (section_on() of the config DeepSpeed will use,
    read as DeepSpeed reads it); False for a config that cannot be read, which DeepSpeed then reports."""
    import inspect

    try:  # DeepSpeed's own signature (the wrapper's __wrapped__), so positional configs are found too
        bound = inspect.signature(orig).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {}  # DeepSpeed will report the bad call itself
    bound = {**kwargs, **bound}  # a signature with **kwargs (another DeepSpeed) binds config=... under its name
    # The same choice as DeepSpeed and the adapter (engine._ds_config): config, config_params, then args.
    cfg = bound.get("config")
    if cfg is None:
        cfg = bound.get("config_params")
    ns = bound.get("args")
    if cfg is None and ns is not None:
        cfg = getattr(ns, "deepspeed_config", None) or getattr(ns, "deepscale_config", None)
    return section_on(load_config(cfg))


def load_config(cfg):
    """`cfg` as DeepSpeed 0.19.8's load_ds_config reads it: a dict as is, a path to a JSON/HJSON file, or a base64
    string of one; None for anything else and for whatever fails to read or parse (DeepSpeed raises there)."""
    if isinstance(cfg, dict):
        return cfg
    if not isinstance(cfg, str):
        return None
    try:
        try:
            import hjson as parser  # DeepSpeed's own parser (a dependency of it, so importable once it is loaded)
        except ImportError:
            import json as parser  # a DeepSpeed without hjson reads JSON; the hook must still see the section
        if os.path.exists(cfg):
            with open(cfg) as f:
                out = parser.load(f, object_pairs_hook=_no_duplicate_keys)  # DeepSpeed refuses them in a file
        else:
            import base64

            out = parser.loads(base64.urlsafe_b64decode(cfg).decode("utf-8"))
    except Exception:  # unreadable, not JSON/HJSON, not base64, duplicate keys: DeepSpeed reports it
        return None
    return out if isinstance(out, dict) else None


def _no_duplicate_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys")
    return out


def section_on(ds_config) -> bool:
    """The adapter's rule (config.parse): on when fp8_comm is a top-level key that is not false and, as an object,
    not "enabled": false. A section fp8comm cannot read counts as on, so that fp8comm reports it."""
    if not isinstance(ds_config, dict) or SECTION not in ds_config:
        return False
    raw = ds_config[SECTION]
    if isinstance(raw, dict):
        return raw.get("enabled", True) is not False
    return raw is not False


# --------------------------------------------------------------------------------------- on / hand over
def install() -> None:
    """Put the finder on sys.meta_path (once), or wrap deepspeed.initialize now if deepspeed is already loaded."""
    if not state["enabled"] or state["finder"] or state["released"]:
        return
    ds = sys.modules.get(TARGET)
    if ds is not None:
        _wrap(ds)
        return
    sys.meta_path.insert(0, _Finder())
    state["finder"] = True


def release() -> None:
    """fp8comm's own config flag takes over: drop the finder and give deepspeed.initialize back to DeepSpeed's
    original, so that the flag wraps DeepSpeed's function (never this wrapper: no call goes through fp8comm twice).
    Callers holding this wrapper (`from deepspeed import initialize` before) still reach fp8comm through it."""
    if not state["enabled"]:  # FP8COMM_AUTOLOAD=0: nothing of the hook runs
        return
    state["released"] = True
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    state["finder"] = False
    ds = sys.modules.get(TARGET)
    current = getattr(ds, "initialize", None)
    if ds is not None and getattr(current, MARK, False):
        setattr(ds, "initialize", getattr(current, "_fp8comm_autoload_original"))  # noqa: B010, B009


def reattach() -> None:
    """Undo release() (the adapter failed to import): the wrapper goes back, so the section is not silently ignored.
    With FP8COMM_AUTOLOAD=0 it does nothing: DeepSpeed's initialize stays as the program left it."""
    if not state["enabled"]:
        return
    state["released"] = False
    ds = sys.modules.get(TARGET)
    if ds is not None:
        _wrap(ds)
    else:
        install()


state["enabled"] = enabled()
install()
