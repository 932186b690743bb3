"""End to end: a random MoE model -> ``fp4moe quantize`` -> ``load_fp4_model`` -> ``generate``, compared
with the bf16 model (``fp4moe demo --e2e``, the integration tests, the GPU measurement).

Three models take the same tokens:

* ``bf16``: the transformers model with its random bf16 weights;
* ``fake-quant``: the same transformers code with every weight the checkpoint quantized replaced by
  its dequantized FP4 value: the model fp4moe is meant to compute, run by transformers' own code;
* ``fp4moe``: the checkpoint loaded by :func:`load_fp4_model` (MoE blocks and linears on fp4moe's
  kernels).

``fp4moe`` vs ``fake-quant`` isolates fp4moe's own error (kernels, routing, loading: bf16 rounding
only); ``fake-quant`` vs ``bf16`` is the quantization error, which the weights' measured relative
error predicts (:func:`predicted_logits_error`).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ...checkpoints import open_checkpoint, write_checkpoint
from ...quantize import dequantize
from .families import FAMILIES, family_for
from .loader import FP4MoEBlock, load_fp4_model

__all__ = ["SIZES", "model_config", "build_model", "fake_quant_model", "weight_error", "predicted_logits_error",
           "E2EResult", "run_e2e", "moe_blocks", "time_moe_layers"]

Size = Literal["tiny", "large"]

#: Shapes per size. "tiny" keeps the Triton interpreter on a 2-core CPU to seconds; "large" is a
#: Qwen3-30B-A3B-wide slice (hidden 2048, 128 experts of 768, top-8) with 4 layers, for the GPU.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, moe_inter=32, dense_inter=128, experts=8, top_k=2, layers=2, heads=4, kv_heads=2,
                 head_dim=16, vocab=128, lora=32),
    "large": dict(hidden=2048, moe_inter=768, dense_inter=6144, experts=128, top_k=8, layers=4, heads=32,
                  kv_heads=4, head_dim=128, vocab=32000, lora=512),
}


def model_config(family: str, size: Size = "tiny"):
    """A transformers config of ``family`` (a key of FAMILIES) at ``size``; weights are drawn with
    std 1/sqrt(hidden) so that every layer, not only the embeddings, shapes the logits."""
    import transformers

    s = SIZES[size]
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                  num_experts_per_tok=s["top_k"], initializer_range=1.0 / math.sqrt(s["hidden"]),
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=None,
                  pad_token_id=0)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=s["head_dim"], intermediate_size=s["dense_inter"],
                                           moe_intermediate_size=s["moe_inter"], num_experts=s["experts"],
                                           norm_topk_prob=True)
    if family in ("deepseek_v3", "glm4_moe"):
        moe = dict(intermediate_size=s["dense_inter"], moe_intermediate_size=s["moe_inter"],
                   n_routed_experts=s["experts"], n_shared_experts=1, first_k_dense_replace=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True)
        if family == "deepseek_v3":
            return transformers.DeepseekV3Config(**common, **moe, n_group=4, topk_group=2, q_lora_rank=s["lora"],
                                                 kv_lora_rank=s["lora"], qk_rope_head_dim=s["head_dim"] // 2,
                                                 qk_nope_head_dim=s["head_dim"] // 2, v_head_dim=s["head_dim"])
        return transformers.Glm4MoeConfig(**common, **moe, head_dim=s["head_dim"], n_group=1, topk_group=1)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, head_dim=s["head_dim"], intermediate_size=s["moe_inter"],
                                         num_local_experts=s["experts"], sliding_window=128)
    raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {family!r}")


def build_model(family: str, size: Size = "tiny", *, seed: int = 0, device: str | torch.device = "cpu"):
    """A random bf16 causal LM of ``family``; router biases (DeepSeek/GLM selection bias, gpt-oss
    router and expert biases) are drawn too, so that they are exercised."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(family, size), dtype=torch.float32)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    fam = FAMILIES[family]
    with torch.no_grad():
        for block in moe_blocks(model, family).values():
            router = getattr(block, fam.router)
            if fam.selection_bias:
                b = getattr(router, fam.selection_bias)
                b.copy_(0.05 * torch.randn(b.shape, generator=gen, device=device))
            if fam.router_bias:
                router.bias.copy_(0.1 * torch.randn(router.bias.shape, generator=gen, device=device))
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                p = getattr(block.experts, name, None)
                if p is not None:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=device))
    return model.to(torch.bfloat16).eval()


def moe_blocks(model: nn.Module, family: str) -> dict[str, nn.Module]:
    """The MoE blocks of a transformers model (bf16) or of its fp4moe twin, by name."""
    classes = FAMILIES[family].block_classes
    return {n: m for n, m in model.named_modules() if isinstance(m, FP4MoEBlock) or type(m).__name__ in classes}


def _hf_expert_weights(w13: torch.Tensor, w2: torch.Tensor, layout: str, family: str):
    """fp4moe's stacked [E, 2I, H] / [E, H, I] (gate_up or interleaved rows) in the layout of the
    transformers experts module of ``family``."""
    if family == "gpt_oss":  # x @ W, gate/up interleaved
        if layout == "gate_up":
            i = w13.shape[1] // 2
            w13 = torch.stack((w13[:, :i], w13[:, i:]), dim=2).reshape(w13.shape)
        return w13.transpose(1, 2), w2.transpose(1, 2)
    if layout != "gate_up":
        raise ValueError(f"{family}: interleaved experts in a model that stores gate then up")
    return w13, w2


def fake_quant_model(model: nn.Module, checkpoint: str | Path, family: str) -> tuple[nn.Module, dict[str, float]]:
    """A copy of the bf16 ``model`` whose weights quantized in ``checkpoint`` hold their dequantized
    values, and the weights' relative error (``weight_error``)."""
    fq = copy.deepcopy(model)
    sq_err = sq_ref = 0.0
    worst = 0.0
    with open_checkpoint(checkpoint) as ckpt, torch.no_grad():
        def put(param: torch.Tensor, value: torch.Tensor) -> None:
            nonlocal sq_err, sq_ref, worst
            value = value.to(param.device, param.dtype)
            ref = param.float()
            e, r = (value.float() - ref).pow(2).sum().item(), ref.pow(2).sum().item()
            sq_err, sq_ref, worst = sq_err + e, sq_ref + r, max(worst, math.sqrt(e / r) if r else 0.0)
            param.copy_(value)

        for prefix in ckpt.moe_layers():
            ex = ckpt.experts(prefix)
            experts = fq.get_submodule(f"{prefix}.experts")
            w13, w2 = _hf_expert_weights(dequantize(ex.w13, torch.float32), dequantize(ex.w2, torch.float32),
                                         ex.layout, family)
            put(experts.gate_up_proj, w13)
            put(experts.down_proj, w2)
        for name in ckpt.linear_names():
            if ".experts." in name:
                continue
            put(fq.get_submodule(name).weight, dequantize(ckpt.linear(name).weight, torch.float32))
    rel = math.sqrt(sq_err / sq_ref)
    return fq, {"relative_rms": rel, "worst_tensor_relative_rms": worst}


def weight_error(model: nn.Module, checkpoint: str | Path, family: str) -> dict[str, float]:
    return fake_quant_model(model, checkpoint, family)[1]


def quantized_gemms_per_token(model: nn.Module, family: str) -> int:
    """Quantized GEMMs one token's hidden state passes through (attention projections and, per MoE
    layer, the k routed experts' gate, up and down plus the shared expert's), whose independent
    errors add up in the logits."""
    cfg = model.config
    fam = FAMILIES[family]
    per_moe = 3 * int(cfg.num_experts_per_tok) + (3 if fam.shared else 0)
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".self_attn." in name:
            n += 1
        if ".mlp." in name and isinstance(module, nn.Linear) and ".shared_experts." not in name:
            n += 1  # dense MLP layers
    return n + per_moe * len(moe_blocks(model, family))


def predicted_logits_error(weight_rel_rms: float, n_gemms: int) -> float:
    """Relative RMS error of the logits that quantization error of relative size ``weight_rel_rms``
    in ``n_gemms`` GEMMs predicts when each GEMM's output error is ~ weight_rel_rms x its output
    (independent random weight errors) and the errors add in quadrature through a residual network
    of unit gain: ``weight_rel_rms * sqrt(n_gemms)``. An estimate, not a bound (gains are not
    exactly one; a routing choice that flips moves more): tests allow 2x."""
    return weight_rel_rms * math.sqrt(n_gemms)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_moe_layers(blocks: dict[str, nn.Module], hidden: int, tokens: int, device: torch.device, *,
                    iters: int = 20, dtype: torch.dtype = torch.bfloat16) -> float:
    """Seconds one forward of all ``blocks`` takes for ``tokens`` tokens (unit-RMS random inputs,
    as after the RMSNorm that precedes every MoE block), median over ``iters`` after a warm-up."""
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)
    for block in blocks.values():
        block(x)
    times = []
    for _ in range(iters):
        _sync(device)
        t = time.perf_counter()
        for block in blocks.values():
            block(x)
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def _time_generate(model, ids: torch.Tensor, new_tokens: int, *, graphs: bool = False) -> tuple[torch.Tensor, float]:
    """The new tokens of a greedy generate and its seconds: ``model.generate``, or with ``graphs``
    ``decode.generate`` (each decode step one CUDA graph)."""
    from .decode import generate

    _sync(ids.device)
    t = time.perf_counter()
    if graphs:
        out = generate(model, ids, new_tokens)
    else:
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync(ids.device)
    return out[:, ids.shape[1]:], time.perf_counter() - t


@dataclass
class E2EResult:
    family: str
    size: str
    format: str
    device: str
    shapes: dict[str, int]
    weight_error: dict[str, float]  # relative RMS of the dequantized weights
    quantized_gemms_per_token: int
    predicted_logits_error: float
    logits_error_vs_bf16: float  # fp4moe vs bf16, relative RMS over all logits
    logits_error_fake_quant_vs_bf16: float  # the quantization error alone
    logits_error_vs_fake_quant: float  # fp4moe's own error
    top1_agreement: float  # next-token argmax, fp4moe vs bf16, over the prompt positions
    generated_bf16: list[list[int]]
    generated_fp4moe: list[list[int]]
    token_agreement: float  # greedy tokens equal position by position
    seconds: dict[str, float] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def run_e2e(family: str = "qwen3_moe", size: Size = "tiny", *, workdir: str | Path, fmt: str = "modelopt",
            device: str | torch.device | None = None, seed: int = 0, batch: int = 2, prompt_len: int = 8,
            new_tokens: int = 4, timing: bool = False, timing_tokens: tuple[int, ...] = (1, 16, 64),
            linears: bool = True) -> E2EResult:
    """Build, save, quantize, load, compare and generate (module docstring); ``timing`` adds
    tokens/s of the whole model's generate and of the MoE layers alone, bf16 vs fp4moe."""
    family_for(family)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    workdir = Path(workdir)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    model = build_model(family, size, seed=seed, device=device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar
    model.save_pretrained(workdir / "bf16")
    seconds["build_and_save"] = time.perf_counter() - t
    t = time.perf_counter()
    write_checkpoint(workdir / "bf16", workdir / fmt, fmt, progress=False, overwrite=True)
    seconds["quantize"] = time.perf_counter() - t
    t = time.perf_counter()
    fp4 = load_fp4_model(workdir / fmt, device=device, linears=linears)
    seconds["load"] = time.perf_counter() - t
    fq, w_err = fake_quant_model(model, workdir / fmt, family)

    gen = torch.Generator().manual_seed(seed + 7)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=gen).to(device)
    t = time.perf_counter()
    with torch.no_grad():
        ref = model(ids).logits.float()
        quant = fq(ids).logits.float()
        got = fp4(ids).logits.float()
    seconds["forward_3_models"] = time.perf_counter() - t
    del fq
    t = time.perf_counter()
    tokens_ref, _ = _time_generate(model, ids, new_tokens)
    tokens_fp4, _ = _time_generate(fp4, ids, new_tokens)
    seconds["generate_2_models"] = time.perf_counter() - t
    n = quantized_gemms_per_token(model, family)
    s = SIZES[size]
    result = E2EResult(
        family=family, size=size, format=fmt, device=str(device),
        shapes={k: s[k] for k in ("hidden", "moe_inter", "experts", "top_k", "layers", "vocab")},
        weight_error=w_err, quantized_gemms_per_token=n,
        predicted_logits_error=predicted_logits_error(w_err["relative_rms"], n),
        logits_error_vs_bf16=_rel(got, ref), logits_error_fake_quant_vs_bf16=_rel(quant, ref),
        logits_error_vs_fake_quant=_rel(got, quant),
        top1_agreement=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        generated_bf16=tokens_ref.tolist(), generated_fp4moe=tokens_fp4.tolist(),
        token_agreement=float((tokens_ref == tokens_fp4).float().mean()), seconds=seconds)
    if timing:
        result.timing = _timing(model, fp4, family, ids, new_tokens, timing_tokens, device)
    return result


def _timing(model, fp4, family: str, ids: torch.Tensor, new_tokens: int, tokens: tuple[int, ...],
            device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"note": "median of 20 after a warm-up; MoE layers: all MoE blocks of the model, one "
                                   "forward each, unit-RMS random inputs; generate: model.generate as users call it "
                                   "(fp4moe's modules replay graphs of their own calls), generate_graphs: "
                                   "fp4moe.integrations.transformers.generate (each decode step one CUDA graph; "
                                   "transformers' experts on grouped_mm)"}
    gen_tokens = ids.shape[0] * new_tokens
    for name, m in (("bf16", model), ("fp4moe", fp4)):
        _time_generate(m, ids, new_tokens)  # warm-up: compilation, guard probes
        _, secs = _time_generate(m, ids, new_tokens)
        out[f"generate_tokens_per_s_{name}"] = gen_tokens / secs
        experts = getattr(m.config, "_experts_implementation", None)
        m.config._experts_implementation = "grouped_mm"  # transformers' capturable experts (bf16)
        try:
            _time_generate(m, ids, new_tokens, graphs=True)  # warm-up and capture
            _, secs = _time_generate(m, ids, new_tokens, graphs=True)
            out[f"generate_graphs_tokens_per_s_{name}"] = gen_tokens / secs
        finally:
            m.config._experts_implementation = experts
    hidden = model.config.hidden_size
    rows = []
    for t in tokens:
        s_bf16 = time_moe_layers(moe_blocks(model, family), hidden, t, device)
        s_fp4 = time_moe_layers(moe_blocks(fp4, family), hidden, t, device)
        rows.append({"tokens": t, "moe_layers": len(moe_blocks(model, family)), "bf16_ms": 1e3 * s_bf16,
                     "fp4moe_ms": 1e3 * s_fp4, "bf16_tokens_per_s": t / s_bf16, "fp4moe_tokens_per_s": t / s_fp4,
                     "speedup": s_bf16 / s_fp4})
    out["moe_layers"] = rows
    return out
