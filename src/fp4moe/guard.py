"""First-use numerical guard: no kernel configuration returns silently wrong numbers.

The first time a (kernel, configuration, GPU) runs in a process, the launcher hands the guard a
probe: a small problem run through the same kernel and configuration, and the torch reference.
All-zero output, NaN/Inf where the reference is finite, or an error above the kernel's tolerance
raises :class:`GuardError` naming the kernel and the configuration. Results are cached per
process.

Environment:
  FP4MOE_GUARD=1 (default) check and raise;  =warn  check, warn, and fall back to the torch
  reference for that key;  =0  no checks (benchmarking); the first time the guard is consulted
  while it is off, a RuntimeWarning says so, once per process.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["GuardError", "GuardKey", "Tolerance", "TOLERANCES", "check", "compare", "should_check",
           "use_reference", "reset", "device_name"]


class GuardError(RuntimeError):
    """A kernel configuration produced numbers that disagree with its reference."""


@dataclass(frozen=True)
class GuardKey:
    kernel: str
    config: str
    device: str


@dataclass(frozen=True)
class Tolerance:
    """Bounds on the error of an output against its reference, normalised by max |reference|."""

    max_rel: float
    rms_rel: float
    reason: str


#: One table of tolerances, used by the guard and by the tests. Errors are normalised by
#: max |reference| (max_rel) and by the RMS of the reference (rms_rel).
TOLERANCES: dict[str, Tolerance] = {
    "fp4_linear": Tolerance(
        max_rel=2e-2, rms_rel=1e-2,
        reason="operands are decoded exactly (E2M1 x scale fits bf16); only the fp32 accumulation "
               "order differs (~1e-6 sqrt(K)) and the output is rounded to bf16/fp16 (2**-8 relative "
               "to each element, up to 2**-8 of max |y|)",
    ),
    "fp4_moe": Tolerance(
        max_rel=3e-2, rms_rel=1.5e-2,
        reason="as fp4_linear for each GEMM; in addition the SwiGLU output is rounded to bf16 in both "
               "kernel and reference, and a 1-ulp difference of the first GEMM can flip that rounding "
               "(2**-8 relative on one h element), which the second GEMM averages over I terms",
    ),
    "fp4_moe_w4a4": Tolerance(
        max_rel=1.5e-1, rms_rel=6e-2,
        reason="the SwiGLU output is re-quantized to NVFP4: where kernel and reference differ by one bf16 "
               "ulp (accumulation order) next to an E2M1 rounding midpoint, the element lands one E2M1 "
               "step (25-50% of its value) apart; a few percent of elements do, so the layer output "
               "differs by a few percent RMS. The quantizer itself is bit-exact (tested separately)",
    ),
}
TOLERANCES["fp4_linear_mma"] = TOLERANCES["fp4_linear"]  # same numerics, weights in MMA operand order
TOLERANCES["fp4_moe_mma"] = TOLERANCES["fp4_moe"]
TOLERANCES["fp4_linear_wgmma"] = TOLERANCES["fp4_linear"]  # the same decode, wgmma instead of mma.sync
TOLERANCES["fp4_moe_wgmma"] = TOLERANCES["fp4_moe"]
# the weight dequantized exactly to bf16, then cuBLAS: the same products, fp32 sums, one rounding
TOLERANCES["fp4_linear_dequant_matmul"] = TOLERANCES["fp4_linear"]


_lock = threading.Lock()
_checked: dict[GuardKey, bool] = {}  # key -> passed
_failures: dict[GuardKey, str] = {}  # key -> what was wrong
_warned_capture: set[GuardKey] = set()
_warned_off = False  # "the guard is off" said in this process


def mode() -> str:
    """'raise', 'warn' or 'off', from ``FP4MOE_GUARD``; 'off' warns the first time in a process."""
    raw = os.environ.get("FP4MOE_GUARD", "1")
    value = raw.strip().lower()
    if value in ("0", "off", "false", "no"):
        _warn_off(raw.strip())
        return "off"
    if value == "warn":
        return "warn"
    return "raise"


def _warn_off(value: str) -> None:
    global _warned_off
    with _lock:
        if _warned_off:
            return
        _warned_off = True
    warnings.warn(f"fp4moe guard is off (FP4MOE_GUARD={value}): kernels run unchecked", RuntimeWarning,
                  stacklevel=4)  # mode() <- the guard function <- the launcher's caller


def device_name(device: torch.device) -> str:
    """The device part of a guard key: the GPU's name, and the architecture whose kernels it runs
    where ``FP4MOE_ARCH`` names another than its own."""
    if device.type == "cuda":
        from .ops._runtime import emulated_arch

        name = torch.cuda.get_device_name(device)
        arch = emulated_arch(device)
        return name if arch is None else f"{name} running {arch.name} kernels"
    return f"{device.type} (Triton interpreter)"


def should_check(key: GuardKey) -> bool:
    """True when this key has not been checked in this process and checking is possible now."""
    if mode() == "off" or key in _checked:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # no host synchronisation inside a CUDA graph capture: the kernel goes into the graph unchecked
        if key not in _warned_capture:
            _warned_capture.add(key)
            warnings.warn(f"fp4moe guard: kernel {key.kernel} with configuration {key.config} is first used "
                          "inside a CUDA graph capture and cannot be checked there; make one eager call before "
                          "capturing", RuntimeWarning, stacklevel=3)
        return False
    if torch.compiler.is_compiling():
        return False
    return True


def use_reference(key: GuardKey) -> bool:
    """True when the key failed its check and the guard is in 'warn' mode: callers run the torch
    reference instead. In 'raise' mode a key that failed raises again on every use."""
    if _checked.get(key) is not False:
        return False
    if mode() == "warn":
        return True
    raise GuardError(_failures.get(key, f"fp4moe guard: kernel {key.kernel} with configuration {key.config} failed"))


def reset() -> None:
    """Forget every result (tests)."""
    with _lock:
        _checked.clear()
        _failures.clear()
        _warned_capture.clear()


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> str | None:
    """None when ``out`` matches ``ref`` within ``tol``; otherwise what is wrong, in words."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}"
    o, r = out.detach().to(torch.float32).cpu(), ref.detach().to(torch.float32).cpu()
    r_finite = torch.isfinite(r)
    bad = ~torch.isfinite(o) & r_finite
    if bool(bad.any()):
        return f"{int(bad.sum())} NaN/Inf values where the reference is finite"
    if bool((o == 0).all()) and bool((r != 0).any()):
        return "the output is all zeros while the reference is not"
    scale = r[r_finite].abs().max().item() if bool(r_finite.any()) else 0.0
    if scale == 0.0:
        return None if bool((o[r_finite] == 0).all()) else "non-zero output where the reference is zero"
    err = (o - r)[r_finite]
    max_rel = err.abs().max().item() / scale
    rms_ref = r[r_finite].pow(2).mean().sqrt().item()
    rms_rel = err.pow(2).mean().sqrt().item() / max(rms_ref, 1e-30)
    if max_rel > tol.max_rel or rms_rel > tol.rms_rel:
        return (f"error above tolerance: max {max_rel:.3g} (limit {tol.max_rel:g}), "
                f"rms {rms_rel:.3g} (limit {tol.rms_rel:g}) relative to the reference")
    return None


def check(key: GuardKey, probe: Callable[[], tuple[torch.Tensor, torch.Tensor]], tolerance: str | None = None) -> bool:
    """Run ``probe`` (returns kernel output and reference) once for ``key`` and judge it."""
    tol = TOLERANCES[tolerance or key.kernel.split("[")[0]]
    out, ref = probe()
    problem = compare(out, ref, tol)
    with _lock:
        _checked[key] = problem is None
    if problem is None:
        return True
    message = (f"fp4moe guard: kernel {key.kernel} with configuration {key.config} on {key.device}: {problem}. "
               f"Set FP4MOE_GUARD=warn to fall back to the torch reference, or pin another configuration.")
    with _lock:
        _failures[key] = message
    if mode() == "warn":
        warnings.warn(message + " Falling back to the torch reference.", RuntimeWarning, stacklevel=3)
        return False
    raise GuardError(message)
