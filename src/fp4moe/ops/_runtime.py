"""What every launcher asks of the runtime: is Triton interpreting, and which dtype the MMA takes."""

from __future__ import annotations

import os

import torch

from ..formats import e4m3_is_nan


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


def fast_decode(act: int, x_dtype: torch.dtype | str, *, compiled: bool | None = None) -> bool:
    """Whether a kernel launch decodes FP4 with the inline-PTX decoder (``FAST_DECODE``).

    Only in compiled CUDA code (``compiled``: default, whenever Triton is not interpreting), and
    only for bf16 operands: W4A16 with bf16 activations (act 0) or W4A4 decoded in the kernel
    (act 1). Native FP4 MMA (act 2) decodes nothing. The launchers and the compile requests the
    planner proves both ask this function, so the planner compiles the kernel that runs.
    """
    if compiled is None:
        compiled = not interpreting()
    if not compiled or act == 2:
        return False
    return act == 1 or x_dtype in (torch.bfloat16, "bf16")


def fast_fold(act: int, fast: bool, w_e4m3: bool) -> float:
    """The power of two a kernel multiplies its fp32 accumulator by after the fast decoder, which
    leaves ``value * scale * 2**-(126 - F)`` on every decoded operand (``kernels.fp4_decode``):
    the weight's fold, times the activation's when act 1 decodes NVFP4 activations too."""
    if not fast:
        return 1.0
    from ..kernels.fp4_decode import FAST_FOLD_E4M3, FAST_FOLD_E8M0

    fold = FAST_FOLD_E4M3.value if w_e4m3 else FAST_FOLD_E8M0.value
    return fold * (FAST_FOLD_E4M3.value if act == 1 else 1.0)


#: E8M0 biased exponents the kernels decode exactly: the fast (inline-PTX, bf16) path folds 2**100
#: into the scale (exponents 21..154, scales 2**-106..2**27); fp16 activations decode on the portable
#: path, where e2m1 * scale must stay a normal fp16 (scales 2**-14..2**13, exponents 113..140).
E8M0_RANGE = {"bf16": (21, 154), "fp16": (113, 140)}


def check_weight_scales(w, name: str = "w", activations: str = "bf16") -> None:
    """Refuse weights the packed kernels cannot decode: NVFP4 block scales holding NaN (E4M3 0x7F
    or 0xFF; the kernels' integer decode would read them as numbers), MXFP4 scales out of the range
    ``check_weight_scale_range`` allows. One host sync: call it when weights are loaded or packed."""
    if w.fmt.scale_kind == "e4m3":
        if bool(e4m3_is_nan(w.scales.view(torch.uint8)).any()):
            raise ValueError(f"{name}: NVFP4 scales contain NaN (E4M3 0x7F)")
    else:
        check_weight_scale_range(w, name, activations)


def check_weight_scale_range(w, name: str = "w", activations: str = "bf16") -> None:
    """Refuse MXFP4 weights whose scales the kernels cannot decode exactly with ``activations``
    ("bf16" or "fp16"): one host sync, so call it when weights are loaded, not per call. NVFP4's
    E4M3 scales are always in range."""
    if w.fmt.scale_kind != "e8m0" or w.scales.numel() == 0:
        return
    lo, hi = int(w.scales.min()), int(w.scales.max())
    for dtype, (a, b) in E8M0_RANGE.items():
        if dtype != activations:
            continue
        if not (a <= lo and hi <= b):
            raise ValueError(
                f"{name}: MXFP4 scale exponents span {lo - 127}..{hi - 127} (biased {lo}..{hi}); fp4moe decodes "
                f"{a - 127}..{b - 127} exactly with {dtype} activations. Rescale the weights (move a power of two "
                f"into the layer's output) or use NVFP4")


def pdl_enabled(device: torch.device) -> int:
    """1 when the kernels of a launch chain on ``device`` use programmatic dependent launch
    (``kernels.pdl``): compiled CUDA on an architecture with ``griddepcontrol`` (``Arch.has_pdl``),
    unless ``FP4MOE_PDL=0`` (for measuring what it saves); else 0. The launcher passes the result
    as both the kernel's ``PDL`` constexpr and ``launch_pdl``."""
    if device.type != "cuda" or interpreting() or os.environ.get("FP4MOE_PDL", "1") == "0":
        return 0
    from ..arch import arch_for_capability

    cc = torch.cuda.get_device_capability(device)
    try:
        return int(arch_for_capability(cc).has_pdl)
    except ValueError:  # not in the catalogue: launch without PDL (it only hides launch gaps)
        return 0


def pdl_kwargs(device: torch.device) -> dict:
    """A chain kernel's launch arguments for ``pdl_enabled``: the ``PDL`` constexpr and ``launch_pdl``."""
    pdl = pdl_enabled(device)
    return {"PDL": pdl, "launch_pdl": bool(pdl)}
