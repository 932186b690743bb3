"""What every launcher asks of the runtime: is Triton interpreting, and which dtype the MMA takes."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU through Triton's interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def mma_dtype(dtype: torch.dtype):
    """The Triton dtype decoded FP4 operands take for an MMA with ``dtype`` activations.

    fp32 under the interpreter, whose bf16 ``tl.dot`` is wrong in Triton 3.6: the decoded values
    (E2M1 x scale, at most 5 significant bits) are exact in either type.
    """
    import triton.language as tl

    if interpreting():
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
