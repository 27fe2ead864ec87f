"""FP8 training recipes: how each GEMM operand role (input, weight, grad) is quantized, as frozen configs.

A recipe names, per role, the FP8 format, the scale granularity along the GEMM's contraction dimension, the scale
encoding, the margin and where the scale comes from (current amax, delayed amax history, a constant, or none).
Named presets reproduce the seed paper (fp8_amax, cscale), torchao/TE (tensorwise, delayed, rowwise),
DeepSeek-V3 (blockwise) and OCP MX (mxfp8); `fp8_noscale` is the negative control.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import Fp8CommError
from ..quant import Scaling, get_format

ROLES = ("input", "weight", "grad")
GRANULARITIES = ("tensor", "row", "block", "mx")
SCALE_SOURCES = ("current", "delayed", "constant", "none")


@dataclass(frozen=True)
class RoleConfig:
    """Quantization of one operand role.

    granularity: tensor (one scale), row (one scale per row of the operand's [rows, K] GEMM view), block
    (`block_rows` x `block` tiles, K-extent `block`), mx (1 x `block` with E8M0 scales).
    source: current (amax of this tensor now), delayed (amax history), constant (2**-bias), none (scale 1: a plain
    saturating cast, the negative control).
    """

    fmt: str = "e4m3"
    granularity: str = "tensor"
    block: int = 128
    block_rows: int = 1
    encoding: str = "fp32"
    margin: int = 0
    source: str = "current"

    def __post_init__(self) -> None:
        get_format(self.fmt)  # raises a clear error for an unknown format
        if self.granularity not in GRANULARITIES:
            raise Fp8CommError(f"unknown granularity {self.granularity!r}; valid: {', '.join(GRANULARITIES)}")
        if self.source not in SCALE_SOURCES:
            raise Fp8CommError(f"unknown scale source {self.source!r}; valid: {', '.join(SCALE_SOURCES)}")
        if self.source != "current" and self.granularity != "tensor":
            raise Fp8CommError(f"{self.source} scaling keeps one scale per tensor; granularity must be 'tensor'")
        if self.block_rows not in (1, self.block):
            raise Fp8CommError(f"block_rows must be 1 or equal to block ({self.block}), got {self.block_rows}")
        Scaling(1, self.block, self.encoding, self.margin)  # validates encoding, margin and block

    @property
    def scaling(self) -> Scaling:
        """The quant-core Scaling over the operand's [rows, K] view (K = the GEMM's contraction dim)."""
        if self.granularity == "tensor":
            return Scaling(None, None, self.encoding, self.margin)
        if self.granularity == "row":
            return Scaling(1, None, self.encoding, self.margin)
        if self.granularity == "mx":
            return Scaling(1, self.block, "e8m0", 0)
        return Scaling(self.block_rows, self.block, self.encoding, self.margin)

    @property
    def transpose_invariant(self) -> bool:
        """True when the transposed operand is the same codes with transposed scales (no re-quantization)."""
        return self.granularity == "tensor" or (self.granularity == "block" and self.block_rows == self.block)

    def describe(self) -> str:
        src = "" if self.source == "current" else f" {self.source}"
        return f"{self.fmt} {self.scaling.describe()}{src}"


@dataclass(frozen=True)
class Fp8Recipe:
    """A complete Fp8Linear recipe: one RoleConfig per role plus the state of delayed/constant scaling.

    history_len / amax_reduce: delayed scaling's amax history (reduce 'max' or 'most_recent').
    constant_bias: FP8-CSCALE's bias b (the seed paper's t8 = cast(t * 2**b)); the dequant scale is 2**-b.
    """

    name: str
    input: RoleConfig
    weight: RoleConfig
    grad: RoleConfig
    history_len: int = 16
    amax_reduce: str = "max"
    constant_bias: int = 0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise Fp8CommError(f"history_len must be >= 1, got {self.history_len}")
        if self.amax_reduce not in ("max", "most_recent"):
            raise Fp8CommError(f"unknown amax_reduce {self.amax_reduce!r}; valid: max, most_recent")
        if not isinstance(self.constant_bias, int) or abs(self.constant_bias) > 100:
            raise Fp8CommError(f"constant_bias must be an int in [-100, 100], got {self.constant_bias!r}")

    def role(self, role: str) -> RoleConfig:
        if role not in ROLES:
            raise Fp8CommError(f"unknown role {role!r}; valid: {', '.join(ROLES)}")
        return getattr(self, role)

    @property
    def delayed(self) -> bool:
        return any(self.role(r).source == "delayed" for r in ROLES)

    def describe(self) -> str:
        return f"{self.name}: " + "; ".join(f"{r} {self.role(r).describe()}" for r in ROLES)


def _tensor(fmt: str, **kw) -> RoleConfig:
    return RoleConfig(fmt=fmt, granularity="tensor", **kw)


def _presets() -> dict[str, Fp8Recipe]:
    e4, e5 = "e4m3", "e5m2"
    pow2 = dict(encoding="pow2")
    return {
        r.name: r
        for r in [
            # Seed paper FP8-AMAX: per tensor, power-of-two scales; margin 3 on gradients only (Graphcore's layer),
            # E4 weights/activations, E5 gradients.
            Fp8Recipe(
                "fp8_amax",
                _tensor(e4, **pow2),
                _tensor(e4, **pow2),
                _tensor(e5, margin=3, **pow2),
                notes="Perez et al. 2023 FP8-AMAX",
            ),
            # Seed paper FP8-CSCALE: one constant bias for every tensor for the whole run (sweep it).
            Fp8Recipe(
                "cscale",
                _tensor(e4, source="constant", **pow2),
                _tensor(e4, source="constant", **pow2),
                _tensor(e5, source="constant", **pow2),
                notes="Perez et al. 2023 FP8-CSCALE",
            ),
            # TE/torchao delayed scaling: the scale comes from the max of the last 16 amax values.
            Fp8Recipe(
                "delayed",
                _tensor(e4, source="delayed"),
                _tensor(e4, source="delayed"),
                _tensor(e5, source="delayed"),
                notes="TE / torchao delayed scaling (HYBRID formats)",
            ),
            Fp8Recipe("tensorwise", _tensor(e4), _tensor(e4), _tensor(e5), notes="exact fp32 per-tensor scales"),
            Fp8Recipe(
                "rowwise",
                RoleConfig(e4, "row"),
                RoleConfig(e4, "row"),
                RoleConfig(e4, "row"),
                notes="torchao rowwise: one scale per row along K of every GEMM operand",
            ),
            # DeepSeek-V3: 1x128 activations and gradients, 128x128 weights, E4M3 everywhere, fp32 promotion per 128.
            Fp8Recipe(
                "blockwise",
                RoleConfig(e4, "block", 128),
                RoleConfig(e4, "block", 128, block_rows=128),
                RoleConfig(e4, "block", 128),
                notes="DeepSeek-V3",
            ),
            Fp8Recipe(
                "mxfp8",
                RoleConfig(e4, "mx", 32),
                RoleConfig(e4, "mx", 32),
                RoleConfig(e4, "mx", 32),
                notes="OCP MXFP8: 1x32 blocks, E8M0 scales",
            ),
            # Negative control: cast to FP8 with scale 1 (saturating), no scaling at all.
            Fp8Recipe(
                "fp8_noscale",
                _tensor(e4, source="none"),
                _tensor(e4, source="none"),
                _tensor(e5, source="none"),
                notes="negative control: plain cast, no scaling",
            ),
        ]
    }


RECIPES: dict[str, Fp8Recipe] = _presets()


def get_recipe(recipe: str | Fp8Recipe, **overrides) -> Fp8Recipe:
    """A preset by name (or a recipe itself), with top-level fields replaced, e.g. get_recipe("cscale",
    constant_bias=4)."""
    if isinstance(recipe, Fp8Recipe):
        r = recipe
    elif isinstance(recipe, str) and recipe in RECIPES:
        r = RECIPES[recipe]
    else:
        raise Fp8CommError(f"unknown recipe {recipe!r}; valid: {', '.join(RECIPES)} (or an Fp8Recipe)")
    return replace(r, **overrides) if overrides else r
