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


#: Names a catalogued architecture (``sm80``, ``sm89``, ``sm120`` ...) whose kernels the process runs
#: on the GPU in hand: the configurations and paths fp4moe chooses for it, compiled through Triton's
#: lowering for it (``TRITON_OVERRIDE_ARCH``) and assembled for the device. For running another
#: generation's code on silicon where only a newer GPU is at hand (``runtime_arch``); read once per
#: process, by the first op that chooses a path or a launch (every launcher asks ``runtime_arch``
#: or ``pdl_enabled`` before its first kernel compiles).
ARCH_ENV = "FP4MOE_ARCH"

_requested: list[str] = []  # the first value of ARCH_ENV this process read ("" when unset)


def requested_arch():
    """The architecture ``FP4MOE_ARCH`` names, or None when it is unset; the value is fixed at its
    first read (Triton caches kernels per process, so a change later would mix architectures)."""
    from ..arch import get_arch

    value = os.environ.get(ARCH_ENV, "").strip()
    if not _requested:
        _requested.append(value)
    elif value != _requested[0]:
        raise RuntimeError(f"{ARCH_ENV} changed from {_requested[0]!r} to {value!r} in this process; it applies to "
                           f"a whole process: set it before starting Python")
    if not value:
        return None
    try:
        arch = get_arch(value)
    except ValueError as err:
        raise ValueError(f"{ARCH_ENV}={value!r}: {err}") from None
    _lower_for(arch)
    return arch


def _lower_for(arch) -> None:
    """Make Triton lower every kernel of this process for ``arch`` (the PTX still targets the device)."""
    from triton import knobs

    current = knobs.runtime.override_arch
    if current not in (None, "", arch.name):
        raise ValueError(f"{ARCH_ENV}={arch.name} but TRITON_OVERRIDE_ARCH={current}: unset one of them")
    if current != arch.name:
        knobs.runtime.override_arch = arch.name


def device_capability_arch(device: torch.device):
    """The catalogue architecture of the CUDA device itself, whatever ``FP4MOE_ARCH`` says."""
    from ..arch import arch_for_capability

    return arch_for_capability(torch.cuda.get_device_capability(device))


def runtime_arch(device: torch.device):
    """The architecture whose kernels run on ``device``: None off CUDA (the interpreter); else the
    device's own, or the one ``FP4MOE_ARCH`` names where the device can run that architecture's
    code (``arch.emulation_gaps``: e.g. sm80, sm89 or sm120 W4A16 on an H200; never one that needs
    wgmma, tcgen05, TMA or PDL the device lacks, nor more shared memory). The launch sizes (SM
    count, L2) stay the device's."""
    if device.type != "cuda":
        return None
    from ..arch import emulation_gaps

    own = device_capability_arch(device)
    wanted = requested_arch()
    if wanted is None or wanted == own:
        return own
    gaps = emulation_gaps(wanted, own)
    if gaps:
        raise ValueError(f"{ARCH_ENV}={wanted.name}: {torch.cuda.get_device_name(device)} ({own.name}) cannot run "
                         f"{wanted.name}'s kernels; it lacks {'; '.join(gaps)}")
    return wanted


def check_native_fp4(device: torch.device) -> None:
    """Refuse native FP4 MMA (W4A4 on SM100/SM120) where ``FP4MOE_ARCH`` plans it for a device
    without FP4 tensor cores: the kernel would not assemble there."""
    if device.type != "cuda":
        return
    own = device_capability_arch(device)
    if own.fp4_mma == "none":
        raise ValueError(f"{ARCH_ENV}={runtime_arch(device).name} plans W4A4 on native FP4 MMA, which "
                         f"{torch.cuda.get_device_name(device)} ({own.name}) does not have; W4A16 runs, or emulate "
                         f"an architecture without FP4 MMA (e.g. sm89) for W4A4")


def pdl_enabled(device: torch.device) -> int:
    """1 when the kernels of a launch chain on ``device`` use programmatic dependent launch
    (``kernels.pdl``): compiled CUDA on an architecture with ``griddepcontrol`` (``Arch.has_pdl``),
    unless ``FP4MOE_PDL=0`` (for measuring what it saves); else 0. The launcher passes the result
    as both the kernel's ``PDL`` constexpr and ``launch_pdl``."""
    if device.type != "cuda" or interpreting() or os.environ.get("FP4MOE_PDL", "1") == "0":
        return 0
    try:
        return int(runtime_arch(device).has_pdl)
    except ValueError:  # not in the catalogue: launch without PDL (it only hides launch gaps)
        if requested_arch() is not None:  # FP4MOE_ARCH the device cannot run: say so
            raise
        return 0


def pdl_kwargs(device: torch.device) -> dict:
    """A chain kernel's launch arguments for ``pdl_enabled``: the ``PDL`` constexpr and ``launch_pdl``."""
    pdl = pdl_enabled(device)
    return {"PDL": pdl, "launch_pdl": bool(pdl)}

