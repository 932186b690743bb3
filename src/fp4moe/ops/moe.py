"""The FP4 MoE experts: dispatch -> grouped GEMM 1 (+ SwiGLU) -> grouped GEMM 2 (x routing weight)
-> deterministic combine. Launchers, configuration, torch reference and custom op.

Routing (top-k ids and weights) is an input here; ``ops.routing`` computes it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Literal

import torch

from .. import guard
from ..kernels.moe import GPT_OSS_ALPHA, GPT_OSS_LIMIT  # gpt-oss's activation constants (one definition)
from ..quantize import FP4Tensor, dequantize
from .dispatch import DispatchPlan, dispatch, max_tiles, tile_map
from ._runtime import arch_kwargs, fast_decode, fast_fold, interpreting, mma_dtype, pdl_kwargs

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


# ----------------------------------------------------------------------------------------------
# launchers


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
    from .mma_layout import _version

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


def check_moe_inputs(x: torch.Tensor, w13: FP4Tensor, w2: FP4Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate shapes and formats; returns (E, I, H, top_k)."""
    for name, t in (("w13", w13), ("w2", w2)):
        if not isinstance(t, FP4Tensor) or len(t.shape) != 3:
            raise TypeError(f"{name}: expected a stacked FP4Tensor [E, N, K], got "
                            f"{type(t).__name__}{'' if not isinstance(t, FP4Tensor) else tuple(t.shape)}")
    E, two_i, H = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: expected [E, 2*I, H] (gate and up rows), got {tuple(w13.shape)}")
    I = two_i // 2
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree: expected w2 of shape "
                         f"{(E, H, I)}")
    if w13.fmt != w2.fmt:
        raise ValueError(f"w13 and w2: expected the same format, got w13 {w13.fmt} and w2 {w2.fmt}")
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"x: expected [T, {H}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x: expected bfloat16 or float16, got {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids: expected [T={x.shape[0]}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: expected an integer tensor (expert ids), got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights: expected a floating-point tensor, got {topk_weights.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    for name, t in (("w13", w13.data), ("w2", w2.data), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device}, got {t.device}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.data.stride(-1) != 1 or t.scales.stride(-1) != 1:
            raise ValueError(f"{name}: packed data and scales must be contiguous along K (call .contiguous())")
    return E, I, H, topk_ids.shape[1]


def check_moe_extras(x: torch.Tensor, E: int, I: int, H: int, w13_bias: torch.Tensor | None,
                     w2_bias: torch.Tensor | None, shared_out: torch.Tensor | None) -> None:
    """Shapes and devices of the optional inputs (biases, shared-expert output)."""
    for name, t, shape in (("w13_bias", w13_bias, (E, 2 * I)), ("w2_bias", w2_bias, (E, H)),
                           ("shared_out", shared_out, (x.shape[0], H))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device}, got {t.device}")


def check_mode_and_activation(mode: str, activation: str, w: FP4Tensor) -> None:
    """The layer's mode ("w4a16", or "w4a4" with NVFP4 experts) and SwiGLU variant."""
    if mode not in ("w4a16", "w4a4"):
        raise ValueError(f"mode: expected 'w4a16' or 'w4a4', got {mode!r}")
    if mode == "w4a4" and w.fmt.name != "nvfp4":
        raise ValueError(f"mode: 'w4a4' needs NVFP4 expert weights, got {w.fmt}")
    if activation not in _SWIGLU:
        raise ValueError(f"activation: expected 'silu' or 'gpt_oss', got {activation!r}")


def _act_code(mode: str, w: FP4Tensor, device: torch.device) -> int:
    """0 for W4A16; for W4A4 (NVFP4 only, ``check_mode_and_activation``) 2 where the GPU has native
    FP4 MMA, else 1."""
    if mode == "w4a16":
        return 0
    from .linear import choose_path, device_arch

    return 2 if choose_path("w4a4", device_arch(device), device) == "w4a4_native" else 1


def _quantize_rows(x: torch.Tensor, global_scale: torch.Tensor | None) -> FP4Tensor:
    from .quantize import quantize_activations

    return quantize_activations(x, global_scale)


def fp4_moe_experts(x: torch.Tensor, w13: FP4Tensor, w2: FP4Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, *, activation: Activation = "silu", interleaved: bool = False,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    shared_out: torch.Tensor | None = None, mode: str = "w4a16",
                    input_global_scale: torch.Tensor | None = None,
                    configs: tuple[MoEGemmConfig, MoEGemmConfig] | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer: ``sum_s w[t,s] * FFN_{ids[t,s]}(x[t]) (+ shared_out)``.

    x [T, H] bf16/fp16; w13 [E, 2I, H] FP4 (gate rows then up rows, or interleaved);
    w2 [E, H, I]; topk_ids int [T, k]; topk_weights fp32 [T, k]. No host synchronisation.
    mode "w4a4" (NVFP4): x is quantized once per token (global ``input_global_scale`` or dynamic)
    and the SwiGLU output is re-quantized before the second GEMM.
    """
    E, I, H, k = check_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    check_moe_extras(x, E, I, H, w13_bias, w2_bias, shared_out)
    check_mode_and_activation(mode, activation, w13)
    act = _act_code(mode, w13, x.device)
    topk_ids = topk_ids.to(torch.int32).contiguous()
    w13_bias = None if w13_bias is None else w13_bias.contiguous()
    w2_bias = None if w2_bias is None else w2_bias.contiguous()
    T = x.shape[0]
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    if configs is None:
        from .linear import device_arch

        arch = device_arch(x.device)
        packed_cfg = packed_layout_config(x, w13, w2, mode, arch, T * k / E, interleaved)
        if packed_cfg is not None:
            packed = (mma_packed_experts(w13), mma_packed_experts(w2))
            if None not in packed:
                return _forward_mma(x, w13, w2, packed, topk_ids, topk_weights, k, activation, interleaved, w13_bias,
                                    w2_bias, shared_out, out, packed_cfg, mode, input_global_scale)
        configs = choose_moe_configs(T, k, E, H, I, arch=arch, mode=mode)
    g1, g2 = configs
    if g1.block_m != g2.block_m:
        raise ValueError(f"configs: both GEMMs must share block_m (one dispatch plan), got {g1.block_m} and {g2.block_m}")
    x = x.contiguous()
    layout = "interleaved" if interleaved else "gate_up"
    wg_mode = _weight_globals(w13)[1]
    has_bias = w13_bias is not None or w2_bias is not None
    variant = f"{w13.fmt},{mode},{activation},{layout},{str(x.dtype).replace('torch.', '')},wg{wg_mode}" + \
        (",bias" if has_bias else "")
    key = guard.GuardKey(kernel=f"fp4_moe[{variant}]", config=f"{g1}|{g2}", device=guard.device_name(x.device))
    if guard.should_check(key):
        guard.check(key, lambda: _probe(x.device, x.dtype, w13.fmt.name, activation, interleaved, mode, (g1, g2),
                                        per_row=wg_mode == 2, bias=has_bias),
                    tolerance="fp4_moe" if mode == "w4a16" else "fp4_moe_w4a4")
    if guard.use_reference(key):
        return fp4_moe_reference(x, w13, w2, topk_ids, topk_weights, activation=activation, interleaved=interleaved,
                                 w13_bias=w13_bias, w2_bias=w2_bias, shared_out=shared_out, mode=mode,
                                 input_global_scale=input_global_scale)
    plan = dispatch(topk_ids.to(torch.int32), E, g1.block_m)
    return _run(x, w13, w2, topk_ids, topk_weights, plan, (g1, g2), k, act, activation, interleaved, w13_bias, w2_bias,
                shared_out, input_global_scale, out)


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


# ----------------------------------------------------------------------------------------------
# decode on weights in MMA operand order (kernels.linear_mma, grouped over the dispatch plan)


def packed_layout_config(x: torch.Tensor, w13: FP4Tensor, w2: FP4Tensor, mode: str, arch, rows_per_expert: float,
                         interleaved: bool):
    """The configuration of the kernels on weights in MMA operand order (``ops.mma_layout``), or None
    for ``moe_gemm_kernel``: on compiled CUDA, W4A16 with bf16 activations, or emulated W4A4 (no FP4
    MMA; ``_w4a4_activations``) with bf16 or fp16 activations; the kernel from ``packed_moe_kernel`` (an
    ``MMAConfig`` for the mma.sync kernel, a ``WgmmaConfig`` for the wgmma kernel with the activation
    fused into GEMM 1)."""
    from .linear import runs_packed

    if not (x.is_cuda and not interpreting() and arch is not None and runs_packed(mode, arch)):
        return None
    if mode == "w4a16" and x.dtype != torch.bfloat16:
        return None
    kernel = packed_moe_kernel(arch, rows_per_expert, w13.shape[1], w2.shape[1], interleaved)
    if kernel == "mma":
        return mma_moe_layer_config(rows_per_expert, w13.shape[0])
    if kernel == "wgmma":
        return wgmma_moe_config(rows_per_expert)
    return None


#: on SM90, experts averaging more rows than this run on the wgmma kernel (16- and 32-row tiles
#: with the activations by TMA) rather than the mma.sync decode kernel. H200, GLM-5 experts
#: (``scripts/sweep_small_m.py``, benchmarks/raw/sweep-small-m-h200.json): at 16 rows per expert
#: (512 tokens) 2,018 us with 32-row wgmma tiles against 2,528 on the decode kernel; at 8 rows
#: 1,852 against 1,861; at 4 rows the decode kernel wins (1,517 against 1,754)
WGMMA_MOE_MIN_ROWS = 8


def packed_moe_kernel(arch, rows_per_expert: float, n13: int, n2: int, interleaved: bool) -> str | None:
    """Which kernel on weights in MMA operand order runs a bf16 W4A16 layer (w13 [E, n13, H],
    w2 [E, n2, I]): "mma" (grouped mma.sync, every architecture from SM80) up to MAX_M rows per
    expert, or up to WGMMA_MOE_MIN_ROWS where the wgmma kernel can take over; "wgmma" (SM90, w13
    gate-then-up with I a multiple of 16) above; None for the Triton kernels (weight rows not whole
    16-row blocks, or larger layers elsewhere)."""
    from .mma_layout import MAX_M, ROWS, fuses_activation

    if n13 % ROWS or n2 % ROWS:
        return None
    wgmma = arch.bf16_mma == "wgmma" and not interleaved and fuses_activation(n13)
    if rows_per_expert <= (WGMMA_MOE_MIN_ROWS if wgmma else MAX_M):
        return "mma"
    return "wgmma" if wgmma else None


#: the bit order of the MoE experts' packed words (``ops.mma_layout.WORD_ORDERS``): "rotation",
#: decoded in 9 integer operations per word instead of the plain linear's 13. H200, GLM-5 layer,
#: both orders on copies of the same experts in one process, replays interleaved, outputs bitwise
#: equal (scripts/try_moe_decode_order.py, benchmarks/raw/try-moe-decode-order*-h200.json): 1.03x
#: at 4 tokens, 1.07-1.10x at 16-64, 1.04-1.08x at 128-256, 1.05x at 4096 (wgmma); at 1-3 tokens
#: level only with the configurations of ``mma_moe_config`` for few pairs (1 token on the 4-step K
#: tiles: 0.92x). Qwen3-30B-A3B 1.00-1.05x. The plain linear keeps "nibble": its decode at M <= 16
#: ran 4-37% slower in the rotation order (session 22: ptxas issues the next step's weight loads
#: late).
MOE_WORD_ORDER = "rotation"


def mma_packed_experts(w: FP4Tensor):
    """Stacked expert weights [E, N, K] packed as one [E * N, K] weight in MMA operand order (bit
    order ``MOE_WORD_ORDER``), without global scales (the MoE epilogue applies them per expert or
    per row); kept with the weight's storage like ``ops.linear.mma_packed`` (and packed again after
    its bytes or scales changed in place). None while a CUDA graph is captured and no current pack
    exists."""
    from .mma_layout import cached_pack, pack_mma

    def make(w: FP4Tensor):
        E, N, K = w.shape
        ones = torch.ones(1, dtype=torch.float32, device=w.device) if w.global_scale is not None else None
        flat = FP4Tensor(w.data.reshape(E * N, K // 2), w.scales.reshape(E * N, -1), ones, torch.Size((E * N, K)),
                         w.fmt)
        return replace(pack_mma(flat, MOE_WORD_ORDER), global_scale=None)

    return cached_pack(w, make, with_global=False)


#: where experts average more than 4 and at most this many rows (GLM-5 at 129-256 tokens), the
#: decode GEMMs run as two launches each (``MMAHeights``): the experts with at most 8 rows on the
#: 8-row configuration, the others on 16-row tiles. H200, GLM-5 experts, both GEMMs only
#: (scripts/try_moe_two_heights.py, benchmarks/raw/try-moe-two-heights-h200.json): 256 tokens
#: (149 experts of <= 8 rows, 107 above) 1,605 against 1,685 us and 1,659 against 1,753 on another
#: lease; 192 tokens 1,514 against 1,656. Per expert the 8-row launch ran at ~89% of the weight-read
#: bound and the 16-row one at ~71%, so with all experts on 16-row tiles the short ones paid the
#: taller tile's registers (160 against 126: 3 programs per SM against 4) and MMAs.
MMA_HEIGHTS_ROWS = 8


@dataclass(frozen=True)
class MMAHeights:
    """The decode path's grouped mma.sync GEMMs as two launches each over one dispatch plan (made
    for ``large.block_m``): the experts with at most ``rows`` rows on ``small``, the others on
    ``large`` (``ops.dispatch.tile_map(rows=...)`` gives each launch its class's tiles; no host
    synchronisation). Both write into the same h and partial sums; the epilogues and the combine
    run once. Every output row comes from one launch, so the result equals either configuration's
    alone bit for bit where their K steps add in the same order."""

    small: object  # MMAConfig
    large: object  # MMAConfig
    rows: int

    def __post_init__(self) -> None:
        from .mma_layout import MMAConfig

        if not (isinstance(self.small, MMAConfig) and isinstance(self.large, MMAConfig)):
            raise TypeError(f"MMAHeights: expected two MMAConfig, got {type(self.small).__name__}, "
                            f"{type(self.large).__name__}")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"MMAHeights.rows: expected a positive int, got {self.rows!r}")
        if not self.small.block_m < self.large.block_m:
            raise ValueError(f"MMAHeights: small tiles ({self.small.block_m} rows) must be shorter than large "
                             f"ones ({self.large.block_m})")
        if self.small.split_k != self.large.split_k or self.small.kw != 1 or self.large.kw != 1:
            raise ValueError("MMAHeights: both launches write one partial-sum tensor (the same split_k, kw = 1), "
                             f"got {self.small} and {self.large}")

    @property
    def block_m(self) -> int:
        """The dispatch plan's tile height (the large class's)."""
        return self.large.block_m

    @property
    def split_k(self) -> int:
        return self.large.split_k

    def classes(self):
        """(configuration, (lo, hi) rows of its experts) per launch, the short tiles first."""
        from .dispatch import ALL_ROWS

        return ((self.small, (0, self.rows)), (self.large, (self.rows, ALL_ROWS)))

    def __str__(self) -> str:
        return f"{self.small}+{self.large}@{self.rows}"


#: x steps in the shared-memory ring of ``MMAHeights``' tall class (``MMAConfig.xs``; 0: x in
#: registers). Session 26 (H200, GLM-5 experts, ``scripts/try_moe_class_configs.py``, interleaved,
#: benchmarks/raw/try-moe-class-configs-c1-h200.json): ncu's source counters put the 16-row GEMM 1
#: loop's stalls on the HMMAs that wait for x's loads; through the ring the 107 experts of 9-16 rows
#: at 256 tokens ran GEMM 1 in 471.8 against 506.1 us and GEMM 2 in 252.5 against 258.4 (at 192
#: tokens, 47 experts: 226.5 against 229.9 and level), bitwise the same. The 8-row class and the
#: one-height configurations stay in registers (session 24: the ring there was 3-4% slower).
MMA_HEIGHTS_X_STAGES = 2

#: ``MMAHeights``' second launch of each GEMM runs alongside the first's last programs (PDL without
#: a wait: ``launch_grouped_mma(independent=True)``; the classes share no rows)
MMA_HEIGHTS_OVERLAP = True


def mma_moe_layer_config(rows_per_expert: float, n_experts: int | None = None):
    """The decode path's configuration: ``mma_moe_config``'s, or where its tiles are taller than
    8 rows and experts average at most ``MMA_HEIGHTS_ROWS``, an ``MMAHeights`` of the 8-row
    configuration for the experts of at most 8 rows and that one, with x through a shared-memory
    ring of ``MMA_HEIGHTS_X_STAGES`` steps, for the others. ``n_experts`` (the layer's E) lets
    ``mma_moe_config`` see the token-expert pairs (its few-pairs configurations)."""
    cfg = mma_moe_config(rows_per_expert, n_experts)
    small = mma_moe_config(1)
    if cfg.block_m > small.block_m and rows_per_expert <= MMA_HEIGHTS_ROWS:
        return MMAHeights(small, replace(cfg, xs=MMA_HEIGHTS_X_STAGES), small.block_m)
    return cfg


#: token-expert pairs (inclusive) up to which the decode GEMMs take the few-pair configurations of
#: ``mma_moe_config``: K split in two with 128-K steps, then two-warp programs (``n_experts`` given)
FEW_PAIRS = (8, 16)


def mma_moe_config(rows_per_expert: float, n_experts: int | None = None):
    """The grouped GEMMs' configuration (GEMM 2 takes ``mma_moe_gemm2_config`` of it), no K split
    (the active experts' row blocks fill the GPU): tiles of 8 rows, 64 weight rows and 256 K per step; past 4 rows per expert 16-row tiles
    of 128 weight rows and 128 K per step (two row blocks per warp share each x fragment: GLM-5 at
    256 tokens, H200, ``scripts/sweep_moe_decode.py``, benchmarks/raw/sweep-moe-decode-h200.json:
    median 1,737-1,824 us over seven runs against 1,811-1,912 with one row block and 256 K).

    With ``n_experts``, few pairs (``FEW_PAIRS``: at most 8 active experts, then 16) get more,
    smaller programs: with the experts' words in the rotation order (``MOE_WORD_ORDER``) the 4-warp
    256-K tiles wait on their weights there. H200, GLM-5 layer (scripts/try_moe_decode_order.py
    --configs, benchmarks/raw/try-moe-decode-order-configs-run*-h200.json): 1 token 59.5 -> 54.9 us
    (K split in two, 128-K steps; the nibble order's 256-K tiles 55.3), 2 tokens 117.0 -> 91.8
    (two-warp programs; nibble 106.9). GEMM 2 takes ``mma_moe_gemm2_config`` of the result."""
    from .mma_layout import MMAConfig

    if n_experts is not None and rows_per_expert * n_experts <= FEW_PAIRS[0]:
        return _few_pairs_split()
    if n_experts is not None and rows_per_expert * n_experts <= FEW_PAIRS[1]:
        return MMAConfig(rb=1, warps=2, kh=4, block_m=8, split_k=1)
    if rows_per_expert <= 4:
        return MMAConfig(rb=1, warps=4, kh=4, block_m=8, split_k=1)
    return MMAConfig(rb=2, warps=4, kh=2, block_m=16, split_k=1)


#: K split of ``mma_moe_config``'s few-pairs configuration (GEMM 1), and (row blocks per warp, K
#: split) of GEMM 2's (``mma_moe_gemm2_config``)
FEW_PAIRS_SPLIT = 2
FEW_PAIRS_GEMM2 = (2, 2)


def _few_pairs_split():
    """``mma_moe_config``'s configuration for at most ``FEW_PAIRS[0]`` pairs: K split in
    ``FEW_PAIRS_SPLIT``, 128-K steps."""
    from .mma_layout import MMAConfig

    return MMAConfig(rb=1, warps=4, kh=2, block_m=8, split_k=FEW_PAIRS_SPLIT)


#: 16-row blocks per warp of GEMM 2's launch for the short-tile class of ``MMAHeights`` (GEMM 1's
#: configuration there has one: ``mma_moe_gemm2_config``)
MMA_HEIGHTS_GEMM2_SMALL_RB = 2


def mma_moe_gemm2_config(cfg, rows: tuple[int, int] | None = None):
    """GEMM 2's configuration on the decode path where the layer's (``mma_moe_layer_config``, GEMM
    1's) is ``cfg``, or, with ``rows``, that of the ``MMAHeights`` class of those rows.

    The short-tile class of ``MMAHeights`` (rows (0, h]) takes ``MMA_HEIGHTS_GEMM2_SMALL_RB`` row
    blocks per warp: 128 weight rows per program, so each program's 8 rows of h are read for twice
    the weights. H200, GLM-5 experts, that class's GEMM 2 alone, interleaved against the 64-row
    programs (scripts/try_moe_class_configs.py --class 0, benchmarks/raw/try-moe-class-configs-c0-h200.json):
    320.3 -> 307.4 us at 256 tokens, 433.7 -> 418.9 at 192; GEMM 1 with 128 rows was slower (520.5
    -> 541.1, 709.8 -> 724.6), and so were 256-row programs in the 16-row class's GEMMs.

    Otherwise the same as ``cfg``, except that the few-pairs split takes two 16-row blocks per warp in
    GEMM 2 (128 weight rows per program: at one token 768 programs of 8 K steps, within one wave,
    against 1,536 in 1.2 waves; rows add their K steps in the same order, so the output is bitwise
    the same). H200, GLM-5 layer at one token, interleaved in one process (scripts/try_moe_layer_ab.py,
    benchmarks/README.md session 28): 55.5-56.2 -> 53.2-53.6 us on two leases; at two tokens the
    two-warp configuration with two row blocks was 6% slower, and GEMM 1 with two row blocks at one
    token 10% slower (54.0 -> 59.2-59.5)."""
    if cfg == _few_pairs_split():
        return replace(cfg, rb=FEW_PAIRS_GEMM2[0], split_k=FEW_PAIRS_GEMM2[1])
    if rows is not None and rows[0] == 0:
        return replace(cfg, rb=MMA_HEIGHTS_GEMM2_SMALL_RB)
    return cfg


def wgmma_moe_config(rows_per_expert: float):
    """Above ``WGMMA_MOE_MIN_ROWS`` rows per expert on SM90 (H200, GLM-5 experts,
    scripts/try_wgmma.py, sweep_moe_tails.py, sweep_small_m.py): one warpgroup of two register
    repeats per program (GEMM 2 on the linear's two warpgroups of one repeat was 8% slower: 8,023 vs
    7,438 us at 4096 tokens), 32-row tiles while experts average <= 24 rows, 64-row tiles up to 48
    rows, else 128-row tiles whose short tails (<= 32 rows) run with 32-row wgmmas in both GEMMs
    (``tail_m``, ``_GEMM2_TAILS``). Session 8 (``scripts/sweep_moe_prefill.py``): 4096 tokens
    6,126 -> 5,572 us against session 7's 64-row tails in GEMM 1 only and fp32 pair rows (the grouped
    GEMMs 5,122 -> 4,977 us of it, the combine 345 -> 106); 64-row tails in both 5,688; at 16384
    tokens 20,106 -> 20,464 in that run and 20,663 -> 20,350 in its repeat (within the spread).
    Session 5 (64-row tails in GEMM 1):
    7,469 -> 7,096 us at 4096 tokens.

    Merged tails (``WgmmaConfig.merge_tail``, session 19) where experts average one full tile to one
    full tile plus a tail (``MERGE_TAIL_ROWS``): most experts then have a full tile and a short one,
    whose weights the merged tile decodes once."""
    from .mma_layout import WgmmaConfig

    if rows_per_expert <= 24:
        return WgmmaConfig(block_m=32, stages=4, warps=4)
    if rows_per_expert <= 48:
        return WgmmaConfig(block_m=64, stages=4, warps=4)
    lo, hi = MERGE_TAIL_ROWS
    return WgmmaConfig(block_m=128, stages=4, warps=4, tail_m=32, merge_tail=lo <= rows_per_expert <= hi)


#: rows per expert (inclusive) at which the MoE GEMMs merge an expert's short last tile into the
#: full tile before it (``WgmmaConfig.merge_tail``): 128 to 128 + 32. Outside, few experts have a
#: full tile and a tail of <= 32 rows, and the merged variant's registers (255 with 40-88 B of spills
#: outside the K loop, against 226 and 253) cost the other tiles. H200, GLM-5 layer, uniform routing,
#: both GEMMs merged against separate tails, replays interleaved (scripts/sweep_moe_wgmma_configs.py;
#: benchmarks/raw/sweep-moe-merged-tails*-h200.json): 1.064x and 1.111x at 4096 tokens (128 rows per
#: expert), 1.153x at 4608 (144), 1.032x at 5120 (160); 0.980x at 3072 (96), 0.983x at 3584 (112),
#: 0.991x at 6144 (192), 1.007x at 8192 (256), 0.988x at 16384 (512), 0.991x at 2048 (64). GEMM 1
#: alone merged at 4096: 1.030x.
MERGE_TAIL_ROWS = (128, 160)


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


#: GEMM 1 of the decode path runs its epilogue in the kernel (``launch_grouped_mma_swiglu``) for the
#: SiLU activation on gate-then-up weights; gpt-oss's clamped variant and interleaved rows keep the
#: partial sums and the epilogue kernel
FUSED_SWIGLU = True

#: ... when its grid has at least this many programs per SM: the fused program streams gate and up
#: rows (121 registers on SM90 against 72: 4 resident programs of 4 warps per SM against 7), so a
#: smaller grid leaves each SM fewer warps for the same weight bytes. H200, GLM-5 (benchmarks/README.md,
#: session 10): at 1 token (8 tiles x 32 = 256 programs, ~2 per SM) the layer took 63.1 us fused
#: against 59.0 with the epilogue kernel; at 4 tokens (1,024 programs) 181.3 against 188.9
FUSED_SWIGLU_MIN_PROGRAMS_PER_SM = 4


def fuses_swiglu(cfg, activation: str, interleaved: bool, I: int, programs_per_sm: float) -> bool:
    """Whether the decode path's GEMM 1 writes h itself (``FUSED_SWIGLU``): SiLU, gate rows then up
    rows, I a whole number of 16-row blocks, K not split over programs, and a grid of at least
    ``FUSED_SWIGLU_MIN_PROGRAMS_PER_SM`` (``programs_per_sm``: the plan's worst-case tiles times the
    output blocks, over the SMs)."""
    from .mma_layout import ROWS

    return (FUSED_SWIGLU and activation == "silu" and not interleaved and I % ROWS == 0 and cfg.split_k == 1
            and cfg.kw == 1 and programs_per_sm >= FUSED_SWIGLU_MIN_PROGRAMS_PER_SM)


def fused_programs_per_sm(tiles: int, I: int, cfg, sm_count: int) -> float:
    """Programs per SM of the fused GEMM 1's grid of ``tiles`` plan tiles (``fuses_swiglu``)."""
    return tiles * -(-I // cfg.block_n) / sm_count


def decode_fuses_swiglu(cfg, activation: str, interleaved: bool, I: int, tiles: int, device) -> bool:
    """``fuses_swiglu`` for a plan of ``tiles`` tiles (its worst case, ``max_tiles``) on ``device``
    (``MMAHeights``: the large class's configuration decides for both launches)."""
    if isinstance(cfg, MMAHeights):
        cfg = cfg.large
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return fuses_swiglu(cfg, activation, interleaved, I, fused_programs_per_sm(tiles, I, cfg, sm_count))


def overlaps_previous_class(rows) -> bool:
    """Whether the launch of ``MMAHeights``' class of experts with lo < rows <= hi (``rows``; None:
    one launch for all) runs alongside the class launch before it (``MMA_HEIGHTS_OVERLAP``,
    ``launch_grouped_mma(independent=True)``): every class but the first, whose rows neither it reads
    nor writes. The runtime's rule (``_overlaps``) and the planner's compile requests."""
    return MMA_HEIGHTS_OVERLAP and rows is not None and rows[0] > 0


def _overlaps(launches, i: int) -> bool:
    """``overlaps_previous_class`` for launch ``i`` of a GEMM's (configuration, plan, rows) launches,
    only where the launches before it run: a class whose plan holds no tiles launches nothing, and
    the next would then follow the kernel that wrote its inputs."""
    return overlaps_previous_class(launches[i][2]) and all(pl.max_tiles > 0 for _, pl, _ in launches[:i])


#: GEMM 2's pair rows on the decode path (its partial sums, which the combine reads back) where K is
#: not split: "bf16" (each pair's sum rounded once, as the wgmma path's ``PAIR_ROWS_DTYPE``) or "fp32".
#: bf16 halves their traffic (at 256 GLM-5 tokens 50 MB written and read back in fp32). H200, GLM-5
#: layer, replays interleaved in one process (scripts/try_moe_layer_ab.py --name MMA_PAIR_ROWS,
#: benchmarks/raw/try-moe-pair-rows-h200.json): 64 tokens 1,263 -> 1,256 us (twice), 128 tokens
#: 1,482 -> 1,471, 256 tokens 1,684 -> 1,667 and 1,737 -> 1,726 (0.6-1.0%)
MMA_PAIR_ROWS = "bf16"


def mma_pair_rows(cfg2, chunks: int, out_dtype: str) -> str:
    """The dtype ("bf16" or "fp32") of GEMM 2's partial sums on the decode path for its
    configuration ``cfg2`` on weights of ``chunks`` 64-K chunks and a layer output of ``out_dtype``
    ("bf16" or "fp16"): ``MMA_PAIR_ROWS`` for bf16 outputs, fp32 for fp16 ones (3 more bits than a
    bf16 row keeps) and wherever K is split (each split's sum would be rounded)."""
    from .mma_layout import _split

    bf16 = MMA_PAIR_ROWS == "bf16" and out_dtype == "bf16" and _split(cfg2, chunks)[1] == 1
    return "bf16" if bf16 else "fp32"


def _run_mma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, interleaved, w13_bias, w2_bias,
             shared_out, out, fused=None, requant=None):
    """GEMM 1 with its epilogue (globals, bias, SwiGLU) in the kernel (``fuses_swiglu``), else GEMM 1
    partials -> epilogue kernel; GEMM 2 partials -> its epilogue (globals, bias, routing weight) and
    the combine in one kernel; ``cfg`` (an ``MMAConfig``, or ``MMAHeights``: two launches per GEMM)
    for GEMM 1 and, through ``mma_moe_gemm2_config``, GEMM 2, the plan made for ``cfg.block_m``;
    the second class launch of each GEMM overlaps the first (``_overlaps``); ``fused`` (None:
    ``decode_fuses_swiglu``) pins GEMM 1's variant. ``requant``
    (emulated W4A4, ``_w4a4_activations``): h -> (GEMM 2's bf16 input, w2 with its global scales) between
    the GEMMs; h (in ``out``'s dtype, x's) is then zero in the rows of dropped slots."""
    from .mma_layout import launch_grouped_mma, launch_grouped_mma_swiglu

    T, H = x.shape
    I = w2.shape[2]
    p13, p2 = packed
    h = (torch.zeros if requant else torch.empty)((T * k, I), dtype=out.dtype, device=x.device)
    if fused is None:
        fused = decode_fuses_swiglu(cfg, activation, interleaved, I, plan.max_tiles, x.device)
    if isinstance(cfg, MMAHeights):  # each class's tiles over the same plan (both maps before the GEMMs)
        maps = plan.class_tiles  # ``packed_dispatch``'s; a plan made without them gets a launch per class
        if [(t.block_m, t.rows) for t in maps] != [(c.block_m, rows) for c, rows in cfg.classes()]:
            maps = [tile_map(plan, c.block_m, rows) for c, rows in cfg.classes()]
        launches = [(c, replace(plan, tiles=t), rows) for (c, rows), t in zip(cfg.classes(), maps)]
    else:
        launches = [(cfg, plan, None)]
    part = None
    globals13 = _weight_globals(w13) if fused else None  # once, before the launches (any copy it makes too)
    for i, (c, pl, _) in enumerate(launches):
        ind = _overlaps(launches, i)
        if fused:
            launch_grouped_mma_swiglu(x, p13, I, pl, c, h, globals13, w13_bias, independent=ind)
        else:
            part = launch_grouped_mma(x, p13, 2 * I, pl, c, gather=True, out=part, independent=ind)
    if not fused:
        launch_partials_epilogue(part, w13, plan, h, swiglu=_SWIGLU[activation], interleaved=interleaved,
                                 scatter=False, row_weight=None, bias=w13_bias)
    if requant:
        h, w2 = requant(h)
    # GEMM 2 follows GEMM 1 (and, unfused, the epilogue): dispatch wrote the plan two or more kernels back
    part = None
    pair_rows = mma_pair_rows(mma_moe_gemm2_config(launches[0][0]), p2.words.shape[1],
                              "bf16" if out.dtype == torch.bfloat16 else "fp16")
    dtype = torch.bfloat16 if pair_rows == "bf16" else torch.float32
    for i, (c, pl, rows) in enumerate(launches):
        part = launch_grouped_mma(h, p2, H, pl, mma_moe_gemm2_config(c, rows), gather=False, plan_ready=True, out=part,
                                  independent=_overlaps(launches, i), dtype=dtype)
    return launch_partials_combine(part, w2, plan, topk_ids, _pair_weights(topk_weights), shared_out, w2_bias, out)


#: GEMM 2 runs the short tails with narrower wgmmas too (``WgmmaConfig.tail_m``). Off until
#: session 8: with both tile variants GEMM 2 spilled 8 bytes (session 5's kernel) and the sweep was
#: mixed (7,096 -> 6,824 us at 4096 tokens, 22,171 -> 22,954 at 16384, scripts/sweep_moe_tails.py).
#: Since the scales come by TMA and the pair rows are bf16, the GLM-5 configuration of GEMM 2 with
#: tails (per-expert globals, no bias) does not spill; without tails it spills 40 B, and with bias and
#: per-row globals 56 B, all outside the main loop (``plan.sass.loop_local_memory_ops``). The tails
#: took 4096 tokens 6,162 -> 5,572 us (scripts/sweep_moe_prefill.py).
_GEMM2_TAILS = True


#: GEMM 2's per-pair output rows on the wgmma path (prefill), which the combine reads back: bf16
#: (each expert's weighted output rounded once before the fp32 sum in slot order) halves the
#: traffic of fp32 rows, 805 MB of them at 4096 GLM-5 tokens.
PAIR_ROWS_DTYPE = torch.bfloat16


def wgmma_gemm2_config(cfg):
    """GEMM 2's configuration on the plan GEMM 1's ``cfg`` was chosen for (``_GEMM2_TAILS``)."""
    return cfg if _GEMM2_TAILS else cfg.with_tail(0)


def _run_wgmma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, w13_bias, w2_bias, shared_out,
               out, requant=None):
    """GEMM 1 with the activation fused (writes h) -> GEMM 2 with the routing weight, scattered to
    pair rows -> combine; ``cfg`` GEMM 1's ``WgmmaConfig`` (GEMM 2's: ``wgmma_gemm2_config``), the
    plan made for its block_m. ``requant`` as ``_run_mma``'s: h is then written in K order (the
    quantizer's blocks are 16 consecutive K) and ``requant`` returns it in GEMM 2's MMA K order."""
    from .mma_layout import KCHUNK, launch_grouped_wgmma

    T, H = x.shape
    I = w2.shape[2]
    p13, p2 = packed
    # h in GEMM 2's MMA K order (its columns past I, if any, stay zero): GEMM 2's TMA reads it as it is
    i_stored = p2.words.shape[1] * KCHUNK
    if requant:
        h = torch.zeros((T * k, I), dtype=out.dtype, device=x.device)
    else:
        h = (torch.empty if i_stored == I else torch.zeros)((T * k, i_stored), dtype=x.dtype, device=x.device)
    alpha, limit = GPT_OSS_ALPHA, GPT_OSS_LIMIT
    launch_grouped_wgmma(x, p13, 2 * I, plan, h, cfg, gather=True, out_mma_order=not requant,
                         swiglu=_SWIGLU[activation], alpha=alpha, limit=limit, globals_=_weight_globals(w13),
                         bias=w13_bias)
    if requant:
        h, w2 = requant(h, k_stored=i_stored)
    y_pair = torch.empty((T * k, H), dtype=PAIR_ROWS_DTYPE, device=x.device)
    # per sorted row: reading it per pair in this kernel's epilogue costs GEMM 2 ~170 B of spills
    row_w = _pair_weights(topk_weights)[plan.sorted_pair.long()]
    launch_grouped_wgmma(h, p2, H, plan, y_pair, wgmma_gemm2_config(cfg), gather=False, x_mma_order=True,
                         globals_=_weight_globals(w2), bias=w2_bias, row_weight=row_w, scatter=True)
    return launch_combine(y_pair, topk_ids, k, shared_out, out, w13.shape[0])


def packed_dispatch(topk_ids: torch.Tensor, n_experts: int, cfg):
    """The dispatch plan for the packed kernels' configuration ``cfg``: for ``MMAHeights`` with
    each class's tile map (``DispatchPlan.class_tiles``, written in the plan's own launch where the
    dispatch places its pairs in one: two launches fewer before GEMM 1)."""
    classes = tuple((c.block_m, rows) for c, rows in cfg.classes()) if isinstance(cfg, MMAHeights) else ()
    return dispatch(topk_ids, n_experts, cfg.block_m, classes=classes)


def _run_packed(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, interleaved, w13_bias, w2_bias,
                shared_out, out, fused=None, mode: str = "w4a16", input_global_scale=None):
    """The layer on the packed kernels of ``cfg`` (emulated W4A4: ``_w4a4_activations``)."""
    from .mma_layout import MMAConfig

    requant = None
    if mode == "w4a4":  # emulated: each GEMM's activations quantized, then dequantized for the W4A16 kernels
        x, w13 = _w4a4_activations(x, input_global_scale, w13)
        requant = functools.partial(_w4a4_requantize, w2=w2)
    if isinstance(cfg, (MMAConfig, MMAHeights)):
        return _run_mma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, interleaved, w13_bias,
                        w2_bias, shared_out, out, fused, requant)
    return _run_wgmma(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, w13_bias, w2_bias,
                      shared_out, out, requant)


def _w4a4_activations(x: torch.Tensor, global_scale: torch.Tensor | None, w: FP4Tensor,
                      k_stored: int | None = None) -> tuple[torch.Tensor, FP4Tensor]:
    """Emulated W4A4 on the packed W4A16 kernels, as ``ops.linear`` runs it: x quantized to NVFP4
    (``global_scale``, or None: dynamic) and dequantized to bf16 without its global scale (exact),
    and ``w`` with its global scales times that one, which the GEMM epilogues apply to the fp32
    sums (before the SwiGLU). In x's order both in one kernel (``fake_quantize_activations``); in
    GEMM 2's MMA K order (``k_stored``, the wgmma path) by the quantizer and the dequantize kernel.
    The product of the globals is formed in that kernel's first program, or by torch where there
    are too many globals for it (per-row globals [E, N] of real layers); it comes back as [E, 1] or
    [E, N], shapes ``_weight_globals`` reads without a copy."""
    from .quantize import MAX_WEIGHT_GLOBALS, fake_quantize_activations

    wv, mode = _weight_globals(w)  # contiguous [E] or [E, N], kept with w's globals: no copy per call
    wg = wv if wv.numel() <= MAX_WEIGHT_GLOBALS else None
    x_hat, g = fake_quantize_activations(x, global_scale, wg, k_stored=k_stored)
    if wg is None:
        g = wv * g
    return x_hat, replace(w, global_scale=g.reshape(-1, 1) if mode == 1 else g)


def _w4a4_requantize(h: torch.Tensor, w2: FP4Tensor, k_stored: int | None = None) -> tuple[torch.Tensor, FP4Tensor]:
    """Emulated W4A4 between the GEMMs: h re-quantized over all its rows with one dynamic global
    scale, as ``_run`` does, then ``_w4a4_activations`` for GEMM 2 (``k_stored``: in its MMA K order)."""
    return _w4a4_activations(h, None, w2, k_stored)


def _forward_mma(x, w13, w2, packed, topk_ids, topk_weights, k, activation, interleaved, w13_bias, w2_bias,
                 shared_out, out, cfg, mode: str = "w4a16", input_global_scale=None):
    E = w13.shape[0]
    layout = "interleaved" if interleaved else "gate_up"
    wg_mode = _weight_globals(w13)[1]
    has_bias = w13_bias is not None or w2_bias is not None
    fused = None
    if str(cfg).startswith("mma"):  # GEMM 1's variant, decided once: the probe runs the same one
        fused = decode_fuses_swiglu(cfg, activation, interleaved, w2.shape[2],
                                    max_tiles(topk_ids.numel(), E, cfg.block_m), x.device)
    variant = f"{w13.fmt},{activation},{layout},wg{wg_mode}" + (",bias" if has_bias else "") + \
        (",swiglu_fused" if fused else "")
    if mode != "w4a16":  # the emulated W4A4 chain, and the dtype its h is kept in
        variant = f"w4a4,{str(x.dtype).replace('torch.', '')},{variant}"
    kernel = "fp4_moe_mma" if str(cfg).startswith("mma") else "fp4_moe_wgmma"
    key = guard.GuardKey(kernel=f"{kernel}[{variant}]", config=str(cfg), device=guard.device_name(x.device))
    if guard.should_check(key):
        guard.check(key, lambda: _probe(x.device, x.dtype, w13.fmt.name, activation, interleaved, mode, None,
                                        per_row=wg_mode == 2, bias=has_bias, mma_config=cfg, fused=fused),
                    tolerance="fp4_moe" if mode == "w4a16" else "fp4_moe_w4a4")
    if guard.use_reference(key):
        return fp4_moe_reference(x, w13, w2, topk_ids, topk_weights, activation=activation, interleaved=interleaved,
                                 w13_bias=w13_bias, w2_bias=w2_bias, shared_out=shared_out, mode=mode,
                                 input_global_scale=input_global_scale)
    plan = packed_dispatch(topk_ids, E, cfg)
    return _run_packed(x, w13, w2, packed, topk_ids, topk_weights, plan, cfg, k, activation, interleaved, w13_bias,
                       w2_bias, shared_out, out, fused, mode, input_global_scale)


@dataclass
class MoEProblem:
    """A random MoE layer's inputs (``random_moe_problem``): the arguments of ``fp4_moe_experts``."""

    x: torch.Tensor
    w13: FP4Tensor
    w2: FP4Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None


def random_moe_problem(T: int, E: int, k: int, H: int, I: int, fmt: str, *, device, dtype=torch.bfloat16,
                       seed: int = 0, per_row: bool = False, bias: bool = False,
                       dropped: tuple[int, int] | None = None) -> MoEProblem:
    """Random activations, experts quantized to ``fmt`` with one global per expert (``per_row``: gate and up rows of w13 with
    their own globals, as checkpoints that quantized them separately; NVFP4 only), distinct top-k
    experts per token, weights in [0, 1); ``dropped`` = (token, slot) marks one slot dropped (id -1,
    weight 0, as OEA leaves them). Built on the CPU from ``seed``, then moved to ``device``."""
    from ..quantize import quantize_stacked

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    w13 = quantize_stacked(torch.randn(E, 2 * I, H, generator=g), fmt)
    if per_row:
        if w13.global_scale is None:
            raise ValueError(f"per_row: {fmt} has no global scales")
        gs = w13.global_scale * torch.linspace(0.5, 2.0, 2 * I).reshape(1, 2 * I)
        w13 = FP4Tensor(w13.data, w13.scales, gs.contiguous(), w13.shape, w13.fmt)
    w13 = w13.to(device)
    w2 = quantize_stacked(torch.randn(E, H, I, generator=g), fmt).to(device)  # one global per expert
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device=device, dtype=torch.int32)
    if dropped is not None:
        ids[dropped] = -1
    wts = torch.rand(T, k, generator=g).to(device) * (ids >= 0)
    b13 = torch.randn(E, 2 * I, generator=g).to(device=device, dtype=dtype) if bias else None
    b2 = torch.randn(E, H, generator=g).to(device=device, dtype=dtype) if bias else None
    return MoEProblem(x, w13, w2, ids, wts, b13, b2)


def _probe_problem(T: int, fmt: str, *, device, dtype, per_row: bool, bias: bool, hot_rows: int = 0,
                   split: int = 0) -> MoEProblem:
    """The guard's probe layer: T tokens, 5 experts, top-2, H = 128, I = 64, one dropped slot;
    ``hot_rows`` > 0 routes every token's first slot to expert 0 (T > hot_rows rows there, the
    rest spread over the others), so that tiles both taller and shorter than ``hot_rows`` run.
    ``split`` > 0: the second slot of the first ``split`` tokens goes to expert 1, the others'
    spread over experts 2-4 (a merged-tail probe: expert 0 a full tile and its tail, expert 1 a
    tile between, the rest tails)."""
    p = random_moe_problem(T, 5, 2, 128, 64, fmt, device=device, dtype=dtype, seed=4321, per_row=per_row, bias=bias,
                           dropped=(3, 1))
    if hot_rows:
        ids = p.topk_ids.clone()
        ids[:, 0] = 0
        t = torch.arange(T, device=ids.device, dtype=ids.dtype)
        spread = torch.where(t < split, 1, 2 + t % 3) if split else 1 + t % 4
        ids[:, 1] = torch.where(ids[:, 1] >= 0, spread, ids[:, 1])  # distinct from slot 0; the dropped slot stays
        p = replace(p, topk_ids=ids)
    return p


def _probe_rows(mma_config) -> tuple[int, int, int]:
    """(T, hot_rows, split) of ``_probe_problem`` for the probe of ``mma_config`` (``_probe``)."""
    tail = getattr(mma_config, "tail_m", 0)
    if getattr(mma_config, "merge_tail", False):
        return mma_config.block_m + 8, tail, tail + 8  # expert 1: tail + 7 rows (the dropped slot is its)
    if isinstance(mma_config, MMAHeights):  # expert 0 two large tiles, the others at most ``rows`` rows
        return mma_config.block_m + 4, mma_config.rows, 0
    return (tail + 8 if tail else 7), tail, 0


def _probe(device, dtype, fmt, activation, interleaved, mode, configs, *, per_row=False, bias=False,
           mma_config=None, fused=None):
    """A small layer through the same launches, configurations and variant (dtype, per-row globals,
    biases, one dropped slot; ``fused``: the decode path's GEMM 1 variant), and its reference. With a
    tail height (``WgmmaConfig.tail_m``) one expert gets more rows than it, so both of GEMM 1's
    tile variants run; with ``merge_tail`` that expert gets a full tile and a short one (merged),
    another one more rows than the tail and fewer than a tile, the rest at most the tail. With
    ``MMAHeights`` one expert has more rows than a large tile and the others at most ``rows``."""
    k, E = 2, 5
    T, hot_rows, split = _probe_rows(mma_config)
    p = _probe_problem(T, fmt, device=device, dtype=dtype, per_row=per_row, bias=bias, hot_rows=hot_rows, split=split)
    out = torch.empty((T, 128), dtype=dtype, device=device)
    if mma_config is not None:  # the packed-layout path, with the caller's configuration
        packed = (mma_packed_experts(p.w13), mma_packed_experts(p.w2))
        out = _run_packed(p.x, p.w13, p.w2, packed, p.topk_ids, p.topk_weights,
                          packed_dispatch(p.topk_ids, E, mma_config), mma_config, k, activation, interleaved,
                          p.w13_bias, p.w2_bias, None, out, fused, mode)
    else:
        out = _run(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, dispatch(p.topk_ids, E, configs[0].block_m), configs,
                   k, _act_code(mode, p.w13, device), activation, interleaved, p.w13_bias, p.w2_bias, None, None, out)
    return out, fp4_moe_reference(p.x, p.w13, p.w2, p.topk_ids, p.topk_weights, activation=activation,
                                  interleaved=interleaved, mode=mode, w13_bias=p.w13_bias, w2_bias=p.w2_bias)


# ----------------------------------------------------------------------------------------------
# reference


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation == "silu":
        return gate / (1.0 + torch.exp(-gate)) * up
    gate = gate.clamp(max=GPT_OSS_LIMIT)
    up = up.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return gate / (1.0 + torch.exp(-GPT_OSS_ALPHA * gate)) * (up + 1.0)


def fp4_moe_reference(x: torch.Tensor, w13: FP4Tensor, w2: FP4Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, *, activation: Activation = "silu", interleaved: bool = False,
                      w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                      shared_out: torch.Tensor | None = None, mode: str = "w4a16",
                      input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The numerics the kernels match: fp32 products of dequantized weights; the SwiGLU output is
    rounded to x's dtype (the kernels store it so); each token sums its k expert outputs in slot
    order in fp32, then adds the shared-expert output, and rounds once to x's dtype. (The SM90
    wgmma path rounds each weighted expert output to bf16 before that sum, ``PAIR_ROWS_DTYPE``: the
    tests' tolerance covers it.)
    W4A4: x is quantized to NVFP4 once ([T, H], one global scale), and the SwiGLU outputs of all
    T*k pairs are quantized together ([T*k, I], dynamic global scale) before the second GEMM."""
    from ..quantize import quantize

    E, I, H, k = check_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    if mode not in ("w4a16", "w4a4"):
        raise ValueError(f"mode: expected 'w4a16' or 'w4a4', got {mode!r}")
    W13 = dequantize(w13, torch.float32)
    W2 = dequantize(w2, torch.float32)
    if interleaved:
        gate_w, up_w = W13[:, 0::2], W13[:, 1::2]
        gate_b = w13_bias[:, 0::2] if w13_bias is not None else None
        up_b = w13_bias[:, 1::2] if w13_bias is not None else None
    else:
        gate_w, up_w = W13[:, :I], W13[:, I:]
        gate_b = w13_bias[:, :I] if w13_bias is not None else None
        up_b = w13_bias[:, I:] if w13_bias is not None else None
    xf = x.to(torch.float32)
    if mode == "w4a4":
        xf = dequantize(quantize(x, "nvfp4", input_global_scale), torch.float32)
    T = x.shape[0]
    kept = (topk_ids >= 0) & (topk_ids < E)  # other ids are dropped slots (OEA marks them -1)
    hs = []
    for s in range(k):
        ids = torch.where(kept[:, s], topk_ids[:, s], 0).long()
        g = torch.einsum("th,tih->ti", xf, gate_w[ids])
        u = torch.einsum("th,tih->ti", xf, up_w[ids])
        if gate_b is not None:
            g = g + gate_b[ids].float()
            u = u + up_b[ids].float()
        h = _activate(g, u, activation).to(x.dtype)
        hs.append(torch.where(kept[:, s, None], h, torch.zeros_like(h)))  # dropped slots: zero rows
    h_all = torch.stack(hs, 1).reshape(T * k, I)  # pair order t * k + s
    if mode == "w4a4":
        h_all = dequantize(quantize(h_all, "nvfp4"), x.dtype)
    h_all = h_all.to(torch.float32).reshape(T, k, I)
    acc = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for s in range(k):
        ids = torch.where(kept[:, s], topk_ids[:, s], 0).long()
        h = h_all[:, s]
        y = torch.einsum("ti,thi->th", h, W2[ids])
        if w2_bias is not None:
            y = y + w2_bias[ids].float()
        y = topk_weights[:, s].to(torch.float32)[:, None] * y
        acc = acc + torch.where(kept[:, s, None], y, torch.zeros_like(y))
    if shared_out is not None:
        acc = acc + shared_out.to(torch.float32)
    return acc.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# torch.library custom op (torch.compile and CUDA graphs see one opaque op)


@torch.library.custom_op("fp4moe::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, w13_data: torch.Tensor, w13_scales: torch.Tensor, w13_global: torch.Tensor | None,
                    w2_data: torch.Tensor, w2_scales: torch.Tensor, w2_global: torch.Tensor | None, fmt: str,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str, interleaved: bool,
                    w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                    shared_out: torch.Tensor | None, mode: str,
                    input_global_scale: torch.Tensor | None) -> torch.Tensor:
    E, two_i, half_h = w13_data.shape
    H = half_h * 2
    w13 = FP4Tensor(w13_data, w13_scales, w13_global, torch.Size((E, two_i, H)), fmt)
    w2 = FP4Tensor(w2_data, w2_scales, w2_global, torch.Size((E, H, two_i // 2)), fmt)
    return fp4_moe_experts(x, w13, w2, topk_ids, topk_weights, activation=activation,  # type: ignore[arg-type]
                           interleaved=interleaved, w13_bias=w13_bias, w2_bias=w2_bias, shared_out=shared_out,
                           mode=mode, input_global_scale=input_global_scale)


@_moe_experts_op.register_fake
def _moe_experts_fake(x, w13_data, w13_scales, w13_global, w2_data, w2_scales, w2_global, fmt, topk_ids,
                      topk_weights, activation, interleaved, w13_bias, w2_bias, shared_out, mode, input_global_scale):
    return torch.empty_like(x)


def moe_experts(x: torch.Tensor, w13: FP4Tensor, w2: FP4Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                *, activation: Activation = "silu", interleaved: bool = False, w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None, shared_out: torch.Tensor | None = None, mode: str = "w4a16",
                input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``fp4_moe_experts`` through the ``fp4moe::moe_experts`` custom op (the module's entry point),
    or directly where nothing traces the call (``ops._direct.runs_direct``)."""
    from ._direct import runs_direct

    check_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    if runs_direct(x, w13.data, w13.scales, w13.global_scale, w2.data, w2.scales, w2.global_scale, topk_ids,
                   topk_weights, w13_bias, w2_bias, shared_out, input_global_scale):
        return fp4_moe_experts(x, w13, w2, topk_ids, topk_weights, activation=activation, interleaved=interleaved,
                               w13_bias=w13_bias, w2_bias=w2_bias, shared_out=shared_out, mode=mode,
                               input_global_scale=input_global_scale)
    return _moe_experts_op(x, w13.data, w13.scales, w13.global_scale, w2.data, w2.scales, w2.global_scale,
                           w13.fmt.name, topk_ids, topk_weights, activation, interleaved, w13_bias, w2_bias,
                           shared_out, mode, input_global_scale)


def compile_request(cfg: MoEGemmConfig, fmt: str, cc: int, *, swiglu: int, gather: bool, scatter: bool,
                    out_dtype: str = "bf16", act: int = 0, x_dtype: str = "bf16"):
    """Cross-compilation request (``fp4moe.plan.crosscompile``) for one grouped GEMM, with the
    constexprs ``launch_moe_gemm`` passes for activations of ``x_dtype`` ("bf16"/"fp16")."""
    from ..formats import get_format
    from ..plan.crosscompile import CompileRequest

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
