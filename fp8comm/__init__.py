"""fp8comm: FP8 training GEMMs and FP8 collectives (weights, gradients, MoE tokens) for LLM pretraining."""
from .comm import (all_gather, all_gather_into, all_reduce, all_reduce_into, all_to_all, comm_stats,
                   format_comm_stats, reduce_scatter, reduce_scatter_into, reset_comm_stats)
from .gemm import ConversionReport, Fp8Linear, Fp8Recipe, convert_to_fp8, get_recipe
from .quant import (BlockScaling, DelayedScaling, Fp8Tensor, MXScaling, RowScaling, Scaling, TensorScaling,
                    dequantize, quantize)

__version__ = "0.1.0"
__all__ = ["quantize", "dequantize", "Fp8Tensor", "Scaling", "TensorScaling", "RowScaling", "BlockScaling",
           "MXScaling", "DelayedScaling", "all_gather", "all_gather_into", "reduce_scatter", "reduce_scatter_into",
           "all_reduce", "all_reduce_into", "all_to_all", "comm_stats", "reset_comm_stats", "format_comm_stats",
           "Fp8Linear", "convert_to_fp8", "ConversionReport", "Fp8Recipe", "get_recipe"]
