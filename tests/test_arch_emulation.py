"""Another architecture's kernels on the GPU in hand (``FP4MOE_ARCH``, ``ops._runtime.device_arch``):
which pairs can run (CPU), the cross-compiler unaffected by an override (CPU), and on a GPU the
kernels lowered for the named architecture, planned for it and right at model sizes."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from fp4moe.target import ARCHS, emulation_gaps
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
    """``requested_arch`` as in a new process."""
    monkeypatch.setattr(_runtime, "_requested", [])


def test_requested_arch_parses_once_per_process(fresh_request, monkeypatch):
    monkeypatch.delenv("FP4MOE_ARCH", raising=False)
    assert _runtime.requested_arch() is None
    monkeypatch.setenv("FP4MOE_ARCH", "sm_89")
    with pytest.raises(RuntimeError, match="changed from '' to 'sm_89'"):
        _runtime.requested_arch()

    monkeypatch.setattr(_runtime, "_requested", [])
    assert _runtime.requested_arch() is ARCHS["sm89"]

    monkeypatch.setattr(_runtime, "_requested", [])
    monkeypatch.setenv("FP4MOE_ARCH", "sm75")
    with pytest.raises(ValueError, match=r"FP4MOE_ARCH='sm75'.*SM80 and newer"):
        _runtime.requested_arch()


def _launch_calls(source: str):
    """(kernel name, call text) of every ``<name>_kernel[grid](...)`` launch in ``source``."""
    for m in re.finditer(r"(\w+_kernel)\[", source):
        i, depth = m.end() - 1, 0
        while True:  # the subscript, then the call's parentheses
            depth += source[i] == "["
            depth -= source[i] == "]"
            i += 1
            if depth == 0:
                break
        if source[i] != "(":
            continue
        j, depth = i, 0
        while True:
            depth += source[j] in "([{"
            depth -= source[j] in ")]}"
            j += 1
            if depth == 0:
                break
        yield m.group(1), source[i:j]


def test_every_launch_names_the_architecture_to_lower_for():
    """Each fp4moe kernel launch passes ``arch_kwargs``: Triton then lowers it for the architecture
    whose kernels run (``FP4MOE_ARCH`` or the device's own), whatever ran before in the process or
    ``TRITON_OVERRIDE_ARCH`` says, and keys its in-memory cache by it."""
    import pathlib

    import fp4moe

    root = pathlib.Path(fp4moe.__file__).parent
    launches = [(path.name, name, call) for path in sorted(root.rglob("*.py"))
                for name, call in _launch_calls(path.read_text())]
    assert len(launches) >= 27, len(launches)  # the launchers' count when this test was written
    missing = [(f, name) for f, name, call in launches if "**arch_kwargs(" not in call]
    assert not missing, missing


def test_arch_kwargs_off_cuda_and_under_the_interpreter(fresh_request, monkeypatch):
    monkeypatch.setenv("FP4MOE_ARCH", "sm80")
    assert _runtime.arch_kwargs(torch.device("cpu")) == {}
    assert _runtime.emulated_arch(torch.device("cpu")) is None


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_cross_compilation_ignores_an_override(monkeypatch):
    """The planner proves the target it names whatever the environment says
    (TRITON_OVERRIDE_ARCH, FP4MOE_ARCH): an sm_90 compile of a bf16 tl.dot kernel is a wgmma, not
    sm80's mma.sync, through ``cross_compile`` and from the worker given that environment."""
    from fp4moe.plan.crosscompile import cross_compile
    from fp4moe.plan.space import LinearProblem, get_kernel
    from fp4moe.target import get_arch

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
    message = json.dumps({"index": 0, "request": dataclasses.asdict(request)}) + "\n"  # one request per line
    proc = subprocess.run([sys.executable, "-m", "fp4moe.plan.worker"], input=message, env=env, capture_output=True,
                          text=True, timeout=600)
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["ok"], line["error"]
    assert any(m.startswith("wgmma") for m in line["mma"]), line["mma"]


# ---------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------

_EMULATED_RUN = r"""
import json, sys, torch
import importlib
from fp4moe.ops._runtime import device_arch
from fp4moe.ops.linear import fp4_linear, fp4_linear_reference
from fp4moe.ops.moe import moe_experts, fp4_moe_reference
from fp4moe.ops.routing import route
from fp4moe.models import Routing
from fp4moe.guard import device_name
from fp4moe.quantize import quantize

dev = torch.device("cuda")
torch.manual_seed(0)
out = {"errors": {}}
T, E, k, H, I = 64, 32, 8, 2048, 768
routed = route(torch.randn(T, E, device=dev), Routing("softmax", top_k=k))  # the first kernel
def err(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
for M, N, K in [(1, 6144, 2048), (16, 4096, 6144), (64, 6144, 2048), (300, 2048, 6144)]:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = quantize(torch.randn(N, K, device=dev), "nvfp4")
    out["errors"][f"linear M{M} {N}x{K}"] = err(fp4_linear(x, w), fp4_linear_reference(x, w))
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
w13 = quantize(torch.randn(E, 2 * I, H, device=dev), "nvfp4")
w2 = quantize(torch.randn(E, H, I, device=dev), "nvfp4")
ids, wts = routed.topk_ids, routed.topk_weights
out["errors"]["moe T64"] = err(moe_experts(x, w13, w2, ids, wts), fp4_moe_reference(x, w13, w2, ids, wts))
archs = set()
for name in ("linear", "linear_mma", "moe", "quantize", "dispatch", "routing", "gemm_wgmma", "gemm_ws"):
    for fn in vars(importlib.import_module("fp4moe.kernels." + name)).values():
        for cache in getattr(fn, "device_caches", {}).values():
            archs |= {kernel.metadata.arch for kernel in cache[0].values()}
out["lowered_for"] = sorted(archs)
out["arch"], out["guard_device"] = device_arch(dev).name, device_name(dev)
try:
    fp4_linear(torch.randn(1, 2048, device=dev, dtype=torch.bfloat16),
               quantize(torch.randn(256, 2048, device=dev), "nvfp4"), mode="w4a4")
    out["w4a4"] = "ran"
except ValueError as e:
    out["w4a4"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name,override", [("sm80", None), ("sm89", None), ("sm120", None), (None, "sm80")],
                         ids=["sm80", "sm89", "sm120", "own_with_TRITON_OVERRIDE_ARCH"])
def test_gpu_runs_another_architectures_kernels(name, override):
    """FP4MOE_ARCH=sm80/sm89/sm120 on a newer GPU (the H200 here): every fp4moe kernel the process
    compiled (routing first, then the quantizer, dispatch, linear and MoE GEMMs) was lowered by Triton
    for that architecture; the outputs (decode, split-K, prefill tiles of that architecture's plan;
    an MoE layer) match the reference within the guard's tolerances; the guard keys them apart from
    the GPU's own kernels; W4A4 runs emulated where the named architecture has no FP4 MMA and is
    refused, clearly, where it has FP4 MMA the GPU lacks. On a GPU that cannot run the named
    architecture's code the first kernel launch refuses, naming what is missing. Without FP4MOE_ARCH, a TRITON_OVERRIDE_ARCH
    in the environment does not reach fp4moe's kernels: they are the GPU's own."""
    from fp4moe.guard import TOLERANCES
    from fp4moe.ops._runtime import device_capability_arch

    own = device_capability_arch(torch.device("cuda"))
    refused = name is not None and emulation_gaps(ARCHS[name], own)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH", "FP4MOE_ARCH")}
    if name is not None:
        env["FP4MOE_ARCH"] = name
    if override is not None:
        env["TRITON_OVERRIDE_ARCH"] = override
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _EMULATED_RUN], env=env, capture_output=True, text=True,
                          timeout=900)
    if refused:  # a GPU that cannot run that architecture's code (e.g. sm80 on a 99 KB part) says so
        assert proc.returncode != 0 and f"cannot run {name}'s kernels" in proc.stderr, proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = ARCHS[name] if name is not None else own
    assert out["arch"] == runs.name
    assert out["lowered_for"] == [runs.name], out["lowered_for"]
    if runs == own:
        assert "running" not in out["guard_device"], out["guard_device"]
    else:
        assert out["guard_device"].endswith(f"running {runs.name} kernels"), out["guard_device"]
    for case, e in out["errors"].items():
        assert e < TOLERANCES["fp4_moe" if case.startswith("moe") else "fp4_linear"].max_rel, (case, e)
    if runs.fp4_mma != "none" and own.fp4_mma != runs.fp4_mma:
        assert "plans W4A4 on FP4 MMA" in out["w4a4"], out["w4a4"]
    else:
        assert out["w4a4"] == "ran", out["w4a4"]
