"""fp8comm: FP8 training GEMMs and FP8 collectives (weights, gradients, MoE tokens) for LLM pretraining."""
from .quant import (BlockScaling, DelayedScaling, Fp8Tensor, MXScaling, RowScaling, Scaling, TensorScaling,
                    dequantize, quantize)

__version__ = "0.1.0"
__all__ = ["quantize", "dequantize", "Fp8Tensor", "Scaling", "TensorScaling", "RowScaling", "BlockScaling",
           "MXScaling", "DelayedScaling"]
