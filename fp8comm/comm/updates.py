"""ReplicaUpdate: the weight all-gather of engines that keep a full replica on every rank, sending each shard's
change since the last gather in 4 (or 8) bits instead of its new values in bf16.

Every rank sends q(shard - replica[own slice]) and every rank, the owner too, applies the same decoded change to
every slice: replicas stay bit-identical, and the owner's quantization error stays in (master - replica), so it is
sent again with the next step's change instead of accumulating (docs/collectives.md, "Weight updates").
"""

from __future__ import annotations

import torch

from ..errors import Fp8CommError
from .checks import group_rank_size
from .collectives import all_gather_add
from .config import WireConfig
from .core import AddInto, all_gather_bytes

DEFAULT_UPDATE_CONFIG = WireConfig(fmt="mxfp4")


class ReplicaUpdate:
    """One flat replica's update gather: `gather(replica, shard)` after each optimizer step.

    The first gather (and the first after `reset()`) sends the values themselves in the replica's dtype, so replicas
    start exactly equal; `state_dict()` carries whether that happened (a resume that restores the replica too)."""

    def __init__(self, config: WireConfig | None = None, **options) -> None:
        cfg = config if config is not None else DEFAULT_UPDATE_CONFIG
        if not isinstance(cfg, WireConfig):
            raise Fp8CommError(f"config must be a fp8comm.comm.WireConfig, got {type(cfg).__name__}")
        self.config = cfg.replace(**options)
        if self.config.error_feedback:
            raise Fp8CommError(
                "ReplicaUpdate needs no error_feedback: the quantization error stays in (master - replica) and is "
                "sent with the next change"
            )
        self.primed = False
        self._buffers: dict[str, torch.Tensor] = {}  # fp32 scratch reused between gathers (change, shard)
        self.last_wire_bytes = 0  # bytes this rank sent in its last gather (to the other ranks)
        self.last_dtype_bytes = 0  # what gathering the replica's dtype would have sent
        self._inflight: UpdateHandle | None = None  # the last async gather, until waited (or discarded)

    def reset(self) -> None:
        """The next gather sends full values (after the engine rewrote the replica from the master, e.g. a load).
        An async gather still in flight finishes its transfer and is dropped (its change is not applied)."""
        if self._inflight is not None:
            self._inflight.discard()
            self._inflight = None
        self.primed = False

    def gather(
        self,
        replica: torch.Tensor,
        shard: torch.Tensor,
        group=None,
        *,
        async_op: bool = False,
        hierarchical=None,
        config: WireConfig | None = None,
        guard=None,
    ):
        """replica [world * n] (flat, identical on every rank) <- every rank's shard [n], through its change.

        async_op=True: the change is computed, quantized and put on the wire now (shard and replica may be read
        again, the shard overwritten, right after the call), and an `UpdateHandle` is returned whose wait()
        finishes the transfer (two levels: issues the node-local phase, so wait() where every rank waits, in the
        same order), decodes and adds the change to the replica (the replica must not be read or written
        in between: it is updated in wait()); the bits are those of the synchronous call. hierarchical: node groups
        (as for all_gather_into: every rank still decodes the same bytes, so replicas stay bit-identical and equal
        to the flat call's). config: this gather's wire instead of self.config (a numerics guard's FP8 fallback,
        fp8comm.comm.config_for; the same on every rank); guard: a GuardBucket the packing kernel counts into."""
        rank, world = group_rank_size(group)
        _check(replica, shard, world)
        if self._inflight is not None:  # the previous change first: this one is taken against the updated replica
            self._inflight.wait()
            self._inflight = None
        n = shard.numel()
        mine = replica.view(world, n)[rank]
        self.last_dtype_bytes = (world - 1) * n * replica.element_size()
        if not self.primed:
            work = all_gather_bytes(replica, shard.to(replica.dtype).contiguous(), group, async_op=async_op)
            self.primed = True
            self.last_wire_bytes = self.last_dtype_bytes
            if not async_op:
                return replica
            self._inflight = UpdateHandle(replica, work)
            return self._inflight
        # change = shard - mine in fp32; buffers kept between gathers (fresh ones cost page faults on every step)
        change = self._scratch("change", n, replica.device).copy_(mine)
        src = shard if shard.dtype == torch.float32 else self._scratch("shard", n, replica.device).copy_(shard)
        torch.sub(src, change, out=change)
        cfg = self.config if config is None else config
        if cfg.error_feedback:
            raise Fp8CommError("ReplicaUpdate.gather: config must not ask for error_feedback (see ReplicaUpdate)")
        # replica += every rank's decoded change, added as each piece is decoded (one pass on the native 4-bit
        # kernels: no fp32 copy of the replica-sized change is written)
        adder = AddInto(replica)
        h = all_gather_add(
            adder,
            change,
            group,
            config=cfg,
            async_op=async_op,
            hierarchical=hierarchical,
            node_phase_in_wait=async_op,  # the cross-node bytes travel while the caller works; wait() does the rest
            guard=guard,
        )
        self.last_wire_bytes = (world - 1) * _wire_bytes(cfg, n)
        if not async_op:
            return replica
        self._inflight = UpdateHandle(replica, h, adder)
        return self._inflight

    def _scratch(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """fp32 scratch; on CPU kept for the next gather (a fresh buffer of replica size costs its page faults on
        every step: measured 2-3 ns per element); on CUDA the caching allocator already reuses memory."""
        t = self._buffers.get(name)
        if t is None or t.numel() != numel or t.device != device:
            t = torch.empty(numel, dtype=torch.float32, device=device)
            if device.type == "cpu":
                self._buffers[name] = t
        return t

    def wire_bytes(self, n: int) -> int:
        """Bytes one rank's change of n elements takes on the wire (payload, scales, padding)."""
        return _wire_bytes(self.config, n)

    def state_dict(self) -> dict:
        """{"primed": bool}. An async gather in flight is finished first (its change applied), as a checkpoint of
        the replica must be taken after it."""
        if self._inflight is not None:
            self._inflight.wait()
        return {"primed": self.primed}

    def load_state_dict(self, sd: dict) -> None:
        if self._inflight is not None:  # the replica is being restored: the change in flight belongs to the old one
            self._inflight.discard()
            self._inflight = None
        self.primed = bool(sd["primed"])


class UpdateHandle:
    """What `ReplicaUpdate.gather(..., async_op=True)` returns: wait() finishes the transfer and (for a change)
    adds the decoded change to the replica, once; later waits return the replica. discard() finishes the transfer
    and drops the change (the replica was rewritten meanwhile: the engine's reset)."""

    def __init__(self, replica: torch.Tensor, work, adder: AddInto | None = None) -> None:
        self._replica, self._work, self._adder = replica, work, adder  # adder None: the priming gather
        self._done = False

    def wait(self, timeout=None) -> torch.Tensor:
        if not self._done:
            if self._work is not None:
                self._work.wait()  # a change's handle decodes and adds it into the replica here
            self._done = True
            self._work = None
        return self._replica

    def discard(self) -> None:
        """Finish the transfer without adding the change (the replica was restored meanwhile)."""
        if not self._done:
            if self._adder is not None:
                self._adder.drop()  # the transfer completes (every phase issued); nothing is added
            if self._work is not None:
                self._work.wait()
            self._done = True
            self._work = None

    def is_completed(self) -> bool:
        """True once wait() (or discard()) ran: the replica is updated only there."""
        return self._done


def _wire_bytes(cfg: WireConfig, n: int) -> int:
    codec = cfg.spec.codec
    return codec.layout((1,), codec.width(n)).total_bytes


def _check(replica, shard, world: int) -> None:
    for name, t in (("replica", replica), ("shard", shard)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise Fp8CommError(f"ReplicaUpdate.gather: {name} must be a floating-point tensor, got {_desc(t)}")
        if not t.is_contiguous():
            raise Fp8CommError(f"ReplicaUpdate.gather: {name} must be contiguous")
    if replica.numel() != world * shard.numel():
        raise Fp8CommError(
            f"ReplicaUpdate.gather: replica has {replica.numel()} elements, expected world ({world}) x shard "
            f"({shard.numel()}) = {world * shard.numel()}"
        )
    if replica.device != shard.device:
        raise Fp8CommError(f"ReplicaUpdate.gather: replica is on {replica.device}, shard on {shard.device}")


def _desc(t) -> str:
    return f"{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
