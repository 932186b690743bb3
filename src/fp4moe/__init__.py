"""fp4moe: FP4 (NVFP4, MXFP4) Mixture-of-Experts inference for every NVIDIA generation."""

from .formats import MXFP4, NVFP4, FP4Format, get_format
from .quantize import FP4Tensor, dequantize, quantize, quantize_stacked

__version__ = "0.1.0"

__all__ = ["FP4Format", "FP4Tensor", "MXFP4", "NVFP4", "dequantize", "get_format", "quantize", "quantize_stacked", "__version__"]
