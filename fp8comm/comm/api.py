"""Buffer: a DeepEP-Buffer-like object that owns reusable scratch memory and default options for one group."""
from __future__ import annotations

from .buffers import ScratchPool
from .collectives import (all_gather, all_gather_into, all_reduce, all_reduce_into, reduce_scatter,
                          reduce_scatter_into)
from .moe import all_to_all


class Buffer:
    """Scratch memory + default options (fmt, scaling, rounding, check, hierarchical, ...) for calls on `group`.

    Its methods mirror the functional API; per-call keywords override the defaults.
    """

    def __init__(self, group=None, **defaults) -> None:
        self.group = group
        self.defaults = defaults
        self.pool = ScratchPool()

    def _kw(self, kw: dict) -> dict:
        return {**self.defaults, **kw, "buffer": self}

    def all_gather(self, tensor, **kw):
        return all_gather(tensor, self.group, **self._kw(kw))

    def all_gather_into(self, output, input, **kw):
        return all_gather_into(output, input, self.group, **self._kw(kw))

    def reduce_scatter(self, tensor, op="sum", **kw):
        return reduce_scatter(tensor, self.group, op, **self._kw(kw))

    def reduce_scatter_into(self, output, input, op="sum", **kw):
        return reduce_scatter_into(output, input, self.group, op, **self._kw(kw))

    def all_reduce(self, tensor, op="sum", **kw):
        return all_reduce(tensor, self.group, op, **self._kw(kw))

    def all_reduce_into(self, output, input, op="sum", **kw):
        return all_reduce_into(output, input, self.group, op, **self._kw(kw))

    def all_to_all(self, tensor, output_split_sizes=None, input_split_sizes=None, **kw):
        kw = self._kw(kw)
        kw.pop("hierarchical", None)  # all-to-all has no hierarchical mode
        return all_to_all(tensor, output_split_sizes, input_split_sizes, self.group, **kw)

    def release(self) -> None:
        """Free the scratch memory this Buffer holds (it is re-allocated on the next call)."""
        self.pool.clear()
