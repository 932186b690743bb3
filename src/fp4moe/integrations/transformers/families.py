"""The MoE blocks of transformers 5.17 that fp4moe replaces, and how each one routes.

Read from the installed modeling files (``transformers/models/<type>/modeling_<type>.py``):

=================  ==========================  =========================================================
model_type         block class (attribute)     routing, as transformers computes it
=================  ==========================  =========================================================
``qwen3_moe``      ``Qwen3MoeSparseMoeBlock``  logits = x @ gate.weight^T in x's dtype; softmax in fp32
                   (``mlp``)                   over all experts; top-k; divided by their sum when
                                               ``norm_topk_prob``; weights cast to x's dtype
``deepseek_v3``,   ``DeepseekV3MoE``,          logits in fp32 (x and gate.weight cast); s = sigmoid;
``glm4_moe``,      ``Glm4MoeMoE``,             choose with s + ``gate.e_score_correction_bias``: group
``glm_moe_dsa``    ``GlmMoeDsaMoE`` (``mlp``)  score = sum of a group's top-2, keep ``topk_group`` of
                                               ``n_group`` groups, top-k inside; weights = unbiased s,
                                               / (sum + 1e-20) when ``norm_topk_prob``, x
                                               ``routed_scaling_factor`` (fp32); ``shared_experts`` (a
                                               SwiGLU MLP) added unweighted
``gpt_oss``        ``GptOssMLP`` (``mlp``,     logits = x @ router.weight^T + router.bias in x's dtype;
                   returns (out, scores))      top-k of the logits, softmax over those k in x's dtype;
                                               experts with biases and clamped SwiGLU (limit 7,
                                               alpha 1.702, gate/up interleaved)
=================  ==========================  =========================================================

fp4moe's routing (``fp4moe.ops.routing``) computes the same choices and weights in fp32 with its
own exp (within 1.2 ulp of the exact one), so against transformers it differs only by rounding:

* Qwen3-MoE and gpt-oss: transformers rounds the routing weights to bf16 before weighting the
  experts, fp4moe keeps them fp32 (a relative difference up to 2^-9 per weight); gpt-oss's softmax
  over the k runs in bf16 there, in fp32 here.
* DeepSeek-V3 / GLM: the logits are fp32 in both (``FP4MoE(router_dtype=torch.float32)``);
  ``torch.sigmoid`` versus fp4moe's sigmoid differ by a few ulp, which changes the selection only
  when two biased scores are that close.
* Combine: transformers adds each expert's bf16 output into a bf16 sum (in expert order);
  fp4moe sums the k weighted outputs in fp32 (slot order) and rounds once, then adds the shared
  expert in the same fp32 sum (transformers adds it in bf16 afterwards).
* Ties (equal scores): fp4moe picks the lowest expert id; ``torch.topk`` does not specify.
* The SwiGLU of the shared expert runs in fp32 (``fp4moe.nn.GatedMLP``), bf16 in transformers.

None of these is visible next to the FP4 quantization error (see the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ...models import Routing

__all__ = ["MoEFamily", "FAMILIES", "family_for"]


@dataclass(frozen=True)
class MoEFamily:
    """Where a family's MoE block keeps its parts, and its routing."""

    name: str
    block_classes: tuple[str, ...]  # class names of the transformers MoE block
    router: str  # the router submodule: its ``weight`` [E, H] (and ``bias``)
    router_bias: bool  # the router linear has a bias (added to the logits)
    selection_bias: str | None  # router buffer added to the scores for the choice only
    shared: str | None  # the shared-expert submodule (gate_proj, up_proj, down_proj)
    activation: Literal["silu", "gpt_oss"]
    router_fp32: bool  # logits computed in fp32
    returns_tuple: bool  # forward returns (out, router_scores)
    routing: Callable[[Any], Routing]
    n_experts: Callable[[Any], int]
    intermediate: Callable[[Any], int]

    def check_config(self, config) -> None:
        act = getattr(config, "hidden_act", "silu")
        if self.activation == "silu" and act != "silu":
            raise ValueError(f"{self.name}: hidden_act {act!r} is not supported; fp4moe's experts run SwiGLU (silu)")


def _softmax(c) -> Routing:
    return Routing("softmax", top_k=int(c.num_experts_per_tok), renormalize=bool(c.norm_topk_prob))


def _sigmoid_bias(c) -> Routing:
    return Routing("sigmoid_bias", top_k=int(c.num_experts_per_tok), renormalize=bool(c.norm_topk_prob),
                   n_group=int(c.n_group or 1), topk_group=int(c.topk_group or 1),
                   routed_scaling_factor=float(c.routed_scaling_factor))


def _gpt_oss(c) -> Routing:
    return Routing("gpt_oss", top_k=int(c.num_experts_per_tok))


def _deepseek_like(name: str, block: str) -> MoEFamily:
    return MoEFamily(name, (block,), router="gate", router_bias=False, selection_bias="e_score_correction_bias",
                     shared="shared_experts", activation="silu", router_fp32=True, returns_tuple=False,
                     routing=_sigmoid_bias, n_experts=lambda c: int(c.n_routed_experts),
                     intermediate=lambda c: int(c.moe_intermediate_size))


FAMILIES: dict[str, MoEFamily] = {
    "qwen3_moe": MoEFamily("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), router="gate", router_bias=False,
                           selection_bias=None, shared=None, activation="silu", router_fp32=False,
                           returns_tuple=False, routing=_softmax, n_experts=lambda c: int(c.num_experts),
                           intermediate=lambda c: int(c.moe_intermediate_size)),
    "deepseek_v3": _deepseek_like("deepseek_v3", "DeepseekV3MoE"),
    "glm4_moe": _deepseek_like("glm4_moe", "Glm4MoeMoE"),
    # GLM-5 (``GlmMoeDsaMoE``: the router, experts and shared expert of DeepSeek-V3, read the same way)
    "glm_moe_dsa": _deepseek_like("glm_moe_dsa", "GlmMoeDsaMoE"),
    "gpt_oss": MoEFamily("gpt_oss", ("GptOssMLP",), router="router", router_bias=True, selection_bias=None,
                         shared=None, activation="gpt_oss", router_fp32=False, returns_tuple=True, routing=_gpt_oss,
                         n_experts=lambda c: int(c.num_local_experts), intermediate=lambda c: int(c.intermediate_size)),
}


def family_for(model_type: str | None, model_class: str = "") -> MoEFamily:
    """The family of ``model_type``; a clear error for a model without an MoE block fp4moe knows."""
    family = FAMILIES.get(str(model_type))
    if family is None:
        what = f"model class {model_class} (model_type {model_type!r})" if model_class else f"model_type {model_type!r}"
        raise ValueError(f"{what} has no MoE block fp4moe knows; supported model types: {', '.join(FAMILIES)}")
    return family
