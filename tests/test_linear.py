"""FP4 linear kernels against the torch reference: interpreter on CPU, real sizes on the GPU."""

from dataclasses import dataclass

import pytest
import torch

import fp4moe
from fp4moe import guard
from fp4moe.guard import TOLERANCES
from fp4moe.nn import FP4Linear
from fp4moe.tuning import LinearTuning
from fp4moe.ops.linear import LinearConfig, choose_config, compile_request, fp4_linear, fp4_linear_reference

TOL = TOLERANCES["fp4_linear"]


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    problem = guard.compare(out, ref, TOL)
    assert problem is None, problem


@dataclass(frozen=True)
class Case:
    M: int
    N: int
    K: int
    why: str


CPU_CASES = [
    Case(1, 48, 64, "one token (decode)"),
    Case(3, 64, 96, "odd M; K not a multiple of the 64-wide K tile"),
    Case(17, 40, 160, "M one past a 16-row tile; N not a multiple of the N tile"),
    Case(5, 32, 32, "K equal to one MXFP4 block (two NVFP4 blocks)"),
    Case(3, 32, 16, "K equal to one NVFP4 block"),
    Case(2, 48, 48, "K three NVFP4 blocks, not a multiple of 32 (NVFP4 only)"),
]


def _problem(case: Case, fmt: str, device: str, dtype=torch.bfloat16, zero_block: bool = False):
    g = torch.Generator().manual_seed(case.M * 1000 + case.N + case.K)
    x = torch.randn(case.M, case.K, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(case.N, case.K, generator=g)
    if zero_block:
        w[:, :32] = 0  # zero blocks get scale 1.0 and zero codes
    bias = torch.randn(case.N, generator=g).to(device=device, dtype=dtype)
    return x, fp4moe.quantize(w, fmt).to(device), bias


@pytest.fixture(autouse=True)
def _fresh_guard():
    guard.reset()
    yield
    guard.reset()


# MXFP4 needs K to be a multiple of its 32-element block: those cases are not generated for it
LINEAR_CASES = [(c, fmt, mode) for c in CPU_CASES
                for fmt, mode in (("nvfp4", "w4a16"), ("mxfp4", "w4a16"), ("nvfp4", "w4a4"))
                if fmt != "mxfp4" or c.K % 32 == 0]


@pytest.mark.parametrize("split_k", [1, 3], ids=["whole_k", "split_k3"])
@pytest.mark.parametrize("case,fmt,mode", LINEAR_CASES, ids=lambda v: f"M{v.M}_N{v.N}_K{v.K}" if isinstance(v, Case) else str(v))
def test_linear_matches_reference(case, fmt, mode, split_k, device):
    x, w, bias = _problem(case, fmt, device, zero_block=True)
    # split_k=3 with K/64 = 1..3 steps: splits of unequal length and splits clipped to fewer
    cfg = LinearConfig(block_n=16, block_m=16, block_k=64, num_warps=4, num_stages=2, split_k=split_k)
    out = fp4_linear(x, w, bias, mode=mode, config=cfg)
    assert out.shape == (case.M, case.N) and out.dtype == x.dtype
    assert_close(out, fp4_linear_reference(x, w, bias, mode=mode))


def test_default_config_path_and_leading_dims(device):
    x, w, _ = _problem(Case(6, 32, 64, ""), "nvfp4", device)
    x3 = x.reshape(2, 3, 64)
    out = fp4_linear(x3, w)  # custom op, heuristic configuration, no bias
    assert out.shape == (2, 3, 32)
    assert_close(out.reshape(6, 32), fp4_linear_reference(x, w))


def test_non_contiguous_x_and_fp16(device):
    x, w, bias = _problem(Case(4, 32, 64, ""), "nvfp4", device, dtype=torch.float16)
    xt = x.t().contiguous().t()  # same values, column-major strides
    assert not xt.is_contiguous()
    assert_close(fp4_linear(xt, w, bias), fp4_linear_reference(x, w, bias))


def test_static_input_global_scale(device):
    x, w, _ = _problem(Case(3, 32, 64, ""), "nvfp4", device)
    gs = torch.tensor([0.01], device=device)
    ref = fp4_linear_reference(x, w, mode="w4a4", input_global_scale=gs)
    assert_close(fp4_linear(x, w, mode="w4a4", input_global_scale=gs), ref)
    for cfg in (None, LinearConfig(16, 16, 64, 4, 2)):  # a number works on both entry paths
        assert torch.equal(fp4_linear(x, w, mode="w4a4", input_global_scale=0.01, config=cfg),
                           fp4_linear(x, w, mode="w4a4", input_global_scale=gs, config=cfg))


def test_m_zero_returns_empty(device):
    x, w, bias = _problem(Case(1, 32, 64, ""), "nvfp4", device)
    out = fp4_linear(x[:0], w)
    assert out.shape == (0, 32)
    for mode in ("w4a16", "w4a4"):
        assert fp4_linear(x[:0].reshape(0, 3, 64), w, bias, mode=mode).shape == (0, 3, 32)


def test_k_zero_is_an_empty_sum(device):
    w = fp4moe.quantize(torch.randn(32, 0), "nvfp4").to(device)
    x = torch.randn(2, 3, 0, device=device, dtype=torch.bfloat16)
    bias = torch.randn(32, device=device, dtype=torch.bfloat16)
    assert torch.equal(fp4_linear(x, w), torch.zeros(2, 3, 32, device=device, dtype=torch.bfloat16))
    assert torch.equal(fp4_linear(x, w, bias), bias.expand(2, 3, 32))


def test_non_contiguous_bias(device):
    x, w, bias = _problem(Case(5, 48, 64, ""), "nvfp4", device)
    strided = torch.stack([bias, -bias], dim=1)[:, 0]  # same values, stride 2
    assert not strided.is_contiguous()
    for cfg in (None, LinearConfig(16, 16, 64, 4, 2), LinearConfig(16, 16, 64, 4, 2, split_k=2)):
        assert_close(fp4_linear(x, w, strided, config=cfg), fp4_linear_reference(x, w, bias))


def test_bad_inputs(device):
    x, w, bias = _problem(Case(2, 32, 64, ""), "nvfp4", device)
    with pytest.raises(ValueError, match=r"x: expected last dimension K=64"):
        fp4_linear(x[:, :48], w)
    with pytest.raises(TypeError, match=r"x: expected bfloat16 or float16, got torch.float32"):
        fp4_linear(x.float(), w)
    with pytest.raises(TypeError, match="w: expected an FP4Tensor"):
        fp4_linear(x, torch.zeros(32, 64))
    with pytest.raises(ValueError, match=r"bias: expected shape \(32,\)"):
        fp4_linear(x, w, bias[:8])
    mx = fp4moe.quantize(torch.randn(32, 64), "mxfp4").to(device)
    with pytest.raises(ValueError, match="w4a4' needs NVFP4"):
        fp4_linear(x, mx, mode="w4a4")
    with pytest.raises(ValueError, match="mode: expected"):
        fp4_linear(x, w, mode="w8a8", config=LinearConfig(16, 16, 64, 4, 2))
    with pytest.raises(ValueError, match="LinearConfig.block_n"):
        LinearConfig(24, 16, 64, 4, 2)
    # the default path validates before the custom op rebuilds the weight
    with pytest.raises(ValueError, match=r"w: expected a 2-D weight \[N, K\], got shape \(64,\)"):
        fp4_linear(x, fp4moe.quantize(torch.randn(64)).to(device))
    with pytest.raises(ValueError, match=r"w: expected a 2-D weight"):
        fp4_linear(x, fp4moe.quantize_stacked(torch.randn(2, 32, 64)).to(device))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        fp4_linear([[1.0] * 64], w)
    with pytest.raises(TypeError, match="bias: expected None or a torch.Tensor, got float"):
        fp4_linear(x, w, 1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="input_global_scale: expected a positive finite value"):
            fp4_linear(x, w, mode="w4a4", input_global_scale=bad)
    with pytest.raises(TypeError, match=r"input_global_scale: expected .* one-element floating-point tensor, got \(2,\)"):
        fp4_linear(x, w, mode="w4a4", input_global_scale=torch.ones(2, device=device))
    with pytest.raises(TypeError, match="input_global_scale"):
        fp4_linear(x, w, mode="w4a4", input_global_scale=torch.ones(1, dtype=torch.int32, device=device))


def test_mixed_devices_are_refused(device):
    x, w, bias = _problem(Case(2, 32, 64, ""), "nvfp4", device)
    split = fp4moe.FP4Tensor(w.data, w.scales, w.global_scale.to("meta"), w.shape, w.fmt)
    with pytest.raises(ValueError, match=r"w: its global_scale are on meta, its data on"):
        fp4_linear(x, split, config=LinearConfig(16, 16, 64, 4, 2))
    with pytest.raises(ValueError, match=r"x and w: expected the same device"):
        fp4_linear(x.to("meta"), w, config=LinearConfig(16, 16, 64, 4, 2))
    with pytest.raises(ValueError, match=r"bias: expected device"):
        fp4_linear(x, w, bias.to("meta"), config=LinearConfig(16, 16, 64, 4, 2))
    with pytest.raises(ValueError, match=r"input_global_scale: expected device"):
        fp4_linear(x, w, mode="w4a4", input_global_scale=torch.ones(1, device="meta"),
                   config=LinearConfig(16, 16, 64, 4, 2))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    x, w, _ = _problem(Case(2, 32, 64, ""), "nvfp4", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x: CPU tensors need TRITON_INTERPRET=1"):
        fp4_linear(x, w, config=LinearConfig(16, 16, 64, 4, 2))


def test_guard_catches_a_configuration_that_writes_garbage(device, monkeypatch):
    import fp4moe.ops.linear as lin

    real = lin.launch_linear

    def zeros(x2, xq, w, bias, out, path, config):
        out.zero_()
        return out

    monkeypatch.setattr(lin, "launch_linear", zeros)
    x, w, _ = _problem(Case(2, 32, 64, ""), "nvfp4", device)
    with pytest.raises(guard.GuardError, match=r"fp4_linear\[w4a16,nvfp4,bfloat16\].*all zeros"):
        fp4_linear(x, w, config=LinearConfig(16, 16, 64, 4, 2))
    with pytest.raises(guard.GuardError, match="all zeros"):  # and again: a failed key never falls back silently
        fp4_linear(x, w, config=LinearConfig(16, 16, 64, 4, 2))
    guard.reset()
    monkeypatch.setenv("FP4MOE_GUARD", "warn")
    with pytest.warns(RuntimeWarning, match="Falling back"):
        out = fp4_linear(x, w, config=LinearConfig(16, 16, 64, 4, 2))
    assert_close(out, fp4_linear_reference(x, w))  # the reference answered
    monkeypatch.setattr(lin, "launch_linear", real)


@pytest.mark.parametrize("failure", ["nan", "off_by_10pct"])
def test_guard_catches_nan_and_error_above_tolerance(device, monkeypatch, failure):
    import fp4moe.ops.linear as lin

    real = lin.launch_linear

    def wrong(x2, xq, w, bias, out, path, config):
        real(x2, xq, w, bias, out, path, config)
        if failure == "nan":
            out[0, 0] = float("nan")
        else:
            out.mul_(1.1)
        return out

    monkeypatch.setattr(lin, "launch_linear", wrong)
    x, w, _ = _problem(Case(2, 32, 64, ""), "nvfp4", device)
    why = "NaN/Inf" if failure == "nan" else "error above tolerance"
    with pytest.raises(guard.GuardError, match=rf"fp4_linear\[w4a16,nvfp4,bfloat16\].*{why}"):
        fp4_linear(x, w, config=LinearConfig(16, 16, 64, 4, 2))


def test_heuristic_spreads_decode_over_the_sms():
    for N in (4096, 6144, 12288):
        cfg = choose_config(16, N, 6144, path="w4a16", arch=None, sm_count=132)
        assert -(-N // cfg.block_n) * cfg.split_k >= 1.9 * 132, cfg  # ~2 programs per SM
    big = choose_config(8192, 4096, 6144, path="w4a16", arch=None, sm_count=132)
    assert big.block_n >= 128 and big.block_m >= 128


# ------------------------------------------------------------------------------ cross-compilation


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_cross_compile_every_path():
    """W4A4 uses the block-scaled FP4 MMA on SM120/SM100; every path compiles for SM80/89/90."""
    from fp4moe.target import get_arch
    from fp4moe.plan.crosscompile import cross_compile

    requests, expect = [], []
    for M in (16, 4096):
        for cc, path, mma in [
            (120, "w4a4_native", "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale"),
            (100, "w4a4_native", "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale"),
            (90, "w4a16", "mma"), (90, "w4a4_emulated", "mma"),  # wgmma or mma.sync, by tile size
            (89, "w4a16", "mma.sync.aligned.m16n8k16"), (89, "w4a4_emulated", "mma.sync.aligned.m16n8k16"),
            (80, "w4a16", "mma.sync.aligned.m16n8k16"),
        ]:
            arch = get_arch(cc)
            cfg = choose_config(M, 6144, 2048, path=path, arch=arch, sm_count=132)
            requests.append(compile_request(cfg, path, "nvfp4", cc))
            expect.append((cc, path, mma, arch.smem_per_block_optin, cfg))
    results = cross_compile(requests)
    for (cc, path, mma, limit, cfg), r in zip(expect, results):
        assert r.ok, f"sm{cc} {path} {cfg}: {r.error}"
        assert any(mma in m for m in r.mma), f"sm{cc} {path}: {r.mma}"
        assert r.shared <= limit, f"sm{cc} {path} {cfg}: {r.shared} B > {limit} B"
        assert r.spill_bytes == 0, f"sm{cc} {path} {cfg}: spills {r.spill_bytes} B\n{r.ptxas_log}"


# ------------------------------------------------------------------------------ GPU


GPU_CASES = [Case(M, N, K, "GLM-5 shape") for M in (1, 16, 64, 4096) for N, K in ((4096, 6144), (6144, 2048))]
GPU_CASES += [Case(3, 6144, 12288, "odd M, long K: split K"), Case(300, 4096, 6144, "between decode and prefill")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"M{c.M}_N{c.N}_K{c.K}")
@pytest.mark.parametrize("fmt,mode", [("nvfp4", "w4a16"), ("mxfp4", "w4a16"), ("nvfp4", "w4a4")])
def test_gpu_real_sizes(case, fmt, mode):
    x, w, bias = _problem(case, fmt, "cuda")
    assert_close(fp4_linear(x, w, bias, mode=mode), fp4_linear_reference(x, w, bias, mode=mode))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic_scale", "static_scale"])
def test_gpu_w4a4_on_packed_kernels(M, dtype, static):
    """W4A4 on the kernel the runtime picks for this GPU and M, under the guard's key for it: without
    FP4 MMA (SM80-SM90) the packed W4A16 kernels on x quantized to NVFP4 and dequantized to bf16
    (ops.linear._launch_packed) where ``packed_config`` has one, else the Triton kernel; with FP4 MMA
    the Triton kernel's native path. The reference's numbers for bf16 and fp16 x, with a static or
    a per-call global scale, and replayed in a CUDA graph on new inputs."""
    from fp4moe.ops.linear import device_arch, packed_config, target_path
    from fp4moe.ops.mma_sync import MMAConfig

    arch = device_arch(torch.device("cuda"))
    path = target_path("w4a4", arch)
    cfg = packed_config(path, arch, M, 4096, 6144)
    want = (f"fp4_linear[{path}," if cfg is None else
            "fp4_linear_mma[w4a4," if isinstance(cfg, MMAConfig) else "fp4_linear_wgmma[w4a4,")
    x, w, bias = _problem(Case(M, 4096, 6144, ""), "nvfp4", "cuda", dtype=dtype)
    gs = torch.tensor([0.02], device="cuda") if static else None
    out = fp4_linear(x, w, bias, mode="w4a4", input_global_scale=gs)
    assert out.dtype == dtype
    assert_close(out, fp4_linear_reference(x, w, bias, mode="w4a4", input_global_scale=gs))
    keys = [k.kernel for k in guard._checked]
    assert any(k.startswith(want) for k in keys), (want, keys)
    # captured in a CUDA graph after one eager call: the quantize, dequantize and GEMM chain replays
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp4_linear(x, w, bias, mode="w4a4", input_global_scale=gs)
    x.mul_(-0.5)
    graph.replay()
    assert_close(y, fp4_linear_reference(x, w, bias, mode="w4a4", input_global_scale=gs))


def test_weight_dequantize_is_the_activation_dequantize(device):
    """``dequantize_weight`` (one pass over the flat codes, two values per 32-bit word) gives
    ``dequantize_activations``' exact values bit for bit, contiguous or not (a column slice takes the
    general kernel); the weight's global scale is left out."""
    from fp4moe.ops.quantize import dequantize_activations, dequantize_weight
    from fp4moe.quantize import FP4Tensor

    torch.manual_seed(3)
    ones = torch.ones(1, device=device)
    for N, K in ((1, 16), (5, 336), (64, 2048 + 16)):
        w = fp4moe.quantize(torch.randn(N, K) * 4.0, "nvfp4").to(device)
        want = dequantize_activations(FP4Tensor(w.data, w.scales, ones, w.shape, w.fmt))[0]
        assert torch.equal(dequantize_weight(w).view(torch.int16), want.view(torch.int16))
    cut = FP4Tensor(w.data[:, :64], w.scales[:, :8], w.global_scale, torch.Size((N, 128)), w.fmt)
    assert not cut.data.is_contiguous()
    want = dequantize_weight(w)[:, :128]  # the flat kernel's values on the whole weight
    assert torch.equal(dequantize_weight(cut).view(torch.int16), want.view(torch.int16))


def test_dequant_matmul_path(device):
    """Large-batch W4A16 on SM90 (``dequant_matmul_applies``): the rule, and the computation (the
    exact bf16 weight, torch's matmul with the global scale as alpha, bias) against the reference."""
    from fp4moe.target import get_arch
    from fp4moe.ops import linear as L

    sm90 = get_arch("sm90")
    assert L.dequant_matmul_applies("w4a16", sm90, LinearTuning().dequant_matmul_min_m, 12288, 6144, "nvfp4")
    assert not L.dequant_matmul_applies("w4a16", sm90, LinearTuning().dequant_matmul_min_m - 1, 12288, 6144, "nvfp4")
    assert not L.dequant_matmul_applies("w4a16", sm90, 16384, 12288, 6144, "mxfp4")
    assert not L.dequant_matmul_applies("w4a4_emulated", sm90, 16384, 12288, 6144, "nvfp4")
    assert not L.dequant_matmul_applies("w4a16", get_arch("sm120"), 16384, 12288, 6144, "nvfp4")
    assert not L.dequant_matmul_applies("w4a16", get_arch("sm80"), 16384, 12288, 6144, "nvfp4")
    too_big = LinearTuning().dequant_matmul_max_bytes // 2 // 4096 + 16
    assert not L.dequant_matmul_applies("w4a16", sm90, 16384, too_big, 4096, "nvfp4")
    torch.manual_seed(5)
    x = torch.randn(37, 336, device=device).to(torch.bfloat16)
    w = fp4moe.quantize(torch.randn(80, 336) * 3.0, "nvfp4").to(device)
    for bias in (None, torch.randn(80, device=device).to(torch.bfloat16)):
        out = torch.full((37, 80), float("nan"), device=device, dtype=torch.bfloat16)
        L._dequant_matmul(x, w, float(w.global_scale.reshape(())), bias, out)
        assert_close(out, fp4_linear_reference(x, w, bias))


def test_weight_global_host_follows_in_place_writes():
    """The global scale as a host float is read once per weight and again after it is written in
    place (``load_state_dict``) or replaced."""
    from fp4moe.ops.linear import weight_global_host
    from fp4moe.quantize import FP4Tensor

    w = fp4moe.quantize(torch.randn(16, 64), "nvfp4")
    g0 = float(w.global_scale.reshape(()))
    assert weight_global_host(w) == g0
    w.global_scale.mul_(2.0)
    assert weight_global_host(w) == 2.0 * g0
    w2 = FP4Tensor(w.data, w.scales, torch.tensor([0.5]), w.shape, w.fmt)
    assert weight_global_host(w2) == 0.5
    # a NaN block scale written in place is found at the next read, as pack_mma finds it (w read
    # again first: the write, not a change of global, must be what makes the cache miss)
    assert weight_global_host(w) == 2.0 * g0
    w.scales.view(torch.uint8)[3, 1] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        weight_global_host(w)
    # ... and in new scales beside the same codes and global (a fresh tensor counts no writes)
    bad = w.scales.clone()
    w.scales.view(torch.uint8)[3, 1] = 0x00
    assert weight_global_host(w) == 2.0 * g0
    with pytest.raises(ValueError, match="NaN"):
        weight_global_host(FP4Tensor(w.data, bad, w.global_scale, w.shape, w.fmt))
    # MXFP4's E8M0 scales have no NaN check here: 0x7F is 1.0
    wm = fp4moe.quantize(torch.randn(16, 64), "mxfp4")
    wm.scales.view(torch.uint8).fill_(0x7F)
    assert weight_global_host(wm) == 1.0


@pytest.mark.gpu
def test_gpu_large_batch_takes_dequant_matmul():
    """On SM90, ``fp4_linear`` at ``LinearTuning.dequant_matmul_min_m`` rows and more runs the weight
    dequantized to bf16 and torch's matmul (under its own guard key): the reference's numbers, bitwise repeatable,
    replayed in a CUDA graph on new inputs, and under ``torch.compile``; below, the wgmma kernel."""
    from fp4moe.ops import linear as L

    if L.device_arch(torch.device("cuda")).bf16_mma != "wgmma":
        pytest.skip("the path is taken on SM90 only")
    x, w, bias = _problem(Case(LinearTuning().dequant_matmul_min_m, 2048, 1024, ""), "nvfp4", "cuda")
    guard.reset()
    out = fp4_linear(x, w, bias)
    assert_close(out, fp4_linear_reference(x, w, bias))
    assert any(k.kernel.startswith("fp4_linear_dequant_matmul[") for k in guard._checked)
    assert torch.equal(fp4_linear(x, w, bias), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp4_linear(x, w, bias)
    x.mul_(-0.5)
    graph.replay()
    assert_close(y, fp4_linear_reference(x, w, bias))
    compiled = torch.compile(lambda a: fp4_linear(a, w, bias), fullgraph=True)
    assert_close(compiled(x), fp4_linear_reference(x, w, bias))
    guard.reset()
    fp4_linear(x[: LinearTuning().dequant_matmul_min_m - 1], w, bias)
    assert not any(k.kernel.startswith("fp4_linear_dequant_matmul[") for k in guard._checked)
    # an fp32 bias (which addmm would refuse with bf16 x) keeps the wgmma kernel
    guard.reset()
    assert_close(fp4_linear(x, w, bias.float()), fp4_linear_reference(x, w, bias.float()))
    assert not any(k.kernel.startswith("fp4_linear_dequant_matmul[") for k in guard._checked)


@pytest.mark.gpu
def test_gpu_torch_compile_and_cuda_graph():
    from fp4moe.nn import FP4Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(2048, 512, bias=True).cuda().bfloat16()
    layer = FP4Linear.from_linear(lin, "nvfp4")
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    ref = fp4_linear_reference(x, layer.weight_fp4, layer.bias)
    eager = layer(x)
    assert_close(eager, ref)
    compiled = torch.compile(layer, fullgraph=True)
    assert_close(compiled(x), ref)
    static_x = x.clone()
    layer(static_x)  # warm-up (and guard) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(x * 2)
    graph.replay()
    assert_close(static_y, fp4_linear_reference(x * 2, layer.weight_fp4, layer.bias))


def test_fp4linear_survives_dtype_conversion(device):
    layer = FP4Linear.from_linear(torch.nn.Linear(64, 32).to(device), "nvfp4")
    before = layer.weight_fp4
    layer = layer.to(torch.float16)  # the FP4 buffers keep their dtypes; only the bias follows
    after = layer.weight_fp4
    assert after.scales.dtype == torch.float8_e4m3fn and after.global_scale.dtype == torch.float32
    assert torch.equal(after.global_scale, before.global_scale)
    assert layer.bias.dtype == torch.float16
    x = torch.randn(3, 64, device=device, dtype=torch.float16)
    assert_close(layer(x), fp4_linear_reference(x, after, layer.bias))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4linear_from_linear_without_bias_and_from_float64(device, fmt):
    lin = torch.nn.Linear(64, 32, bias=False, dtype=torch.float64).to(device)
    layer = FP4Linear.from_linear(lin, fmt)
    assert layer.bias is None and layer.fmt.name == fmt
    assert torch.equal(layer.weight_fp4.data, fp4moe.quantize(lin.weight.detach().float(), fmt).data)
    x = torch.randn(3, 64, device=device, dtype=torch.bfloat16)
    assert_close(layer(x), fp4_linear_reference(x, layer.weight_fp4))


def test_fp4linear_bad_construction():
    with pytest.raises(ValueError, match="linear: in_features must be a multiple of the nvfp4 block size 16, got 40"):
        FP4Linear.from_linear(torch.nn.Linear(40, 32), "nvfp4")
    with pytest.raises(ValueError, match="linear: in_features must be a multiple of the mxfp4 block size 32, got 48"):
        FP4Linear.from_linear(torch.nn.Linear(48, 32), "mxfp4")
    w = fp4moe.quantize(torch.randn(32, 64))
    layer = FP4Linear.from_fp4(w, mode="w4a4", input_scale=0.01)  # a number, as checkpoints' configs give it
    assert layer.input_scale.dtype == torch.float32 and layer.input_scale.shape == (1,)
    assert float(layer.input_scale) == pytest.approx(0.01)
    for bad in (0, -0.5, float("inf")):
        with pytest.raises(ValueError, match="input_scale: expected a positive finite value"):
            FP4Linear.from_fp4(w, mode="w4a4", input_scale=bad)
    with pytest.raises(TypeError, match=r"input_scale: expected None, a number or a one-element"):
        FP4Linear.from_fp4(w, mode="w4a4", input_scale=torch.ones(2))


def test_per_row_global_is_refused_by_linear(device):
    w = fp4moe.quantize(torch.randn(32, 64)).to(device)
    per_row = fp4moe.FP4Tensor(w.data, w.scales, w.global_scale.reshape(1).expand(32).contiguous(), w.shape, "nvfp4")
    with pytest.raises(ValueError, match="one global scale per weight"):
        fp4_linear(torch.randn(2, 64, device=device, dtype=torch.bfloat16), per_row)
