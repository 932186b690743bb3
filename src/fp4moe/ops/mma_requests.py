"""Cross-compilation requests (``fp4moe.target.compile_request``) of the kernels on packed
weights, as their launchers call them: the mma.sync kernel (``ops.mma_sync``) and the wgmma kernel
(``ops.wgmma``). The planner compiles these for any target without a GPU.
"""

from __future__ import annotations

from ..formats import NVFP4, FP4Format
from ..target import get_arch
from .mma_pack import KCHUNK, _scale_pairs_per_chunk
from .mma_sync import MMAConfig, _fit_kw, _split
from .wgmma import WgmmaConfig, _decode_consts, _s_smem_layout, _split_pdl, _w_box_rows, _w_smem_layout, _x_smem_layout

def mma_compile_request(config: MMAConfig, fmt: FP4Format | str, cc: int, K: int, *, has_bias: bool = False,
                        grouped: bool = False, gather: bool = False, swiglu: bool = False, wg_mode: int = 0,
                        plan_ready: bool = False, out_dtype: str = "bf16", order: str = "nibble",
                        independent: bool = False, part_dtype: str = "fp32"):
    """The cross-compilation request (``fp4moe.plan.crosscompile``) of the mma.sync kernel as
    ``launch_linear_mma`` calls it for a weight of K columns (the K step fitted to K as ``_split``),
    or, ``grouped``, as ``launch_grouped_mma`` does (partial sums in ``part_dtype``, "fp32" or
    "bf16", as its ``dtype``; no globals or bias; ``gather`` for MoE GEMM 1, ``plan_ready`` for GEMM
    2), or, ``swiglu``, as ``launch_grouped_mma_swiglu`` does (h, ``wg_mode`` and ``has_bias`` as the
    weight's); ``independent`` as ``launch_grouped_mma``'s (with the x ring). ``out_dtype`` ("bf16"
    or "fp16"): the plain linear's output and bias, or the fused GEMM 1's h (emulated W4A4 keeps x's
    dtype there; the activations themselves are bf16 either way). ``order``: the weight pack's bit order
    (``MMAPackedFP4.order``; the MoE experts' is ``MoETuning.word_order``)."""
    from ..formats import get_format
    from ..kernels.linear_mma import FOLD_E4M3, FOLD_E8M0, decode_asm, scale_asm
    from ..target.compile_request import CompileRequest

    if out_dtype not in ("bf16", "fp16"):
        raise ValueError(f"out_dtype: expected 'bf16' or 'fp16', got {out_dtype!r}")
    if part_dtype not in ("fp32", "bf16"):
        raise ValueError(f"part_dtype: expected 'fp32' or 'bf16', got {part_dtype!r}")
    mx = get_format(fmt) is not NVFP4
    chunks = -(-K // KCHUNK)
    # K_X is x's K, a multiple of the format's block (16 or 32): the runtime specialises it, which lets
    # the masked x loads of a K padded to the 64-K chunk stay 16-byte vectors (without it: 230 registers)
    divisible = ("wq_ptr", "sc_ptr", "x_ptr", "y_ptr", "N", "K", "K_X", "stride_xm", "stride_ym")
    if config.kw > 1:
        if grouped:
            raise ValueError("config.kw: the in-program K split is for the plain linear, not grouped GEMMs")
        kh, kw = _fit_kw(config, chunks)
        signature = {"wq_ptr": "*i32", "sc_ptr": "*i16", "x_ptr": "*bf16", "wg_ptr": "*fp32",
                     "bias_ptr": f"*{out_dtype}", "y_ptr": f"*{out_dtype}", "M": "i32", "N": "i32", "K": "i32",
                     "K_X": "i32", "stride_xm": "i32", "stride_ym": "i32", "k_chunks_per_slice": "i32"}
        constexprs = dict(RB=config.rb, WARPS=config.warps, KW=kw, KH=kh, BLOCK_M=config.block_m, MXFP4=mx,
                          HAS_WG=not mx, HAS_BIAS=has_bias, FOLD=FOLD_E8M0 if mx else FOLD_E4M3, DECODE=decode_asm(order),
                          SCALE=scale_asm(mx),
                          X_LAYOUT={"layout": "fp4moe.kernels.linear_mma:x_layout_kw",
                                    "args": [config.block_m, 1 if config.xc else kh, config.warps, kw]},
                          EVEN_K=chunks * KCHUNK == K, PDL=config.pdl if get_arch(cc).has_pdl else 0,
                          X_STAGES=config.xs if chunks * KCHUNK == K else 0, XC=config.xc, XA=config.xa,
                          PF=config.pf if get_arch(cc).has_tma else 0)
        return CompileRequest(kernel="fp4moe.kernels.linear_mma:fp4_linear_mma_kw_kernel", signature=signature,
                              constexprs=constexprs, cc=cc, num_warps=config.warps * kw, num_stages=1,
                              divisible_by_16=divisible)
    kh, split, _ = _split(config, chunks)
    signature = {"wq_ptr": "*i32", "sc_ptr": "*i16", "x_ptr": "*bf16", "wg_ptr": "*fp32",
                 "bias_ptr": "*bf16" if grouped else f"*{out_dtype}",
                 "y_ptr": (f"*{part_dtype}" if grouped else "*fp32") if (split > 1 or grouped) and not swiglu
                 else f"*{out_dtype}", "tile_expert_ptr": "*i32",
                 "tile_start_ptr": "*i32",
                 "tile_end_ptr": "*i32", "row_x_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "K_X": "i32",
                 "stride_xm": "i32", "stride_ym": "i32", "k_chunks_per_split": "i32", "stride_ge": "i32",
                 "stride_be": "i32"}
    constexprs = dict(RB=config.rb, WARPS=config.warps, KH=kh, BLOCK_M=config.block_m, MXFP4=mx,
                      HAS_WG=not mx and not grouped, HAS_BIAS=has_bias and (swiglu or not grouped), SPLIT_K=split,
                      FOLD=FOLD_E8M0 if mx else FOLD_E4M3, DECODE=decode_asm(order),
                      SCALE=scale_asm(mx),
                      X_LAYOUT={"layout": "fp4moe.kernels.linear_mma:x_layout",
                                "args": [config.block_m, kh, config.warps]},
                      EVEN_K=chunks * KCHUNK == K, GROUPED=grouped, GATHER=grouped and gather,
                      PDL=(3 if independent and config.xs and chunks * KCHUNK == K else 2 if plan_ready else 1)
                      if grouped and get_arch(cc).has_pdl else 0,
                      SWIGLU=swiglu,
                      WG_MODE=wg_mode if swiglu else 0, X_STAGES=config.xs if chunks * KCHUNK == K else 0)
    return CompileRequest(kernel="fp4moe.kernels.linear_mma:fp4_linear_mma_kernel", signature=signature,
                          constexprs=constexprs, cc=cc, num_warps=config.warps, num_stages=1,
                          divisible_by_16=divisible)


def _epilogue_signature(out_type: str, bias_type: str = "*bf16") -> dict[str, str]:
    """Signature types of the wgmma kernels' arguments from ``wg_ptr`` on (the epilogue's, the
    dispatch plan's and the sizes), shared by both kernels."""
    return {"wg_ptr": "*fp32", "bias_ptr": bias_type, "out_ptr": out_type, "tile_expert_ptr": "*i32",
            "tile_start_ptr": "*i32", "tile_end_ptr": "*i32", "row_out_ptr": "*i32", "row_w_ptr": "*fp32",
            "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "stride_ge": "i32", "stride_be": "i32",
            "n_tiles_m": "i32"}


def _x_desc_type(block_m: int) -> str:
    """The Triton signature type of ``_x_desc``'s descriptor (what the runtime would specialise)."""
    return f"tensordesc<bf16[{block_m}, {KCHUNK}],{_x_smem_layout()!r}>"


def wgmma_compile_request(config: WgmmaConfig, fmt: FP4Format | str, cc: int, *, gemm: str = "linear",
                          has_bias: bool = False, wg_mode: int | None = None, out_dtype: str = "bf16",
                          out_mma_order: bool | None = None, order: str = "nibble"):
    """The cross-compilation request (``fp4moe.plan.crosscompile``) of the wgmma kernel as the
    launchers call it: ``gemm`` "linear" (plain), "gemm1" (MoE GEMM 1: gather pass, SwiGLU, h in
    MMA order) or "gemm2" (MoE GEMM 2: routing weight, scatter to bf16 pair rows); with ``config.ws`` the
    warp-specialized kernel (plain linear only), register cap included. ``wg_mode``: global scales
    (default: one per weight for an NVFP4 linear, per expert for NVFP4 MoE, none for MXFP4).
    ``out_dtype`` ("bf16" or "fp16"): the plain linear's output and bias, or GEMM 1's h (emulated
    W4A4 keeps x's dtype there); ``out_mma_order``: GEMM 1 writes h in GEMM 2's MMA K order (the
    default; emulated W4A4 writes it in K order for its re-quantization); ``order``: the weight
    pack's bit order, as ``mma_compile_request``'s."""
    from ..target.compile_request import CompileRequest

    if gemm not in ("linear", "gemm1", "gemm2"):
        raise ValueError(f"gemm: expected 'linear', 'gemm1' or 'gemm2', got {gemm!r}")
    consts = _decode_consts(fmt, order)
    if wg_mode is None:
        wg_mode = 0 if consts["MXFP4"] else 1
    if gemm == "linear" and config.tail_m:
        raise ValueError(f"config: tail_m is for the MoE GEMMs, got {config} for the plain linear")
    if gemm != "linear" and config.persistent:
        raise ValueError(f"config: persistent is for the plain linear, got {config} for {gemm}")
    if out_dtype not in ("bf16", "fp16") or (out_dtype != "bf16" and gemm == "gemm2"):
        raise ValueError(f"out_dtype: expected 'bf16' or 'fp16' (GEMM 2 writes bf16 pair rows), got {out_dtype!r} "
                         f"for {gemm}")
    if out_mma_order is None:
        out_mma_order = gemm == "gemm1"
    elif out_mma_order and gemm != "gemm1":
        raise ValueError(f"out_mma_order: only GEMM 1 writes its output in MMA K order, got {gemm}")
    common = dict(BLOCK_M=config.block_m, WARPS=config.warps, STAGES=config.stages, WG_MODE=wg_mode,
                  HAS_BIAS=has_bias, GROUPED=gemm != "linear", SCATTER=gemm == "gemm2", HAS_RW=gemm == "gemm2",
                  GROUP_M=config.group_m if gemm == "linear" else 1, **consts)
    w_rows = _w_box_rows(config, gemm == "gemm1")
    w_type = f"tensordesc<i32[{w_rows}, 128],{_w_smem_layout()!r}>"
    if config.ws:
        if gemm != "linear":
            raise ValueError(f"config: the warp-specialized kernel runs the plain linear only, got gemm={gemm!r}")
        from .experimental import ws_compile_request

        signature = {"w_desc": w_type, "s_desc": _s_desc_type(w_rows, fmt), "x_desc": _x_desc_type(config.block_m),
                     **_epilogue_signature(f"*{out_dtype}", f"*{out_dtype}")}
        return ws_compile_request(config, cc, common, signature)
    if config.split_k > 1:
        if gemm != "linear":
            raise ValueError(f"config: split_k is for the plain linear, got gemm={gemm!r}")
        common["HAS_BIAS"] = False  # the reduction adds it
    signature = {"w_desc": w_type, "s_desc": _s_desc_type(w_rows, fmt), "x_desc": _x_desc_type(config.block_m),
                 "x_tail_desc": _x_desc_type(config.tail_m or config.block_m),
                 **_epilogue_signature("*fp32" if config.split_k > 1 else f"*{out_dtype}",
                                       f"*{out_dtype}" if gemm == "linear" else "*bf16"),
                 "k_per_split": "i32"}
    constexprs = dict(common, REPEATS=config.repeats, SWIGLU=1 if gemm == "gemm1" else 0, ALPHA=0.0, LIMIT=0.0,
                      OUT_MMA_ORDER=out_mma_order, TAIL_M=config.tail_m, PERSISTENT=config.persistent,
                      MERGE_TAIL=config.merge_tail,  # PDL as launch_linear_wgmma (x passed into MMA order first)
                      PDL=2 if _split_pdl(config.split_k, get_arch(cc).has_pdl) else 0)
    return CompileRequest(kernel="fp4moe.kernels.gemm_wgmma:fp4_gemm_wgmma_kernel", signature=signature,
                          constexprs=constexprs, cc=cc, num_warps=config.warps, num_stages=config.stages,
                          divisible_by_16=("out_ptr", "N", "K", "stride_om"))


def _s_desc_type(rows: int, fmt: FP4Format | str) -> str:
    """The Triton signature type of ``_s_desc``'s descriptor for boxes of ``rows`` 16-row blocks."""
    return f"tensordesc<i16[{rows}, {_scale_pairs_per_chunk(fmt)}],{_s_smem_layout()!r}>"
