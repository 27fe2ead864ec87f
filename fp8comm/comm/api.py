"""Buffer: one object owning a group's default WireConfig, scratch memory, statistics and seeds (DeepEP-style).

buf = fp8comm.comm.Buffer(group, fmt="e4m3", scaling="e8m0")     # validated here: a typo raises now
out = buf.reduce_scatter(grads, op="avg")                        # per-call options override the defaults
buf.stats.snapshot()                                              # this Buffer's traffic; comm_stats(): all
"""

from __future__ import annotations

import gc
import importlib
import inspect
import sys
import warnings

import torch
import torch.distributed as dist

from ..errors import Fp8CommConfigError, Fp8CommError
from .buffers import Handle, ScratchPool
from .collectives import all_gather, all_gather_into, all_reduce, all_reduce_into, reduce_scatter, reduce_scatter_into
from .config import WireConfig, resolve
from .hierarchical import CALLER, LIBRARY, HierarchicalGroups, release_all_node_groups, release_node_groups
from .moe import all_to_all
from .state import CommState, default_state
from .stats import Stats

Result = torch.Tensor | Handle


class Buffer:
    """Default WireConfig + state (scratch pool, Stats, seed counter, check-policy call counts) for calls on `group`.

    Its methods mirror the functional API; per-call keywords override the defaults. `hierarchical` applies to
    all_gather / reduce_scatter / all_reduce; all_to_all has no hierarchical mode and refuses such a Buffer."""

    def __init__(
        self,
        group=None,
        config: WireConfig | None = None,
        *,
        hierarchical: bool | HierarchicalGroups | None = None,
        **options,
    ) -> None:
        self.group = group
        self.config = resolve(config, WireConfig(), options)  # raises Fp8CommConfigError on a bad option
        self.hierarchical = hierarchical
        self.state = CommState()

    @property
    def pool(self) -> ScratchPool:
        return self.state.pool

    @pool.setter
    def pool(self, pool: ScratchPool) -> None:
        self.state.pool = pool

    @property
    def stats(self) -> Stats:
        return self.state.stats

    def _kw(self, kw: dict) -> dict:
        kw.setdefault("hierarchical", self.hierarchical)
        return {**kw, "buffer": self}

    def all_gather(self, tensor: torch.Tensor, **kw) -> Result:
        return all_gather(tensor, self.group, **self._kw(kw))

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, **kw) -> Result:
        return all_gather_into(output, input, self.group, **self._kw(kw))

    def reduce_scatter(self, tensor: torch.Tensor, op="sum", **kw) -> Result:
        return reduce_scatter(tensor, self.group, op, **self._kw(kw))

    def reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, op="sum", **kw) -> Result:
        return reduce_scatter_into(output, input, self.group, op, **self._kw(kw))

    def all_reduce(self, tensor: torch.Tensor, op="sum", **kw) -> Result:
        return all_reduce(tensor, self.group, op, **self._kw(kw))

    def all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op="sum", **kw) -> Result:
        return all_reduce_into(output, input, self.group, op, **self._kw(kw))

    def all_to_all(self, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None, **kw):
        if self.hierarchical:
            raise Fp8CommConfigError(
                "this Buffer is hierarchical, and all_to_all has no hierarchical mode; use a "
                "Buffer without hierarchical= for MoE traffic"
            )
        return all_to_all(tensor, output_split_sizes, input_split_sizes, self.group, **kw, buffer=self)

    def release(self) -> None:
        """Free the scratch memory this Buffer holds (it is re-allocated on the next call)."""
        self.state.pool.clear()


def unpin_default_groups() -> int:
    """Drop the process-group references that torch binds as default arguments at import time; returns how many
    functions it changed.

    torch.distributed.nn.functional declares `group=group.WORLD` defaults, evaluated when it is first imported, and
    torch._dynamo imports it (fp8comm imports torch._dynamo: torch.compiler.disable, the compiled kernels). Imported
    after init_process_group, those defaults hold the live default group, so dist.destroy_process_group() cannot
    free it: its gloo worker and socket threads keep running into interpreter teardown (measured: 3 threads left per
    rank, 0 without fp8comm). None means "the default group" to every torch.distributed call, so replacing the
    bound groups by None changes no behaviour (and no longer points at a destroyed group after a re-init)."""
    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None or not dist.is_available():
        return 0
    changed = 0
    for fn in list(vars(mod).values()):
        defaults = getattr(fn, "__defaults__", None) if inspect.isfunction(fn) else None
        if defaults and any(isinstance(v, dist.ProcessGroup) for v in defaults):
            fn.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v for v in defaults)
            changed += 1
    return changed


def shutdown() -> None:
    """Release what fp8comm holds on process groups and scratch memory, for every holder; call it on every rank
    before dist.destroy_process_group(). Adapters call teardown(their holder) instead.

    Idempotent, safe without torch.distributed (and after destroy_process_group()). It destroys every node group
    fp8comm made (node_groups() of the caller and of adapters, and those hierarchical=True created: a later
    node_groups() or hierarchical call makes new ones), frees the default state's scratch memory, drops the group
    references torch binds at import time (unpin_default_groups) and those its DTensor caches keep
    (clear_dtensor_caches: FSDP2 fills them; it cannot reach other threads' caches), and collects reference
    cycles, so that destroy_process_group() really stops every backend thread before the interpreter exits.
    Handles not yet waited must be waited first (their collectives are in flight); a Buffer's scratch is freed by
    Buffer.release()."""
    release_all_node_groups()
    default_state().pool.clear()
    unpin_default_groups()
    clear_dtensor_caches()
    gc.collect()  # meshes also wait in reference cycles (FSDP2 state): free them while the interpreter is whole


def teardown(holder: str) -> int:
    """An adapter's teardown: release the node groups `holder` took (release_node_groups), free the default scratch
    pool's idle blocks and unpin torch's import-time default groups; returns how many node-group sets it destroyed.

    What others hold (the caller's node_groups(), another adapter's) stays usable, and torch's DTensor caches are
    left alone: the process-wide fp8comm.shutdown() frees those. Call it on every rank, like node_groups()."""
    if holder in (CALLER, LIBRARY):
        raise Fp8CommError(
            f"teardown({holder!r}): that holder is the caller's or the library's; an adapter releases its own "
            "holder (fp8comm.comm.release_node_groups() releases the caller's, fp8comm.shutdown() everything)"
        )
    destroyed = release_node_groups(holder)
    default_state().pool.clear()
    unpin_default_groups()
    return destroyed


# Where torch 2.13 caches a DTensorSpec or a DeviceMesh: (module, attribute path, how to empty it). Private names:
# a torch that renamed one makes clear_dtensor_caches() warn once instead of silently leaving that cache full.
_DTENSOR_CACHES = (
    ("torch._C", "_clear_DTensor_sharding_propagator_cache", None),  # C++ fast path, per thread
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding", "cache_clear"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos", "cache_clear"),
    ("torch.distributed.tensor._redistribute", "_planner_cache", "clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh", "cache_clear"),
)
_WARNED_MISSING: set[str] = set()


def clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches that keep a DeviceMesh alive, when DTensor is loaded: sharding propagation
    (C++ and Python), redistribute plans and transform infos, mesh topology.

    Their entries hold DTensorSpecs or meshes, hence the meshes' process groups: after FSDP2 (which fills them)
    dist.destroy_process_group() could not free the default group, and its gloo threads ran into interpreter
    teardown (measured in torch 2.13 without fp8comm: 3 threads per rank; CI saw both ranks of the FSDP2 example
    abort at exit). Clearing costs only recomputation on the next DTensor op.
    What it cannot reach: both sharding-propagation caches are per thread in torch 2.13, so only the calling
    thread's are emptied; entries made by DTensor ops in another thread still alive (autograd's device threads on
    CUDA) keep their meshes until that thread ends, and torch has no public call that empties them. The names are
    private torch names: when one is missing, this warns once (RuntimeWarning) and clears the others."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    missing = []
    for module, path, method in _DTENSOR_CACHES:
        target = _lookup(module, path)
        clear = target if method is None else getattr(target, method, None)
        if callable(clear):
            clear()
        else:
            missing.append(f"{module}.{path}" + (f".{method}" if method else ""))
    new = [name for name in missing if name not in _WARNED_MISSING]
    if new:
        _WARNED_MISSING.update(new)
        warnings.warn(
            f"fp8comm: torch {torch.__version__} has no {', '.join(new)}; the DTensor cache behind it is not "
            "emptied, so a DeviceMesh it holds (and the mesh's process groups) can outlive "
            "dist.destroy_process_group() (fp8comm needs updating for this torch version)",
            RuntimeWarning,
            stacklevel=2,
        )


def _lookup(module: str, path: str) -> object:
    """module.path, or None where any part of it is missing."""
    obj: object
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj
