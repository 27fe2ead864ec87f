"""End of a DeepSpeed job: drop the references to process groups that DeepSpeed keeps outside any engine.

torch.distributed.destroy_process_group() frees a gloo group, and stops its worker and socket threads, only when no
Python object holds it any more; threads still running at exit meet interpreter teardown, which can abort
("terminate called without an active exception"). Measured on DeepSpeed 0.19.8, 1 rank, ZeRO-1, 2 or 3 with and
without the fp8_comm section, engine.destroy() called and the engine dropped, then uninstall(), fp8comm.shutdown()
and destroy_process_group(): 6 gloo threads left (two groups: WORLD and the copy DeepSpeed clones from it); 0 after
shutdown() below. What holds them:

- deepspeed.utils.groups module globals (_WORLD_GROUP, the expert/data/model-parallel groups, mesh_device, mpu);
  only deepspeed.comm.destroy_process_group() releases them, torch's own does not;
- deepspeed.comm.torch.TorchBackend.barrier / monitored_barrier, whose `group=GroupMember.WORLD` defaults are
  evaluated at import: imported after init_process_group, they hold the live default group;
- deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK, to which every ZeRO-3 engine appends its module for
  good: the module's hooks hold the engine, and the engine its groups (engine.destroy() leaves it there);
- the lru_cache of PartitionedParameterCoordinator.__params_to_release (ZeRO-3, from the second step on): its keys
  hold the coordinator, hence the parameters and their ds_process_group;
- reference cycles that only several collections free (an engine's autograd hooks live in C++).

All are DeepSpeed's private names, read on DeepSpeed 0.19.8 and looked up defensively: a name that is missing is
reported once (that release keeps its groups elsewhere: gloo threads may outlive the job again).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys

import torch.distributed as dist

from fp8comm.comm import shutdown as comm_shutdown

from ..private_names import MissingNames
from .engine import _ENGINES, uninstall
from .patching import log

CHECKED_ON = "0.19.8"  # the DeepSpeed release whose private names below were read

# deepspeed.utils.groups globals that hold groups (dicts: name -> group) or objects holding groups (mesh_device, mpu)
GROUP_GLOBALS = (
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_ALL_TO_ALL_GROUP",
    "_WORLD_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP",
    "mesh_device",
    "mpu",
)
# methods whose ProcessGroup defaults are replaced by None: each turns None back into GroupMember.WORLD itself
DEFAULT_BOUND = ("barrier", "monitored_barrier")

_missing = MissingNames("DeepSpeed", CHECKED_ON, log)


def shutdown() -> None:
    """End of the DeepSpeed job: uninstall() (every engine detached, DeepSpeed restored), release_groups() and
    fp8comm.shutdown(), so that dist.destroy_process_group() next stops every gloo thread. Every rank, idempotent.

    Call engine.destroy() and drop the engines first: DeepSpeed's gradient hooks keep an engine, and its groups,
    alive through autograd, where no garbage collection frees it. An fp8comm engine still alive is reported."""
    alive = [es._engine for es in _ENGINES if es._engine is not None]
    release_groups()
    uninstall()
    comm_shutdown()  # all of fp8comm's references (node groups included), not only the adapter's share
    for _ in range(4):  # an engine dies over several collections: freeing its tensors' autograd hooks (C++) only
        if not gc.collect():  # then drops the Python objects of the next cycle
            break
    left = sum(ref() is not None for ref in alive)
    if left:
        log.warning(
            f"fp8comm: {left} DeepSpeed engine(s) still alive at shutdown(); their process groups outlive "
            "destroy_process_group() (gloo threads left running at exit). Call engine.destroy() and drop every "
            "reference to the engine (and its optimizer) first"
        )


def release_groups() -> None:
    """Drop DeepSpeed's own references to process groups: module globals, import-time defaults, ZeRO-3's module
    stack and release cache. Local (no collective), idempotent, a no-op when DeepSpeed is not loaded.

    Call it when every engine is done (engine.destroy() called, engine dropped), before destroy_process_group():
    DeepSpeed creates its groups again (new_group, a collective) if it needs them afterwards."""
    if "deepspeed" not in sys.modules:
        return
    _release_group_globals()
    _unbind_default_groups()
    _clear_zero3_state()


def _release_group_globals() -> None:
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)  # DeepSpeed's own: what deepspeed.comm.destroy_process_group() runs after WORLD
    for name in GROUP_GLOBALS:  # and the same by name, for a release without it
        if not hasattr(groups, name):
            _missing(f"deepspeed.utils.groups.{name}")
        elif isinstance(getattr(groups, name), dict):
            getattr(groups, name).clear()
        else:
            setattr(groups, name, None)


def _unbind_default_groups() -> None:
    backend = sys.modules.get("deepspeed.comm.torch")
    if backend is None:
        return
    cls = getattr(backend, "TorchBackend", None)
    for name in DEFAULT_BOUND:
        fn = inspect.getattr_static(cls, name, None) if cls is not None else None
        if not inspect.isfunction(fn):
            _missing(f"deepspeed.comm.torch.TorchBackend.{name}")
        elif fn.__defaults__:
            fn.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v for v in fn.__defaults__)


def _clear_zero3_state() -> None:
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:
        owner = getattr(coordinator, "PartitionedParameterCoordinator", None)
        cache = _lru_cache(getattr(owner, "_PartitionedParameterCoordinator__params_to_release", None))
        if cache is None:
            _missing("deepspeed.runtime.zero.partitioned_param_coordinator: the lru_cache of __params_to_release")
        else:
            cache.cache_clear()  # costs a recomputation at the next parameter release
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        stack = getattr(offload, "FWD_MODULE_STACK", None)
        if isinstance(stack, list):
            stack.clear()  # between forwards it holds only the engines' top modules, pushed once and never popped
        else:
            _missing("deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK")


def _lru_cache(fn, depth: int = 3):
    """The functools.lru_cache wrapper inside `fn`: DeepSpeed's instrument_w_nvtx wraps it without functools.wraps,
    so it is reached through the wrapper's closure."""
    if fn is None or depth < 0:
        return None
    if hasattr(fn, "cache_clear") and hasattr(fn, "cache_info"):
        return fn
    inner = [getattr(fn, "__wrapped__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            inner.append(cell.cell_contents)
    for f in inner:
        if callable(f):
            found = _lru_cache(f, depth - 1)
            if found is not None:
                return found
    return None
