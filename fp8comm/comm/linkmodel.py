"""One byte and time model of a collective per level of a cluster of n nodes x g ranks, for fp8comm and its baselines.

bytes(op, algo, codec, g, n, elems) -> Levels: what one call puts on the inter-node links (per node) and on the
node-local links (per rank, per node); time(op, algo, codec, machine, elems) -> Estimate: seconds from per-level
bandwidth and latency, codec throughput and pipelining. Pure arithmetic, no torch.distributed: quantized chunk sizes
come from the real wire layouts (fp8comm.quant.layout.layout_of, fp8comm.quant.wire4.fp4_layout), so they are the
bytes fp8comm sends, alignment included. `python -m fp8comm.comm.linkmodel` prints the tables of docs/scaling.md.

Conventions (docs/scaling.md, "The byte model"): `elems` is the whole buffer every rank holds, the reduce-scatter's
input and the all-gather's output (its shard is elems / (g*n)); ranks are node-major (torchrun's order); every
pattern here is symmetric, so a node receives what it sends and "bytes" means one direction.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..quant.fp4 import MXFP4, NVFP4, Fp4Format
from ..quant.layout import align, layout_of
from ..quant.scaling import Scaling
from ..quant.wire4 import fp4_layout
from .pieces import plan_pieces

OPS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")
# gloo: torch's own call on the gloo backend; ring: NCCL's ring algorithm in node-major rank order; flat: fp8comm's
# flat call; two_level: fp8comm's hierarchical mode (node-local phase, then the rails).
ALGOS = ("gloo", "ring", "flat", "two_level")
_CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------------- codecs
@dataclass(frozen=True)
class Codec:
    """How elements travel: a plain dtype of `itemsize` bytes, an FP8 format with 1xB block `scaling`, or a 4-bit
    format `fp4`. chunk_bytes(elems, pieces) is exact: the bytes fp8comm's layout gives one destination chunk."""

    name: str
    itemsize: int = 0  # plain dtypes; FP8 codes are 1 byte, E2M1 codes half a byte
    scaling: Scaling | None = None
    fp4: Fp4Format | None = None

    @property
    def quantized(self) -> bool:
        return self.scaling is not None or self.fp4 is not None

    def chunk_bytes(self, elems: int, pieces: int = 1) -> int:
        """Bytes of one destination chunk of `elems` elements that travels in `pieces` pipelined pieces (each piece
        whole blocks with its own 16-byte-aligned sections, as fp8comm.comm.core cuts them)."""
        if elems <= 0:
            return 0
        if self.scaling is not None:
            cols = plan_pieces(elems, self.scaling.cols, None, _CPU, "nearest", pieces)
            return sum(layout_of((1,), b - a, self.scaling).total_bytes for a, b in cols)
        if self.fp4 is not None:
            lp = align(elems, self.fp4.block)  # the tail block travels zero-padded (core._rows4)
            p = 1 if self.fp4.two_level else pieces  # NVFP4's per-chunk tensor scale spans the row (core._pieces4)
            cols = plan_pieces(lp, self.fp4.block, None, _CPU, "nearest", p)
            return sum(fp4_layout((1,), b - a, self.fp4).total_bytes for a, b in cols)
        return elems * self.itemsize

    @property
    def per_element(self) -> float:
        """Bytes per element of a long chunk (alignment amortized): 1 + 4/128 for FP8 with fp32 1x128 scales."""
        if self.scaling is not None:
            return 1 + self.scaling.scale_bytes / (self.scaling.cols or 1)
        if self.fp4 is not None:
            return 0.5 + 1 / self.fp4.block
        return float(self.itemsize)


CODECS = {
    "bf16": Codec("bf16", 2),
    "fp32": Codec("fp32", 4),
    "fp8": Codec("fp8", scaling=Scaling(1, 128, "fp32")),  # E4M3 (or E5M2: same bytes), 1x128 fp32 scales
    "fp8_e8m0": Codec("fp8_e8m0", scaling=Scaling(1, 128, "e8m0")),  # 1x128 one-byte power-of-two scales
    "mxfp4": Codec("mxfp4", fp4=MXFP4),  # E2M1 + one E8M0 byte per 1x32
    "nvfp4": Codec("nvfp4", fp4=NVFP4),  # E2M1 + one E4M3 byte per 1x16 + an fp32 per chunk (16-byte section)
}


def codec_of(codec: str | Codec) -> Codec:
    if isinstance(codec, Codec):
        return codec
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; valid: {', '.join(CODECS)}")
    return CODECS[codec]


# ------------------------------------------------------------------------------------------------------ bytes
@dataclass(frozen=True)
class Levels:
    """Bytes one call sends per level, one direction: inter_node = over one node's inter-node links (all its NICs),
    inter_rank / intra_rank = by the busiest rank off-node / to its own node, intra_node = node-local in all,
    sent_rank = by the busiest rank to all others (what fp8comm's comm_stats() counts as wire_bytes)."""

    inter_node: int = 0
    inter_rank: int = 0
    intra_rank: int = 0
    intra_node: int = 0
    sent_rank: int = 0

    def __add__(self, o: Levels) -> Levels:
        return Levels(*(a + b for a, b in zip(self.as_tuple(), o.as_tuple())))

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.inter_node, self.inter_rank, self.intra_rank, self.intra_node, self.sent_rank)


def _ring(g: int, n: int, chunk: int, rounds: int) -> Levels:
    """`rounds` passes of a ring over w = g*n ranks in node-major order moving `chunk` bytes per rank per step:
    w-1 steps a pass; of the w ring edges n cross nodes (one per node), the other g-1 per node stay inside."""
    w = g * n
    per_rank = rounds * (w - 1) * chunk
    if w == 1:
        return Levels()
    if n == 1:  # one node: every edge is node-local
        return Levels(0, 0, per_rank, g * per_rank, per_rank)
    local = per_rank if g > 1 else 0  # the g-1 ranks whose right neighbour is on the node
    return Levels(per_rank, per_rank, local, (g - 1) * per_rank, per_rank)


def _direct(g: int, n: int, chunk: int) -> Levels:
    """Every rank sends one `chunk` straight to each other rank (all_to_all): g*(n-1) off-node, g-1 on-node."""
    w = g * n
    return Levels(g * g * (n - 1) * chunk, g * (n - 1) * chunk, (g - 1) * chunk, g * (g - 1) * chunk, (w - 1) * chunk)


def _check(op: str, algo: str, g: int, n: int, elems: int) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")
    if algo not in ALGOS:
        raise ValueError(f"unknown algo {algo!r}; valid: {', '.join(ALGOS)}")
    if g < 1 or n < 1 or elems < 0:
        raise ValueError(f"need g >= 1, n >= 1, elems >= 0; got g={g}, n={n}, elems={elems}")


def _local(op: str, codec: Codec, local: str | Codec | None, dtype: str) -> Codec:
    """The two-level node-local codec: fp8comm's unless given (reduce-scatter: the input dtype; all-gather: the
    wire's packed bytes, gathered as they are)."""
    if local is not None:
        return codec_of(local)
    return codec_of(dtype) if op == "reduce_scatter" else codec


def bytes(
    op: str,
    algo: str,
    codec: str | Codec,
    g: int,
    n: int,
    elems: int,
    pieces: int = 1,
    local: str | Codec | None = None,
    dtype: str = "bf16",
) -> Levels:
    """Bytes per level of one `op` over n nodes x g ranks, `elems` elements per rank (the whole buffer: the
    reduce-scatter's input, the all-gather's output; all_to_all: every rank's tokens, equal splits).

    codec: what crosses the links (a plain dtype for gloo/ring, quantized for fp8comm's calls). pieces: pipelined
    pieces per quantized phase (only alignment depends on it). local: the two-level node-local codec (default
    fp8comm's: the input `dtype` for reduce-scatter, the wire's packed bytes for all-gather; a quantized one means
    a flat quantized reduce-scatter inside the node, then a second quantization for the rails)."""
    _check(op, algo, g, n, elems)
    c = codec_of(codec)
    w = g * n
    L = -(-elems // w) if elems else 0  # elements per chunk (fp8comm pads the buffer to w*L)
    if op == "all_reduce":  # every algorithm here: a reduce-scatter, then an all-gather of the reduced chunks
        if algo == "gloo" or (algo == "ring" and not c.quantized):
            return _ring(g, n, c.chunk_bytes(L), 2)  # ring all-reduce = ring RS + ring AG (gloo's default too)
        rs = bytes("reduce_scatter", algo, c, g, n, elems, pieces, local, dtype)
        return rs + bytes("all_gather", algo, c, g, n, elems, pieces, local, dtype)
    if op == "all_to_all":
        if algo not in ("flat", "gloo"):
            raise ValueError(f"all_to_all is modelled flat (fp8comm's) or as torch's gloo call, not {algo!r}")
        return _direct(g, n, c.chunk_bytes(L, pieces))  # gloo's alltoall is direct pairwise sends too
    if algo == "gloo":
        if c.quantized:
            raise ValueError("algo 'gloo' is torch's call in a plain dtype; quantized calls are 'flat'/'two_level'")
        # torch's ProcessGroupGloo.reduce_scatter_tensor clones the input, ALL-REDUCES it (gloo's ring) and keeps
        # its own chunk: twice the ring's bytes (node-0 link 25.2 vs 12.6 MB at 2x2, SIMULATED). all_gather: ring.
        return _ring(g, n, c.chunk_bytes(L), 2 if op == "reduce_scatter" else 1)
    if algo == "ring":
        if c.quantized and op == "reduce_scatter":
            raise ValueError("a quantized ring reduce-scatter would re-quantize at every hop; not modelled")
        return _ring(g, n, c.chunk_bytes(L, pieces), 1)
    if algo == "flat":
        if op == "reduce_scatter":
            return _direct(g, n, c.chunk_bytes(L, pieces))  # one all_to_all_single of every rank's w-1 chunks
        # fp8comm's flat all-gather is the backend's all_gather of the packed shard: a ring on gloo and on NCCL
        # (measured: FP8 flat 7.6 MB at 2x4 = 7 shards; an all-to-all would put 16 shards, 17.3 MB, on the link)
        return _ring(g, n, c.chunk_bytes(L, pieces), 1)
    # two_level
    lc = _local(op, c, local, dtype)
    if op == "reduce_scatter":
        # node-local: the w chunks grouped by local index, each rank receives the n chunks of its rail from every
        # node-mate ((g-1) x n*L elements; fp8comm: one all_to_all in the input dtype, fp32 sum; a ring moves
        # the same (g-1)/g of the buffer); a quantized local codec: a flat quantized reduce-scatter in the node
        if lc.quantized:
            loc = _direct(g, 1, lc.chunk_bytes(n * L, pieces))
        else:
            loc = _ring(g, 1, lc.chunk_bytes(n * L), 1)
        rails = _direct(1, n, c.chunk_bytes(L, pieces))  # my rail: n-1 quantized chunks of L
        return loc + Levels(g * rails.inter_node, rails.inter_rank, 0, 0, rails.sent_rank)
    # all_gather: the rails gather every node's shard (ring over n), then the node gathers n shards per rank
    rails = _ring(1, n, c.chunk_bytes(L, pieces), 1)
    if lc.quantized:
        per = (g - 1) * n * lc.chunk_bytes(L, pieces)  # fp8comm: the same packed bytes, gathered inside the node
    else:
        per = (g - 1) * n * lc.chunk_bytes(L)  # decoded first, then gathered in a plain dtype
    return Levels(g * rails.inter_node, rails.inter_rank, per, g * per, rails.sent_rank + per)


# ------------------------------------------------------------------------------------------------------- time
@dataclass(frozen=True)
class CodecSpeed:
    """One rank's codec throughput in ELEMENTS per second: pack (quantize + pack), unpack_sum (decode a received
    chunk and add it to an fp32 sum), unpack (decode into the output dtype), residual (error feedback: decode what
    this rank packed and subtract it from its input; 0 = not measured, charged at `unpack`'s speed, the decode
    being most of it). `source` says where they come from."""

    pack: float
    unpack_sum: float
    unpack: float
    source: str = ""
    residual: float = 0.0
    # seconds each codec kernel call costs beyond its elements (the intercept of two timed sizes: launches, Python,
    # allocation), charged per codec stage per piece; 0: not modelled
    fixed: float = 0.0
    # (numel, speeds): calls whose kernel is chosen from at least `numel` elements run at these speeds (another
    # kernel: on CPU, FP8 from dispatch.COMPILE_MIN_NUMEL runs compiled, not the torch reference; or timed with every
    # rank at once); None: these speeds at every size
    above: tuple[int, CodecSpeed] | None = None

    @property
    def residual_speed(self) -> float:
        return self.residual or self.unpack

    def at(self, numel: int | None) -> CodecSpeed:
        """The speeds of the kernel a call chosen from `numel` elements runs (self unless `above` applies)."""
        if self.above is not None and numel is not None and numel >= self.above[0]:
            return self.above[1].at(numel)
        return self


@dataclass(frozen=True)
class Machine:
    """A cluster: n nodes x g ranks; inter = one node's inter-node bandwidth (bytes/s per direction, all NICs) and
    latency per step; intra = one rank's node-local bandwidth and latency; intra_node_bw caps a node's node-local
    traffic in all (a shared host bridge; None: no cap); codec speeds per codec name ("*" = any other);
    call_overhead: seconds a quantized call costs beyond its stages (fixed per call, again for each further
    piece; what its first piece's work before the wire does not hide); small_calls: per option (op/algo/codec), a
    real call's seconds at small_elems, which replaces call_overhead for that option."""

    name: str
    g: int
    n: int
    inter_bw: float
    inter_lat: float
    intra_bw: float
    intra_lat: float
    codecs: dict[str, CodecSpeed] = field(default_factory=dict, compare=False)
    intra_node_bw: float | None = None
    note: str = ""
    call_overhead: float = 0.0  # seconds per quantized call beyond its stages, added once; 0 = not modelled
    # "op/algo/codec" -> seconds one real call of that option took on small_elems elements (calibrate's small calls):
    # a call of that option is charged what the small one took beyond the model's stages for it (not call_overhead)
    small_calls: dict[str, float] = field(default_factory=dict, compare=False)
    small_elems: int = 0
    # node-local transfers are copies made by the cores that run the codecs (CPU ranks: loopback TCP), so the
    # node-local wire and codec work cannot overlap; False: a separate engine moves them (NVLink, PCIe DMA)
    host_local: bool = False
    # the cross-node latency per step is the ranks' own wake-up on shared cores (CPU ranks), and the kernel keeps
    # the link busy with bytes already handed to it meanwhile: that level's wire time is the LONGER of its bytes
    # and its steps' latency, not their sum; False: a step's latency is the network's own (the alpha-beta sum)
    host_latency: bool = False

    def speed(self, codec: Codec) -> CodecSpeed:
        s = self.codecs.get(codec.name) or self.codecs.get("*")
        if s is None:
            raise ValueError(f"machine {self.name!r} has no codec speed for {codec.name!r}")
        return s

    def wire_s(self, lv: Levels, steps: int) -> float:
        """Seconds to move `lv`: the levels run at once, each its bytes / bandwidth plus `steps` times its latency
        (a ring's w-1 steps, an all-to-all's one); the slowest level decides. (A ring step on a slow link is not
        also charged the node-local latency: the node-local edges of that step finish meanwhile.) host_latency:
        the cross-node level takes the longer of its bytes and its latency instead of their sum."""
        t = 0.0
        if lv.inter_node:
            b, a = lv.inter_node / self.inter_bw, steps * self.inter_lat
            t = max(t, max(a, b) if self.host_latency else a + b)
        if lv.intra_rank:
            t = max(t, lv.intra_rank / self.intra_bw + steps * self.intra_lat)
        if lv.intra_node and self.intra_node_bw:
            t = max(t, lv.intra_node / self.intra_node_bw + steps * self.intra_lat)
        return t


@dataclass(frozen=True)
class Estimate:
    """A call's predicted seconds and its stages (name, seconds of all pieces together). Stages on one resource
    (RESOURCES: a rank's codec work runs on one thread/stream, each link level moves its own bytes) add up; with P
    pieces the resources overlap: seconds = max(resource) + (sum(stages) - max(resource)) / P, the second term the
    first (and last) piece's cost that nothing hides; P = 1 is the plain sum. measured_scale: the factor a
    calibration's large real call of this option set on `seconds` (planner.anchored; 1: none)."""

    seconds: float
    stages: tuple[tuple[str, float], ...]
    levels: Levels
    pieces: int
    resources: tuple[tuple[str, float], ...] = ()
    measured_scale: float = 1.0


# stage -> what runs it: codec stages on the rank's compute (one thread on CPU, one stream on GPUs: pack, sum and
# decode of different pieces do not run at once), the wires on their links
RESOURCES = {"wire": "link", "rails wire": "link", "local wire": "local link"}


def time(
    op: str,
    algo: str,
    codec: str | Codec,
    m: Machine,
    elems: int,
    pieces: int = 1,
    local: str | Codec | None = None,
    dtype: str = "bf16",
    feedback: bool = False,
    gather_pieces: int | None = None,
) -> Estimate:
    """Predicted seconds of one `op` (bytes()'s arguments, g and n from m) on machine m; codec work is charged per
    rank at m's codec speeds; reductions inside the plain-dtype collectives (NCCL, gloo) are free (in-kernel,
    memory-bound). pieces > 1: the stages are pipelined (Estimate's formula), each piece pays the latency and the
    call's fixed cost again.
    feedback: error feedback on the reduce-scatter's quantization (a "residual" stage over the elements this rank
    quantizes for the wire, at CodecSpeed.residual_speed). A quantized all_reduce is its two phases one after the
    other (the all-gather starts from the reduce-scatter's sum), the all-gather's cut into gather_pieces (None: as
    many as the reduce-scatter's), the call's fixed cost charged with its reduce-scatter phase (per piece, as a
    reduce-scatter's) or, where the machine has an all_reduce small call, that call's extra once."""
    c = codec_of(codec)
    if op == "all_reduce" and c.quantized:
        extra = _small_extra(op, algo, c, m, local)
        once = replace(m, call_overhead=0.0, small_calls={})  # the call's fixed cost is charged once
        a = time("reduce_scatter", algo, c, m if extra is None else once, elems, pieces, local, dtype, feedback)
        b = time("all_gather", algo, c, once, elems, gather_pieces or pieces, local, dtype)
        gather = tuple((f"gather {k}", v) for k, v in b.stages)
        return Estimate(
            a.seconds + b.seconds + (extra or 0.0),
            a.stages + gather,
            a.levels + b.levels,
            pieces,
            a.resources + b.resources,
        )
    g, n, w = m.g, m.n, m.g * m.n
    lv = bytes(op, algo, c, g, n, elems, pieces, local, dtype)
    L = -(-elems // w) if elems else 0
    st: list[tuple[str, float]] = []

    def wire(name: str, levels: Levels, steps: int) -> None:
        st.append((name, m.wire_s(levels, steps * pieces)))

    def work(name: str, cc: Codec, kind: str, count: int, numel: int | None = None, calls: bool = True) -> None:
        # numel: the elements the call's kernel is chosen from (as comm/core.py and comm/levels.py choose it);
        # calls: the stage is codec kernel calls (once per piece: CodecSpeed.fixed each), not a plain-dtype sum
        if cc.quantized and count:
            s = m.speed(cc).at(numel)
            st.append((name, count / getattr(s, kind) + (max(pieces, 1) * s.fixed if calls else 0.0)))

    def split(levels: Levels) -> tuple[Levels, Levels]:  # (the rails' part, the node-local part)
        return (
            Levels(levels.inter_node, levels.inter_rank, 0, 0, levels.inter_rank),
            Levels(0, 0, levels.intra_rank, levels.intra_node, levels.intra_rank),
        )

    def rs() -> None:
        if algo == "flat":
            work("pack", c, "pack", w * L, w * L)
            if feedback:
                work("residual", c, "residual_speed", w * L, w * L)
            wire("wire", bytes("reduce_scatter", algo, c, g, n, elems, pieces), 1)
            work("unpack_sum", c, "unpack_sum", w * L, w * L)
            return
        lc = _local("reduce_scatter", c, local, dtype)
        rails, loc = split(bytes("reduce_scatter", algo, c, g, n, elems, pieces, local, dtype))
        work("local pack", lc, "pack", w * L, w * L)
        wire("local wire", loc, 1)  # one all_to_all inside the node
        # the receiver's fp32 sum of g chunks of n*L: charged at the decode-and-add speed (a plain dtype too)
        work("local sum", lc if lc.quantized else c, "unpack_sum", n * L * g if g > 1 else 0, n * L, lc.quantized)
        work("pack", c, "pack", n * L, n * L)
        if feedback:  # the residual covers the rail quantization: the n*L partial sums this rank sends
            work("residual", c, "residual_speed", n * L, n * L)
        wire("rails wire", rails, 1)
        work("unpack_sum", c, "unpack_sum", n * L, n * L)

    def ag() -> None:
        work("pack", c, "pack", L, L)
        if algo in ("flat", "ring"):  # the backend's all_gather of the packed shard: a ring
            wire("wire", bytes("all_gather", algo, c, g, n, elems, pieces), w - 1)
            work("unpack", c, "unpack", w * L, w * L)
            return
        lc = _local("all_gather", c, local, dtype)
        rails, loc = split(bytes("all_gather", algo, c, g, n, elems, pieces, local, dtype))
        wire("rails wire", rails, n - 1)
        if not lc.quantized:
            work("unpack", c, "unpack", n * L, w * L)  # decoded once, gathered inside the node in the plain dtype
        wire("local wire", loc, g - 1)
        if lc.quantized:
            work("unpack", c, "unpack", w * L, w * L)

    if op == "all_to_all":
        work("pack", c, "pack", w * L, w * L)
        wire("wire", lv, 1)
        work("unpack", c, "unpack", w * L, w * L)
    elif algo == "gloo" or (algo == "ring" and not c.quantized):
        rounds = 2 if op == "all_reduce" or (algo == "gloo" and op == "reduce_scatter") else 1
        wire("wire", lv, rounds * (w - 1))
    else:
        if op in ("reduce_scatter", "all_reduce"):
            rs()
        if op in ("all_gather", "all_reduce"):
            ag()
    res: dict[str, float] = {}
    for name, s in st:
        r = RESOURCES.get(name, "compute")
        r = "compute" if m.host_local and r == "local link" else r
        res[r] = res.get(r, 0.0) + s
    total = sum(s for _, s in st)
    peak = max(res.values(), default=0.0)
    # call_overhead: a quantized call's fixed cost, timed as the metadata check's gather. Where the check runs it
    # travels while the first piece is prepared (comm/core.py and comm/levels.py settle it just before the first
    # quantized piece goes on the wire): only the rest shows. Calls past the check (policy "first") are charged the
    # same: they measured a fixed cost of about its size (docs/planner.md, "What call_overhead stands for"). Each
    # further piece is its own collectives and pays that fixed cost again (docs/planner.md, "Each piece's fixed cost")
    again = max(pieces, 1) - 1
    extra = _small_extra(op, algo, c, m, local)
    if extra is not None:
        host = extra * (1 + again)
    else:
        first = next((i for i, (name, _) in enumerate(st) if RESOURCES.get(name) == "link"), len(st))
        lead = sum(s for _, s in st[:first]) / max(pieces, 1)
        host = max(0.0, m.call_overhead - lead) + m.call_overhead * again if c.quantized else 0.0
    return Estimate(host + peak + (total - peak) / max(pieces, 1), tuple(st), lv, pieces, tuple(res.items()))


def _small_extra(op: str, algo: str, c: Codec, m: Machine, local: str | Codec | None) -> float | None:
    """What this option's small real call took beyond the model's own stages for it (never less than nothing), or
    None where the machine has no small call for it. The stages are the measured call's: bf16 input (fp32 for the
    engine's own fp32 call), one piece."""
    small = m.small_calls.get(f"{op}/{algo}/{c.name}") if m.small_elems else None
    if small is None:
        return None
    bare = replace(m, call_overhead=0.0, small_calls={})
    dtype = "fp32" if c.name == "fp32" else "bf16"
    return max(0.0, small - time(op, algo, c, bare, m.small_elems, 1, local, dtype).seconds)


# --------------------------------------------------------------------------------- measured checks, projections
MiB = 1 << 20


@dataclass(frozen=True)
class Measured:
    """A link counter measured on the simulated cluster (docs/benchmarks.md): MB (1e6 bytes) that node 0's eth0
    sent in one call, TCP/IP included, for `op` by `algo` in `codec` on n nodes x g ranks, `elems` per rank."""

    label: str
    op: str
    algo: str
    codec: str
    g: int
    n: int
    elems: int
    mb: float
    source: str
    pieces: int = 1  # the pieces fp8comm's CPU pipelining cut that call into (alignment only)

    def model_mb(self) -> float:
        return bytes(self.op, self.algo, self.codec, self.g, self.n, self.elems, self.pieces).inter_node / 1e6


_ISSUE = "issue 28 (simulated cluster, 1 Gbit/s, 16 MiB of bf16 per rank)"
_RUN_T = "docs/results/bench_comm_200mbit.json (2026-12-03, 2x4, 200 Mbit/s, 16 MiB of bf16 per rank)"
_RUN_E = "docs/benchmarks.md run E (2026-11-30, commit 388c985, 32 MiB per rank; all-gather: 32 MiB shard)"
SIMULATED = (
    Measured("reduce_scatter, bf16 ring", "reduce_scatter", "ring", "bf16", 2, 2, 8 * MiB, 12.6, _ISSUE),
    Measured("reduce_scatter, bf16 ring", "reduce_scatter", "ring", "bf16", 4, 2, 8 * MiB, 14.7, _ISSUE),
    Measured("reduce_scatter, torch gloo bf16", "reduce_scatter", "gloo", "bf16", 2, 2, 8 * MiB, 25.2, _ISSUE),
    Measured("reduce_scatter, torch gloo bf16", "reduce_scatter", "gloo", "bf16", 4, 2, 8 * MiB, 29.5, _ISSUE),
    Measured("reduce_scatter, FP8 flat", "reduce_scatter", "flat", "fp8", 2, 2, 8 * MiB, 8.7, _ISSUE, 4),
    Measured("reduce_scatter, FP8 flat", "reduce_scatter", "flat", "fp8", 4, 2, 8 * MiB, 17.4, _ISSUE, 4),
    Measured("reduce_scatter, FP8 two-level", "reduce_scatter", "two_level", "fp8", 2, 2, 8 * MiB, 4.3, _ISSUE),
    Measured("reduce_scatter, FP8 two-level", "reduce_scatter", "two_level", "fp8", 4, 2, 8 * MiB, 4.3, _ISSUE),
    Measured("reduce_scatter, MXFP4 flat", "reduce_scatter", "flat", "mxfp4", 2, 2, 8 * MiB, 4.5, _ISSUE, 4),
    Measured("reduce_scatter, MXFP4 flat", "reduce_scatter", "flat", "mxfp4", 4, 2, 8 * MiB, 9.0, _ISSUE, 4),
    # all-gather: the issue's 16 MiB is the gathered buffer (shard 2 MiB); see docs/scaling.md
    Measured("all_gather, FP8 flat", "all_gather", "flat", "fp8", 4, 2, 8 * MiB, 7.6, _ISSUE),
    Measured("all_gather, FP8 two-level", "all_gather", "two_level", "fp8", 4, 2, 8 * MiB, 4.3, _ISSUE),
    Measured("all_gather, bf16 ring", "all_gather", "ring", "bf16", 4, 2, 8 * MiB, 14.7, _ISSUE),
    # the 4-bit wire in two levels (refused when the issue was measured) and flat, 2x4 at 200 Mbit/s
    Measured("reduce_scatter, MXFP4 two-level", "reduce_scatter", "two_level", "mxfp4", 4, 2, 8 * MiB, 2.25, _RUN_T),
    Measured("all_gather, MXFP4 two-level", "all_gather", "two_level", "mxfp4", 4, 2, 8 * MiB, 2.25, _RUN_T),
    Measured("all_gather, MXFP4 flat", "all_gather", "flat", "mxfp4", 4, 2, 8 * MiB, 3.92, _RUN_T),
    Measured("reduce_scatter, torch gloo bf16", "reduce_scatter", "gloo", "bf16", 2, 2, 16 * MiB, 50.4, _RUN_E),
    Measured("reduce_scatter, torch gloo fp32", "reduce_scatter", "gloo", "fp32", 2, 2, 16 * MiB, 100.9, _RUN_E),
    Measured("reduce_scatter, FP8 flat", "reduce_scatter", "flat", "fp8", 2, 2, 16 * MiB, 17.3, _RUN_E, 8),
    Measured("reduce_scatter, FP8 two-level", "reduce_scatter", "two_level", "fp8", 2, 2, 16 * MiB, 8.7, _RUN_E),
    Measured("all_gather, torch gloo bf16", "all_gather", "gloo", "bf16", 2, 2, 64 * MiB, 100.9, _RUN_E),
    Measured("all_gather, FP8 flat", "all_gather", "flat", "fp8", 2, 2, 64 * MiB, 52.0, _RUN_E, 8),
    Measured("all_to_all, torch gloo bf16", "all_to_all", "gloo", "bf16", 2, 2, 16 * MiB, 33.6, _RUN_E),
    Measured("all_to_all, FP8 flat", "all_to_all", "flat", "fp8", 2, 2, 16 * MiB, 17.3, _RUN_E, 8),
)


def gpu_speeds() -> dict[str, CodecSpeed]:
    """Per-rank codec speeds of one H200. FP8 pack, unpack and unpack_sum: docs/benchmarks.md "GPU (H200):
    quantize+pack vs device copy" (256 MiB, CUDA-graph replay, 2026-11-30; the 2026-12-04 run agrees within 4%),
    converted from GB/s (bytes read + written) to elements/s by the bytes per element launch/device_check.py
    counts: pack 2 + 1 + 4/128 (fp32 scales) or 2 + 1 + 1/128 (e8m0), unpack to bf16 1 + 4/128 + 2, unpack_sum over
    8 chunks 1 + 4/128 + 4/8. Error-feedback residuals and every 4-bit speed: docs/results/gpu.json's codec rows
    (gpu_ready_check.py codec_speeds: 4-bit 2026-12-04 14:22 UTC at commit bd13a54, the fused 4-bit wire kernels;
    FP8 residuals 14:34 UTC at d695f05, the one-pass FP8 residual; 2^25 and 2^28 elements, from the difference; its
    unpack_sum decodes one chunk per call). Fixed costs per call are not included (see docs/scaling.md, "What is
    not modelled")."""
    src = "H200, measured (docs/benchmarks.md, 256 MiB; residual: docs/results/gpu.json 2026-12-04)"
    fp8 = CodecSpeed(
        2322e9 / (3 + 4 / 128), 2946e9 / (1 + 4 / 128 + 4 / 8), 3859e9 / (3 + 4 / 128), src, residual=525.2e9
    )
    e8m0 = CodecSpeed(
        3226e9 / (3 + 1 / 128),
        fp8.unpack_sum,
        fp8.unpack,
        src + "; decode: assumed = fp32 scales'",
        residual=574.8e9,
    )
    src4 = "H200, measured (docs/results/gpu.json, 2026-12-04, commit bd13a54)"
    mxfp4 = CodecSpeed(496.2e9, 323.9e9, 387.2e9, src4, residual=558.6e9)
    nvfp4 = CodecSpeed(105.0e9, 345.3e9, 368.3e9, src4, residual=571.0e9)
    return {"fp8": fp8, "fp8_e8m0": e8m0, "mxfp4": mxfp4, "nvfp4": nvfp4}


# Three real shapes, 8 nodes x 8 GPUs each. Bandwidths are nominal link rates per direction; latencies are
# assumptions (they barely matter at the projected size). Sources: docs/scaling.md, "Projections".
SHAPES = (
    Machine(
        "a: NVLink, 8x400 Gb/s rails",
        8,
        8,
        8 * 400e9 / 8,
        5e-6,
        450e9,
        2e-6,
        gpu_speeds(),
        note="8 NICs of 400 Gb/s per node (one per GPU); NVLink 900 GB/s per GPU = 450 GB/s per direction",
    ),
    Machine(
        "b: NVLink, 100 Gb/s per node",
        8,
        8,
        100e9 / 8,
        5e-6,
        450e9,
        2e-6,
        gpu_speeds(),
        note="one 100 Gb/s NIC per node; NVLink as in (a)",
    ),
    Machine(
        "c: PCIe, 100 Gb/s per node",
        8,
        8,
        100e9 / 8,
        5e-6,
        25e9,
        5e-6,
        gpu_speeds(),
        intra_node_bw=50e9,
        note="no NVLink: ~25 GB/s per GPU (PCIe Gen4 x16), node-local traffic capped at 50 GB/s per node "
        "(ASSUMED: two host bridges of ~25 GB/s shared by 4 GPUs each); one 100 Gb/s NIC",
    ),
)
# (label, algo, codec, local, pieces): the choices a planner weighs, the engine's own (NCCL's ring) first.
CHOICES = (
    ("NCCL ring, bf16", "ring", "bf16", None, 1),
    ("flat FP8", "flat", "fp8", None, 1),
    ("two-level FP8", "two_level", "fp8", None, 1),
    ("two-level FP8, 8 pieces", "two_level", "fp8", None, 8),
    ("two-level FP8, FP8 in the node", "two_level", "fp8", "fp8", 1),
    ("two-level MXFP4", "two_level", "mxfp4", None, 1),
)
PROJECTED_ELEMS = 64 * MiB  # one 128 MiB bf16 bucket per rank (the whole buffer; the shard is 1/64 of it)


def check_table() -> str:
    """The measured link counters beside the model (docs/scaling.md's check table)."""
    out = [
        "| measurement | nodes x ranks | elems/rank | model MB | measured MB | measured/model |",
        "|---|---|---|---|---|---|",
    ]
    for r in SIMULATED:
        m = r.model_mb()
        out.append(f"| {r.label} | {r.n}x{r.g} | {r.elems // MiB} Mi | {m:.2f} | {r.mb} | {r.mb / m:.3f} |")
    return "\n".join(out)


def bytes_table(g: int = 8, n: int = 8, elems: int = PROJECTED_ELEMS) -> str:
    """Inter-node MB per node and node-local MB per rank of each choice (no link speed involved)."""
    out = [
        f"| op ({n} nodes x {g}, {elems // MiB} Mi bf16 elements per rank) | "
        + " | ".join(c[0] for c in CHOICES if c[4] == 1)
        + " |",
        "|---" * (1 + sum(c[4] == 1 for c in CHOICES)) + "|",
    ]
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        cells = []
        for _, algo, codec, local, pieces in CHOICES:
            if pieces == 1:
                lv = bytes(op, algo, codec, g, n, elems, pieces, local)
                cells.append(f"{lv.inter_node / 1e6:.0f} / {lv.intra_rank / 1e6:.0f}")
        out.append(f"| {op}: inter MB/node / local MB/rank | " + " | ".join(cells) + " |")
    return "\n".join(out)


def projection_table(elems: int = PROJECTED_ELEMS) -> str:
    """Predicted ms per call on SHAPES for each choice, and its gain over NCCL's bf16 ring."""
    out = [
        "| shape | op | " + " | ".join(c[0] for c in CHOICES) + " | best |",
        "|---" * (len(CHOICES) + 3) + "|",
    ]
    for m in SHAPES:
        for op in ("reduce_scatter", "all_gather", "all_reduce"):
            ts = [time(op, algo, codec, m, elems, pieces, local).seconds for _, algo, codec, local, pieces in CHOICES]
            cells = [f"{t * 1e3:.2f} ({ts[0] / t:.2f}x)" for t in ts]
            best = min(range(len(ts)), key=ts.__getitem__)
            out.append(f"| {m.name} | {op} | " + " | ".join(cells) + f" | {CHOICES[best][0]} |")
    return "\n".join(out)


def main() -> None:
    print("Model vs the simulated cluster's link counters (node 0's eth0, MB = 1e6 bytes):\n")
    print(check_table())
    print("\nBytes per level, 8 nodes x 8 GPUs:\n")
    print(bytes_table())
    print(f"\nProjected ms per call, {PROJECTED_ELEMS // MiB} Mi bf16 elements per rank (gain vs NCCL's bf16 ring):\n")
    print(projection_table())
    print("\nShapes:")
    for m in SHAPES:
        print(f"- {m.name}: {m.note}; codec {m.codecs['fp8'].source}; 4-bit codec {m.codecs['mxfp4'].source}")


if __name__ == "__main__":
    main()
