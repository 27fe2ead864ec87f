"""Buffer: one object owning a group's default WireConfig, scratch memory, statistics and seeds (DeepEP-style).

buf = fp8comm.comm.Buffer(group, fmt="e4m3", scaling="e8m0")     # validated here: a typo raises now
out = buf.reduce_scatter(grads, op="avg")                        # per-call options override the defaults
buf.stats.snapshot()                                              # this Buffer's traffic; comm_stats(): all
"""

from __future__ import annotations

import gc
import inspect
import sys

import torch
import torch.distributed as dist

from ..errors import Fp8CommConfigError
from .buffers import Handle, ScratchPool
from .collectives import all_gather, all_gather_into, all_reduce, all_reduce_into, reduce_scatter, reduce_scatter_into
from .config import WireConfig, resolve
from .hierarchical import HierarchicalGroups
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
    """Release what fp8comm holds on process groups and scratch memory; call it before dist.destroy_process_group().

    Idempotent, local (no collective), safe without torch.distributed. It drops the node groups that hierarchical
    mode created (cached per parent group, re-created on the next hierarchical call), the default state's scratch
    memory, the group references torch binds at import time (unpin_default_groups) and those its DTensor caches
    keep (clear_dtensor_caches: FSDP2 fills them), so that destroy_process_group() really stops every backend
    thread before the interpreter exits. Handles not yet waited
    must be waited first (their collectives are in flight); a Buffer's scratch is freed by Buffer.release()."""
    from . import hierarchical

    hierarchical._CACHE.clear()
    default_state().pool.clear()
    unpin_default_groups()
    clear_dtensor_caches()
    gc.collect()  # meshes also wait in reference cycles (FSDP2 state): free them while the interpreter is whole


def clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches that keep a DeviceMesh alive, when DTensor is loaded: sharding propagation
    (C++ and Python), redistribute plans and transform infos, mesh topology.

    Their entries hold DTensorSpecs or meshes, hence the meshes' process groups: after FSDP2 (which fills them)
    dist.destroy_process_group() could not free the default group, and its gloo threads ran into interpreter
    teardown (measured in torch 2.13 without fp8comm: 3 threads per rank; CI saw both ranks of the FSDP2 example
    abort at exit). Clearing costs only recomputation on the next DTensor op. Private torch names, looked up
    defensively: a torch without one of them simply has nothing there to clear."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    dtensor = getattr(sys.modules["torch.distributed.tensor"], "DTensor", None)
    prop = getattr(getattr(dtensor, "_op_dispatcher", None), "sharding_propagator", None)
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    collective = sys.modules.get("torch.distributed.tensor._collective_utils")
    for cached in (
        getattr(prop, "propagate_op_sharding", None),
        getattr(redistribute, "_gen_transform_infos", None),
        getattr(getattr(collective, "MeshTopoInfo", None), "build_from_mesh", None),
    ):
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    plans = getattr(redistribute, "_planner_cache", None)
    if isinstance(plans, dict):
        plans.clear()
