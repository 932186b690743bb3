"""Roofline arithmetic: bytes, FLOPs and lower bounds on time. Pure functions, no GPU.

Units: bytes, FLOPs, GB/s (1e9 B/s), TFLOP/s (1e12 FLOP/s), microseconds.
"""

from __future__ import annotations

from ..formats import FP4Format, get_format

__all__ = ["fp4_weight_bytes", "linear_bytes", "linear_flops", "roofline_us", "fraction", "gbs", "tflops"]


def fp4_weight_bytes(N: int, K: int, fmt: str | FP4Format) -> int:
    """Bytes of an [N, K] FP4 weight: packed codes ``N*K/2`` plus one scale byte per block.

    The per-tensor global scale (4 bytes, NVFP4) is ignored.
    """
    fmt = get_format(fmt)
    if N < 0 or K < 0:
        raise ValueError(f"N, K: expected non-negative sizes, got N={N}, K={K}")
    if K % fmt.block_size:
        raise ValueError(f"K: expected a multiple of the {fmt} block size {fmt.block_size}, got {K}")
    return N * K // 2 + N * K // fmt.block_size


def linear_bytes(M: int, N: int, K: int, fmt: str | FP4Format) -> int:
    """Least traffic of ``y[M, N] = x[M, K] @ w[N, K].T``: FP4 weight + bf16 x read + bf16 y written."""
    return fp4_weight_bytes(N, K, fmt) + 2 * M * K + 2 * M * N


def linear_flops(M: int, N: int, K: int) -> int:
    """Multiply-adds of an [M, K] x [K, N] product, counted as 2 FLOPs each."""
    return 2 * M * N * K


def roofline_us(nbytes: float, flops: float, bandwidth_gbs: float, peak_tflops: float) -> float:
    """Lower bound on time: the larger of ``bytes / bandwidth`` and ``flops / peak``, in µs."""
    if bandwidth_gbs <= 0 or peak_tflops <= 0:
        raise ValueError(f"expected a positive bandwidth and peak, got {bandwidth_gbs} GB/s, {peak_tflops} TFLOP/s")
    return max(nbytes / (bandwidth_gbs * 1e3), flops / (peak_tflops * 1e6))


def fraction(measured_us: float, bound_us: float) -> float:
    """How close a measurement is to its bound: ``bound / measured`` (1.0 means at the bound)."""
    if not measured_us > 0:
        raise ValueError(f"measured_us: expected a positive time, got {measured_us}")
    return bound_us / measured_us


def gbs(nbytes: float, us: float) -> float:
    """Bandwidth in GB/s of moving ``nbytes`` in ``us`` microseconds."""
    return nbytes / (us * 1e3)


def tflops(flops: float, us: float) -> float:
    """Throughput in TFLOP/s of ``flops`` in ``us`` microseconds."""
    return flops / (us * 1e6)
