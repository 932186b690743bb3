"""The FP4 MoE experts: dispatch -> grouped GEMM 1 (+ SwiGLU) -> grouped GEMM 2 (x routing weight)
-> deterministic combine. The public API: the op (``fp4_moe_experts``; ``moe_experts`` through its
custom op), its torch reference, the checks and the probes of the numerical guard. The execution
paths live beside it: the Triton grouped GEMM (``ops.moe_triton``) and the kernels on weights in
MMA operand order (``ops.moe_packed``); their configurations and launchers are re-exported here.

Routing (top-k ids and weights) is an input here; ``ops.routing`` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import guard
from ..kernels.moe import GPT_OSS_ALPHA, GPT_OSS_LIMIT  # gpt-oss's activation constants (one definition)
from ..quantize import FP4Tensor, dequantize
from .dispatch import dispatch, max_tiles
from .moe_packed import (PAIR_ROWS_DTYPE, MMAHeights, _run_packed, decode_fuses_swiglu, fused_programs_per_sm,
                         fuses_swiglu, mma_moe_config, mma_moe_gemm2_config, mma_moe_layer_config, mma_packed_experts,
                         mma_pair_rows, overlaps_previous_class, packed_dispatch, packed_layout_config,
                         packed_moe_kernel, wgmma_gemm2_config, wgmma_moe_config)
from .moe_triton import (_SWIGLU, Activation, MoEGemmConfig, _run, _weight_globals, choose_moe_configs, compile_request,
                         launch_combine, launch_moe_gemm, launch_partials_combine, launch_partials_epilogue)

__all__ = ["Activation", "MMAHeights", "MoEGemmConfig", "MoEProblem", "PAIR_ROWS_DTYPE", "check_mode_and_activation",
           "check_moe_extras", "check_moe_inputs", "choose_moe_configs", "compile_request", "decode_fuses_swiglu",
           "fp4_moe_experts", "fp4_moe_reference", "fused_programs_per_sm", "fuses_swiglu", "launch_combine",
           "launch_moe_gemm", "launch_partials_combine", "launch_partials_epilogue", "mma_moe_config",
           "mma_moe_gemm2_config", "mma_moe_layer_config", "mma_packed_experts", "mma_pair_rows", "moe_experts",
           "overlaps_previous_class", "packed_dispatch", "packed_layout_config", "packed_moe_kernel",
           "random_moe_problem", "wgmma_gemm2_config", "wgmma_moe_config"]


# ----------------------------------------------------------------------------------------------
# checks


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
    from ._runtime import device_arch
    from .linear import choose_path

    return 2 if choose_path("w4a4", device_arch(device), device) == "w4a4_native" else 1


# ----------------------------------------------------------------------------------------------
# the op


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
        from ._runtime import device_arch

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


# ----------------------------------------------------------------------------------------------
# problems and the numerical guard's probes


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
