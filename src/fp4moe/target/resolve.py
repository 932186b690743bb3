"""Resolving the catalogue (``fp4moe.target.catalogue``): architectures and products by any usual
spelling, what one architecture's code needs that another lacks, the GPU in hand (``detect``) and
where it differs from the catalogue (``compare``, a pure function, tested on CPU), and the
catalogue's records as JSON. Nothing happens at import time.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .catalogue import _ARCH_BY_CAPABILITY, _GPU_LIST, ARCHS, GPU, GPUS, Arch, _tokens

__all__ = [
    "Detected",
    "arch_for_capability",
    "as_dict",
    "compare",
    "detect",
    "emulation_gaps",
    "find_gpu",
    "get_arch",
    "resolve_target",
]


# --------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------


def _known_archs() -> str:
    return ", ".join(ARCHS)


def arch_for_capability(cc: tuple[int, int]) -> Arch:
    """The catalogue architecture of a compute capability, e.g. ``(12, 0)`` -> sm120."""
    if (
        not isinstance(cc, tuple)
        or len(cc) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in cc)
    ):
        raise ValueError(f"arch_for_capability: argument 'cc' must be a (major, minor) tuple of ints; received {cc!r}")
    arch = _ARCH_BY_CAPABILITY.get(cc)
    if arch is not None:
        return arch
    major, minor = cc
    if (major, minor) < (8, 0):
        reason = "fp4moe supports SM80 and newer"
    else:
        reason = "it is not in the catalogue"
    raise ValueError(
        f"arch_for_capability: compute capability {major}.{minor} (sm{major}{minor}) is not supported: "
        f"{reason}; known archs: {_known_archs()}"
    )


def emulation_gaps(target: Arch, device: Arch) -> tuple[str, ...]:
    """What ``device`` lacks to run ``target``'s kernels: compiled as Triton compiles for ``target``
    (its lowering, the configurations fp4moe chooses for it) but assembled for ``device``. Empty
    where it can (``FP4MOE_ARCH``, ``fp4moe.ops._runtime.device_arch``). Native FP4 MMA is not
    listed: W4A16 and emulated W4A4 run without it, and the runtime refuses native W4A4 on its own
    (``check_native_fp4``).

    The instructions an architecture's code may use are its catalogue fields; the limits a launch
    planned for it may reach (shared memory per block, registers, cluster size) must not exceed
    the device's."""
    gaps = []
    if target.bf16_mma != "mma.sync" and target.bf16_mma != device.bf16_mma:  # mma.sync exists from sm_80
        gaps.append(f"{target.bf16_mma} bf16 MMA ({target.name}'s dot products; {device.name} has {device.bf16_mma})")
    if target.has_tmem and not device.has_tmem:
        gaps.append("tensor memory (tcgen05)")
    for flag, what in (("has_tma", "bulk copies (TMA)"), ("has_pdl", "programmatic dependent launch"),
                       ("has_multicast", "TMA multicast"), ("has_xorsign_abs_max", "max.xorsign.abs")):
        if getattr(target, flag) and not getattr(device, flag):
            gaps.append(what)
    # limits a launch fails beyond (occupancy assumptions such as threads per SM only change speed)
    for limit, what in (("smem_per_block_optin", "shared memory per block"), ("regs_per_sm", "registers per SM"),
                        ("max_cluster_size", "cluster size")):
        if getattr(target, limit) > getattr(device, limit):
            gaps.append(f"{what} ({getattr(target, limit):,} against {getattr(device, limit):,})")
    return tuple(gaps)


# "sm_120", "sm120", "sm_100a", "compute_90", "120" ... and "12.0".
_ARCH_NAME_RE = re.compile(r"^(?:sm|compute)?_?(\d{2,3})[af]?$")
_ARCH_DOTTED_RE = re.compile(r"^(\d{1,2})\.(\d)$")


def get_arch(arch: str | int | tuple[int, int] | Arch) -> Arch:
    """The catalogue ``Arch`` for any usual spelling of an architecture.

    Accepts an ``Arch``; names such as ``"sm120"``, ``"sm_120"``, ``"SM_100a"``,
    ``"120"``; the integer ``120``; the capability ``(12, 0)`` or ``"12.0"``.
    """
    if isinstance(arch, Arch):
        return arch
    capability: tuple[int, int] | None = None
    if isinstance(arch, tuple):
        if len(arch) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in arch):
            capability = (arch[0], arch[1])
    elif isinstance(arch, int) and not isinstance(arch, bool):
        if arch >= 10:
            capability = divmod(arch, 10)
    elif isinstance(arch, str):
        text = arch.strip().lower()
        if match := _ARCH_NAME_RE.match(text):
            capability = divmod(int(match.group(1)), 10)
        elif match := _ARCH_DOTTED_RE.match(text):
            capability = (int(match.group(1)), int(match.group(2)))
    found = _ARCH_BY_CAPABILITY.get(capability) if capability is not None else None
    if found is None:
        too_old = " (fp4moe supports SM80 and newer)" if capability is not None and capability < (8, 0) else ""
        raise ValueError(
            f"get_arch: argument 'arch' received {arch!r}, which is not a known architecture{too_old}; "
            f"known archs: {_known_archs()} (also spelt 'sm_120', '120', 120, (12, 0) or '12.0')"
        )
    return found


# --------------------------------------------------------------------------------------
# Products
# --------------------------------------------------------------------------------------


def _known_gpus() -> str:
    return ", ".join(GPUS)


def find_gpu(text: str, *, strict: bool = False) -> GPU:
    """The catalogue GPU named by ``text``: a user spelling or a torch device name.

    Case, spaces and dashes do not matter ("RTX-PRO-6000", "rtx pro 6000",
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"). When several products match,
    the one whose matching alias is longest wins; an exact tie raises. A variant matches its
    catalogued product by name ("NVIDIA H100 PCIe" -> H100; ``compare`` then reports what
    differs); ``strict`` (planning for a named target) refuses it instead: another form factor
    ("pcie", "nvl") or memory size has other bandwidth and peaks.
    """
    if not isinstance(text, str) or not _tokens(text):
        raise ValueError(f"find_gpu: argument 'text' must name a GPU; received {text!r}; known GPUs: {_known_gpus()}")
    scored = [(gpu.match_length(text), gpu) for gpu in _GPU_LIST]
    best = max(score for score, _ in scored)
    if best == 0:
        spellings = {"".join(_tokens(a)): g.name for g in _GPU_LIST for a in (g.name, *g.aliases)}
        close = difflib.get_close_matches("".join(_tokens(text)), list(spellings), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(dict.fromkeys(spellings[c] for c in close))}?)" if close else ""
        raise ValueError(f"find_gpu: argument 'text' received {text!r}, which matches no catalogued GPU{hint}; "
                         f"known GPUs: {_known_gpus()}")
    winners = [gpu for score, gpu in scored if score == best]
    if len(winners) > 1:
        names = ", ".join(g.name for g in winners)
        raise ValueError(f"find_gpu: {text!r} is ambiguous between {names}; spell it out")
    gpu = winners[0]
    if not strict:
        return gpu
    # a form factor or memory size the catalogue entry is not: its bandwidth and peaks differ
    own = {t for a in (gpu.name, *gpu.aliases) for t in _tokens(a)}
    for tok in _tokens(text):
        size = re.fullmatch(r"(\d+)gb", tok)
        if (tok in _VARIANT_TOKENS and tok not in own) or (
                size and abs(int(size[1]) - gpu.memory_gib) > _MEMORY_TOLERANCE * gpu.memory_gib):
            raise ValueError(
                f"find_gpu: {text!r} names a variant ({tok!r}) of the catalogued {gpu.name} "
                f"({gpu.memory_gib:g} GB, {gpu.mem_bandwidth_gbs:,} GB/s), which the catalogue does not hold; its "
                f"bandwidth and peaks differ, so plans would be modelled on the wrong numbers: use --arch "
                f"{gpu.arch.name} to plan for the architecture alone")
    return gpu


#: name words that mark a form factor other than the catalogued (SXM / board) product
_VARIANT_TOKENS = frozenset({"pcie", "nvl"})


def resolve_target(gpu: str | None = None, arch: str | None = None) -> tuple[Arch, GPU | None]:
    """For command lines: a ``--gpu`` name gives its arch and product, an ``--arch`` the arch alone.

    Exactly one of the two must be given.
    """
    if (gpu is None) == (arch is None):
        raise ValueError(
            f"resolve_target: give exactly one of gpu= or arch=; received gpu={gpu!r}, arch={arch!r}"
        )
    if gpu is not None:
        product = find_gpu(gpu, strict=True)
        return product.arch, product
    assert arch is not None
    return get_arch(arch), None


# --------------------------------------------------------------------------------------
# The GPU in hand
# --------------------------------------------------------------------------------------

# Reported memory may sit below the datasheet figure (ECC, driver and OS reservations:
# e.g. 139.8 GiB on a 141 GB H200, ~119 GiB of a DGX Spark's 128 GB). Beyond this
# fraction it is a different part (A100 40GB read as the catalogued 80GB) or a MIG slice.
_MEMORY_TOLERANCE = 0.15


@dataclass(frozen=True)
class Detected:
    """What was read from a device, its catalogue matches, and where the two differ."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block_optin: int | None  # None when torch does not expose it
    total_memory_gib: float
    arch: Arch | None  # by capability; None when not in the catalogue
    gpu: GPU | None  # by name; None when not in the catalogue
    differences: tuple[str, ...]  # human sentences; empty when all agrees


def compare(
    name: str,
    capability: tuple[int, int],
    sm_count: int,
    smem_optin: int | None,
    total_memory_gib: float,
) -> Detected:
    """Match device properties against the catalogue and list every disagreement.

    A pure function (no GPU needed): ``detect`` calls it with what torch reports.
    """
    capability = (int(capability[0]), int(capability[1]))
    major, minor = capability
    differences: list[str] = []

    arch = _ARCH_BY_CAPABILITY.get(capability)
    if arch is None:
        if capability < (8, 0):
            differences.append(
                f"compute capability {major}.{minor} is not supported: fp4moe supports SM80 and newer"
            )
        else:
            differences.append(
                f"compute capability {major}.{minor} (sm{major}{minor}) is not in the catalogue "
                f"(known archs: {_known_archs()})"
            )

    try:
        gpu: GPU | None = find_gpu(name)
    except ValueError:
        gpu = None
        limits = f"the {arch.name} limits apply" if arch is not None else "no limits are known"
        differences.append(f"{name!r} is not in the catalogue of GPUs; {limits}")

    if gpu is not None:
        if gpu.arch.capability != capability:
            cat_major, cat_minor = gpu.arch.capability
            differences.append(
                f"{name!r} reports compute capability {major}.{minor}; "
                f"the catalogue's {gpu.name} is {cat_major}.{cat_minor} ({gpu.arch.name})"
            )
        if sm_count != gpu.sm_count:
            differences.append(
                f"{name!r} reports {sm_count} SMs; the catalogue's {gpu.name} has {gpu.sm_count} "
                f"(a cut-down variant, a MIG slice, or a different product)"
            )
        if abs(total_memory_gib - gpu.memory_gib) > _MEMORY_TOLERANCE * gpu.memory_gib:
            differences.append(
                f"{name!r} reports {total_memory_gib:.1f} GiB of memory; the catalogue's {gpu.name} "
                f"has {gpu.memory_gib:g} (a different memory variant or a MIG slice)"
            )

    if arch is not None and smem_optin is not None and smem_optin != arch.smem_per_block_optin:
        differences.append(
            f"{name!r} reports {smem_optin} B of opt-in shared memory per block; "
            f"{arch.name} in the catalogue allows {arch.smem_per_block_optin} B"
        )

    return Detected(
        name=name,
        capability=capability,
        sm_count=sm_count,
        smem_per_block_optin=smem_optin,
        total_memory_gib=total_memory_gib,
        arch=arch,
        gpu=gpu,
        differences=tuple(differences),
    )


def detect(device: int | None = None) -> Detected | None:
    """Read the CUDA device ``device`` (default: the current one) and compare it with the catalogue.

    Returns None when CUDA is not available.
    """
    import torch  # imported here: the catalogue itself needs no torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    smem_optin = getattr(props, "shared_memory_per_block_optin", None)
    return compare(
        name=props.name,
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        smem_optin=int(smem_optin) if smem_optin is not None else None,
        total_memory_gib=props.total_memory / 2**30,
    )


# --------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Arch):
            out["triton_target"] = list(value.triton_target)
        return out
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"as_dict: cannot serialise {type(value).__name__} value {value!r}")


def as_dict(obj: Arch | GPU | Detected) -> dict[str, Any]:
    """A JSON-serialisable dict of an ``Arch``, ``GPU`` or ``Detected`` (tuples become lists).

    A GPU's or Detected's arch is nested in full; an ``Arch`` also carries its
    ``triton_target``.
    """
    if not isinstance(obj, (Arch, GPU, Detected)):
        raise TypeError(f"as_dict: argument 'obj' must be an Arch, GPU or Detected; received {type(obj).__name__}")
    result = _plain(obj)
    assert isinstance(result, dict)
    return result
