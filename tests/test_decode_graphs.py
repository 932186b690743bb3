"""fp4moe.integrations.transformers.decode: greedy decoding with each step replayed from one graph.

On CPU the graph is ``RerunGraph`` (the captured step run again on the same static inputs and cache,
which is what a CUDA-graph replay does); the tokens must equal transformers' own greedy ``generate``
(with its dynamic cache) for a bf16 model and for the fp4moe model of the same checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fp4moe.checkpoints import write_checkpoint  # noqa: E402
from fp4moe.graphs import graph_policy  # noqa: E402
from fp4moe.integrations.transformers import load_fp4_model  # noqa: E402
from fp4moe.integrations.transformers.decode import DecodeGraphs, generate  # noqa: E402
from fp4moe.integrations.transformers.e2e import build_model, model_config  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_guard")


def _prompt(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g)


def _hf_greedy(model, ids, n):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def _bf16_model(family: str, device: str = "cpu"):
    """A tiny random bf16 model; MLA models with as many key/value heads as heads, as the real ones
    (transformers' static cache sizes its layers from num_key_value_heads)."""
    cfg = model_config(family, "tiny")
    if family == "deepseek_v3":
        cfg.num_key_value_heads = cfg.num_attention_heads
    torch.manual_seed(2)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bf16_model_same_tokens_as_transformers(family, device):
    model = _bf16_model(family, device)
    model.config._experts_implementation = "grouped_mm"  # transformers' capturable experts
    ids = _prompt(model.config.vocab_size, 2, 5).to(device)
    want = _hf_greedy(model, ids, 6)
    got = generate(model, ids, 6, max_cache_len=16)
    assert torch.equal(got, want)
    runner = model._fp4moe_decode_graphs[(2, 16)]
    assert runner.state.steps == {"eager": 1, "replayed": 4}
    # a second call reuses the runner and its graph: every step after the prefill is a replay
    ids2 = _prompt(model.config.vocab_size, 2, 3, seed=1).to(device)
    assert torch.equal(generate(model, ids2, 4, max_cache_len=16), _hf_greedy(model, ids2, 4))
    assert runner.state.steps == {"eager": 1, "replayed": 7}


@pytest.mark.slow  # writes, loads and generates with an fp4moe model through the interpreter
def test_fp4moe_model_same_tokens_as_its_own_generate(tmp_path, device):
    """On a GPU the whole decode step of the fp4moe model is captured: its kernels inside a caller's
    capture, the modules' own graphs kept out of it."""
    build_model("qwen3_moe", "tiny", seed=3).save_pretrained(tmp_path / "bf16")
    write_checkpoint(tmp_path / "bf16", tmp_path / "q", progress=False)
    model = load_fp4_model(tmp_path / "q", device=device)
    ids = _prompt(model.config.vocab_size, 1, 4).to(device)
    with graph_policy(enabled=False):
        want = _hf_greedy(model, ids, 5)
    with graph_policy(devices={"cpu", "cuda"}):
        got = generate(model, ids, 5)
    assert torch.equal(got, want)
    runner = next(iter(model._fp4moe_decode_graphs.values()))
    assert runner.state.steps == {"eager": 1, "replayed": 3} and not runner.state.failed


def test_bad_arguments():
    model = build_model("qwen3_moe", "tiny", seed=2)
    runner = DecodeGraphs(model, batch=1, max_cache_len=8)
    with pytest.raises(ValueError, match="input_ids"):
        runner.generate(torch.zeros(2, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_cache_len"):
        runner.generate(torch.ones(1, 6, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        runner.generate(torch.ones(1, 2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="input_ids"):
        generate(model, torch.ones(3, dtype=torch.long), 2)


def test_a_step_that_cannot_be_captured_warns_and_runs_eagerly():
    model = build_model("qwen3_moe", "tiny", seed=2)
    model.config._experts_implementation = "grouped_mm"
    ids = _prompt(model.config.vocab_size, 1, 3)
    want = _hf_greedy(model, ids, 4)
    runner = DecodeGraphs(model, batch=1, max_cache_len=8)
    real = runner._step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 2:  # the capture
            raise RuntimeError("operation not permitted when stream is capturing")
        real()

    runner._step = step
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = runner.generate(ids, 4)
    assert torch.equal(got, want)
    assert runner.state.steps == {"eager": 3, "replayed": 0}
