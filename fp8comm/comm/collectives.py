"""Public FP8 all_gather / reduce_scatter / all_reduce and their into-buffer variants for flat engine buckets.

Every function takes `config=` (a WireConfig: format, block scales, rounding, kernel backend, check policy,
pipelining) and keyword options on top of it (`fmt="e5m2"` = `config=WireConfig(fmt="e5m2")`); unknown options are
an error on every rank. Per call: seed (stochastic rounding; None: a fresh one per call), async_op (return a
Handle; dequantization and accumulation happen in wait()), hierarchical (True: node groups from LOCAL_WORLD_SIZE,
or a HierarchicalGroups), buffer (a Buffer: its default config, scratch memory, statistics and seeds; default: the
process's), guard (a numerics-guard bucket, Guard.bucket(key, device): the packing kernels count into it).
Pipelining (CPU): a big call is cut into column pieces of whole blocks (whole tokens for all_to_all), each its own
collective, so quantizing, the wire and dequantizing overlap; bit-identical to one piece.
all_gather(fp8_out=True) returns an Fp8Tensor (codes + scales) for an FP8 GEMM instead of dequantizing.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from ..errors import Fp8CommError
from ..quant.formats import div_exact
from ..quant.layout import view_2d
from ..quant.tensor import Fp8Tensor
from ..quant.wire4 import backend_problem
from .buffers import Handle, Lease, completed, refuse_capture
from .checks import Meta, exchange, group_rank_size, out_problem, tensor_problem
from .config import WireConfig, WireSpec, resolve
from .core import AddInto, Call, ag_phase, chunk_rows, gathered_into, guarded, rs_phase
from .feedback import ErrorFeedback
from .guard import GuardBucket
from .hierarchical import precheck, resolve_groups
from .levels import hier_ag_phase, hier_rs_phase
from .state import default_state

_OPS = {"sum": 0, "avg": 1, dist.ReduceOp.SUM: 0, dist.ReduceOp.AVG: 1}
DEFAULT_CONFIG = WireConfig()


def start_call(
    op: str,
    group,
    meta: Meta,
    kw: dict,
    extra=None,
    defer: bool = True,
    fp8_wire: bool = True,
    ef: ErrorFeedback | None = None,
    device=None,
) -> Call:
    """Resolve the call's WireConfig (kw: config, buffer, seed and option overrides), validate, run the metadata
    check if this call is checked (raises on every rank) and lease scratch memory from the buffer's state.

    extra(spec) -> problem | None: a further local check that needs the resolved wire spec. fp8_wire=False (an
    all_to_all moving bf16 or the native dtype): the FP8 options are validated but not compared across ranks.
    ef: the call's ErrorFeedback state; a config with error_feedback=True needs one (state is per buffer).
    device: where the call's tensors live. Inside CUDA graph capture the call is refused first
    (Fp8CommCaptureError), before the metadata check and the lease (see buffers.refuse_capture)."""
    refuse_capture(op, device)
    rank, world = group_rank_size(group)
    buffer = kw.pop("buffer", None)
    state = buffer.state if buffer is not None else default_state()
    seed = kw.pop("seed", None)
    guard = kw.pop("guard", None)
    if guard is not None and not isinstance(guard, GuardBucket):
        meta.fail(("option", f"guard must be a GuardBucket (Guard.bucket(key, device)), got {type(guard).__name__}"))
        guard = None
    cfg = None
    try:
        cfg = resolve(kw.pop("config", None), buffer.config if buffer is not None else DEFAULT_CONFIG, kw)
    except Fp8CommError as e:
        meta.fail(("option", str(e)))
    if cfg is not None:
        meta.spec, meta.pipeline = cfg.spec, cfg.pipeline
        if device is not None and (problem := backend_problem(cfg.spec.backend, device)) is not None:
            meta.fail(("option", problem))  # an explicit backend this rank cannot run: refused on every rank
        if extra is not None:
            meta.fail(extra(cfg.spec))
        if cfg.error_feedback and ef is None:
            meta.fail(
                (
                    "option",
                    "config.error_feedback=True needs an error_feedback=ErrorFeedback(...) state on the "
                    "call (one per gradient buffer, kept across calls)"
                    if op != "all_gather"
                    else "error feedback applies to gradient reductions; all_gather has none",
                )
            )
    spec = meta.spec
    if not fp8_wire:
        meta.spec = None
    try:
        check = state.should_check(cfg.check if cfg is not None else None, group, op)
    except Fp8CommError as e:
        raise Fp8CommError(f"fp8comm.{op}: {e}") from None  # the same on every rank: no rank goes on alone
    # Deferred: the check travels while the first piece is quantized (hierarchical mode first creates its groups).
    sent, settle = exchange(meta, group, rank, world, check, defer=defer and not meta.hier)
    if sent:
        state.stats.record(op, 0, 0, 0, check_bytes=sent, calls=0)
    rounding = cfg.rounding if cfg is not None else "nearest"
    return Call(
        op,
        group,
        rank,
        world,
        cast(WireSpec, spec),  # set whenever the exchange above returned
        Lease(state.pool),
        state.next_seed(seed, rank, rounding),
        meta.pipeline,
        settle=settle,
        state=state,
        guard=guard,
    )


def _reduce_op(op) -> tuple[int, tuple[str, str] | None]:
    if isinstance(op, str):
        op = op.lower()
    if op not in _OPS:
        return 0, ("option", f"op must be 'sum' or 'avg' (or ReduceOp.SUM/AVG), got {op!r}")
    return _OPS[op], None


def _meta(name: str, x, what: str, output=None, op=None) -> Meta:
    """The call's metadata with every local input problem recorded (nothing raises before the cross-rank check)."""
    meta = Meta(name, dtype=getattr(x, "dtype", None), shape=tuple(getattr(x, "shape", ())))
    flat = output is not None  # into-buffer variants take flat buffers, so 0-d inputs are fine there
    meta.fail(tensor_problem(x, what, allow_0d=flat) if flat else tensor_problem(x, what))
    if flat:
        meta.fail(tensor_problem(output, "output", allow_0d=True))
    if op is not None:
        meta.reduce_op, p = _reduce_op(op)
        meta.fail(p)
    return meta


def _hier(hierarchical, group, meta: Meta):
    """Validate hierarchical mode now; the groups themselves are created only after the metadata check passed."""
    meta.hier, problem = precheck(hierarchical, group)
    meta.fail(problem)
    return lambda: resolve_groups(hierarchical, group)


def _nothing_to_move(call: Call, result, async_op: bool):
    """An empty input: no payload collective, but the (deferred) metadata check still raises on a mismatch."""
    guarded(call, call.checked)
    call.lease.release()
    return completed(result) if async_op else result


def _dev(t):
    """The device of the call's tensor (None for a non-tensor: its error comes from the metadata check)."""
    return t.device if isinstance(t, torch.Tensor) else None


def _run(call: Call, works: list, finish, async_op: bool, device, later_phases: bool = False):
    """The call's Handle (async_op) or its result; later_phases: finish() issues further collectives (all_reduce)."""
    h = Handle(works, finish, call.lease, later_phases=later_phases, device=device)
    return h if async_op else h.wait()


# ---------------------------------------------------------------------------------------------- all-gather
def all_gather(
    tensor: torch.Tensor,
    group=None,
    *,
    async_op: bool = False,
    hierarchical=None,
    fp8_out: bool = False,
    out=None,
    **kw,
):
    """Concatenation along dim 0 of every rank's tensor, in its dtype; bit-identical on every rank (owner too).

    fp8_out=True: return the gathered FP8 codes and scales as an Fp8Tensor (shape [world * dim0, ...], 1xB scales
    along the last dim, dtype = the input's) for an FP8 GEMM consumer (fp8comm.gemm, Fp8Linear); nothing is
    dequantized. Its codes and scales are those the dequantizing call decodes. Needs the last dim (the length of a
    1-D tensor) to be a multiple of the block size, so flat blocks are row blocks; not in hierarchical mode.
    out: a preallocated output to write (a tensor, or an Fp8Tensor with fp8_out=True), as engines keep their
    gathered buffers; a fresh big output costs page faults on every call (docs/benchmarks.md).
    """
    meta = _meta("all_gather", tensor, "tensor")
    hg = _hier(hierarchical, group, meta)
    call = start_call(
        "all_gather", group, meta, kw, _ag_out_problem(tensor, group, hierarchical, fp8_out, out), device=_dev(tensor)
    )
    hg = hg()
    shape = (call.world * tensor.shape[0],) + tuple(tensor.shape[1:])
    if fp8_out:
        return _all_gather_fp8(call, shape, tensor, async_op, out)
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    return _all_gather_flat(call, hg, out, tensor, async_op)


def _ag_out_problem(tensor, group, hierarchical, fp8_out, out):
    def check(spec):
        if isinstance(tensor, torch.Tensor) and tensor.dim() and out is not None:
            shape = (group_rank_size(group)[1] * tensor.shape[0],) + tuple(tensor.shape[1:])
            p = out_problem(out, shape, tensor.dtype, tensor.device, spec if fp8_out else None)
            if p is not None:
                return p
        if not fp8_out:
            return None
        if not spec.codec.codes_out:
            return "option", f"fp8_out=True returns FP8 codes; the {spec.wire_name} wire has no such output"
        if hierarchical:
            return "option", "fp8_out=True is not available with hierarchical=...; use the flat all-gather"
        b = spec.scaling.cols
        k = tensor.shape[-1] if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
        if b is None or k % b:
            return "shape", (
                f"fp8_out=True needs the last dim ({k}) to be a multiple of the block size ({b}) so "
                f"the wire's flat 1x{b} blocks are the Fp8Tensor's row blocks"
            )
        return None

    return check


def _all_gather_fp8(call: Call, shape: tuple, x: torch.Tensor, async_op: bool, out=None):
    spec, n, w = call.spec, x.numel(), call.world
    if out is None:
        codes = torch.empty(shape, dtype=torch.uint8, device=x.device)
        scales = torch.empty(spec.scaling.scale_shape(*view_2d(shape)), dtype=torch.float32, device=x.device)
        result = Fp8Tensor(codes.view(spec.fmt.dtype), scales, spec.fmt, spec.scaling, x.dtype)
    else:
        codes, scales, result = out.data.view(torch.uint8), out.scale, out
    if n == 0:
        return _nothing_to_move(call, result, async_op)
    blk = cast(int, spec.scaling.cols)  # wire scaling is always 1 x cols blocks
    work, fin = guarded(
        call,
        lambda: ag_phase(
            call, x.reshape(-1), (codes.view(w, n), scales.view(w, n // blk)), call.group, w, "all_gather", x.dtype
        ),
    )

    def finish():
        fin()
        return result

    return _run(call, [work], finish, async_op, x.device)


def all_gather_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    *,
    async_op: bool = False,
    hierarchical=None,
    node_phase_in_wait: bool = False,
    _adder: AddInto | None = None,
    **kw,
):
    """Flat-buffer all-gather: output (world * input.numel() elements, any float dtype) <- every rank's input.

    node_phase_in_wait (two levels, async_op): return as soon as the bytes are on their way across the nodes, and
    issue the node-local phase in wait() (a later phase, as all_reduce's: call wait() at the same point of the
    collective sequence on every rank); else the call returns once the cross-node phase has arrived."""
    meta = _meta("all_gather", input, "input", output)
    if meta.error is None:
        meta.shape = (input.numel(),)  # flat semantics: only the element count must agree across ranks
        world = group_rank_size(group)[1]
        if output.numel() != world * input.numel():
            meta.fail(
                (
                    "shape",
                    f"output has {output.numel()} elements, expected world ({world}) x input "
                    f"({input.numel()}) = {world * input.numel()}",
                )
            )
        elif output.device != input.device:
            meta.fail(("device", f"output is on {output.device}, input on {input.device}"))
    hg = _hier(hierarchical, group, meta)
    call = start_call("all_gather", group, meta, kw, device=_dev(input))
    hg = hg()
    return _all_gather_flat(call, hg, output, input, async_op, node_phase_in_wait, _adder)


def all_gather_add(adder: AddInto, input: torch.Tensor, group=None, **kw):
    """all_gather_into whose output, adder.target, receives += the gathered values (the fp32 sum rounded once into
    its dtype; the native 4-bit kernels decode and add in one pass): ReplicaUpdate's transfer. The target changes
    only where the gather decodes (the call, or wait() with async_op); after adder.drop() nothing is added."""
    return all_gather_into(adder.target, input, group, _adder=adder, **kw)


def _all_gather_flat(
    call: Call, hg, out: torch.Tensor, x: torch.Tensor, async_op: bool, node_in_wait=False, adder=None
):
    n = x.numel()
    if n == 0:
        return _nothing_to_move(call, out, async_op)
    dest = adder.view(call.world, n) if adder is not None else out.view(call.world, n)
    later = bool(node_in_wait and async_op and hg is not None)

    def begin():
        if hg is not None:
            return hier_ag_phase(call, hg, x, dest, x.dtype, node_in_finish=later)
        return ag_phase(call, x, dest, call.group, call.world, "all_gather", x.dtype)

    work, fin = guarded(call, begin)

    def finish():
        fin()
        return out

    return _run(call, [work], finish, async_op, x.device, later_phases=later)


# ------------------------------------------------------------------------------------------ reduce-scatter
def reduce_scatter(
    tensor: torch.Tensor,
    group=None,
    op="sum",
    *,
    async_op: bool = False,
    hierarchical=None,
    error_feedback: ErrorFeedback | None = None,
    **kw,
):
    """This rank's chunk (rows [r*c, (r+1)*c), c = ceil(dim0 / world)) of the sum/mean over ranks, in the input dtype.

    Chunks are padded to c rows, so the last ranks may get fewer (or zero) rows when dim 0 does not divide.
    """
    meta = _meta("reduce_scatter", tensor, "tensor", op=op)
    hg = _hier(hierarchical, group, meta)
    call = start_call("reduce_scatter", group, meta, kw, ef=error_feedback, device=_dev(tensor))
    hg = hg()
    c, mine = chunk_rows(tensor.shape[0], call.world, call.rank)
    out = torch.empty((mine,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    row = tensor.numel() // tensor.shape[0] if tensor.shape[0] else 0
    return _reduce_scatter_flat(call, hg, out, tensor, c * row, meta.reduce_op, error_feedback, async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    op="sum",
    *,
    async_op: bool = False,
    hierarchical=None,
    error_feedback: ErrorFeedback | None = None,
    **kw,
):
    """Flat-buffer reduce-scatter: output <- elements [r*L, r*L + output.numel()) of the sum, L = ceil(N / world)."""
    meta = _meta("reduce_scatter", input, "input", output, op)
    if meta.error is None:
        meta.shape = (input.numel(),)
        rank, world = group_rank_size(group)
        L, mine = chunk_rows(input.numel(), world, rank)
        if output.numel() != mine:
            meta.fail(
                (
                    "shape",
                    f"output has {output.numel()} elements; rank {rank}'s chunk of a {input.numel()}-"
                    f"element input over {world} ranks has {mine} (chunks of ceil(N/world) = {L})",
                )
            )
        elif output.device != input.device:
            meta.fail(("device", f"output is on {output.device}, input on {input.device}"))
    hg = _hier(hierarchical, group, meta)
    call = start_call("reduce_scatter", group, meta, kw, ef=error_feedback, device=_dev(input))
    hg = hg()
    L = chunk_rows(input.numel(), call.world, call.rank)[0]
    return _reduce_scatter_flat(call, hg, output, input, L, meta.reduce_op, error_feedback, async_op)


def _rs_start(call: Call, hg, x: torch.Tensor, L: int, ef: ErrorFeedback | None):
    """Start the FP8 reduce-scatter phase (flat or hierarchical) of `call.op` -> (work, finish giving fp32 sums)."""

    def begin():
        if hg is not None:
            return hier_rs_phase(call, hg, x, L, ef, x.dtype)
        return rs_phase(call, x, L, call.group, call.world, ef, call.op, x.dtype)

    return guarded(call, begin)


def _reduce_scatter_flat(
    call: Call, hg, out: torch.Tensor, x: torch.Tensor, L: int, avg: int, ef: ErrorFeedback | None, async_op: bool
):
    if x.numel() == 0:
        return _nothing_to_move(call, out, async_op)

    work, acc_fn = _rs_start(call, hg, x, L, ef)

    def finish():
        acc = acc_fn()
        if avg:
            div_exact(acc, call.world, out=acc)
        out.view(-1).copy_(acc[: out.numel()])
        return out

    return _run(call, [work], finish, async_op, x.device)


# ---------------------------------------------------------------------------------------------- all-reduce
def all_reduce(
    tensor: torch.Tensor,
    group=None,
    op="sum",
    *,
    async_op: bool = False,
    hierarchical=None,
    error_feedback: ErrorFeedback | None = None,
    **kw,
):
    """Sum (or mean) over ranks, same shape and dtype: FP8 reduce-scatter, then FP8 all-gather of the sums.

    Every rank ends bit-identical; error feedback applies to the reduce-scatter (sender) quantization.
    async_op=True: the reduce-scatter starts now and the handle's wait() issues the all-gather phase, so call wait()
    at the same point of the collective sequence on every rank; is_completed() stays False until then.
    """
    out = torch.empty_like(tensor) if isinstance(tensor, torch.Tensor) else tensor
    return all_reduce_into(
        out, tensor, group, op, async_op=async_op, hierarchical=hierarchical, error_feedback=error_feedback, **kw
    )


def all_reduce_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    op="sum",
    *,
    async_op: bool = False,
    hierarchical=None,
    error_feedback: ErrorFeedback | None = None,
    **kw,
):
    """Flat-buffer all-reduce: output (same numel as input; may BE input) <- sum/mean of every rank's input."""
    meta = _meta("all_reduce", input, "input", output, op)
    if meta.error is None:
        meta.shape = (input.numel(),)
        if output.numel() != input.numel() or output.device != input.device:
            meta.fail(
                (
                    "shape",
                    f"output ({output.numel()} elements on {output.device}) must match input "
                    f"({input.numel()} on {input.device})",
                )
            )
    hg = _hier(hierarchical, group, meta)
    call = start_call("all_reduce", group, meta, kw, ef=error_feedback, device=_dev(input))
    hg = hg()
    n = input.numel()
    out_flat = output.view(-1)
    if n == 0:
        return _nothing_to_move(call, output, async_op)
    L = chunk_rows(n, call.world, call.rank)[0]

    work, acc_fn = _rs_start(call, hg, input, L, error_feedback)

    def finish():
        acc = acc_fn()
        if meta.reduce_op:
            div_exact(acc, call.world, out=acc)
        # Second phase: quantize this rank's reduced chunk and gather every chunk to every rank.
        dest = gathered_into(call, out_flat, n, L, call.world)
        if hg is not None:
            w2, fin2 = hier_ag_phase(call, hg, acc, dest, input.dtype, calls=0)
        else:
            w2, fin2 = ag_phase(call, acc, dest, call.group, call.world, "all_reduce", input.dtype, calls=0)
        w2.wait()
        fin2()
        if dest.data_ptr() != out_flat.data_ptr():
            out_flat.copy_(dest.view(-1)[:n])
        return output

    # wait() issues the all-gather phase; is_completed() never does (collective order must not follow poll timing)
    return _run(call, [work], finish, async_op, input.device, later_phases=True)
