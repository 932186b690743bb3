"""The GPU catalogue: every hardware fact fp4moe uses lives here and nowhere else.

Two kinds of facts, kept apart:

* ``Arch`` -- what a compute capability guarantees (shared memory, registers, which
  tensor-core instructions exist). Source: the NVIDIA CUDA C++ Programming Guide,
  "Compute Capabilities" / "Technical Specifications per Compute Capability" (cited
  below as "CUDA guide"), and the PTX ISA for instruction availability.
* ``GPU`` -- what one product has (SM count, memory, bandwidth, datasheet peaks).
  Source: the product's datasheet or architecture whitepaper, cited per entry.

Peaks are *dense* (no 2:4 sparsity). Datasheets often print the sparse figure; where
we halved it the comment says "sparse/2". Bandwidths are in GB/s (1e9 bytes/s).
``memory_gib`` is the datasheet capacity figure: HBM and GDDR parts are built from
binary-sized chips, so the marketed "GB" is the GiB figure; torch reports a little
less (ECC and driver reservations).

Looking names up, and the GPU in hand, are ``fp4moe.target.resolve``'s. Nothing happens at
import time beyond building the frozen tables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "ARCHS",
    "BF16MMA",
    "FP4MMA",
    "GPUS",
    "SUSTAINED_BANDWIDTH_FRACTION",
    "SUSTAINED_TENSOR_FRACTION",
    "Arch",
    "GPU",
    "default_gpu",
]

FP4MMA = Literal["none", "mma_sync_block_scaled", "tcgen05"]
"""How FP4 (e2m1) block-scaled MMA is issued: not at all, warp-level ``mma.sync ...
kind::mxf4nvf4.block_scale`` (SM120/SM121), or ``tcgen05.mma`` (SM100/SM103)."""

BF16MMA = Literal["mma.sync", "wgmma", "tcgen05"]
"""The widest bf16 tensor-core instruction of an architecture."""

_KIB = 1024


# --------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """What one compute capability guarantees, whatever the product."""

    name: str  # "sm90"
    capability: tuple[int, int]  # (9, 0)
    generation: str  # "Hopper"
    smem_per_block_optin: int  # bytes: max dynamic shared memory per block, with opt-in
    smem_per_sm: int  # bytes: shared memory per SM (max carveout)
    regs_per_sm: int  # 32-bit registers per SM
    max_threads_per_sm: int  # resident threads per SM
    fp4_mma: FP4MMA
    bf16_mma: BF16MMA
    has_tma: bool  # bulk copies (cp.async.bulk.tensor, and cp.async.bulk.prefetch.L2)
    has_pdl: bool  # programmatic dependent launch (griddepcontrol.wait / launch_dependents)
    has_multicast: bool  # TMA multicast to the CTAs of a cluster
    max_cluster_size: int  # portable cluster size fp4moe may plan for (1: no clusters)
    has_tmem: bool  # tensor memory (tcgen05 accumulators)
    tmem_bytes_per_sm: int  # 0 where has_tmem is False

    def __post_init__(self) -> None:
        major, minor = self.capability
        if self.name != f"sm{major}{minor}":
            raise ValueError(f"Arch name {self.name!r} does not match capability {self.capability}")
        if self.has_tmem != (self.tmem_bytes_per_sm > 0):
            raise ValueError(f"{self.name}: has_tmem={self.has_tmem} but tmem_bytes_per_sm={self.tmem_bytes_per_sm}")
        if self.smem_per_block_optin > self.smem_per_sm:
            raise ValueError(f"{self.name}: per-block shared memory exceeds the per-SM amount")
        if self.max_cluster_size < 1:
            raise ValueError(f"{self.name}: max_cluster_size must be >= 1")

    @property
    def sm_version(self) -> int:
        """The capability as one integer, as in ``sm_120``: 120."""
        major, minor = self.capability
        return major * 10 + minor

    @property
    def triton_target(self) -> tuple[str, int, int]:
        """Arguments of ``triton.backends.compiler.GPUTarget(backend, arch, warp_size)``."""
        return ("cuda", self.sm_version, 32)

    def ctas_per_sm(self, threads: int, *, registers: int | None = None, smem_bytes: int = 0) -> int:
        """Programs of ``threads`` threads resident on one SM (at least 1), limited by threads, by
        shared memory (1 KB reserved per block) and, when known, by registers per thread (allocated
        per warp in units of 256, i.e. rounded up to 8 per thread); at most 32 per SM. CUDA guide,
        occupancy calculation."""
        limits = [self.smem_per_sm // (smem_bytes + 1024), self.max_threads_per_sm // threads, 32]
        if registers:
            limits.append(self.regs_per_sm // (-(-registers // 8) * 8 * threads))
        return max(1, min(limits))

    @property
    def has_xorsign_abs_max(self) -> bool:
        """PTX ``max.xorsign.abs`` on bf16x2 (the maximum of magnitudes in one instruction): sm_86
        and newer (PTX ISA, ``max``)."""
        return self.capability >= (8, 6)

    @property
    def has_native_fp4(self) -> bool:
        """True where FP4 x FP4 block-scaled MMA runs on the tensor cores."""
        return self.fp4_mma != "none"


# Shared-memory and thread limits: CUDA guide, "Technical Specifications per Compute
# Capability" table. The per-block opt-in limit is the per-SM amount less the 1 KB that
# CUDA reserves per block (same guide). REFERENCE.md pins the opt-in limits.
# Registers: 64 K 32-bit registers per SM for every capability listed (same table).
_REGS_PER_SM = 64 * _KIB

_ARCH_LIST: tuple[Arch, ...] = (
    Arch(
        name="sm80",
        capability=(8, 0),
        generation="Ampere",
        smem_per_block_optin=163 * _KIB,  # 166,912 B -- CUDA guide, cc 8.0: 163 KB per block
        smem_per_sm=164 * _KIB,  # 167,936 B -- CUDA guide, cc 8.0: 164 KB per SM
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=2048,  # CUDA guide, cc 8.0
        fp4_mma="none",  # FP4 tensor-core MMA needs sm_100a/sm_120a (PTX ISA)
        bf16_mma="mma.sync",  # PTX ISA: mma.sync bf16 from sm_80
        has_tma=False,  # TMA arrives with sm_90 (PTX ISA, cp.async.bulk.tensor)
        has_pdl=False,
        has_multicast=False,
        max_cluster_size=1,  # thread-block clusters need cc 9.0 (CUDA guide)
        has_tmem=False,
        tmem_bytes_per_sm=0,
    ),
    Arch(
        name="sm86",
        capability=(8, 6),
        generation="Ampere",
        smem_per_block_optin=99 * _KIB,  # 101,376 B -- CUDA guide, cc 8.6: 99 KB per block
        smem_per_sm=100 * _KIB,  # 102,400 B -- CUDA guide, cc 8.6: 100 KB per SM
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=1536,  # CUDA guide, cc 8.6
        fp4_mma="none",
        bf16_mma="mma.sync",
        has_tma=False,
        has_pdl=False,
        has_multicast=False,
        max_cluster_size=1,
        has_tmem=False,
        tmem_bytes_per_sm=0,
    ),
    Arch(
        name="sm89",
        capability=(8, 9),
        generation="Ada",
        smem_per_block_optin=99 * _KIB,  # 101,376 B -- CUDA guide, cc 8.9: 99 KB per block
        smem_per_sm=100 * _KIB,  # 102,400 B -- CUDA guide, cc 8.9: 100 KB per SM
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=1536,  # CUDA guide, cc 8.9
        fp4_mma="none",  # Ada has FP8 but no FP4 tensor cores (Ada GPU architecture whitepaper)
        bf16_mma="mma.sync",
        has_tma=False,
        has_pdl=False,
        has_multicast=False,
        max_cluster_size=1,
        has_tmem=False,
        tmem_bytes_per_sm=0,
    ),
    Arch(
        name="sm90",
        capability=(9, 0),
        generation="Hopper",
        smem_per_block_optin=227 * _KIB,  # 232,448 B -- CUDA guide, cc 9.0: 227 KB per block
        smem_per_sm=228 * _KIB,  # 233,472 B -- CUDA guide, cc 9.0: 228 KB per SM
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=2048,  # CUDA guide, cc 9.0
        fp4_mma="none",  # Hopper tensor cores stop at FP8 (NVIDIA H100 whitepaper)
        bf16_mma="wgmma",  # PTX ISA: wgmma.mma_async, sm_90a
        has_tma=True,  # PTX ISA: cp.async.bulk.tensor from sm_90
        has_pdl=True,  # PTX ISA: griddepcontrol from sm_90
        has_multicast=True,  # PTX ISA: .multicast::cluster from sm_90
        max_cluster_size=8,  # CUDA guide: portable cluster size 8 (16 is non-portable)
        has_tmem=False,
        tmem_bytes_per_sm=0,
    ),
    Arch(
        name="sm100",
        capability=(10, 0),
        generation="Blackwell (datacenter)",
        smem_per_block_optin=227 * _KIB,  # 232,448 B -- CUDA guide, cc 10.0: 227 KB per block
        smem_per_sm=228 * _KIB,  # 233,472 B -- CUDA guide, cc 10.0 (Blackwell tuning guide: as H100)
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=2048,  # CUDA guide, cc 10.0
        fp4_mma="tcgen05",  # PTX ISA: tcgen05.mma kind::mxf4nvf4, sm_100a
        bf16_mma="tcgen05",
        has_tma=True,
        has_pdl=True,
        has_multicast=True,
        max_cluster_size=8,  # CUDA guide: portable cluster size 8
        has_tmem=True,
        tmem_bytes_per_sm=256 * _KIB,  # 128 lanes x 512 columns x 4 B (PTX ISA, tensor memory)
    ),
    Arch(
        name="sm103",
        capability=(10, 3),
        generation="Blackwell (datacenter)",
        smem_per_block_optin=227 * _KIB,  # 232,448 B -- CUDA guide, cc 10.3 (as 10.0)
        smem_per_sm=228 * _KIB,  # 233,472 B -- CUDA guide, cc 10.3
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=2048,  # CUDA guide, cc 10.3
        fp4_mma="tcgen05",  # PTX ISA: tcgen05 on sm_103a (Blackwell Ultra)
        bf16_mma="tcgen05",
        has_tma=True,
        has_pdl=True,
        has_multicast=True,
        max_cluster_size=8,
        has_tmem=True,
        tmem_bytes_per_sm=256 * _KIB,  # NVIDIA Blackwell Ultra blog: 256 KB TMEM per SM
    ),
    Arch(
        name="sm120",
        capability=(12, 0),
        generation="Blackwell (workstation/consumer)",
        smem_per_block_optin=99 * _KIB,  # 101,376 B -- CUDA guide, cc 12.0: 99 KB per block
        smem_per_sm=100 * _KIB,  # 102,400 B -- CUDA guide, cc 12.0: 100 KB per SM
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=1536,  # CUDA guide, cc 12.0
        fp4_mma="mma_sync_block_scaled",  # PTX ISA: mma.sync m16n8k64 kind::mxf4nvf4.block_scale, sm_120a
        bf16_mma="mma.sync",  # no wgmma, no tcgen05 on sm_120 (PTX ISA)
        has_tma=True,  # cp.async.bulk.tensor is available on sm_120
        has_pdl=True,
        has_multicast=False,  # CUTLASS SM120 GEMMs: no TMA multicast
        max_cluster_size=1,  # CUTLASS SM120 GEMMs use cluster 1x1x1 (REFERENCE.md); fp4moe plans no clusters here
        has_tmem=False,
        tmem_bytes_per_sm=0,
    ),
    Arch(
        name="sm121",
        capability=(12, 1),
        generation="Blackwell (workstation/consumer)",
        smem_per_block_optin=99 * _KIB,  # 101,376 B -- CUDA guide, cc 12.x: 99 KB per block
        smem_per_sm=100 * _KIB,  # 102,400 B -- CUDA guide, cc 12.x: 100 KB per SM
        regs_per_sm=_REGS_PER_SM,
        max_threads_per_sm=1536,  # CUDA guide, cc 12.x
        fp4_mma="mma_sync_block_scaled",  # same instruction family as sm_120 (PTX ISA, sm_121a)
        bf16_mma="mma.sync",
        has_tma=True,
        has_pdl=True,
        has_multicast=False,
        max_cluster_size=1,  # as sm120
        has_tmem=False,
        tmem_bytes_per_sm=0,
    ),
)

ARCHS: Mapping[str, Arch] = MappingProxyType({a.name: a for a in _ARCH_LIST})
"""Every architecture fp4moe targets, by name ("sm80" ... "sm121")."""

_ARCH_BY_CAPABILITY: Mapping[tuple[int, int], Arch] = MappingProxyType({a.capability: a for a in _ARCH_LIST})

# --------------------------------------------------------------------------------------
# Products
# --------------------------------------------------------------------------------------


def _tokens(text: str) -> list[str]:
    """Lower-case alphanumeric runs: 'NVIDIA A100-SXM4-80GB' -> ['nvidia', 'a100', 'sxm4', '80gb']."""
    return re.findall(r"[a-z0-9]+", text.lower())


def _match_length(alias: str, text: str) -> int:
    """Length of ``alias`` (without separators) if it occurs in ``text`` on token boundaries, else 0.

    Separators are ignored ("rtx-pro-6000", "rtxpro6000" and "RTX PRO 6000" are one
    spelling), but a match must start and end where a word of ``text`` does, so that
    "b300" does not match inside "gb300".
    """
    words = _tokens(text)
    needle = "".join(_tokens(alias))
    if not needle:
        return 0
    joined = "".join(words)
    boundaries = {0}
    offset = 0
    for word in words:
        offset += len(word)
        boundaries.add(offset)
    start = joined.find(needle)
    while start != -1:
        if start in boundaries and start + len(needle) in boundaries:
            return len(needle)
        start = joined.find(needle, start + 1)
    return 0


#: What kernels reach of a product's datasheet rates, assumed for every product: DRAM at the copy
#: bandwidth, tensor cores at what torch's bf16 matmul sustains (the FP4 and FP8 peaks take the
#: same fraction, not measured) (docs/performance-engineering.md, ``SUSTAINED_BANDWIDTH_FRACTION``).
SUSTAINED_BANDWIDTH_FRACTION = 0.887
SUSTAINED_TENSOR_FRACTION = 0.72


@dataclass(frozen=True)
class GPU:
    """One product: its architecture plus what its datasheet says."""

    name: str  # canonical, e.g. "H200"
    aliases: tuple[str, ...]  # lower-case spellings users and torch use
    arch: Arch
    sm_count: int
    memory_gib: float  # datasheet capacity figure
    mem_bandwidth_gbs: float  # GB/s (1e9 B/s), datasheet
    bf16_dense_tflops: float  # dense tensor-core bf16 (FP32 accumulate) peak
    fp4_dense_tflops: float | None  # dense FP4 tensor-core peak; None without FP4 tensor cores
    l2_mib: float

    def __post_init__(self) -> None:
        if self.arch.has_native_fp4 != (self.fp4_dense_tflops is not None):
            raise ValueError(
                f"GPU {self.name}: fp4_dense_tflops must be given exactly when {self.arch.name} has FP4 MMA"
            )
        for alias in self.aliases:
            if alias != alias.lower():
                raise ValueError(f"GPU {self.name}: alias {alias!r} must be lower-case")

    @property
    def sustained_bandwidth_gbs(self) -> float:
        """The DRAM bandwidth kernels reach (``SUSTAINED_BANDWIDTH_FRACTION`` of the datasheet's)."""
        return self.mem_bandwidth_gbs * SUSTAINED_BANDWIDTH_FRACTION

    @staticmethod
    def sustained_tflops(peak_tflops: float) -> float:
        """The tensor-core rate kernels reach of a datasheet peak (``SUSTAINED_TENSOR_FRACTION``)."""
        return peak_tflops * SUSTAINED_TENSOR_FRACTION

    def match_length(self, text: str) -> int:
        """Length of the longest of name/aliases found in ``text`` (0: no match)."""
        return max(_match_length(alias, text) for alias in (self.name, *self.aliases))

    def matches(self, text: str) -> bool:
        """True if ``text`` names this GPU: case, space and dash insensitive, on word boundaries.

        Torch device names match too: "NVIDIA H100 80GB HBM3" matches H100.
        """
        return self.match_length(text) > 0


_GPU_LIST: tuple[GPU, ...] = (
    GPU(
        name="A100",  # A100 SXM4 80GB
        aliases=("a100", "a100 sxm", "a100 sxm4", "a100 80gb", "a100 sxm4 80gb"),
        arch=ARCHS["sm80"],
        sm_count=108,  # NVIDIA A100 Tensor Core GPU architecture whitepaper
        memory_gib=80,  # NVIDIA A100 datasheet (80GB HBM2e)
        mem_bandwidth_gbs=2039,  # NVIDIA A100 datasheet, SXM 80GB
        bf16_dense_tflops=312,  # NVIDIA A100 datasheet (624 with sparsity)
        fp4_dense_tflops=None,
        l2_mib=40,  # NVIDIA A100 whitepaper: 40 MB L2
    ),
    GPU(
        name="RTX 3090",
        aliases=("rtx 3090", "geforce rtx 3090", "3090"),
        arch=ARCHS["sm86"],
        sm_count=82,  # NVIDIA Ampere GA102 GPU architecture whitepaper
        memory_gib=24,  # GA102 whitepaper: 24 GB GDDR6X
        mem_bandwidth_gbs=936,  # GA102 whitepaper
        bf16_dense_tflops=71,  # GA102 whitepaper: BF16 with FP32 accumulate, 71 dense / 142 sparse
        fp4_dense_tflops=None,
        l2_mib=6,  # GA102 whitepaper: 6144 KB L2
    ),
    GPU(
        name="RTX 4090",
        aliases=("rtx 4090", "geforce rtx 4090", "4090"),
        arch=ARCHS["sm89"],
        sm_count=128,  # NVIDIA Ada GPU architecture whitepaper
        memory_gib=24,  # Ada whitepaper: 24 GB GDDR6X
        mem_bandwidth_gbs=1008,  # Ada whitepaper
        bf16_dense_tflops=165.2,  # Ada whitepaper: BF16 with FP32 accumulate, 165.2 dense / 330.4 sparse
        fp4_dense_tflops=None,
        l2_mib=72,  # Ada whitepaper: 73,728 KB L2
    ),
    GPU(
        name="L40S",
        aliases=("l40s",),
        arch=ARCHS["sm89"],
        sm_count=142,  # NVIDIA L40S datasheet (18,176 CUDA cores / 128 per SM)
        memory_gib=48,  # NVIDIA L40S datasheet: 48 GB GDDR6
        mem_bandwidth_gbs=864,  # NVIDIA L40S datasheet
        bf16_dense_tflops=362.05,  # NVIDIA L40S datasheet: 362.05 dense (733 sparse)
        fp4_dense_tflops=None,
        l2_mib=96,  # NVIDIA L40S product brief: 96 MB L2 (AD102)
    ),
    GPU(
        name="H100",  # H100 SXM5 80GB
        aliases=("h100", "h100 sxm", "h100 sxm5", "h100 80gb hbm3"),
        arch=ARCHS["sm90"],
        sm_count=132,  # NVIDIA H100 Tensor Core GPU architecture whitepaper, SXM5
        memory_gib=80,  # NVIDIA H100 datasheet, SXM
        mem_bandwidth_gbs=3350,  # NVIDIA H100 datasheet, SXM: 3.35 TB/s
        bf16_dense_tflops=989.4,  # NVIDIA H100 datasheet: 1,979 with sparsity (sparse/2)
        fp4_dense_tflops=None,
        l2_mib=50,  # H100 whitepaper: 50 MB L2 on H100 SXM5
    ),
    GPU(
        name="H200",  # H200 SXM 141GB
        aliases=("h200", "h200 sxm", "h200 sxm 141gb"),
        arch=ARCHS["sm90"],
        sm_count=132,  # NVIDIA H200 Tensor Core GPU datasheet (same GH100 configuration as H100 SXM)
        memory_gib=141,  # NVIDIA H200 datasheet: 141 GB HBM3e
        mem_bandwidth_gbs=4800,  # NVIDIA H200 datasheet: 4.8 TB/s
        bf16_dense_tflops=989.4,  # NVIDIA H200 datasheet: 1,979 with sparsity (sparse/2)
        fp4_dense_tflops=None,
        # NVIDIA's H200 datasheet gives no L2 size; torch's L2_cache_size
        # (cudaDeviceProp::l2CacheSize) reads 62,914,560 B = 60 MiB on an H200 SXM, where an
        # H100 SXM reads 50 MB (docs/performance-engineering.md, ``GPU.l2_mib``).
        l2_mib=60,
    ),
    GPU(
        name="B200",  # HGX B200
        aliases=("b200", "b200 sxm", "hgx b200"),
        arch=ARCHS["sm100"],
        sm_count=148,  # NVIDIA Blackwell architecture technical brief; driver reports 148
        memory_gib=180,  # NVIDIA HGX B200 datasheet: 180 GB HBM3e per GPU (early briefs: 192)
        # NVIDIA HGX B200 datasheet: 7.7 TB/s (early briefs: 8 TB/s); the driver's 7680-bit
        # bus at 3996 MHz gives 7.67 TB/s (pytorch/ao PR #4002).
        mem_bandwidth_gbs=7700,
        bf16_dense_tflops=2250,  # HGX B200 datasheet: 4.5 PFLOPS with sparsity (sparse/2)
        fp4_dense_tflops=9000,  # HGX B200 datasheet: 18 PFLOPS FP4 with sparsity (sparse/2)
        l2_mib=126.5,  # driver-reported L2 on B200 (pytorch/ao PR #4002); not on the datasheet
    ),
    GPU(
        name="B300",  # HGX B300 (Blackwell Ultra)
        aliases=("b300", "hgx b300", "b300 sxm6 ac"),
        arch=ARCHS["sm103"],
        sm_count=160,  # NVIDIA "Inside Blackwell Ultra" technical blog: 160 SMs
        memory_gib=270,  # approximate: HGX B300 datasheet, ~2.1 TB for 8 GPUs (288 GB HBM3e fitted)
        mem_bandwidth_gbs=7700,  # approximate: HGX B300 datasheet per-GPU figure
        bf16_dense_tflops=2250,  # HGX B300 datasheet: 36 PFLOPS sparse for 8 GPUs (sparse/2/8)
        fp4_dense_tflops=14000,  # approximate: HGX B300 datasheet dense FP4 per GPU
        l2_mib=126.5,  # approximate: assumed as B200 (same die family); not published
    ),
    GPU(
        name="GB300",  # Grace Blackwell Ultra superchip GPU (GB300 NVL72)
        aliases=("gb300", "gb300 nvl72"),
        arch=ARCHS["sm103"],
        sm_count=160,  # NVIDIA "Inside Blackwell Ultra" technical blog: 160 SMs
        memory_gib=288,  # NVIDIA Blackwell Ultra blog: up to 288 GB HBM3e (usable may be ~279)
        mem_bandwidth_gbs=8000,  # NVIDIA Blackwell Ultra blog: 8 TB/s
        bf16_dense_tflops=2500,  # approximate: GB300 NVL72 datasheet per-GPU dense figure
        fp4_dense_tflops=15000,  # NVIDIA Blackwell Ultra blog: 15 PFLOPS dense NVFP4
        l2_mib=126.5,  # approximate: assumed as B200 (same die family); not published
    ),
    GPU(
        name="RTX PRO 6000 Blackwell",  # Workstation Edition (Max-Q and Server editions share the 188 SMs)
        aliases=(
            "rtx pro 6000",
            "rtx pro 6000 blackwell",
            "rtx pro 6000 blackwell workstation edition",
            "pro 6000",
        ),
        arch=ARCHS["sm120"],
        sm_count=188,  # NVIDIA RTX PRO 6000 Blackwell datasheet (24,064 CUDA cores / 128 per SM)
        memory_gib=96,  # RTX PRO 6000 Blackwell datasheet: 96 GB GDDR7
        mem_bandwidth_gbs=1792,  # RTX PRO 6000 Blackwell datasheet: 1,792 GB/s
        # RTX Blackwell GPU architecture whitepaper: BF16 with FP32 accumulate, dense;
        # = 188 SMs x 1024 FLOP/clk x 2.617 GHz boost.
        bf16_dense_tflops=503.8,
        # Datasheet: 4,000 AI TOPS (FP4, sparse); dense = 188 SMs x 4096 FLOP/clk x
        # 2.617 GHz = 2,015 (sparse/2, approximate: depends on the boost clock).
        fp4_dense_tflops=2015.2,
        l2_mib=128,  # RTX Blackwell whitepaper: full GB202 L2, 128 MB
    ),
    GPU(
        name="RTX 5090",
        aliases=("rtx 5090", "geforce rtx 5090", "5090"),
        arch=ARCHS["sm120"],
        sm_count=170,  # RTX Blackwell GPU architecture whitepaper
        memory_gib=32,  # RTX Blackwell whitepaper: 32 GB GDDR7
        mem_bandwidth_gbs=1792,  # RTX Blackwell whitepaper: 1,792 GB/s
        bf16_dense_tflops=209.5,  # RTX Blackwell whitepaper: BF16 with FP32 accumulate (GeForce half rate)
        fp4_dense_tflops=1676,  # RTX Blackwell whitepaper: 3,352 AI TOPS FP4 sparse (sparse/2)
        l2_mib=96,  # RTX Blackwell whitepaper: 98,304 KB L2
    ),
    GPU(
        name="DGX Spark",  # GB10 Grace Blackwell superchip
        aliases=("dgx spark", "gb10"),
        arch=ARCHS["sm121"],
        sm_count=48,  # 6,144 CUDA cores (NVIDIA DGX Spark spec page) / 128 per SM
        memory_gib=128,  # NVIDIA DGX Spark datasheet: 128 GB LPDDR5x unified (shared with the CPU)
        mem_bandwidth_gbs=273,  # NVIDIA DGX Spark datasheet: 273 GB/s
        # Approximate: NVIDIA publishes no BF16 figure; FP4 dense / 4 as on other SM12x parts.
        bf16_dense_tflops=125,
        fp4_dense_tflops=500,  # approximate: DGX Spark datasheet, 1 PFLOP FP4 with sparsity (sparse/2)
        l2_mib=24,  # approximate: third-party reports; not on an NVIDIA datasheet
    ),
)

GPUS: Mapping[str, GPU] = MappingProxyType({g.name: g for g in _GPU_LIST})
"""Every catalogued product, by canonical name."""


def default_gpu(arch: Arch) -> GPU:
    """The catalogue product that stands for ``arch`` when no GPU is named: the first listed."""
    for gpu in GPUS.values():
        if gpu.arch == arch:
            return gpu
    raise ValueError(f"default_gpu: no catalogued GPU has architecture {arch.name}; name one with gpu=")
