"""Opt-in launch paths that no default choice reaches: kept runnable and tested, imported only when a
configuration names them (default code never imports this module).

* The warp-specialized wgmma kernel (``kernels.gemm_ws``, ``WgmmaConfig.ws``): a decode warpgroup
  writes the bf16 weight tile to shared memory for eight MMA warps. It measured slower than the
  register-A kernel (``ops.wgmma``) at every size the heuristic covers, so ``choose_wgmma_config``
  never picks it; tests and the planner may name it.
"""

from __future__ import annotations

import torch

from ..target import get_arch
from ._runtime import arch_kwargs
from .mma_pack import KCHUNK, ROWS, _scale_pairs_per_chunk

#: the warp-specialized kernel's decoded weight tiles in flight and registers per thread of its
#: decode warpgroup (the launch's register cap, ``ws_maxnreg``, fits the SM's registers;
#: ``setmaxnreg`` gives the MMA warps what the decode warpgroup leaves)
WS_A_STAGES = 2
WS_DECODE_REGS = 96
WS_DECODE_WARPS = 4  # the kernel's decode partition (``gl.warp_specialize`` in kernels/gemm_ws.py)


def ws_maxnreg(warps: int) -> int:
    """The register cap under which one program of ``warps`` warps fits an SM90's register file, a
    multiple of 8 as ``setmaxnreg`` counts (12 warps: 168)."""
    return get_arch("sm90").regs_per_sm // (32 * warps) // 8 * 8


def ws_smem_terms(config, fmt) -> list[tuple[str, int, int]]:
    """(name, bytes each, count) of the warp-specialized kernel's explicit shared buffers: the TMA
    ring (activation tile, weight words, scale pairs), the decoded A tiles and the mbarriers
    (``gl.warp_specialize`` adds a little of its own)."""
    nb = config.block_n // ROWS
    return [("activation tile (TMA)", config.block_m * KCHUNK * 2, config.stages),
            ("weight words (TMA)", nb * 32 * 4 * 4, config.stages),
            ("scale pairs (TMA)", nb * _scale_pairs_per_chunk(fmt) * 2, config.stages),
            ("decoded weight tile (bf16)", config.block_n * KCHUNK * 2, WS_A_STAGES),
            ("mbarrier", 8, config.stages + 2 * WS_A_STAGES)]


def ws_compile_request(config, cc: int, common: dict, signature: dict):
    """The warp-specialized kernel's cross-compilation request (``ops.mma_requests.wgmma_compile_request``
    with ``config.ws``, plain linear only, which gives the signature and the constexprs the kernels
    share): its register cap included."""
    from ..target.compile_request import CompileRequest

    return CompileRequest(kernel="fp4moe.kernels.gemm_ws:fp4_gemm_ws_kernel", signature=signature,
                          constexprs=dict(common, A_STAGES=WS_A_STAGES, DECODE_REGS=WS_DECODE_REGS), cc=cc,
                          num_warps=config.warps, divisible_by_16=("out_ptr", "N", "K", "stride_om"),
                          maxnreg=ws_maxnreg(config.warps + WS_DECODE_WARPS))


def launch_ws(grid, w_desc, s_desc, x_desc, rest: tuple, consts: dict, config, out: torch.Tensor) -> None:
    """The warp-specialized kernel's launch for ``ops.wgmma.launch_linear_wgmma`` (``config.ws``; the
    descriptors and the arguments from ``wg_ptr`` on as that launcher builds them)."""
    from ..kernels.gemm_ws import fp4_gemm_ws_kernel

    fp4_gemm_ws_kernel[grid](w_desc, s_desc, x_desc, *rest, A_STAGES=WS_A_STAGES, DECODE_REGS=WS_DECODE_REGS,
                             num_warps=config.warps, maxnreg=ws_maxnreg(config.warps + WS_DECODE_WARPS), **consts,
                             **arch_kwargs(out.device))
