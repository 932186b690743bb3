"""FP4 linear layer: configuration, path choice, launcher, torch reference and custom op.

Layers, from the bottom: ``kernels.linear.fp4_linear_kernel`` (the @triton.jit body) ->
``launch_linear`` (grid, strides, one launch) -> ``fp4moe::linear`` (torch.library custom op
with a fake implementation, so torch.compile and CUDA graphs see a plain op) ->
``fp4_linear`` (the public function) -> ``fp4moe.nn.FP4Linear`` (the module).
``fp4_linear_reference`` beside them defines the numerics.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from .. import guard
from ..target import Arch
from ..formats import NVFP4, FP4Format, get_format
from ..quantize import FP4Tensor, dequantize, quantize
from ..tuning import current_tuning
from ._runtime import arch_kwargs, check_native_fp4, device_arch, fast_decode, fast_fold, interpreting, mma_dtype
from .split_k import reduce_splits

Mode = Literal["w4a16", "w4a4"]
Path = Literal["w4a16", "w4a4_emulated", "w4a4_native"]
_ACT_CODE = {"w4a16": 0, "w4a4_emulated": 1, "w4a4_native": 2}
_X_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LinearConfig:
    """Tile shape and launch parameters of ``fp4_linear_kernel``.

    block_n: weight rows per program (the MMA's M side); block_m: tokens per program;
    block_k: K elements per loop step (a multiple of the format's block size and of 64);
    split_k: programs sharing one output tile along K (>1 writes fp32 partials that a second,
    deterministic kernel adds): more programs in flight when N alone does not fill the GPU.
    """

    block_n: int
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"LinearConfig.{name}: expected a power of two >= 16, got {v}")
        if self.block_k < 64:
            raise ValueError(f"LinearConfig.block_k: expected >= 64, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LinearConfig.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"LinearConfig.num_stages: expected 1..8, got {self.num_stages}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"LinearConfig.split_k: expected 1..64, got {self.split_k}")

    def __str__(self) -> str:
        split = f"_split{self.split_k}" if self.split_k > 1 else ""
        return f"n{self.block_n}_m{self.block_m}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}{split}"

    @staticmethod
    def from_heuristic(M: int, N: int, K: int, *, path: Path, arch: Arch | None, sm_count: int | None = None) -> LinearConfig:
        return choose_config(M, N, K, path=path, arch=arch, sm_count=sm_count)


def choose_config(M: int, N: int, K: int, *, path: Path, arch: Arch | None, sm_count: int | None = None) -> LinearConfig:
    """The one place where a configuration is chosen from the problem and the target.

    Decode (M <= 64) is bound by reading W: small ``block_n`` so that N / block_n gives every
    SM two or more programs, and a long ``block_k`` so each program streams wide rows.
    Prefill is bound by the tensor cores: 128x128 tiles, software-pipelined.
    On a known architecture the choice is then stepped down until the shared-memory model of
    ``fp4moe.target.smem`` fits ``arch.smem_per_block_optin`` (``fit_shared_memory``).
    """
    cfg = _heuristic_config(M, N, K, path=path, arch=arch, sm_count=sm_count)
    return fit_shared_memory(cfg, path, arch) if arch is not None else cfg


@functools.lru_cache(maxsize=4096)  # runs on every forward call through choose_config
def config_smem_bytes(config: LinearConfig, path: Path, arch: Arch) -> int:
    """Modelled shared memory of ``config`` on ``arch`` (``fp4moe.target.smem``): the most of any
    weight format (NVFP4, MXFP4: their scale tiles differ) and activation dtype (bf16, fp16)."""
    from ..target.smem import linear_smem

    return max(linear_smem(config.block_n, config.block_m, config.block_k, config.num_warps, config.num_stages,
                           config.split_k, path=path, arch=arch, group=group, x_dtype=x_dtype).total
               for group in (16, 32) for x_dtype in ("bf16", "fp16"))


def fit_shared_memory(config: LinearConfig, path: Path, arch: Arch) -> LinearConfig:
    """``config``, or the nearest smaller one whose modelled shared memory fits ``arch``'s per-block
    limit: fewer pipeline stages first (down to 2), then a shorter K tile, then fewer tokens per
    tile, then fewer weight rows, then no pipeline."""
    from dataclasses import replace

    limit = arch.smem_per_block_optin
    cfg = config
    while config_smem_bytes(cfg, path, arch) > limit:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 64:
            cfg = replace(cfg, block_k=cfg.block_k // 2)
        elif cfg.block_m > 16:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        elif cfg.block_n > 64:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=1)
        else:
            raise ValueError(f"fit_shared_memory: no configuration below {config} fits {limit:,} B of shared "
                             f"memory on {arch.name} (path {path})")
    return cfg


def _heuristic_config(M: int, N: int, K: int, *, path: Path, arch: Arch | None,
                      sm_count: int | None = None) -> LinearConfig:
    sms = sm_count or 132
    if path == "w4a4_native" and arch is not None and arch.fp4_mma == "tcgen05":
        # tcgen05 MMAs are 64 or 128 rows tall (the weight side here). Not tuned on silicon.
        return LinearConfig(block_n=128, block_m=16 if M <= 16 else (64 if M <= 64 else 128), block_k=128,
                            num_warps=4 if M <= 64 else 8, num_stages=3)
    if M <= 256:
        # 64-row weight tiles, 4 warps, no cp.async pipeline (num_stages=1: loads land in the
        # coalesced layout the decoder wants); each program is bound by its in-register decoding, so
        # K is split until there are ~2 programs per SM (docs/performance-engineering.md,
        # ``choose_config``)
        block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
        block_k = 256 if M <= 16 else 128
        tiles = -(-N // 64) * -(-M // block_m)
        split = 1
        while tiles * split < 1.9 * sms and K // (block_k * split * 2) >= 2:
            split *= 2
        return LinearConfig(block_n=64, block_m=block_m, block_k=block_k, num_warps=4, num_stages=1, split_k=split)
    # prefill: 128 weight rows x 256 tokens per program with wgmma; with mma.sync (SM80/89/120)
    # that tile spills registers, 128 x 128 does not (docs/performance-engineering.md, ``choose_config``)
    if arch is None or arch.bf16_mma == "wgmma":
        return LinearConfig(block_n=128, block_m=256, block_k=64, num_warps=8, num_stages=3)
    return LinearConfig(block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=3)


def target_path(mode: Mode, arch: Arch | None) -> Path:
    """The path compiled code takes on ``arch``: W4A16 everywhere; W4A4 on native FP4 MMA where
    the architecture has it, else emulated. (``fp4moe.plan`` plans with this for any target.)"""
    if mode == "w4a16":
        return "w4a16"
    if arch is not None and arch.fp4_mma != "none":
        return "w4a4_native"
    return "w4a4_emulated"


def runs_packed(mode: Mode, arch: Arch | None) -> bool:
    """Whether ``mode`` on ``arch`` runs the kernels on weights in MMA operand order (``ops.mma_pack``,
    where the shape and dtype allow): W4A16, and W4A4 without FP4 MMA (its activations dequantized
    for the W4A16 kernels); native W4A4 runs the Triton kernel's FP4 MMA."""
    return target_path(mode, arch) != "w4a4_native"


def choose_path(mode: Mode, arch: Arch | None, device: torch.device | None = None) -> Path:
    """``target_path``, except that the interpreter (no native FP4 MMA) runs W4A4 emulated; on
    ``device``, native FP4 MMA only where the device has it (``_runtime.check_native_fp4``)."""
    if mode == "w4a4" and interpreting():
        return "w4a4_emulated"
    path = target_path(mode, arch)
    if path == "w4a4_native" and device is not None:
        check_native_fp4(device)
    return path


# ----------------------------------------------------------------------------------------------
# validation


def _check_inputs(x: torch.Tensor, w: FP4Tensor, bias: torch.Tensor | None, mode: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, FP4Tensor):
        raise TypeError(f"w: expected an FP4Tensor (fp4moe.quantize), got {type(w).__name__}")
    if mode not in ("w4a16", "w4a4"):
        raise ValueError(f"mode: expected 'w4a16' or 'w4a4', got {mode!r}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"x: expected bfloat16 or float16, got {x.dtype}")
    if len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x: expected last dimension K={w.shape[1]} (from w {tuple(w.shape)}), got {tuple(x.shape)}")
    if mode == "w4a4" and w.fmt is not NVFP4:
        raise ValueError(f"w: mode 'w4a4' needs NVFP4 weights, got {w.fmt}")
    if w.global_scale is not None and w.global_scale.numel() != 1:
        raise ValueError(f"w: fp4_linear takes one global scale per weight, got shape "
                         f"{tuple(w.global_scale.shape)} (per-row globals are for stacked expert weights)")
    if w.data.stride(-1) != 1 or w.scales.stride(-1) != 1:
        raise ValueError("w: packed data and scales must be contiguous along K (call .contiguous())")
    if x.device != w.device:
        raise ValueError(f"x and w: expected the same device, got x on {x.device} and w on {w.device}")
    for name, part in (("scales", w.scales), ("global_scale", w.global_scale)):
        if part is not None and part.device != w.device:
            raise ValueError(f"w: its {name} are on {part.device}, its data on {w.device}: expected one device")
    if x.device.type == "cpu" and not interpreting():
        raise ValueError("x: CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter); move x and w to a CUDA device")
    if bias is not None:
        if bias.shape != (w.shape[0],):
            raise ValueError(f"bias: expected shape ({w.shape[0]},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias: expected device {x.device}, got {bias.device}")


def global_scale_tensor(value: torch.Tensor | float, device, name: str = "input_global_scale") -> torch.Tensor:
    """A static activation global scale as the one-element fp32 tensor the kernels read: a number is
    checked (positive, finite) and made with ``torch.full`` (no host-to-device copy: allowed under
    CUDA graph capture); a tensor's value is not read (no host sync)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a positive finite value, got {value!r}")
        return torch.full((1,), float(value), dtype=torch.float32, device=device)
    _check_scale_form(value, name)
    return value.detach().to(device=device, dtype=torch.float32).reshape(1)


def _check_scale_form(value, name: str) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise TypeError(f"{name}: expected None, a number or a one-element floating-point tensor, got "
                        f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")


def _check_input_global_scale(scale, x: torch.Tensor) -> None:
    """W4A4's static activation global scale: a one-element floating-point tensor on x's device
    (its value is not read here: no host sync on the hot path; numbers are checked by fp4_linear)."""
    if scale is None:
        return
    _check_scale_form(scale, "input_global_scale")
    if scale.device != x.device:
        raise ValueError(f"input_global_scale: expected device {x.device}, got {scale.device}")


# ----------------------------------------------------------------------------------------------
# launcher


def launch_linear(
    x2: torch.Tensor,
    xq: FP4Tensor | None,
    w: FP4Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    path: Path,
    config: LinearConfig,
) -> torch.Tensor:
    """One launch of the kernel. x2 is [M, K] with unit stride along K (W4A16) or xq its NVFP4
    quantization (W4A4); out is [M, N] with unit stride along N."""
    import triton

    from ..kernels.linear import fp4_linear_kernel

    M, K = x2.shape
    N = w.shape[0]
    act = _ACT_CODE[path]
    w_scales = w.scales.view(torch.uint8)
    wg = w.global_scale if w.global_scale is not None else w_scales  # unused placeholder pointer
    if act == 0:
        x_arg, xs_arg, xg_arg = x2, w_scales, wg
        stride_xm, stride_xsm = x2.stride(0), 0
        compute = mma_dtype(x2.dtype)
    else:
        assert xq is not None
        x_arg, xs_arg, xg_arg = xq.data, xq.scales.view(torch.uint8), xq.global_scale
        stride_xm, stride_xsm = xq.data.stride(0), xq.scales.stride(0)
        compute = mma_dtype(torch.bfloat16)
    split = min(config.split_k, triton.cdiv(K, config.block_k))
    k_per_split = triton.cdiv(triton.cdiv(K, split), config.block_k) * config.block_k
    split = triton.cdiv(K, k_per_split)
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    bias_arg = bias if bias is not None else w_scales
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(M, config.block_m), split)
    fp4_linear_kernel[grid](
        x_arg, xs_arg, xg_arg, w.data, w_scales, wg, bias_arg, target,
        M, N, K,
        stride_xm, stride_xsm, w.data.stride(0), w_scales.stride(0), out.stride(0), k_per_split,
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
        GROUP=w.block_size, W_E4M3=w.fmt.scale_kind == "e4m3", ACT=act,
        HAS_WG=w.global_scale is not None, HAS_BIAS=bias is not None, COMPUTE_DTYPE=compute, SPLIT_K=split,
        FAST_DECODE=fast_decode(act, x2.dtype),
        FOLD=fast_fold(act, fast_decode(act, x2.dtype), w.fmt.scale_kind == "e4m3"), num_warps=config.num_warps, num_stages=config.num_stages,
        **arch_kwargs(out.device))
    if split > 1:
        reduce_splits(target, bias, out)
    return out


def _quantize_x(x2: torch.Tensor, input_global_scale: torch.Tensor | None) -> FP4Tensor:
    from .quantize import quantize_activations

    return quantize_activations(x2, input_global_scale)


def _forward(x: torch.Tensor, w: FP4Tensor, bias: torch.Tensor | None, mode: Mode,
             input_global_scale: torch.Tensor | None, config: LinearConfig | None) -> torch.Tensor:
    """Validate, choose path and configuration, guard on first use, launch."""
    _check_inputs(x, w, bias, mode)
    _check_input_global_scale(input_global_scale, x)
    N, K = w.shape
    lead = x.shape[:-1]
    M = lead.numel()
    if M == 0 or K == 0:  # an empty sum: zeros (+ bias)
        out = torch.zeros((M, N), dtype=x.dtype, device=x.device)
        if bias is not None and M:
            out += bias.to(x.dtype)
        return out.reshape(*lead, N)
    x2 = x.reshape(-1, K)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if bias is not None and not bias.is_contiguous():  # every kernel reads the bias with unit stride
        bias = bias.contiguous()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    arch = device_arch(x.device)
    path = choose_path(mode, arch, x.device)
    props = torch.cuda.get_device_properties(x.device) if x.is_cuda else None
    sm_count = props.multi_processor_count if props is not None else None
    packed_cfg = packed_config(path, arch, M, N, K, sm_count, fmt=w.fmt,
                               l2_bytes=getattr(props, "L2_cache_size", None) or None) \
        if config is None and _use_mma_layout(x2, w, path) else None
    if (packed_cfg is not None and dequant_matmul_applies(path, arch, M, N, K, w.fmt)
            and (bias is None or bias.dtype == x.dtype)):  # addmm adds a bias of out's dtype only
        g = weight_global_host(w)
        if g is not None:
            return _forward_dequant_matmul(x, x2, w, g, bias, out).reshape(*lead, N)
    if packed_cfg is not None:
        packed = mma_packed(w)
        if packed is not None:
            return _forward_mma(x, x2, w, packed, bias, out, packed_cfg, path, input_global_scale).reshape(*lead, N)
    cfg = config or choose_config(M, N, K, path=path, arch=arch, sm_count=sm_count)
    key = guard.GuardKey(kernel=f"fp4_linear[{path},{w.fmt},{x.dtype}]".replace("torch.", ""),
                         config=str(cfg), device=guard.device_name(x.device))
    if guard.should_check(key):
        guard.check(key, lambda: _probe(x.device, x.dtype, w.fmt, mode, path, cfg))
    if guard.use_reference(key):
        return fp4_linear_reference(x, w, bias, mode=mode, input_global_scale=input_global_scale)
    xq = _quantize_x(x2, input_global_scale) if path != "w4a16" else None
    launch_linear(x2, xq, w, bias, out, path, cfg)
    return out.reshape(*lead, N)


def packed_config(path: Path, arch: Arch | None, M: int, N: int, K: int, sm_count: int | None = None, *,
                  fmt: FP4Format | str = "nvfp4", l2_bytes: int | None = None):
    """The configuration of the kernel on weights in MMA operand order (``ops.mma_pack``) that
    ``fp4_linear`` runs on compiled CUDA, or None for the Triton kernel: W4A16 decode (M <= MAX_M)
    on the mma.sync kernel, which every catalogued architecture, SM80 on, has (an ``MMAConfig``);
    W4A16 above it (M >= WGMMA_MIN_M) on SM90 on the wgmma kernel (a ``WgmmaConfig``, split along
    K up to M = 64). Emulated W4A4 (no FP4 MMA) takes the same kernels on its activations
    dequantized to bf16 (``_forward_mma``). The rest (M > MAX_M on other architectures, native
    W4A4) on the Triton kernel. ``l2_bytes``: the device's L2 (``choose_mma_config``'s)."""
    from .mma_sync import MAX_M, choose_mma_config
    from .wgmma import WGMMA_MIN_M, choose_wgmma_config

    if path == "w4a4_native" or arch is None:
        return None
    if M <= MAX_M:
        return choose_mma_config(M, N, K, sm_count or 132, fmt=fmt, arch=arch, l2_bytes=l2_bytes)
    if M >= WGMMA_MIN_M and arch.bf16_mma == "wgmma":
        return choose_wgmma_config(M, N, K, sm_count or 132)
    return None


def _use_mma_layout(x2: torch.Tensor, w: FP4Tensor, path: Path = "w4a16") -> bool:
    """Compiled CUDA with a 2-D weight, and bf16 activations or emulated W4A4 (whose dequantized
    activations are bf16 whatever x's dtype): the packed kernels' domain."""
    return ((x2.dtype == torch.bfloat16 or path == "w4a4_emulated") and x2.is_cuda and not interpreting()
            and len(w.shape) == 2)


def mma_packed(w: FP4Tensor):
    """``w`` in MMA operand order (``ops.mma_pack.pack_mma``), packed on first use and kept with
    the weight's storage (one more copy of the FP4 bytes). None while a CUDA graph is being
    captured and no pack exists yet (packing allocates): the caller then uses the Triton kernel;
    ``FP4Linear`` packs when it is moved to a GPU, so captured graphs find the pack ready. Packed
    again after ``w`` changed in place (``mma_pack.cached_pack``)."""
    from .mma_pack import cached_pack, pack_mma

    return cached_pack(w, pack_mma, with_global=True)


def dequant_matmul_applies(path: Path, arch: Arch | None, M: int, N: int, K: int, fmt: FP4Format | str) -> bool:
    """Whether ``fp4_linear`` runs ``x @ W^T`` as torch's matmul on W dequantized to bf16 (with bf16
    x): W4A16 NVFP4 on SM90 (wgmma; measured there) from ``LinearTuning.dequant_matmul_min_m`` rows,
    for a transient copy of at most ``LinearTuning.dequant_matmul_max_bytes``. At those sizes the product is bound by
    tensor cores, where cuBLAS's bf16 GEMM outruns the kernel that decodes FP4 in its main loop
    by more than one pass over the weight costs. Numerics as the kernels': the products of bf16 x
    with the exact bf16 values code x block scale, fp32 sums, the global scale applied to those
    sums (cuBLAS's alpha), bias added, one rounding (cuBLAS may reduce split-K partials in bf16
    where ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` allows it)."""
    tune = current_tuning().linear
    return (path == "w4a16" and arch is not None and arch.bf16_mma == "wgmma" and get_format(fmt) is NVFP4
            and M >= tune.dequant_matmul_min_m and N * K * 2 <= tune.dequant_matmul_max_bytes)


def weight_global_host(w: FP4Tensor) -> float | None:
    """``w``'s global scale as a Python float (1.0 without one), read once per weight (one host
    sync, with ``check_weight_scales``, which ``pack_mma`` makes on the other paths) and kept with
    the weight as its packs are (``mma_pack.cached_on_weight``); None when it would have to be
    read while a CUDA graph is being captured (the caller takes another path).
    A graph captured on ``_dequant_matmul`` keeps the value it was captured with, as every captured
    graph keeps the packed weights it was captured with: write weights before capturing."""
    from ._runtime import check_weight_scales
    from .mma_pack import cached_on_weight

    def read(w: FP4Tensor) -> float:
        check_weight_scales(w, "w")  # as pack_mma checks them for the other packed paths
        return 1.0 if w.global_scale is None else float(w.global_scale.reshape(()))

    return cached_on_weight(w, "_fp4moe_global_host", read, with_global=True)


def _forward_dequant_matmul(x, x2, w: FP4Tensor, g: float, bias, out):
    """``dequant_matmul_applies``'s path, behind the guard like every kernel: W's codes times its
    block scales to bf16 (``kernels.quantize.nvfp4_weight_dequantize_kernel``, exact), then
    ``out = g * (x2 @ W_hat^T) + bias`` in one cuBLAS GEMM (fp32 alpha, fp32 accumulation unless
    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` lets cuBLAS reduce split-K
    partials in bf16; one rounding to bf16 otherwise)."""
    key = guard.GuardKey(kernel=f"fp4_linear_dequant_matmul[{w.fmt},{x.dtype}]".replace("torch.", ""),
                         config="dequantize+torch.addmm", device=guard.device_name(x.device))
    if guard.should_check(key):
        guard.check(key, lambda: _probe_dequant_matmul(x.device, x.dtype))
    if guard.use_reference(key):
        return fp4_linear_reference(x2, w, bias).to(out.dtype)
    return _dequant_matmul(x2, w, g, bias, out)


def _dequant_matmul(x2, w: FP4Tensor, g: float, bias, out):
    from .quantize import dequantize_weight

    w_hat = dequantize_weight(w)  # without the global scale: alpha applies it to the fp32 sums
    if bias is None:
        return torch.addmm(out, x2, w_hat.t(), beta=0.0, alpha=g, out=out)
    return torch.addmm(bias, x2, w_hat.t(), beta=1.0, alpha=g, out=out)


def _probe_dequant_matmul(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A small problem through ``_dequant_matmul`` and its reference: K not a multiple of 64, a bias,
    and a global scale other than one."""
    g = torch.Generator(device="cpu").manual_seed(4321)
    M, N, K = 37, 80, 336
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    w = quantize(torch.randn(N, K, generator=g) * 3.0, NVFP4).to(device)
    bias = torch.randn(N, generator=g).to(device=device, dtype=dtype)
    out = torch.empty((M, N), dtype=dtype, device=device)
    _dequant_matmul(x, w, float(w.global_scale.reshape(())), bias, out)
    return out, fp4_linear_reference(x, w, bias)


def _forward_mma(x, x2, w, packed, bias, out, cfg, path: Path = "w4a16", input_global_scale=None):
    """The packed weights through the kernel of ``cfg``: mma.sync (``MMAConfig``) or wgmma.
    Emulated W4A4: x quantized to NVFP4 and dequantized to bf16 first (``_launch_packed``)."""
    from .mma_sync import MMAConfig

    kernel = "fp4_linear_mma" if isinstance(cfg, MMAConfig) else "fp4_linear_wgmma"
    if path == "w4a16":
        mode, name = "w4a16", f"{kernel}[{w.fmt},bfloat16]"
    else:
        mode, name = "w4a4", f"{kernel}[w4a4,{w.fmt},{x.dtype}]".replace("torch.", "")
    key = guard.GuardKey(kernel=name, config=str(cfg), device=guard.device_name(x.device))
    if guard.should_check(key):
        guard.check(key, lambda: _probe_mma(x.device, w.fmt, cfg, path, x.dtype))
    if guard.use_reference(key):
        return fp4_linear_reference(x2, w, bias, mode=mode, input_global_scale=input_global_scale).to(out.dtype)
    return _launch_packed(x2, packed, bias, out, cfg, path, input_global_scale)


def _launch_packed(x2, packed, bias, out, cfg, path: Path, input_global_scale=None):
    """``out = x2 @ W^T (+ bias)`` on the packed kernel of ``cfg``. Emulated W4A4 (GPUs without FP4
    MMA): x2 is quantized to NVFP4 (``quantize_activations``), its codes times block scales go
    back to bf16 (exact; ``fake_quantize_activations``: one kernel where x keeps its order, for the
    mma.sync kernel; in the wgmma kernel's MMA K order otherwise) and the W4A16 kernel multiplies them by the
    weights with fp32 sums, then by the product of both global scales: the products of the two
    dequantized operands, as the native FP4 MMA forms them."""
    from dataclasses import replace

    from .mma_pack import KCHUNK
    from .mma_sync import MMAConfig, launch_linear_mma
    from .wgmma import launch_linear_wgmma
    from .quantize import fake_quantize_activations

    wgmma = not isinstance(cfg, MMAConfig)
    if path != "w4a16":  # for the wgmma kernel x goes straight into its MMA K order (no second pass)
        x2, g = fake_quantize_activations(x2, input_global_scale, packed.global_scale,
                                          k_stored=packed.words.shape[1] * KCHUNK if wgmma else None)
        packed = replace(packed, global_scale=g)
    if wgmma:
        return launch_linear_wgmma(x2, packed, bias, out, cfg, x_mma_order=path != "w4a16")
    return launch_linear_mma(x2, packed, bias, out, cfg)


def _probe_mma(device: torch.device, fmt: FP4Format, cfg, path: Path = "w4a16",
               dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A small problem through the packed-layout kernel of ``cfg`` (an ``MMAConfig`` or a
    ``WgmmaConfig``) on ``path``, and its reference: more than one program along N, K not a
    multiple of 64."""
    from .mma_pack import pack_mma
    from .mma_sync import MMAConfig

    g = torch.Generator(device="cpu").manual_seed(1234)
    if isinstance(cfg, MMAConfig):
        # K: three loop steps per split, or per K slice of the in-program split
        M, N, K = 5, cfg.block_n + 16, 3 * 64 * cfg.kh * cfg.split_k * cfg.kw
    else:
        M, N, K = cfg.block_m + 3, 32 * cfg.warps + 16, 4 * 64 + 32
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    w = quantize(torch.randn(N, K, generator=g), fmt).to(device)
    bias = torch.randn(N, generator=g).to(device=device, dtype=dtype)
    out = torch.empty((M, N), dtype=dtype, device=device)
    _launch_packed(x, pack_mma(w), bias, out, cfg, path)
    return out, fp4_linear_reference(x, w, bias, mode="w4a16" if path == "w4a16" else "w4a4")


def _probe(device: torch.device, dtype: torch.dtype, fmt: FP4Format, mode: Mode, path: Path,
           cfg: LinearConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A small problem run through the same kernel, path and configuration, and its reference."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    M, N, K = 5, max(cfg.block_n, 32) + 16, 2 * cfg.block_k + 64
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    w = quantize(torch.randn(N, K, generator=g), fmt).to(device)
    bias = torch.randn(N, generator=g).to(device=device, dtype=dtype)
    out = torch.empty((M, N), dtype=dtype, device=device)
    xq = _quantize_x(x, None) if path != "w4a16" else None
    launch_linear(x, xq, w, bias, out, path, cfg)
    return out, fp4_linear_reference(x, w, bias, mode=mode)


# ----------------------------------------------------------------------------------------------
# reference


def fp4_linear_reference(x: torch.Tensor, w: FP4Tensor, bias: torch.Tensor | None = None, *, mode: Mode = "w4a16",
                         input_global_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """The numerics every path must match: fp32 product of the dequantized operands.

    W4A16: ``x @ dequantize(W)^T``. W4A4: x is first quantized to NVFP4 with ``fp4moe.quantize``
    (global scale given or amax / 2688), then both operands are dequantized. Output in x's dtype.
    """
    _check_inputs_reference(x, w, mode)
    wf = dequantize(w, torch.float32)
    xf = x.to(torch.float32)
    if mode == "w4a4":
        xf = dequantize(quantize(x.reshape(-1, x.shape[-1]), NVFP4, input_global_scale), torch.float32).reshape(x.shape)
    y = xf @ wf.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def _check_inputs_reference(x: torch.Tensor, w: FP4Tensor, mode: str) -> None:
    if not isinstance(w, FP4Tensor):
        raise TypeError(f"w: expected an FP4Tensor, got {type(w).__name__}")
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"x: expected last dimension K={w.shape[-1]}, got {tuple(x.shape)}")
    if mode == "w4a4" and w.fmt is not NVFP4:
        raise ValueError(f"w: mode 'w4a4' needs NVFP4 weights, got {w.fmt}")


# ----------------------------------------------------------------------------------------------
# torch.library custom op


@torch.library.custom_op("fp4moe::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w_data: torch.Tensor, w_scales: torch.Tensor, w_global: torch.Tensor | None,
               k: int, fmt: str, mode: str, bias: torch.Tensor | None,
               input_global_scale: torch.Tensor | None) -> torch.Tensor:
    w = FP4Tensor(data=w_data, scales=w_scales, global_scale=w_global, shape=torch.Size((w_data.shape[0], k)),
                  fmt=get_format(fmt))
    return _forward(x, w, bias, mode, input_global_scale, None)  # type: ignore[arg-type]


@_linear_op.register_fake
def _linear_fake(x, w_data, w_scales, w_global, k, fmt, mode, bias, input_global_scale):
    return x.new_empty((*x.shape[:-1], w_data.shape[0]))


def fp4_linear(x: torch.Tensor, w: FP4Tensor, bias: torch.Tensor | None = None, *, mode: Mode = "w4a16",
               config: LinearConfig | None = None,
               input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` with W an FP4Tensor [N, K].

    Args:
        x: [..., K] bfloat16 or float16 (any strides).
        w: NVFP4 or MXFP4 weight [N, K].
        mode: "w4a16" (weights decoded to x's dtype) or "w4a4" (x quantized to NVFP4 per call;
            NVFP4 weights only).
        config: pin a configuration (tests, tuning); None chooses one for the problem and GPU.
        input_global_scale: W4A4 only: a static activation global scale (fp32 one-element tensor,
            e.g. a checkpoint's ``input_scale``); None computes amax / (6 * 448) per call.
    """
    if isinstance(input_global_scale, (int, float)):
        input_global_scale = global_scale_tensor(input_global_scale, x.device if isinstance(x, torch.Tensor) else None)
    if config is not None:
        return _forward(x, w, bias, mode, input_global_scale, config)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, FP4Tensor):
        raise TypeError(f"w: expected an FP4Tensor (fp4moe.quantize), got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected None or a torch.Tensor, got {type(bias).__name__}")
    _check_input_global_scale(input_global_scale, x)
    from ._direct import runs_direct

    if runs_direct(x, w.data, w.scales, w.global_scale, bias, input_global_scale):  # nothing traces: no custom op
        return _forward(x, w, bias, mode, input_global_scale, None)
    return _linear_op(x, w.data, w.scales, w.global_scale, w.shape[1], w.fmt.name, mode, bias, input_global_scale)


__all__ = ["LinearConfig", "choose_config", "choose_path", "config_smem_bytes", "fit_shared_memory", "fp4_linear",
           "fp4_linear_reference", "launch_linear", "runs_packed", "target_path"]


def compile_request(config: LinearConfig, path: Path, fmt: str | FP4Format, cc: int,
                    x_dtype: torch.dtype = torch.bfloat16, has_bias: bool = False):
    """The cross-compilation request (``fp4moe.plan.crosscompile``) for one configuration and target."""
    from ..target.compile_request import CompileRequest

    fmt = get_format(fmt)
    xt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[x_dtype]
    act = _ACT_CODE[path]
    signature = {
        "x_ptr": f"*{xt}" if act == 0 else "*u8", "xs_ptr": "*u8", "xg_ptr": "*fp32", "w_ptr": "*u8",
        "ws_ptr": "*u8", "wg_ptr": "*fp32", "bias_ptr": f"*{xt}",
        "y_ptr": "*fp32" if config.split_k > 1 else f"*{xt}",  # split K writes fp32 partial sums
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_xsm": "i32", "stride_wn": "i32",
        "stride_wsn": "i32", "stride_ym": "i32", "k_per_split": "i32",
    }
    constexprs = {
        "BLOCK_N": config.block_n, "BLOCK_M": config.block_m, "BLOCK_K": config.block_k,
        "GROUP": fmt.block_size, "W_E4M3": fmt.scale_kind == "e4m3", "ACT": act,
        "HAS_WG": fmt.has_global_scale, "HAS_BIAS": has_bias, "COMPUTE_DTYPE": xt if act == 0 else "bf16",
        "SPLIT_K": config.split_k, "FAST_DECODE": fast_decode(act, x_dtype, compiled=True),
        "FOLD": fast_fold(act, fast_decode(act, x_dtype, compiled=True), fmt.scale_kind == "e4m3"),
    }
    divisible = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_ym",
                 "k_per_split")
    return CompileRequest(kernel="fp4moe.kernels.linear:fp4_linear_kernel", signature=signature,
                          constexprs=constexprs, cc=cc, num_warps=config.num_warps, num_stages=config.num_stages,
                          divisible_by_16=divisible)
