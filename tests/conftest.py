"""Test set-up: kernels run through Triton's interpreter when there is no CUDA GPU.

TRITON_INTERPRET must be set before any @triton.jit function is defined, i.e. before fp4moe's
kernel modules are imported, so it is set here at collection time.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where kernels run in this test run: the GPU when there is one, else the interpreter on CPU."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def fresh_guard():
    """The numerical guard with no results remembered (each test probes its kernels itself)."""
    from fp4moe import guard

    guard.reset()
    yield


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE in bf16 (``bf16/``) and as an NVFP4 checkpoint (``q/``)."""
    pytest.importorskip("transformers")
    from fp4moe.checkpoints import write_checkpoint
    from fp4moe.integrations.transformers.e2e import build_model

    root = tmp_path_factory.mktemp("qwen")
    build_model("qwen3_moe", "tiny", seed=6).save_pretrained(root / "bf16")
    write_checkpoint(root / "bf16", root / "q", progress=False)
    return root
