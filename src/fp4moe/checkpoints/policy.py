"""Which modules are (or are to be) quantized: exclusion patterns and the writer's rule.

Exclusion patterns, as each format writes them:

* ModelOpt ``exclude_modules`` / ``ignore`` and gpt-oss ``modules_to_not_convert``: fnmatch
  wildcards (``lm_head``, ``model.layers.*.mlp.gate``, ``model.layers.0.self_attn*``);
* compressed-tensors ``ignore``: exact module names or ``re:<regex>``.

fp4moe accepts all three spellings everywhere. A pattern that matches a module also covers its
children (``model.layers.0.self_attn`` excludes ``model.layers.0.self_attn.q_proj``), as vLLM
and the formats' own tools read them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

__all__ = ["match_exclude", "Decision", "quantize_decision", "module_of", "BLOCK_K"]

#: NVFP4 block size: a quantized linear's K must be a multiple of it.
BLOCK_K = 16

#: Leaf module names of Linear projections in Hugging Face decoder models (attention and MLP,
#: dense, shared and routed experts): Llama/Qwen/DeepSeek/GLM ``*_proj`` (``kv_a_proj_with_mqa``
#: included), Mixtral experts ``w1 w2 w3``, GPT-style ``fc1 fc2 c_fc c_proj c_attn dense ...``.
LINEAR_LEAVES: tuple[str, ...] = ("*_proj", "*_proj_with_mqa", "w1", "w2", "w3", "fc1", "fc2", "c_fc", "c_proj",
                                  "c_attn", "dense", "query_key_value", "dense_h_to_4h", "dense_4h_to_h")


def module_of(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    return name.rsplit(".", 1)[0] if "." in name else name


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or fnmatchcase(name, pattern)


def match_exclude(patterns: Iterable[str], name: str) -> str | None:
    """The first pattern that excludes module (or tensor) ``name`` or one of its parents, else None."""
    candidates = _ancestors(name)
    for pattern in patterns:
        if any(_matches(pattern, c) for c in candidates):
            return pattern
    return None


@dataclass(frozen=True)
class Decision:
    """What the writer does with one source tensor, and why (shown in its report)."""

    quantize: bool
    reason: str


def quantize_decision(name: str, dtype: str, shape: Sequence[int], exclude: Sequence[str] = ()) -> Decision:
    """Whether the writer quantizes tensor ``name`` (safetensors dtype name, shape) to NVFP4.

    Quantized: the 2-D floating-point ``.weight`` of a Linear projection (a leaf name in
    :data:`LINEAR_LEAVES`: attention and MLP projections, dense, shared and routed experts) whose
    K (columns) is a multiple of 16, unless a pattern in ``exclude`` matches its module. Never:
    biases and other non-weights, embeddings, norms, ``lm_head``, routers (``mlp.gate``,
    ``router``, ``*_gate``), the sparse-attention indexer of GLM-5 / DeepSeek-V3.2 (``*.indexer.*``).
    """
    if not name.endswith(".weight"):
        return Decision(False, "not a weight")
    module = module_of(name)
    leaf = module.rsplit(".", 1)[-1]
    if dtype not in ("BF16", "F16", "F32"):
        return Decision(False, f"dtype {dtype} is not bf16/fp16/fp32")
    if len(shape) != 2:
        return Decision(False, f"{len(shape)}-D, not a Linear weight")
    if leaf == "lm_head":
        return Decision(False, "lm_head")
    if "embed" in leaf or leaf in ("wte", "wpe"):
        return Decision(False, "embedding")
    if "norm" in leaf:
        return Decision(False, "norm")
    if leaf in ("gate", "router") or leaf.endswith("_gate"):
        return Decision(False, "router")
    if ".indexer." in f".{module}.":  # DeepSeek sparse attention (GLM-5): its code casts inputs to the weights' dtype
        return Decision(False, "sparse-attention indexer")
    pattern = match_exclude(exclude, module)
    if pattern is not None:
        return Decision(False, f"excluded by {pattern!r}")
    if not any(fnmatchcase(leaf, p) for p in LINEAR_LEAVES):
        return Decision(False, "not a Linear projection")
    if shape[1] % BLOCK_K:
        return Decision(False, f"K={shape[1]} is not a multiple of {BLOCK_K}")
    return Decision(True, "quantized")
