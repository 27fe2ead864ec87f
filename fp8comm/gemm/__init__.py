"""FP8 GEMMs and Fp8Linear: recipes, backends (torch._scaled_mm, Triton, CPU emulation), model conversion."""

from .backends import BACKENDS, gemm
from .convert import ConversionReport, convert_to_fp8, set_weight_cache
from .linear import Fp8Linear, strip_fp8_state
from .recipes import RECIPES, Fp8Recipe, RoleConfig, get_recipe
from .telemetry import Telemetry

__all__ = [
    "Fp8Linear",
    "convert_to_fp8",
    "set_weight_cache",
    "ConversionReport",
    "strip_fp8_state",
    "Fp8Recipe",
    "RoleConfig",
    "RECIPES",
    "get_recipe",
    "gemm",
    "BACKENDS",
    "Telemetry",
]
