"""Numerics guard: per-bucket counts of what FP8 could not hold, and a policy that falls a bucket back to BF16.

The quantize kernels count, in every call that carries a bucket's counters, the finite elements that saturated
(|x / scale| beyond the format's max) and the finite non-zero elements that underflowed to zero; the counts add up
on the device in the bucket's counter tensor (inside the packing kernel: no extra pass, no host read). Once per
step, at a point where the engine already synchronizes, `Guard.step()` sums every bucket's counts over the ranks
(one small all-reduce, started asynchronously) and uses the sums of the step before (one step of lag: they were
complete when the engine synchronized), so every rank sees the same numbers and takes the same decision.

A bucket whose saturated-or-underflowed fraction is above `threshold` for `patience` consecutive steps sends BF16
(the engine's own collective) for the next `cooldown` steps, then FP8 again. Non-finite elements are counted but
never trigger a fallback: they must reach the engine's overflow check, as without fp8comm.

4-bit buckets (a step whose packs were MXFP4/NVFP4): at 4 bits flushing small elements to zero is normal (an E2M1
block keeps nothing below ~1/24 of its amax: 5-15% of Gaussian data), so the FP8 rule would fall back constantly.
Their measure is the fraction of elements that were finite and non-zero and became +-0 (an E2M1 block never
saturates), against
`fp4_threshold`; over it for `patience` steps the bucket sends FP8 for `cooldown` steps (then 4 bits again), and
while on FP8 the FP8 rule can take it on to BF16: the fallback goes 4 bits -> FP8 -> BF16, per bucket.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ..errors import Fp8CommConfigError, Fp8CommError
from .stats import PROCESS_STATS

log = logging.getLogger("fp8comm.guard")
COUNTS = ("saturated", "underflow", "nonfinite")  # per bucket, as the kernels add them (int64)
WIRES = ("fp4", "fp8", "bf16")  # what Guard.wire says a bucket sends next: its 4-bit config, FP8, or the engine's
# Device types whose counters are added to on several streams (the engines' gather and reduce streams) and read on
# the step stream: ordered by events. A test adds "cpu" with fake streams to check the ordering logic.
_STREAM_DEVICE_TYPES = ("cuda",)


def _current_stream(device: torch.device):
    return torch.cuda.current_stream(device)


def _new_event():
    return torch.cuda.Event()


@dataclass(frozen=True)
class GuardPolicy:
    """threshold: fraction of a bucket's elements that saturated or underflowed in one step; patience: steps over
    it before the bucket falls back to BF16; cooldown: steps in BF16 before FP8 is tried again. fp4_threshold: the
    same for a 4-bit bucket's fraction of non-zero elements flushed to zero (then FP8 for cooldown steps)."""

    threshold: float = 1e-3
    patience: int = 3
    cooldown: int = 50
    fp4_threshold: float = 0.25

    def __post_init__(self) -> None:
        for name in ("threshold", "fp4_threshold"):
            v = getattr(self, name)
            if not (isinstance(v, float | int) and not isinstance(v, bool) and 0 < v < 1):
                raise Fp8CommConfigError(f"guard {name} must be a fraction in (0, 1), got {v!r}")
        for name in ("patience", "cooldown"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise Fp8CommConfigError(f"guard {name} must be an int >= 1 (steps), got {v!r}")


class GuardBucket:
    """One bucket's device counters (saturated, underflow, nonfinite) and the host count of elements quantized.

    Pass it to a collective (`guard=`) and the packing kernels add into `counters`. On CUDA the kernels add on
    whatever stream the collective runs on and Guard.step() reads and zeroes on its own: before_pack/after_pack
    (called around every pack) and the step's read/zero order the two with events, on the GPU (no host wait)."""

    def __init__(self, key: str, device: torch.device) -> None:
        self.key = key
        self.counters = torch.zeros(len(COUNTS), dtype=torch.int64, device=device)
        self.elements = 0  # host-side: the call knows how many elements it quantized
        self.fp4_elements = 0  # of which in 4 bits (the bucket's measure is then the 4-bit one)
        self._streamed = self.counters.device.type in _STREAM_DEVICE_TYPES
        self._added: dict = {}  # stream -> event recorded after the last pack that added on it since the last read
        self._reset = None  # event recorded on the step stream after the last read-and-zero
        self._after_reset: set = set()  # streams already ordered behind that event

    def add_elements(self, n: int, fp4: bool = False) -> None:
        self.elements += int(n)
        if fp4:
            self.fp4_elements += int(n)

    def before_pack(self) -> None:
        """Order a pack on the current stream after the step's last read-and-zero (else it adds into counts that
        are then zeroed, or into the previous step's read)."""
        if self._streamed and self._reset is not None:
            s = _current_stream(self.counters.device)
            if s not in self._after_reset:
                s.wait_event(self._reset)
                self._after_reset.add(s)

    def after_pack(self) -> None:
        """Record where the counters were just added to: the step's read waits for the last such event per stream."""
        if self._streamed:
            s = _current_stream(self.counters.device)
            ev = _new_event()
            ev.record(s)
            self._added[s] = ev

    def _before_read(self, stream) -> None:
        for s, ev in self._added.items():
            if s != stream:
                stream.wait_event(ev)
        self._added.clear()

    def _after_zero(self, stream, event) -> None:
        self._reset, self._after_reset = event, {stream}


@dataclass
class BucketState:
    """Where one bucket stands: consecutive steps over the threshold, BF16 (and, 4-bit buckets, FP8) steps left,
    switches so far, whether its last measured step packed 4 bits."""

    over: int = 0
    bf16_left: int = 0
    switches: int = 0
    last_fraction: float = 0.0
    fp8_left: int = 0
    fp4: bool = False


@dataclass
class _Pending:
    """The counts of one finished step: all-reduced (async) into `reduced`, copied to host memory."""

    keys: list[str]
    work: object
    host: torch.Tensor
    event: torch.cuda.Event | None = None


@dataclass
class Guard:
    """The guard of one engine (one process group): buckets by key, their state, and the per-step decision.

    Keys must be registered in the same order on every rank (they are: buckets are met in collective order)."""

    policy: GuardPolicy = field(default_factory=GuardPolicy)
    group: object = None
    buckets: dict[str, GuardBucket] = field(default_factory=dict)
    states: dict[str, BucketState] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # per step: {key: fraction} of the step the decision used
    steps: int = 0
    _pending: _Pending | None = None
    _reduced_buckets: int = 0

    def bucket(self, key: str, device: torch.device, fp4: bool = False) -> GuardBucket:
        """The bucket `key` (created on first use, on `device`); fp4=True: its collectives are configured in 4
        bits, so `wire(key)` answers "fp4" (not "fp8") until the guard demotes it."""
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = GuardBucket(key, torch.device(device))
            self.states.setdefault(key, BucketState())
        if fp4:
            self.states[key].fp4 = True
        return b

    def wire(self, key: str) -> str:
        """ "bf16" while `key` falls back to the engine's own collective; "fp8" (an FP8 bucket, or a 4-bit one
        demoted to FP8); "fp4" (a 4-bit bucket on its own wire). The same answer on every rank at the same step;
        `config_for` turns it into the call's WireConfig."""
        st = self.states.get(key)
        if st is None:
            return "fp8"
        if st.bf16_left > 0:
            return "bf16"
        if st.fp8_left > 0:
            return "fp8"
        return "fp4" if st.fp4 else "fp8"

    def step(self) -> dict[str, str]:
        """Call once per optimizer step where the engine synchronizes anyway: decides from the previous step's
        all-reduced counts, starts this step's all-reduce, and returns {key: wire} for the next step."""
        self.steps += 1
        done, self._pending = self._pending, self._start()
        for st in self.states.values():  # the fallback clock runs whatever the counts say
            if st.bf16_left > 0:
                st.bf16_left -= 1
                if st.bf16_left == 0:
                    self._switch("fp8", st, "cooldown over: FP8 again")
            elif st.fp8_left > 0:
                st.fp8_left -= 1
                if st.fp8_left == 0:
                    self._switch("fp4", st, "cooldown over: 4 bits again")
        if done is not None:
            self._decide(done)
        return {k: self.wire(k) for k in self.buckets}

    def _start(self) -> _Pending | None:
        keys = list(self.buckets)
        if not keys:
            return None
        dev = next(iter(self.buckets.values())).counters.device
        cuda = dev.type == "cuda"
        # The packs add on the collectives' streams: this (the step) stream reads only after the last of them, and
        # the packs after this step wait for the zeroing below (GuardBucket.before_pack).
        step_stream = _current_stream(dev) if dev.type in _STREAM_DEVICE_TYPES else None
        if step_stream is not None:
            for b in self.buckets.values():
                b._before_read(step_stream)
        elements = torch.tensor([[b.elements, b.fp4_elements] for b in self.buckets.values()], dtype=torch.int64)
        if cuda:  # pinned and async: no host wait for the upload either
            elements = elements.pin_memory().to(dev, non_blocking=True)
        rows = torch.cat([torch.stack([b.counters for b in self.buckets.values()]), elements], dim=1)
        for b in self.buckets.values():
            b.counters.zero_()
            b.elements = b.fp4_elements = 0
        if step_stream is not None:
            zeroed = _new_event()
            zeroed.record(step_stream)
            for b in self.buckets.values():
                b._after_zero(step_stream, zeroed)
        work = None
        if dist.is_available() and dist.is_initialized():
            if len(keys) != self._reduced_buckets:  # new buckets (the first steps): all ranks must agree
                _same_buckets(keys, self.group, dev)
                self._reduced_buckets = len(keys)
            work = dist.all_reduce(rows, group=self.group, async_op=True)
        host = torch.empty(rows.shape, dtype=torch.int64, pin_memory=cuda)
        if work is not None:
            work.wait()  # on CUDA: the copy below waits on the GPU, not the host
        host.copy_(rows, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return _Pending(keys, work, host, event)

    def _decide(self, p: _Pending) -> None:
        if p.event is not None:
            p.event.synchronize()  # complete since the engine's own synchronization: returns at once
        counts = p.host.tolist()  # a host tensor, complete after the event: no device sync
        fractions = {}
        for key, (sat, under, _nonfinite, elements, fp4_elements) in zip(p.keys, counts):
            st = self.states[key]
            frac = (sat + under) / elements if elements else 0.0
            st.last_fraction = fractions[key] = frac
            if st.bf16_left > 0:
                continue
            if fp4_elements:  # a 4-bit step: flushed fraction vs fp4_threshold; over it -> FP8
                st.fp4 = True
                if st.fp8_left > 0:  # a step from before the demotion (one step of lag): decided already
                    continue
                limit, to, what = self.policy.fp4_threshold, "fp8", "non-zero elements flushed to zero"
            elif elements or st.fp8_left == 0:
                limit, to, what = self.policy.threshold, "bf16", "elements saturated or underflowed"
            else:
                continue
            st.over = st.over + 1 if frac > limit else 0
            if st.over >= self.policy.patience:
                st.over = 0
                if to == "bf16":
                    st.bf16_left = self.policy.cooldown
                else:
                    st.fp8_left = self.policy.cooldown
                self._switch(
                    to, st, f"{frac:.2%} of its {what} for {self.policy.patience} steps (threshold {limit:.2%})", key
                )
        self.history.append({"step": self.steps, **fractions})

    def _switch(self, to: str, st: BucketState, why: str, key: str | None = None) -> None:
        st.switches += 1
        key = key or next(k for k, s in self.states.items() if s is st)
        PROCESS_STATS.record(f"guard.to_{to}", 0, 0, calls=1)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("fp8comm guard: bucket %s -> %s at step %d: %s", key, to.upper(), self.steps, why)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {
            "policy": asdict(self.policy),
            "steps": self.steps,
            "states": {k: asdict(s) for k, s in self.states.items()},
            "history": list(self.history),
        }

    def load_state_dict(self, sd: dict) -> None:
        if GuardPolicy(**sd["policy"]) != self.policy:
            raise Fp8CommConfigError(
                f"checkpointed guard policy {sd['policy']} differs from this run's {asdict(self.policy)}"
            )
        self.steps = int(sd["steps"])
        self.states = {k: BucketState(**v) for k, v in sd["states"].items()}
        self.history = list(sd.get("history", []))
        self._pending = None

    def summary(self) -> dict[str, dict]:
        """{key: {wire, switches, last_fraction, bf16_left}} for logs and reports."""
        return {
            k: {
                "wire": self.wire(k),
                "switches": s.switches,
                "last_fraction": s.last_fraction,
                "bf16_left": s.bf16_left,
                "fp8_left": s.fp8_left,
            }
            for k, s in self.states.items()
        }

    def plot(self, path: str, title: str = "fp8comm guard") -> None:
        """Per bucket: the fraction that saturated or underflowed per step, the threshold, and BF16 spans."""
        import matplotlib  # plotting is the tools extra's job: imported only when asked for

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        keys = sorted({k for h in self.history for k in h if k != "step"})
        for k in keys:
            pts = [(h["step"], h[k]) for h in self.history if k in h]
            ax.plot([p[0] for p in pts], [max(p[1], 1e-9) for p in pts], label=k)
        ax.axhline(self.policy.threshold, color="k", lw=0.8, ls="--", label="threshold")
        ax.set(yscale="log", xlabel="step", ylabel="saturated + underflowed fraction", title=title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def config_for(cfg, wire: str, fp8_fmt: str = "e4m3"):
    """The WireConfig a bucket sends with under Guard.wire's answer: None for "bf16" (the engine's own collective),
    `cfg` itself, or for a 4-bit cfg demoted to "fp8" the same options in `fp8_fmt` with 1x128 block scales."""
    if wire not in WIRES:
        raise Fp8CommError(f"unknown guard wire {wire!r}; valid: {', '.join(WIRES)}")
    if wire == "bf16":
        return None
    if wire == "fp8" and cfg.is_fp4:
        return cfg.replace(fmt=fp8_fmt, block_size=128, scaling="fp32", hadamard=0, hadamard_seed=0)
    return cfg


def _same_buckets(keys: list[str], group, device: torch.device) -> None:
    """Every rank must reduce the same bucket table, row for row: a clear error on every rank if the counts or the
    ordered keys (a digest) differ. Read on the host: this runs only in the steps that register new buckets."""
    n, digest = len(keys), zlib.crc32("\0".join(keys).encode())
    t = torch.tensor([n, -n, digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, lo, dhi, dlo = (int(v) for v in t.tolist())
    if hi != -lo:
        raise Fp8CommError(
            f"fp8comm guard: ranks registered different numbers of buckets (max {hi}, min {-lo}); "
            "every rank must make the same guarded collectives"
        )
    if dhi != -dlo:
        shown = keys if n <= 8 else keys[:8] + ["..."]
        raise Fp8CommError(
            f"fp8comm guard: ranks registered their {n} buckets in a different order or under different keys "
            f"(this rank: {shown}); the counts are summed row by row, so every rank must register the same keys "
            "in the same order (make the same guarded collectives in the same order)"
        )
