"""The NVFP4 activation quantization kernel (fp4moe.ops.quantize) against the torch reference.

Everything is bit-exact: packed codes, E4M3 scale bits (compared as uint8) and the global
scale. Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), on the same
algorithm the GPU runs (the interpreter emulates the fused multiply-adds exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from fp4moe import FP4Tensor, quantize
from fp4moe.formats import e2m1_encode, nvfp4_block_scales
from fp4moe.tuning import current_tuning, tuning
from fp4moe.kernels.quantize import nvfp4_quantize_kernel
from fp4moe.kernels.quantize_arith import (div_by_reciprocal, div_by_reciprocal_pair, e2m1_magnitudes, e4m3_round,
                                           reciprocal_pair, reciprocal_rn)
from fp4moe.ops.quantize import (
    _EMULATE_FMA,
    QuantizeConfig,
    dequantize_activations,
    fake_quantize_activations,
    quantize_activations,
    quantize_activations_reference,
)
from layer_checks import run_compile_snippet

INF = torch.tensor(math.inf)
ZERO = torch.tensor(0.0)


def assert_same(got: FP4Tensor, want: FP4Tensor) -> None:
    """Bit-exact equality of two FP4Tensors (scales compared as their uint8 bits)."""
    assert got.shape == want.shape and got.fmt == want.fmt
    assert got.data.dtype == torch.uint8 and got.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(got.scales.cpu().view(torch.uint8), want.scales.cpu().view(torch.uint8)), "block scales differ"
    assert torch.equal(got.data.cpu(), want.data.cpu()), (
        f"codes differ in {(got.data.cpu() != want.data.cpu()).sum().item()} bytes")
    assert got.global_scale.shape == () and got.global_scale.dtype == torch.float32
    assert torch.equal(got.global_scale.cpu().view(torch.int32), want.global_scale.cpu().view(torch.int32))


def check(x: torch.Tensor, global_scale=None, **kwargs) -> FP4Tensor:
    got = quantize_activations(x, global_scale, **kwargs)
    assert_same(got, quantize_activations_reference(x, global_scale))
    return got


# ----------------------------------------------------------------------------------------------
# Inputs


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def normal(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, generator=g)


def heavy_tailed(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Student-t-like: most blocks small, a few outliers 1e4 times larger (activation outliers)."""
    return torch.randn(m, k, generator=g) / torch.rand(m, k, generator=g).clamp_min(1e-4) ** 1.5


def zero_rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=g)
    x[::2] = 0.0
    return x


def zero_block(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """One all-zero block (scale 1.0) and one of negative zeros in otherwise non-zero rows."""
    x = torch.randn(m, k, generator=g)
    x[:, 16:32] = 0.0
    x[:, :16] = -0.0
    return x


def tiny_blocks(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Blocks 1e-6..1e-3 of the tensor's max: scales clamped to 2**-9 or E4M3 subnormal."""
    x = torch.randn(m, k, generator=g)
    x[:, 16:] *= torch.logspace(-6, -3, k - 16)
    return x


def wide_range(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Block magnitudes from 1e-30 to 1e30 (every scale path, with a given global scale)."""
    return torch.randn(m, k, generator=g) * torch.logspace(-30, 30, k // 16).repeat_interleave(16)


def ties(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Every E2M1 tie and grid value exactly: blocks of amax 6 * 2**j (scale 2**j with g = 1)."""
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, 6.0])
    block = torch.cat([torch.tensor([6.0]), t])
    sign = torch.randint(0, 2, (m, k // 16, 16), generator=g) * 2.0 - 1.0
    scale = torch.exp2(torch.randint(-8, 9, (m, k // 16, 1), generator=g).float())
    return (block * sign * scale).reshape(m, k)


def near_boundaries(m: int, k: int, g: torch.Generator, global_scale: float = 1.0) -> torch.Tensor:
    """Elements within 2 ulps of t * d for every E2M1 threshold t, for arbitrary (non power of two) d."""
    anchor = torch.exp2(torch.empty(m, k // 16).uniform_(-20, 20, generator=g))
    gs = torch.tensor(global_scale, dtype=torch.float32)
    d = nvfp4_block_scales(anchor, gs).float() * gs
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = t[torch.randint(0, 7, (m, k // 16, 15), generator=g)] * d[..., None]
    for _ in range(2):
        step = torch.randint(-1, 2, x.shape, generator=g)
        x = torch.where(step > 0, torch.nextafter(x, INF), torch.where(step < 0, torch.nextafter(x, ZERO), x))
    x = torch.cat([anchor[..., None], x], -1)
    return (x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)).reshape(m, k)


@dataclass(frozen=True)
class Case:
    name: str
    make: object  # (m, k, generator) -> fp32 tensor
    m: int = 17
    k: int = 272
    dtype: torch.dtype = torch.bfloat16
    global_scale: object = None  # None (dynamic), a float, or "tensor" (a 0-d tensor of 1.0)


CASES = [
    Case("normal", normal),
    Case("normal-fp16", normal, dtype=torch.float16),
    Case("normal-fp32", normal, dtype=torch.float32),
    Case("normal-given-float", normal, global_scale=0.0037),
    Case("normal-given-tensor", normal, global_scale="tensor"),
    Case("heavy-tailed", heavy_tailed, dtype=torch.float32),
    Case("heavy-tailed-bf16", heavy_tailed),
    Case("zero-rows", zero_rows),
    Case("zero-block-in-row", zero_block, dtype=torch.float32),
    Case("tiny-blocks", tiny_blocks, dtype=torch.float32),
    Case("tiny-blocks-given", tiny_blocks, global_scale=0.01),
    # a small given global scale saturates block scales at 448 (elements then clip to +-6)
    Case("saturated-scales", normal, global_scale=1e-5),
    Case("ties", ties, m=8, k=64, dtype=torch.float32, global_scale=1.0),
    Case("ties-bf16", ties, m=8, k=64, global_scale=1.0),
    Case("near-boundaries", near_boundaries, m=32, k=256, dtype=torch.float32, global_scale=1.0),
    # bf16/fp16 take the short division (kernels.quantize_arith.div_by_reciprocal); rounded to 16 bits
    # these land on the thresholds themselves (ties), test_short_dividends_near_thresholds near them
    Case("ties-on-thresholds-bf16", near_boundaries, m=32, k=256, global_scale=1.0),
    Case("ties-on-thresholds-fp16", lambda m, k, g: near_boundaries(m, k, g) * 2.0 ** -8, m=32, k=256,
         dtype=torch.float16, global_scale=1.0),  # (scaled into fp16's range)
    # programs that need the per-element clamp (saturated or subnormal-scale blocks) next to ones that do not
    Case("mixed-saturation", lambda m, k, g: normal(m, k, g) * torch.logspace(-6, 4, m)[:, None], m=17, k=272,
         global_scale=1e-3),
    Case("mixed-saturation-fp16", lambda m, k, g: normal(m, k, g) * torch.logspace(-5, 3, m)[:, None], m=17,
         k=272, dtype=torch.float16, global_scale=1e-3),
    # global scales outside [2**-91, 2**100] take the kernel's per-element division path
    Case("wide-range-huge-g", wide_range, m=4, k=1024, dtype=torch.float32, global_scale=1e36),
    Case("wide-range-tiny-g", wide_range, m=4, k=1024, dtype=torch.float32, global_scale=1e-36),
    Case("wide-range-dynamic", wide_range, m=4, k=1024, dtype=torch.float32),
    Case("huge-g-bf16", normal, m=4, k=1024, global_scale=1e35),  # bf16 words, division path
    # amax near fp32's max: the dynamic g (about 1.1e35) is above 2**100 -> division path
    Case("huge-dynamic", lambda m, k, g: (torch.rand(m, k, generator=g) * 2 - 1) * 3e38, m=2, k=64,
         dtype=torch.float32),
    Case("all-zero", lambda m, k, g: torch.zeros(m, k), m=3, k=48),  # dynamic scale -> 1.0
]


def _global_scale(spec, device):
    return torch.tensor(1.0, device=device) if spec == "tensor" else spec


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy x / d -> inf, as in torch
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_reference(case: Case, device):
    x = case.make(case.m, case.k, _gen(len(case.name))).to(case.dtype).to(device)
    check(x, _global_scale(case.global_scale, device))


@pytest.mark.slow  # many interpreter runs; the default run keeps the single-scale boundary cases
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_dividends_near_thresholds(dtype, device):
    """bf16/fp16 elements whose quotient x / d lies within a few fp32 ulps of an E2M1 threshold
    without equalling it: a global scale g = RN(a / (t s)) nudged by -2..2 ulps for a value a of the
    dtype, a threshold t and an E4M3 scale s; every block's anchor (its maximum) makes its scale
    s * 2**e, and its elements are +-a * 2**e, so x / d = a / RN(s g) in every block."""
    g = _gen(14 if dtype == torch.bfloat16 else 15)
    thresholds = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    near = total = 0
    for i in range(8):
        t = thresholds[i % 7]
        a = float(torch.empty(()).uniform_(0.5, 4.0, generator=g).to(dtype))
        s = float(torch.empty(()).uniform_(0.5, 4.0, generator=g).to(torch.float8_e4m3fn))
        gs = torch.tensor(a / (t * s), dtype=torch.float32)
        for step in (-2, -1, 0, 1, 2):
            gk = gs.clone()
            for _ in range(abs(step)):
                gk = torch.nextafter(gk, INF if step > 0 else ZERO)
            exps = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
            anchor = (6 * s * float(gk)) * torch.exp2(exps)  # block maxima: raw = anchor / (6 g) = s 2**e
            elems = a * torch.exp2(exps)[:, None] * (torch.randint(0, 2, (5, 15), generator=g) * 2 - 1)
            x = torch.cat([anchor[:, None], elems], 1).reshape(1, 80).to(dtype)
            got = check(x.to(device), float(gk))
            d = got.scales.cpu().float()[0, :, None] * gk  # fp32 products, as the kernel's d
            q = x.float().abs()[0].reshape(5, 16)[:, 1:] / d
            total += q.numel()
            near += int(((q - t).abs() <= 4 * torch.finfo(torch.float32).eps * t).logical_and(q != t).sum())
    assert near >= total // 2, (near, total)  # the construction really sits next to the thresholds


# M = 0 (empty batch), 1 (decode), 3, 17 (not a multiple of any tile); K = 16 (one block),
# 48 (3 blocks, not a power of two), 64, 272 (17 blocks: a partly masked second tile column)
@pytest.mark.parametrize("M", [0, 1, 3, 17])
@pytest.mark.parametrize("K", [16, 48, 64, 272])
def test_shapes(M, K, device):
    x = torch.randn(M, K, generator=_gen(M * 1000 + K)).to(torch.bfloat16).to(device)
    got = check(x)
    assert got.data.shape == (M, K // 2) and got.scales.shape == (M, K // 16)


@pytest.mark.slow  # many interpreter runs; the default run keeps the single-scale boundary cases
@pytest.mark.parametrize("global_scale", [None, 0.02, "tensor"])
def test_near_boundaries_many_scales(global_scale, device):
    """Elements at and around every rounding boundary, for block scales d of every kind."""
    g = _gen(7)
    gs = 1.0 if global_scale in (None, "tensor") else global_scale
    x = near_boundaries(64, 512, g, gs).to(device)
    check(x, _global_scale(global_scale, device))


def test_non_contiguous_inputs(device):
    base = torch.randn(272, 17, generator=_gen(1)).to(device)
    check(base.t())  # [17, 272] with unit row stride: copied
    wide = torch.randn(9, 400, generator=_gen(2)).to(torch.bfloat16).to(device)
    check(wide[:, 32:304])  # row stride 400, contiguous rows: no copy
    check(wide[:, 3:99])  # rows start 6 bytes past 16-byte alignment: copied (bf16 is read as int32 pairs)
    cube = torch.randn(64, 3, 5, generator=_gen(3)).to(device)
    got = check(cube.permute(1, 2, 0), 0.01)  # [3, 5, 64]: N-D, reshaped back
    assert got.shape == (3, 5, 64) and got.data.shape == (3, 5, 32) and got.scales.shape == (3, 5, 4)


def test_one_dimensional_and_empty(device):
    check(torch.randn(48, generator=_gen(4)).to(device))
    got = check(torch.zeros(0, 7, 32, device=device), 0.5)
    assert got.data.shape == (0, 7, 16) and float(got.global_scale) == 0.5


def test_config_pins_give_the_same_bits(device):
    x = torch.randn(5, 96, generator=_gen(5)).to(torch.bfloat16).to(device)
    want = quantize_activations_reference(x)
    for cfg in (QuantizeConfig(1, 32, 1), QuantizeConfig(4, 64, 2), QuantizeConfig(64, 128, 4)):
        assert_same(quantize_activations(x, config=cfg), want)


def test_heuristic():
    big = QuantizeConfig.from_heuristic(16384, 6144)
    assert big == QuantizeConfig(block_m=1, block_k=1024, num_warps=1, maxnreg=64)
    assert QuantizeConfig.from_heuristic(64, 512) == QuantizeConfig(block_m=2, block_k=512, num_warps=1, maxnreg=64)
    assert QuantizeConfig.from_heuristic(64, 2880) == QuantizeConfig(block_m=1, block_k=1024, num_warps=1, maxnreg=64)
    assert QuantizeConfig.from_heuristic(64, 7168).block_k == 1024
    assert QuantizeConfig.from_heuristic(64, 1536).block_k == 512  # 3 x 512 exactly
    assert QuantizeConfig.from_heuristic(64, 2560).block_k == 512
    assert QuantizeConfig.from_heuristic(1, 16) == QuantizeConfig(block_m=1, block_k=32, num_warps=1, maxnreg=64)
    assert QuantizeConfig.from_heuristic(64, 48) == QuantizeConfig(block_m=16, block_k=64, num_warps=1, maxnreg=64)
    assert QuantizeConfig.from_heuristic(3, 48).block_k == 64
    assert QuantizeConfig.from_heuristic(64, 6144, torch.float32).maxnreg is None  # would spill
    assert QuantizeConfig.from_heuristic(64, 6144, torch.float16).maxnreg is None
    for M, K in ((1, 16), (5, 96), (64, 48), (7, 6144), (16384, 6144)):
        cfg = QuantizeConfig.from_heuristic(M, K)
        assert cfg.block_m * cfg.block_k <= 1024 and cfg.num_warps == 1  # 32 elements per thread at most
    with pytest.raises(AttributeError):
        big.block_m = 2  # frozen
    with pytest.raises(ValueError, match="maxnreg"):
        QuantizeConfig(1, 32, 1, maxnreg=8)


def test_dynamic_global_scale_is_a_correctly_rounded_division(device):
    """amax / 2688 rounds correctly in the kernel and in the reference on every device (torch on
    CUDA would multiply by the reciprocal of a Python-number divisor: 3.3 is a value where the two
    differ, so the reference divides by a tensor)."""
    from fp4moe.quantize import nvfp4_global_scale

    x = torch.rand(4, 64, generator=_gen(11)).to(device)
    x[2, 7] = -3.3  # amax where division and multiplication by the reciprocal differ
    amax = torch.tensor(3.3)
    exact = torch.tensor(3.3, dtype=torch.float64).float().double() / 2688.0  # fp64 quotient of the fp32 amax
    assert amax * (torch.tensor(1.0) / torch.tensor(2688.0)) != exact.float()
    data = torch.empty(4, 8, dtype=torch.int32, device=device)
    scales = torch.empty(4, 4, dtype=torch.uint8, device=device)
    gs = torch.empty((), device=device)
    nvfp4_quantize_kernel[(1, 1)](x, data, scales, amax.to(device), gs, 4, 64, 64, 1, BLOCK_M=4, BLOCK_K=64,
                                  DYNAMIC=True, SM86=False, EMULATE_FMA=_EMULATE_FMA, BLOCK_P=1)
    assert gs.cpu().item() == exact.float().item()
    assert nvfp4_global_scale(amax.to(device)).cpu().item() == exact.float().item()


@pytest.mark.parametrize("path", ["partials", "atomic"])
@pytest.mark.parametrize("M,K", [(1, 64), (3, 2048), (40, 1040), (300, 64)])
@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_dynamic_scale_from_partials_or_one_atomic_word(path, M, K, device):
    """The dynamic scale's absmax pass leaves one maximum per program for the quantize kernels to
    reduce (up to ``QuantizeTuning.max_absmax_partials`` programs: no zero fill) or folds them into one zeroed
    word with atomics; both give the reference's global scale and codes, in the quantizer and in
    the one-kernel quantize-to-bf16, for grids of 1 to 8 programs (300 x 64: 3 row groups)."""
    import fp4moe.ops.quantize as opsq

    with tuning(quantize=dict(max_absmax_partials=0) if path == "atomic" else {}):
        cfg = QuantizeConfig.from_heuristic(M, K)
        most = current_tuning().quantize.max_absmax_partials
        assert (opsq._absmax_programs(M, K, cfg) <= most) == (path == "partials")
        x = normal(M, K, _gen(M + K)) * 5
        x[-1, -1] = -40.0  # the maximum in the last program
        check(x.to(device))
    x_hat, g = fake_quantize_activations(x.to(device))
    want, want_g = dequantize_activations(quantize_activations_reference(x.to(device)))
    assert torch.equal(x_hat.view(torch.int16), want.view(torch.int16)) and torch.equal(g, want_g)


# ----------------------------------------------------------------------------------------------
# The jit helpers, element by element


@triton.jit
def _e4m3_round_kernel(v_ptr, value_ptr, bits_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    value, bits = e4m3_round(tl.load(v_ptr + offs, mask=mask, other=1.0))
    tl.store(value_ptr + offs, value, mask=mask)
    tl.store(bits_ptr + offs, bits, mask=mask)


def _around(points: torch.Tensor) -> torch.Tensor:
    """The points and their fp32 neighbours."""
    return torch.cat([points, torch.nextafter(points, INF), torch.nextafter(points, ZERO)])


def test_e4m3_round_matches_torch(device):
    """All positive E4M3 values, all midpoints between them (ties), +-1 ulp, and 2**18 random values."""
    grid = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    special = torch.tensor([2.0**-9 * 1.5, 2.0**-9 * 0.75, 2.0**-6, 448.0])
    v = torch.cat([_around(torch.cat([grid, (grid[:-1] + grid[1:]) / 2, special])),
                   torch.exp2(torch.empty(1 << 18).uniform_(-9, math.log2(448), generator=_gen(6)))])
    v = v.clamp(2.0**-9, 448.0)  # the kernel's domain
    value, bits = torch.empty_like(v), torch.empty(v.shape, dtype=torch.int32)
    v, value, bits = v.to(device), value.to(device), bits.to(device)
    _e4m3_round_kernel[(triton.cdiv(v.numel(), 4096),)](v, value, bits, v.numel(), BLOCK=4096)
    want = v.cpu().to(torch.float8_e4m3fn)
    assert torch.equal(bits.cpu(), want.view(torch.uint8).to(torch.int32))
    assert torch.equal(value.cpu(), want.float())


@triton.jit
def _e2m1_kernel(q_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(out_ptr + offs, e2m1_magnitudes(tl.load(q_ptr + offs, mask=mask, other=0.0)), mask=mask)


def test_e2m1_magnitudes_match_reference(device):
    """Every E2M1 value and tie +-1 ulp, tiny and saturating magnitudes, random values in [0, 7)."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.9])
    q = torch.cat([_around(points), torch.tensor([0.0, 1e-45, 1e-30]),
                   torch.rand(1 << 16, generator=_gen(8)) * 6.99]).clamp(min=0.0)
    out = torch.empty(q.shape, dtype=torch.int32, device=device)
    _e2m1_kernel[(triton.cdiv(q.numel(), 4096),)](q.to(device), out, q.numel(), BLOCK=4096)
    assert torch.equal(out.cpu() - 0x4B000000, e2m1_encode(q).to(torch.int32))  # codes are biased


@triton.jit
def _div_kernel(a_ptr, d_ptr, out_ptr, N, BLOCK: tl.constexpr, SHORT: tl.constexpr, EMULATE_FMA: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(a_ptr + offs, mask=mask, other=1.0)
    d = tl.load(d_ptr + offs, mask=mask, other=1.0)
    if SHORT:
        q = div_by_reciprocal(a, d, reciprocal_rn(d, EMULATE_FMA), EMULATE_FMA)
    else:
        y, y_lo = reciprocal_pair(d, EMULATE_FMA)
        q = div_by_reciprocal_pair(a, d, y, y_lo, EMULATE_FMA)
    tl.store(out_ptr + offs, q, mask=mask)


@pytest.mark.parametrize("dividend", ["fp32", "bf16", "fp16"])
def test_divisions_are_correctly_rounded(dividend, device):
    """Quotients 0..7 for divisors whose significands crowd 1 and 2 (where q = RN(a / d) is hardest),
    across the kernel's divisor range (2**-100 .. 2**109): any fp32 dividend through the reciprocal
    pair, bf16/fp16 significands through the short division (a sample: tools/sweep/sweep_quantize.py
    checks every significand pair on the GPU)."""
    g = _gen(9)
    n = 1 << 18
    sig = torch.cat([1 + torch.rand(n // 2, generator=g) ** 8, 2 - torch.rand(n // 2, generator=g) ** 8])
    d = torch.ldexp(sig, torch.randint(-100, 108, (n,), generator=g)).float()
    if dividend == "fp32":
        a = (torch.rand(n, generator=g) * 7 * d).float()
    else:  # a value of the dtype times d's power of two (exact)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dividend]
        a = (torch.rand(n, generator=g) * 7).to(dtype).float() * torch.ldexp(torch.ones(n), torch.frexp(d).exponent)
    out = torch.empty(n, device=device)
    _div_kernel[(triton.cdiv(n, 4096),)](a.to(device), d.to(device), out, n, BLOCK=4096, SHORT=dividend != "fp32",
                                         EMULATE_FMA=_EMULATE_FMA)
    assert torch.equal(out.cpu(), a / d)


# ----------------------------------------------------------------------------------------------
# Errors and checks


def test_bad_inputs_are_named(device):
    x = torch.randn(4, 32, device=device)
    q = quantize_activations
    cases = [  # (call, error, message: the argument, what was expected, what arrived)
        (lambda: q([1.0]), TypeError, "x: expected a torch.Tensor, got list"),
        (lambda: q(x.to(torch.int32)), TypeError, "x: expected one of bfloat16, float16, float32, got torch.int32"),
        (lambda: q(torch.randn(4, 40, device=device)), ValueError, "multiple of 16, got shape (4, 40)"),
        (lambda: q(torch.tensor(1.0, device=device)), ValueError, "x: expected at least one dimension"),
        (lambda: q(x, -1.0), ValueError, "global_scale: expected a positive finite fp32 value, got -1.0"),
        (lambda: q(x, 1e-50), ValueError, "global_scale: expected a positive finite"),  # 0 in fp32
        (lambda: q(x, "1"), TypeError, "global_scale: expected a float, a one-element tensor or None, got str"),
        (lambda: q(x, torch.ones(2)), ValueError, "global_scale: expected one value, got a tensor of shape (2,)"),
        (lambda: q(x, config=(1, 16, 1)), TypeError, "config: expected a QuantizeConfig or None, got tuple"),
        (lambda: QuantizeConfig(3, 32, 1), ValueError, "block_m: expected a power of two, got 3"),
        (lambda: QuantizeConfig(1, 16, 1), ValueError, "block_k: expected a power of two >= 32"),
    ]
    for call, error, message in cases:
        with pytest.raises(error) as info:
            call()
        assert message in str(info.value)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the unchecked NaN
def test_check_finite(device):
    x = torch.randn(4, 32, device=device)
    x[1, 3] = math.nan
    x[2, 5] = -math.inf
    with pytest.raises(ValueError, match=r"x: expected finite values \(check_finite=True\), got 2 NaN/Inf"):
        quantize_activations(x, check_finite=True)
    with pytest.raises(ValueError, match="global_scale: expected a positive finite value, got -2.0"):
        quantize_activations(torch.ones(4, 32, device=device), torch.tensor(-2.0), check_finite=True)
    quantize_activations(x)  # the default does not look (no host synchronisation)


def test_infinite_inputs_match_the_reference_without_checks(device):
    """Not promised by the API, but +-Inf saturate like the reference's x / d (code 7)."""
    x = torch.randn(2, 32, device=device)
    x[0, 0], x[1, 17] = math.inf, -math.inf
    want = quantize(x.nan_to_num(posinf=3e38, neginf=-3e38), "nvfp4", 1.0)
    got = quantize_activations(x, 1.0)
    assert torch.equal(got.data.cpu(), want.data.cpu())
    assert torch.equal(got.scales.cpu().view(torch.uint8), want.scales.cpu().view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# GPU and cross-compilation


@pytest.mark.gpu
@pytest.mark.parametrize("global_scale", [None, 0.0123, "tensor"])
def test_gpu_bit_exact_large(global_scale):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4096, 6144, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[:, 100:116] = 0  # a zero block in every row
    x[7] *= 1e-4  # a row of tiny blocks
    check(x, _global_scale(global_scale, "cuda"))
    check(x.float()[:512].t().contiguous().t()[:, :4096])  # fp32, column-major: copied first
    check(near_boundaries(512, 2048, _gen(10), 0.37).cuda(), 0.37)


@pytest.mark.gpu
@pytest.mark.parametrize("global_scale", [None, 0.0123], ids=["dynamic", "given"])
def test_gpu_fake_quantize_large(global_scale):
    """The one-kernel quantize-dequantize at real sizes (a GLM-5 decode batch's x and h, a prefill
    x), launched with PDL, bit for bit the two kernels'."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for M, K in [(1, 6144), (16, 6144), (128, 2048), (4096, 6144)]:
        x = (torch.randn(M, K, device="cuda", generator=g) * 3).to(torch.bfloat16)
        x[:, 100:116] = 0
        wg = torch.rand(256, device="cuda", generator=g) + 0.5
        x_hat, gg = fake_quantize_activations(x, global_scale, wg)
        want, want_g = dequantize_activations(quantize_activations(x, global_scale), wg)
        assert torch.equal(x_hat.view(torch.int16), want.view(torch.int16)), (M, K)
        assert torch.equal(gg, want_g)


# ----------------------------------------------------------------------------------------------
# The inverse for emulated W4A4 (GPUs without FP4 MMA)


@pytest.mark.parametrize("M,K", [(1, 16), (3, 80), (5, 1040), (9, 512), (0, 64)])
@pytest.mark.parametrize("weight_global", [None, 0.37, (0.37, 2.5, 1e-3)], ids=["none", "one", "per_expert"])
def test_dequantize_is_exact(M, K, weight_global, device):
    """x_hat holds code * block scale exactly (times the activations' global scale it is
    ``fp4moe.dequantize`` bit for bit) and g the product of the two global scales; tiles that end
    inside M and K, zero blocks and negative codes included."""
    x = normal(M, K, _gen(M * 7 + K)) * 3
    x[:, :16] = 0  # a zero block: scale 1.0, codes 0 (x[:, :16] of no rows when M = 0)
    xq = quantize_activations(x.to(device=device, dtype=torch.bfloat16))
    wg = None if weight_global is None else torch.tensor(weight_global, dtype=torch.float32, device=device).reshape(-1)
    x_hat, g = dequantize_activations(xq, wg)
    assert x_hat.shape == (M, K) and x_hat.dtype == torch.bfloat16 and g.shape == ((1,) if wg is None else wg.shape)
    gx = xq.global_scale.float().cpu()
    want = fp4moe_dequantize(xq)
    assert torch.equal((x_hat.float().cpu() * gx).view(torch.int32), want.view(torch.int32))
    assert bool((x_hat[:, :16] == 0).all())
    assert torch.equal(g.cpu(), gx * (wg.cpu() if wg is not None else torch.ones(1)))


@pytest.mark.parametrize("M,K", [(3, 80), (2, 1040), (1, 2048)])
def test_dequantize_in_mma_order(M, K, device):
    """With k_stored the rows come out in the packed weights' K order, zero past K: what
    mma_order_rows makes of the plain result (the wgmma kernel's input)."""
    from fp4moe.ops.wgmma import mma_order_rows

    xq = quantize_activations((normal(M, K, _gen(K)) * 2).to(device=device, dtype=torch.bfloat16))
    k_stored = -(-K // 64) * 64
    plain, g = dequantize_activations(xq)
    ordered, g2 = dequantize_activations(xq, k_stored=k_stored)
    assert ordered.shape == (M, k_stored) and torch.equal(g, g2)
    assert torch.equal(ordered.view(torch.int16), mma_order_rows(plain, k_stored).view(torch.int16))
    with pytest.raises(ValueError, match="multiple of 64"):
        dequantize_activations(xq, k_stored=K - 16)


def test_dequantize_refuses_what_it_cannot_read(device):
    x = torch.randn(2, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="NVFP4 FP4Tensor"):
        dequantize_activations(quantize(x.float().cpu(), "mxfp4"))
    with pytest.raises(ValueError, match="2-D activations"):
        dequantize_activations(quantize_activations(x.reshape(2, 1, 64)))
    with pytest.raises(ValueError, match="contiguous fp32 values"):
        dequantize_activations(quantize_activations(x), torch.ones(2048, device=device))
    with pytest.raises(ValueError, match="contiguous fp32 values"):
        dequantize_activations(quantize_activations(x), torch.ones(2, device=device, dtype=torch.float64))


@pytest.mark.parametrize("M,K", [(1, 16), (3, 80), (5, 1040), (2, 2048), (17, 48), (0, 64)])
@pytest.mark.parametrize("global_scale", [None, 0.0123], ids=["dynamic", "given"])
@pytest.mark.parametrize("weight_global", [None, (0.37, 2.5, 1e-3)], ids=["none", "per_expert"])
def test_fake_quantize_is_quantize_then_dequantize(M, K, global_scale, weight_global, device):
    """``fake_quantize_activations`` = ``dequantize_activations(quantize_activations(...))`` bit for
    bit in one kernel: tiles ending inside M and K, a zero block, a saturated block (only programs
    with one clamp every element), the dynamic global scale and the weights' globals."""
    x = normal(M, K, _gen(M * 11 + K)) * 3
    x[:, :16] = 0
    if M > 1:
        x[1, -16:] *= 1e6  # saturates its block scale at 448 with a given global scale
    x = x.to(device=device, dtype=torch.bfloat16)
    wg = None if weight_global is None else torch.tensor(weight_global, dtype=torch.float32, device=device)
    x_hat, g = fake_quantize_activations(x, global_scale, wg)
    want, want_g = dequantize_activations(quantize_activations(x, global_scale), wg)
    assert x_hat.shape == (M, K) and x_hat.dtype == torch.bfloat16 and g.shape == want_g.shape
    assert torch.equal(x_hat.view(torch.int16), want.view(torch.int16))
    assert torch.equal(g, want_g)


@pytest.mark.slow  # three interpreter runs of large tiles; bf16 contiguous stays in the default run
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fake_quantize_other_dtypes_and_strides(dtype, device):
    """bf16 (read as pairs), fp16 and fp32 x (read as elements), a column-major x (copied first), and
    rows farther apart than K (read in place: the output's rows are K apart, x's are not) give the
    same values as the two kernels; so do global scales outside the divisions' fast range (1e-30,
    1e31: exact divisions throughout)."""
    x = (near_boundaries(6, 320, _gen(3), 0.37)).to(device=device, dtype=dtype)
    wide = torch.zeros(6, 320 + 64, device=device, dtype=dtype)
    wide[:, :320] = x
    for xx, scale in ((x, 0.37), (x.t().contiguous().t(), 0.37), (wide[:, :320], 0.37), (wide[:, :320], None),
                      (x, 1e-30), (x, 1e31)):
        x_hat, g = fake_quantize_activations(xx, scale)
        want, want_g = dequantize_activations(quantize_activations(xx, scale))
        assert torch.equal(x_hat.view(torch.int16), want.view(torch.int16)) and torch.equal(g, want_g)
    assert wide[:, :320].stride(0) == 384  # read in place, not copied: the strided case is tested


def test_bf16_rows_off_four_bytes_are_copied(device):
    """The quantize kernels read bf16 as int32 pairs: x starting 2 bytes off a 4-byte boundary is
    copied first, one row included (a decode batch's x can be such a view)."""
    from fp4moe.ops.quantize import _prepare

    base = torch.randn(1, 16 * 3 + 1, device=device, dtype=torch.bfloat16)
    x = base[:, 1:]
    assert x.data_ptr() % 4 == 2
    x2 = _prepare(x, 0.5, False, None)[0]
    assert x2.data_ptr() % 4 == 0 and torch.equal(x2, x)
    x_hat, _ = fake_quantize_activations(x, 0.5)
    want, _ = dequantize_activations(quantize_activations(x.contiguous(), 0.5))
    assert torch.equal(x_hat.view(torch.int16), want.view(torch.int16))


def test_fake_quantize_refuses_what_it_cannot_read(device):
    x = torch.randn(2, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2-D activations"):
        fake_quantize_activations(x.reshape(2, 1, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        fake_quantize_activations(x[:, :40])
    with pytest.raises(TypeError, match="bfloat16, float16, float32"):
        fake_quantize_activations(x.to(torch.int32))
    with pytest.raises(ValueError, match="contiguous fp32 values"):
        fake_quantize_activations(x, None, torch.ones(2048, device=device))


def fp4moe_dequantize(xq: FP4Tensor) -> torch.Tensor:
    from fp4moe.quantize import dequantize

    return dequantize(xq.to("cpu"), torch.float32)


_CROSS_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4moe.kernels.quantize import absmax_kernel, nvfp4_dequantize_kernel, nvfp4_quantize_kernel
from fp4moe.ops.quantize import QuantizeConfig

cfg = QuantizeConfig.from_heuristic(16384, 6144)
div16 = [["tt.divisibility", 16]]  # what the launcher's 16-byte-aligned pointers and strides get
results = []
for cc in json.loads(sys.argv[1]):
    target = GPUTarget("cuda", cc, 32)
    sig = {"x_ptr": "*bf16", "data_ptr": "*i32", "scales_ptr": "*u8", "scale_ptr": "*fp32",
           "gs_out_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32", "n_part": "i32", "BLOCK_M": "constexpr",
           "BLOCK_K": "constexpr", "DYNAMIC": "constexpr", "SM86": "constexpr",
           "EMULATE_FMA": "constexpr", "BLOCK_P": "constexpr"}
    consts = {"BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k, "DYNAMIC": True, "SM86": cc >= 86,
              "EMULATE_FMA": False, "BLOCK_P": 1}
    attrs = {(i,): div16 for i in (0, 1, 2, 3, 4, 6, 7)}
    quant = triton.compile(ASTSource(nvfp4_quantize_kernel, sig, consts, attrs), target=target,
                           options={"num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg})
    sig = {"x_ptr": "*bf16", "amax_ptr": "*i32", "M": "i32", "K": "i32", "stride_xm": "i32",
           "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "ROW_STEPS": "constexpr", "PARTIALS": "constexpr",
           "PDL": "constexpr"}
    consts = {"BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k, "ROW_STEPS": 4, "PARTIALS": False, "PDL": cc >= 90}
    amax = triton.compile(ASTSource(absmax_kernel, sig, consts, {(0,): div16, (4,): div16}),
                          target=target, options={"num_warps": cfg.num_warps})
    sig = {"data_ptr": "*u8", "scales_ptr": "*u8", "xg_ptr": "*fp32", "wg_ptr": "*fp32", "out_ptr": "*bf16",
           "g_out_ptr": "*fp32", "M": "i32", "K": "i32", "K_OUT": "i32", "stride_dm": "i32", "stride_sm": "i32",
           "stride_om": "i32", "G": "i32", "BLOCK_K": "constexpr", "HAS_WG": "constexpr", "BLOCK_G": "constexpr",
           "MMA_ORDER": "constexpr", "PDL": "constexpr"}
    consts = {"BLOCK_K": 1024, "HAS_WG": True, "BLOCK_G": 256, "MMA_ORDER": cc == 90, "PDL": cc >= 90}
    deq = triton.compile(ASTSource(nvfp4_dequantize_kernel, sig, consts, {(i,): div16 for i in (0, 1, 4, 9, 11)}),
                         target=target, options={"num_warps": 4})
    ptx = quant.asm["ptx"]
    results.append({"cc": cc, "ptx": len(ptx), "shared": quant.metadata.shared,
                    "dequant_ptx": deq.asm["ptx"], "dequant_shared": deq.metadata.shared,
                    "absmax_ptx": len(amax.asm["ptx"]), "absmax_shared": amax.metadata.shared,
                    "loads_16B": ptx.count("ld.global.v4.b32"), "fma": ptx.count("fma.rn.f32"),
                    "approx_div": ptx.count("div.approx") + ptx.count("div.full"),
                    "fp8_cvt": ptx.count("e4m3x2"), "maxnreg": ".maxnreg 64" in ptx,
                    "xorsign": ptx.count("max.xorsign.abs.bf16x2")})
print(json.dumps(results))
"""


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_cross_compiles_for_every_generation():
    """SM80 (no FP8 conversion), SM89, SM90, SM100, SM120 from this CPU machine, in a subprocess
    without TRITON_INTERPRET (under the interpreter @triton.jit objects cannot be compiled)."""
    ccs = [80, 89, 90, 100, 120]
    results = run_compile_snippet(_CROSS_COMPILE, ccs, timeout=300)
    assert [r["cc"] for r in results] == ccs
    for r in results:
        deq = r.pop("dequant_ptx")
        print(r)
        assert r["ptx"] > 0 and r["absmax_ptx"] > 0
        assert r["loads_16B"] >= 4, r  # 2 x 16-byte loads per 16-element block, per thread
        assert r["fma"] > 0 and r["approx_div"] == 0, r  # exact divisions only
        assert r["fp8_cvt"] == 0, r  # integer/float rounding to E4M3, no FP8 conversion instruction
        assert r["shared"] <= 16384 and r["absmax_shared"] <= 16384, r
        assert r["maxnreg"], r  # the heuristic's register cap reaches the PTX
        assert (r["xorsign"] > 0) == (r["cc"] >= 86), r  # SM80 has no max.xorsign.abs
        # the inverse (emulated W4A4): integer decode only, PDL where the target has it, no shared memory
        assert "cvt.rn.f32.e4m3" not in deq and "e4m3x2" not in deq and r["dequant_shared"] == 0, r
        assert ("griddepcontrol.wait" in deq) == (r["cc"] >= 90), r
