"""fp4moe.integrations.transformers.quantize_model: in-memory quantization, the checkpoint path's model.

The checkpoint writer quantizes from the stored bf16 values through fp32; some global scales then
differ from an in-memory quantization of the bf16 tensors by a rounding, so the two models agree to
far below their quantization error, not bit for bit."""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fp4moe.checkpoints import write_checkpoint  # noqa: E402
from fp4moe.integrations.transformers import FP4MoEBlock, load_fp4_model  # noqa: E402
from fp4moe.integrations.transformers.convert import quantize_model  # noqa: E402
from fp4moe.integrations.transformers.e2e import build_model  # noqa: E402
from fp4moe.nn import FP4Linear  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_guard")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_same_model_as_the_checkpoint_path(family, tmp_path, device):
    model = build_model(family, "tiny", seed=4)
    model.save_pretrained(tmp_path / "bf16")
    write_checkpoint(tmp_path / "bf16", tmp_path / "q", progress=False)
    loaded = load_fp4_model(tmp_path / "q", device=device)
    model = model.to(device)
    converted = quantize_model(copy.deepcopy(model))
    assert sum(isinstance(m, FP4MoEBlock) for m in converted.modules()) == len(loaded.fp4moe_report.moe_blocks)
    assert sorted(n for n, m in converted.named_modules() if isinstance(m, FP4Linear)) == \
        sorted(n for n, m in loaded.named_modules() if isinstance(m, FP4Linear))
    ids = torch.randint(1, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref, a, b = model(ids).logits.float(), loaded(ids).logits.float(), converted(ids).logits.float()
    quant_err = float((a - ref).norm() / ref.norm())
    assert float((b - a).norm() / a.norm()) < 0.25 * quant_err


def test_refusals():
    with pytest.raises(ValueError, match="gpt-oss"):
        quantize_model(build_model("gpt_oss", "tiny"))
    with pytest.raises(ValueError, match="no MoE block fp4moe knows"):
        quantize_model(torch.nn.Linear(4, 4))


def _tiny_glm5():
    """A tiny random GLM-5-class model (``glm_moe_dsa``: MLA + the sparse-attention indexer, one dense
    layer, one MoE layer with a shared expert)."""
    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
        index_topk=8, index_head_dim=32, index_n_heads=2, first_k_dense_replace=1, max_position_embeddings=256,
        initializer_range=1 / 8, pad_token_id=0, bos_token_id=0, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()


@pytest.mark.skipif(not hasattr(transformers, "GlmMoeDsaConfig"), reason="transformers without glm_moe_dsa")
def test_glm5_class_loads_and_converts_alike(tmp_path, device):
    """GLM-5's class through both paths; the indexer stays bf16 (its code casts inputs to its weights' dtype)."""
    model = _tiny_glm5()
    model.save_pretrained(tmp_path / "bf16")
    write_checkpoint(tmp_path / "bf16", tmp_path / "q", progress=False)
    loaded = load_fp4_model(tmp_path / "q", device=device)
    assert loaded.fp4moe_report.moe_blocks == ["model.layers.1.mlp"]
    assert not [n for n in loaded.fp4moe_report.fp4_linears if ".indexer." in n]
    model = model.to(device)
    converted = quantize_model(copy.deepcopy(model))
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref, a, b = model(ids).logits.float(), loaded(ids).logits.float(), converted(ids).logits.float()
    quant_err = float((a - ref).norm() / ref.norm())
    assert float((b - a).norm() / a.norm()) < 0.25 * quant_err
