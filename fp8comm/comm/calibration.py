"""What the planner knows about a cluster: per-level link bandwidth and latency, per-format codec speed (a
`Calibration`), with its JSON form, the checks that refuse one taken elsewhere, and the codec's measurement.

A calibration is measured once per job (or ahead of time) and published by rank 0, so every rank plans from the same
numbers. It names the fp8comm version, the device kind and the ranks per node it was taken with; a file from another
version, device kind or ranks-per-node layout is refused (the codec speeds or the node-local links would be another
machine's); a different world size is accepted (the per-level figures do not depend on it). Links: `inter` is one
node's inter-node bandwidth (bytes/s per direction, all its NICs) and the latency of one step across nodes; `intra`
one rank's node-local bandwidth and latency; `node_local_cap` a node's node-local traffic in all (a shared host
bridge; None: no cap). Codec speeds are elements per second per rank (linkmodel.CodecSpeed).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .._version import __version__
from ..errors import Fp8CommConfigError
from . import linkmodel
from .config import WireConfig
from .linkmodel import CodecSpeed

FORMAT = "fp8comm-calibration"
BACKENDS = ("nccl", "gloo")
# the quantized wires the planner weighs (linkmodel's codec names) and the WireConfig each one is
WIRE_CONFIGS: dict[str, dict] = {
    "fp8": {"fmt": "e4m3", "scaling": "fp32"},
    "fp8_e8m0": {"fmt": "e4m3", "scaling": "e8m0"},
    "mxfp4": {"fmt": "mxfp4"},
    "nvfp4": {"fmt": "nvfp4"},
}
SPEED_KINDS = ("pack", "unpack_sum", "unpack", "residual")


def _err(msg: str) -> Fp8CommConfigError:
    return Fp8CommConfigError(f"calibration: {msg}")


def _positive(name: str, v: object, allow_zero: bool = False) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or v < 0
        or (v == 0 and not allow_zero)
    ):
        raise _err(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number, got {v!r}")
    return float(v)


def device_kind(device: torch.device | str) -> str:
    """'cpu', or 'cuda:<device name>' (the GPU model: codec speeds differ between models, not between indices)."""
    d = torch.device(device)
    if d.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(d)}"
    return d.type


@dataclass(frozen=True)
class Link:
    """One level's link: bandwidth in bytes/s per direction, latency in seconds per step."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        _positive("bandwidth", self.bandwidth)
        _positive("latency", self.latency, allow_zero=True)


@dataclass(frozen=True)
class Calibration:
    """Per-level links and per-codec speeds of one kind of machine (see the module's docstring). codecs: codec name
    (linkmodel.CODECS) -> speed, "*" for any codec not named; backend: what the engines' own collectives run on
    (nccl: NCCL's ring; gloo: torch's gloo calls); call_overhead: fixed seconds per quantized call, timed as one
    small gloo all_gather (calibrate.py; 0: not modelled); small_calls: "op/algo/codec" -> seconds one real call of
    that option took on a buffer of small_call_elems elements (comm/smallcalls.py; the model prefers it to
    call_overhead where it has one); large_calls: the same at large_call_elems (> small_call_elems; needs the small
    calls), which scale the option's prediction toward what a large call measured (planner.estimate);
    world_size: the world it was taken in (informational: never checked); source: where the numbers come from."""

    inter: Link
    intra: Link
    codecs: Mapping[str, CodecSpeed]
    device: str
    ranks_per_node: int
    backend: str = "nccl"
    node_local_cap: float | None = None
    call_overhead: float = 0.0
    small_calls: Mapping[str, float] = field(default_factory=dict)
    small_call_elems: int = 0
    large_calls: Mapping[str, float] = field(default_factory=dict)
    large_call_elems: int = 0
    version: str = __version__
    world_size: int | None = None
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.inter, Link) or not isinstance(self.intra, Link):
            raise _err("inter and intra must be Link(bandwidth, latency)")
        if self.backend not in BACKENDS:
            raise _err(f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise _err(f"ranks_per_node must be an int >= 1, got {self.ranks_per_node!r}")
        if not self.device or not isinstance(self.device, str):
            raise _err(f"device must name a device kind ('cpu', 'cuda:<name>'), got {self.device!r}")
        if self.node_local_cap is not None:
            _positive("node_local_cap", self.node_local_cap)
        _positive("call_overhead", self.call_overhead, allow_zero=True)
        for field_name in ("small_calls", "large_calls"):
            for k, v in getattr(self, field_name).items():
                _small_key(k, field_name)
                _positive(f"{field_name}[{k!r}]", v, allow_zero=field_name == "small_calls")
            e = getattr(self, field_name[:-1] + "_elems")
            if isinstance(e, bool) or not isinstance(e, int) or e < 0 or (getattr(self, field_name) and e < 1):
                raise _err(f"{field_name[:-1]}_elems must be an int >= 1 with {field_name} (0 without), got {e!r}")
            object.__setattr__(self, field_name, dict(getattr(self, field_name)))
        if self.large_calls and not (self.small_calls and self.large_call_elems > self.small_call_elems):
            raise _err(
                f"large_calls need small_calls of fewer elements (the model scales between the two sizes); got "
                f"{len(self.small_calls)} small calls of {self.small_call_elems} elements, large of "
                f"{self.large_call_elems}"
            )
        for name, s in self.codecs.items():
            if name != "*" and name not in WIRE_CONFIGS:
                raise _err(f"codec speed for unknown codec {name!r}; valid: {', '.join(WIRE_CONFIGS)}, '*'")
            if not isinstance(s, CodecSpeed):
                raise _err(f"codec {name!r}: a CodecSpeed is needed, got {type(s).__name__}")
            _check_speed(name, s)
        object.__setattr__(self, "codecs", dict(self.codecs))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    def speed(self, codec: str) -> CodecSpeed:
        s = self.codecs.get(codec) or self.codecs.get("*")
        if s is None:
            raise _err(f"no codec speed for {codec!r} (have: {', '.join(self.codecs) or 'none'})")
        return s

    def machine(self, nodes: int, ranks_per_node: int, name: str = "") -> linkmodel.Machine:
        """linkmodel's Machine for a group of `nodes` x `ranks_per_node` members on this calibration's links; the
        small calls only for the layout they were timed on (the world's; another layout's calls run other steps on
        other links: those charge call_overhead)."""
        same = self.timed_on(nodes, ranks_per_node)
        return linkmodel.Machine(
            name or f"{nodes}x{ranks_per_node} ({self.device})",
            ranks_per_node,
            nodes,
            self.inter.bandwidth,
            self.inter.latency,
            self.intra.bandwidth,
            self.intra.latency,
            dict(self.codecs),
            intra_node_bw=self.node_local_cap,
            call_overhead=self.call_overhead,
            small_calls=dict(self.small_calls) if same else {},
            small_elems=self.small_call_elems if same else 0,
            host_local=self.device_type == "cpu",  # CPU ranks copy node-local bytes themselves (loopback TCP)
            host_latency=self.device_type == "cpu",  # and their latency per step is their own wake-up
        )

    def timed_on(self, nodes: int, ranks_per_node: int) -> bool:
        """Whether the small and large calls were timed on this layout (the world's): only then do they apply."""
        return self.world_size == nodes * ranks_per_node and ranks_per_node == self.ranks_per_node

    def check(self, *, device: str | None = None, ranks_per_node: int | None = None) -> None:
        """Refuse this calibration where it was not taken: another fp8comm version, device kind or ranks per node
        (the world size may differ). Raises Fp8CommConfigError naming what differs and how to get a fitting one."""
        if self.version != __version__:
            raise _err(
                f"taken with fp8comm {self.version}, this is fp8comm {__version__}: the codecs may have changed; "
                "calibrate again (fp8comm calibrate)"
            )
        if device is not None and device != self.device:
            raise _err(f"taken on device kind {self.device!r}, this job runs on {device!r}: calibrate on this machine")
        if ranks_per_node is not None and ranks_per_node != self.ranks_per_node:
            raise _err(
                f"taken with {self.ranks_per_node} ranks per node, this job has {ranks_per_node}: the node-local "
                "links are shared differently; calibrate with this layout (the world size may differ, this may not)"
            )

    # ---------------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": self.version,
            "device": self.device,
            "backend": self.backend,
            "ranks_per_node": self.ranks_per_node,
            "world_size": self.world_size,
            "inter": {"bandwidth": self.inter.bandwidth, "latency": self.inter.latency},
            "intra": {"bandwidth": self.intra.bandwidth, "latency": self.intra.latency},
            "node_local_cap": self.node_local_cap,
            "call_overhead": self.call_overhead,
            "small_calls": dict(self.small_calls),
            "small_call_elems": self.small_call_elems,
            "large_calls": dict(self.large_calls),
            "large_call_elems": self.large_call_elems,
            "codecs": {k: _speed_dict(s) for k, s in self.codecs.items()},
            "source": self.source,
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(
        cls, d: Mapping, *, device: str | None = None, ranks_per_node: int | None = None, where: str = ""
    ) -> Calibration:
        """The calibration in `d` (to_dict's form), checked against this fp8comm version and, when given, this
        job's device kind and ranks per node (check()). Missing or malformed fields are errors naming the field."""
        at = f" ({where})" if where else ""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise _err(f'not an fp8comm calibration{at}: expected an object with "format": {FORMAT!r}')

        def get(m: Mapping, key: str, path: str = "") -> object:
            if not isinstance(m, Mapping) or key not in m:
                raise _err(f"field {path + key!r} missing{at}")
            return m[key]

        def num(m: Mapping, key: str, path: str = "") -> float:
            v = get(m, key, path)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _err(f"field {path + key!r}{at} must be a number, got {v!r}")
            return float(v)

        def text(key: str) -> str:
            v = get(d, key)
            if not isinstance(v, str):
                raise _err(f"field {key!r}{at} must be a string, got {v!r}")
            return v

        def obj(m: Mapping, key: str, path: str = "") -> Mapping:
            v = get(m, key, path)
            if not isinstance(v, Mapping):
                raise _err(f"field {path + key!r}{at} must be an object, got {v!r}")
            return v

        def link(key: str) -> Link:
            m = obj(d, key)
            return Link(num(m, "bandwidth", key + "."), num(m, "latency", key + "."))

        def speed(m: Mapping, p: str) -> CodecSpeed:
            above = None
            if m.get("above") is not None:
                b = obj(m, "above", p)
                lim = get(b, "numel", p + "above.")
                if isinstance(lim, bool) or not isinstance(lim, int) or lim < 1:
                    raise _err(f"field {p + 'above.numel'!r}{at} must be an int >= 1, got {lim!r}")
                above = (lim, speed(b, p + "above."))
            return CodecSpeed(
                num(m, "pack", p),
                num(m, "unpack_sum", p),
                num(m, "unpack", p),
                source=str(m.get("source", "")),
                residual=num(m, "residual", p) if "residual" in m else 0.0,
                fixed=num(m, "fixed", p) if "fixed" in m else 0.0,
                above=above,
            )

        codecs = {}
        for name, m in obj(d, "codecs").items():
            codecs[name] = speed(m, f"codecs.{name}.")
        rpn = get(d, "ranks_per_node")
        if isinstance(rpn, bool) or not isinstance(rpn, int):
            raise _err(f"field 'ranks_per_node'{at} must be an int, got {rpn!r}")
        cap = d.get("node_local_cap")
        cal = cls(
            inter=link("inter"),
            intra=link("intra"),
            codecs=codecs,
            device=text("device"),
            ranks_per_node=rpn,
            backend=text("backend"),
            node_local_cap=None if cap is None else num(d, "node_local_cap"),
            call_overhead=num(d, "call_overhead") if "call_overhead" in d else 0.0,
            small_calls={k: num(obj(d, "small_calls"), k, "small_calls.") for k in d.get("small_calls") or {}},
            small_call_elems=d.get("small_call_elems", 0),
            large_calls={k: num(obj(d, "large_calls"), k, "large_calls.") for k in d.get("large_calls") or {}},
            large_call_elems=d.get("large_call_elems", 0),
            version=text("version"),
            world_size=d.get("world_size"),
            source=str(d.get("source", "")),
            notes=tuple(d.get("notes", ())),
        )
        cal.check(device=device, ranks_per_node=ranks_per_node)
        return cal

    @classmethod
    def from_json(
        cls, text: str, *, device: str | None = None, ranks_per_node: int | None = None, where: str = ""
    ) -> Calibration:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise _err(f"not JSON{f' ({where})' if where else ''}: {e}") from None
        return cls.from_dict(d, device=device, ranks_per_node=ranks_per_node, where=where)

    @classmethod
    def load(cls, path: str | Path, *, device: str | None = None, ranks_per_node: int | None = None) -> Calibration:
        p = Path(path)
        if not p.is_file():
            raise _err(f"no such file: {p}")
        return cls.from_json(p.read_text(), device=device, ranks_per_node=ranks_per_node, where=str(p))


SMALL_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SMALL_ALGOS = ("gloo", "ring", "flat", "two_level")


def _small_key(k: object, field_name: str = "small_calls") -> None:
    """A small_calls (or large_calls) key names one option: op/algo/codec (comm/smallcalls.key)."""
    parts = k.split("/") if isinstance(k, str) else []
    ok = len(parts) == 3 and parts[0] in SMALL_OPS and parts[1] in SMALL_ALGOS
    if not ok or parts[2] not in (*WIRE_CONFIGS, "bf16", "fp32"):
        raise _err(
            f"{field_name} key {k!r}: expected op/algo/codec with op in {SMALL_OPS}, algo in {SMALL_ALGOS}, codec one "
            f"of {', '.join(WIRE_CONFIGS)}, bf16, fp32"
        )


def _check_speed(name: str, s: CodecSpeed) -> None:
    for k in SPEED_KINDS:
        _positive(f"codec {name!r} {k}", getattr(s, k), allow_zero=k == "residual")
    _positive(f"codec {name!r} fixed", s.fixed, allow_zero=True)
    if s.above is not None:
        at, b = s.above
        if isinstance(at, bool) or not isinstance(at, int) or at < 1 or not isinstance(b, CodecSpeed):
            raise _err(f"codec {name!r}: above must be (numel >= 1, CodecSpeed), got {s.above!r}")
        _check_speed(name, b)


def _speed_dict(s: CodecSpeed) -> dict:
    d: dict = {"pack": s.pack, "unpack_sum": s.unpack_sum, "unpack": s.unpack, "residual": s.residual}
    if s.fixed:
        d["fixed"] = s.fixed
    if s.above is not None:
        d["above"] = {"numel": s.above[0], **_speed_dict(s.above[1])}
    d["source"] = s.source
    return d


# ------------------------------------------------------------------------------------------- codec speeds
def speed_rows(speeds: Mapping[str, CodecSpeed]) -> list[tuple[str, float, str]]:
    """(name, value, unit) per codec and kind: the rows results_speeds reads back (a GPU script writes them into
    docs/results/gpu.json), speeds to 4 significant digits, the fixed cost per kernel call when measured."""
    out = []
    for codec, s in speeds.items():
        for kind in SPEED_KINDS:
            v = getattr(s, kind)
            if v:
                out.append((f"codec_{codec}_{kind}_elems_per_s", float(f"{v:.4g}"), "elements/s"))
        if s.fixed:
            out.append((f"codec_{codec}_fixed_s", float(f"{s.fixed:.4g}"), "s per codec kernel call"))
    return out


def results_speeds(rows: Iterable[Mapping], where: str = "") -> dict[str, CodecSpeed]:
    """Codec speeds from a results file's rows (docs/results/gpu.json's schema: {"name", "value", "unit", "date",
    "commit", "device"}): rows named `codec_<codec>_<pack|unpack_sum|unpack|residual>_elems_per_s` and, optional,
    `codec_<codec>_fixed_s`. A codec needs pack, unpack_sum and unpack; residual is optional. An error names the rows
    it looked for when none are there."""
    found: dict[str, dict[str, float]] = {}
    meta: dict[str, str] = {}
    for r in rows:
        name = str(r.get("name", ""))
        for codec in WIRE_CONFIGS:
            if name == f"codec_{codec}_fixed_s":
                found.setdefault(codec, {})["fixed"] = _positive(name, r.get("value"), allow_zero=True)
            for kind in SPEED_KINDS:
                if name == f"codec_{codec}_{kind}_elems_per_s":
                    found.setdefault(codec, {})[kind] = _positive(name, r.get("value"))
                    meta[codec] = f"{r.get('device', '?')}, {r.get('date', '?')}, commit {r.get('commit', '?')}"
    out = {}
    for codec, k in found.items():
        missing = [x for x in ("pack", "unpack_sum", "unpack") if x not in k]
        if missing:
            raise _err(f"{where or 'results'}: codec {codec!r} lacks rows for {', '.join(missing)}")
        out[codec] = CodecSpeed(
            k["pack"],
            k["unpack_sum"],
            k["unpack"],
            f"{where} ({meta[codec]})",
            k.get("residual", 0.0),
            k.get("fixed", 0.0),
        )
    if not out:
        raise _err(
            f"{where or 'results'} has no codec speed rows (codec_<{'|'.join(WIRE_CONFIGS)}>_<pack|unpack_sum|unpack>"
            "_elems_per_s); launch/gpu_ready_check.py's codec_speeds section writes them on a GPU"
        )
    return out


def measure_codecs(
    names: Iterable[str] = tuple(WIRE_CONFIGS),
    elems: int | tuple[int, int] = 1 << 22,
    chunks: int = 8,
    reps: int = 3,
    device: torch.device | str = "cpu",
    kinds: Iterable[str] = SPEED_KINDS,
    timings: dict | None = None,
    backend: str = "auto",
) -> dict[str, CodecSpeed]:
    """Each codec's pack, unpack_sum, unpack and residual speed here, in elements/s: `elems` bf16 elements in
    `chunks` destination chunks through the codec and kernel backend a collective of that size would use (one
    untimed call first: compiles and caches), median of `reps` timed calls. unpack_sum decodes one chunk into an
    fp32 sum per call, as a receiver does; residual is x - decode(pack(x)), as error feedback computes it.

    elems=(small, large): each kind timed at both sizes, the speed from the difference (elements per extra second:
    what a call's size adds, without its fixed cost), or from the large size alone where the large call takes less
    than 1.5x the small one (a fixed cost the difference would turn into noise). Kinds not in `kinds` are not timed:
    unpack is then set to unpack_sum's speed and residual to 0 (charged at unpack's), and the source says so.
    `timings`, when given, receives per codec the untimed first calls' seconds ("first_call_s"), the timed calls'
    seconds ("timed_s") and the fixed cost per call the two sizes give ("fixed_s", per kind). `backend`: the kernels
    to time ("auto": those a collective of that size runs; or one by name, as the collectives' `backend=`)."""
    dev = torch.device(device)
    sizes = (elems,) if isinstance(elems, int) else tuple(elems)
    kinds = tuple(kinds)
    if (
        len(sizes) not in (1, 2)
        or any(isinstance(n, bool) or not isinstance(n, int) or n < chunks for n in sizes)
        or (len(sizes) == 2 and sizes[0] >= sizes[1])
        or chunks < 1
        or reps < 1
    ):
        raise _err(
            f"need elems (an int, or (small, large) with small < large) >= chunks >= 1 and reps >= 1; got "
            f"elems={elems}, chunks={chunks}, reps={reps}"
        )
    bad = [k for k in kinds if k not in SPEED_KINDS]
    if bad or not {"pack", "unpack_sum"} <= set(kinds):
        raise _err(f"kinds must include pack and unpack_sum, from {', '.join(SPEED_KINDS)}; got {kinds}")
    out = {}
    for name in names:
        if name not in WIRE_CONFIGS:
            raise _err(f"unknown codec {name!r}; valid: {', '.join(WIRE_CONFIGS)}")
    for name in names:
        t: dict = {}
        out[name] = _measure(name, sizes, chunks, reps, dev, kinds, t, backend)
        if timings is not None:
            timings[name] = t
    return out


def _measure(
    name: str,
    sizes: tuple[int, ...],
    chunks: int,
    reps: int,
    dev: torch.device,
    kinds: tuple[str, ...] = SPEED_KINDS,
    timings: dict | None = None,
    backend: str = "auto",
) -> CodecSpeed:
    per: list[tuple[dict[str, tuple[float, int]], str]] = []
    t = timings if timings is not None else {}
    t.update(first_call_s=0.0, timed_s=0.0, fixed_s={})
    for n in sizes:
        per.append(_time_kinds(name, n, chunks, reps, dev, kinds, t, backend))
    speed: dict[str, float] = {}
    for kind in kinds:
        tl, nl = per[-1][0][kind]
        if len(per) == 2:
            ts, ns = per[0][0][kind]
            # the difference only where the larger size clearly adds time; else (a fixed cost that noise would
            # amplify) the large size's own rate, which is lower: never an optimistic speed from noise
            speed[kind] = (nl - ns) / (tl - ts) if tl >= 1.5 * ts else nl / max(tl, 1e-9)
            t["fixed_s"][kind] = max(0.0, ts - ns / speed[kind])
        else:
            speed[kind] = nl / max(tl, 1e-9)
    filled = [k for k in ("unpack", "residual") if k not in speed]
    speed.setdefault("unpack", speed["unpack_sum"])
    speed.setdefault("residual", 0.0)  # 0: charged at unpack's speed (linkmodel.CodecSpeed)
    kern = per[-1][1]
    how = f"{sizes[0]} elements" if len(sizes) == 1 else f"{sizes[0]} and {sizes[1]} elements, from the difference"
    untimed = f"; not timed: {', '.join(filled)} (unpack at unpack_sum's speed)" if filled else ""
    src = f"measured here ({device_kind(dev)}, {how}, kernel {kern}, {time.strftime('%Y-%m-%d %H:%M')}{untimed})"
    # two sizes: the fixed cost per kernel call, the mean intercept of the kinds timed (0 from one size)
    fixed = sum(t["fixed_s"].values()) / len(t["fixed_s"]) if t["fixed_s"] else 0.0
    return CodecSpeed(speed["pack"], speed["unpack_sum"], speed["unpack"], src, speed["residual"], fixed)


def _time_kinds(
    name: str,
    elems: int,
    chunks: int,
    reps: int,
    dev: torch.device,
    kinds: tuple[str, ...],
    t: dict,
    backend: str = "auto",
) -> tuple[dict[str, tuple[float, int]], str]:
    """{kind: (median seconds of one call, elements it handles)} at `elems`, and the kernel used."""
    codec = WireConfig(**WIRE_CONFIGS[name]).spec.codec
    k = codec.width(elems // chunks)
    # a private generator: calibration runs before the model is built and must not move the caller's random stream
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(chunks, k, device=dev, generator=gen).to(torch.bfloat16)
    lay = codec.layout((1,) * chunks, k)
    kern = codec.kernel(backend, dev, x.numel())
    buf = torch.empty(lay.total_bytes, dtype=torch.uint8, device=dev)
    one = codec.layout((1,), k)  # one received chunk: the first of buf
    acc = torch.zeros(1, k, dtype=torch.float32, device=dev)
    dst = torch.empty_like(x)
    res = torch.empty(chunks, k, dtype=torch.float32, device=dev)
    steps = {
        "pack": (lambda: codec.pack(x, lay, buf, rounding="nearest", seed=0, kernel=kern), x.numel()),
        "unpack_sum": (lambda: codec.unpack_sum(buf[: one.total_bytes], one, acc, kernel=kern), k),
        "unpack": (lambda: codec.unpack(buf, lay, dst, kernel=kern), x.numel()),
        "residual": (lambda: codec.residual(buf, lay, x, res, kernel=kern), x.numel()),
    }
    out = {}
    for kind in [k for k in SPEED_KINDS if k in kinds]:  # pack first: the others decode what it wrote
        fn, count = steps[kind]
        t0 = time.perf_counter()
        fn()  # untimed: compiles, caches
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        t["first_call_s"] += t1 - t0
        ts = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            ts.append(time.perf_counter() - t0)
        t["timed_s"] += time.perf_counter() - t1
        out[kind] = (sorted(ts)[len(ts) // 2], count)
    return out, str(kern)
