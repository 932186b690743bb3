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

from fp4moe import guard  # noqa: E402
from fp4moe.checkpoints import write_checkpoint  # noqa: E402
from fp4moe.integrations.transformers import FP4MoEBlock, load_fp4_model  # noqa: E402
from fp4moe.integrations.transformers.convert import quantize_model  # noqa: E402
from fp4moe.integrations.transformers.e2e import build_model  # noqa: E402
from fp4moe.nn import FP4Linear  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_guard():
    guard.reset()
    yield


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
