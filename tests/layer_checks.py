"""Checks shared by the kernel tests (test_mma_layout.py, test_gemm_wgmma.py,
test_quantize_kernel.py): cross-compilation snippets run outside the interpreter, a packed linear
launcher against the reference, MoE layer variants, the MoE layer against its reference on a given
kernel, and FP4Linear routing plus CUDA-graph capture on a given kernel."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fp4moe.formats import MXFP4, NVFP4

FMTS = [NVFP4, MXFP4]


def run_compile_snippet(code: str, cases, timeout: float = 600):
    """Run ``code`` (a Python script that compiles kernels for GPU targets and prints one JSON line
    last) with ``json.dumps(cases)`` as its argument, in a subprocess without TRITON_INTERPRET
    (under the interpreter @triton.jit objects cannot be compiled) and with this tree's src first
    on the path; returns that line parsed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def packed_linear_case(fmt, M, N, K):
    """(x [M, K] bf16, the weight [N, K] in ``fmt``, its MMA-order pack, a bf16 bias, the reference
    output in fp32) on the GPU, from seed 0."""
    from fp4moe.ops.linear import fp4_linear_reference
    from fp4moe.ops.mma_pack import pack_mma
    from fp4moe.quantize import quantize

    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = quantize(torch.randn(N, K, device="cuda"), fmt)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    return x, w, pack_mma(w), bias, fp4_linear_reference(x, w, bias).float()


def check_packed_linear(launch, configs, fmt, M, N, K):
    """``launch(x, packed, bias, y, cfg)`` (a packed-layout linear launcher) writes every element of
    y, finite and within 1e-2 of the reference, and a second launch the same bits (for a PDL
    configuration the second is the one that requests weights before waiting), for each of
    ``configs``."""
    x, _, p, bias, ref = packed_linear_case(fmt, M, N, K)
    for cfg in configs:
        y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch(x, p, bias, y, cfg)
        err = (y.float() - ref).abs().max() / ref.abs().max()
        assert torch.isfinite(y).all() and err < 1e-2, (cfg, err)
        y2 = torch.full_like(y, float("nan"))
        launch(x, p, bias, y2, cfg)
        assert torch.equal(y, y2), cfg


def moe_variants(*cases):
    """pytest params (fmt, activation, interleaved, per_row, bias) of ``cases`` x both formats,
    without MXFP4 + per-row globals (MXFP4 has no global scales)."""
    return [pytest.param(fmt, *case, id=f"{fmt}-{'-'.join(map(str, case))}") for fmt in FMTS for case in cases
            if not (fmt is MXFP4 and case[2])]


def check_moe_layer(kernel: str, fmt, activation, interleaved, per_row, bias, T, E, k, H, I, *, device="cuda"):
    """fp4_moe_experts on ``kernel`` (the guard saw it) matches the reference within 2e-2, skips
    dropped slots, and is bitwise deterministic."""
    from fp4moe import guard
    from fp4moe.ops.moe import fp4_moe_experts, fp4_moe_reference, random_moe_problem

    p = random_moe_problem(T, E, k, H, I, fmt.name, device=device, seed=T, per_row=per_row, bias=bias,
                           dropped=(0, k - 1))
    kw = dict(activation=activation, interleaved=interleaved, w13_bias=p.w13_bias, w2_bias=p.w2_bias)
    y = fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, **kw)
    assert any(key.kernel.startswith(kernel) for key in guard._checked)
    ref = fp4_moe_reference(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, **kw).float()
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, err
    assert torch.equal(fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, **kw), y)


def check_fp4linear_graph(kernel: str, x_shape: tuple[int, ...]):
    """FP4Linear(2048 -> 1024, bias) in bf16 on the GPU runs ``kernel`` for x of ``x_shape`` (the
    guard saw it), matches the reference within 1e-2, and replays identically in a CUDA graph."""
    from fp4moe import guard
    from fp4moe.nn import FP4Linear
    from fp4moe.ops.linear import fp4_linear_reference

    torch.manual_seed(0)
    m = FP4Linear.from_linear(torch.nn.Linear(2048, 1024, bias=True), "nvfp4").cuda()
    assert getattr(m.weight, "_fp4moe_mma", None) is not None  # packed when moved to the GPU
    m = m.to(torch.bfloat16)
    x = torch.randn(*x_shape, device="cuda", dtype=torch.bfloat16)
    ref = fp4_linear_reference(x, m.weight_fp4, m.bias).float()
    y = m(x)
    assert any(k.kernel.startswith(kernel) for k in guard._checked)
    assert ((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2
    g = torch.cuda.CUDAGraph()
    static = x.clone()
    with torch.cuda.graph(g):
        out = m(static)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
