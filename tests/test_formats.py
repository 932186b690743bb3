"""Bit-exact tests of the FP4 formats and the torch reference quantizer."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp4moe
from fp4moe.formats import (
    E2M1_VALUES,
    E4M3_MIN_SCALE,
    MXFP4,
    NVFP4,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode_bits,
    e8m0_decode,
    get_format,
    mxfp4_block_exponents,
    pack_fp4,
    swizzle_scales,
    swizzled_offset,
    unpack_fp4,
    unswizzle_scales,
)

# ------------------------------------------------------------------------------------- E2M1


def test_every_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8)
    got = e2m1_decode(codes)
    want = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), codes >= 8)  # code 8 is -0.0


def test_every_value_encodes_to_its_code():
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    assert torch.equal(e2m1_encode(values), torch.arange(16, dtype=torch.uint8))


# Each midpoint between two neighbours rounds to the neighbour with the even code.
TIES = [
    (0.25, 0),  # 0 (code 0) vs 0.5 (code 1)
    (0.75, 2),  # 0.5 (1) vs 1.0 (2)
    (1.25, 2),  # 1.0 (2) vs 1.5 (3)
    (1.75, 4),  # 1.5 (3) vs 2.0 (4)
    (2.5, 4),  # 2.0 (4) vs 3.0 (5)
    (3.5, 6),  # 3.0 (5) vs 4.0 (6)
    (5.0, 6),  # 4.0 (6) vs 6.0 (7)
]


@pytest.mark.parametrize("value,code", TIES)
def test_ties_round_to_even_code(value, code):
    x = torch.tensor([value, -value], dtype=torch.float32)
    assert e2m1_encode(x).tolist() == [code, code | 8]
    # one ulp either side of the tie goes to the nearer neighbour
    up = torch.nextafter(torch.tensor(value), torch.tensor(math.inf)).reshape(1)
    down = torch.nextafter(torch.tensor(value), torch.tensor(-math.inf)).reshape(1)
    lo = max(c for c in range(8) if E2M1_VALUES[c] < value)
    assert e2m1_encode(up).item() == lo + 1
    assert e2m1_encode(down).item() == lo


def test_saturation_at_six():
    x = torch.tensor([6.0, 6.5, 7.0, 1e30, float("inf"), -6.0, -100.0, -float("inf")])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [6, 6, 6, 6, 6, -6, -6, -6]


def test_sign_is_kept_for_values_that_round_to_zero():
    x = torch.tensor([0.1, -0.1, 0.0, -0.0])
    assert e2m1_encode(x).tolist() == [0, 8, 0, 8]


def test_encode_rejects_non_fp32():
    with pytest.raises(TypeError, match="float32"):
        e2m1_encode(torch.zeros(4, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------- packing


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_quantize_packing_order_explicit():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -0.5
    t = fp4moe.quantize(x, global_scale=1.0)  # block scale = 6 / (6 * 1) = 1.0
    assert t.scales.float().item() == 1.0
    assert t.data[0, 0].item() == (0x9 << 4) | 0x7
    assert t.data[0, 1:].tolist() == [0] * 7


# ------------------------------------------------------------------------------------- scales


def test_every_finite_e4m3_value_decodes_like_torch():
    bits = torch.arange(256, dtype=torch.uint8)
    ours = e4m3_decode_bits(bits)
    theirs = bits.view(torch.float8_e4m3fn).to(torch.float32)
    finite = torch.isfinite(theirs)
    assert int(finite.sum()) == 254  # 0x7F and 0xFF are NaN
    assert torch.equal(ours[finite], theirs[finite])
    assert torch.isnan(ours[~finite]).all()


def test_e8m0_values():
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_decode(e)
    assert got[:-1].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(got[-1].item())


@pytest.mark.parametrize(
    "amax,exponent",
    [
        (6.0, 0),  # exactly 6 * 2**0: no rounding up
        (6.0000005, 1),  # just above: the next power of two
        (3.0, -1),
        (4.5, 0),  # 4.5 / 1 = 4.5 <= 6
        (0.75, -3),
        (1.0, -2),  # 1 / 0.25 = 4 <= 6, 1 / 0.125 = 8 > 6
        (448.0, 7),  # 448 / 128 = 3.5
    ],
)
def test_mxfp4_exponent_is_the_smallest_that_avoids_saturation(amax, exponent):
    got = mxfp4_block_exponents(torch.tensor([amax], dtype=torch.float32)).item() - 127
    assert got == exponent
    assert amax <= 6 * 2.0**got and amax > 6 * 2.0 ** (got - 1)


def test_mxfp4_zero_block_gets_scale_one():
    assert mxfp4_block_exponents(torch.zeros(1)).item() == 127


def test_nvfp4_scales_follow_modelopt():
    torch.manual_seed(0)
    x = torch.randn(8, 64) * 3
    t = fp4moe.quantize(x)
    amax = x.abs().max()
    assert t.global_scale.item() == (amax / 2688.0).item()
    block_amax = x.reshape(8, 4, 16).abs().amax(-1)
    want = (block_amax / (6.0 * t.global_scale)).clamp(E4M3_MIN_SCALE, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(t.scales.view(torch.uint8), want.view(torch.uint8))
    assert t.scales.float().max().item() == 448.0  # the block holding amax gets the top scale


def test_nvfp4_zero_and_tiny_blocks():
    x = torch.zeros(1, 48)
    x[0, 16:32] = 1.0
    x[0, 32] = 1e-9  # a block so small its scale would flush to zero: clamped at 2**-9
    t = fp4moe.quantize(x)
    s = t.scales.float()[0]
    assert s[0].item() == 1.0  # zero block
    assert s[2].item() == E4M3_MIN_SCALE
    assert (fp4moe.dequantize(t, torch.float32)[0, :16] == 0).all()


def test_nvfp4_given_global_scale_saturates_block_scales():
    x = torch.full((1, 16), 100.0)
    t = fp4moe.quantize(x, global_scale=0.01)  # 100 / 0.06 = 1667 > 448
    assert t.scales.float().item() == 448.0
    assert fp4moe.dequantize(t, torch.float32).max().item() == pytest.approx(6 * 448 * 0.01)


# ------------------------------------------------------------------------------------- swizzle


def test_swizzled_offset_hand_checked():
    # m=130, k=5, 8 scale columns: row tile 1 of 2 k-tiles, k-tile 1 -> tile 3 -> 1536;
    # m % 32 = 2 -> +32; (m % 128) // 32 = 0; k % 4 = 1 -> 1569
    assert swizzled_offset(130, 5, 8) == 1569
    # m=37, k=2, 4 columns: 5*16 + 1*4 + 2
    assert swizzled_offset(37, 2, 4) == 86


@pytest.mark.parametrize("rows,cols", [(128, 4), (300, 7), (1, 1), (256, 384 // 16)])
def test_swizzle_round_trip_and_offsets(rows, cols):
    s = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    sw = swizzle_scales(s)
    assert sw.shape == (-(-rows // 128) * 128, -(-cols // 4) * 4)
    assert torch.equal(unswizzle_scales(sw, rows, cols), s)
    flat = sw.reshape(-1)
    for m in range(rows):
        for k in range(cols):
            assert flat[swizzled_offset(m, k, cols)].item() == s[m, k].item()


def test_swizzle_batched_and_fp8():
    t = fp4moe.quantize(torch.randn(3, 130, 64))
    sw = t.swizzled_scales()
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == (3, 256, 4)
    back = unswizzle_scales(sw, 130, 4)
    assert torch.equal(back.view(torch.uint8), t.scales.view(torch.uint8))


def test_unswizzle_checks_shape():
    with pytest.raises(ValueError, match="swizzled"):
        unswizzle_scales(torch.zeros(128, 4), 130, 4)


# ------------------------------------------------------------------------------------- error bound


def _e2m1_half_gap(v: torch.Tensor) -> torch.Tensor:
    """Half the distance between the E2M1 neighbours around |v| (v already divided by scale)."""
    return torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))


def _effective_scale(t) -> torch.Tensor:
    s = t.block_scales_fp32()
    return s * t.global_scale if t.global_scale is not None else s


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed", "uniform"])
def test_error_within_half_a_step(fmt, dist):
    g = torch.Generator().manual_seed(1)
    shape = (64, 256)
    if dist == "normal":
        x = torch.randn(shape, generator=g)
    elif dist == "heavy_tailed":
        x = torch.randn(shape, generator=g) ** 3 * 10
    else:
        x = torch.rand(shape, generator=g) * 200 - 100
    t = fp4moe.quantize(x, fmt)
    y = fp4moe.dequantize(t, torch.float32)
    bs = t.block_size
    scale = _effective_scale(t).unsqueeze(-1)  # [64, K/bs, 1]
    xb, yb = x.reshape(64, -1, bs), y.reshape(64, -1, bs)
    v = xb.abs() / scale
    err = (xb - yb).abs()
    # NVFP4 may saturate by at most the E4M3 rounding of the scale (2**-4 relative).
    assert v.max() <= 6 * (1 + 2**-4) * (1 + 1e-6)
    bound = torch.where(v <= 6, _e2m1_half_gap(v) * scale, (v - 6) * scale)
    assert (err <= bound + 1e-6 * scale).all(), (err - bound).max()  # fp32 rounding of x - 6s
    # and the largest step of a block is twice the scale: half of it bounds everything
    assert (err <= scale * 1.0 * (1 + 1e-6)).all()


# ------------------------------------------------------------------------------------- property


def _nearest_code(v: torch.Tensor) -> torch.Tensor:
    """Brute force: the code whose value is nearest v (ties to even code), saturating."""
    values = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)
    a = v.abs().to(torch.float64).clamp(max=6.0).unsqueeze(-1)
    dist = (a - values).abs()
    best = dist.min(-1, keepdim=True).values
    # among equally near values prefer the even code (argmax returns the first maximum)
    even_pref = torch.where(dist == best, (torch.arange(8) % 2 == 0).to(torch.int64) * 2 + 1, 0)
    code = even_pref.argmax(-1)
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


finite_floats = st.one_of(
    st.floats(-1e4, 1e4, allow_nan=False, width=32),
    st.sampled_from([0.0, -0.0, 6.0, -6.0, 448.0, 1e-30, -1e-30, 3.4e38 / 1e6, 2.0**-9]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(["nvfp4", "mxfp4"]),
    rows=st.integers(0, 5),
    blocks=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_property_codes_are_nearest_and_scales_exact(fmt, rows, blocks, dtype, data):
    f = get_format(fmt)
    k = blocks * f.block_size
    vals = data.draw(st.lists(finite_floats, min_size=rows * k, max_size=rows * k))
    x = torch.tensor(vals, dtype=torch.float32).reshape(rows, k).to(dtype)
    if not torch.isfinite(x).all():  # float16 overflow of large draws
        x = torch.nan_to_num(x, posinf=60000.0, neginf=-60000.0)
    t = fp4moe.quantize(x, fmt)
    assert t.data.shape == (rows, k // 2) and t.scales.shape == (rows, blocks)
    xf = x.to(torch.float32).reshape(rows, blocks, f.block_size)
    scale = _effective_scale(t).unsqueeze(-1)
    want = _nearest_code(xf / scale).reshape(rows, k)
    got = unpack_fp4(t.data)
    # -0 vs +0 codes both decode to zero; compare values and signs of non-zero codes
    assert torch.equal(e2m1_decode(got), e2m1_decode(want))
    # dequantize is exactly (code value * block scale) * global, in that order
    y = fp4moe.dequantize(t, torch.float32).reshape(rows, blocks, f.block_size)
    want_y = e2m1_decode(got).reshape(rows, blocks, f.block_size) * t.block_scales_fp32().unsqueeze(-1)
    if t.global_scale is not None:
        want_y = want_y * t.global_scale
    assert torch.equal(y, want_y)
    if f is MXFP4:  # never saturates
        assert (xf.abs() <= 6 * scale).all()


# ------------------------------------------------------------------------------------- bad input


def test_bad_block_multiple():
    with pytest.raises(ValueError, match=r"length 24.*multiple.*16"):
        fp4moe.quantize(torch.randn(2, 24))
    with pytest.raises(ValueError, match=r"multiple.*32"):
        fp4moe.quantize(torch.randn(2, 48), "mxfp4")


def test_bad_dtype_and_type():
    with pytest.raises(TypeError, match=r"x: expected .*got torch.int32"):
        fp4moe.quantize(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        fp4moe.quantize([1.0] * 16)
    with pytest.raises(ValueError, match=r"fmt: expected .*got 'int4'"):
        fp4moe.quantize(torch.randn(2, 16), "int4")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_refused_or_mapped(bad):
    x = torch.randn(2, 32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        fp4moe.quantize(x)
    t = fp4moe.quantize(x, nonfinite="zero")
    y = fp4moe.dequantize(t, torch.float32)
    assert torch.isfinite(y).all() and y[1, 3].item() == 0.0


def test_bad_global_scale():
    x = torch.randn(2, 32)
    for gs in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="global_scale"):
            fp4moe.quantize(x, global_scale=gs)
    with pytest.raises(ValueError, match="global_scale: mxfp4 has no global scale"):
        fp4moe.quantize(x, "mxfp4", global_scale=1.0)


def test_bad_axis():
    with pytest.raises(ValueError, match="axis"):
        fp4moe.quantize(torch.randn(2, 32), axis=2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64)])
def test_empty_tensors(fmt, shape):
    t = fp4moe.quantize(torch.empty(shape), fmt)
    assert t.data.shape == (*shape[:-1], 32) and t.data.numel() == 0
    assert fp4moe.dequantize(t).shape == shape


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_non_contiguous_and_axis(fmt):
    torch.manual_seed(3)
    w = torch.randn(64, 96)  # [K, N] stored transposed
    a = fp4moe.quantize(w.t(), fmt)  # non-contiguous view [N, K]
    b = fp4moe.quantize(w.t().contiguous(), fmt)
    c = fp4moe.quantize(w, fmt, axis=0)  # blocks along K = axis 0
    for t in (a, c):
        assert torch.equal(t.data, b.data)
        assert torch.equal(t.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert a.shape == (96, 64)


def test_fp4tensor_validates_its_parts():
    t = fp4moe.quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="data: expected shape"):
        fp4moe.FP4Tensor(t.data[:, :8], t.scales, t.global_scale, t.shape, t.fmt)
    with pytest.raises(TypeError, match="scales: expected torch.float8_e4m3fn"):
        fp4moe.FP4Tensor(t.data, t.scales.view(torch.uint8), t.global_scale, t.shape, t.fmt)
    with pytest.raises(ValueError, match="needs an fp32 global scale"):
        fp4moe.FP4Tensor(t.data, t.scales, None, t.shape, "nvfp4")
    with pytest.raises(TypeError, match="dequantize|FP4Tensor"):
        fp4moe.dequantize(torch.zeros(3))


def test_formats_are_frozen_data():
    assert NVFP4.block_size == 16 and NVFP4.scale_dtype == torch.float8_e4m3fn and NVFP4.has_global_scale
    assert MXFP4.block_size == 32 and MXFP4.scale_dtype == torch.uint8 and not MXFP4.has_global_scale
    with pytest.raises(Exception):
        NVFP4.block_size = 32  # type: ignore[misc]


def test_stacked_matrices_may_carry_one_global_scale_each():
    torch.manual_seed(5)
    w = torch.randn(3, 32, 64) * torch.tensor([1.0, 10.0, 0.1]).reshape(3, 1, 1)
    per = [fp4moe.quantize(w[e]) for e in range(3)]
    stacked = fp4moe.FP4Tensor(
        data=torch.stack([p.data for p in per]), scales=torch.stack([p.scales for p in per]),
        global_scale=torch.stack([p.global_scale.reshape(1) for p in per]), shape=w.shape, fmt="nvfp4")  # [E, 1]
    got = fp4moe.dequantize(stacked, torch.float32)
    for e in range(3):
        assert torch.equal(got[e], fp4moe.dequantize(per[e], torch.float32))
    per_row = fp4moe.FP4Tensor(stacked.data, stacked.scales, stacked.global_scale.expand(3, 32).contiguous(),
                               w.shape, "nvfp4")  # [E, N]: the same globals, row by row
    assert torch.equal(fp4moe.dequantize(per_row, torch.float32), got)
    with pytest.raises(ValueError, match=r"broadcasting to \(3, 32\)"):
        fp4moe.FP4Tensor(stacked.data, stacked.scales, torch.ones(2, 1), w.shape, "nvfp4")


def test_copied_and_loaded_formats_are_the_registered_objects():
    """Kernels and checks compare formats with ``is``: a deep-copied, pickled or torch.load-ed
    weight must keep the registered format object (a copy once read as MXFP4 in the MMA pack)."""
    import copy
    import io
    import pickle

    from fp4moe.formats import MXFP4, NVFP4, FP4Format, get_format

    assert copy.deepcopy(NVFP4) is NVFP4 and copy.copy(MXFP4) is MXFP4
    assert pickle.loads(pickle.dumps(MXFP4)) is MXFP4
    assert get_format(FP4Format("nvfp4", 16, "e4m3", True)) is NVFP4
    custom = FP4Format("custom", 16, "e4m3", True)
    assert copy.deepcopy(custom) == custom and get_format(custom) is custom
    q = fp4moe.quantize(torch.randn(32, 128), "nvfp4")
    assert copy.deepcopy(q).fmt is NVFP4
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).fmt is NVFP4
