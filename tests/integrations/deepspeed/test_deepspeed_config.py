"""The fp8_comm section, version/signature checks, unsupported combinations and install/uninstall (one process).

Nothing here needs torch.distributed: every error must fire before DeepSpeed starts anything.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed not installed")

import torch.nn as nn  # noqa: E402

import fp8comm.integrations.deepspeed as fd  # noqa: E402
from fp8comm.integrations.deepspeed import compat, config  # noqa: E402

BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


def with_fp8(section, **over):
    return {**BASE, **over, "fp8_comm": section}


@pytest.fixture(autouse=True)
def clean():
    fd.uninstall()
    fd.enable_config_flag()
    yield
    fd.uninstall()
    fd.enable_config_flag()


# ------------------------------------------------------------------------------------------------ the section
def test_defaults_and_enabled():
    assert not config.parse(BASE).enabled
    assert not config.parse(with_fp8({"enabled": False})).enabled
    on = config.parse(with_fp8({"enabled": True}))
    assert on.enabled and on == config.parse(with_fp8({})) == config.parse(with_fp8(True))
    d = config.defaults()
    for sec in ("weights", "gradients", "moe"):
        assert d[sec]["enabled"] is True, sec
    assert d["weights"]["fmt"] == "e4m3" and d["gemm"]["recipe"] == "blockwise" and d["mode"] == "fp8"
    assert config.parse(with_fp8({"gemm": False})).gemm.enabled is False


def test_gemm_is_opt_in():
    """The flag promises FP8 communication: FP8 GEMMs only when the section asks for them (issue 20, section 3)."""
    assert config.defaults()["gemm"]["enabled"] is False
    for section in ({}, True, {"enabled": True}, {"weights": True, "gradients": True}, {"gemm": False}):
        assert config.parse(with_fp8(section)).gemm.enabled is False, section
    bare = config.parse(with_fp8({"gemm": True})).gemm
    assert bare.enabled and bare.recipe == "blockwise"  # a bare true: the default recipe
    explicit = config.parse(with_fp8({"gemm": {"enabled": True, "recipe": "tensorwise"}})).gemm
    assert explicit.enabled and explicit.recipe == "tensorwise"
    # an object is on unless it says otherwise (as the section itself): options alone are never silently ignored
    assert config.parse(with_fp8({"gemm": {"recipe": "rowwise"}})).gemm.enabled
    assert not config.parse(with_fp8({"gemm": {"enabled": False, "recipe": "not-a-recipe"}})).gemm.enabled
    guard = config.parse(with_fp8({"guard": {"threshold": 0.01}})).guard
    assert guard.enabled and guard.threshold == 0.01
    assert not config.parse(with_fp8({"guard": {"enabled": False, "threshold": 0.01}})).guard.enabled


def test_log_line_says_what_is_on():
    """The one-line summary names every part, on or off: each traffic kind's wire, and the GEMMs with the recipe."""
    from fp8comm.gemm import Fp8Linear

    def model():
        return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    m = model()
    fd.install(with_fp8({}), m)
    line = fd.summary()
    assert "; FP8 GEMMs off;" in line and not any(isinstance(x, Fp8Linear) for x in m.modules()), line
    for part in (
        "weight all-gather FP8 (e4m3 1x128 fp32 scales)",
        "gradient reduce-scatter FP8 (e4m3 1x128",
        "MoE dispatch FP8 (MoE layers: 0; combine native, backward native)",
    ):
        assert part in line, (part, line)
    fd.install(with_fp8({"weights": False, "gradients": False, "moe": False, "gemm": {"enabled": True}}), model())
    line = fd.summary()
    for part in (
        "weight all-gather native (DeepSpeed's own)",
        "gradient reduce-scatter native (DeepSpeed's own)",
        "MoE all-to-all native (DeepSpeed's own)",
        "GEMMs FP8 blockwise (2 linears)",
    ):
        assert part in line, (part, line)
    fd.install(with_fp8({"mode": "measure", "gemm": {"recipe": "rowwise"}}), model())
    assert "MEASURE mode" in fd.summary() and fd.summary().endswith("GEMMs FP8 rowwise (2 linears)"), fd.summary()


@pytest.mark.parametrize(
    "section, key, fragment",
    [
        ({"enabeld": True}, "fp8_comm.enabeld", "did you mean 'enabled'"),
        ({"weigths": {}}, "fp8_comm.weigths", "did you mean 'weights'"),
        ({"weights": {"fromat": "e4m3"}}, "fp8_comm.weights.fromat", "did you mean 'fmt'"),
        ({"gradients": {"blocksize": 64}}, "fp8_comm.gradients.blocksize", "did you mean 'block_size'"),
        ({"moe": {"combin": "fp8"}}, "fp8_comm.moe.combin", "did you mean 'combine'"),
        ({"gemm": {"recipie": "blockwise"}}, "fp8_comm.gemm.recipie", "did you mean 'recipe'"),
        ({"gradients": {"error_feedbak": True}}, "fp8_comm.gradients.error_feedbak", "did you mean 'error_feedback'"),
        ({"guard": {"treshold": 0.01}}, "fp8_comm.guard.treshold", "did you mean 'threshold'"),
        ({"gaurd": {}}, "fp8_comm.gaurd", "did you mean 'guard'"),
    ],
)
def test_unknown_key_is_named(section, key, fragment):
    with pytest.raises(fd.Fp8CommConfigError) as e:
        config.parse(with_fp8(section))
    msg = str(e.value)
    assert key in msg and fragment in msg and "valid keys" in msg, msg


@pytest.mark.parametrize(
    "section, fragment",
    [
        ({"gradients": {"residual_dtype": "fp16"}}, "'float32', 'bfloat16', 'fp8', 'fp32', 'bf16'"),
        ({"gradients": {"error_feedback": 1}}, "true/false"),
        ({"guard": {"threshold": 1.5}}, "fraction in (0, 1)"),
        ({"guard": {"threshold": "1e-3"}}, "a number"),
        ({"guard": {"patience": 0}}, ">= 1"),
        ({"guard": {"cooldown": 2.5}}, "an integer"),
        ({"gradients": {"enabled": False, "error_feedback": True}}, "needs fp8_comm.gradients.enabled"),
        ({"mode": "measure", "gradients": {"error_feedback": True}}, "no error to feed back"),
        ({"weights": {"fmt": "e4m4"}}, "'e4m3', 'e5m2'"),
        ({"gradients": {"scaling": "amax"}}, "'fp32', 'pow2', 'e8m0'"),
        ({"weights": {"block_size": 100}}, "power of two"),
        ({"weights": {"block_size": True}}, "an integer"),
        ({"moe": {"grad": "fp16"}}, "'native', 'bf16', 'fp8'"),
        ({"gemm": {"recipe": "blockwize"}}, "did you mean 'blockwise'"),
        ({"mode": "dry"}, "'fp8', 'measure'"),
        ({"enabled": "yes"}, "true/false"),
        ({"weights": 3}, "an object or true/false"),
    ],
)
def test_bad_value_lists_valid(section, fragment):
    with pytest.raises(fd.Fp8CommConfigError) as e:
        config.parse(with_fp8(section))
    assert fragment in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "section, fragment",
    [
        (
            {"weights": {"fmt": "mxfp4"}},
            "4-bit weights travel only as changes of a replica: fp8_comm.weights.update_fmt",
        ),
        ({"moe": {"fmt": "nvfp4"}}, "the MoE all-to-all has no 4-bit wire"),
        ({"weights": {"update_fmt": "e4m3"}}, "fp8_comm.weights.update_fmt = 'e4m3' is not valid; valid: 'mxfp4'"),
        ({"weights": {"enabled": False, "update_fmt": "mxfp4"}}, "update_fmt needs fp8_comm.weights.enabled"),
        ({"mode": "measure", "weights": {"update_fmt": "mxfp4"}}, "measure mode quantizes nothing"),
        ({"gradients": {"hadamard": 8}}, "fp8_comm.gradients.hadamard = 8 is not valid; valid: 0, 16, 32"),
        ({"gradients": {"hadamard": 16}}, "fp8_comm.gradients: hadamard=16 applies to the 4-bit formats"),
        ({"gradients": {"fmt": "mxfp4", "block_size": 64}}, "fp8_comm.gradients: fmt='mxfp4' has 1x32 blocks"),
        ({"gradients": {"fmt": "mxfp5"}}, "'e4m3', 'e5m2', 'mxfp4', 'nvfp4'"),
        ({"gradients": {"fmt": "nvfp4", "hadamard": 32}}, "fp8_comm.gradients: hadamard=32 does not fit"),
    ],
)
def test_four_bit_keys_bad_values(section, fragment):
    """4 bits go where a collective carries them: gradients (reduce-scatter) and ZeRO-1/2 weight changes."""
    with pytest.raises(fd.Fp8CommConfigError) as e:
        config.parse(with_fp8(section))
    assert fragment in str(e.value), str(e.value)


def test_four_bit_keys_parse_and_log():
    cfg = config.parse(with_fp8({"gradients": {"fmt": "nvfp4", "hadamard": 16}, "weights": {"update_fmt": "mxfp4"}}))
    w = cfg.gradients.wire(None)
    assert w.is_fp4 and w.fmt == "nvfp4" and w.hadamard == 16 and cfg.gradients.is_fp4
    assert cfg.weights.update_wire(None).fmt == "mxfp4" and cfg.weights.wire(None).fmt == "e4m3"
    assert config.parse(with_fp8({"gradients": {"fmt": "mxfp4", "block_size": 32}})).gradients.block_size == 32
    z2 = {"zero_optimization": {"stage": 2}}
    fd.install(with_fp8({"gemm": False, "gradients": {"fmt": "mxfp4"}, "weights": {"update_fmt": "nvfp4"}}, **z2))
    line = fd.summary()
    assert "weight all-gather as 4-bit changes of the replica (nvfp4" in line, line
    assert "gradient reduce to owners 4-bit (mxfp4" in line, line
    # every bucket carries the configured format (small, unbalanced ones too: no FP8 in their place)
    assert "every bucket" in line and "unbalanced" not in line and "one FP8 all-to-all" not in line, line


def test_update_fmt_refused_under_zero3():
    """ZeRO-3 keeps no replica between steps: its weights stay FP8 (a clear error, nothing installed); its
    gradients may be 4-bit (they go through reduce_scatter_into)."""
    with pytest.raises(fd.Fp8CommUnsupportedError, match="only ZeRO-1/2 keep; ZeRO-3 keeps FP8 weights"):
        fd.install(with_fp8({"gemm": False, "weights": {"update_fmt": "mxfp4"}}))
    assert not fd.is_installed()
    assert fd.install(with_fp8({"gemm": False, "gradients": {"fmt": "mxfp4"}})) is not None
    assert "gradient reduce-scatter 4-bit (mxfp4" in fd.summary()


def test_bucket_plan_reduce_scatter_or_all_to_all():
    """ZeRO-1/2 batches: balanced owners -> one padded reduce-scatter; unbalanced -> the exact-part all-to-all to the
    owners. Both carry the configured format (4 bits included: no FP8 substitution), so only the padding decides,
    from the layout alone (the same decision on every rank)."""
    import inspect

    from fp8comm.integrations.deepspeed.grad_reduce import plan_reduce

    assert list(inspect.signature(plan_reduce).parameters) == ["rows"]  # no format: nothing to substitute
    assert plan_reduce([10, 10, 10, 10]) is True
    assert plan_reduce([10, 10, 10, 9]) is True  # 3% padding
    assert plan_reduce([40, 0, 0, 0]) is False  # 4x the elements padded
    assert plan_reduce([20, 20, 0, 0]) is False  # 2x padding: the all-to-all moves half (was a 4-bit reduce-scatter)
    assert plan_reduce([0, 0]) is False


def test_typo_fails_through_deepspeed_initialize(tmp_path):
    """The flag path: plain deepspeed.initialize (dict and JSON file) rejects the typo before starting anything."""
    cfg = with_fp8({"enabled": True, "gradients": {"fmt": "e4m3", "rounding": "nearest", "blok_size": 64}})
    with pytest.raises(fd.Fp8CommConfigError, match="fp8_comm.gradients.blok_size"):
        deepspeed.initialize(model=nn.Linear(4, 4), config=cfg)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(fd.Fp8CommConfigError, match="did you mean 'block_size'"):
        fd.initialize(model=nn.Linear(4, 4), config=str(path))
    assert not fd.is_installed()


# ------------------------------------------------------------------------------------ unsupported combinations
@pytest.mark.parametrize(
    "over, fragment",
    [
        ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage is 0"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_quantized_weights"),
        ({"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}}, "all_reduce_for_fetch"),
        ({"zero_optimization": {"stage": 2, "reduce_scatter": False}}, "reduce_scatter=false"),
        ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}, "contiguous_gradients=false"),
        ({"zero_optimization": {"stage": 1, "use_multi_rank_bucket_allreduce": False}}, "use_multi_rank_bucket"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "offload"),
        ({"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}, "BF16_Optimizer"),
    ],
)
def test_unsupported_combination(over, fragment):
    with pytest.raises(fd.Fp8CommUnsupportedError, match=fragment):
        fd.install(with_fp8({"gemm": False}, **over))
    assert not fd.is_installed()


@pytest.mark.parametrize(
    "stage, dtype, extra, fragment",
    [
        (2, "bf16", {}, r"WHOLE gradient \(4 bytes per parameter, float32: 0.1 MiB for this model's 16,512"),
        (3, "bf16", {"residual_dtype": "bf16"}, r"\(2 bytes per parameter, bfloat16"),
        (2, "bf16", {"residual_dtype": "fp8"}, r"\(1 byte per parameter plus 4 per parameter tensor, fp8: 0.0 MiB"),
        (1, "fp16", {}, "loss-scaled units"),
        (None, "bf16", {"allow_unpartitioned_residuals": True}, None),  # opted in: ZeRO-2 accepted
        (1, "bf16", {}, None),  # ZeRO-1 keeps full gradients anyway
    ],
)
def test_error_feedback_memory_policy(stage, dtype, extra, fragment):
    """Error feedback keeps the whole gradient's residual: ZeRO-2/3 refuse it (naming the cost) unless opted in."""
    over = {
        "zero_optimization": {"stage": stage or 2},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
    }
    section = {"gemm": False, "gradients": {"error_feedback": True, **extra}}
    model = nn.Linear(128, 128)
    if fragment is None:
        assert fd.install(with_fp8(section, **over), model) is not None
        assert "error feedback" in fd.summary()
        return
    with pytest.raises(fd.Fp8CommUnsupportedError, match=fragment):
        fd.install(with_fp8(section, **over), model)


@pytest.mark.parametrize("hierarchical", [True, False])
def test_error_feedback_refusal_states_two_level_share(hierarchical):
    """Under two levels a rank keeps only its rail's share of the residual (levels.rail_window): the refusal says so,
    and says nothing of it when two levels are off."""
    section = {"gemm": False, "hierarchical": hierarchical, "gradients": {"error_feedback": True}}
    over = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    with pytest.raises(fd.Fp8CommUnsupportedError) as e:
        fd.install(with_fp8(section, **over), nn.Linear(128, 128))
    said = "1/(ranks per node) of that" in str(e.value)
    assert said == hierarchical, str(e.value)


@pytest.mark.parametrize(
    "given, name",
    [("fp32", "float32"), ("float32", "float32"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp8", "fp8")],
)
def test_residual_dtype_spellings(given, name):
    """One spelling for every adapter (fp8comm.comm.RESIDUAL_DTYPES); this section's older "fp32"/"bf16" stay."""
    g = config.parse(with_fp8({"gradients": {"error_feedback": True, "residual_dtype": given}})).gradients
    assert g.residual_dtype == name and g.wire(None).residual_dtype == name


def test_stage0_without_comm_is_fine():
    st = fd.install(with_fp8({"weights": False, "gradients": False, "gemm": False}, zero_optimization={"stage": 0}))
    assert st is not None and "MoE dispatch FP8" in fd.summary()


# ------------------------------------------------------------------------------------------ version and targets
def test_version_range(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")
    with pytest.raises(fd.Fp8CommUnsupportedError, match="outside the range"):
        fd.install(with_fp8({"gemm": False}))
    monkeypatch.setenv(compat.ANY_VERSION_ENV, "1")
    assert fd.install(with_fp8({"gemm": False})) is not None  # the per-target checks alone decide


def test_changed_signature_is_an_error_and_patches_nothing(monkeypatch):
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero import stage3

    def reduce_scatter_coalesced(tensors, group=None, extra=None):  # a "new release" with another parameter
        raise AssertionError("never called")

    monkeypatch.setattr(stage3, "reduce_scatter_coalesced", reduce_scatter_coalesced)
    before = pp._dist_allgather_fn
    with pytest.raises(fd.Fp8CommUnsupportedError, match="zero3.grad_reduce.*parameters"):
        fd.install(with_fp8({"gemm": False}))
    assert pp._dist_allgather_fn is before and not fd.is_installed()


def test_caller_that_stopped_calling_is_an_error():
    t = compat.Target("demo", __name__, "with_fp8", ("section", "over"), ("test_every_target_checks_out",))
    with pytest.raises(fd.Fp8CommUnsupportedError, match="no longer calls 'with_fp8'"):
        compat.check_target(t)


def test_every_target_checks_out():
    for t in compat.TARGETS.values():
        compat.check_target(t)


# ------------------------------------------------------------------------------------------ install/uninstall
def _current(t):
    """What the name a target patches holds now (the _AllToAll hook replaces the whole class)."""
    attr = t.attr[: -len(".forward")] if t.attr == "_AllToAll.forward" else t.attr
    return fd.engine.Patcher._locate(t.module, attr)[2]


def test_install_uninstall_restores_everything():
    """Module-level names are replaced by dispatchers (methods wrapped per optimizer instance stay untouched at
    class level); uninstall() puts DeepSpeed's originals back, deepspeed.initialize included."""
    targets = list(compat.TARGETS.values())
    patched = [t for t in targets if t.patched]
    before = {t.key: _current(t) for t in targets}
    init_before = deepspeed.initialize
    fd.install(with_fp8({"gemm": False}))
    assert len(fd.engine._HOOKS) == len(patched) and fd.is_installed()
    for t in targets:
        now = _current(t)
        assert (now is not before[t.key] and getattr(now, "_fp8comm_hook", False)) == t.patched, t.key
    fd.uninstall()
    assert not fd.is_installed()
    for t in targets:
        assert _current(t) is before[t.key], t.key
    assert deepspeed.initialize is not init_before and deepspeed.initialize is fd.engine._ORIG_INIT
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert not getattr(DeepSpeedEngine.__dict__["__init__"], "_fp8comm_hook", False)


def test_dispatchers_installed_per_role_once():
    """Different sections share the dispatchers: a second install adds only roles the first did not need."""
    fd.install(with_fp8({"gemm": False, "gradients": False, "moe": False}))
    n = len(fd.engine._HOOKS)
    assert fd.engine._ROLES == {"weights"}
    fd.install(with_fp8({"gemm": False, "weights": {"fmt": "e5m2"}}))
    assert fd.engine._ROLES == {"weights", "gradients", "moe"} and len(fd.engine._HOOKS) > n
    m = len(fd.engine._HOOKS)
    fd.install(with_fp8({"gemm": False, "gradients": {"fmt": "e5m2"}}))
    assert len(fd.engine._HOOKS) == m


def test_shared_parameters_are_refused():
    """A model whose parameters belong to an fp8comm engine cannot be given to a second engine (one parameter is
    gathered and reduced by one hook): a clear error before DeepSpeed starts, with or without a section."""
    model = nn.Linear(4, 4)
    es = fd.EngineState(config.parse(with_fp8({"gemm": False})))
    es.attached = True
    fd.engine.tag(es, model.weight)
    for cfg in (BASE, with_fp8({"gemm": False, "weights": False})):
        with pytest.raises(fd.Fp8CommStateError, match="already belong to fp8comm engine"):
            deepspeed.initialize(model=model, config=cfg)
    es.detach()
    assert not hasattr(model.weight, "_fp8comm_engine")


def test_engine_guard_catches_a_bypassed_flag():
    """An engine built with an enabled section but without the hooks (an unwrapped initialize) is refused."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    with pytest.raises(fd.Fp8CommStateError, match="hooks are not installed"):
        DeepSpeedEngine(args=None, model=nn.Linear(4, 4), config=with_fp8({"gemm": False}))


def test_gemm_converts_before_the_engine():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    fd.install(with_fp8({"gemm": {"recipe": "tensorwise"}}), model)
    from fp8comm.gemm import Fp8Linear

    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 2
    assert "GEMMs FP8 tensorwise (2 linears)" in fd.summary()


def _documented_table(doc: str) -> dict:
    """{key path: default} from the Options table of docs/deepspeed.md (the key and default cells' backticked
    items, in order; `.x` continues the row's first key, "`a`, `b`" defaults pair up with the keys)."""
    import re

    section = doc[doc.index("## Options") :]
    section = section[: section.index("\n## ", 1)]
    out: dict = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([^`]+)`", cells[0])
        vals = [json.loads(v) for v in re.findall(r"`([^`]+)`", cells[1])]
        assert len(keys) == len(vals), f"docs row {line!r}: {len(keys)} keys, {len(vals)} defaults"
        head = keys[0].rsplit(".", 1)[0] if "." in keys[0] else ""
        for k, v in zip(keys, vals):
            k = head + k if k.startswith(".") else k
            assert k not in out, f"{k} documented twice"
            out[k] = v
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _docstring_block() -> dict:
    """The example section in the config module's docstring, comments dropped: valid JSON."""
    import re

    doc = config.__doc__ or ""
    block = doc[doc.index('"fp8_comm": {') :]
    block = block[: block.index("\n    }\n") + 6]
    return json.loads("{" + re.sub(r"#[^\n]*", "", block) + "}")["fp8_comm"]


def test_docs_list_every_option():
    """docs/deepspeed.md's Options table and the config module's docstring document every key of the section with
    its default: both are parsed and compared with the dataclass defaults (a documented default that differs, a
    missing or an unknown key fails)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "deepspeed.md").read_text()
    want = _flat(config.defaults())
    for where, got in (
        ("docs/deepspeed.md Options table", _flat(_documented_table(doc))),
        ("config module docstring", _flat(_docstring_block())),
    ):
        assert set(got) == set(want), (where, sorted(set(want) ^ set(got)))
        wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k] or type(got[k]) is not type(want[k])}
        assert not wrong, f"{where}: documented default != dataclass default: {wrong}"


def test_docs_check_can_fail():
    """The parsers see a changed default: the table with gemm.enabled back at true differs from the dataclass."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "deepspeed.md").read_text()
    row = "| `gemm.enabled` | `false` |"
    assert row in doc
    table = _flat(_documented_table(doc.replace(row, "| `gemm.enabled` | `true` |")))
    assert table["gemm.enabled"] is True != config.defaults()["gemm"]["enabled"]


@pytest.mark.slow  # a subprocess imports DeepSpeed: 15-50 s
def test_mutations_name_real_checks():
    """ds_mutations.py (the broken variants behind docs/deepspeed.md's "fails on" claims) names checks that exist in
    the scenario it launches, so the script cannot silently run nothing."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import ds_worker, ds_mutations\n"
        "names = {s: {f.__name__ for f in fns} for s, fns in ds_worker.SCENARIOS.items()}\n"
        "bad = [(m, c) for m, (_, s, cs) in ds_mutations.MUTATIONS.items() for c in cs if c not in names[s]]\n"
        "print(len(ds_mutations.MUTATIONS), bad); sys.exit(1 if bad else 0)"
    )
    p = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
