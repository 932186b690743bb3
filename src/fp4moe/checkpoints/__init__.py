"""Checkpoints: read ModelOpt NVFP4, compressed-tensors NVFP4 and gpt-oss MXFP4 models; write NVFP4.

* :class:`Checkpoint` (``open_checkpoint``): a model folder, its detected format, config and
  exclusion patterns; ``linear(name)`` and ``experts(layer_prefix)`` read quantized weights as
  FP4Tensors (experts stacked in the FP4MoE layout), ``tensor(name)`` anything else.
* :func:`write_checkpoint`: a bf16 model to ModelOpt or compressed-tensors NVFP4, streamed layer
  by layer into a temporary folder that is renamed into place.
* :class:`CheckpointError`: every bad input (missing or extra tensors, wrong dtype or shape,
  corrupted files, unsupported formats), naming the file or tensor, expected and found.

safetensors only; pickle files are never opened.
"""

from .errors import CheckpointError

# imported on first use (PEP 562): the command line mounts ``checkpoints.cli`` without torch
_LAZY = {"Checkpoint": "reader", "ExpertWeights": "reader", "LinearWeights": "reader", "ModuleEntry": "reader",
         "open_checkpoint": "reader", "checkpoint_global_scale": "scales", "WRITE_FORMATS": "writer",
         "WriteReport": "writer", "write_checkpoint": "writer"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4moe.checkpoints' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ExpertWeights",
    "LinearWeights",
    "ModuleEntry",
    "WRITE_FORMATS",
    "WriteReport",
    "checkpoint_global_scale",
    "open_checkpoint",
    "write_checkpoint",
]
