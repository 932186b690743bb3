"""Checkpoints: ModelOpt / compressed-tensors NVFP4 and gpt-oss MXFP4 read, NVFP4 written, bad input refused.

Tiny bf16 "models" (Qwen3-MoE-like and DeepSeek-V3-like configs, random weights) are written with
safetensors in tmp_path; nothing needs transformers. Round trips and cross-format equality are
bit-exact; every bad input must raise CheckpointError naming the file or tensor.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp4moe import dequantize as dequantize_fp4
from fp4moe.checkpoints import Checkpoint, CheckpointError, write_checkpoint
from fp4moe.checkpoints.policy import match_exclude, quantize_decision
from fp4moe.checkpoints.safetensors_io import read_header
from fp4moe.checkpoints.scales import checkpoint_global_scale, reciprocal_round_trips
from fp4moe.checkpoints.stacking import share_global, stack_experts
from fp4moe.formats import MXFP4, NVFP4
from fp4moe.quantize import FP4Tensor, dequantize, nvfp4_global_scale, quantize

FORMATS = ("modelopt", "compressed-tensors")

# ---------------------------------------------------------------------------------------------
# tiny models

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 2,
    "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "vocab_size": 96,
}


def _rand(gen: torch.Generator, *shape: int, scale: float = 0.05) -> torch.Tensor:
    # a per-row spread of magnitudes so block scales differ; bf16 like real checkpoints
    rows = torch.exp(torch.randn(shape[0], *([1] * (len(shape) - 1)), generator=gen))
    return (torch.randn(*shape, generator=gen) * rows * scale).to(torch.bfloat16)


def _experts(t: dict, gen, prefix: str, e: int, i: int, h: int) -> None:
    for x in range(e):
        t[f"{prefix}.experts.{x}.gate_proj.weight"] = _rand(gen, i, h)
        t[f"{prefix}.experts.{x}.up_proj.weight"] = _rand(gen, i, h)
        t[f"{prefix}.experts.{x}.down_proj.weight"] = _rand(gen, h, i)


def qwen3_moe_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    c, gen = QWEN3_MOE, torch.Generator().manual_seed(seed)
    h, v, d = c["hidden_size"], c["vocab_size"], c["head_dim"]
    t = {"model.embed_tokens.weight": _rand(gen, v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": _rand(gen, v, h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[f"{p}.self_attn.q_proj.weight"] = _rand(gen, c["num_attention_heads"] * d, h)
        t[f"{p}.self_attn.k_proj.weight"] = _rand(gen, c["num_key_value_heads"] * d, h)
        t[f"{p}.self_attn.v_proj.weight"] = _rand(gen, c["num_key_value_heads"] * d, h)
        t[f"{p}.self_attn.o_proj.weight"] = _rand(gen, h, c["num_attention_heads"] * d)
        t[f"{p}.self_attn.q_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        t[f"{p}.self_attn.k_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        t[f"{p}.mlp.gate.weight"] = _rand(gen, c["num_experts"], h)
        _experts(t, gen, f"{p}.mlp", c["num_experts"], c["moe_intermediate_size"], h)
    return t


def deepseek_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    c, gen = DEEPSEEK_V3, torch.Generator().manual_seed(seed)
    h, v, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    t = {"model.embed_tokens.weight": _rand(gen, v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": _rand(gen, v, h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[f"{p}.self_attn.q_a_proj.weight"] = _rand(gen, c["q_lora_rank"], h)
        t[f"{p}.self_attn.q_a_layernorm.weight"] = torch.ones(c["q_lora_rank"], dtype=torch.bfloat16)
        # K = q_lora_rank = 24, not a multiple of 16: must stay bf16
        t[f"{p}.self_attn.q_b_proj.weight"] = _rand(gen, heads * qk, c["q_lora_rank"])
        t[f"{p}.self_attn.kv_a_proj_with_mqa.weight"] = _rand(gen, c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
        t[f"{p}.self_attn.kv_a_layernorm.weight"] = torch.ones(c["kv_lora_rank"], dtype=torch.bfloat16)
        t[f"{p}.self_attn.kv_b_proj.weight"] = _rand(gen, heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                                                     c["kv_lora_rank"])
        t[f"{p}.self_attn.o_proj.weight"] = _rand(gen, h, heads * c["v_head_dim"])
        if layer < c["first_k_dense_replace"]:
            t[f"{p}.mlp.gate_proj.weight"] = _rand(gen, c["intermediate_size"], h)
            t[f"{p}.mlp.up_proj.weight"] = _rand(gen, c["intermediate_size"], h)
            t[f"{p}.mlp.down_proj.weight"] = _rand(gen, h, c["intermediate_size"])
        else:
            i = c["moe_intermediate_size"]
            t[f"{p}.mlp.gate.weight"] = _rand(gen, c["n_routed_experts"], h)
            t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(c["n_routed_experts"], generator=gen)
            _experts(t, gen, f"{p}.mlp", c["n_routed_experts"], i, h)
            t[f"{p}.mlp.shared_experts.gate_proj.weight"] = _rand(gen, i, h)
            t[f"{p}.mlp.shared_experts.up_proj.weight"] = _rand(gen, i, h)
            t[f"{p}.mlp.shared_experts.down_proj.weight"] = _rand(gen, h, i)
    return t


def save_model(folder: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A Hugging Face model folder: config.json, one file or ``shards`` files + index, a tokenizer file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        return folder
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


MODELS = {"qwen3-moe": (QWEN3_MOE, qwen3_moe_tensors, 2), "deepseek-v3": (DEEPSEEK_V3, deepseek_tensors, 1)}


@pytest.fixture(params=sorted(MODELS))
def bf16_model(request, tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    config, make, shards = MODELS[request.param]
    tensors = make()
    return save_model(tmp_path / request.param, config, tensors, shards=shards), tensors


def writer_reference(w: torch.Tensor) -> FP4Tensor:
    """What the writer must store for ``w``: fp4moe.quantize with the writer's global scale."""
    return quantize(w, "nvfp4", global_scale=checkpoint_global_scale(w.abs().amax().float()))


def assert_fp4_equal(got: FP4Tensor, want: FP4Tensor) -> None:
    assert got.fmt == want.fmt and got.shape == want.shape
    assert torch.equal(got.data, want.data)
    assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
    if want.global_scale is None:
        assert got.global_scale is None
    else:
        assert torch.equal(got.global_scale.reshape(want.global_scale.shape), want.global_scale)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = a.dtype == b.dtype and a.shape == b.shape
    return same and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# writer -> reader round trip


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bit_exact(bf16_model, tmp_path, fmt):
    src_dir, tensors = bf16_model
    report = write_checkpoint(src_dir, tmp_path / "out", fmt, progress=False)
    with Checkpoint(tmp_path / "out") as ckpt:
        assert ckpt.format == fmt and not ckpt.static_input_scales
        assert sorted(ckpt.linear_names()) == sorted(report.quantized)
        for name, w in tensors.items():
            info = ckpt.info(name) if name in ckpt.tensor_names() else None
            if quantize_decision(name, "BF16" if w.dtype == torch.bfloat16 else "F32", tuple(w.shape)).quantize:
                lin = ckpt.linear(name)
                assert_fp4_equal(lin.weight, writer_reference(w))
                assert lin.bias is None and lin.input_global_scale is None
            else:
                assert info is not None, f"{name} was not copied"
                assert bits_equal(ckpt.tensor(name), w), name
    # copied side files, never the source's weights
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_what_is_quantized_and_what_is_kept(tmp_path):
    src = save_model(tmp_path / "ds", DEEPSEEK_V3, deepseek_tensors())
    report = write_checkpoint(src, tmp_path / "out", "modelopt", progress=False)
    kept = report.kept
    assert kept["lm_head"] == "lm_head"
    assert kept["model.embed_tokens"] == "embedding"
    assert kept["model.layers.1.mlp.gate"] == "router"
    assert kept["model.layers.0.self_attn.q_b_proj"] == "K=24 is not a multiple of 16"
    quantized = set(report.quantized)
    for m in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts.3.down_proj",
              "model.layers.1.mlp.shared_experts.up_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
              "model.layers.1.self_attn.o_proj"):
        assert m in quantized
    hf_quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "W4A16_NVFP4" and hf_quant["group_size"] == 16
    assert "lm_head" in hf_quant["exclude_modules"] and "model.layers.1.mlp.gate" in hf_quant["exclude_modules"]
    with Checkpoint(tmp_path / "out") as ckpt:
        assert ckpt.is_excluded("lm_head") and ckpt.is_excluded("model.layers.1.mlp.gate.weight")
        assert not ckpt.is_excluded("model.layers.1.mlp.experts.0.up_proj")
        assert ckpt.moe_layers() == ["model.layers.1.mlp"]
        kinds = {m.name: m.kind for m in ckpt.modules()}
        assert kinds["model.layers.1.mlp.experts.2.up_proj"] == "nvfp4_linear"
        assert kinds["model.layers.1.mlp.gate"] == "tensors"
        # the router's correction bias (fp32) survives unchanged
        assert ckpt.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "F32"


def test_both_formats_dequantize_to_the_same_weights(bf16_model, tmp_path):
    src_dir, tensors = bf16_model
    for fmt in FORMATS:
        write_checkpoint(src_dir, tmp_path / fmt, fmt, progress=False)
    with Checkpoint(tmp_path / "modelopt") as mo, Checkpoint(tmp_path / "compressed-tensors") as ct:
        assert mo.linear_names() == ct.linear_names() and mo.linear_names()
        for name in mo.linear_names():
            a, b = mo.linear(name).weight, ct.linear(name).weight
            assert_fp4_equal(a, b)
            assert torch.equal(dequantize(a, torch.float32), dequantize(b, torch.float32))
            # and both are the bf16 weight to within NVFP4's error (an inverted global would be off by amax^2)
            w = tensors[name + ".weight"].float()
            rel = (dequantize(a, torch.float32) - w).norm() / w.norm()
            assert rel < 0.15, (name, rel)
        # the stored globals really are inverted in compressed-tensors
        name = mo.linear_names()[0]
        stored_mo = mo.tensor(name + ".weight_scale_2")
        stored_ct = ct.tensor(name + ".weight_global_scale")
        assert stored_mo.shape == () and stored_ct.shape == (1,)
        assert torch.equal(stored_ct.reshape(()), 1.0 / stored_mo)
        for prefix in mo.moe_layers():
            x, y = mo.experts(prefix), ct.experts(prefix)
            for p, q in ((x.w13, y.w13), (x.w2, y.w2)):
                assert torch.equal(dequantize_fp4(p, torch.float32), dequantize_fp4(q, torch.float32))


def test_checkpoint_global_scale_is_modelopts_unless_its_reciprocal_does_not_round_trip():
    # every fp32 value of one binade (the property is scale-invariant): the nudged global always
    # round-trips through 1/x, and moves by at most one ulp
    x = torch.arange(0x3F800000, 0x40000000, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ok = (1.0 / (1.0 / x)) == x
    assert 0.15 < 1 - ok.float().mean().item() < 0.2  # 17% do not round-trip
    bad = x[~ok]
    up = torch.nextafter(bad, torch.full_like(bad, math.inf))
    assert torch.equal(1.0 / (1.0 / up), up)
    for amax in (torch.tensor(1.0), torch.tensor(0.37), torch.tensor(1e-3), torch.tensor(123.0)):
        g, base = checkpoint_global_scale(amax), nvfp4_global_scale(amax)
        assert reciprocal_round_trips(g)
        assert g == base if reciprocal_round_trips(base) else g == torch.nextafter(base, torch.tensor(math.inf))


# ---------------------------------------------------------------------------------------------
# expert stacking


def test_experts_stack_gate_then_up(tmp_path):
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors())
    write_checkpoint(src, tmp_path / "out", "compressed-tensors", progress=False)
    e, i, h = QWEN3_MOE["num_experts"], QWEN3_MOE["moe_intermediate_size"], QWEN3_MOE["hidden_size"]
    with Checkpoint(tmp_path / "out") as ckpt:
        assert ckpt.moe_layers() == ["model.layers.0.mlp", "model.layers.1.mlp"]
        ex = ckpt.experts("model.layers.1.mlp.experts")
        assert ex.layout == "gate_up" and (ex.n_experts, ex.intermediate, ex.hidden) == (e, i, h)
        assert ex.w13.shape == (e, 2 * i, h) and ex.w2.shape == (e, h, i)
        assert ex.w13.global_scale.shape in ((e, 1), (e, 2 * i)) and ex.w2.global_scale.shape == (e, 1)
        w13, w2 = dequantize_fp4(ex.w13, torch.float32), dequantize_fp4(ex.w2, torch.float32)
        for x in range(e):
            p = f"model.layers.1.mlp.experts.{x}"
            gate, up, down = (dequantize(ckpt.linear(f"{p}.{n}").weight, torch.float32)
                              for n in ("gate_proj", "up_proj", "down_proj"))
            assert torch.equal(w13[x, :i], gate) and torch.equal(w13[x, i:], up) and torch.equal(w2[x], down)
        assert ex.w13_bias is None and ex.w13_input_scale is None


def _with_global(w: torch.Tensor, g: float) -> FP4Tensor:
    return quantize(w, "nvfp4", global_scale=torch.tensor(g, dtype=torch.float32))


def test_gate_up_with_power_of_two_ratio_share_one_global_exactly():
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)
    g = float(nvfp4_global_scale(torch.maximum(gate.abs().max(), up.abs().max())))
    parts = (_with_global(gate, g), _with_global(up, g / 2))  # ratio 2: scales halve exactly
    scales, shared = share_global(parts)
    assert float(shared) == g and torch.equal(scales[0].view(torch.uint8), parts[0].scales.view(torch.uint8))
    assert torch.equal(scales[1].float(), parts[1].scales.float() / 2)
    stacked = stack_experts([parts, parts])
    assert isinstance(stacked, FP4Tensor) and stacked.global_scale.shape == (2, 1)
    want = torch.cat([dequantize(p, torch.float32) for p in parts])
    assert torch.equal(dequantize_fp4(stacked, torch.float32)[1], want)
    assert torch.equal(stacked.dequantize(torch.float32)[0], want)


def test_gate_up_that_cannot_share_a_global_keep_per_row_globals():
    gen = torch.Generator().manual_seed(4)
    # default (ModelOpt) globals of two random tensors: a ratio that is no power of two
    gate = writer_reference(torch.randn(16, 64, generator=gen))
    up = writer_reference(3 * torch.randn(16, 64, generator=gen))
    assert share_global((gate, up)) is None
    stacked = stack_experts([(gate, up)] * 3)
    assert stacked.global_scale.shape == (3, 32)
    assert torch.equal(stacked.global_scale[0, :16], gate.global_scale.expand(16))
    want = torch.cat([dequantize(gate, torch.float32), dequantize(up, torch.float32)])
    assert torch.equal(dequantize_fp4(stacked, torch.float32)[2], want)
    moved = stacked.to("cpu")
    assert isinstance(moved, FP4Tensor) and torch.equal(moved.global_scale, stacked.global_scale)


def test_power_of_two_ratio_that_would_underflow_or_overflow_e4m3_falls_back():
    # gate has a block at the largest scale (448), up one at the smallest (2**-9): with a ratio of
    # two, halving up's scales underflows and doubling gate's overflows
    g = 1.0
    gate = torch.zeros(1, 32)
    gate[0, :16] = 6 * 448 * g
    up = torch.zeros(1, 32)
    up[0, :16] = 6 * 2**-9 * (g / 2)
    parts = (_with_global(gate, g), _with_global(up, g / 2))
    assert parts[0].scales.float()[0, 0] == 448 and parts[1].scales.float()[0, 0] == 2**-9
    assert share_global(parts) is None
    stacked = stack_experts([parts])
    assert stacked.global_scale.shape == (1, 2)
    assert torch.equal(dequantize_fp4(stacked, torch.float32)[0],
                       torch.cat([dequantize(p, torch.float32) for p in parts]))


def test_stacked_global_must_broadcast():
    t = quantize(torch.randn(2, 4, 32), "nvfp4")
    with pytest.raises(ValueError, match=r"\[E, 1\] per expert, \[E, N\] per row"):
        FP4Tensor(data=t.data, scales=t.scales, global_scale=torch.ones(3, 1), shape=t.shape, fmt=NVFP4)


# ---------------------------------------------------------------------------------------------
# gpt-oss MXFP4

GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
           "intermediate_size": 32, "num_local_experts": 4, "experts_per_token": 2, "num_hidden_layers": 1,
           "vocab_size": 96,
           "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
               "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


def gpt_oss_model(folder: Path, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    e, h, i = GPT_OSS["num_local_experts"], GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"]
    gate, up = torch.randn(e, i, h, generator=gen), torch.randn(e, i, h, generator=gen)
    down = torch.randn(e, h, i, generator=gen)
    w13 = torch.stack((gate, up), dim=2).reshape(e, 2 * i, h)  # gate on even rows, up on odd
    q13, q2 = quantize(w13, "mxfp4"), quantize(down, "mxfp4")
    p = "model.layers.0.mlp.experts"
    tensors = {
        f"{p}.gate_up_proj_blocks": q13.data.reshape(e, 2 * i, h // 32, 16),
        f"{p}.gate_up_proj_scales": q13.scales,
        f"{p}.gate_up_proj_bias": torch.randn(e, 2 * i, generator=gen).to(torch.bfloat16),
        f"{p}.down_proj_blocks": q2.data.reshape(e, h, i // 32, 16),
        f"{p}.down_proj_scales": q2.scales,
        f"{p}.down_proj_bias": torch.randn(e, h, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.router.weight": torch.randn(e, h, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.router.bias": torch.randn(e, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(h, h, generator=gen).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(96, h, generator=gen).to(torch.bfloat16),
    }
    save_model(folder, GPT_OSS, tensors)
    return tensors, (gate, up, down), (q13, q2)


def test_gpt_oss_mxfp4_experts_read_interleaved(tmp_path):
    tensors, (gate, up, down), (q13, q2) = gpt_oss_model(tmp_path / "g")
    with Checkpoint(tmp_path / "g") as ckpt:
        assert ckpt.format == "gpt-oss-mxfp4" and ckpt.moe_layers() == ["model.layers.0.mlp"]
        ex = ckpt.experts("model.layers.0.mlp")
        assert ex.layout == "interleaved" and ex.w13.fmt == MXFP4 and ex.w13.global_scale is None
        assert ex.w13.shape == (4, 64, 64) and ex.w2.shape == (4, 64, 32)
        assert_fp4_equal(ex.w13, q13)
        assert_fp4_equal(ex.w2, q2)
        w13 = dequantize(ex.w13, torch.float32)
        # rows are per-row blocks, so the even rows are exactly the gate quantized on its own
        assert torch.equal(w13[:, 0::2], dequantize(quantize(gate, "mxfp4"), torch.float32))
        assert torch.equal(w13[:, 1::2], dequantize(quantize(up, "mxfp4"), torch.float32))
        assert torch.equal(dequantize(ex.w2, torch.float32), dequantize(quantize(down, "mxfp4"), torch.float32))
        assert bits_equal(ex.w13_bias, tensors["model.layers.0.mlp.experts.gate_up_proj_bias"])
        assert bits_equal(ex.w2_bias, tensors["model.layers.0.mlp.experts.down_proj_bias"])
        assert ckpt.is_excluded("model.layers.0.self_attn.q_proj") and ckpt.is_excluded("model.layers.0.mlp.router")
        assert not ckpt.is_excluded("model.layers.0.mlp.experts")
        with pytest.raises(CheckpointError, match="stored unquantized"):
            ckpt.linear("model.layers.0.self_attn.q_proj")
        assert {m.name: m.kind for m in ckpt.modules()}["model.layers.0.mlp.experts"] == "mxfp4_experts"


def test_gpt_oss_nibble_order_and_e8m0_scales(tmp_path):
    # byte 0x21: element 0 (low nibble) is code 1 = 0.5, element 1 (high nibble) is code 2 = 1.0
    e, h, i = 1, 32, 32
    p = "model.layers.0.mlp.experts"
    blocks = torch.zeros(e, 2 * i, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x21
    blocks[0, 1, 0, 0] = 0x21
    scales = torch.full((e, 2 * i, 1), 127, dtype=torch.uint8)
    scales[0, 1, 0] = 128  # 2**1
    config = {**GPT_OSS, "hidden_size": h, "intermediate_size": i, "num_local_experts": e}
    save_model(tmp_path / "g", config, {
        f"{p}.gate_up_proj_blocks": blocks, f"{p}.gate_up_proj_scales": scales,
        f"{p}.down_proj_blocks": torch.zeros(e, h, 1, 16, dtype=torch.uint8),
        f"{p}.down_proj_scales": torch.full((e, h, 1), 127, dtype=torch.uint8)})
    with Checkpoint(tmp_path / "g") as ckpt:
        w13 = dequantize(ckpt.experts("model.layers.0.mlp").w13, torch.float32)
    assert w13[0, 0, :3].tolist() == [0.5, 1.0, 0.0]  # gate row 0
    assert w13[0, 1, :3].tolist() == [1.0, 2.0, 0.0]  # up row 0, scale 2


# ---------------------------------------------------------------------------------------------
# writer behaviour


def test_sharded_output_has_an_index_and_reads_back_the_same(tmp_path):
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors(), shards=2)
    one = write_checkpoint(src, tmp_path / "one", "modelopt", progress=False)
    many = write_checkpoint(src, tmp_path / "many", "modelopt", progress=False, max_shard_bytes="20KB")
    assert one.shards == ("model.safetensors",) and len(many.shards) > 3
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(many.shards)
    for shard in many.shards:
        header, _ = read_header(tmp_path / "many" / shard)
        data = sum(t.nbytes for t in header.values())
        assert data <= 20_000 or len({n.rsplit(".", 1)[0] for n in header}) == 1  # a lone big group may exceed
    with Checkpoint(tmp_path / "one") as a, Checkpoint(tmp_path / "many") as b:
        assert sorted(a.tensor_names()) == sorted(b.tensor_names())
        for name in a.tensor_names():
            assert bits_equal(a.tensor(name), b.tensor(name)), name


def test_shard_files_are_plain_safetensors(tmp_path):
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors())
    write_checkpoint(src, tmp_path / "out", "modelopt", progress=False)
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))  # safetensors' own reader agrees
    name = "model.layers.0.mlp.experts.0.up_proj"
    assert loaded[f"{name}.weight"].dtype == torch.uint8
    assert loaded[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
    assert loaded[f"{name}.weight_scale_2"].shape == ()


def test_exclude_patterns_keep_modules_in_bf16(tmp_path):
    tensors = qwen3_moe_tensors()
    src = save_model(tmp_path / "q", QWEN3_MOE, tensors)
    report = write_checkpoint(src, tmp_path / "out", "compressed-tensors", ["model.layers.*.self_attn*"],
                              progress=False)
    assert report.kept["model.layers.1.self_attn.o_proj"] == "excluded by 'model.layers.*.self_attn*'"
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.self_attn.q_proj" in ignore  # compressed-tensors: explicit names, no wildcards
    with Checkpoint(tmp_path / "out") as ckpt:
        assert ckpt.is_excluded("model.layers.0.self_attn.q_proj")
        assert bits_equal(ckpt.tensor("model.layers.0.self_attn.q_proj.weight"),
                          tensors["model.layers.0.self_attn.q_proj.weight"])
        with pytest.raises(CheckpointError, match="stored unquantized"):
            ckpt.linear("model.layers.0.self_attn.q_proj")


def test_exclude_pattern_matching_nothing_is_an_error(tmp_path):
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors())
    with pytest.raises(CheckpointError, match=r"exclude pattern 'model\.layer\.\*' matches no module"):
        write_checkpoint(src, tmp_path / "out", exclude=["model.layer.*"], progress=False)
    assert not (tmp_path / "out").exists()


def test_exclusion_pattern_spellings():
    assert match_exclude(["model.layers.0.self_attn"], "model.layers.0.self_attn.q_proj") is not None
    assert match_exclude(["*.mlp.gate"], "model.layers.3.mlp.gate") == "*.mlp.gate"
    assert match_exclude(["re:.*mlp\\.gate$"], "model.layers.3.mlp.gate") is not None
    assert match_exclude(["*.mlp.gate"], "model.layers.3.mlp.gate_proj") is None


def test_refuses_a_non_empty_out_dir_unless_overwrite(tmp_path):
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        write_checkpoint(src, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="holds no config.json .not a checkpoint.: overwrite replaces"):
        write_checkpoint(src, out, overwrite=True, progress=False)  # an arbitrary folder is never deleted
    assert (out / "keep.txt").read_text() == "mine"
    (out / "config.json").write_text("{}")  # another model: refused, left as it is
    with pytest.raises(CheckpointError, match="no fp4moe_checkpoint.json, so it is not a checkpoint written by fp4moe"):
        write_checkpoint(src, out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "fp4moe_checkpoint.json").write_text('{"producer": "fp4moe"}')  # a checkpoint fp4moe wrote: replaced
    write_checkpoint(src, out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "hf_quant_config.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_never_replaces_a_folder_holding_the_source(tmp_path, monkeypatch):
    src = save_model(tmp_path / "models" / "q", QWEN3_MOE, qwen3_moe_tensors())
    (tmp_path / "models" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="contains the source model folder"):
        write_checkpoint(src, tmp_path / "models", overwrite=True, progress=False)
    assert (src / "config.json").exists()
    with pytest.raises(CheckpointError, match=r"exclude pattern 're:\[': not a valid regular expression"):
        write_checkpoint(src, tmp_path / "out", exclude=["re:["], progress=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    report = write_checkpoint(src, ".", progress=False)  # the current (empty) folder
    assert report.out_dir == work.resolve() and (work / "hf_quant_config.json").exists()


def test_an_expert_of_another_dtype_is_refused_before_writing(tmp_path):
    tensors = qwen3_moe_tensors()
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[name] = tensors[name].double()  # not quantizable: the block would be written half quantized
    src = save_model(tmp_path / "q", QWEN3_MOE, tensors)
    written = []
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj would stay unquantized \(dtype F64 is not "
                                              r"bf16/fp16/fp32\) while other experts of model\.layers\.1\.mlp\.experts"):
        write_checkpoint(src, tmp_path / "out", progress=False, on_group=written.append)
    assert written == [] and not (tmp_path / "out").exists()
    write_checkpoint(src, tmp_path / "out", exclude=["model.layers.1.mlp.experts"], progress=False)  # as it says


def test_a_failure_mid_write_leaves_nothing(tmp_path):
    tensors = qwen3_moe_tensors()
    tensors["model.layers.1.mlp.experts.3.down_proj.weight"][0, 5] = float("nan")  # found late in the write
    src = save_model(tmp_path / "q", QWEN3_MOE, tensors)
    written = []
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj\.weight' has 1 NaN/Inf"):
        write_checkpoint(src, tmp_path / "out", progress=False, on_group=written.append)
    assert len(written) > 10  # it failed part-way, not up front
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no temporary folder left behind


def fuse_experts(tensors: dict[str, torch.Tensor], prefix: str, e: int) -> dict[str, torch.Tensor]:
    """transformers v5's fused layout of per-expert weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    t = dict(tensors)
    p = f"{prefix}.experts"
    t[f"{p}.gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}.{x}.gate_proj.weight"),
                                                     t.pop(f"{p}.{x}.up_proj.weight")]) for x in range(e)])
    t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{x}.down_proj.weight") for x in range(e)])
    return t


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_experts_write_the_same_checkpoint_as_per_expert_weights(tmp_path, fmt):
    per_expert = qwen3_moe_tensors()
    fused = per_expert
    for layer in range(QWEN3_MOE["num_hidden_layers"]):
        fused = fuse_experts(fused, f"model.layers.{layer}.mlp", QWEN3_MOE["num_experts"])
    save_model(tmp_path / "fused", QWEN3_MOE, fused)
    save_model(tmp_path / "per_expert", QWEN3_MOE, per_expert)
    a = write_checkpoint(tmp_path / "fused", tmp_path / "a", fmt, progress=False)
    b = write_checkpoint(tmp_path / "per_expert", tmp_path / "b", fmt, progress=False)
    assert sorted(a.quantized) == sorted(b.quantized) and a.kept == b.kept
    assert "model.layers.1.mlp.experts.3.up_proj" in a.quantized
    got, want = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(bits_equal(got[k], want[k]) for k in want)
    with Checkpoint(tmp_path / "a") as ckpt:
        ex = ckpt.experts("model.layers.1.mlp")
        w = fused["model.layers.1.mlp.experts.gate_up_proj"]
        i = QWEN3_MOE["moe_intermediate_size"]
        for x in range(QWEN3_MOE["num_experts"]):  # each slice quantized on its own, read back bit for bit
            gate = dequantize(writer_reference(w[x, :i]), torch.float32)
            up = dequantize(writer_reference(w[x, i:]), torch.float32)
            assert torch.equal(dequantize(ex.w13, torch.float32)[x], torch.cat([gate, up]))


def test_gpt_oss_fused_experts_are_transposed_and_interleaved(tmp_path):
    gen = torch.Generator().manual_seed(11)
    e, h, i = 3, 64, 32
    p = "model.layers.0.mlp.experts"
    gate_up, down = _rand(gen, e, h, 2 * i), _rand(gen, e, i, h)  # x @ W: [E, H, 2I] and [E, I, H]
    bias_gu, bias_d = _rand(gen, e, 2 * i), _rand(gen, e, h)
    tensors = {f"{p}.gate_up_proj": gate_up, f"{p}.down_proj": down, f"{p}.gate_up_proj_bias": bias_gu,
               f"{p}.down_proj_bias": bias_d, "model.layers.0.mlp.router.weight": _rand(gen, e, h),
               "model.layers.0.self_attn.q_proj.weight": _rand(gen, h, h)}
    save_model(tmp_path / "g", {"model_type": "gpt_oss", "hidden_size": h}, tensors)
    write_checkpoint(tmp_path / "g", tmp_path / "q", "modelopt", progress=False)
    with Checkpoint(tmp_path / "q") as ckpt:
        ex = ckpt.experts("model.layers.0.mlp")
        assert ex.layout == "gate_up" and ex.w13.shape == (e, 2 * i, h) and ex.w2.shape == (e, h, i)
        w13, w2 = dequantize(ex.w13, torch.float32), dequantize(ex.w2, torch.float32)
        for x in range(e):
            gate, up = gate_up[x].t()[0::2], gate_up[x].t()[1::2]  # gate on even columns
            assert torch.equal(w13[x, :i], dequantize(writer_reference(gate.contiguous()), torch.float32))
            assert torch.equal(w13[x, i:], dequantize(writer_reference(up.contiguous()), torch.float32))
            assert torch.equal(w2[x], dequantize(writer_reference(down[x].t().contiguous()), torch.float32))
        assert bits_equal(ex.w13_bias, torch.cat([bias_gu[:, 0::2], bias_gu[:, 1::2]], dim=1))
        assert bits_equal(ex.w2_bias, bias_d)


def test_refuses_bad_fused_experts_and_models_with_nothing_to_quantize(tmp_path):
    bad = {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 64, dtype=torch.bfloat16),
           "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 32, 64, dtype=torch.bfloat16),
           "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}
    save_model(tmp_path / "bad", {"model_type": "qwen3_moe"}, bad)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj': expected "
                                              r"BF16\[4, 64, 32\] next to gate_up_proj BF16\[4, 64, 64\] "
                                              r"\(the transformers v5 default.*found BF16\[4, 32, 64\]"):
        write_checkpoint(tmp_path / "bad", tmp_path / "out", progress=False)
    unknown = {"model.layers.0.mlp.experts.w13_weight": torch.zeros(4, 64, 64, dtype=torch.bfloat16),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}
    save_model(tmp_path / "unknown", {"model_type": "x"}, unknown)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.w13_weight' BF16\[4, 64, 64\] "
                                              "holds fused experts under a name the writer does not know"):
        write_checkpoint(tmp_path / "unknown", tmp_path / "out", progress=False)
    save_model(tmp_path / "none", {"model_type": "x"}, {"model.embed_tokens.weight": torch.zeros(8, 16),
                                                         "lm_head.weight": torch.zeros(8, 16)})
    with pytest.raises(CheckpointError, match="no tensor to quantize .*kept: embedding, lm_head"):
        write_checkpoint(tmp_path / "none", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "none", "unknown"]


def test_refuses_to_quantize_a_quantized_checkpoint(tmp_path):
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors())
    write_checkpoint(src, tmp_path / "nvfp4", progress=False)
    with pytest.raises(CheckpointError, match="already a modelopt checkpoint"):
        write_checkpoint(tmp_path / "nvfp4", tmp_path / "again", progress=False)


def test_quantize_command(tmp_path):
    import typer

    from fp4moe.checkpoints.cli import quantize_command

    app = typer.Typer()
    app.command("quantize")(quantize_command)
    app.command("other")(lambda: None)  # a group, as in the fp4moe app
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors())
    runner = CliRunner()
    result = runner.invoke(app, ["quantize", str(src), str(tmp_path / "out"), "--format", "compressed-tensors",
                                 "--exclude", "lm_head", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["format"] == "compressed-tensors" and summary["quantized_linears"] == 2 * (4 + 3 * 4)
    assert summary["bytes_out"] < summary["bytes_in"]
    result = runner.invoke(app, ["quantize", str(src), str(tmp_path / "out2")])  # with the progress bar
    assert result.exit_code == 0, result.output
    assert "quantized linears" in result.output
    result = runner.invoke(app, ["quantize", str(src), str(tmp_path / "x"), "--format", "gguf"])
    assert result.exit_code != 0 and "--format" in result.output
    result = runner.invoke(app, ["quantize", str(src), str(tmp_path / "out")])  # exists
    assert result.exit_code == 1 and "not empty" in result.output


# ---------------------------------------------------------------------------------------------
# bad input: hand-built ModelOpt checkpoints, then broken one thing at a time


def _modelopt_linear(t: dict, module: str, n: int, k: int, gen, *, input_scale: bool = False) -> None:
    q = writer_reference(torch.randn(n, k, generator=gen))
    t[f"{module}.weight"] = q.data
    t[f"{module}.weight_scale"] = q.scales
    t[f"{module}.weight_scale_2"] = q.global_scale.reshape(())
    if input_scale:
        t[f"{module}.input_scale"] = torch.tensor(0.01)


def modelopt_tensors(*, input_scale: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    t = {"model.embed_tokens.weight": torch.randn(96, 64, generator=gen).to(torch.bfloat16)}
    for x in range(3):
        for proj, n, k in (("gate_proj", 32, 64), ("up_proj", 32, 64), ("down_proj", 64, 32)):
            _modelopt_linear(t, f"model.layers.0.mlp.experts.{x}.{proj}", n, k, gen, input_scale=input_scale)
    return t


def modelopt_folder(folder: Path, tensors: dict, algo: str = "W4A16_NVFP4") -> Path:
    save_model(folder, {"model_type": "qwen3_moe"}, tensors)
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": algo, "group_size": 16, "exclude_modules": ["lm_head"]}}))
    return folder


def test_hand_built_modelopt_checkpoint_reads(tmp_path):
    with Checkpoint(modelopt_folder(tmp_path / "m", modelopt_tensors(input_scale=True), "NVFP4")) as ckpt:
        assert ckpt.static_input_scales and ckpt.quant_algo == "NVFP4"
        ex = ckpt.experts("model.layers.0.mlp")
        assert ex.w13_input_scale.shape == (3,) and float(ex.w2_input_scale[0]) == pytest.approx(0.01)
        assert float(ckpt.linear("model.layers.0.mlp.experts.0.up_proj").input_global_scale) == pytest.approx(0.01)


def test_modelopt_files_that_disagree_on_the_algorithm(tmp_path):
    folder = modelopt_folder(tmp_path / "m", modelopt_tensors(), "W4A16_NVFP4")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"says quant_algo 'W4A16_NVFP4' but config\.json quantization_config "
                                              r"says 'NVFP4'; which one is it\?"):
        Checkpoint(folder)
    config["quantization_config"]["quant_algo"] = "w4a16_nvfp4"  # the same algorithm, another case: fine
    (folder / "config.json").write_text(json.dumps(config))
    with Checkpoint(folder) as ckpt:
        assert ckpt.quant_algo == "W4A16_NVFP4"


E = "model.layers.0.mlp.experts"
BAD_TENSORS = [
    # (why, mutation of the tensor dict, error pattern)
    ("missing block scales", lambda t: t.pop(f"{E}.1.up_proj.weight_scale"),
     rf"missing tensor '{E}\.1\.up_proj\.weight_scale'"),
    ("missing global", lambda t: t.pop(f"{E}.0.down_proj.weight_scale_2"),
     rf"missing tensor '{E}\.0\.down_proj\.weight_scale_2'"),
    ("extra tensor", lambda t: t.__setitem__(f"{E}.2.gate_proj.weight_zero_point", torch.zeros(1)),
     rf"'{E}\.2\.gate_proj\.weight_zero_point'.*extra tensor"),
    ("scale without its weight", lambda t: t.__setitem__("model.layers.0.mlp.gate.weight_scale", torch.ones(1)),
     r"missing tensor 'model\.layers\.0\.mlp\.gate\.weight'"),
    ("weight not packed", lambda t: t.__setitem__(f"{E}.1.gate_proj.weight", torch.zeros(32, 64, dtype=torch.bfloat16)),
     rf"'{E}\.1\.gate_proj\.weight'.*expected U8 packed NVFP4 codes \[N, K/2\].*found BF16\[32, 64\]"),
    ("scale dtype", lambda t: t.__setitem__(f"{E}.1.gate_proj.weight_scale", torch.ones(32, 4)),
     rf"'{E}\.1\.gate_proj\.weight_scale'.*expected F8_E4M3\[32, 4\].*found F32\[32, 4\]"),
    ("scale shape", lambda t: t.__setitem__(f"{E}.1.gate_proj.weight_scale", torch.ones(32, 8).to(torch.float8_e4m3fn)),
     rf"'{E}\.1\.gate_proj\.weight_scale'.*expected F8_E4M3\[32, 4\].*found F8_E4M3\[32, 8\]"),
    ("global with two values", lambda t: t.__setitem__(f"{E}.1.gate_proj.weight_scale_2", torch.ones(2)),
     rf"'{E}\.1\.gate_proj\.weight_scale_2'.*expected one F32 value.*found F32\[2\]"),
    ("expert missing", lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{E}.1.")],
     rf"{E}: expert 1 is missing"),
    ("projection missing", lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{E}.2.up_proj")],
     rf"{E}\.2: missing the up projection"),
    ("expert weight not 2-D", lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{E}.0.gate_proj.weight_")]
     + [t.__setitem__(f"{E}.0.gate_proj.weight", torch.zeros(2, 32, 64, dtype=torch.bfloat16))],
     rf"'{E}\.0\.gate_proj\.weight'.*expected a 2-D expert weight \[N, K\], found BF16\[2, 32, 64\]"),
    ("expert of another shape", lambda t: _modelopt_linear(t, f"{E}.2.gate_proj", 48, 64, torch.Generator()),
     rf"'{E}\.2\.gate_proj\.weight'.*expected the shape of expert 0's gate projection \[N, K\] = \[32, 64\], "
     r"found \[48, 64\]"),
]


@pytest.mark.parametrize("why,mutate,error", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_bad_tensors_are_refused_on_open(tmp_path, monkeypatch, why, mutate, error):
    t = modelopt_tensors()
    mutate(t)
    folder = modelopt_folder(tmp_path / "m", t)
    import safetensors

    # structural errors come from the headers alone: not one tensor is loaded
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError, match=error):
        Checkpoint(folder)


def test_w4a4_checkpoint_without_activation_scales_is_refused(tmp_path):
    folder = modelopt_folder(tmp_path / "m", modelopt_tensors(input_scale=False), "NVFP4")
    with pytest.raises(CheckpointError, match=rf"missing tensor '{E}\.0\.down_proj\.input_scale' \(NVFP4"):
        Checkpoint(folder)


@pytest.mark.parametrize("algo", ["FP8", "W4A16_AWQ", "NVFP4_AWQ", "INT8_SQ"])
def test_unsupported_quant_algo(tmp_path, algo):
    folder = modelopt_folder(tmp_path / "m", modelopt_tensors(), algo)
    with pytest.raises(CheckpointError, match=rf"hf_quant_config\.json.*quant_algo '{algo}' is not supported"):
        Checkpoint(folder)


@pytest.mark.parametrize("qc,error", [
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, r"config\.json: quantization_config: quant_algo 'FP8'"),
    ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}},
     r"config_groups\.group_0: format 'pack-quantized', weights num_bits 4 type 'int'.* is not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "float", "group_size": 16},
        "input_activations": {"num_bits": 8, "type": "float"}}}},
     r"input_activations num_bits 8 type 'float' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "float", "group_size": 16}, "input_activations": True}}},
     r"config_groups\.group_0\.input_activations: expected an object, found True"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "weights": [1]}}}, r"config_groups\.group_0\.weights: expected an object, found \[1\]"),
])
def test_unsupported_quantization_configs(tmp_path, qc, error):
    save_model(tmp_path / "m", {"model_type": "x", "quantization_config": qc}, {"a.weight": torch.zeros(2, 16)})
    with pytest.raises(CheckpointError, match=error):
        Checkpoint(tmp_path / "m")


def test_compressed_tensors_reads_inverted_globals(tmp_path):
    # a hand-written compressed-tensors linear of amax 10: weight_global_scale = 2688 / 10
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(16, 64, generator=gen)
    w = w / w.abs().max() * 10
    q = writer_reference(w)
    qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                        "input_activations": {"num_bits": 4, "type": "float"}}}}
    save_model(tmp_path / "c", {"model_type": "x", "quantization_config": qc}, {
        "l.weight_packed": q.data, "l.weight_scale": q.scales, "l.weight_global_scale": (1 / q.global_scale).reshape(1),
        "l.input_global_scale": torch.tensor([2688 / 4.0])})
    with Checkpoint(tmp_path / "c") as ckpt:
        lin = ckpt.linear("l")
    assert ckpt.static_input_scales
    assert_fp4_equal(lin.weight, q)
    assert float(lin.input_global_scale) == pytest.approx(4.0 / 2688)
    assert dequantize(lin.weight, torch.float32).abs().max() == pytest.approx(10, rel=0.1)


def test_a_quantized_looking_model_without_quantization_config(tmp_path):
    t = modelopt_tensors()
    save_model(tmp_path / "m", {"model_type": "qwen3_moe"}, t)  # no hf_quant_config.json
    with pytest.raises(CheckpointError, match=r"weight_scale' looks quantized, but .*config\.json \(no quantization"):
        Checkpoint(tmp_path / "m")


@pytest.mark.parametrize("mutation,error", [
    ("nan_scale", r"weight_scale'.*1 NaN and 0 negative E4M3 block scale"),
    ("zero_global", r"weight_scale_2'.*expected a positive finite global scale, found 0\.0"),
])
def test_corrupted_values_are_caught_on_read(tmp_path, mutation, error):
    t = modelopt_tensors()
    name = f"{E}.1.down_proj"
    if mutation == "nan_scale":
        scales = t[f"{name}.weight_scale"].view(torch.uint8).clone()
        scales[3, 1] = 0x7F
        t[f"{name}.weight_scale"] = scales.view(torch.float8_e4m3fn)
    else:
        t[f"{name}.weight_scale_2"] = torch.tensor(0.0)
    with Checkpoint(modelopt_folder(tmp_path / "m", t)) as ckpt:
        ckpt.linear(f"{E}.0.down_proj")  # the others read fine
        with pytest.raises(CheckpointError, match=error):
            ckpt.experts("model.layers.0.mlp")


# --- corrupted files


def _valid_file(tmp_path: Path) -> Path:
    folder = modelopt_folder(tmp_path / "m", modelopt_tensors())
    return folder / "model.safetensors"


def test_truncated_file(tmp_path):
    path = _valid_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '.*' ends at byte"):
        Checkpoint(path.parent)


def test_header_length_beyond_file_size(tmp_path):
    path = _valid_file(tmp_path)
    path.write_bytes(struct.pack("<Q", 5000) + b'{"a": 1}')
    with pytest.raises(CheckpointError, match=r"header length 5,000 bytes runs past the end of the file \(16 bytes\)"):
        Checkpoint(path.parent)


def test_absurd_header_length(tmp_path):
    path = _valid_file(tmp_path)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="above the 100,000,000-byte limit"):
        Checkpoint(path.parent)


def test_header_that_is_not_json(tmp_path):
    path = _valid_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[9:14] = b"#####"  # inside the JSON
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header .* is not valid JSON"):
        Checkpoint(path.parent)


def test_header_offsets_that_do_not_match_the_dtype(tmp_path):
    path = tmp_path / "x.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(CheckpointError, match=r"'w': F32\[4\] needs 16 bytes but data_offsets \[0, 12\] span 12"):
        read_header(path)


def test_tiny_file(tmp_path):
    path = _valid_file(tmp_path)
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="file is 3 bytes, too short"):
        Checkpoint(path.parent)


def _sharded(tmp_path: Path) -> Path:
    src = save_model(tmp_path / "q", QWEN3_MOE, qwen3_moe_tensors())
    write_checkpoint(src, tmp_path / "out", progress=False, max_shard_bytes="40KB")
    return tmp_path / "out"


def test_index_pointing_to_a_missing_shard(tmp_path):
    out = _sharded(tmp_path)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json: shard '{shard.name}' .* does not exist"):
        Checkpoint(out)


def test_index_and_shard_disagree(tmp_path):
    out = _sharded(tmp_path)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    moved = sorted(index["weight_map"])[0]
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"][moved] = next(s for s in shards if s != index["weight_map"][moved])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"(missing tensor '{moved}'|extra tensor '{moved}')"):
        Checkpoint(out)


def test_index_that_is_not_json(tmp_path):
    out = _sharded(tmp_path)
    (out / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"index\.json: not valid JSON"):
        Checkpoint(out)


@pytest.mark.parametrize("weight_map,error", [({}, "its weight_map lists no tensor"),
                                               ({"x": 5}, r"found the entry 'x': 5 \(shard names are strings\)")])
def test_index_with_an_empty_or_bad_weight_map(tmp_path, weight_map, error):
    out = _sharded(tmp_path)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"index\.json: .*{error}"):
        Checkpoint(out)


def test_pickle_only_folder(tmp_path):
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02")  # never opened
    with pytest.raises(CheckpointError, match=r"only pickle weights \(pytorch_model\.bin\), which fp4moe never loads"):
        Checkpoint(folder)


def test_missing_config(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: no such file"):
        Checkpoint(folder)


def test_unknown_names_suggest_close_ones(tmp_path):
    with Checkpoint(modelopt_folder(tmp_path / "m", modelopt_tensors())) as ckpt:
        with pytest.raises(CheckpointError, match=rf"did you mean '{E}\.1\.up_proj'"):
            ckpt.linear(f"{E}.1.up_prj")
        with pytest.raises(CheckpointError, match=r"no MoE layer named 'model\.layers\.3\.mlp'"):
            ckpt.experts("model.layers.3.mlp")
