"""Hugging Face transformers (5.17) models with their MoE blocks on fp4moe.

``load_fp4_model(path)`` loads a quantized checkpoint (what ``fp4moe quantize`` writes, ModelOpt
NVFP4, compressed-tensors nvfp4-pack-quantized, gpt-oss MXFP4) into the model class its
``config.json`` names, every MoE block replaced by an ``FP4MoEBlock`` (``fp4moe.nn.FP4MoE``) and,
optionally, every other quantized linear by an ``FP4Linear``; ``model.generate`` then works as
usual, and ``generate(model, input_ids, max_new_tokens)`` decodes greedily with each step one CUDA
graph (``decode``). ``quantize_model`` quantizes a bf16 model in memory (``convert``). Supported families and how their routing compares with transformers': ``families``.
``e2e`` builds tiny (or larger) random models, quantizes, loads and compares them with the bf16
model (``fp4moe demo --e2e``).

Importing this module does not import transformers; the functions do.
"""

from .convert import quantize_model
from .decode import DecodeGraphs, generate
from .families import FAMILIES, MoEFamily, family_for
from .loader import FP4MoEBlock, LoadReport, load_fp4_model, transformers_config

__all__ = ["FAMILIES", "DecodeGraphs", "FP4MoEBlock", "LoadReport", "MoEFamily", "family_for", "generate",
           "load_fp4_model", "quantize_model", "transformers_config"]
