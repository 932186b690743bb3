"""What every launcher asks of the runtime: is Triton interpreting, which dtype the MMA takes, which
architecture's kernels run on the device (``FP4MOE_ARCH``) and the launch options that follow."""

from __future__ import annotations

import functools
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


#: elements of a weight's block scales ``check_fp4_values`` examines per step (bounds its temporaries)
CHECK_CHUNK = 1 << 26


def _first_bad(mask: torch.Tensor, shape: torch.Size) -> tuple[list[int], int]:
    """The index (in ``shape``) of the first True of the flat ``mask``, and how many are True."""
    flat = int(torch.nonzero(mask)[0, 0])
    index = list(torch.unravel_index(torch.tensor(flat), tuple(shape))) if len(shape) else []
    return [int(i) for i in index], int(mask.sum())


def check_fp4_values(w, name: str = "w") -> None:
    """Refuse an FP4Tensor whose values the kernels would decode otherwise than ``dequantize``:

    * NVFP4 block scales (E4M3) that are NaN codes (0x7F, 0xFF: the kernels' integer decode reads
      them as 480) or negative (sign bit set: the kernels ignore it; -0 = 0x80 is allowed);
    * MXFP4 block scales (E8M0) that are the NaN code 0xFF;
    * global scales that are not positive and finite (NaN, Inf, zero, negative);
    * data, scales and global scale on different devices.

    Raises ValueError naming ``name``, the first offending index, what was expected and what was
    found. ``quantize`` and the checkpoint reader never produce such values. One host sync (the
    scales are examined ``CHECK_CHUNK`` elements at a time): call it once per weight, when a module
    is built or weights are loaded or packed, never per call. Meta tensors hold no values: only the
    devices are checked."""
    parts = [("data", w.data), ("scales", w.scales)]
    if w.global_scale is not None:
        parts.append(("global_scale", w.global_scale))
    devices = {t.device for _, t in parts}
    if len(devices) > 1:
        found = ", ".join(f"{p} on {t.device}" for p, t in parts)
        raise ValueError(f"{name}: expected data, block scales and global scale on one device, found {found}")
    if w.data.device.type == "meta":
        return
    from ..formats import invalid_scale_codes

    nvfp4 = w.fmt.scale_kind == "e4m3"
    bits = w.scales.reshape(-1).view(torch.uint8)

    def bad_scales(chunk: torch.Tensor) -> torch.Tensor:
        return invalid_scale_codes(chunk, w.fmt.scale_kind)

    flags = torch.zeros(2, dtype=torch.bool, device=bits.device)
    for i in range(0, bits.numel(), CHECK_CHUNK):
        flags[0] |= bad_scales(bits[i:i + CHECK_CHUNK]).any()
    g = w.global_scale
    if g is not None and g.numel():
        gf = g.reshape(-1).to(torch.float32)
        flags[1] = (~(torch.isfinite(gf) & (gf > 0))).any()
    bad_block, bad_global = flags.tolist()  # the one host sync
    if bad_block:
        mask = bad_scales(bits)
        index, count = _first_bad(mask, w.scales.shape)
        code = int(bits[int(torch.nonzero(mask)[0, 0])])
        more = f" ({count} bad block scales in all)" if count > 1 else ""
        if not nvfp4:
            found = f"the E8M0 NaN code (0x{code:02x})"
            want = "an E8M0 exponent 0x00..0xfe"
        elif code & 0x7F == 0x7F:
            found = f"a NaN code (0x{code:02x})"
            want = "a finite non-negative E4M3 scale"
        else:
            value = torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
            found = f"negative (0x{code:02x} = {value})"
            want = "a non-negative E4M3 scale (sign bit clear)"
        raise ValueError(f"{name}: block scale at {index} is {found}; expected {want}{more}")
    if bad_global:
        gf = g.reshape(-1).to(torch.float32)
        mask = ~(torch.isfinite(gf) & (gf > 0))
        index, count = _first_bad(mask, g.shape)
        value = float(gf[int(torch.nonzero(mask)[0, 0])])
        more = f" ({count} bad global scales in all)" if count > 1 else ""
        raise ValueError(f"{name}: global scale at {index} is {value!r}; expected a positive finite value{more}")


def check_fp4_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """``FP4Linear``'s ``load_state_dict`` pre-hook: ``check_fp4_values`` on the weight about to be
    loaded (the state dict's ``weight``, ``weight_scale``, ``weight_scale_2``, the module's own
    buffers for those it lacks), before anything is copied. Entries of another shape or kind are
    left to ``load_state_dict``'s own error."""
    shape = torch.Size((module.out_features, module.in_features))
    _check_loaded_fp4(module, state_dict, prefix, "weight", shape, module.fmt)


def check_fp4_moe_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                             error_msgs) -> None:
    """``FP4MoE``'s ``load_state_dict`` pre-hook: ``check_fp4_state_dict`` for each stacked expert
    weight (``w13_weight*``, ``w2_weight*``)."""
    for name, (shape, fmt) in module._fp4.items():
        _check_loaded_fp4(module, state_dict, prefix, f"{name}_weight", shape, fmt)


def _check_loaded_fp4(module, state_dict, prefix: str, base: str, shape: torch.Size, fmt) -> None:
    """``check_fp4_values`` on the FP4 weight ``base`` (its data, ``_scale`` and ``_scale_2`` buffers)
    as ``state_dict`` would leave it."""
    from ..quantize import FP4Tensor

    names = (base, f"{base}_scale", f"{base}_scale_2")
    if not any(prefix + n in state_dict for n in names):
        return
    parts = []
    for n in names:
        own = module._buffers.get(n)
        new = state_dict.get(prefix + n, own)
        if own is None or new is None:
            parts.append(None)
            continue
        if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(own.shape):
            return
        if n == base and new.dtype != own.dtype:
            return
        parts.append(new.detach().to(own.dtype))  # load_state_dict casts as it copies
    if any(t is not None and t.device.type == "meta" for t in parts):
        return  # no values to check (a partial load into a module built on meta)
    device = parts[1].device
    data, scales, gs = (None if t is None else t.to(device) for t in parts)
    check_fp4_values(FP4Tensor(data=data, scales=scales, global_scale=gs, shape=shape, fmt=fmt), prefix + base)


def check_weight_scales(w, name: str = "w", activations: str = "bf16") -> None:
    """Refuse weights the kernels cannot decode as ``dequantize`` does: ``check_fp4_values`` (NaN or
    negative block scales, bad global scales) and MXFP4 scales out of the range
    ``check_weight_scale_range`` allows. One host sync or two: call it when weights are loaded or
    packed (modules do, at construction), never per call."""
    check_fp4_values(w, name)
    check_weight_scale_range(w, name, activations)


def check_weight_scale_range(w, name: str = "w", activations: str = "bf16") -> None:
    """Refuse MXFP4 weights whose scales the kernels cannot decode exactly with ``activations``
    ("bf16" or "fp16"): one host sync, so call it when weights are loaded, not per call. NVFP4's
    E4M3 scales are always in range."""
    if w.fmt.scale_kind != "e8m0" or w.scales.numel() == 0 or w.scales.device.type == "meta":
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
#: on the GPU in hand: the configurations and paths fp4moe chooses for it, each kernel lowered by
#: Triton for it (the launch option ``arch``, ``arch_kwargs``) and assembled for the device. For
#: running another generation's code on silicon where only a newer GPU is at hand
#: (``device_arch``); read once per process.
ARCH_ENV = "FP4MOE_ARCH"

_requested: list[str] = []  # the first value of ARCH_ENV this process read ("" when unset)


def requested_arch():
    """The architecture ``FP4MOE_ARCH`` names, or None when it is unset; the value is fixed at its
    first read (the guard and the packed-weight caches are per process)."""
    from ..target import get_arch

    value = os.environ.get(ARCH_ENV, "").strip()
    if not _requested:
        _requested.append(value)
    elif value != _requested[0]:
        raise RuntimeError(f"{ARCH_ENV} changed from {_requested[0]!r} to {value!r} in this process; it applies to "
                           f"a whole process: set it before starting Python")
    if not value:
        return None
    try:
        return get_arch(value)
    except ValueError as err:
        raise ValueError(f"{ARCH_ENV}={value!r}: {err}") from None


def device_capability_arch(device: torch.device):
    """The catalogue architecture of the CUDA device itself, whatever ``FP4MOE_ARCH`` says."""
    from ..target import arch_for_capability

    try:
        return arch_for_capability(torch.cuda.get_device_capability(device))
    except ValueError as err:
        if os.environ.get(ARCH_ENV, "").strip():
            raise ValueError(f"{ARCH_ENV} is set, but {err}") from None
        raise


def device_arch(device: torch.device):
    """The architecture whose kernels run on ``device``: None off CUDA (the interpreter); else the
    device's own, or the one ``FP4MOE_ARCH`` names where the device can run that architecture's
    code (``target.emulation_gaps``: e.g. sm80, sm89 or sm120 W4A16 on an H200; never one that needs
    wgmma, tcgen05, TMA or PDL the device lacks, nor more shared memory). The launch sizes (SM
    count, L2) stay the device's. Resolved once per device (every launch asks, ``arch_kwargs``)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_arch(index, os.environ.get(ARCH_ENV, "").strip())


@functools.lru_cache(maxsize=None)
def _device_arch(index: int, requested: str):
    from ..target import emulation_gaps

    device = torch.device("cuda", index)
    own = device_capability_arch(device)
    wanted = requested_arch()  # raises if the variable changed since the process first read it
    if wanted is None or wanted == own:
        return own
    gaps = emulation_gaps(wanted, own)
    if gaps:
        raise ValueError(f"{ARCH_ENV}={wanted.name}: {torch.cuda.get_device_name(device)} ({own.name}) cannot run "
                         f"{wanted.name}'s kernels; it lacks {'; '.join(gaps)}")
    return wanted


def emulated_arch(device: torch.device):
    """The architecture ``FP4MOE_ARCH`` has ``device`` run when it is not the device's own, else
    None (also off CUDA, and for a device outside the catalogue with the variable unset)."""
    if device.type != "cuda" or not os.environ.get(ARCH_ENV, "").strip():
        return None
    arch = device_arch(device)
    return None if arch == device_capability_arch(device) else arch


def arch_kwargs(device: torch.device) -> dict:
    """Every fp4moe kernel launch's ``arch`` option: Triton lowers the kernel for ``device_arch``
    (the device's own, or ``FP4MOE_ARCH``'s) whatever ``TRITON_OVERRIDE_ARCH`` says, and its
    in-memory cache keys the kernel by it. Nothing off CUDA or under the interpreter."""
    if device.type != "cuda" or interpreting():
        return {}
    return {"arch": device_arch(device).name}


def check_native_fp4(device: torch.device) -> None:
    """Refuse native FP4 MMA where ``FP4MOE_ARCH`` plans an instruction the device does not have
    (W4A4 of sm120 on a GPU without FP4 tensor cores, or on SM100's tcgen05 ones): the kernel would
    not assemble there."""
    if device.type != "cuda":
        return
    own, planned = device_capability_arch(device), device_arch(device)
    if planned.fp4_mma != "none" and planned.fp4_mma != own.fp4_mma:
        have = "no FP4 MMA" if own.fp4_mma == "none" else f"FP4 MMA by {own.fp4_mma}"
        raise ValueError(f"{ARCH_ENV}={planned.name} plans W4A4 on FP4 MMA by {planned.fp4_mma}; "
                         f"{torch.cuda.get_device_name(device)} ({own.name}) has {have}. W4A16 runs, or name an "
                         f"architecture without FP4 MMA (e.g. sm89) for emulated W4A4")


def pdl_enabled(device: torch.device) -> int:
    """1 when the kernels of a launch chain on ``device`` use programmatic dependent launch
    (``kernels.pdl``): compiled CUDA on an architecture with ``griddepcontrol`` (``Arch.has_pdl``),
    unless ``FP4MOE_PDL=0`` (for measuring what it saves); else 0. The launcher passes the result
    as both the kernel's ``PDL`` constexpr and ``launch_pdl``."""
    if device.type != "cuda" or interpreting() or os.environ.get("FP4MOE_PDL", "1") == "0":
        return 0
    try:
        arch = device_arch(device)
    except ValueError:
        if os.environ.get(ARCH_ENV, "").strip():  # a name or a device FP4MOE_ARCH cannot use: say so
            raise
        return 0  # not in the catalogue: launch without PDL (it only hides launch gaps)
    return int(arch.has_pdl)


def pdl_kwargs(device: torch.device) -> dict:
    """A chain kernel's launch arguments for ``pdl_enabled``: the ``PDL`` constexpr and ``launch_pdl``."""
    pdl = pdl_enabled(device)
    return {"PDL": pdl, "launch_pdl": bool(pdl)}
