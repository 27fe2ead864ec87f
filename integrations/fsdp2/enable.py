"""enable(model, **options) installs the FP8 comm hooks on every FSDP2 module; disable(model) puts FSDP2's back.

Everything is validated first (options, every module, every param group); only then are hooks installed, so a
refused model is left exactly as it was. One entry per FSDP2 param group: `fully_shard([norm, lm_head])` makes one
group shared by two modules, reported (and hooked, and restored) once as "norm+lm_head". enable() changes only
communication: it converts no Linear (FP8 GEMMs are fp8comm.convert_to_fp8, a separate opt-in). Fp8Linear layers
already inside the model get weight_cache="gathered": under FSDP2 the (version, data_ptr) key of a cached FP8
weight can repeat after an optimizer step (stale weights).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp8comm.comm import config_for, residual_nbytes, teardown, topology
from fp8comm.comm.planned import RuntimePlanner
from fp8comm.comm.planner import Policy
from fp8comm.errors import Fp8CommConfigError

from . import hooks, layout
from .config import Fp8CommFsdp2Config, Fp8CommFsdp2Error, parse

_ATTR = "_fp8comm_fsdp2"  # where an enabled model keeps what disable() needs
logger = logging.getLogger("fp8comm.integrations.fsdp2")
_PER_ELEMENT = {"float32": "4 bytes", "bfloat16": "2 bytes", "fp8": "1 byte (plus a 4-byte scale per group)"}


@dataclass
class ModuleEntry:
    """One FSDP2 param group (one module, or several sharded by one fully_shard call: names joined by "+"): what
    it shards and what enable() installed on it."""

    name: str
    params: int
    numel: int
    mesh: str
    weights: str
    gradients: str
    wire_padding: int = 0  # elements per rank added so every parameter starts a whole block (0 when unaligned)
    shard_numel: int = 0  # elements of this rank's flat shard (FSDP2's own padding included)
    notes: list = field(default_factory=list)
    residual_bytes: int = 0  # error feedback: this rank's residual of the group's whole padded gradient (0: off)
    residual_elements: int = 0  # ... and its elements


@dataclass
class Fsdp2Report:
    """What enable() did, per FSDP2 module, in the style of convert_to_fp8's report."""

    config: Fp8CommFsdp2Config
    modules: list = field(default_factory=list)
    fp8_linears: int = 0
    weight_cache: str = ""
    unmanaged: list = field(default_factory=list)  # parameters no FSDP2 module manages (no hook can see them)
    levels: list = field(default_factory=list)  # one line per shard group: two-level or flat, and why
    planner: RuntimePlanner | None = None  # enable(planner=...): its calibration, and the plans decided so far

    @property
    def installed(self) -> list[str]:
        return [m.name for m in self.modules if "fp8" in (m.weights + m.gradients)]

    @property
    def residual_bytes(self) -> int:
        """Error-feedback residual memory on this rank, all groups (allocated at each group's first reduce)."""
        return sum(m.residual_bytes for m in self.modules)

    def gemms(self) -> str:
        """What enable() did to the GEMMs: nothing (it converts no layer); Fp8Linear layers are the caller's."""
        if not self.fp8_linears:
            return "FP8 GEMMs off (enable() converts no layer; fp8comm.convert_to_fp8 is the opt-in)"
        return f"FP8 GEMMs in {self.fp8_linears} Fp8Linear layers converted by the caller (enable() converts none)"

    def __str__(self) -> str:
        c = self.config
        planned = c.planned_wires
        lines = [
            f"fp8comm FSDP2: {len(self.installed)} of {len(self.modules)} FSDP2 modules with FP8 hooks; "
            f"weights {planned.get('weights') or c.weights.describe()}; "
            f"gradients {planned.get('gradients') or c.gradients.describe()}; metadata check "
            f"{ {None: 'library default', True: 'every call', False: 'off'}[c.check] }; parameters "
            f"{'start whole blocks' if c.align_blocks else 'packed (blocks may straddle parameters)'}; "
            f"hierarchical {'on (two levels per shard group that spans nodes)' if c.hierarchical else 'off (flat)'}; "
            f"{self.gemms()}"
        ]
        if c.planner is not None:
            p = c.planner
            cal = (
                f"calibration from {p.calibration}"
                if p.calibration
                else f"calibration measured over the world at enable() (timeout {p.timeout_s:g} s)"
            )
            if self.planner is not None and self.planner.fallback:
                cal += f"; {self.planner.fallback}: the fixed choice (FP8, two levels where a group spans nodes)"
            four = " or 4-bit gradients" if p.allow_4bit else ""
            lines.append(
                f"  planner on: per collective size class FSDP2's own, FP8{four}, "
                f"{'flat or two-level' if c.hierarchical else 'flat'}; {cal}; each plan logged on rank 0 at its "
                "first call"
            )
        if self.residual_bytes:
            b, upto = self.residual_bytes, "up to " if c.planner is not None else ""
            lines.append(
                f"  error-feedback residuals: {upto}{b} bytes ({b / 2**20:.2f} MiB) on every rank, "
                f"{c.gradients.residual_dtype}, the size of each group's whole gradient"
            )
        w = max([len(m.name) for m in self.modules] + [8])
        for m in self.modules:
            pad = f", wire padding {m.wire_padding}/{m.shard_numel} el" if m.shard_numel else ""
            res = f", residual {m.residual_bytes} B" if m.residual_bytes else ""
            lines.append(
                f"  {m.name:<{w}}  {m.params} params, {m.numel} el, {m.mesh}: weights {m.weights}, "
                f"gradients {m.gradients}{pad}{res}"
            )
            lines += [f"  {'':<{w}}    note: {n}" for n in m.notes]
        if self.fp8_linears:
            lines.append(f"  Fp8Linear layers: {self.fp8_linears}, weight cache {self.weight_cache}")
        if self.unmanaged:
            lines.append(f"  not managed by FSDP2 (no hook sees them): {', '.join(self.unmanaged)}")
        return "\n".join(lines)


def _fsdp_modules(model: nn.Module) -> list[tuple[str, Any]]:
    """(name, module) per FSDP2 state of `model`, in module order; a state shared by several modules once."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    found: list[tuple[str, Any]] = []
    for name, m in model.named_modules():
        if isinstance(m, FSDP1):
            raise Fp8CommFsdp2Error(
                f"module {name or '<root>'} is wrapped by FullyShardedDataParallel (FSDP1); "
                "fp8comm.integrations.fsdp2 supports FSDP2's fully_shard only"
            )
        if isinstance(m, FSDPModule):
            found.append((name or "<root>", m))
    if not found:
        raise Fp8CommFsdp2Error(
            f"{type(model).__name__} has no module sharded by FSDP2: call "
            "torch.distributed.fsdp.fully_shard on its blocks and on the root first, then enable()"
        )
    # fully_shard([a, b]) gives a and b ONE FSDP state (one param group): one entry, named "a+b", so the group's
    # original comm objects are saved once, before any hook of ours is on it.
    by_state: dict[int, tuple[list[str], Any]] = {}
    for name, m in found:
        by_state.setdefault(id(m._get_fsdp_state()), ([], m))[0].append(name)
    return [("+".join(names), m) for names, m in by_state.values()]


def _param_group(name: str, module) -> Any:
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise Fp8CommFsdp2Error(
            f"FSDP2 module {name} has {len(groups)} param groups (per-parameter meshes from "
            "shard_placement_fn); FSDP2's comm hooks take one hook per module, so fp8comm cannot "
            "install a hook there. Shard such parameters in a separate fully_shard call"
        )
    return groups[0] if groups else None


def _mesh(pg) -> tuple[str, list[str]]:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    mi = pg.mesh_info
    if not isinstance(mi, FSDPMeshInfo):
        return "", []
    if isinstance(mi, HSDPMeshInfo):
        mp = pg.mp_policy
        rdt = str(mp.reduce_dtype or mp.param_dtype or "the parameter dtype").replace("torch.", "")
        note = (
            f"HSDP: the FP8 reduce-scatter runs over the shard group ({mi.shard_mesh_size} ranks); FSDP2's "
            f"all-reduce over the replicate group ({mi.replicate_mesh_size} ranks) stays in {rdt} (FSDP2 has "
            "no hook for it)"
        )
        return f"HSDP shard {mi.shard_mesh_size} x replicate {mi.replicate_mesh_size}", [note]
    return f"shard {mi.shard_mesh_size}", []


def _gathered_dtype(orig, param_dtype):
    """The dtype FSDP2 all-gathers a parameter in (its MixedPrecisionPolicy rule)."""
    return param_dtype if param_dtype is not None and orig.is_floating_point else orig


def _entry(name: str, pg, cfg: Fp8CommFsdp2Config) -> ModuleEntry:
    """The report line of one FSDP2 module; raises for a module whose mesh has nothing to shard."""
    if pg is None:
        return ModuleEntry(name, 0, 0, "-", "none (no parameters of its own)", "none")
    mesh, notes = _mesh(pg)
    if not mesh:
        raise Fp8CommFsdp2Error(
            f"FSDP2 module {name} is replicated, not sharded ({type(pg.mesh_info).__name__}): "
            "there is no all-gather or reduce-scatter to replace"
        )
    fps = pg.fsdp_params
    dtypes = {_gathered_dtype(fp.sharded_param.dtype, pg.mp_policy.param_dtype) for fp in fps}
    if len(dtypes) > 1 and cfg.weights.enabled:
        notes.append(
            f"mixed parameter dtypes {sorted(map(str, dtypes))}: FSDP2 all-gathers raw bytes (uint8), "
            "which pass through untouched (hook_stats()['weights']['passthrough'])"
        )
    sizes = [fp.padded_sharded_param_size.numel() for fp in fps]
    block = (cfg.weights if cfg.weights.enabled else cfg.gradients).wire_block
    _, wn = layout.spans(sizes, block, cfg.align_blocks)
    on = "planned (FSDP2's own or fp8)" if cfg.planner is not None else "fp8"
    entry = ModuleEntry(
        name,
        len(fps),
        sum(fp.sharded_param.numel() for fp in fps),
        mesh,
        on if cfg.weights.enabled else "FSDP2's own",
        (on.replace("fp8", "fp8/mxfp4") if cfg.gradients.fmt == "mxfp4" else on)
        if cfg.gradients.enabled
        else "FSDP2's own",
        wn - sum(sizes),
        sum(sizes),
        notes,
    )
    if pg.mesh_info.shard_mesh_size == 1:
        entry.notes.append("shard group of 1 rank: FSDP2 calls no collective, so the hooks never run")
    g = cfg.gradients
    if g.enabled and g.error_feedback and pg.mesh_info.shard_mesh_size > 1:
        # The residual is laid out like the reduce-scatter's wire input: shard group x this rank's wire row.
        grads = [fp.padded_sharded_param_size.numel() for fp in fps if fp.sharded_param.requires_grad]
        # under the planner only a class whose option carries error feedback keeps one (keeps_feedback)
        _, wl = layout.spans(grads, g.wire_block, cfg.align_blocks)
        entry.residual_elements = pg.mesh_info.shard_mesh_size * wl
        entry.residual_bytes = residual_nbytes(g.residual_dtype, entry.residual_elements)
    return entry


def _check_residual_memory(cfg: Fp8CommFsdp2Config, entries: list[ModuleEntry]) -> None:
    """Error feedback undoes FSDP2's gradient sharding (a residual of every group's whole gradient on every
    rank): refused unless gradients["allow_unpartitioned_residuals"] accepts that memory."""
    g = cfg.gradients
    if not (g.enabled and g.error_feedback) or g.allow_unpartitioned_residuals:
        return
    total = sum(e.residual_bytes for e in entries)
    per = _PER_ELEMENT[g.residual_dtype]
    raise Fp8CommFsdp2Error(
        f"gradients['error_feedback'] keeps each rank's quantization residual of every FSDP2 module's WHOLE "
        f"(unsharded) gradient on every rank: {per} per element ({g.residual_dtype}), {total:,} bytes "
        f"({total / 2**20:.1f} MiB) for this model, while FSDP2 keeps 1/world of the gradients per rank. Set "
        "gradients={'error_feedback': True, 'allow_unpartitioned_residuals': True} to accept that memory "
        "(residual_dtype 'bfloat16' halves it, 'fp8' quarters it), or turn error feedback off"
    )


def enable(model: nn.Module, **options) -> Fsdp2Report:
    """Install FP8 all-gather / reduce-scatter hooks on every FSDP2 module of `model` (already fully_shard-ed).

    Options (see config.py / docs/fsdp2.md): weights, gradients (True/False or a dict), check, align_blocks,
    hierarchical, planner. Returns an Fsdp2Report; raises Fp8CommFsdp2Error, changing nothing, for anything it
    cannot honour.

    planner: True, or a dict of "allow_4bit" (bool), "calibration" (an `fp8comm calibrate` file) and "timeout_s"
    (the measurement's deadline). It turns on both collectives it may choose, the weight all-gather and the
    gradient reduce-scatter (a direction set to False stays FSDP2's own and is not planned), and decides per
    collective size class, identically on every rank, from the calibration: FSDP2's own collective (its dtype),
    FP8 (e4m3 1x128) or, with allow_4bit, 4-bit gradients (the validated recipe: mxfp4 with error feedback,
    nearest rounding, whose residual memory the planner allows: gradients' allow_unpartitioned_residuals, set by
    it and stated in the plan lines; a class planned on FP8 runs
    without error feedback), flat or two-level (two levels only for shard groups that run two-level;
    hierarchical=False: flat only). Weights travel in FP8 at most (FSDP2 keeps no weight replicas). An explicit
    format for the same traffic (a weights / gradients dict with format keys, a WeightWire / GradientWire) is an
    error naming both. Without a calibration file enable() measures the links once over the world (gloo only; NCCL
    needs the file); a bad value or a file from another fp8comm version, device kind or ranks-per-node layout is an
    error before any bytes move. Rank 0 logs each plan at its first call; fp8comm.comm.comm_stats() gains
    predicted_s / measured_s / timed_calls per op."""
    cfg = parse(**options)
    if getattr(model, _ATTR, None) is not None:
        raise Fp8CommFsdp2Error("fp8comm FSDP2 hooks are already enabled on this model; call disable(model) first")
    mods = _fsdp_modules(model)
    plan = []
    for name, m in mods:
        pg = _param_group(name, m)
        if pg is not None and (hooks.is_ours(pg._all_gather_comm) or hooks.is_ours(pg._reduce_scatter_comm)):
            raise Fp8CommFsdp2Error(
                f"FSDP2 module {name} already carries fp8comm hooks (enabled through another "
                "model object?); call disable() on that model first"
            )
        plan.append((name, m, pg, _entry(name, pg, cfg)))
    report = Fsdp2Report(cfg, [e for *_, e in plan])
    _check_residual_memory(cfg, report.modules)
    report.unmanaged = _unmanaged(model, [pg for _, _, pg, _ in plan if pg is not None])
    groups = [pg for _, _, pg, _ in plan if pg is not None]
    planner, device = _planner(cfg, groups)  # its checks (no communication) before any bytes move
    table = None
    if planner is not None:  # before _levels makes node groups, so a refusal here leaves nothing behind
        table = topology.node_table()  # collective over the world once (cached: _levels reuses it)
        try:
            planner.start(device)  # the file, or a measurement over the world (collective; gloo only)
        except Fp8CommConfigError as e:
            raise Fp8CommFsdp2Error(str(e)) from None
        report.planner = planner
    splits = _levels(cfg, plan, report)  # collective over the world when on: every rank calls enable()
    installed = []
    for _name, m, pg, _ in plan:  # one entry per param group: its originals are saved before our hook goes on
        if pg is None:
            continue
        ag, rs = pg._all_gather_comm, pg._reduce_scatter_comm
        installed.append((m, ag, rs))
        pw = pr = None
        if planner is not None and table is not None:
            pw = hooks.Planned(planner, "all_gather", ag, {"fp8": cfg.weights.wire(cfg.check)}, table)
            base = cfg.gradients.wire(cfg.check)
            pr = hooks.Planned(planner, "reduce_scatter", rs, {"fp8": config_for(base, "fp8"), "mxfp4": base}, table)
        if cfg.weights.enabled:
            m.set_custom_all_gather(hooks.Fp8AllGather(pg, cfg.weights, cfg.check, cfg.align_blocks, splits, pw))
        if cfg.gradients.enabled:
            m.set_custom_reduce_scatter(
                hooks.Fp8ReduceScatter(pg, cfg.gradients, cfg.check, cfg.align_blocks, splits, pr)
            )
    report.fp8_linears, report.weight_cache = _gathered_weight_cache(model)
    object.__setattr__(model, _ATTR, (cfg, installed, report))
    logger.info("%s", report)
    if _rank() == 0:
        for line in report.levels:
            logger.info("fp8comm FSDP2: %s", line)
    return report


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _log_rank0(line: str) -> None:
    if _rank() == 0:
        logger.info("%s", line)


def _planner(cfg: Fp8CommFsdp2Config, groups: list) -> tuple[RuntimePlanner | None, torch.device]:
    """The RuntimePlanner of enable(planner=...), its input checked with no communication: the calibration file
    (fp8comm version, device kind, ranks per node from torchrun's LOCAL_WORLD_SIZE when set; start() checks the
    node table's figure again), or a gloo world to measure on."""
    import torch.distributed as dist

    device = groups[0].fsdp_params[0].sharded_param.device if groups and groups[0].fsdp_params else torch.device("cpu")
    settings = cfg.planner
    if settings is None:
        return None, device
    policy = Policy(
        allow_4bit=settings.allow_4bit,
        allow_4bit_updates=False,
        replicas=False,  # FSDP2 keeps no weight replicas: weights travel in FP8 at most
        two_level=cfg.hierarchical,
        residual_dtype=cfg.gradients.residual_dtype,
        residual_option="gradients['allow_unpartitioned_residuals'] (set by the planner)"
        if settings.allow_4bit
        else "",
        fp8_feedback=cfg.gradients.error_feedback and not settings.allow_4bit,  # the user's own (4 bits: the recipe's)
    )
    planner = RuntimePlanner(settings, policy, _log_rank0, "fp8comm FSDP2 planner")
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        planner.check_file(device, int(env) if env.isdigit() else None)
    except Fp8CommConfigError as e:  # the file's checks: this adapter's error, the same words
        raise Fp8CommFsdp2Error(str(e)) from None
    if settings.calibration is None and dist.is_initialized() and dist.get_backend() != "gloo":
        raise Fp8CommFsdp2Error(
            f"fp8comm FSDP2 planner: the planner measures links on gloo groups only; this job runs "
            f"{dist.get_backend()!r}: give a calibration file (`fp8comm calibrate --out FILE` on the same nodes) "
            "as planner={'calibration': FILE}"
        )
    return planner, device


def _levels(cfg: Fp8CommFsdp2Config, plan: list, report: Fsdp2Report) -> dict:
    """Decide two-level or flat for every shard group (fp8comm.comm.topology; collective over the world when on)
    and note it in the report: one line per group, and each module's mode next to its entry."""
    from fp8comm.comm import topology

    groups = {}
    for _, _, pg, entry in plan:
        if pg is not None and pg.mesh_info.shard_mesh_size > 1:
            groups[id(pg)] = (topology.group_ranks(pg.mesh_info.shard_process_group), entry)
    _, splits = topology.prepare([r for r, _ in groups.values()], holder="fsdp2", enabled=cfg.hierarchical)
    report.levels = [s.describe() for s in splits.values()]
    for ranks, entry in groups.values():
        s = splits[ranks]
        entry.notes.append(("two-level: " if s.two_level else "flat: ") + s.reason)
        if s.two_level and entry.residual_elements and cfg.planner is None:  # the planner may choose flat
            entry.residual_elements //= s.local  # the cross-node phase's residual: node count x wire row
            entry.residual_bytes = residual_nbytes(cfg.gradients.residual_dtype, entry.residual_elements)
    return splits


def disable(model: nn.Module) -> bool:
    """Restore the comm objects FSDP2 had before enable() (its own collectives); False if nothing was enabled.

    Fp8Linear layers keep weight_cache="gathered": FSDP2 itself needs it (see the module docstring)."""
    state = getattr(model, _ATTR, None)
    if state is None:
        return False
    for m, ag, rs in state[1]:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
    object.__delattr__(model, _ATTR)
    teardown("fsdp2")  # its own share only: node groups the caller prepared stay (fp8comm.shutdown() frees all)
    return True


def is_enabled(model: nn.Module) -> bool:
    return getattr(model, _ATTR, None) is not None


def report(model: nn.Module) -> Fsdp2Report | None:
    """The report of the enable() call now in force on `model` (None when not enabled)."""
    state = getattr(model, _ATTR, None)
    return None if state is None else state[2]


def _unmanaged(model: nn.Module, groups: list) -> list[str]:
    managed = set()
    for pg in groups:
        for fp in pg.fsdp_params:
            managed.add(id(fp.sharded_param))
            if hasattr(fp, "_unsharded_param"):
                managed.add(id(fp._unsharded_param))
    return [n for n, p in model.named_parameters() if id(p) not in managed]


def _gathered_weight_cache(model: nn.Module) -> tuple[int, str]:
    """Make a stale FP8 weight impossible in every Fp8Linear of `model`: (count, description)."""
    import fp8comm.gemm as fg

    n = fg.set_weight_cache(model, "gathered")
    return n, "'gathered' (quantized from the gathered weight in forward, again from the re-gather in backward)"
