"""Model presets, the Hugging Face config reader and the per-layer FP4 GEMM list."""

import json

import pytest

from fp4moe.models import PRESETS, fp4_linear_ops, from_hf_config, get_model


def test_presets_match_reference():
    glm = get_model("GLM-5")
    assert (glm.hidden, glm.expert_intermediate, glm.n_experts, glm.routing.top_k) == (6144, 2048, 256, 8)
    assert glm.routing.kind == "sigmoid_bias" and glm.routing.routed_scaling_factor == 2.5
    assert glm.moe_layers == 75 and glm.dense_intermediate == 12288
    ds = get_model("deepseek-v3")
    assert (ds.routing.n_group, ds.routing.topk_group) == (8, 4)
    assert get_model("qwen3-30b-a3b").n_shared_experts == 0
    assert get_model("gpt-oss-120b").fmt == "mxfp4"
    assert set(PRESETS) == {"glm-5", "deepseek-v3", "qwen3-30b-a3b", "gpt-oss-120b"}


def test_unknown_model():
    with pytest.raises(ValueError, match=r"model: expected one of .*got 'llama'"):
        get_model("llama")


def test_glm5_tp8_expert_shape_is_the_one_that_crashed():
    ops = {op.name: op for op in fp4_linear_ops(get_model("glm-5"), tokens=16, tp=8)}
    w13, w2 = ops["experts.w13 (gate+up)"], ops["experts.w2 (down)"]
    assert (w13.N, w13.K) == (512, 6144)  # gate+up of a 256-wide expert slice
    assert (w2.N, w2.K) == (6144, 256)
    assert w13.M == 1  # 16 tokens * 8 / 256 experts
    assert w13.count == 128  # 16 * 8 = 128 routed pairs over 256 experts
    assert "dense.w13" in ops and ops["dense.w13"].N == 2 * 12288 // 8


def test_ep_and_bad_degrees():
    ops = fp4_linear_ops(get_model("qwen3-30b-a3b"), tokens=4096, ep=4)
    assert ops[0].count == 32 and ops[0].M == 256
    with pytest.raises(ValueError, match="tp: .*not divisible by 7"):
        fp4_linear_ops(get_model("glm-5"), tokens=1, tp=7)
    with pytest.raises(ValueError, match="tokens"):
        fp4_linear_ops(get_model("glm-5"), tokens=0)


def _write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_hf_config_deepseek_style(tmp_path):
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "moe_intermediate_size": 2048,
           "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8,
           "topk_group": 4, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "num_hidden_layers": 61,
           "first_k_dense_replace": 3, "intermediate_size": 18432}
    m = from_hf_config(_write(tmp_path, cfg))
    assert m.routing.kind == "sigmoid_bias" and m.routing.n_group == 8 and m.dense_intermediate == 18432


def test_hf_config_qwen_and_gpt_oss(tmp_path):
    qwen = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": 48}
    m = from_hf_config(_write(tmp_path, qwen))
    assert m.routing.kind == "softmax" and m.n_experts == 128
    oss = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 128,
           "num_experts_per_tok": 4, "num_hidden_layers": 36}
    m = from_hf_config(_write(tmp_path, oss))
    assert m.routing.kind == "gpt_oss" and m.fmt == "mxfp4"


def test_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        from_hf_config(tmp_path / "missing.json")
    dense = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008}
    with pytest.raises(ValueError, match="not a MoE model"):
        from_hf_config(_write(tmp_path, dense))
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_hf_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xd0\xff")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, expected an object"):
        from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="not a MoE model"):
        from_hf_config(_write(tmp_path, {"model_type": "x", "text_config": None}))
    moe = {"model_type": "qwen3_moe", "num_experts": 8, "hidden_size": 64, "moe_intermediate_size": "x",
           "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match=r"config\.json': invalid literal for int\(\)"):
        from_hf_config(_write(tmp_path, moe))


def test_tp_that_breaks_the_block_size_is_named():
    from fp4moe.models import fp4_linear_ops

    qwen = get_model("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=r"tp: 64 leaves 12 of .* expert intermediate 768 per GPU, not a multiple of "
                                         r"the nvfp4 block size 16"):
        fp4_linear_ops(qwen, 16, tp=64)
    assert fp4_linear_ops(qwen, 16, tp=8)[1].K == 96
