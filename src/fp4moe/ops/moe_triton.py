"""The MoE experts on the Triton grouped GEMM (``kernels.moe.moe_gemm_kernel``; any GPU, the
interpreter, native W4A4): its configuration, launchers and compile request, and the epilogue and
combine kernels that the packed paths (``ops.moe_packed``) share. ``ops.moe`` is the public API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..quantize import FP4Tensor
from ._runtime import arch_kwargs, fast_decode, fast_fold, mma_dtype, pdl_kwargs
from .dispatch import DispatchPlan


Activation = Literal["silu", "gpt_oss"]


_SWIGLU = {"silu": 1, "gpt_oss": 2}


@dataclass(frozen=True)
class MoEGemmConfig:
    """Tiles of one grouped GEMM: block_n output columns x block_m rows of one expert per program."""

    block_n: int
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEGemmConfig.{name}: expected a power of two >= 16, got {v}")
        if self.block_k < 64:
            raise ValueError(f"MoEGemmConfig.block_k: expected >= 64, got {self.block_k}")

    def __str__(self) -> str:
        return f"n{self.block_n}_m{self.block_m}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}"


def choose_moe_configs(T: int, top_k: int, n_experts: int, H: int, I: int, *, arch=None,
                       mode: str = "w4a16") -> tuple[MoEGemmConfig, MoEGemmConfig]:
    """(GEMM 1, GEMM 2) configurations. Decode: few rows per expert, so 16-row tiles and narrow
    N tiles that spread each active expert's weights over many programs (the linear kernel's
    decode tile). Prefill: wide tiles. Both share block_m, since one dispatch plan serves both.
    Native W4A4 on tcgen05 (SM100) needs 128 weight rows per MMA: not tuned on silicon."""
    rows_per_expert = T * top_k / n_experts
    if mode == "w4a4" and arch is not None and arch.fp4_mma == "tcgen05":
        bm = 16 if rows_per_expert <= 16 else 128
        cfg = MoEGemmConfig(block_n=128, block_m=bm, block_k=128, num_warps=4 if bm == 16 else 8, num_stages=3)
        return cfg, cfg
    if rows_per_expert <= 16:
        g1 = MoEGemmConfig(block_n=32, block_m=16, block_k=256, num_warps=4, num_stages=1)
        g2 = MoEGemmConfig(block_n=64, block_m=16, block_k=256, num_warps=4, num_stages=1)
    elif rows_per_expert <= 64:
        g1 = MoEGemmConfig(block_n=64, block_m=64, block_k=128, num_warps=4, num_stages=1)
        g2 = MoEGemmConfig(block_n=64, block_m=64, block_k=128, num_warps=4, num_stages=1)
    else:
        g1 = MoEGemmConfig(block_n=64, block_m=128, block_k=64, num_warps=8, num_stages=3)
        g2 = MoEGemmConfig(block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=3)
    return g1, g2


def _weight_globals(w: FP4Tensor) -> tuple[torch.Tensor | None, int]:
    """The kernel's view of a stacked weight's global scales: (None, 0) for MXFP4; ([E], 1) for one
    global (per tensor or per expert [E, 1]); ([E, N], 2) for one per row (checkpoints whose gate
    and up halves were quantized separately). A global that must be broadcast (one per tensor, or
    one row shared by the experts) is expanded once and kept with the global tensor until that is
    written in place: a copy per call would put a kernel between two of the decode chain's."""
    g = w.global_scale
    if g is None:
        return None, 0
    E, N = w.shape[0], w.shape[1]
    if g.numel() == 1 or g.shape[-1] == 1:
        view, mode = g.reshape(-1).expand(E), 1
    else:
        view, mode = g.reshape(-1, N).expand(E, N), 2
    if view.is_contiguous():
        return view, mode
    from .mma_pack import _version

    state = (_version(g), E, N)
    cached = getattr(g, "_fp4moe_globals", None)
    if cached is not None and getattr(g, "_fp4moe_globals_state", None) == state:
        return cached, mode
    full = view.contiguous()
    if not (g.is_cuda and torch.cuda.is_current_stream_capturing()):  # a captured copy is written on replay only
        g._fp4moe_globals, g._fp4moe_globals_state = full, state
    return full, mode


def _pair_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    """The routing weights [T, k] as the fp32 vector [T * k] of pairs (no copy when they already are
    fp32 and contiguous): the Triton and mma.sync paths' GEMM 2 epilogue reads it at each scattered
    row's pair; the wgmma path gathers it per sorted row first."""
    return topk_weights.reshape(-1).to(torch.float32).contiguous()


def _check_row_weight(row_weight: torch.Tensor | None, scatter: bool) -> None:
    """The epilogues read a pair's routing weight at its scattered output row: it needs scatter."""
    if row_weight is not None and not scatter:
        raise ValueError("row_weight: the routing weights are read at each scattered row's pair (scatter=True)")


def launch_moe_gemm(x: torch.Tensor | FP4Tensor, w: FP4Tensor, plan: DispatchPlan, out: torch.Tensor,
                    cfg: MoEGemmConfig, *, swiglu: int, interleaved: bool, gather: bool, scatter: bool,
                    row_weight: torch.Tensor | None, bias: torch.Tensor | None, act: int = 0) -> torch.Tensor:
    """One grouped GEMM. ``x`` is bf16/fp16 rows (act 0) or their NVFP4 quantization (act 1:
    decoded in the kernel; act 2: native block-scaled FP4 MMA). ``row_weight`` [T * k] fp32 (the
    routing weight of each pair, ``_pair_weights``) needs ``scatter``: a row's pair is its output row."""
    import triton

    _check_row_weight(row_weight, scatter)

    from ..kernels.moe import moe_gemm_kernel

    E, N_w, K = w.shape
    n_out = N_w // 2 if swiglu else N_w
    ws = w.scales.view(torch.uint8)
    wg, wg_mode = _weight_globals(w)
    placeholder = plan.sorted_pair
    if act == 0:
        x_arg, xs_arg, xg_arg, stride_xsm = x, placeholder, placeholder, 0
        compute = mma_dtype(x.dtype)
        fast = fast_decode(act, x.dtype)
    else:
        x_arg, xs_arg, xg_arg = x.data, x.scales.view(torch.uint8), x.global_scale
        stride_xsm = xs_arg.stride(0)
        compute = mma_dtype(torch.bfloat16)
        fast = fast_decode(act, torch.bfloat16)
    grid = (triton.cdiv(n_out, cfg.block_n), plan.max_tiles)
    moe_gemm_kernel[grid](
        x_arg, xs_arg, xg_arg, w.data, ws, wg if wg is not None else placeholder,
        bias if bias is not None else placeholder,
        plan.sorted_token, plan.sorted_pair, row_weight if row_weight is not None else placeholder,
        plan.tile_expert, plan.tile_start, plan.tile_end, out,
        n_out, K, N_w // 2,
        x_arg.stride(0), stride_xsm, w.data.stride(0), w.data.stride(1), ws.stride(0), ws.stride(1),
        wg.stride(0) if wg_mode == 2 else 0,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, GROUP=w.block_size,
        W_E4M3=w.fmt.scale_kind == "e4m3", SWIGLU=swiglu, INTERLEAVED=interleaved, GATHER=gather,
        SCATTER=scatter, HAS_RW=2 if row_weight is not None else 0, WG_MODE=wg_mode,
        HAS_BIAS=bias is not None, COMPUTE_DTYPE=compute, FAST_DECODE=fast, ACT=act,
        FOLD=fast_fold(act, fast, w.fmt.scale_kind == "e4m3"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **arch_kwargs(w.data.device))
    return out


def launch_combine(y_pair: torch.Tensor, topk_ids: torch.Tensor, top_k: int, shared: torch.Tensor | None,
                   out: torch.Tensor, n_experts: int) -> torch.Tensor:
    """out[t] = sum over kept slots s (expert id in [0, E)) of y_pair[t*k + s], in slot order, + shared[t]."""
    import triton

    from ..kernels.moe import moe_combine_kernel

    T, H = out.shape
    block = 1024 if H >= 1024 else triton.next_power_of_2(H)
    moe_combine_kernel[(T, triton.cdiv(H, block))](
        y_pair, topk_ids, shared if shared is not None else y_pair, out, H, n_experts, y_pair.stride(0),
        shared.stride(0) if shared is not None else 0, out.stride(0),
        TOP_K=top_k, BLOCK_H=block, HAS_SHARED=shared is not None, num_warps=4, **pdl_kwargs(out.device),
        **arch_kwargs(out.device))
    return out


def launch_partials_combine(part: torch.Tensor, w2: FP4Tensor, plan: DispatchPlan, topk_ids: torch.Tensor,
                            pair_weights: torch.Tensor, shared: torch.Tensor | None, bias: torch.Tensor | None,
                            out: torch.Tensor) -> torch.Tensor:
    """GEMM 2's epilogue and the combine in one launch (``moe_partials_combine_kernel``): out[t] =
    sum over kept slots s, in slot order, of (part[row(t, s)] * globals + bias) * weight(t, s), +
    shared[t]. ``part`` [splits, R, H] fp32 or bf16 (added in split order, in fp32), ``pair_weights``
    [T * k] fp32."""
    import triton

    from ..kernels.moe import moe_partials_combine_kernel

    T, H = out.shape
    k = topk_ids.shape[1]
    # enough programs to spread the pair rows' reads over the GPU at decode batch sizes
    block = max(32, min(1024, triton.next_power_of_2(max(1, T * H // 512))))
    wg, wg_mode = _weight_globals(w2)
    unused = part
    moe_partials_combine_kernel[(T, triton.cdiv(H, block))](
        part, wg if wg is not None else unused, bias if bias is not None else unused, pair_weights, topk_ids,
        plan.pair_row, shared if shared is not None else unused, out, part.shape[1], H, w2.shape[0],
        wg.stride(0) if wg_mode == 2 else 0, bias.stride(0) if bias is not None else 0,
        shared.stride(0) if shared is not None else 0, out.stride(0),
        TOP_K=k, SPLIT=part.shape[0], BLOCK_H=block, WG_MODE=wg_mode, HAS_BIAS=bias is not None, HAS_SHARED=shared is not None,
        num_warps=max(1, min(4, block // 256)), enable_fp_fusion=False, **pdl_kwargs(out.device),
        **arch_kwargs(out.device))
    return out


def _quantize_rows(x: torch.Tensor, global_scale: torch.Tensor | None) -> FP4Tensor:
    from .quantize import quantize_activations

    return quantize_activations(x, global_scale)


def _run(x, w13, w2, topk_ids, topk_weights, plan, configs, k, act, activation, interleaved, w13_bias, w2_bias, shared_out,
         input_global_scale, out):
    """The launches of one layer: [quantize x] -> GEMM 1 -> [re-quantize h] -> GEMM 2 -> combine."""
    T, H = x.shape
    I = w2.shape[2]
    g1, g2 = configs
    x_in = _quantize_rows(x, input_global_scale) if act else x
    # W4A4 re-quantizes all T*k rows of h with one global scale (amax over every row): rows of dropped
    # slots are never written by GEMM 1, so they must hold zeros
    h = (torch.zeros if act else torch.empty)((T * k, I), dtype=x.dtype, device=x.device)
    launch_moe_gemm(x_in, w13, plan, h, g1, swiglu=_SWIGLU[activation], interleaved=interleaved, gather=True,
                    scatter=False, row_weight=None, bias=w13_bias, act=act)
    h_in = _quantize_rows(h, None) if act else h
    y_pair = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    row_w = _pair_weights(topk_weights)
    launch_moe_gemm(h_in, w2, plan, y_pair, g2, swiglu=0, interleaved=False, gather=False, scatter=True,
                    row_weight=row_w, bias=w2_bias, act=act)
    return launch_combine(y_pair, topk_ids, k, shared_out, out, w13.shape[0])


def launch_partials_epilogue(part: torch.Tensor, w: FP4Tensor, plan: DispatchPlan, out: torch.Tensor, *, swiglu: int,
                             interleaved: bool, scatter: bool, row_weight: torch.Tensor | None,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """``moe_gemm_kernel``'s epilogue on the grouped partial sums ``part`` [splits, R, N_w]
    (``row_weight`` as ``launch_moe_gemm``'s)."""
    import triton

    _check_row_weight(row_weight, scatter)

    from ..kernels.moe import moe_partials_epilogue_kernel

    N_w = w.shape[1]
    n_out = N_w // 2 if swiglu else N_w
    wg, wg_mode = _weight_globals(w)
    unused = plan.sorted_pair  # pointer arguments a variant does not read
    block_n = 64
    moe_partials_epilogue_kernel[(triton.cdiv(n_out, block_n), plan.max_tiles)](
        part, wg if wg is not None else unused, bias if bias is not None else unused, plan.sorted_pair,
        row_weight if row_weight is not None else unused, plan.tile_expert, plan.tile_start, plan.tile_end, out,
        part.shape[1], N_w, n_out, N_w // 2, wg.stride(0) if wg_mode == 2 else 0,
        bias.stride(0) if bias is not None else 0, out.stride(0),
        SPLIT=part.shape[0], BLOCK_N=block_n, BLOCK_M=plan.block_m, SWIGLU=swiglu, INTERLEAVED=interleaved,
        SCATTER=scatter, HAS_RW=2 if row_weight is not None else 0, WG_MODE=wg_mode, HAS_BIAS=bias is not None, num_warps=4,
        enable_fp_fusion=False, **pdl_kwargs(out.device), **arch_kwargs(part.device))
    return out


def compile_request(cfg: MoEGemmConfig, fmt: str, cc: int, *, swiglu: int, gather: bool, scatter: bool,
                    out_dtype: str = "bf16", act: int = 0, x_dtype: str = "bf16"):
    """Cross-compilation request (``fp4moe.plan.crosscompile``) for one grouped GEMM, with the
    constexprs ``launch_moe_gemm`` passes for activations of ``x_dtype`` ("bf16"/"fp16")."""
    from ..formats import get_format
    from ..target.compile_request import CompileRequest

    f = get_format(fmt)
    sig = {"x_ptr": "*bf16", "xs_ptr": "*u8", "xg_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*u8", "wg_ptr": "*fp32", "bias_ptr": f"*{x_dtype}",
           "row_x_ptr": "*i32", "row_out_ptr": "*i32", "row_w_ptr": "*fp32", "tile_expert_ptr": "*i32",
           "tile_start_ptr": "*i32", "tile_end_ptr": "*i32", "out_ptr": f"*{out_dtype}", "N_out": "i32", "K": "i32",
           "I_half": "i32", "stride_xm": "i32", "stride_xsm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32",
           "stride_wsn": "i32", "stride_ge": "i32", "stride_be": "i32", "stride_om": "i32"}
    consts = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k, "GROUP": f.block_size,
              "W_E4M3": f.scale_kind == "e4m3", "SWIGLU": swiglu, "INTERLEAVED": False, "GATHER": gather,
              "SCATTER": scatter, "HAS_RW": 2 if scatter else 0, "WG_MODE": int(f.has_global_scale), "HAS_BIAS": False,
              "COMPUTE_DTYPE": x_dtype if act == 0 else "bf16",
              "FAST_DECODE": fast_decode(act, x_dtype, compiled=True), "ACT": act,
              "FOLD": fast_fold(act, fast_decode(act, x_dtype, compiled=True), f.scale_kind == "e4m3")}
    sig["x_ptr"] = f"*{x_dtype}" if act == 0 else "*u8"
    div = ("x_ptr", "w_ptr", "ws_ptr", "out_ptr", "N_out", "K", "I_half", "stride_xm", "stride_we", "stride_wn",
           "stride_wse", "stride_wsn", "stride_om")
    return CompileRequest(kernel="fp4moe.kernels.moe:moe_gemm_kernel", signature=sig, constexprs=consts, cc=cc,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages, divisible_by_16=div)
