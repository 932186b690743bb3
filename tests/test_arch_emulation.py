"""Another architecture's kernels on the GPU in hand (``FP4MOE_ARCH``, ``ops._runtime.runtime_arch``):
which pairs can run (CPU), the cross-compiler unaffected by an override (CPU), and on a GPU the
kernels lowered for the named architecture, planned for it and right at model sizes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from fp4moe.arch import ARCHS, emulation_gaps
from fp4moe.ops import _runtime

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))


@pytest.mark.parametrize("device,runs,refused", [
    ("sm90", ["sm80", "sm86", "sm89", "sm90", "sm120", "sm121"], ["sm100", "sm103"]),
    ("sm80", ["sm80"], ["sm86", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121"]),
    ("sm89", ["sm86", "sm89"], ["sm80", "sm90", "sm100", "sm120"]),
    ("sm120", ["sm86", "sm89", "sm120", "sm121"], ["sm80", "sm90", "sm100"]),
    ("sm100", ["sm80", "sm86", "sm89", "sm100", "sm103", "sm120", "sm121"], ["sm90"]),
])
def test_which_architectures_a_device_can_run(device, runs, refused):
    """An architecture's kernels run where the device has every instruction they may use and room
    for every launch planned for them: sm80 is refused on 99 KB parts (its 163 KB tiles), sm86+ on
    sm80 (max.xorsign.abs), wgmma and tcgen05 everywhere but their own families."""
    for name in runs:
        assert emulation_gaps(ARCHS[name], ARCHS[device]) == (), name
    for name in refused:
        assert emulation_gaps(ARCHS[name], ARCHS[device]), name


def test_gaps_name_what_is_missing():
    gaps = emulation_gaps(ARCHS["sm90"], ARCHS["sm120"])
    assert any("wgmma" in g for g in gaps) and any("shared memory per block (232,448 against 101,376)" in g
                                                   for g in gaps)
    assert any("tensor memory" in g for g in emulation_gaps(ARCHS["sm100"], ARCHS["sm90"]))
    assert emulation_gaps(ARCHS["sm86"], ARCHS["sm80"]) == ("max.xorsign.abs",)


@pytest.fixture
def fresh_request(monkeypatch):
    """``requested_arch`` as in a new process, the Triton override left as it was."""
    from triton import knobs

    monkeypatch.setattr(_runtime, "_requested", [])
    before = knobs.runtime.__dict__.get("override_arch", None)
    env_before = os.environ.get("TRITON_OVERRIDE_ARCH")
    yield
    if before is None:
        knobs.runtime.__dict__.pop("override_arch", None)
    else:
        knobs.runtime.override_arch = before
    if env_before is None:
        os.environ.pop("TRITON_OVERRIDE_ARCH", None)
    else:
        os.environ["TRITON_OVERRIDE_ARCH"] = env_before


def test_requested_arch_parses_once_per_process(fresh_request, monkeypatch):
    from triton import knobs

    monkeypatch.delenv("FP4MOE_ARCH", raising=False)
    assert _runtime.requested_arch() is None
    monkeypatch.setenv("FP4MOE_ARCH", "sm_89")
    with pytest.raises(RuntimeError, match="changed from '' to 'sm_89'"):
        _runtime.requested_arch()

    monkeypatch.setattr(_runtime, "_requested", [])
    assert _runtime.requested_arch() is ARCHS["sm89"]
    assert knobs.runtime.override_arch == "sm89"  # Triton lowers for it from now on

    monkeypatch.setattr(_runtime, "_requested", [])
    monkeypatch.setenv("FP4MOE_ARCH", "sm75")
    with pytest.raises(ValueError, match=r"FP4MOE_ARCH='sm75'.*SM80 and newer"):
        _runtime.requested_arch()


def test_requested_arch_refuses_a_different_triton_override(fresh_request, monkeypatch):
    from triton import knobs

    knobs.runtime.override_arch = "sm80"
    monkeypatch.setenv("FP4MOE_ARCH", "sm120")
    with pytest.raises(ValueError, match="TRITON_OVERRIDE_ARCH=sm80"):
        _runtime.requested_arch()


def test_runtime_arch_is_none_off_cuda(fresh_request, monkeypatch):
    monkeypatch.setenv("FP4MOE_ARCH", "sm80")
    assert _runtime.runtime_arch(torch.device("cpu")) is None


def test_cross_compilation_ignores_an_override(monkeypatch):
    """The planner proves the target it names even when the process lowers for another
    (TRITON_OVERRIDE_ARCH, which FP4MOE_ARCH sets): an sm_90 compile of a bf16 tl.dot kernel is a
    wgmma, not sm80's mma.sync, whether compiled by the worker in this process or in its own."""
    from fp4moe.plan.crosscompile import cross_compile
    from fp4moe.plan.space import LinearProblem, get_kernel
    from fp4moe.arch import get_arch

    spec = get_kernel("fp4_linear")
    problem = LinearProblem(M=256, N=256, K=256, fmt="nvfp4", mode="w4a16")
    sm90 = get_arch("sm90")
    request = spec.compile_request(spec.heuristic(problem, sm90, 132), problem, sm90)
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", "sm80")
    monkeypatch.setenv("FP4MOE_ARCH", "sm80")
    (result,) = cross_compile([request])
    assert result.ok, result.error
    assert any(m.startswith("wgmma") for m in result.mma), result.mma

    # the worker itself, given the override in its environment
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "fp4moe.plan.worker"], input=json.dumps([dataclasses.asdict(request)]),
                          env=env, capture_output=True, text=True, timeout=600)
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["ok"], line["error"]
    assert any(m.startswith("wgmma") for m in line["mma"]), line["mma"]


# ---------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------

_EMULATED_RUN = r"""
import json, sys, torch
import importlib
from fp4moe.ops._runtime import runtime_arch
from fp4moe.ops.linear import fp4_linear, fp4_linear_reference
from fp4moe.ops.moe import moe_experts, fp4_moe_reference
from fp4moe.ops.routing import route
from fp4moe.models import Routing
from fp4moe.guard import device_name
from fp4moe.quantize import quantize

dev = torch.device("cuda")
torch.manual_seed(0)
out = {"arch": runtime_arch(dev).name, "guard_device": device_name(dev), "errors": {}}
def err(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
for M, N, K in [(1, 6144, 2048), (16, 4096, 6144), (64, 6144, 2048), (300, 2048, 6144)]:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = quantize(torch.randn(N, K, device=dev), "nvfp4")
    out["errors"][f"linear M{M} {N}x{K}"] = err(fp4_linear(x, w), fp4_linear_reference(x, w))
T, E, k, H, I = 64, 32, 8, 2048, 768
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
w13 = quantize(torch.randn(E, 2 * I, H, device=dev), "nvfp4")
w2 = quantize(torch.randn(E, H, I, device=dev), "nvfp4")
routed = route(torch.randn(T, E, device=dev), Routing("softmax", top_k=k))
ids, wts = routed.topk_ids, routed.topk_weights
out["errors"]["moe T64"] = err(moe_experts(x, w13, w2, ids, wts), fp4_moe_reference(x, w13, w2, ids, wts))
archs = set()
for name in ("linear", "linear_mma", "moe", "quantize", "dispatch", "routing", "gemm_wgmma", "gemm_ws"):
    for fn in vars(importlib.import_module("fp4moe.kernels." + name)).values():
        for cache in getattr(fn, "device_caches", {}).values():
            archs |= {kernel.metadata.arch for kernel in cache[0].values()}
out["lowered_for"] = sorted(archs)
try:
    fp4_linear(torch.randn(1, 2048, device=dev, dtype=torch.bfloat16),
               quantize(torch.randn(256, 2048, device=dev), "nvfp4"), mode="w4a4")
    out["w4a4"] = "ran"
except ValueError as e:
    out["w4a4"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sm80", "sm89", "sm120"])
def test_gpu_runs_another_architectures_kernels(name):
    """FP4MOE_ARCH=sm80/sm89/sm120 on a newer GPU (the H200 here): every fp4moe kernel the process
    compiled (quantizer, routing, dispatch, linear and MoE GEMMs) was lowered by Triton for that
    architecture; the outputs (decode, split-K,
    prefill tiles of that architecture's plan; an MoE layer) match the reference within the
    guard's W4A16 tolerance; the guard keys them apart from the GPU's own kernels; W4A4 runs
    emulated where the named architecture has no FP4 MMA and is refused, clearly, where the
    architecture has it and the GPU does not."""
    from fp4moe.guard import TOLERANCES
    from fp4moe.ops._runtime import device_capability_arch

    own = device_capability_arch(torch.device("cuda"))
    if emulation_gaps(ARCHS[name], own):
        pytest.skip(f"{own.name} cannot run {name}'s kernels")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH")}
    env["FP4MOE_ARCH"] = name
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _EMULATED_RUN], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["arch"] == name
    assert out["lowered_for"] == [name], out["lowered_for"]
    assert out["guard_device"].endswith(f"running {name} kernels")
    for case, e in out["errors"].items():
        assert e < TOLERANCES["fp4_moe" if case.startswith("moe") else "fp4_linear"].max_rel, (case, e)
    if ARCHS[name].fp4_mma != "none" and own.fp4_mma == "none":
        assert "native FP4 MMA" in out["w4a4"], out["w4a4"]
    else:
        assert out["w4a4"] == "ran", out["w4a4"]
