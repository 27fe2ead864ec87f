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
from .collectives import all_gather_into
from .config import WireConfig
from .core import all_gather_bytes

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
        self._buffers: dict[str, torch.Tensor] = {}  # fp32 scratch reused between gathers (change, decoded, ...)
        self.last_wire_bytes = 0  # bytes this rank sent in its last gather (to the other ranks)
        self.last_dtype_bytes = 0  # what gathering the replica's dtype would have sent

    def reset(self) -> None:
        """The next gather sends full values (after the engine rewrote the replica from the master, e.g. a load)."""
        self.primed = False

    def gather(self, replica: torch.Tensor, shard: torch.Tensor, group=None) -> torch.Tensor:
        """replica [world * n] (flat, identical on every rank) <- every rank's shard [n], through its change."""
        rank, world = group_rank_size(group)
        _check(replica, shard, world)
        n = shard.numel()
        mine = replica.view(world, n)[rank]
        self.last_dtype_bytes = (world - 1) * n * replica.element_size()
        if not self.primed:
            all_gather_bytes(replica, shard.to(replica.dtype).contiguous(), group, async_op=False)
            self.primed = True
            self.last_wire_bytes = self.last_dtype_bytes
            return replica
        # change = shard - mine in fp32; buffers kept between gathers (fresh ones cost page faults on every step)
        change = self._scratch("change", n, replica.device).copy_(mine)
        src = shard if shard.dtype == torch.float32 else self._scratch("shard", n, replica.device).copy_(shard)
        torch.sub(src, change, out=change)
        decoded = self._scratch("decoded", world * n, replica.device)
        all_gather_into(decoded, change, group, config=self.config)
        _apply(replica, decoded, self._scratch("apply", min(_APPLY_STEP, replica.numel()), replica.device))
        self.last_wire_bytes = (world - 1) * self.wire_bytes(n)
        return replica

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
        codec = self.config.spec.codec
        return codec.layout((1,), codec.width(n)).total_bytes

    def state_dict(self) -> dict:
        return {"primed": self.primed}

    def load_state_dict(self, sd: dict) -> None:
        self.primed = bool(sd["primed"])


_APPLY_STEP = 1 << 20  # elements per piece of the replica's fp32 add (the piece stays in cache)


def _apply(replica: torch.Tensor, decoded: torch.Tensor, tmp: torch.Tensor) -> None:
    """replica <- replica + decoded: the fp32 sum rounded once into the replica's dtype, on every rank the same
    bits (bit-identical replicas); a bf16 replica goes through fp32 pieces (mixed-dtype adds are slow on CPU)."""
    if replica.dtype == torch.float32:
        replica.add_(decoded)
        return
    for a in range(0, replica.numel(), tmp.numel()):
        b = min(a + tmp.numel(), replica.numel())
        t = tmp[: b - a].copy_(replica[a:b])
        replica[a:b].copy_(t.add_(decoded[a:b]))


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
