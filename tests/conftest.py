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
    """Where kernels run in this session: the GPU when there is one, else the interpreter on CPU."""
    return "cuda" if HAS_CUDA else "cpu"
