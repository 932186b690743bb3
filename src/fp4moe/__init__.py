"""fp4moe: FP4 (NVFP4, MXFP4) Mixture-of-Experts inference for every NVIDIA generation."""

__version__ = "0.1.0"

# the names below are imported on first use (PEP 562), so that `import fp4moe` and the command line
# start without importing torch
_LAZY = {"MXFP4": "formats", "NVFP4": "formats", "FP4Format": "formats", "get_format": "formats",
         "FP4Tensor": "quantize", "dequantize": "quantize", "quantize": "quantize", "quantize_stacked": "quantize"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4moe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

__all__ = ["FP4Format", "FP4Tensor", "MXFP4", "NVFP4", "dequantize", "get_format", "quantize", "quantize_stacked", "__version__"]
