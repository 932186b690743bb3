"""The MMA-operand weight layout (ops.mma_layout) and its Gluon decode kernel (kernels.linear_mma).

On CPU: the layout is an exact re-ordering (round trip), the scale re-encoding gives the bf16
patterns the kernel's multiply-add expects, and a bit-level model of the kernel's PTX decoder,
applied to the packed words, gives every weight value at the fragment position the layout
documents. Cross-compilation: the kernel builds for sm_80/90/120 with no shared memory at all (the
operand conversions are asserted trivial) and no spills; its in-program K split variant from sm_80 to
sm_120 with shared memory only for the partial tiles, PDL from sm_90; the decode heuristic's register
table is what ptxas reports. GPU: against the reference, and deterministic.
"""

import itertools

import pytest
import torch

from fp4moe.target import get_arch
from fp4moe.formats import MXFP4, NVFP4
from fp4moe.formats import e4m3_to_e5m3, e5m3_to_e4m3
from fp4moe.ops.mma_pack import pack_mma, unpack_mma
from fp4moe.ops.mma_sync import MMAConfig, choose_mma_config
from fp4moe.quantize import FP4Tensor, dequantize, quantize
from fp4moe.tuning import current_tuning, tuning
from layer_checks import (FMTS, check_fp4linear_graph, check_moe_layer, check_packed_linear, moe_variants,
                          packed_linear_case, run_compile_snippet)
from ptx_interp import bf16_to_float, run_ptx

# (activation, interleaved, per-row globals, bias)
MOE_VARIANTS = moe_variants(("silu", False, False, False), ("silu", False, True, True), ("gpt_oss", True, False, True))


def _weights(N, K, fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.logspace(-3, 2, N).unsqueeze(1)
    w[:, :fmt.block_size] = 0  # a zero block (zero scale for NVFP4)
    return quantize(w, fmt)


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("N,K", [(16, 64), (64, 256), (40, 192), (33, 128), (200, 1024)])
def test_pack_round_trip(fmt, N, K):
    with tuning(linear=dict(pack_rows=48)):  # several steps, one ending off a 16-row block
        w = _weights(N, K, fmt)
        p = pack_mma(w)
        assert p.words.shape == (-(-N // 16), -(-K // 64), 32, 4) and p.words.dtype == torch.int32
        assert torch.equal(dequantize(unpack_mma(p)), dequantize(w))


def test_scale_codes_cover_e4m3_exactly():
    bits = torch.arange(1, 127, dtype=torch.uint8)  # every finite positive E4M3 (0x7F is NaN)
    code = e4m3_to_e5m3(bits)
    assert int(code.min()) >= 8 and int(code.max()) <= 151  # code 0 is reserved for a zero scale
    assert torch.equal(e5m3_to_e4m3(code), bits)
    # the kernel's multiply-add: code * 16 + (235 << 7) is the bf16 of scale * 2**118
    bf16 = (code.to(torch.int32) * 16 + (235 << 7)).to(torch.int16).view(torch.bfloat16).float()
    assert torch.equal(bf16, bits.view(torch.float8_e4m3fn).float() * 2.0**118)


def test_pack_refuses_bad_input():
    w = quantize(torch.randn(16, 64), NVFP4)
    nan = FP4Tensor(w.data, torch.full_like(w.scales.view(torch.uint8), 0x7F).view(torch.float8_e4m3fn),
                    w.global_scale, w.shape, NVFP4)
    with pytest.raises(ValueError, match="NaN"):
        pack_mma(nan)
    mx = quantize(torch.randn(16, 64), MXFP4)
    tiny = FP4Tensor(mx.data, torch.full_like(mx.scales, 5), None, mx.shape, MXFP4)
    with pytest.raises(ValueError, match="exponents"):
        pack_mma(tiny)
    with pytest.raises(ValueError, match="2-D"):
        pack_mma(quantize(torch.randn(2, 16, 64), NVFP4))


@pytest.mark.parametrize("order", ["nibble", "rotation"])
@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_decoder_model_gives_the_documented_fragments(fmt, order):
    """Run the kernel's PTX (``decode_asm(order)``, ``scale_asm``, interpreted by ``ptx_interp``) on
    words packed in that bit order and check that value (i2, i1, i0) of lane 4g+t, word kl of chunk
    kc, row block rb is W[16 rb + g + 8 i1, k] * 2**(F-126) with k the stored K order
    64 kc + 16 t + 4 kl + 2 i2 + i0; ``unpack_mma`` reads the pack back in its order."""
    from fp4moe.kernels.linear_mma import decode_asm, scale_asm

    N, K = 48, 192
    w = _weights(N, K, fmt, seed=3)
    p = pack_mma(w, order)
    assert p.order == order and p.to("cpu").order == order
    assert torch.equal(dequantize(unpack_mma(p)), dequantize(w))
    # the kernel applies the global scale in its epilogue: compare with code x block scale
    ref = dequantize(FP4Tensor(w.data, w.scales, torch.ones(1), w.shape, fmt) if fmt is NVFP4 else w, torch.float32)
    fold = 2.0 ** (118 - 126) if fmt is NVFP4 else 2.0 ** (100 - 126)
    words = p.words.to(torch.int64)  # [nb, kc, 32, 4]
    sb = p.scales.to(torch.int64)
    if fmt is NVFP4:  # lane's pair [nb, kc, 32, 2]
        pair = sb
    else:  # [nb, kc, 8, 4] -> lane (g, t): pair at t // 2
        pair = sb.reshape(*sb.shape[:2], 8, 2, 2)[:, :, :, [0, 0, 1, 1], :].reshape(*sb.shape[:2], 32, 2)
    sg, sh = run_ptx(scale_asm(fmt is not NVFP4), [pair[..., 0] | (pair[..., 1] << 8)], 2)
    vals = run_ptx(decode_asm(order), [words, sg.unsqueeze(-1), sh.unsqueeze(-1)], 8)  # $2j + i0: reg j = 2 i2 + i1
    out = torch.empty(*words.shape, 2, 2, 2)  # [..., i2, i1, i0]
    for k, v in enumerate(vals):
        out[..., k // 4, k // 2 % 2, k % 2] = bf16_to_float(v)
    nb, kcs = words.shape[:2]
    # [rb, kc, g, t, kl, i2, i1, i0] -> W[rb*16 + i1*8 + g, kc*64 + t*16 + kl*4 + i2*2 + i0]
    vals = out.reshape(nb, kcs, 8, 4, 4, 2, 2, 2).permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(nb * 16, kcs * 64)
    assert torch.equal(vals[:N, :K], ref * fold)


def test_weights_before_the_pdl_wait_only_after_a_packs_first_launch():
    """The launchers' shared rule (``_weights_before_wait``): a PDL mode that reads weights before its
    wait (2, 3) waits first (1) on a pack's first launch, then keeps its mode; modes 0 and 1 pass
    unchanged and do not count as that first launch; packs are counted apart."""
    from fp4moe.ops.mma_pack import _weights_before_wait

    w = quantize(torch.randn(32, 64), NVFP4)
    p, q = pack_mma(w), pack_mma(w)
    assert [_weights_before_wait(p, m) for m in (0, 1)] == [0, 1]
    assert [_weights_before_wait(p, 3), _weights_before_wait(p, 3), _weights_before_wait(p, 2)] == [1, 3, 2]
    assert _weights_before_wait(q, 2) == 1


def test_choose_mma_config():
    """Decode splits K over warp groups of one program (one launch, PDL on SM90+), every program
    resident at once, each warp at least two loop steps; K too short for that: the grid split."""
    from fp4moe.ops.mma_sync import KW_REGISTERS, KW_REGISTERS_XC, _fit_kw

    for M, N, K in [(1, 12288, 6144), (16, 12288, 6144), (3, 6144, 2048), (9, 4096, 6144), (1, 6144, 12288),
                    (16, 6144, 2048), (1, 200, 1024)]:
        for fmt in ("nvfp4", "mxfp4"):
            c = choose_mma_config(M, N, K, 132, fmt=fmt)
            assert c.block_m == (8 if M <= 8 else 16) and c.kw >= 2 and c.split_k == 1 and c.pdl in (2, 3), c
            chunks = K // 64
            assert _fit_kw(c, chunks) == (c.kh, c.kw) and chunks // (c.kh * c.kw) >= 2, c
            regs = KW_REGISTERS_XC[(fmt == "mxfp4", c.rb, c.kh, c.kw)] if c.xc else \
                KW_REGISTERS[(fmt == "mxfp4", c.block_m, c.rb, c.kh, c.kw)]
            per_sm = get_arch("sm90").ctas_per_sm(32 * c.kw, registers=regs)
            assert -(-N // c.block_n) * -(-M // c.block_m) <= 132 * per_sm or N <= 16 * 132, c  # one wave
    assert choose_mma_config(1, 12288, 6144, arch="sm89").pdl == 0  # no griddepcontrol before Hopper
    assert str(choose_mma_config(1, 12288, 6144)) == "mma_n16_m8_k256_w1_kw4_pdl2"  # the H200 sweep's best
    # x through the shared-memory ring only for one-row-block 16-token programs with long K slices
    # whose grid stays one wave with the ring (measured on the H200: 6144x12288 at M = 9..16)
    assert [choose_mma_config(M, 6144, 12288).xs for M in (4, 9, 16)] == [0, 2, 2]
    assert choose_mma_config(16, 12288, 6144).xs == 0  # two row blocks per warp
    assert choose_mma_config(16, 4096, 6144).xs == 0  # 6 steps per slice
    assert choose_mma_config(16, 8192, 28672).xs == 0  # the ring would need a second wave
    assert choose_mma_config(16, 6144, 12288, 188, arch="sm120").xs == 0  # 100 KB per SM: one program
    # ties on bytes in flight: 8-token programs of weights streamed from DRAM with >= 3 row blocks per
    # SM take more warps of shorter steps (measured on the H200); 5120 rows, 16 tokens, weights that
    # go into L2 first and GLM-5's shapes keep longer steps
    assert str(choose_mma_config(1, 8192, 25600)) == "mma_n16_m8_k128_w1_kw8_pdl2"
    assert str(choose_mma_config(4, 8192, 14336, fmt="mxfp4")) == "mma_n16_m8_k128_w1_kw8_pdl2"
    assert str(choose_mma_config(1, 5120, 25600)) == "mma_n16_m8_k256_w1_kw4_pdl2"
    assert choose_mma_config(16, 8192, 25600).kh == 4
    assert str(choose_mma_config(1, 1024, 25600, l2_bytes=60 << 20)) == "mma_n16_m8_k256_w1_kw4_pdl3"
    assert str(choose_mma_config(1, 8192, 25600, 200)) == "mma_n16_m8_k256_w1_kw4_pdl2"  # 2.6 blocks per SM
    # with the ring, from SM90 on, the weights go into L2 two steps ahead (measured faster only there)
    assert [choose_mma_config(M, 6144, 12288).pf for M in (4, 9, 16)] == [0, 2, 2]
    assert [choose_mma_config(16, 2048, 28672, arch=a).pf for a in ("sm80", "sm89", "sm90", "sm120")] == [0, 0, 2, 2]
    assert choose_mma_config(16, 2048, 28672, arch="sm80").xs == 2
    assert all(choose_mma_config(M, N, K).pf == 0 for M in (1, 4, 8, 16)
               for N, K in ((12288, 6144), (4096, 6144), (6144, 2048), (8192, 28672)))
    # weights of at most a quarter of the L2 are requested into it whole before the PDL wait
    h200_l2 = 60 << 20
    assert [choose_mma_config(1, N, K, l2_bytes=h200_l2).pdl for N, K in ((6144, 2048), (4096, 6144), (8192, 8192))] \
        == [3, 3, 2]
    assert choose_mma_config(1, 4096, 6144).pdl == 2  # by default SM90's first catalogue GPU, the H100: 50 MB
    assert choose_mma_config(1, 6144, 2048, l2_bytes=6 << 20).pdl == 2  # GA102's 6 MB L2
    assert choose_mma_config(1, 6144, 2048, arch="sm86").pdl == 0  # no PDL before Hopper
    # there, 8-token NVFP4 programs take a grid that fits each SM twice (the next launch resident beside
    # it), with x read per chunk where only its fewer registers allow that (H200 sweep, PDL3_CORESIDENT)
    assert [str(choose_mma_config(M, N, K, l2_bytes=h200_l2)) for M, N, K in
            ((1, 4096, 6144), (8, 8192, 2048), (1, 6144, 4096), (1, 12288, 2048), (1, 6144, 2048))] == \
        ["mma_n16_m8_k256_w1_kw8_pdl3_xc", "mma_n16_m8_k256_w1_kw4_pdl3_xc", "mma_n16_m8_k256_w1_kw4_pdl3",
         "mma_n16_m8_k256_w1_kw2_pdl3", "mma_n16_m8_k256_w1_kw4_pdl3"]
    for M, N, K, fmt in ((16, 4096, 6144, "nvfp4"), (1, 12288, 6144, "nvfp4"), (1, 4096, 6144, "mxfp4")):
        assert not choose_mma_config(M, N, K, l2_bytes=h200_l2, fmt=fmt).xc  # 16 tokens, PDL = 2, MXFP4
    short = choose_mma_config(1, 4096, 64)  # one 64-K chunk: nothing to split
    assert short.kw == 1 and short.split_k == 1 and not short.pdl
    with pytest.raises(ValueError, match="block_m"):
        MMAConfig(block_m=12)
    with pytest.raises(ValueError, match="kh"):
        MMAConfig(kh=3)
    with pytest.raises(ValueError, match="kw"):
        MMAConfig(kw=3)
    with pytest.raises(ValueError, match="not both"):
        MMAConfig(kw=2, split_k=2)
    with pytest.raises(ValueError, match="at most 16"):
        MMAConfig(warps=4, kw=8)
    with pytest.raises(ValueError, match="pdl"):
        MMAConfig(pdl=1)
    with pytest.raises(ValueError, match="pdl"):
        MMAConfig(kw=2, pdl=4)
    assert str(MMAConfig(rb=2, warps=1, kh=2, block_m=16, kw=8, pdl=1)) == "mma_n32_m16_k128_w1_kw8_pdl"
    with pytest.raises(ValueError, match="xc"):
        MMAConfig(xc=True)  # x per chunk is a mode of the in-program K split
    c = MMAConfig(rb=1, warps=1, kh=4, block_m=8, kw=8, pdl=3, xs=2, xc=True)
    assert str(c) == "mma_n16_m8_k256_w1_kw8_pdl3_xs2_xc" and MMAConfig.parse(str(c)) == c
    from dataclasses import replace

    with pytest.raises(ValueError, match="xa"):
        MMAConfig(kw=4, xa=True)  # x a chunk ahead is a mode of x per chunk
    with pytest.raises(ValueError, match="xa"):
        replace(c, xa=True)  # ... in registers, not through the ring
    c = replace(c, xs=0, xa=True)
    assert str(c) == "mma_n16_m8_k256_w1_kw8_pdl3_xc_xa" and MMAConfig.parse(str(c)) == c
    c = MMAConfig(rb=1, warps=1, kh=4, block_m=16, kw=4, pdl=2, xs=2, pf=2)
    assert str(c) == "mma_n16_m16_k256_w1_kw4_pdl2_xs2_pf2" and MMAConfig.parse(str(c)) == c
    for bad in (9, -1, True, 1.0):
        with pytest.raises(ValueError, match="pf"):
            replace(c, pf=bad)
    with pytest.raises(ValueError, match="pf"):
        MMAConfig(pf=2)  # a mode of the in-program K split


def test_fit_kw_gives_every_slice_whole_steps():
    from fp4moe.ops.mma_sync import _fit_kw

    assert _fit_kw(MMAConfig(kh=4, kw=8, warps=1), 96) == (4, 8)
    assert _fit_kw(MMAConfig(kh=4, kw=8, warps=1), 5) == (1, 1)  # K = 320: one chunk per step, one slice
    assert _fit_kw(MMAConfig(kh=4, kw=8, warps=1), 24) == (4, 2)
    assert _fit_kw(MMAConfig(kh=4, kw=8, warps=1), 12) == (4, 1)  # kw gives way before kh
    assert _fit_kw(MMAConfig(kh=2, kw=4, warps=1), 2) == (2, 1)


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_kw_register_table_matches_ptxas():
    """``KW_REGISTERS`` (the decode heuristic's occupancy model) is what ptxas gives for sm_90."""
    from fp4moe.ops.mma_requests import mma_compile_request
    from fp4moe.ops.mma_sync import KW_REGISTERS
    from fp4moe.plan.crosscompile import cross_compile

    keys = sorted(KW_REGISTERS)
    reqs = [mma_compile_request(MMAConfig(rb=rb, warps=1, kh=kh, block_m=bm, kw=kw, pdl=2), "mxfp4" if mx else "nvfp4",
                                90, 12288) for (mx, bm, rb, kh, kw) in keys]
    got = {k: (r.registers, r.spill_bytes, r.ok) for k, r in zip(keys, cross_compile(reqs))}
    assert {k: v for k, v in got.items() if v != (KW_REGISTERS[k], 0, True)} == {}


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_kw_xc_register_table_matches_ptxas():
    """``KW_REGISTERS_XC``: x read per chunk, as the heuristic launches it (8 tokens, PDL = 3)."""
    from fp4moe.ops.mma_requests import mma_compile_request
    from fp4moe.ops.mma_sync import KW_REGISTERS_XC
    from fp4moe.plan.crosscompile import cross_compile

    keys = sorted(KW_REGISTERS_XC)
    reqs = [mma_compile_request(MMAConfig(rb=rb, warps=1, kh=kh, block_m=8, kw=kw, pdl=3, xc=True),
                                "mxfp4" if mx else "nvfp4", 90, 12288) for (mx, rb, kh, kw) in keys]
    got = {k: (r.registers, r.spill_bytes, r.ok) for k, r in zip(keys, cross_compile(reqs))}
    assert {k: v for k, v in got.items() if v != (KW_REGISTERS_XC[k], 0, True)} == {}


def test_kw_registers_hold_where_k_is_padded():
    """K padded to the 64-K chunk masks x's loads past K_X. The compile request declares K_X a
    multiple of 16, as the runtime specialises it (x's K is one of the format's blocks), so the
    loads stay 16-byte vectors and the registers are the tables' (without it ptxas gave 230 and 105)."""
    from fp4moe.ops.mma_requests import mma_compile_request
    from fp4moe.ops.mma_sync import KW_REGISTERS, KW_REGISTERS_XC
    from fp4moe.plan.crosscompile import cross_compile

    cases = [(False, 1, 4, 4, False), (False, 1, 4, 8, False), (False, 1, 4, 4, True), (True, 1, 4, 8, True)]
    reqs = [mma_compile_request(MMAConfig(rb=rb, warps=1, kh=kh, block_m=8, kw=kw, pdl=3, xc=xc),
                                "mxfp4" if mx else "nvfp4", 90, 6112 if not mx else 6080) for mx, rb, kh, kw, xc in cases]
    assert all("K_X" in r.divisible_by_16 for r in reqs)
    for (mx, rb, kh, kw, xc), r in zip(cases, cross_compile(reqs)):
        table = KW_REGISTERS_XC[(mx, rb, kh, kw)] if xc else KW_REGISTERS[(mx, 8, rb, kh, kw)]
        assert r.ok and r.spill_bytes == 0 and r.registers <= table + 8, (mx, rb, kh, kw, xc, r.registers)


def test_kw_x_ahead_compiles_without_spills():
    """``MMAConfig.xa`` (x one chunk ahead, opt-in) compiles for SM80/90/120 at most a chunk of x (16
    registers at 16 tokens) above x per chunk, without spills on SM80/90; sm_120's ptxas stops at 80
    registers and spills 18 bytes, outside the K loop (measured, Triton 3.6)."""
    from dataclasses import replace

    from fp4moe.ops.mma_requests import mma_compile_request
    from fp4moe.plan.crosscompile import cross_compile

    base = MMAConfig(rb=1, warps=1, kh=4, block_m=16, kw=4, pdl=2, xc=True)
    cases = [(cc, xa) for cc in (80, 90, 120) for xa in (False, True)]
    reqs = [mma_compile_request(replace(base, xa=xa, pdl=base.pdl if cc >= 90 else 0), "nvfp4", cc, 6144)
            for cc, xa in cases]
    got = dict(zip(cases, cross_compile(reqs)))
    for cc in (80, 90, 120):
        r, ra = got[(cc, False)], got[(cc, True)]
        assert ra.ok and not ra.loop_spill_ops and ra.registers <= r.registers + 16, (cc, r.registers, ra.registers)
        assert cc == 120 or ra.spill_bytes == 0, (cc, ra.spill_bytes)


_COMPILE = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from fp4moe.kernels import linear_mma as L
from fp4moe.plan.crosscompile import mma_instructions
import re
out = []
for cc, rb, kh, bm, mx, grouped, plan_ready in json.loads(sys.argv[1]):
    fn = L.fp4_linear_mma_kernel
    pdl = (2 if plan_ready else 1) if grouped and cc >= 90 else 0
    sig = {"wq_ptr": "*i32", "sc_ptr": "*i16", "x_ptr": "*bf16", "wg_ptr": "*fp32", "bias_ptr": "*bf16",
           "y_ptr": "*fp32", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32", "tile_end_ptr": "*i32",
           "row_x_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "K_X": "i32", "stride_xm": "i32",
           "stride_ym": "i32", "k_chunks_per_split": "i32", "stride_ge": "i32", "stride_be": "i32"}
    cx = dict(RB=rb, WARPS=4, KH=kh, BLOCK_M=bm, MXFP4=mx, HAS_WG=not mx, HAS_BIAS=True, SPLIT_K=2, FOLD=256.0,
              DECODE=L.DECODE_ASM, SCALE=L.scale_asm(mx), X_LAYOUT=L.x_layout(bm, kh, 4), EVEN_K=True,
              GROUPED=grouped, GATHER=grouped and not plan_ready, PDL=pdl, SWIGLU=False, WG_MODE=0, X_STAGES=0)
    sig.update({k: "constexpr" for k in cx})
    c = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", cc, 32),
                       options={"num_warps": 4})
    log = c.asm.get("ptxas_log", "") if hasattr(c, "asm") else ""
    spills = re.findall(r"(\d+) bytes spill", str(c.metadata))
    ptx = c.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    out.append({"cc": cc, "shared": c.metadata.shared, "mma": mma_instructions(ptx),
                "n_regs": getattr(c, "n_regs", None), "ldshared": ptx.count("ld.shared"),
                "griddepcontrol": ptx.count("griddepcontrol"), "pdl": pdl,
                "wait_at": wait,
                "first_global": min(i for i in (ptx.find(o) for o in ("ld.global", "st.global")) if i >= 0),
                "first_store": ptx.find("st.global"),
                # loads before the wait: (tile map through L2, the rest)
                "early_loads": [ptx[:wait].count("ld.global.cg"), ptx[:wait].count("ld.global") - ptx[:wait].count("ld.global.cg")],
                "loads": ptx.count("ld.global")})
print(json.dumps(out))
"""


def test_cross_compiles_without_shared_memory():
    """Plain and grouped (MoE) variants; the grouped one as GEMM 2 (``plan_ready``) too."""
    cases = [(80, 1, 4, 8, False, False, False), (90, 2, 4, 16, False, False, False),
             (90, 1, 4, 8, True, False, False), (120, 2, 4, 16, False, False, False),
             (90, 1, 4, 8, False, True, False), (120, 1, 4, 16, True, True, False),
             (90, 1, 4, 8, False, True, True), (120, 2, 2, 16, True, True, True), (80, 1, 4, 8, False, True, True)]
    for r in run_compile_snippet(_COMPILE, cases):
        assert r["shared"] == 0 and r["ldshared"] == 0, r  # operands never go through shared memory
        assert any("mma.sync" in m and "bf16" in m for m in r["mma"]), r
        # the grouped (MoE chain) variant waits for the previous grid and lets the next one launch
        assert r["griddepcontrol"] == (2 if r["pdl"] else 0), r
        if r["pdl"] == 1:
            assert r["wait_at"] < r["first_global"], r  # nothing read or written before the wait
        if r["pdl"] == 2:
            # the tile map (through L2) and the first step's weights and scales before the wait, x (the
            # previous kernel's output) and every store after it
            assert r["wait_at"] < r["first_store"], r
            assert r["early_loads"][0] == 3 and 0 < r["early_loads"][1] < r["loads"] // 2, r


_COMPILE_KW = r"""
import dataclasses, json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
from fp4moe.ops.mma_requests import mma_compile_request
from fp4moe.ops.mma_sync import MMAConfig
from fp4moe.plan.crosscompile import mma_instructions
from fp4moe.plan.worker import _ptxas, compile_request
out = []
for cc, rb, warps, kh, kw, bm, mx, pdl, *xc in json.loads(sys.argv[1]):
    req = mma_compile_request(MMAConfig(rb=rb, warps=warps, kh=kh, block_m=bm, kw=kw, pdl=pdl, xc=bool(xc)),
                              "mxfp4" if mx else "nvfp4", cc, 6144, has_bias=True)
    c = compile_request(dataclasses.asdict(req))
    ptx = c.asm["ptx"]
    out.append({"cc": cc, "kw": kw, "rb": rb, "warps": warps, "bm": bm, "shared": c.metadata.shared,
                "mma": mma_instructions(ptx), "wait": ptx.count("griddepcontrol.wait"),
                "early_prefetch": ptx[:ptx.find("griddepcontrol.wait")].count("cp.async.bulk.prefetch.L2"),
                "prefetch": ptx.count("cp.async.bulk.prefetch.L2"),
                "launch": ptx.count("griddepcontrol.launch_dependents"), "spills": _ptxas(ptx, cc)[1]})
print(json.dumps(out))
"""


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_kw_kernel_cross_compiles_for_every_architecture():
    """The in-program K split builds from sm_80 to sm_120 with the bf16 mma.sync and no spills; its
    only shared memory is the warp groups' partial tiles; griddepcontrol (PDL) only from sm_90."""
    cases = [(80, 1, 1, 4, 4, 8, False, 2), (89, 2, 1, 2, 8, 16, True, 3), (90, 1, 1, 4, 4, 8, False, 2),
             (90, 2, 1, 4, 4, 16, True, 1), (90, 1, 2, 2, 2, 8, False, 0), (100, 1, 1, 4, 8, 8, False, 2),
             (120, 2, 1, 4, 4, 16, False, 2), (90, 1, 2, 4, 4, 8, True, 3), (120, 2, 1, 2, 4, 16, False, 3),
             (90, 1, 1, 4, 4, 16, False, 2, True), (80, 2, 1, 2, 4, 16, True, 0, True),
             (120, 1, 1, 4, 8, 8, False, 2, True)]  # x per chunk (MMAConfig.xc)
    for case, r in zip(cases, run_compile_snippet(_COMPILE_KW, cases)):
        pdl = case[-1] if get_arch(r["cc"]).has_pdl else 0
        assert any("mma.sync" in m and "bf16" in m for m in r["mma"]), r
        assert 0 < r["shared"] <= r["kw"] * 16 * r["rb"] * r["warps"] * r["bm"] * 4, r  # the partial tiles at most
        assert (r["wait"] > 0) == (pdl > 0) and (r["launch"] > 0) == (pdl > 0), r
        assert r["spills"] == 0, r
        # PDL = 3: the weights' and scales' bulk L2 requests, all before the wait
        assert r["prefetch"] == r["early_prefetch"] == (2 * r["rb"] if pdl == 3 else 0), r


_COMPILE_XS = r"""
import dataclasses, json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
from fp4moe.ops.mma_requests import mma_compile_request
from fp4moe.ops.mma_sync import MMAConfig
from fp4moe.plan.worker import _ptxas, compile_request
out = []
for cc, name, kind in json.loads(sys.argv[1]):
    kw = {"gemm1": dict(grouped=True, gather=True, swiglu=True, wg_mode=1), "gemm2": dict(grouped=True, plan_ready=True),
          "plain": dict(has_bias=True)}[kind]
    req = mma_compile_request(MMAConfig.parse(name), "nvfp4", cc, 2048, **kw)
    c = compile_request(dataclasses.asdict(req))
    ptx = c.asm["ptx"]
    loop = ptx[ptx.find("cp.async.wait_group"):]
    head = ptx[ptx.find("Inner Loop Header"):]  # the main loop (LLVM marks its header)
    out.append({"cc": cc, "name": name, "shared": c.metadata.shared, "spills": _ptxas(ptx, cc)[1],
                "copies16": ptx.count("cp.async.cg.shared.global") and all(
                    "], 0x10," in line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line),
                "wait_at": ptx.find("griddepcontrol.wait"), "first_copy": ptx.find("cp.async.cg"),
                # after the loop's wait: a CTA barrier before the first read of the ring
                "barrier_then_read": -1 < loop.find("bar.sync") < loop.find("ld.shared"),
                # the loop's first copy overwrites the slot the warps read a step before: a barrier first
                "barrier_then_copy": "Inner Loop Header" in ptx and -1 < head.find("bar.sync") < head.find("cp.async.cg")})
print(json.dumps(out))
"""


def test_x_ring_cross_compiles():
    """``MMAConfig.xs``: the ring is the kernel's only shared memory (xs steps of block_m x 64 kh
    bf16), filled by 16-byte cp.async after the PDL wait (x is the previous kernel's output), read
    after a CTA barrier that follows the wait for the copies (other warps' copies), no spills; from
    sm_80 to sm_120, in both MoE GEMMs and the plain linear."""
    cases = [(90, "mma_n128_m16_k128_w4_xs2", "gemm1"), (90, "mma_n64_m8_k256_w4_xs3", "gemm2"),
             (80, "mma_n64_m8_k256_w4_xs2", "gemm1"), (120, "mma_n128_m16_k128_w4_xs2", "gemm2"),
             (90, "mma_n128_m16_k256_w4_split4_xs2", "plain"), (90, "mma_n64_m16_k128_w2_kw4_pdl2_xs2", "plain"),
             (80, "mma_n32_m8_k256_w1_kw4_xs3", "plain"), (90, "mma_n32_m16_k256_w1_kw4_pdl2_xs2_xc", "plain")]
    for (cc, name, kind), r in zip(cases, run_compile_snippet(_COMPILE_XS, cases)):
        cfg = MMAConfig.parse(name)
        ring = cfg.xs * cfg.kw * cfg.block_m * 64 * cfg.kh * 2
        # the kw kernel's partial tiles may take shared memory of their own
        assert ring <= r["shared"] <= ring + cfg.kw * cfg.block_n * cfg.block_m * 4, r
        assert r["copies16"] and r["barrier_then_read"] and r["barrier_then_copy"] and r["spills"] == 0, r
        if kind != "plain" and cc >= 90:
            assert -1 < r["wait_at"] < r["first_copy"], r


_COMPILE_PF = r"""
import dataclasses, json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
from fp4moe.ops.mma_requests import mma_compile_request
from fp4moe.ops.mma_sync import MMAConfig
from fp4moe.plan.worker import _ptxas, compile_request
out = []
for cc, name, K in json.loads(sys.argv[1]):
    req = mma_compile_request(MMAConfig.parse(name), "nvfp4", cc, K)
    ptx = compile_request(dataclasses.asdict(req)).asm["ptx"]
    wait, loop = ptx.find("griddepcontrol.wait"), ptx.find("Inner Loop Header")
    offsets = [m.start() for m in re.finditer(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)]
    regs, spills = _ptxas(ptx, cc)[:2]
    out.append({"pf": req.constexprs["PF"], "prefetches": len(offsets), "wait": wait, "loop": loop,
                "before_wait": sum(o < wait for o in offsets), "in_loop": sum(o > loop for o in offsets),
                "registers": regs, "spills": spills})
print(json.dumps(out))
"""


def test_l2_prefetch_ahead_cross_compiles():
    """``MMAConfig.pf``: two bulk L2 prefetches (words, scales) per row block before the loop (steps
    1 .. pf - 1; before the PDL wait with ``pdl`` >= 2, the weights not being the previous kernel's
    output) and two per row block in the loop, no spills, and for the one-row-block programs the
    heuristic gives it no more registers than ``KW_REGISTERS`` (the occupancy model) says. Before
    Hopper the request leaves it out (``cp.async.bulk`` is an SM90 instruction)."""
    from fp4moe.ops.mma_sync import KW_REGISTERS

    cases = [(90, "mma_n16_m16_k256_w1_kw4_pdl2_xs2_pf2", 12288), (90, "mma_n16_m16_k256_w1_kw8_pdl2_xs2_pf3", 28672),
             (90, "mma_n32_m16_k256_w1_kw4_pdl_pf2", 6144), (120, "mma_n16_m16_k256_w1_kw4_pdl2_xs2_pf2", 12288),
             (80, "mma_n16_m16_k256_w1_kw4_xs2_pf2", 12288)]
    for (cc, name, K), r in zip(cases, run_compile_snippet(_COMPILE_PF, cases)):
        cfg = MMAConfig.parse(name)
        if cc < 90:
            assert r["pf"] == 0 and r["prefetches"] == 0, r
            continue
        assert r["pf"] == cfg.pf and r["prefetches"] == 4 * cfg.rb and r["in_loop"] == 2 * cfg.rb, (name, r)
        assert r["before_wait"] == (2 * cfg.rb if cfg.pdl >= 2 else 0), (name, r)
        assert r["spills"] == 0, (name, r)
        if cfg.rb == 1 and cc == 90:
            assert r["registers"] <= KW_REGISTERS[(False, 16, 1, cfg.kh, cfg.kw)], (name, r)


# ----------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 64, 256), (3, 80, 320), (16, 200, 1024), (5, 48, 64), (13, 4096, 6144),
                                   (8, 6144, 2048), (1, 8192, 25600)])  # the last: the warps-first tie-break
def test_gpu_kernel_matches_reference(fmt, M, N, K):
    from fp4moe.ops.mma_sync import launch_linear_mma

    configs = (choose_mma_config(M, N, K), MMAConfig(rb=2, warps=2, kh=2, block_m=16, split_k=3),
               MMAConfig(rb=1, warps=1, kh=1, block_m=8), MMAConfig(rb=2, warps=1, kh=2, block_m=16, kw=4, pdl=2),
               MMAConfig(rb=1, warps=2, kh=4, block_m=8, kw=8, pdl=1), MMAConfig(rb=1, warps=4, kh=1, block_m=16, kw=2),
               MMAConfig(rb=2, warps=2, kh=2, block_m=16, split_k=3, xs=2), MMAConfig(rb=1, warps=4, kh=4, block_m=8, xs=3),
               MMAConfig(rb=1, warps=2, kh=2, block_m=16, kw=4, pdl=2, xs=2),
               MMAConfig(rb=1, warps=1, kh=4, block_m=8, kw=4, pdl=1, xs=3),
               MMAConfig(rb=1, warps=1, kh=4, block_m=8, kw=4, pdl=3), MMAConfig(rb=1, warps=1, kh=2, block_m=16, kw=4,
                                                                              pdl=3, xs=2),
               # x per chunk: with and without the ring, two row blocks, steps of 4 and 2 chunks
               MMAConfig(rb=1, warps=1, kh=4, block_m=16, kw=4, pdl=2, xc=True),
               MMAConfig(rb=2, warps=1, kh=4, block_m=16, kw=4, pdl=2, xs=2, xc=True),
               MMAConfig(rb=1, warps=2, kh=2, block_m=8, kw=4, pdl=1, xc=True))
    check_packed_linear(launch_linear_mma, configs, fmt, M, N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("M,N,K,pad", [(1, 4096, 6144, 0), (8, 200, 6112, 0), (3, 96, 4064, 0), (16, 130, 4096, 8),
                                       (7, 64, 352, 0), (1, 512, 1056, 0), (8, 8192, 2048, 0)])
def test_gpu_x_per_chunk_is_bitwise_the_step_form(fmt, M, N, K, pad):
    """``MMAConfig.xc`` (and ``xa``, x a chunk ahead) reorders loads, not arithmetic: bit for bit what
    x per step gives, with and without the ring, K padded to the chunk or not, rows farther apart than K (the ring's fallback),
    kw shrunk to 1 by ``_fit_kw`` (K = 1056), and the heuristic's own choice."""
    from dataclasses import replace

    from fp4moe.ops.linear import fp4_linear_reference
    from fp4moe.ops.mma_sync import launch_linear_mma

    torch.manual_seed(0)
    x = torch.randn(M, K + pad, device="cuda", dtype=torch.bfloat16)[:, :K]
    w = quantize(torch.randn(N, K, device="cuda"), fmt)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    p = pack_mma(w)
    ref = fp4_linear_reference(x, w, bias).float()
    configs = [MMAConfig(rb=1, warps=1, kh=4, block_m=8, kw=4, pdl=3), MMAConfig(rb=2, warps=1, kh=2, block_m=8, kw=2, pdl=3),
               MMAConfig(rb=1, warps=4, kh=4, block_m=16, kw=2, pdl=2), MMAConfig(rb=1, warps=2, kh=4, block_m=8, kw=4, pdl=2, xs=2),
               MMAConfig(rb=2, warps=2, kh=2, block_m=16, kw=4, pdl=2, xs=3), choose_mma_config(M, N, K, fmt=fmt, l2_bytes=60 << 20)]
    for c in configs:
        if c.kw == 1:
            continue
        ys = []
        for v in (dict(xc=False, xa=False), dict(xc=True, xa=False), dict(xc=True, xa=True, xs=0)):
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch_linear_mma(x, p, bias, y, replace(c, **v))
            ys.append(y)
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), c
        assert float((ys[1].float() - ref).abs().max() / ref.abs().max()) < 1e-2, c


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_gpu_rotation_order_is_bitwise_the_nibble_order(fmt):
    """The same weight packed in both bit orders (``MMAPackedFP4.order``) gives bit for bit the same
    output on every kernel that decodes the pack: the decode kernel's one-launch and grid-split
    forms, the 16-row tile with x through the ring, and the wgmma kernel (8 tokens and 256)."""
    from fp4moe.ops.linear import fp4_linear_reference
    from fp4moe.ops.mma_sync import launch_linear_mma
    from fp4moe.ops.wgmma import WgmmaConfig, launch_linear_wgmma

    torch.manual_seed(0)
    N, K = 384, 1024
    w = quantize(torch.randn(N, K, device="cuda"), fmt)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    packs = [pack_mma(w, "nibble"), pack_mma(w, "rotation")]
    assert not torch.equal(packs[0].words, packs[1].words)
    for M, c in [(3, MMAConfig(rb=1, warps=1, kh=4, block_m=8, kw=4, pdl=2)),
                 (16, MMAConfig(rb=2, warps=2, kh=2, block_m=16, kw=2, pdl=2, xs=2)),
                 (5, MMAConfig(rb=1, warps=4, kh=2, block_m=8, split_k=2)), (256, WgmmaConfig())]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ys = []
        for p in packs:
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            if isinstance(c, MMAConfig):
                launch_linear_mma(x, p, bias, y, c)
            elif torch.cuda.get_device_capability()[0] == 9:
                launch_linear_wgmma(x, p, bias, y, c)
            else:
                continue
            ys.append(y)
        if ys:
            ref = fp4_linear_reference(x, w, bias).float()
            assert torch.equal(ys[0], ys[1]), c
            assert float((ys[1].float() - ref).abs().max() / ref.abs().max()) < 1e-2, c


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("M,N,K", [(16, 6144, 12288), (9, 2048, 28672), (13, 200, 6112), (3, 4096, 6144),
                                   (16, 96, 1024)])
def test_gpu_l2_prefetch_ahead_is_bitwise_without(fmt, M, N, K):
    """``MMAConfig.pf`` only requests bytes into L2: every output bit for bit that of the same
    configuration without it, with the ring and without, one and two row blocks (rows past N: the
    last block's), K padded to the 64-K chunk, steps ahead past the end of a K slice, PDL 1 and 2
    and a pack's first launch, and the heuristic's own choice."""
    from dataclasses import replace

    from fp4moe.ops.mma_sync import launch_linear_mma

    x, _, p, bias, ref = packed_linear_case(fmt, M, N, K)
    chosen = choose_mma_config(M, N, K, fmt=fmt, l2_bytes=60 << 20)
    configs = [replace(chosen, pf=0), MMAConfig(rb=1, warps=1, kh=4, block_m=16, kw=4, pdl=2, xs=2),
               MMAConfig(rb=2, warps=1, kh=2, block_m=8, kw=4, pdl=1),
               MMAConfig(rb=1, warps=2, kh=4, block_m=16, kw=2, pdl=2)]
    for c in configs:  # the first is the heuristic's choice without pf, then its pf (if any) among the others
        ys = []
        for pf in (0, 1, 2, 4, 8):
            y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch_linear_mma(x, p, bias, y, replace(c, pf=pf))
            ys.append(y)
        assert all(torch.equal(ys[0], y) for y in ys[1:]), c
        assert float((ys[0].float() - ref).abs().max() / ref.abs().max()) < 1e-2, c


@pytest.mark.gpu
def test_gpu_x_ring_falls_back_where_it_cannot_copy():
    """An ``xs`` configuration on x rows that are not 16-byte aligned (a column slice), on a row stride
    of 8 mod 16 elements (aligned, but not provably so to the compiler) or on a K padded to the 64-K
    chunk runs the register path: the same numbers as the reference."""
    from fp4moe.ops.linear import fp4_linear_reference
    from fp4moe.ops.mma_pack import pack_mma
    from fp4moe.ops.mma_sync import launch_linear_mma
    from fp4moe.quantize import quantize

    torch.manual_seed(1)
    for cfg, (M, N, K, offset) in itertools.product(
            (MMAConfig(rb=1, warps=4, kh=2, block_m=16, xs=2), MMAConfig(rb=1, warps=2, kh=2, block_m=16, kw=2, xs=2)),
            ((5, 128, 512, 1), (5, 128, 512, 8), (9, 64, 96, 0))):
        x = torch.randn(M, K + offset, device="cuda", dtype=torch.bfloat16)[:, offset:]
        w = quantize(torch.randn(N, K, device="cuda"), "nvfp4")
        y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch_linear_mma(x, pack_mma(w), None, y, cfg)
        ref = fp4_linear_reference(x, w, None).float()
        assert ((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2, (cfg, M, N, K, offset)


@pytest.mark.gpu
def test_gpu_fp4_linear_routes_decode_to_mma_layout_and_graphs_work():
    check_fp4linear_graph("fp4_linear_mma", (4, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,activation,interleaved,per_row,bias", MOE_VARIANTS)
@pytest.mark.parametrize("T", [1, 5, 16, 48])
def test_gpu_moe_decode_on_mma_layout(fmt, activation, interleaved, per_row, bias, T):
    """fp4_moe_experts routes decode-sized W4A16 layers to the grouped MMA-layout kernel: same
    numbers as the reference, dropped slots skipped, deterministic."""
    check_moe_layer("fp4_moe_mma", fmt, activation, interleaved, per_row, bias, T, 64, 8, 1024, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("T,rows", [(24, 4), (48, 8), (64, 8), (48, 4)])
def test_gpu_decode_heights_equal_one_height(monkeypatch, fmt, T, rows):
    """Two launches per GEMM (``MMAHeights``: 8-row tiles for the experts of at most ``rows`` rows,
    16-row tiles for the others; 64 experts, top-8, 3-8 rows per expert) give the layer that 16-row
    tiles alone give, bit for bit (each row's K steps add in the same order), and the guard probes
    the pair."""
    from fp4moe import guard
    from fp4moe.ops import moe_packed as moe_ops
    from fp4moe.ops.moe import MMAHeights, fp4_moe_experts, mma_moe_config, random_moe_problem

    p = random_moe_problem(T, 64, 8, 1024, 512, fmt, device="cuda", seed=5, dropped=(1, 3))
    heights = MMAHeights(mma_moe_config(1.0), mma_moe_config(8.0), rows)
    counts = torch.bincount(p.topk_ids[p.topk_ids >= 0].long(), minlength=64)
    assert int(((counts > 0) & (counts <= rows)).sum()) and int((counts > rows).sum())  # both classes run
    monkeypatch.setattr(moe_ops, "mma_moe_layer_config", lambda *a: heights)
    guard.reset()
    two = fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights)
    assert any(key.config == str(heights) for key in guard._checked)
    monkeypatch.setattr(moe_ops, "mma_moe_layer_config", lambda *a: heights.large)
    one = fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights)
    assert torch.equal(two, one)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_heights_overlap_equals_the_chained_launches(monkeypatch, fmt):
    """``MoETuning.heights_overlap``: each GEMM's second class runs without waiting for the first (PDL 3,
    ``launch_grouped_mma(independent=True)``), and its last program holds the grid's completion back
    until the first's. Replayed in a CUDA graph, every replay gives the layer of the chained launches
    bit for bit: GEMM 2's first class reads h rows that only the first class of GEMM 1 writes, so a
    broken chain shows as rows read before they are written. 64 experts of 8 rows on average (the
    decode kernel's range, both classes populated); the second class launches are checked to be PDL
    3 where the GPU has programmatic dependent launch, and to wait as usual where it has not."""
    from dataclasses import replace

    from fp4moe.kernels import linear_mma as kernels
    from fp4moe.ops import moe_packed as moe_ops
    from fp4moe.ops._runtime import pdl_kwargs
    from fp4moe.ops.moe import MMAHeights, fp4_moe_experts, mma_moe_config, random_moe_problem

    pdl = bool(pdl_kwargs(torch.device("cuda"))["PDL"])  # SM90+ (and FP4MOE_PDL not 0)
    p = random_moe_problem(64, 64, 8, 2048, 1024, fmt, device="cuda", seed=9)
    heights = MMAHeights(mma_moe_config(1.0), replace(mma_moe_config(8.0), xs=2), 8)
    counts = torch.bincount(p.topk_ids.long().flatten(), minlength=64)
    assert int(((counts > 0) & (counts <= 8)).sum()) and int((counts > 8).sum())  # both classes run
    monkeypatch.setattr(moe_ops, "mma_moe_layer_config", lambda *a: heights)
    real = kernels.fp4_linear_mma_kernel
    modes = []

    class Spy:  # records each launch's PDL mode (_launch imports the kernel at each call)
        def __getitem__(self, grid):
            def launch(*args, **kw):
                modes.append(kw["PDL"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(kernels, "fp4_linear_mma_kernel", Spy())
    args = (p.x, p.w13, p.w2, p.topk_ids, p.topk_weights)
    with tuning(moe=dict(heights_overlap=False)):
        chained = fp4_moe_experts(*args)
    assert 3 not in modes
    with tuning(moe=dict(heights_overlap=True)):
        modes.clear()
        assert torch.equal(fp4_moe_experts(*args), chained)
        assert modes.count(3) == (2 if pdl else 0), modes  # the second class of each GEMM
        out = torch.empty_like(chained)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(4):
                out.copy_(fp4_moe_experts(*args))
        for _ in range(25):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, chained)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,activation,interleaved,per_row,bias", MOE_VARIANTS)
@pytest.mark.parametrize("xs,block_m,T", [(2, 8, 5), (3, 16, 48)])
def test_gpu_moe_decode_with_x_ring(monkeypatch, fmt, activation, interleaved, per_row, bias, xs, block_m, T):
    """Both grouped GEMMs with x through the shared-memory ring (gathered rows in GEMM 1, fused
    SwiGLU or not): the same checks as the register path."""
    from fp4moe.ops import moe_packed as moe_ops

    cfg = MMAConfig(rb=2 if block_m == 16 else 1, warps=4, kh=2 if block_m == 16 else 4, block_m=block_m, xs=xs)
    monkeypatch.setattr(moe_ops, "mma_moe_config", lambda *a: cfg)
    check_moe_layer("fp4_moe_mma", fmt, activation, interleaved, per_row, bias, T, 64, 8, 1024, 512)


def test_classes_overlap_only_after_a_launch(monkeypatch):
    """A GEMM's second class launch runs without waiting for the first only where the first
    launched (a class whose plan holds no tiles launches nothing: the second then follows the kernel
    that wrote its inputs), and only with ``MoETuning.heights_overlap``; the planner asks the same rule
    (``overlaps_previous_class``) of a class's rows."""
    from types import SimpleNamespace

    from fp4moe.ops import moe_packed as moe_ops
    from fp4moe.ops.dispatch import ALL_ROWS
    from fp4moe.ops.moe import MMAHeights, mma_moe_config, overlaps_previous_class

    classes = [rows for _, rows in MMAHeights(mma_moe_config(1.0), mma_moe_config(8.0), 8).classes()]

    def launches(*tiles):
        return [(None, SimpleNamespace(max_tiles=t), rows) for t, rows in zip(tiles, classes)]

    assert not moe_ops._overlaps([(None, SimpleNamespace(max_tiles=3), None)], 0)
    assert not moe_ops._overlaps(launches(3, 4), 0) and moe_ops._overlaps(launches(3, 4), 1)
    assert not moe_ops._overlaps(launches(0, 4), 1)
    assert [overlaps_previous_class(r) for r in (None, (0, 8), (8, ALL_ROWS))] == [False, False, True]
    with tuning(moe=dict(heights_overlap=False)):
        assert not moe_ops._overlaps(launches(3, 4), 1) and not overlaps_previous_class((8, ALL_ROWS))


@pytest.mark.parametrize("heights", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fmt,activation,interleaved,per_row,bias", MOE_VARIANTS)
def test_moe_mma_pipeline_with_emulated_gemm(monkeypatch, fmt, activation, interleaved, per_row, bias, fused,
                                             heights):
    """The MoE decode pipeline around the grouped kernel (plan, partials epilogue with globals, bias,
    activation, routing weight and scatter, combine) on CPU: the Gluon GEMM is replaced by a torch
    emulation of its contract (partials of the packed weights, which carry no global scale); with
    ``fused`` GEMM 1's SiLU layers take the fused-epilogue launch, emulated as partials followed by
    the epilogue kernel (the contract ``launch_grouped_mma_swiglu`` states), which checks the
    arguments the pipeline passes it. ``heights``: ``MMAHeights``, each GEMM as two launches over
    the experts of at most 2 rows (8-row tiles) and the others (16-row tiles), into one h and one
    partial-sum tensor."""
    from fp4moe.ops import mma_sync
    from fp4moe.ops import moe_packed as moe_ops
    from fp4moe.ops.dispatch import dispatch
    from fp4moe.ops.moe import (
        MMAHeights,
        fp4_moe_reference,
        mma_moe_config,
        mma_packed_experts,
        packed_dispatch,
        random_moe_problem,
    )
    from fp4moe.ops.moe_packed import _run_mma

    T, E, k, H, I = 5, 6, 3, 64, 32
    p = random_moe_problem(T, E, k, H, I, fmt.name, device="cpu", seed=7, per_row=per_row, bias=bias, dropped=(2, 1))
    x, w13, w2, ids, wts, b13, b2 = p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, p.w13_bias, p.w2_bias
    tiles_seen = []
    first_tiles = []  # max_tiles of each GEMM's first class launch

    def emulated(x2, p, n_per_expert, plan, config, *, gather, plan_ready=False, out=None, independent=False,
                 dtype=torch.float32):
        # GEMM 2 (no gather) runs two kernels after dispatch: it may read the plan before its PDL wait
        assert plan_ready == (not gather) and plan.block_m == config.block_m
        # GEMM 1's partial sums are fp32; GEMM 2's pair rows bf16 (a bf16 layer, K not split)
        assert dtype == (torch.float32 if gather else torch.bfloat16), (gather, dtype)
        # only a second class's launch (into the first's output) may run without waiting for the first,
        # and only where the first launched anything
        if out is None:
            first_tiles.append(plan.max_tiles)
        assert independent == (out is not None and current_tuning().moe.heights_overlap and first_tiles[-1] > 0)
        w = dequantize(unpack_mma(p), torch.float32).reshape(-1, n_per_expert, x2.shape[1])
        R = plan.sorted_pair.shape[0]
        # rows no tile covers must never be read (a second class's launch fills its own rows)
        part = torch.full((1, R, n_per_expert), float("nan"), dtype=dtype) if out is None else out
        tiles_seen.append((config.block_m, int(plan.n_tiles)))
        for t in range(plan.max_tiles):
            e = int(plan.tile_expert[t])
            if e < 0:
                continue
            for r in range(int(plan.tile_start[t]), int(plan.tile_end[t])):
                row = int(plan.sorted_token[r]) if gather else r
                part[0, r] = (w[e] @ x2[row].float()).to(dtype)
        return part

    calls = []

    def emulated_swiglu(x2, p, n_out, plan, config, out, globals_, bias13, independent=False):
        assert independent == (len(calls) == 1 and current_tuning().moe.heights_overlap and calls[0] > 0)
        calls.append(plan.max_tiles)
        wg, mode = globals_
        assert mode == (moe_ops._weight_globals(w13)[1]) and bias13 is b13 and n_out == I
        part = emulated(x2, p, 2 * n_out, plan, config, gather=True)
        return moe_ops.launch_partials_epilogue(part, w13, plan, out, swiglu=1, interleaved=False, scatter=False,
                                                row_weight=None, bias=bias13)

    monkeypatch.setattr(mma_sync, "launch_grouped_mma", emulated)
    monkeypatch.setattr(mma_sync, "launch_grouped_mma_swiglu", emulated_swiglu)
    with tuning(moe=dict(fused_swiglu=fused, fused_swiglu_min_programs_per_sm=0)):  # the CPU's tiny grid
        packed = (mma_packed_experts(w13), mma_packed_experts(w2))
        cfg = MMAHeights(mma_moe_config(1), mma_moe_config(8), 2) if heights else mma_moe_config(T * k / E)

        def no_launch(*a, **kw):
            raise AssertionError("the plan carries the class tile maps: no tile_map launch")

        tile_map = moe_ops.tile_map
        monkeypatch.setattr(moe_ops, "tile_map", no_launch)
        out = _run_mma(x, w13, w2, packed, ids, wts, packed_dispatch(ids, E, cfg), cfg, k, activation, interleaved, b13,
                       b2, None, torch.empty(T, H, dtype=torch.bfloat16))
        ref = fp4_moe_reference(x, w13, w2, ids, wts, activation=activation, interleaved=interleaved,
                                w13_bias=b13, w2_bias=b2).float()
        assert torch.isfinite(out.float()).all()
        assert ((out.float() - ref).abs().max() / ref.abs().max()) < 2e-2
        fused_here = fused and activation == "silu" and not interleaved
        assert len(calls) == (2 if heights else 1) * int(fused_here)
        if heights:  # both classes ran, the short tiles first, in each GEMM
            counts = torch.bincount(ids[ids >= 0].long(), minlength=E)
            small, large = int(((counts > 0) & (counts <= 2)).sum()), int((counts > 2).sum())
            assert small and large, counts
            assert tiles_seen == [(8, small), (16, large)] * 2
            # a plan made without the class maps: a tile_map launch per class, the same layer
            monkeypatch.setattr(moe_ops, "tile_map", tile_map)
            tiles_seen.clear(), first_tiles.clear(), calls.clear()
            again = _run_mma(x, w13, w2, packed, ids, wts, dispatch(ids, E, cfg.block_m), cfg, k, activation,
                             interleaved, b13, b2, None, torch.empty(T, H, dtype=torch.bfloat16))
            assert torch.equal(again, out) and tiles_seen == [(8, small), (16, large)] * 2


@pytest.mark.slow  # cross-compilation or many interpreter runs: .ci/run runs it
def test_fused_swiglu_gemm1_cross_compiles():
    """MoE GEMM 1 with its SiLU epilogue in the kernel (the decode configurations, every global-scale
    mode, bias) compiles for SM80, SM90 and SM120 without spills, on mma.sync, with PDL from SM90."""
    from fp4moe.ops.mma_requests import mma_compile_request
    from fp4moe.ops.moe import mma_moe_config
    from fp4moe.plan.crosscompile import cross_compile

    reqs = [mma_compile_request(mma_moe_config(rows), fmt, cc, 6144, has_bias=bias, grouped=True, gather=True,
                                swiglu=True, wg_mode=mode)
            for cc in (80, 90, 120) for rows in (1, 8)
            for fmt, mode, bias in (("nvfp4", 1, False), ("nvfp4", 2, True), ("mxfp4", 0, False))]
    for q, r in zip(reqs, cross_compile(reqs)):
        assert r.ok, r.error
        assert r.spill_bytes == 0, (q.cc, q.constexprs["BLOCK_M"], r.ptxas_log)
        assert any("mma.sync" in m and "bf16" in m for m in r.mma), r.mma
        assert q.constexprs["SWIGLU"] and q.constexprs["PDL"] == int(q.cc >= 90)


@pytest.mark.gpu
@pytest.mark.parametrize("per_row,bias", [(False, False), (True, True)])
def test_gpu_fused_swiglu_matches_partials_epilogue(monkeypatch, per_row, bias):
    """GEMM 1 with the epilogue in the kernel gives the layer the partial sums + epilogue kernel give
    (the same arithmetic in the same order; contraction into FMAs may differ by an ulp before h's
    bf16 rounding)."""
    from fp4moe import guard
    from fp4moe.ops import mma_sync
    from fp4moe.ops.moe import fp4_moe_experts, random_moe_problem

    p = random_moe_problem(5, 64, 8, 1024, 512, "nvfp4", device="cuda", seed=3, per_row=per_row, bias=bias,
                           dropped=(0, 7))
    kw = dict(w13_bias=p.w13_bias, w2_bias=p.w2_bias)
    with tuning(moe=dict(fused_swiglu_min_programs_per_sm=0)):  # fused at this size too
        launches = []
        launch = mma_sync.launch_grouped_mma_swiglu
        monkeypatch.setattr(mma_sync, "launch_grouped_mma_swiglu",
                            lambda *a, **kw: launches.append(1) or launch(*a, **kw))
        guard.reset()  # the guard probes this variant here (a probe launch, then the layer's)
        fused = fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, **kw).float()
        assert len(launches) == 2 and any("swiglu_fused" in key.kernel for key in guard._checked)
        with tuning(moe=dict(fused_swiglu=False)):
            split = fp4_moe_experts(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, **kw).float()
        assert ((fused - split).abs().max() / split.abs().max()) < 5e-3


def test_pack_follows_in_place_weight_updates():
    """The MMA-order copy is made again after the weight changes in place (``load_state_dict``
    copies into the buffers), for FP4Linear and for stacked experts; unchanged weights keep it."""
    from fp4moe.nn import FP4Linear
    from fp4moe.ops.linear import mma_packed
    from fp4moe.ops.moe import mma_packed_experts
    from fp4moe.quantize import quantize_stacked

    torch.manual_seed(0)
    a = FP4Linear.from_linear(torch.nn.Linear(128, 32), "nvfp4")
    b = FP4Linear.from_linear(torch.nn.Linear(128, 32), "nvfp4")
    p0 = mma_packed(a.weight_fp4)
    assert mma_packed(a.weight_fp4) is p0
    a.load_state_dict(b.state_dict())
    p1 = mma_packed(a.weight_fp4)
    assert p1 is not p0
    got, want = unpack_mma(p1), b.weight_fp4
    assert torch.equal(got.data, want.data) and torch.equal(got.global_scale, want.global_scale)
    w = quantize_stacked(torch.randn(3, 32, 64), "nvfp4")
    e0 = mma_packed_experts(w)
    w.scales.copy_(torch.flip(w.scales, dims=[0]))
    assert mma_packed_experts(w) is not e0
    # a new global scale beside the same codes (a fresh tensor, as many writes as the old: none)
    # is a new pack, found by the tensor's identity, not by its id() that a freed scale can pass on
    from fp4moe.quantize import FP4Tensor

    u = FP4Tensor(a.weight_fp4.data, a.weight_fp4.scales, a.weight_fp4.global_scale.clone() * 2.0,
                  a.weight_fp4.shape, a.weight_fp4.fmt)
    p2 = mma_packed(u)
    assert p2 is not p1 and torch.equal(p2.global_scale, u.global_scale)
    assert mma_packed(u) is p2
    with torch.inference_mode():  # inference tensors count no writes: packed once
        v = quantize(torch.randn(32, 128), "nvfp4")
        assert mma_packed(v) is mma_packed(v)


def test_config_names_parse_back():
    """``MMAConfig.parse`` / ``WgmmaConfig.parse`` invert ``str`` (the names benchmark and sweep
    records carry), and refuse other names."""
    from fp4moe.ops.mma_sync import MMAConfig
    from fp4moe.ops.wgmma import WgmmaConfig

    mma = [MMAConfig(), MMAConfig(rb=2, warps=4, kh=2, block_m=16, split_k=1), MMAConfig(split_k=4, kh=1),
           MMAConfig(rb=1, warps=1, kh=4, block_m=8, kw=4, pdl=2), MMAConfig(rb=4, warps=2, kh=1, kw=8, pdl=1),
           MMAConfig(rb=2, warps=4, kh=2, block_m=16, xs=3), MMAConfig(split_k=2, xs=2),
           MMAConfig(rb=1, warps=1, kh=4, block_m=8, kw=4, pdl=3, xs=2)]
    wgmma = [WgmmaConfig(), WgmmaConfig(block_m=256, warps=8, repeats=1), WgmmaConfig(block_m=64, split_k=4),
             WgmmaConfig(block_m=128, tail_m=32), WgmmaConfig(ws=True, warps=8, block_m=128, repeats=1)]
    for c in mma:
        assert MMAConfig.parse(str(c)) == c, c
    for c in wgmma:
        assert WgmmaConfig.parse(str(c)) == c, c
    for bad in ("mma_n24_m8_k256_w4", "mma_n64_m8_k100_w4", "wgmma_n128_m64", "mma_n64_m8_k256_w4:u", ""):
        with pytest.raises(ValueError, match="not a configuration name"):
            (WgmmaConfig if bad.startswith("wgmma") else MMAConfig).parse(bad)
