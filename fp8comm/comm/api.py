"""Buffer: one object owning a group's default WireConfig, scratch memory, statistics and seeds (DeepEP-style).

buf = fp8comm.comm.Buffer(group, fmt="e4m3", scaling="e8m0")     # validated here: a typo raises now
out = buf.reduce_scatter(grads, op="avg")                        # per-call options override the defaults
buf.stats.snapshot()                                              # this Buffer's traffic; comm_stats(): all
"""

from __future__ import annotations

import torch

from ..errors import Fp8CommConfigError
from .buffers import Handle, ScratchPool
from .collectives import all_gather, all_gather_into, all_reduce, all_reduce_into, reduce_scatter, reduce_scatter_into
from .config import WireConfig, resolve
from .hierarchical import HierarchicalGroups
from .moe import all_to_all
from .state import CommState
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
