"""Shared memory a kernel configuration needs, modelled term by term (no compiler, no GPU).

The tuner prunes with this model before anything is compiled, so it must agree with Triton's
``metadata.shared``; ``tests/test_plan.py`` checks it against cross-compiled kernels and
``tools/plan/calibrate_smem.py`` re-measures it on a grid. How it was derived (Triton 3.6,
``fp4_linear_kernel``): 2,874 configurations cross-compiled for cc 80, 89, 90, 100 and 120 (both
paths of each, NVFP4 and MXFP4, bf16 and fp16, split K), reading the explicit buffers from the
TTGIR (``ttg.local_alloc``), the offsets from Triton's ``allocate-shared-memory`` pass, and the
scratch of every ``ttg.convert_layout`` by allocating it alone in a one-op module. The terms:

1. **Pipelined operand tiles** (``num_stages >= 2``). The software pipeliner turns the loads
   that feed the MMA into ``cp.async`` copies into a ring of buffers that live for the whole
   loop: ``num_stages - 1`` buffers of the weight tile and of the activation tile. An MMA that
   reads its operand straight from shared memory while the next copy lands keeps one more
   buffer of it: wgmma (SM90) and tcgen05 (SM100) hold ``num_stages`` buffers of the bf16
   activation tile. A load is pipelined only if every thread copies at least 4 contiguous bytes
   (the smallest ``cp.async``): a 16-token FP4 activation tile of 512 B is not, with 8 warps.
   Scale tiles are never pipelined (their loads do not feed the MMA directly).
2. **MMA operand staging**: an operand that is not pipelined but must sit in shared memory
   (``ttg.local_alloc``): the bf16 activation tile for ``ldmatrix`` (mma.sync), for wgmma and
   tcgen05; the packed FP4 weight tile of SM120's block-scaled mma.sync; both FP4 tiles of
   tcgen05; the decoded activations of the emulated path on SM90 (wgmma's B operand). The
   mma.sync and wgmma staging lives only around the MMA and shares memory with the layout
   conversions; the block-scaled and tcgen05 operands live across them (added).
3. **Layout-conversion scratch** (``ttg.convert_layout`` through shared memory): the scale
   tiles into the layout of the in-register decoder or of the block-scaled MMA, a
   non-pipelined operand into the MMA layout, and the accumulator into the store layout. A
   conversion's scratch is its tile divided by the number of rounds Triton splits it into,
   which depends on the register layouts Triton picks; the model uses ``min(tile, c * threads)``
   with a per-thread budget ``c`` fitted per MMA family and conversion
   (``_SCRATCH_PER_THREAD``), a byte cap where that fits better (``_SCRATCH_MAX_BYTES``), and
   measured tables for the two conversions that follow neither (``_TCGEN05_DECODED_WEIGHT``,
   ``_EPILOGUE_16BIT``). Scratch lives for one operation: the conversions of one loop
   iteration reuse the same bytes, so the largest counts.
4. **The epilogue** reuses the loop's memory (the ring is freed after the loop), so the total
   is ``max(mainloop, epilogue)``.
5. **Barriers and alignment**: 8 bytes per mbarrier (tcgen05 commit barriers; one per buffer
   of the pipelined activation ring on SM100 W4A16). Every tile here is a multiple of 128 B, so
   alignment padding appears only next to barriers (the compiled total is then 8 to 16 B off
   the model, either way) and has no term of its own.

Fit: 2,686 of the 2,874 configurations exact to 16 B, 2,850 within the tolerance of
``max(5%, 1 KiB)``; the 24 outside are all over-estimates (the model is never below the
compiler by more than the tolerance), by 1.5 to 16 KiB, on tiles without a real pipeline
(``num_stages`` 1-2 with ``block_m >= 64``). Within the planner's candidate space (1,779 of
them) 4 fall outside, all over-estimates of small configurations far below every limit.
The same rules give the quantizer's single conversion (``quantize_smem``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .catalogue import Arch

__all__ = ["SmemBreakdown", "SmemTerm", "linear_family", "linear_smem", "moe_smem", "quantize_smem"]

Phase = Literal["mainloop", "epilogue"]


@dataclass(frozen=True)
class SmemTerm:
    """One part of a kernel's shared memory: ``count`` buffers of ``each`` bytes."""

    name: str
    each: int
    count: int = 1
    phase: Phase = "mainloop"
    source: str = ""  # where it comes from, in Triton's terms

    @property
    def bytes(self) -> int:
        return self.each * self.count

    def __str__(self) -> str:
        size = f"{self.count} x {self.each:,} B" if self.count != 1 else f"{self.each:,} B"
        return f"{self.name} {size}"


@dataclass(frozen=True)
class SmemBreakdown:
    """Shared memory of one configuration: the terms, and the total the chip must provide.

    Terms of the main loop are live together; the epilogue reuses the same memory, so
    ``total = max(mainloop, epilogue)``.
    """

    terms: tuple[SmemTerm, ...]

    @property
    def mainloop(self) -> int:
        return sum(t.bytes for t in self.terms if t.phase == "mainloop")

    @property
    def epilogue(self) -> int:
        return sum(t.bytes for t in self.terms if t.phase == "epilogue")

    @property
    def total(self) -> int:
        return max(self.mainloop, self.epilogue)

    def describe(self) -> str:
        """One line: ``weight tile 2 x 8,192 B + ... = 50,176 B (epilogue 16,384 B)``."""
        main = [t for t in self.terms if t.phase == "mainloop" and t.bytes]
        text = " + ".join(str(t) for t in main) or "nothing"
        text += f" = {self.mainloop:,} B"
        if self.epilogue:
            text += f"; epilogue {self.epilogue:,} B (reuses the main loop's memory)"
        return text

    def as_dict(self) -> dict:
        return {
            "total": self.total,
            "mainloop": self.mainloop,
            "epilogue": self.epilogue,
            "terms": [{"name": t.name, "bytes": t.bytes, "each": t.each, "count": t.count, "phase": t.phase,
                       "source": t.source} for t in self.terms],
        }


# ------------------------------------------------------------------------------------------
# fp4_linear_kernel

Family = Literal["mma_v2", "wgmma", "tcgen05_bf16", "mma_fp4", "tcgen05_fp4"]

#: Fitted scratch budgets, bytes per thread, of the layout conversions through shared memory:
#: scratch = min(whole tile, budget * 32 * num_warps); None: the whole tile; 0: converted in
#: registers (warp shuffles), no scratch. Fitted to the cross-compiled sweep (module docstring);
#: "_sm80" is SM80-SM89, whose accumulator-to-store conversion cannot use stmatrix.
_SCRATCH_PER_THREAD: dict[tuple[str, str], int | None] = {
    # weight tile (packed FP4, [BLOCK_N, BLOCK_K/2]) into the decoder's layout, num_stages = 1
    ("mma_v2", "weight"): None, ("wgmma", "weight"): 64, ("mma_fp4", "weight"): 64,
    # weight scales ([BLOCK_N, BLOCK_K/GROUP]) into the decoder's or the MMA's layout
    ("mma_v2", "weight_scales"): None, ("wgmma", "weight_scales"): 8, ("mma_fp4", "weight_scales"): None,
    ("tcgen05_fp4", "weight_scales"): None,
    # FP4 activations ([BLOCK_M, BLOCK_K/2]) into the decoder's / MMA's layout when not pipelined
    ("mma_v2", "activation"): 128, ("wgmma", "activation"): 0, ("mma_fp4", "activation"): 128,
    # activation scales ([BLOCK_M, BLOCK_K/16])
    ("mma_v2", "activation_scales"): None, ("wgmma", "activation_scales"): None,
    ("tcgen05_fp4", "activation_scales"): 4,
    # decoded bf16 weights ([BLOCK_N, BLOCK_K]) into tcgen05's operand layout (SM100 W4A16, 1 stage)
    ("tcgen05_bf16", "decoded_weight"): 32,
    # weight scales broadcast to [BLOCK_N, BLOCK_K/GROUP, 1] bf16 (SM100 W4A16, pipelined)
    ("tcgen05_bf16", "weight_scales"): None,
    # accumulator ([BLOCK_N, BLOCK_M]) into the store layout: bf16/fp16 output (split_k = 1) ...
    ("mma_v2_sm80", "epilogue"): 64, ("mma_v2", "epilogue"): 16, ("wgmma", "epilogue"): 16,
    ("mma_fp4", "epilogue"): 16, ("tcgen05_bf16", "epilogue"): 16, ("tcgen05_fp4", "epilogue"): 64,
    # ... and fp32 partial sums (split_k > 1)
    ("mma_v2_sm80", "epilogue_fp32"): None, ("mma_v2", "epilogue_fp32"): None, ("wgmma", "epilogue_fp32"): 128,
    ("mma_fp4", "epilogue_fp32"): None, ("tcgen05_bf16", "epilogue_fp32"): 32, ("tcgen05_fp4", "epilogue_fp32"): 32,
}


#: Measured scratch of one conversion that follows no per-thread budget: the decoded bf16 weight
#: tile [BLOCK_N, BLOCK_K] into tcgen05's operand layout (SM100 W4A16 without a pipeline), by
#: (BLOCK_N, BLOCK_K, num_warps); it does not depend on BLOCK_M. Triton 3.6, cc 100.
_TCGEN05_DECODED_WEIGHT = {
    (64, 64, 4): 4096, (64, 64, 8): 4096, (64, 128, 4): 2048, (64, 128, 8): 8192, (64, 256, 4): 4096,
    (64, 256, 8): 4096, (128, 64, 4): 2048, (128, 64, 8): 8192, (128, 128, 4): 4096, (128, 128, 8): 4096,
    (128, 256, 4): 8192, (128, 256, 8): 8192,
}


#: Measured scratch of the accumulator-to-store conversion with a 16-bit output (split_k = 1),
#: by (BLOCK_N, BLOCK_M, num_warps), where no per-thread budget fits: SM80-SM89 (no stmatrix) and
#: tcgen05 (the accumulator comes out of tensor memory one row per thread). The same for bf16 and
#: fp16, for every path, and for cc 80/89 alike. Triton 3.6.
_EPILOGUE_16BIT = {
    "mma_v2_sm80": {
        (64, 16, 4): 2048, (64, 16, 8): 2048, (64, 32, 4): 4096, (64, 32, 8): 4096, (64, 64, 4): 8192,
        (64, 64, 8): 8192, (64, 128, 4): 8192, (64, 128, 8): 16384, (64, 256, 4): 8192, (64, 256, 8): 16384,
        (128, 16, 4): 4096, (128, 16, 8): 4096, (128, 32, 4): 8192, (128, 32, 8): 8192, (128, 64, 4): 4096,
        (128, 64, 8): 16384, (128, 128, 4): 4096, (128, 128, 8): 8192, (128, 256, 4): 8192, (128, 256, 8): 8192,
    },
    "tcgen05": {
        (64, 16, 4): 2048, (64, 16, 8): 2048, (64, 32, 4): 4096, (64, 32, 8): 4096, (64, 64, 4): 8192,
        (64, 64, 8): 8192, (64, 128, 4): 8192, (64, 128, 8): 16384, (64, 256, 4): 8192, (64, 256, 8): 32768,
        (128, 16, 4): 4096, (128, 16, 8): 4096, (128, 32, 4): 4096, (128, 32, 8): 8192, (128, 64, 4): 4096,
        (128, 64, 8): 16384, (128, 128, 4): 4096, (128, 128, 8): 16384, (128, 256, 4): 4096, (128, 256, 8): 16384,
    },
}


#: Conversions whose scratch is capped in bytes rather than per thread: the activation scales of
#: SM120's block-scaled MMA are converted in rounds of at most 2 KiB, whatever the warps.
_SCRATCH_MAX_BYTES: dict[tuple[str, str], int] = {("mma_fp4", "activation_scales"): 2048}


def _scratch(family: str, what: str, tile: int, threads: int) -> int:
    if (family, what) in _SCRATCH_MAX_BYTES:
        return min(tile, _SCRATCH_MAX_BYTES[(family, what)])
    budget = _SCRATCH_PER_THREAD.get((family, what))
    if budget is None:
        return tile
    return min(tile, budget * threads)


def linear_family(path: str, arch: Arch) -> Family:
    """Which MMA the linear kernel's ``path`` compiles to on ``arch``."""
    if path == "w4a4_native":
        if arch.fp4_mma == "tcgen05":
            return "tcgen05_fp4"
        if arch.fp4_mma == "mma_sync_block_scaled":
            return "mma_fp4"
        raise ValueError(f"linear_family: path 'w4a4_native' needs native FP4 MMA; {arch.name} has none")
    if arch.bf16_mma == "tcgen05":
        return "tcgen05_bf16"
    if arch.bf16_mma == "wgmma":
        return "wgmma"
    return "mma_v2"


def linear_smem(block_n: int, block_m: int, block_k: int, num_warps: int, num_stages: int, split_k: int = 1, *,
                path: str, arch: Arch, group: int = 16, x_dtype: str = "bf16") -> SmemBreakdown:
    """Shared memory of ``fp4_linear_kernel`` for one tile configuration on ``arch``.

    ``group``: the weight format's scale block (16 NVFP4, 32 MXFP4); ``x_dtype``: "bf16" or
    "fp16" activations (W4A16; fp16 takes the portable decoder instead of the inline-PTX one).
    """
    if x_dtype not in ("bf16", "fp16"):
        raise ValueError(f"linear_smem: x_dtype: expected 'bf16' or 'fp16', got {x_dtype!r}")
    x_bytes = 2
    fast_decode = path == "w4a4_emulated" or (path == "w4a16" and x_dtype == "bf16")
    family = linear_family(path, arch)
    n, m, k, s = block_n, block_m, block_k, num_stages
    threads = 32 * num_warps
    w4a16 = path == "w4a16"
    weight = n * k // 2  # packed FP4 weight tile
    weight_scales = n * k // group
    act = k * m * x_bytes if w4a16 else m * k // 2  # [BLOCK_K, BLOCK_M] bf16 or [BLOCK_M, BLOCK_K/2] FP4
    act_scales = 0 if w4a16 else m * k // 16
    act_name = "activation tile (bf16)" if w4a16 else "activation tile (FP4)"
    pipelined = s >= 2
    # cp.async moves 4, 8 or 16 bytes per thread; a tile with fewer bytes per thread stays a plain load
    act_pipelined = pipelined and (w4a16 or act // threads >= 4)
    terms: list[SmemTerm] = []
    scratch: dict[str, int] = {}  # conversions of the main loop: one at a time, the largest counts
    sequential_staging = 0  # staging that lives only around the MMA, between the conversions

    ring = "cp.async ring of the software pipeliner (num_stages - 1 buffers)"
    if family == "tcgen05_fp4":
        # both FP4 operands must sit in shared memory: a ring when pipelined, else one buffer
        copies = max(1, s - 1)
        terms.append(SmemTerm("weight tile (FP4)", weight, copies, source="tcgen05 operand A: " + ring))
        if act_pipelined or not pipelined:
            terms.append(SmemTerm(act_name, act, copies, source="tcgen05 operand B: " + ring))
        else:
            terms.append(SmemTerm(act_name + ", not pipelined (< 4 B per thread)", act,
                                  source="tcgen05 operand B staging (ttg.local_alloc)"))
        terms.append(SmemTerm("mbarrier", 8, source="tcgen05.commit completion barrier"))
        scratch["weight scales"] = _scratch(family, "weight_scales", weight_scales, threads)
        scratch["activation scales"] = _scratch(family, "activation_scales", act_scales, threads)
    else:
        if pipelined:
            terms.append(SmemTerm("weight tile (FP4)", weight, s - 1, source=ring))
        elif family == "mma_fp4":
            terms.append(SmemTerm("weight tile (FP4)", weight,
                                  source="block-scaled mma.sync operand A staging (ttg.local_alloc)"))
        else:
            scratch["weight tile"] = _scratch(family, "weight", weight, threads) if family != "tcgen05_bf16" else 0
        if w4a16:
            if pipelined:
                extra = family in ("wgmma", "tcgen05_bf16")
                terms.append(SmemTerm(act_name, act, s if extra else s - 1,
                                      source=ring + (" + 1: the asynchronous MMA reads the oldest buffer"
                                                     if extra else "")))
            elif family == "tcgen05_bf16":
                terms.append(SmemTerm(act_name, act, source="tcgen05 operand B staging (ttg.local_alloc)"))
            else:
                sequential_staging = act  # ldmatrix (mma.sync) / wgmma operand B staging
        else:
            if act_pipelined:
                terms.append(SmemTerm(act_name, act, s - 1, source=ring))
            elif family == "mma_fp4" or (family == "mma_v2" and k > 64):
                # mma_v2 with 64-wide K: 32-byte rows land in the decoder's layout without scratch
                scratch["activation tile"] = _scratch(family, "activation", act, threads)
            scratch["activation scales"] = _scratch(family, "activation_scales", act_scales, threads)
            if family == "wgmma":  # decoded activations [BLOCK_M, BLOCK_K] bf16: wgmma's operand B
                sequential_staging = m * k * 2
        if family == "tcgen05_bf16":
            if pipelined:
                terms.append(SmemTerm("mbarrier", 8, 2, source="tcgen05 barriers of the activation ring"))
                # the scales broadcast to [BLOCK_N, BLOCK_K/GROUP, 1]: bf16 for the inline-PTX decoder,
                # fp32 for the portable one (fp16 activations)
                scale_bytes = 2 if fast_decode else 4
                scratch["weight scales"] = _scratch(family, "weight_scales", weight_scales * scale_bytes, threads)
            else:
                terms.append(SmemTerm("mbarrier", 8, source="tcgen05.commit completion barrier"))
                scratch["decoded weight"] = _TCGEN05_DECODED_WEIGHT.get(
                    (n, k, num_warps), _scratch(family, "decoded_weight", n * k * 2, threads))
        else:
            scratch["weight scales"] = _scratch(family, "weight_scales", weight_scales, threads)

    largest = max(scratch.items(), key=lambda kv: kv[1], default=("", 0))
    if sequential_staging >= largest[1]:
        if sequential_staging:
            source = "MMA operand staging (ttg.local_alloc), sharing memory with the layout conversions"
            terms.append(SmemTerm("activation operand staging" if family != "wgmma" or w4a16
                                  else "decoded activations (wgmma operand B)", sequential_staging, source=source))
    elif largest[1]:
        others = ", ".join(f"{name} {size:,} B" for name, size in scratch.items() if name != largest[0])
        terms.append(SmemTerm(f"layout conversion of the {largest[0]}", largest[1],
                              source="ttg.convert_layout scratch, the largest of the loop's conversions"
                              + (f" (others: {others})" if others else "")))

    out_bytes = 4 if split_k > 1 else x_bytes
    epilogue_family = "mma_v2_sm80" if family == "mma_v2" and arch.capability < (9, 0) else family
    what = "epilogue_fp32" if split_k > 1 else "epilogue"
    epilogue = _scratch(epilogue_family, what, n * m * out_bytes, threads)
    table = _EPILOGUE_16BIT.get("tcgen05" if family.startswith("tcgen05") else epilogue_family)
    if split_k == 1 and table is not None:
        epilogue = table.get((n, m, num_warps), epilogue)
    terms.append(SmemTerm("accumulator to store layout", epilogue,
                          phase="epilogue", source="ttg.convert_layout scratch after the loop"))
    return SmemBreakdown(tuple(terms))


# ------------------------------------------------------------------------------------------
# nvfp4_quantize_kernel


def quantize_smem(block_m: int, block_k: int, num_warps: int, x_dtype: str = "bf16") -> SmemBreakdown:
    """Shared memory of ``nvfp4_quantize_kernel``. 16-bit inputs: none (each thread loads its 32
    consecutive values as 16-byte vectors and stores its codes and scales itself). fp32 inputs: the
    packed codes, int32 words [BLOCK_M, BLOCK_K/8], are re-laid out through shared memory for their
    stores: BLOCK_M * BLOCK_K / 2 bytes, at least 128 (cross-compiled on cc 80, 90, 100, 120)."""
    del num_warps
    if x_dtype != "fp32":
        return SmemBreakdown(())
    return SmemBreakdown((SmemTerm("packed codes to store layout", max(128, block_m * block_k // 2),
                                   source="ttg.convert_layout of the int32 code words before the store"),))


# ------------------------------------------------------------------------------------------
# moe_gemm_kernel
#
# The grouped GEMM's main loop looks like the linear kernel's (a weight tile of 2 x BLOCK_N rows
# for GEMM 1, gate and up in one MMA; BLOCK_N rows for GEMM 2), but the shared memory does not
# follow ``linear_smem``: the gathered activation rows, the SwiGLU split of the accumulator
# (reshape / permute / split of [2 BLOCK_N, BLOCK_M]) and GEMM 2's fp32 scattered store lay out
# differently, and ``linear_smem`` with the same tile misses the compiled size by more than the
# tolerance (max(5%, 1 KiB)) on 431 of the 864 cc 90 / 120 configurations. So the model is
# *measured*: every configuration of the planner's grid (block_n 32/64/128 x block_m 16/64/128 x block_k 64/128/256 x warps 4/8 x
# stages 1/3; on SM100 W4A4 block_n 128 only) cross-compiled with Triton 3.6 for cc 80 (W4A16),
# 90 (W4A16, W4A4 emulated), 100 (W4A16, W4A4 native) and 120 (W4A16, W4A4 native), both GEMMs,
# NVFP4 weights and bf16 activations, as the launcher compiles them (``ops.moe.compile_request``).
# Each entry splits ``metadata.shared`` in two terms:
#
# * operand buffers: the explicit shared buffers of the TTGIR (``ttg.local_alloc``: the cp.async
#   rings of num_stages - 1 weight / activation tiles when pipelined, the MMA's operand staging
#   when not: wgmma's and the block-scaled mma.sync's operands, tcgen05's both operands);
# * the rest: layout-conversion scratch of the main loop (scales into the MMA's or the
#   decoder's layout, FP4 activations into the decoder's) or, when larger, of the epilogue (the
#   SwiGLU split and the store of bf16 h, GEMM 2's fp32 pair rows: up to the whole
#   [BLOCK_N, BLOCK_M] fp32 tile), which reuses the main loop's memory.
#
# Agreement on the measured grid is exact by construction (0 B); cc 86/87/89 use cc 80's numbers,
# cc 103 cc 100's and cc 121 cc 120's (the same MMA and pass pipeline). Configurations outside
# the grid, other targets or paths (W4A4 emulated on SM80) take ``_moe_smem_bound``: an upper
# bound (on all 1,368 measured configurations never below the compiled size, up to 14x above),
# so the planner stays safe where nothing was measured. MXFP4 weights (scales per 32 instead of
# 16) and fp16 activations (the portable decoder) reuse the NVFP4 / bf16 numbers: on a sample of
# 128 such configurations (every fifth candidate at GLM-5 TP8 prefill, both GEMMs, cc 90 and 120)
# all within the tolerance and none below the compiled size.
# Regenerate with a grid sweep (cross_compile over the grid, record compiled.shared and the
# summed sizes of compiled.smem_buffers) when the kernel changes.

def _moe_measured_src() -> dict[tuple[int, int, int], str]:
    """The measured table (``moe_smem_measured.json`` beside this file), read once."""
    global _MOE_MEASURED_SRC_CACHE
    if _MOE_MEASURED_SRC_CACHE is None:
        import json
        from pathlib import Path

        raw = json.loads((Path(__file__).with_name("moe_smem_measured.json")).read_text())["tables"]
        _MOE_MEASURED_SRC_CACHE = {tuple(int(v) for v in key.split(",")): value for key, value in raw.items()}
    return _MOE_MEASURED_SRC_CACHE


_MOE_MEASURED_SRC_CACHE: dict[tuple[int, int, int], str] | None = None


_MOE_MEASURED: dict[tuple[int, int, int], dict[tuple[int, int, int, int, int], tuple[int, int]]] = {}


def _moe_measured(cc: int, act: int, gemm: int) -> dict[tuple[int, int, int, int, int], tuple[int, int]]:
    key = (cc, act, gemm)
    if key not in _MOE_MEASURED:
        table = {}
        for item in _moe_measured_src().get(key, "").split():
            cfg, sizes = item.split(":")
            explicit, total = sizes.split("/")
            table[tuple(int(v) for v in cfg.split("."))] = (int(explicit), int(total))
        _MOE_MEASURED[key] = table
    return _MOE_MEASURED[key]


def _moe_measured_cc(arch: Arch) -> int | None:
    """The measured target standing for ``arch``: the same MMA family and Triton pass pipeline."""
    major = arch.capability[0]
    return {8: 80, 9: 90, 10: 100, 12: 120}.get(major)


def _moe_smem_bound(rows: int, block_m: int, block_k: int, num_stages: int, *, act: int,
                    group: int) -> SmemBreakdown:
    """An upper bound where nothing was measured: every operand (weight and activation tiles and
    their scales) in max(1, num_stages) buffers, the decoded bf16 weight (and, W4A4 emulated,
    activation) tiles staged whole, and the epilogue converting the whole fp32 accumulator."""
    w_tile, w_scales = rows * block_k // 2, rows * block_k // group
    a_tile = block_m * block_k * 2 if act == 0 else block_m * block_k // 2
    a_scales = block_m * block_k // 16 if act else 0
    copies = max(1, num_stages)
    terms = [SmemTerm("weight tile (FP4) and scales, bound", w_tile + w_scales, copies,
                      source="upper bound: a buffer per stage (not measured for this target)"),
             SmemTerm("activation tile and scales, bound", a_tile + a_scales, copies,
                      source="upper bound: a buffer per stage (not measured for this target)")]
    if act != 2:
        terms.append(SmemTerm("decoded weight tile (bf16), bound", rows * block_k * 2,
                              source="upper bound: the decoded tile staged whole"))
    if act == 1:
        terms.append(SmemTerm("decoded activation tile (bf16), bound", block_m * block_k * 2,
                              source="upper bound: the decoded tile staged whole"))
    terms.append(SmemTerm("accumulator to store layout, bound", rows * block_m * 4, phase="epilogue",
                          source="upper bound: the whole fp32 accumulator"))
    return SmemBreakdown(tuple(terms))


def moe_smem(block_n: int, block_m: int, block_k: int, num_warps: int, num_stages: int, *, gemm: int, act: int,
             arch: Arch, group: int = 16, x_dtype: str = "bf16") -> SmemBreakdown:
    """Shared memory of ``kernels.moe.moe_gemm_kernel``: GEMM ``gemm`` (1 gate+up with SwiGLU, 2
    down), ``act`` 0 (W4A16), 1 (W4A4 decoded in the kernel) or 2 (W4A4 on native FP4 MMA).

    Measured numbers where the configuration and target were swept (see above), else an upper
    bound. ``group`` and ``x_dtype`` only matter to the bound (the measured numbers are NVFP4 and
    bf16)."""
    if gemm not in (1, 2):
        raise ValueError(f"moe_smem: gemm: expected 1 or 2, got {gemm!r}")
    if act not in (0, 1, 2):
        raise ValueError(f"moe_smem: act: expected 0, 1 or 2, got {act!r}")
    if x_dtype not in ("bf16", "fp16"):
        raise ValueError(f"moe_smem: x_dtype: expected 'bf16' or 'fp16', got {x_dtype!r}")
    rows = 2 * block_n if gemm == 1 else block_n
    cc = _moe_measured_cc(arch)
    entry = _moe_measured(cc, act, gemm).get((block_n, block_m, block_k, num_warps, num_stages)) \
        if cc is not None else None
    if entry is None:
        return _moe_smem_bound(rows, block_m, block_k, num_stages, act=act, group=group)
    explicit, total = entry
    operands = ("cp.async rings (num_stages - 1 weight / activation tiles)" if num_stages >= 2
                else "MMA operand staging (ttg.local_alloc)")
    return SmemBreakdown((
        SmemTerm("operand buffers", explicit, source=f"{operands}; measured on cc {cc}, Triton 3.6"),
        SmemTerm("layout conversions / epilogue", total - explicit,
                 source="ttg.convert_layout scratch of the main loop (scales, FP4 activations) or the epilogue "
                        f"(SwiGLU split, {'bf16 h' if gemm == 1 else 'fp32 pair rows'}), whichever is larger; "
                        f"measured on cc {cc}, Triton 3.6"),
    ))
