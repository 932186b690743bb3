"""Tests of the GPU catalogue (fp4moe.target). All run on CPU."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fp4moe.target import resolve as arch_mod
from fp4moe.target import (
    ARCHS,
    GPUS,
    GPU,
    Arch,
    arch_for_capability,
    as_dict,
    compare,
    detect,
    find_gpu,
    get_arch,
    resolve_target,
)

# ---------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------

# (arch, capability, opt-in shared memory per block in bytes, FP4 MMA, bf16 MMA, TMEM bytes)
# Shared-memory limits are the REFERENCE.md figures, pinned to the byte.
ARCH_CASES = [
    ("sm80", (8, 0), 166_912, "none", "mma.sync", 0),
    ("sm86", (8, 6), 101_376, "none", "mma.sync", 0),
    ("sm89", (8, 9), 101_376, "none", "mma.sync", 0),
    ("sm90", (9, 0), 232_448, "none", "wgmma", 0),
    ("sm100", (10, 0), 232_448, "tcgen05", "tcgen05", 256 * 1024),
    ("sm103", (10, 3), 232_448, "tcgen05", "tcgen05", 256 * 1024),
    ("sm120", (12, 0), 101_376, "mma_sync_block_scaled", "mma.sync", 0),
    ("sm121", (12, 1), 101_376, "mma_sync_block_scaled", "mma.sync", 0),
]


def test_catalogue_holds_exactly_the_listed_archs():
    assert list(ARCHS) == [case[0] for case in ARCH_CASES]


@pytest.mark.parametrize(("name", "capability", "smem_optin", "fp4_mma", "bf16_mma", "tmem"), ARCH_CASES)
def test_arch_facts(name, capability, smem_optin, fp4_mma, bf16_mma, tmem):
    a = ARCHS[name]
    assert a.name == name
    assert a.capability == capability
    assert a.smem_per_block_optin == smem_optin
    assert a.fp4_mma == fp4_mma
    assert a.bf16_mma == bf16_mma
    assert a.tmem_bytes_per_sm == tmem
    assert a.has_tmem == (tmem > 0)
    assert a.has_native_fp4 == (fp4_mma != "none")
    assert a.regs_per_sm == 65536
    # CUDA reserves 1 KB per block: the opt-in limit is the SM's shared memory less 1 KB.
    assert a.smem_per_sm - a.smem_per_block_optin == 1024
    assert a.triton_target == ("cuda", capability[0] * 10 + capability[1], 32)


# (arch, per-SM shared memory, max threads per SM, TMA, multicast, cluster size)
ARCH_LIMIT_CASES = [
    ("sm80", 167_936, 2048, False, False, 1),
    ("sm86", 102_400, 1536, False, False, 1),
    ("sm89", 102_400, 1536, False, False, 1),
    ("sm90", 233_472, 2048, True, True, 8),
    ("sm100", 233_472, 2048, True, True, 8),
    ("sm103", 233_472, 2048, True, True, 8),
    # SM120/121: TMA without multicast; fp4moe plans cluster 1x1x1 there (REFERENCE.md).
    ("sm120", 102_400, 1536, True, False, 1),
    ("sm121", 102_400, 1536, True, False, 1),
]


@pytest.mark.parametrize(("name", "smem_sm", "threads", "tma", "multicast", "cluster"), ARCH_LIMIT_CASES)
def test_arch_limits(name, smem_sm, threads, tma, multicast, cluster):
    a = ARCHS[name]
    assert (a.smem_per_sm, a.max_threads_per_sm, a.has_tma, a.has_multicast, a.max_cluster_size) == (
        smem_sm,
        threads,
        tma,
        multicast,
        cluster,
    )


def test_generations():
    assert {n: a.generation for n, a in ARCHS.items()} == {
        "sm80": "Ampere",
        "sm86": "Ampere",
        "sm89": "Ada",
        "sm90": "Hopper",
        "sm100": "Blackwell (datacenter)",
        "sm103": "Blackwell (datacenter)",
        "sm120": "Blackwell (workstation/consumer)",
        "sm121": "Blackwell (workstation/consumer)",
    }


def test_arch_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ARCHS["sm90"].smem_per_block_optin = 1  # type: ignore[misc]


def test_arch_rejects_inconsistent_definitions():
    good = ARCHS["sm90"]
    with pytest.raises(ValueError, match="does not match capability"):
        dataclasses.replace(good, name="sm91")
    with pytest.raises(ValueError, match="has_tmem"):
        dataclasses.replace(good, has_tmem=True)


# (spelling, expected arch) -- every spelling the CLI and callers use.
GET_ARCH_CASES = [
    ("sm120", "sm120"),
    ("sm_120", "sm120"),
    ("SM_120", "sm120"),
    ("  Sm120 ", "sm120"),  # stray whitespace from a shell
    ("120", "sm120"),
    (120, "sm120"),
    ((12, 0), "sm120"),
    ("12.0", "sm120"),
    ("sm_100a", "sm100"),  # nvcc/PTX feature suffix
    ("sm_120f", "sm120"),
    ("compute_90", "sm90"),
    ("sm90", "sm90"),
    ("9.0", "sm90"),
    (80, "sm80"),
    ("sm121", "sm121"),
    ((10, 3), "sm103"),
]


@pytest.mark.parametrize(("spelling", "expected"), GET_ARCH_CASES)
def test_get_arch_spellings(spelling, expected):
    assert get_arch(spelling) is ARCHS[expected]


def test_get_arch_passes_an_arch_through():
    assert get_arch(ARCHS["sm89"]) is ARCHS["sm89"]


# Unknown or malformed spellings; each must raise a message naming the argument and value.
GET_ARCH_BAD = [
    "sm75",  # Turing: below SM80
    "sm_999",
    "hopper",
    "",
    75,
    (7, 5),
    (12,),  # not a (major, minor) pair
    ([12], 0),  # unhashable member: still a ValueError, not a TypeError
    True,  # a bool is not an int here
    "12.0.1",
]


@pytest.mark.parametrize("bad", GET_ARCH_BAD)
def test_get_arch_errors(bad):
    with pytest.raises(ValueError) as info:
        get_arch(bad)
    message = str(info.value)
    assert "'arch'" in message
    assert repr(bad) in message
    assert "sm80" in message and "sm121" in message  # the list of known archs


@pytest.mark.parametrize(("cc", "expected"), [(a.capability, a.name) for a in ARCHS.values()])
def test_arch_for_capability(cc, expected):
    assert arch_for_capability(cc).name == expected


def test_arch_for_capability_below_sm80():
    with pytest.raises(ValueError, match="SM80 and newer"):
        arch_for_capability((7, 5))


def test_arch_for_capability_unknown_new():
    with pytest.raises(ValueError, match=r"9\.1.*not in the catalogue"):
        arch_for_capability((9, 1))


@pytest.mark.parametrize("bad", [(9,), "9.0", (9.0, 0), None])
def test_arch_for_capability_rejects_non_tuples(bad):
    with pytest.raises(ValueError, match="'cc'"):
        arch_for_capability(bad)


# ---------------------------------------------------------------------------------------
# Products
# ---------------------------------------------------------------------------------------

EXPECTED_GPUS = {
    "A100": "sm80",
    "RTX 3090": "sm86",
    "RTX 4090": "sm89",
    "L40S": "sm89",
    "H100": "sm90",
    "H200": "sm90",
    "B200": "sm100",
    "B300": "sm103",
    "GB300": "sm103",
    "RTX PRO 6000 Blackwell": "sm120",
    "RTX 5090": "sm120",
    "DGX Spark": "sm121",
}


def test_catalogue_gpus_and_their_archs():
    assert {name: gpu.arch.name for name, gpu in GPUS.items()} == EXPECTED_GPUS


@pytest.mark.parametrize("gpu", list(GPUS.values()), ids=list(GPUS))
def test_every_gpu_is_consistent(gpu: GPU):
    assert gpu.arch is ARCHS[gpu.arch.name]
    assert gpu.sm_count > 0 and gpu.memory_gib > 0 and gpu.mem_bandwidth_gbs > 0 and gpu.l2_mib > 0
    assert gpu.bf16_dense_tflops > 0
    assert (gpu.fp4_dense_tflops is not None) == gpu.arch.has_native_fp4
    if gpu.fp4_dense_tflops is not None:
        assert gpu.fp4_dense_tflops > gpu.bf16_dense_tflops
    assert all(alias == alias.lower() for alias in gpu.aliases)
    assert find_gpu(gpu.name) is gpu
    for alias in gpu.aliases:
        assert find_gpu(alias) is gpu, alias


# Product facts that REFERENCE.md and the brief pin.
GPU_FACT_CASES = [
    ("RTX PRO 6000 Blackwell", 188, 1792),
    ("RTX 5090", 170, 1792),
    ("H200", 132, 4800),
    ("H100", 132, 3350),
    ("A100", 108, 2039),
    ("B200", 148, 7700),
    ("DGX Spark", 48, 273),
]


@pytest.mark.parametrize(("name", "sms", "bandwidth"), GPU_FACT_CASES)
def test_gpu_facts(name, sms, bandwidth):
    gpu = GPUS[name]
    assert (gpu.sm_count, gpu.mem_bandwidth_gbs) == (sms, bandwidth)


def test_sm120_fp4_peak_matches_flops_per_sm_per_clock():
    # REFERENCE.md: 4096 FP4 FLOP per SM per clock on SM120; RTX PRO 6000 ~1.85-2.0 PFLOP/s dense.
    gpu = GPUS["RTX PRO 6000 Blackwell"]
    assert gpu.fp4_dense_tflops is not None
    clock_ghz = gpu.fp4_dense_tflops * 1e12 / (gpu.sm_count * 4096) / 1e9
    assert 2.3 < clock_ghz < 2.9
    assert 1850 <= gpu.fp4_dense_tflops <= 2050


# (text, expected canonical name): torch device names and user spellings.
FIND_GPU_CASES = [
    # torch.cuda.get_device_name() strings
    ("NVIDIA H200", "H200"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100"),  # a different variant: compare() reports its 114 SMs
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000 Blackwell"),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "RTX PRO 6000 Blackwell"),
    ("NVIDIA GeForce RTX 5090", "RTX 5090"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 3090", "RTX 3090"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA B300 SXM6 AC", "B300"),
    ("NVIDIA GB300", "GB300"),  # must not match B300 inside "gb300"
    ("NVIDIA GB10", "DGX Spark"),
    # user spellings
    ("rtx pro 6000", "RTX PRO 6000 Blackwell"),
    ("RTX-PRO-6000", "RTX PRO 6000 Blackwell"),
    ("rtxpro6000", "RTX PRO 6000 Blackwell"),
    ("RTX_PRO_6000_blackwell", "RTX PRO 6000 Blackwell"),
    ("h200", "H200"),
    ("H200 SXM", "H200"),
    ("h200-sxm-141gb", "H200"),
    ("dgx spark", "DGX Spark"),
    ("DGX-Spark", "DGX Spark"),
    ("gb10", "DGX Spark"),
    ("5090", "RTX 5090"),
    ("rtx5090", "RTX 5090"),
    ("l40s", "L40S"),
    ("a100", "A100"),
]


@pytest.mark.parametrize(("text", "expected"), FIND_GPU_CASES)
def test_find_gpu(text, expected):
    gpu = find_gpu(text)
    assert gpu.name == expected
    assert gpu.matches(text)


# Names that must not match anything: near misses on word boundaries.
FIND_GPU_BAD = [
    "NVIDIA RTX 6000 Ada Generation",  # no "pro": a different (Ada) product
    "NVIDIA L40",  # not L40S
    "NVIDIA GB200",  # must not match "b200" inside "gb200"
    "NVIDIA Tesla T4",
    "H1000",  # not H100
    "",
    "   ",
]


@pytest.mark.parametrize("text", FIND_GPU_BAD)
def test_find_gpu_unknown(text):
    with pytest.raises(ValueError) as info:
        find_gpu(text)
    message = str(info.value)
    assert repr(text) in message
    assert "H200" in message and "RTX PRO 6000 Blackwell" in message  # the known names


def test_matches_is_false_for_other_products():
    assert not GPUS["H100"].matches("NVIDIA H200")
    assert not GPUS["B300"].matches("NVIDIA GB300")
    assert GPUS["GB300"].matches("nvidia gb300")


def test_find_gpu_prefers_the_longest_alias(monkeypatch):
    # Two products whose aliases both occur in the text: the longer alias wins.
    short = dataclasses.replace(GPUS["RTX 5090"], name="X", aliases=("rtx",))
    monkeypatch.setattr(arch_mod, "_GPU_LIST", (short, GPUS["RTX 5090"]))
    assert find_gpu("NVIDIA GeForce RTX 5090").name == "RTX 5090"
    assert find_gpu("rtx").name == "X"


def test_find_gpu_exact_tie_is_ambiguous(monkeypatch):
    twin = dataclasses.replace(GPUS["H200"], name="H200 twin", aliases=("h200",))
    monkeypatch.setattr(arch_mod, "_GPU_LIST", (GPUS["H200"], twin))
    with pytest.raises(ValueError, match="ambiguous"):
        find_gpu("NVIDIA H200")


# ---------------------------------------------------------------------------------------
# resolve_target
# ---------------------------------------------------------------------------------------


def test_resolve_target_by_gpu():
    arch, gpu = resolve_target(gpu="rtx pro 6000")
    assert arch is ARCHS["sm120"]
    assert gpu is GPUS["RTX PRO 6000 Blackwell"]


def test_resolve_target_by_arch():
    assert resolve_target(arch="sm_90") == (ARCHS["sm90"], None)


@pytest.mark.parametrize(("gpu", "arch"), [(None, None), ("h200", "sm90")])
def test_resolve_target_needs_exactly_one(gpu, arch):
    with pytest.raises(ValueError, match="exactly one"):
        resolve_target(gpu=gpu, arch=arch)


# ---------------------------------------------------------------------------------------
# compare / detect
# ---------------------------------------------------------------------------------------


def test_compare_exact_match_has_no_differences():
    # What torch reports on an H200 SXM: 139.8 GiB usable of the 141 GB datasheet figure.
    d = compare("NVIDIA H200", (9, 0), 132, 232_448, 139.8)
    assert d.gpu is GPUS["H200"]
    assert d.arch is ARCHS["sm90"]
    assert d.differences == ()


def test_compare_without_optin_property_has_no_differences():
    # Older torch exposes no opt-in shared memory: None is not a difference.
    d = compare("NVIDIA GeForce RTX 5090", (12, 0), 170, None, 31.4)
    assert d.gpu is GPUS["RTX 5090"]
    assert d.differences == ()


def test_compare_fewer_sms():
    d = compare("NVIDIA H100 PCIe", (9, 0), 114, 232_448, 79.1)
    assert d.gpu is GPUS["H100"]
    assert len(d.differences) == 1
    assert "114" in d.differences[0] and "132" in d.differences[0]


def test_compare_unknown_name():
    d = compare("NVIDIA RTX 6000 Ada Generation", (8, 9), 142, 101_376, 47.5)
    assert d.gpu is None
    assert d.arch is ARCHS["sm89"]
    assert len(d.differences) == 1
    assert "not in the catalogue" in d.differences[0]


def test_compare_unknown_capability():
    d = compare("NVIDIA Tesla T4", (7, 5), 40, 65_536, 14.6)
    assert d.arch is None
    assert d.gpu is None
    assert any("SM80 and newer" in s for s in d.differences)


def test_compare_smem_optin_differs():
    d = compare("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 188, 232_448, 95.0)
    assert len(d.differences) == 1
    assert "232448" in d.differences[0] and "101376" in d.differences[0]


def test_compare_capability_differs_from_catalogued_gpu():
    d = compare("NVIDIA H200", (10, 0), 132, 232_448, 139.8)
    assert d.arch is ARCHS["sm100"]
    assert d.gpu is GPUS["H200"]
    assert len(d.differences) == 1
    assert "10.0" in d.differences[0] and "9.0" in d.differences[0]


def test_compare_memory_variant():
    # A100 40GB matches the catalogued 80GB A100 by name; the memory tells them apart.
    d = compare("NVIDIA A100-SXM4-40GB", (8, 0), 108, 166_912, 39.4)
    assert len(d.differences) == 1
    assert "39.4" in d.differences[0] and "80" in d.differences[0]


def test_detect_returns_none_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: detect() reads it instead")
    assert detect() is None


def test_detect_reads_torch_properties(monkeypatch):
    # detect() on a fake device: it must pass torch's properties to compare().
    import torch

    class Props:
        name = "NVIDIA H200"
        major, minor = 9, 0
        multi_processor_count = 132
        shared_memory_per_block_optin = 232_448
        total_memory = int(139.8 * 2**30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    d = detect()
    assert d is not None
    assert d.gpu is GPUS["H200"] and d.arch is ARCHS["sm90"]
    assert d.smem_per_block_optin == 232_448
    assert d.differences == ()


# ---------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("a", list(ARCHS.values()), ids=list(ARCHS))
def test_arch_json_round_trip(a: Arch):
    data = json.loads(json.dumps(as_dict(a)))
    assert data["name"] == a.name
    assert data["capability"] == list(a.capability)
    assert data["smem_per_block_optin"] == a.smem_per_block_optin
    assert data["triton_target"] == list(a.triton_target)
    fields = {f.name for f in dataclasses.fields(Arch)}
    assert Arch(**{k: tuple(v) if k == "capability" else v for k, v in data.items() if k in fields}) == a


@pytest.mark.parametrize("gpu", list(GPUS.values()), ids=list(GPUS))
def test_gpu_json_round_trip(gpu: GPU):
    data = json.loads(json.dumps(as_dict(gpu)))
    assert data["name"] == gpu.name
    assert data["aliases"] == list(gpu.aliases)
    assert data["arch"]["name"] == gpu.arch.name
    assert data["fp4_dense_tflops"] == gpu.fp4_dense_tflops


def test_detected_json_round_trip():
    for d in (
        compare("NVIDIA H100 PCIe", (9, 0), 114, 232_448, 79.1),
        compare("NVIDIA Tesla T4", (7, 5), 40, None, 14.6),
    ):
        data = json.loads(json.dumps(as_dict(d)))
        assert data["name"] == d.name
        assert data["capability"] == list(d.capability)
        assert data["differences"] == list(d.differences)
        assert data["arch"] == (None if d.arch is None else as_dict(d.arch))
        assert data["gpu"] == (None if d.gpu is None else as_dict(d.gpu))


def test_as_dict_rejects_other_objects():
    with pytest.raises(TypeError):
        as_dict({"name": "sm90"})  # type: ignore[arg-type]


def test_sustained_rates_are_the_measured_fractions_of_the_datasheet():
    """What the planner's time model takes as reachable: the H200's copy bandwidth (4,257 of 4,800
    GB/s) and torch's bf16 matmul rate (~711 of 989 TFLOP/s), as fractions applied to every product."""
    from fp4moe.target import GPU, find_gpu

    h200 = find_gpu("h200")
    assert abs(h200.sustained_bandwidth_gbs - 4257) < 5
    assert 700 < GPU.sustained_tflops(h200.bf16_dense_tflops) < 720
    pro = find_gpu("rtx pro 6000")
    assert pro.sustained_bandwidth_gbs < pro.mem_bandwidth_gbs and GPU.sustained_tflops(1.0) < 1.0


@pytest.mark.parametrize("text", ["h100 pcie", "NVIDIA H100 PCIe", "H100 NVL", "NVIDIA A100-PCIE-40GB",
                                  "A100-SXM4-40GB", "h200 nvl"])
def test_find_gpu_refuses_uncatalogued_variants(text):
    """A PCIe / NVL card or another memory size has other bandwidth and peaks than the catalogued
    product: planning on the SXM numbers would be silently wrong."""
    with pytest.raises(ValueError, match=r"names a variant .* which the catalogue does not hold.*--arch sm"):
        find_gpu(text, strict=True)
    with pytest.raises(ValueError, match=r"names a variant"):
        resolve_target(gpu=text)
    assert find_gpu(text).name in ("H100", "A100", "H200")  # by name, as detection reads torch's names


def test_find_gpu_suggests_close_names():
    with pytest.raises(ValueError, match=r"matches no catalogued GPU \(did you mean H200"):
        find_gpu("h2000")
    assert find_gpu("NVIDIA H100 80GB HBM3", strict=True).name == "H100"  # torch's name for the catalogued part
    assert find_gpu("gb300 nvl72", strict=True).name == "GB300"
