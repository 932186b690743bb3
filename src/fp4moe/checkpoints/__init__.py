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
from .reader import Checkpoint, ExpertWeights, LinearWeights, ModuleEntry, open_checkpoint
from .scales import checkpoint_global_scale
from .writer import WRITE_FORMATS, WriteReport, write_checkpoint

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
