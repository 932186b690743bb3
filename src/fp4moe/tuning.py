"""Tuning choices of the ops: values a tuner or an experiment may change, as frozen records.

Each op family has one record (:class:`MoETuning`, :class:`LinearTuning`, :class:`DispatchTuning`,
:class:`QuantizeTuning`), gathered in :class:`Tuning`. The defaults below are the library's choices;
each field's comment says the rule it sets, and docs/performance-engineering.md (under the field's
name) what was measured for it. Hardware facts and kernel limits (the MMA's 16 rows, the 64-K chunk,
register counts from ptxas, the most experts a kernel takes) are not tuning: they stay constants of
the modules that use them.

The ops read :func:`current_tuning` when they are called (attribute reads, no per-call work beyond
that). Changes go through one API, modelled on ``fp4moe.graphs``' policy:

* ``with tuning(moe=dict(fused_swiglu=False)): ...`` runs a block under changed choices (nested
  changes per family, or whole records: ``tuning(moe=MoETuning(...))``, ``tuning(Tuning(...))``);
* :func:`set_tuning` replaces the process-wide record and returns the old one.

The record is process-wide, as ``fp4moe.graphs.GraphPolicy`` is: a ``tuning`` block changes it for
every thread until the block ends. A CUDA graph captured by ``fp4moe.graphs.CallGraphs`` is keyed
by the record in force, so a graph captured under one tuning is not replayed under another.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["DispatchTuning", "LinearTuning", "MoETuning", "QuantizeTuning", "Tuning", "current_tuning",
           "set_tuning", "tuning"]

_WORD_ORDERS = ("nibble", "rotation")  # ``ops.mma_pack.WORD_ORDERS`` (checked there too)


def _int(record: str, name: str, v: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{record}.{name}: expected an int {bound}, got {v!r}")


def _number(record: str, name: str, v: Any, lo: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo:
        raise ValueError(f"{record}.{name}: expected a number >= {lo}, got {v!r}")


def _bool(record: str, name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{record}.{name}: expected a bool, got {v!r}")


def _pair(record: str, name: str, v: Any, lo: int, ordered: bool) -> None:
    if (not isinstance(v, tuple) or len(v) != 2 or any(isinstance(a, bool) or not isinstance(a, int) or a < lo
                                                      for a in v) or (ordered and v[0] > v[1])):
        order = ", first <= second" if ordered else ""
        raise ValueError(f"{record}.{name}: expected a tuple of two ints >= {lo}{order}, got {v!r}")


def _choice(record: str, name: str, v: Any, allowed: tuple) -> None:
    if v not in allowed:
        raise ValueError(f"{record}.{name}: expected one of {list(allowed)}, got {v!r}")


@dataclass(frozen=True)
class MoETuning:
    """Choices of the MoE experts' execution paths (``ops.moe``)."""

    #: on SM90, experts averaging more rows than this run on the wgmma kernel rather than the
    #: mma.sync decode kernel (``packed_moe_kernel``)
    wgmma_min_rows: float = 8
    #: bit order of the experts' packed words (``ops.mma_pack.WORD_ORDERS``); read when a pack is
    #: made, and each pack records its own order
    word_order: str = "rotation"
    #: experts averaging more than 4 and at most this many rows run each decode GEMM as two launches
    #: (``MMAHeights``): experts of at most 8 rows on 8-row tiles, the others on 16-row tiles
    heights_rows: float = 8
    #: x steps in the shared-memory ring of ``MMAHeights``' tall class (``MMAConfig.xs``; 0: x in
    #: registers)
    heights_x_stages: int = 2
    #: ``MMAHeights``' second launch of each GEMM runs alongside the first's last programs (PDL
    #: without a wait; the classes share no rows)
    heights_overlap: bool = True
    #: 16-row blocks per warp of GEMM 2 in ``MMAHeights``' short-tile class
    heights_gemm2_small_rb: int = 2
    #: token-expert pairs (inclusive) up to which the decode GEMMs take the few-pair configurations:
    #: K split (``few_pairs_split``) with 128-K steps, then two-warp programs
    few_pairs: tuple[int, int] = (8, 16)
    #: K split of the few-pairs configuration of GEMM 1
    few_pairs_split: int = 2
    #: (16-row blocks per warp, K split) of GEMM 2's few-pairs configuration
    few_pairs_gemm2: tuple[int, int] = (2, 2)
    #: rows per expert (inclusive) at which the wgmma GEMMs merge an expert's short last tile into
    #: the full tile before it (``WgmmaConfig.merge_tail``)
    merge_tail_rows: tuple[int, int] = (128, 160)
    #: GEMM 2 of the wgmma path runs the short tails with narrower wgmmas too (``WgmmaConfig.tail_m``)
    gemm2_tails: bool = True
    #: GEMM 1 of the decode path applies SiLU-and-multiply in its epilogue (gate-then-up weights;
    #: gpt-oss's clamped variant and interleaved rows keep the partial sums and the epilogue kernel)
    fused_swiglu: bool = True
    #: ... when its grid has at least this many programs per SM (the fused program holds more
    #: registers, so a small grid leaves each SM fewer warps for the same weight bytes)
    fused_swiglu_min_programs_per_sm: float = 4
    #: GEMM 2's pair rows on the decode path where K is not split and the output is bf16: "bf16"
    #: (each pair's sum rounded once; half the traffic) or "fp32"
    pair_rows: str = "bf16"

    def __post_init__(self) -> None:
        r = "MoETuning"
        _number(r, "wgmma_min_rows", self.wgmma_min_rows, 0)
        _choice(r, "word_order", self.word_order, _WORD_ORDERS)
        _number(r, "heights_rows", self.heights_rows, 0)
        _choice(r, "heights_x_stages", self.heights_x_stages, (0, 2, 3, 4))
        _bool(r, "heights_overlap", self.heights_overlap)
        _choice(r, "heights_gemm2_small_rb", self.heights_gemm2_small_rb, (1, 2, 4))
        _pair(r, "few_pairs", self.few_pairs, 0, ordered=True)
        _int(r, "few_pairs_split", self.few_pairs_split, 1, 64)
        _pair(r, "few_pairs_gemm2", self.few_pairs_gemm2, 1, ordered=False)
        _choice(r, "few_pairs_gemm2", self.few_pairs_gemm2[0], (1, 2, 4))
        _pair(r, "merge_tail_rows", self.merge_tail_rows, 0, ordered=True)
        _bool(r, "gemm2_tails", self.gemm2_tails)
        _bool(r, "fused_swiglu", self.fused_swiglu)
        _number(r, "fused_swiglu_min_programs_per_sm", self.fused_swiglu_min_programs_per_sm, 0)
        _choice(r, "pair_rows", self.pair_rows, ("bf16", "fp32"))


@dataclass(frozen=True)
class LinearTuning:
    """Choices of the plain linear's kernels (``ops.linear``, ``ops.mma_sync``, ``ops.wgmma``: mma.sync
    decode, wgmma prefill, dequantize-then-matmul) and of packing weights into MMA operand order."""

    #: weight rows re-ordered per step of ``pack_mma``: bounds its temporaries (~12 bytes per value
    #: of a step) whatever the weight's size
    pack_rows: int = 4096
    #: 16-row blocks per SM from which the decode heuristic breaks ties on bytes in flight by more
    #: resident warps before longer steps (8-token programs whose weight streams from DRAM)
    warps_first_blocks_per_sm: float = 3
    #: weight bytes in flight per SM that the decode heuristic aims for (Little's law: DRAM
    #: bandwidth per SM times loaded latency)
    decode_inflight_bytes: int = 40_000
    #: the part of the L2 up to which the decode kernel requests its whole weight into L2 before its
    #: PDL wait (``MMAConfig.pdl`` = 3)
    pdl_l2_share: float = 0.25
    #: 8-token decode programs with ``pdl`` = 3 prefer a grid whose programs fit each SM twice, with x
    #: read per chunk (``MMAConfig.xc``) where only that fits
    pdl3_coresident: bool = True
    #: ... for MXFP4 weights too
    pdl3_coresident_mxfp4: bool = False
    #: K steps per slice from which 16-token decode programs take x through the shared-memory ring
    x_ring_min_steps: int = 12
    #: steps ahead at which decode programs with the x ring request their weights into L2
    #: (``MMAConfig.pf``; GPUs with bulk copies)
    x_ring_prefetch_steps: int = 2
    #: up to this many rows the plain linear's wgmma tile is split along K
    wgmma_split_max_m: int = 64
    #: programs per SM the wgmma K split aims for at most
    wgmma_split_programs_per_sm: int = 3
    #: the fewest 64-K chunks a wgmma K split keeps per program
    wgmma_split_min_chunks: int = 8
    #: split-K wgmma launches chain the pass into MMA K order and the GEMM by programmatic dependent
    #: launch, the GEMM requesting its first weights before its wait
    split_pdl: bool = True
    #: large-batch NVFP4 W4A16 on SM90 from this many rows: the weight dequantized to bf16, then
    #: torch's matmul (``dequant_matmul_applies``)
    dequant_matmul_min_m: int = 4096
    #: the largest transient bf16 copy of a weight that path makes (bytes)
    dequant_matmul_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        r = "LinearTuning"
        _int(r, "pack_rows", self.pack_rows, 1)
        _number(r, "warps_first_blocks_per_sm", self.warps_first_blocks_per_sm, 0)
        _int(r, "decode_inflight_bytes", self.decode_inflight_bytes, 1)
        _number(r, "pdl_l2_share", self.pdl_l2_share, 0)
        _bool(r, "pdl3_coresident", self.pdl3_coresident)
        _bool(r, "pdl3_coresident_mxfp4", self.pdl3_coresident_mxfp4)
        _int(r, "x_ring_min_steps", self.x_ring_min_steps, 1)
        _int(r, "x_ring_prefetch_steps", self.x_ring_prefetch_steps, 0, 8)
        _int(r, "wgmma_split_max_m", self.wgmma_split_max_m, 0)
        _int(r, "wgmma_split_programs_per_sm", self.wgmma_split_programs_per_sm, 1)
        _int(r, "wgmma_split_min_chunks", self.wgmma_split_min_chunks, 1)
        _bool(r, "split_pdl", self.split_pdl)
        _int(r, "dequant_matmul_min_m", self.dequant_matmul_min_m, 0)
        _int(r, "dequant_matmul_max_bytes", self.dequant_matmul_max_bytes, 0)


@dataclass(frozen=True)
class DispatchTuning:
    """Choices of the MoE dispatch (``ops.dispatch``)."""

    #: pair x expert comparisons up to which the heuristic runs the one-vector dispatch program
    small_max_comparisons: int = 16384
    #: block histograms up to which the block path places its pairs in one launch after the
    #: histogram (every program reads all of them) instead of scan, tiles and scatter (0: never)
    place_max_blocks: int = 64
    #: histogram rows the place kernel reads at a time
    place_block_b: int = 16
    #: most tile-map entries per program of the tile-map kernels' grids
    tiles_per_program: int = 128

    def __post_init__(self) -> None:
        r = "DispatchTuning"
        _int(r, "small_max_comparisons", self.small_max_comparisons, 0)
        _int(r, "place_max_blocks", self.place_max_blocks, 0)
        _choice(r, "place_block_b", self.place_block_b, (1, 2, 4, 8, 16, 32, 64))
        _choice(r, "tiles_per_program", self.tiles_per_program, (16, 32, 64, 128, 256, 512, 1024))


@dataclass(frozen=True)
class QuantizeTuning:
    """Choices of the activation quantizer (``ops.quantize``)."""

    #: the most partial maxima the dynamic scale's absmax pass leaves for each quantize program to
    #: reduce; above, one zeroed word and atomics (0: always the atomics)
    max_absmax_partials: int = 64
    #: tiles per absmax program (fewer atomics on the one amax word)
    absmax_row_steps: int = 8

    def __post_init__(self) -> None:
        r = "QuantizeTuning"
        _int(r, "max_absmax_partials", self.max_absmax_partials, 0)
        _int(r, "absmax_row_steps", self.absmax_row_steps, 1)


_FAMILIES = {"moe": MoETuning, "linear": LinearTuning, "dispatch": DispatchTuning, "quantize": QuantizeTuning}


@dataclass(frozen=True)
class Tuning:
    """Every op family's tuning record (hashable: ``fp4moe.graphs`` keys its graphs by it)."""

    moe: MoETuning = field(default_factory=MoETuning)
    linear: LinearTuning = field(default_factory=LinearTuning)
    dispatch: DispatchTuning = field(default_factory=DispatchTuning)
    quantize: QuantizeTuning = field(default_factory=QuantizeTuning)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, _FAMILIES[f.name]):
                raise TypeError(f"Tuning.{f.name}: expected a {_FAMILIES[f.name].__name__}, got {type(v).__name__}")
        # hashed once: every graphed module call hashes the record in force (``fp4moe.graphs``)
        object.__setattr__(self, "_hash", hash((self.moe, self.linear, self.dispatch, self.quantize)))

    def __hash__(self) -> int:
        return self._hash

    def with_changes(self, **changes: Any) -> Tuning:
        """This record with ``changes`` per family: a record of that family, or a mapping of its
        fields (``moe=dict(fused_swiglu=False)``)."""
        updates = {}
        for family, change in changes.items():
            if family not in _FAMILIES:
                raise TypeError(f"tuning: no family {family!r}; expected one of {sorted(_FAMILIES)}")
            if isinstance(change, Mapping):
                cls = _FAMILIES[family]
                unknown = sorted(set(change) - {f.name for f in fields(cls)})
                if unknown:
                    raise TypeError(f"tuning: {cls.__name__} has no field {', '.join(map(repr, unknown))}")
                change = replace(getattr(self, family), **change)
            updates[family] = change
        return replace(self, **updates)


_tuning = Tuning()
_tuning_lock = threading.Lock()


def current_tuning() -> Tuning:
    """The tuning record in force."""
    return _tuning


def set_tuning(record: Tuning | None = None, **changes: Any) -> Tuning:
    """Replace the process-wide record (``record``, or the current one, with ``changes`` per family
    as :meth:`Tuning.with_changes`); returns the old one."""
    global _tuning
    with _tuning_lock:
        old = _tuning
        new = record if record is not None else old
        if not isinstance(new, Tuning):
            raise TypeError(f"record: expected a Tuning, got {type(new).__name__}")
        _tuning = new.with_changes(**changes) if changes else new
    return old


@contextlib.contextmanager
def tuning(record: Tuning | None = None, **changes: Any) -> Iterator[Tuning]:
    """``with tuning(moe=dict(fused_swiglu=False)): ...`` runs the block under changed choices and
    restores the previous record after it."""
    old = set_tuning(record, **changes)
    try:
        yield current_tuning()
    finally:
        set_tuning(old)
