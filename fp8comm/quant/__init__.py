"""fp8comm.quant: FP8 formats, scaling, Fp8Tensor, the packed wire format and the kernels that produce it."""

from .api import dequantize, quantize, quantize_with_transpose
from .dispatch import resolve_backend
from .formats import E4M3, E5M2, Fp8Format, get_format
from .fp4 import MXFP4, NVFP4, Fp4Format, Fp4Tensor, get_fp4_format
from .fp4_api import dequantize_fp4, quantize_fp4
from .scaling import (
    BlockScaling,
    DelayedScaling,
    MXScaling,
    RowScaling,
    Scaling,
    TensorScaling,
    get_scaling,
    scale_from_amax,
)
from .tensor import Fp8Tensor
from .wire import ChunkLayout, pack_chunks, unpack_chunks, unpack_sum

__all__ = [
    "quantize",
    "quantize_with_transpose",
    "dequantize",
    "resolve_backend",
    "E4M3",
    "E5M2",
    "Fp8Format",
    "get_format",
    "Scaling",
    "TensorScaling",
    "RowScaling",
    "BlockScaling",
    "MXScaling",
    "DelayedScaling",
    "get_scaling",
    "scale_from_amax",
    "Fp8Tensor",
    "ChunkLayout",
    "pack_chunks",
    "unpack_chunks",
    "unpack_sum",
    "MXFP4",
    "NVFP4",
    "Fp4Format",
    "Fp4Tensor",
    "get_fp4_format",
    "quantize_fp4",
    "dequantize_fp4",
]
