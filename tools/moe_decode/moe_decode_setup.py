"""Shared setup of the MoE decode measurement scripts (``try_moe_*.py``): a model preset's experts
drawn once (``fp4moe.bench.moe.random_experts``) and packed in MMA operand order, then a batch of
tokens with its routing per token count, from one generator in that order (so every script sees
the same weights and batches). GPU only."""
from dataclasses import dataclass

import torch

from fp4moe.ops import moe as moe_ops


@dataclass
class DecodeExperts:
    spec: object  # fp4moe.models preset
    E: int
    H: int
    I: int
    k: int
    w13: object  # FP4Tensor [E, 2I, H]
    w2: object  # FP4Tensor [E, H, I]
    p13: object  # MMA-order packs of w13 and w2 (ops.moe.mma_packed_experts)
    p2: object
    g13: tuple  # w13's globals as the grouped GEMM 1 takes them (ops.moe._weight_globals)
    gen: torch.Generator

    def batch(self, T: int):
        """(x [T, H] bf16, topk_ids, topk_weights) of T tokens under the preset's routing."""
        from fp4moe.bench.moe import _router

        x = torch.randn(T, self.H, device="cuda", dtype=torch.bfloat16, generator=self.gen)
        logits = torch.randn(T, self.E, device="cuda", dtype=torch.float32, generator=self.gen)
        ids, wts = _router(self.spec)(logits, None)[:2]
        return x, ids, wts


def decode_experts(model: str = "glm-5", seed: int = 0) -> DecodeExperts:
    from fp4moe.bench.moe import random_experts
    from fp4moe.models import get_model

    spec = get_model(model)
    E, H, I, k = spec.n_experts, spec.hidden, spec.expert_intermediate, spec.routing.top_k
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13, w2 = random_experts(E, H, I, spec.fmt, gen)
    return DecodeExperts(spec, E, H, I, k, w13, w2, moe_ops.mma_packed_experts(w13), moe_ops.mma_packed_experts(w2),
                         moe_ops._weight_globals(w13), gen)
