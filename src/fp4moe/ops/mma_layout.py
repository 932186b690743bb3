"""FP4 weights re-ordered once into tensor-core operand order, and the W4A16 decode launcher that
reads them (``kernels.linear_mma``).

``pack_mma(w)`` turns an ``FP4Tensor`` [N, K] into ``MMAPackedFP4``. The values are those of
``w`` exactly (``unpack_mma`` inverts it; tests check both ways): only the order of the nibbles
and the encoding of the scales change.

Words. Rows are cut in blocks of 16, K in chunks of 64. In ``mma.sync.m16n8k16`` a lane
``l = 4g + t`` holds, of a 16x16 A tile, the values (i2, i1, i0) at row ``g + 8*i1`` and column
``8*i2 + 2t + i0``. Word ``[rb, kc, l, kl]`` holds those 8 values of the tile (rows
``16 rb ..``, K ``64 kc + 16 kl ..``), value (i2, i1, i0) as value ``p = 4*i0 + 2*i2 + i1`` of the
word, its four code bits where the pack's bit order (``MMAPackedFP4.order``, ``WORD_ORDERS``)
puts them: "nibble", nibble p, so that nibbles p and p + 4 (one bf16x2 operand register) sit 16
bits apart and one mask and one multiply place both (13 integer operations per word); "rotation",
bits placed so that shifts and rotations of the word place them (9 operations). The decoders'
comments (``kernels.linear_mma``) have the arithmetic.

Scales. NVFP4: E4M3 re-encoded as E5M3 with exponent bias -10 (every E4M3 value, subnormals
included, is a normal E5M3 number with exponent code 1..18), so that ``(code << 4) + (235 << 7)``
is the bf16 bit pattern of scale * 2**118. Code 0 marks a zero scale: the decoder turns it into a
tiny non-zero scale, so its block's codes are set to zero (its values are zero either way). MXFP4: the E8M0 exponent as stored. Pairs (row g, row g + 8) are adjacent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from ..arch import Arch, default_gpu, get_arch
from ..formats import NVFP4, FP4Format, e4m3_to_e5m3, e5m3_to_e4m3, pack_fp4, unpack_fp4
from ..quantize import FP4Tensor
from ._runtime import arch_kwargs, check_weight_scales, pdl_enabled, pdl_kwargs

ROWS = 16  # weight rows per block (the MMA's M)
KCHUNK = 64  # K per 4 words of a lane

#: per stored bit order, the bit positions in its word of value p's E2M1 code bits (mantissa,
#: exponent low, exponent high, sign); ``kernels.linear_mma.DECODE_ASMS`` decodes each, and
#: ``pack_words`` / ``word_codes`` (the pack, its inverse and the tests) take the placement from
#: here only. "nibble": nibble p (13 integer operations per word). "rotation": register j (values
#: j, j + 4) from the word shifted or rotated by 6, 12, 2, 8 (9 operations; found by an exact-cover
#: search, session 22). On the H200 the rotation order ran the plain linear's decode 4-37% slower
#: (ptxas issued the next step's weight loads late; notes/linear-perf.md, session 22) and the MoE
#: layer's grouped GEMMs up to 8% faster (session 27), so each pack records its order.
WORD_ORDERS = {
    "nibble": tuple((4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3) for p in range(8)),
    "rotation": ((0, 1, 2, 9), (26, 27, 28, 3), (4, 5, 6, 13), (30, 7, 8, 15),
                 (16, 17, 18, 25), (10, 11, 12, 19), (20, 21, 22, 29), (14, 23, 24, 31)),
}


def _word_bits(order: str) -> tuple:
    if order not in WORD_ORDERS:
        raise ValueError(f"order: expected one of {sorted(WORD_ORDERS)}, got {order!r}")
    return WORD_ORDERS[order]


def _spread_table(device, order: str) -> torch.Tensor:
    """int64 [8, 16]: the bits of code c (0..15) at value p's positions in ``order``."""
    pos = torch.tensor(_word_bits(order), dtype=torch.int64, device=device)  # [8, 4]
    c = torch.arange(16, dtype=torch.int64, device=device)
    bits = (c[:, None] >> torch.arange(4, device=device)) & 1  # [16, 4]
    return (bits[None] << pos[:, None]).sum(-1)


def pack_words(codes: torch.Tensor, order: str = "nibble") -> torch.Tensor:
    """int32 words of E2M1 codes [..., 8] (value p of each word last), as ``WORD_ORDERS[order]``
    places them."""
    table = _spread_table(codes.device, order)
    words = table[torch.arange(8, device=codes.device), codes.to(torch.int64)].sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def word_codes(words: torch.Tensor, order: str = "nibble") -> torch.Tensor:
    """The E2M1 codes [..., 8] (value p last, int64) of int32 ``words`` (``pack_words`` inverted)."""
    w = words.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF
    pos = torch.tensor(_word_bits(order), dtype=torch.int64, device=words.device)  # [8, 4]
    return sum(((w >> pos[:, b]) & 1) << b for b in range(4))


@dataclass(frozen=True)
class MMAPackedFP4:
    """FP4 weights in the operand order of ``kernels.linear_mma``.

    words: int32 [N_pad/16, K_pad/64, 32, 4]; scales: uint8 [N_pad/16, K_pad/64, 32, 2] (NVFP4)
    or [N_pad/16, K_pad/64, 8, 4] (MXFP4); global_scale: as ``FP4Tensor`` (one value or None);
    shape: the logical [N, K]; N and K are padded with zeros to 16 and 64; order: the words' bit
    order (``WORD_ORDERS``), which the kernels' decode follows (``kernels.linear_mma.decode_asm``).
    """

    words: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    shape: torch.Size
    fmt: FP4Format
    order: str = "nibble"

    @property
    def device(self) -> torch.device:
        return self.words.device

    def to(self, device) -> MMAPackedFP4:
        return MMAPackedFP4(self.words.to(device), self.scales.to(device),
                            None if self.global_scale is None else self.global_scale.to(device), self.shape, self.fmt,
                            self.order)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s count of in-place writes; None for inference-mode tensors, which keep none (their
    packs are then made once, as before writes were tracked)."""
    try:
        return t._version
    except RuntimeError:
        return None


def cached_on_weight(w: FP4Tensor, attr: str, make, *, with_global: bool):
    """``make(w)`` kept with ``w``'s storage (attribute ``attr`` of ``w.data``) and made again when
    ``w`` changed since: its bytes or scales written in place (``load_state_dict`` copies into the
    buffers; torch counts in-place writes in ``Tensor._version``), its block scales replaced or,
    ``with_global``, its global scale replaced or written. The scale tensors are compared by
    identity (a freed tensor's id() can be passed on). None when ``make`` would run while a CUDA
    graph is being captured (it allocates or reads back): the caller then takes a path without it.
    Inference-mode tensors count no writes: there ``make`` runs once per set of tensors."""
    g = w.global_scale if with_global else None
    state = (_version(w.data), _version(w.scales), None if g is None else _version(g))
    cached = getattr(w.data, attr, None)
    if cached is None or cached[0] != state or cached[1] is not w.scales or cached[2] is not g:
        if w.data.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        cached = (state, w.scales, g, make(w))
        setattr(w.data, attr, cached)
    return cached[3]


def cached_pack(w: FP4Tensor, make, *, with_global: bool):
    """The pack ``make(w)`` kept with ``w`` (``cached_on_weight``, attribute ``_fp4moe_mma``): None
    when a pack is needed while a CUDA graph is being captured (packing allocates), and the caller
    then runs a kernel on ``w`` itself."""
    return cached_on_weight(w, "_fp4moe_mma", make, with_global=with_global)


#: weight rows re-ordered per step of ``pack_mma``: bounds its temporaries (~12 bytes per value of
#: a step) whatever the weight's size (a GLM-5 layer's experts hold 6.4 G values)
PACK_ROWS = 4096


def pack_mma(w: FP4Tensor, order: str = "nibble") -> MMAPackedFP4:
    """Re-order a 2-D FP4 weight [N, K] into MMA operand order, its words in bit order ``order``
    (``WORD_ORDERS``; any device; PACK_ROWS rows at a time). Checks the scales with one host sync:
    call it when weights are loaded, not per call."""
    if not isinstance(w, FP4Tensor):
        raise TypeError(f"w: expected an FP4Tensor, got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if w.global_scale is not None and w.global_scale.numel() != 1:
        raise ValueError("w: the MMA layout takes one global scale per weight")
    _word_bits(order)
    N, K = w.shape
    Np, Kp = -(-N // ROWS) * ROWS, -(-K // KCHUNK) * KCHUNK
    sbits = w.scales.view(torch.uint8)
    check_weight_scales(w, "w")  # NVFP4: no NaN; MXFP4: the decoder folds 2**100 into E8M0 scales
    words = torch.empty((Np // 16, Kp // 64, 32, 4), dtype=torch.int32, device=w.device)
    scales = torch.empty((Np // 16, Kp // 64) + ((32, 2) if w.fmt is NVFP4 else (8, 4)), dtype=torch.uint8,
                         device=w.device)
    for r0 in range(0, N, PACK_ROWS):
        r1 = min(r0 + PACK_ROWS, N)
        words[r0 // 16:-(-r1 // 16)], scales[r0 // 16:-(-r1 // 16)] = _pack_rows(w.data[r0:r1], sbits[r0:r1], w.fmt, Kp,
                                                                                 order)
    return MMAPackedFP4(words, scales, w.global_scale, torch.Size((N, K)), w.fmt, order)


def _pack_rows(data: torch.Tensor, sbits: torch.Tensor, fmt: FP4Format, Kp: int,
               order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Words and scale codes of ``data`` rows (packed bytes) and their scale bits, padded to 16 rows
    and Kp columns."""
    n, K = data.shape[0], data.shape[1] * 2
    group = fmt.block_size
    npad = -(-n // ROWS) * ROWS
    codes = unpack_fp4(data)
    if fmt is NVFP4:  # a zero scale has no E5M3 code: its block's values are zero, so are its codes
        codes = codes.masked_fill(((sbits & 0x7F) == 0).repeat_interleave(group, dim=1), 0)
        scodes = e4m3_to_e5m3(sbits)
    else:
        scodes = sbits
    codes = torch.nn.functional.pad(codes, (0, Kp - K, 0, npad - n))
    scodes = torch.nn.functional.pad(scodes, (0, (Kp - K) // group, 0, npad - n), value=0 if fmt is NVFP4 else 127)
    # stored K (kc, t, kl, i2, i0) -> [rb, kc, g, t, kl, i0, i2, i1]: value p = 4 i0 + 2 i2 + i1 of the word
    c = codes.reshape(npad // 16, 2, 8, Kp // 64, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 7, 6, 1)
    words = pack_words(c.reshape(npad // 16, Kp // 64, 32, 4, 8), order)
    if fmt is NVFP4:  # lane (g, t) owns K group t of the chunk: [rb, i1, g, kc, t] -> [rb, kc, g, t, i1]
        s = scodes.reshape(npad // 16, 2, 8, Kp // 64, 4).permute(0, 3, 2, 4, 1).reshape(npad // 16, Kp // 64, 32, 2)
    else:  # one scale per 32 K, group t // 2: [rb, i1, g, kc, th] -> [rb, kc, g, th, i1]
        s = scodes.reshape(npad // 16, 2, 8, Kp // 64, 2).permute(0, 3, 2, 4, 1).reshape(npad // 16, Kp // 64, 8, 4)
    return words, s


def unpack_mma(p: MMAPackedFP4) -> FP4Tensor:
    """The ``FP4Tensor`` that ``p`` holds (codes of zero-scale NVFP4 blocks read back as zeros; an
    NVFP4 pack without a global scale reads back with global scale 1)."""
    N, K = p.shape
    nb, kcs = p.words.shape[:2]
    Np, Kp = nb * 16, kcs * 64
    c = word_codes(p.words, p.order).reshape(nb, kcs, 8, 4, 4, 2, 2, 2)  # [rb, kc, g, t, kl, i0, i2, i1]
    codes = c.permute(0, 7, 2, 1, 3, 4, 6, 5).reshape(Np, Kp)[:N, :K].to(torch.uint8)
    if p.fmt is NVFP4:
        s = p.scales.reshape(nb, kcs, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(Np, Kp // 16)
        s = torch.where(s == 0, 0, e5m3_to_e4m3(s))[:N, :K // 16].to(torch.uint8)
        scales = s.view(torch.float8_e4m3fn)
    else:
        s = p.scales.reshape(nb, kcs, 8, 2, 2).permute(0, 4, 2, 1, 3).reshape(Np, Kp // 32)
        scales = s[:N, :K // 32].contiguous()
    gs = p.global_scale
    if gs is None and p.fmt is NVFP4:  # packed without its global (grouped experts): code x block scale
        gs = torch.ones(1, dtype=torch.float32, device=p.device)
    return FP4Tensor(data=pack_fp4(codes.contiguous()), scales=scales.contiguous(), global_scale=gs,
                     shape=torch.Size((N, K)), fmt=p.fmt)


# ----------------------------------------------------------------------------------------------
# launcher


@dataclass(frozen=True)
class MMAConfig:
    """Launch parameters of ``fp4_linear_mma_kernel``: ``rb`` 16-row blocks per warp, ``warps``
    warps along N (BLOCK_N = 16 * rb * warps), ``kh`` 64-K chunks per loop step, ``block_m``
    tokens per program, ``split_k`` programs sharing one output tile along K. ``kw`` > 1: K is split
    over ``kw`` groups of ``warps`` warps inside each program instead (``fp4_linear_mma_kw_kernel``,
    plain linear only; one launch, no partial sums), and ``pdl`` launches it with programmatic
    dependent launch: 1 waits for the previous kernel before its first load, 2 requests its first
    weight step before that wait, 3 also requests the program's whole share of the weight into L2
    before it (the launcher uses 1 on a pack's first launch, see ``_launch_kw``).
    ``xs`` >= 2: x comes through a shared-memory ring of that many steps, copied by cp.async ``xs`` - 1
    steps ahead once for all the warps along N (with ``kw``, one slot per K slice), instead of each
    warp loading it into registers at the start of each step (0); the launcher keeps 0 where x's row
    stride is not a multiple of 16 elements, its start not 16-byte aligned, or K is padded.
    ``xc`` (with ``kw``): each step's x is read, decoded weights made and MMAs issued one 64-K chunk
    at a time, so x holds a chunk's registers instead of a step's (16 tokens: 16 instead of 64).
    ``xa`` (with ``xc``, x in registers): each chunk's x is requested one chunk ahead of its MMA (two
    chunks' registers), so its latency hides behind the previous chunk's decode and MMAs.
    ``pf`` > 0 (with ``kw``; ignored without bulk copies, ``Arch.has_tma``): each loop step also
    requests the weights and scales ``pf`` steps ahead into L2 (two bulk prefetches per row block),
    so that the step's own loads find them there; ``_with_x_ring`` uses it with the x ring."""

    rb: int = 1
    warps: int = 4
    kh: int = 4
    block_m: int = 16
    split_k: int = 1
    kw: int = 1
    pdl: int = 0
    xs: int = 0
    xc: bool = False
    xa: bool = False
    pf: int = 0

    def __post_init__(self) -> None:
        if self.rb not in (1, 2, 4):
            raise ValueError(f"MMAConfig.rb: expected 1, 2 or 4, got {self.rb}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"MMAConfig.warps: expected 1, 2, 4 or 8, got {self.warps}")
        if self.kh not in (1, 2, 4):
            raise ValueError(f"MMAConfig.kh: expected 1, 2 or 4, got {self.kh}")
        if self.block_m not in (8, 16, 32, 64):
            raise ValueError(f"MMAConfig.block_m: expected 8, 16, 32 or 64, got {self.block_m}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"MMAConfig.split_k: expected 1..64, got {self.split_k}")
        if self.kw not in (1, 2, 4, 8):
            raise ValueError(f"MMAConfig.kw: expected 1, 2, 4 or 8, got {self.kw}")
        if self.kw > 1 and self.split_k > 1:
            raise ValueError(f"MMAConfig: K is split inside the program (kw={self.kw}) or over programs "
                             f"(split_k={self.split_k}), not both")
        if self.warps * self.kw > 16:
            raise ValueError(f"MMAConfig: warps * kw = {self.warps * self.kw} warps per program, at most 16")
        if self.pdl not in (0, 1, 2, 3):
            raise ValueError(f"MMAConfig.pdl: expected 0, 1, 2 or 3, got {self.pdl}")
        if self.xs not in (0, 2, 3, 4):
            raise ValueError(f"MMAConfig.xs: expected 0 (x in registers) or 2..4, got {self.xs}")
        if self.pdl and self.kw == 1:
            raise ValueError("MMAConfig.pdl: only the in-program K split (kw > 1) launches with PDL")
        if self.xc and self.kw == 1:
            raise ValueError("MMAConfig.xc: x per chunk is a mode of the in-program K split (kw > 1)")
        if type(self.pf) is not int or not 0 <= self.pf <= 8:
            raise ValueError(f"MMAConfig.pf: expected 0..8 steps ahead, got {self.pf!r}")
        if self.pf and self.kw == 1:
            raise ValueError("MMAConfig.pf: weights into L2 ahead is a mode of the in-program K split (kw > 1)")
        if self.xa and not (self.xc and self.xs == 0):
            raise ValueError("MMAConfig.xa: x a chunk ahead is a mode of x per chunk in registers (xc, xs = 0)")

    @property
    def block_n(self) -> int:
        return 16 * self.rb * self.warps

    def __str__(self) -> str:
        split = f"_split{self.split_k}" if self.split_k > 1 else ""
        kw = f"_kw{self.kw}" if self.kw > 1 else ""
        pdl = ("", "_pdl", "_pdl2", "_pdl3")[self.pdl]
        xs = f"_xs{self.xs}" if self.xs else ""
        xc = "_xc" if self.xc else ""
        xc += "_xa" if self.xa else ""
        pf = f"_pf{self.pf}" if self.pf else ""
        return f"mma_n{self.block_n}_m{self.block_m}_k{64 * self.kh}_w{self.warps}{split}{kw}{pdl}{xs}{xc}{pf}"

    @classmethod
    def parse(cls, name: str) -> MMAConfig:
        """The configuration ``str`` names (benchmark and sweep records), e.g. ``mma_n16_m8_k256_w1_kw4_pdl2``."""
        m = re.fullmatch(r"mma_n(\d+)_m(\d+)_k(\d+)_w(\d+)(?:_split(\d+))?(?:_kw(\d+))?(_pdl[23]?)?(?:_xs(\d+))?(_xc)?(_xa)?(?:_pf(\d))?", name)
        if not m or int(m[1]) % (16 * int(m[4])) or int(m[3]) % 64:
            raise ValueError(f"MMAConfig.parse: not a configuration name: {name!r}")
        n, bm, k, w = (int(g) for g in m.groups()[:4])
        return cls(rb=n // (16 * w), warps=w, kh=k // 64, block_m=bm, split_k=int(m[5] or 1), kw=int(m[6] or 1),
                   pdl={None: 0, "_pdl": 1, "_pdl2": 2, "_pdl3": 3}[m[7]], xs=int(m[8] or 0),
                   xc=bool(m[9]), xa=bool(m[10]), pf=int(m[11] or 0))


#: the largest batch the MMA-layout kernel takes; wider batches use the Triton kernel (measured on the
#: H200 at M = 64: the MMA-layout kernel's x fragments spill its registers or cut its K step)
MAX_M = 16


def _fit_kh(kh: int, chunks: int) -> int:
    """The largest of kh, kh/2, ... that divides the number of 64-K chunks."""
    while chunks % kh:
        kh //= 2
    return kh


#: registers per thread of ``fp4_linear_mma_kw_kernel`` by (MXFP4, block_m, rb, kh, kw), one warp along
#: N, from ptxas for sm_90 (Triton 3.6; ``tests/test_mma_layout.py`` recompiles and compares): the
#: decode heuristic's occupancy model
KW_REGISTERS = {
    (False, 8, 1, 2, 2): 56, (False, 8, 1, 2, 4): 56, (False, 8, 1, 2, 8): 56, (False, 8, 1, 4, 2): 80,
    (False, 8, 1, 4, 4): 80, (False, 8, 1, 4, 8): 80, (False, 8, 2, 2, 2): 80, (False, 8, 2, 2, 4): 80,
    (False, 8, 2, 2, 8): 80, (False, 8, 2, 4, 2): 122, (False, 8, 2, 4, 4): 122, (False, 8, 2, 4, 8): 122,
    (False, 16, 1, 2, 2): 71, (False, 16, 1, 2, 4): 71, (False, 16, 1, 2, 8): 80, (False, 16, 1, 4, 2): 128,
    (False, 16, 1, 4, 4): 128, (False, 16, 1, 4, 8): 128, (False, 16, 2, 2, 2): 96, (False, 16, 2, 2, 4): 96,
    (False, 16, 2, 2, 8): 128, (False, 16, 2, 4, 2): 158, (False, 16, 2, 4, 4): 158, (False, 16, 2, 4, 8): 158,
    (True, 8, 1, 2, 2): 56, (True, 8, 1, 2, 4): 56, (True, 8, 1, 2, 8): 64, (True, 8, 1, 4, 2): 96,
    (True, 8, 1, 4, 4): 96, (True, 8, 1, 4, 8): 99, (True, 8, 2, 2, 2): 96, (True, 8, 2, 2, 4): 96,
    (True, 8, 2, 2, 8): 98, (True, 8, 2, 4, 2): 146, (True, 8, 2, 4, 4): 146, (True, 8, 2, 4, 8): 148,
    (True, 16, 1, 2, 2): 72, (True, 16, 1, 2, 4): 72, (True, 16, 1, 2, 8): 72, (True, 16, 1, 4, 2): 128,
    (True, 16, 1, 4, 4): 128, (True, 16, 1, 4, 8): 128, (True, 16, 2, 2, 2): 122, (True, 16, 2, 2, 4): 122,
    (True, 16, 2, 2, 8): 126, (True, 16, 2, 4, 2): 188, (True, 16, 2, 4, 4): 188, (True, 16, 2, 4, 8): 188,
}
#: ``KW_REGISTERS`` of the x-per-chunk variant (``MMAConfig.xc``), by (MXFP4, rb, kh, kw), 8-token
#: programs launched with PDL = 3 (the only ones the heuristic gives it)
KW_REGISTERS_XC = {
    (False, 1, 2, 2): 48, (False, 1, 2, 4): 48, (False, 1, 2, 8): 48, (False, 1, 4, 2): 58, (False, 1, 4, 4): 58,
    (False, 1, 4, 8): 58, (False, 2, 2, 2): 70, (False, 2, 2, 4): 70, (False, 2, 2, 8): 70, (False, 2, 4, 2): 100,
    (False, 2, 4, 4): 100, (False, 2, 4, 8): 98, (True, 1, 2, 2): 56, (True, 1, 2, 4): 56, (True, 1, 2, 8): 48,
    (True, 1, 4, 2): 66, (True, 1, 4, 4): 66, (True, 1, 4, 8): 66, (True, 2, 2, 2): 72, (True, 2, 2, 4): 72,
    (True, 2, 2, 8): 78, (True, 2, 4, 2): 128, (True, 2, 4, 4): 128, (True, 2, 4, 8): 128,
}
#: 16-row blocks per SM from which ``choose_mma_config`` breaks ties on bytes in flight by more
#: resident warps before longer steps, for 8-token programs whose weight streams from DRAM (not
#: ``pdl`` = 3): typically 8 warps of 128-K steps instead of 4 warps of 256-K steps. Session 7 fitted
#: the other order on GLM-5's NVFP4 shapes, which this leaves as they were. H200, session 24
#: (scripts/sweep_linear_configs.py, benchmarks/raw/try-decode-tiebreak-h200.json, 75 points where
#: the order matters, M = 1..16, both formats): at >= 3 blocks per SM (N >= 6,336) every point
#: measured was faster or level, 0.99-1.44x (24 points, geometric mean 1.14x; 8192x25600 M = 1 45.1 -> 32.5 us,
#: MXFP4 8192x14336 M = 1 23.2 -> 19.8); at 2.4-2.9 blocks per SM (N = 5120, 6144) mixed, 0.83-1.18x
#: (MXFP4 5120x7168 M = 8 9.7 -> 11.6 us, MXFP4 6144x12288 M = 1 faster); at 16-token programs and
#: for weights requested into L2 first, mostly slower (GLM-5's 4096x6144 at M = 16 0.75x).
WARPS_FIRST_BLOCKS_PER_SM = 3
#: weight bytes in flight per SM that the decode heuristic aims for (Little's law at ~4.3 TB/s over
#: 132 SMs and ~1.2 us of loaded DRAM latency)
DECODE_INFLIGHT_BYTES = 40_000


def choose_mma_config(M: int, N: int, K: int, sm_count: int = 132, *, fmt: FP4Format | str = NVFP4,
                      arch: Arch | str | None = None, l2_bytes: int | None = None) -> MMAConfig:
    """The decode configuration (M <= MAX_M): K split over the warps of each program
    (``MMAConfig.kw``, one launch) with PDL, chosen by an occupancy model (H200 sweep,
    scripts/sweep_decode_kw.py): every program resident at once (one wave, from
    ``KW_REGISTERS``), then the most weight bytes in flight per SM up to
    ``DECODE_INFLIGHT_BYTES`` (one loop step per warp is in flight while the previous one decodes),
    then (ties) longer steps, then more resident warps (the other way round for 8-token programs
    of large weights, ``WARPS_FIRST_BLOCKS_PER_SM``). Each warp runs at least 2 loop steps (4 for 16-token programs,
    whose x fragments cost more per step). 8 tokens per program at M <= 8, 16 above. Occupancy
    limits and PDL from the catalogue entry of ``arch`` (default SM90, where the model was fitted).
    Weights of at most ``PDL_L2_SHARE`` of the L2 (``l2_bytes``; default that of the catalogue's
    first GPU of ``arch``) are requested into L2 whole before the PDL wait (``pdl`` = 3); there,
    8-token programs first look for a grid that fits on the SMs twice (``PDL3_CORESIDENT``), with x
    read per chunk (``MMAConfig.xc``, fewer registers) where only that fits."""
    from ..formats import get_format

    arch = get_arch(arch or "sm90")
    mx = get_format(fmt) is not NVFP4
    block_m = 8 if M <= 8 else 16
    chunks = -(-K // KCHUNK)
    min_steps = 2 if block_m == 8 else 4
    weight_bytes = -(-N // ROWS) * chunks * (KCHUNK * ROWS // 2) * (1 + (1 / 16 if mx else 1 / 8))  # words, scales
    l2 = l2_bytes or int(default_gpu(arch).l2_mib * 2**20)
    pdl3 = arch.has_pdl and weight_bytes <= PDL_L2_SHARE * l2
    coresident = coresident_rule(mx, block_m, pdl3)
    # ties on bytes in flight: more resident warps before longer steps for 8-token programs of a
    # weight streamed from DRAM with at least WARPS_FIRST_BLOCKS_PER_SM row blocks per SM
    warps_first = block_m == 8 and not pdl3 and -(-N // ROWS) >= WARPS_FIRST_BLOCKS_PER_SM * sm_count
    best, best_score = None, None
    for rb in (1, 2):
        for kh in (2, 4):
            for kw in (2, 4, 8):
                if chunks % (kh * kw) or chunks // (kh * kw) < min_steps:
                    continue
                for xc in (False, True) if coresident else (False,):
                    regs = KW_REGISTERS_XC[(mx, rb, kh, kw)] if xc else KW_REGISTERS[(mx, block_m, rb, kh, kw)]
                    per_sm = arch.ctas_per_sm(32 * kw, registers=regs,
                                              smem_bytes=kw * 16 * rb * block_m * 4)  # the partial tiles
                    programs = -(-N // (16 * rb)) * -(-M // block_m)
                    resident = min(programs / sm_count, per_sm)
                    inflight = min(resident * kw * rb * kh * 512, DECODE_INFLIGHT_BYTES)
                    # the next launch's programs fit beside this one's (each SM's share twice)
                    twice = not coresident or 2 * -(-programs // sm_count) <= per_sm
                    ties = (resident * kw, kh) if warps_first else (kh, resident * kw)
                    score = (programs <= per_sm * sm_count, twice, inflight, *ties, not xc)
                    if best_score is None or score > best_score:
                        best, best_score = MMAConfig(rb=rb, warps=1, kh=kh, block_m=block_m, kw=kw,
                                                     pdl=(3 if pdl3 else 2) if arch.has_pdl else 0, xc=xc), score
    if best is None:  # K too short to split over warps: one warp per program, K in one slice
        kh = _fit_kh(4, chunks)
        return MMAConfig(rb=1, warps=4, kh=kh, block_m=block_m, split_k=1)
    return _with_x_ring(best, M, N, chunks, sm_count, mx, arch)


#: the part of the L2 up to which the decode kernel requests its whole weight into L2 before its PDL
#: wait (``MMAConfig.pdl`` = 3), so that the stream overlaps the kernel before it. H200
#: (scripts/sweep_linear_configs.py, benchmarks/raw/sweep-linear-pdl3-h200.json; at M = 1 its second
#: repetition: the first timed the default partly at a pack's first-launch PDL = 1): 6.3 MB weights
#: (6144x2048, 5120x2048, 2048x4096) 6-15% faster at M = 1..16, 12.6 MB (4096x6144) within 0-5%,
#: 33-42 MB 11-25% slower (the requests of a large weight evict each other and compete with the
#: kernel before)
PDL_L2_SHARE = 0.25


#: 8-token decode programs whose weight is requested into L2 before the PDL wait (``pdl`` = 3) prefer
#: a grid whose programs fit on each SM twice, so that the next launch's programs are resident (and
#: requesting their weights) while this one runs; x read per chunk (``MMAConfig.xc``: 56-58 instead
#: of 80 registers) makes room where the grid fits only once. H200 (scripts/sweep_linear_configs.py,
#: benchmarks/raw/sweep-linear-xc-h200.json, M = 1..8): 4096x6144 7.2 -> 6.0 us, 4096x4096
#: 5.6 -> 4.8, 8192x2048 5.0 -> 4.5 at M = 1 (10-20% at M = 1..8). Where the grid already fits twice
#: (6144x2048, 2048x6144) x per chunk was 2-9% slower; with the weight streamed from DRAM (PDL = 2,
#: large weights) 25-30% slower, and at 16 tokens per program slower everywhere but one case
#: (within 1%), so it is used nowhere else.
PDL3_CORESIDENT = True
#: ... for MXFP4 weights too: off. Their registers differ (x per chunk 66 instead of 58 at one row
#: block, 96 instead of 80 without), so the rule picks other grids, often two row blocks per warp;
#: H200 (the same file, part "mxfp4_rule_check"), its choices against the one-grid ones at M = 1 / 8:
#: 6144x2048 -9% / -9%, 6144x4096 -7% / -1%, 4096x6144 +1% / 0, 4096x4096 +1% / +2%, 8192x2048
#: +1% / -3%, 12288x2048 +1% / +5%, 5120x5120 +11% / +18%.
PDL3_CORESIDENT_MXFP4 = False


def coresident_rule(mx: bool, block_m: int, pdl3: bool) -> bool:
    """Whether ``choose_mma_config`` ranks grids that fit each SM twice and considers x per chunk
    (``PDL3_CORESIDENT``, ``PDL3_CORESIDENT_MXFP4``) for programs of ``block_m`` tokens."""
    return pdl3 and block_m == 8 and PDL3_CORESIDENT and (not mx or PDL3_CORESIDENT_MXFP4)


#: K steps per slice from which 16-token decode programs take x through the shared-memory ring
X_RING_MIN_STEPS = 12
#: steps ahead at which decode programs with the x ring request their weights into L2 (``MMAConfig.pf``;
#: GPUs with bulk copies, ``Arch.has_tma``). H200, session 24 (scripts/sweep_linear_configs.py,
#: benchmarks/raw/try-l2-prefetch-xring-h200.json): faster at all 24 points where the ring is the
#: runtime's choice (M = 9, 12, 16; six NVFP4 shapes and two MXFP4): 6144x12288 3.1-4.9%,
#: 5120x12288 / 6144x28672 / 4096x25600 1.3-5.5%, 2048x28672 and 1024x25600 17.6-22.1%, MXFP4
#: 12288x6144 / 12288x12288 0.3-3.8%; 1 and 3 steps ahead less so. Without the ring it was slower
#: almost everywhere (12288x6144 at M = 1 12.8 -> 15.2 us, the MoE decode GEMMs 1-16%;
#: benchmarks/raw/try-l2-prefetch-{linear,moe}-h200.json), so it is used nowhere else: the ring's
#: per-step barrier makes each step wait for its slowest warp's weights, which the prefetch makes
#: shorter, where warps running freely hide that latency among themselves (an explanation that
#: fits, not measured apart).
X_RING_PREFETCH_STEPS = 2


def _with_x_ring(c: MMAConfig, M: int, N: int, chunks: int, sm_count: int, mx: bool, arch: Arch) -> MMAConfig:
    """``c`` with ``xs`` = 2 where the H200 measured the ring faster (scripts/sweep_linear_configs.py,
    benchmarks/raw/sweep-linear-xring-h200.json): 16-token programs of one 16-row block (their x
    step is 4x their weight step) whose K slices run at least ``X_RING_MIN_STEPS`` steps and whose
    grid stays one wave with the ring's shared memory: GLM-5's 6144x12288 at M = 9..16, 5-17% faster.
    Elsewhere it measured slower (up to 30% on 8192x8192, a second wave) or within 3%, and not
    faster in the MoE GEMMs, so it stays off there. At 8 tokens per program it was slower on GLM-5's
    shapes (session 12) and in session 24 faster on two of five other shapes (5120x25600 +23%,
    4096x14336 +15%) and 7-39% slower on three (6144x12288 at M = 8 among them), which the one-wave
    test does not tell apart (``benchmarks/raw/try-l2-prefetch-linear-other-shapes-h200.json``), so
    it stays off there too. With the ring, on SM90, the weights also go into L2
    ``X_RING_PREFETCH_STEPS`` steps ahead (``MMAConfig.pf``)."""
    if c.block_m != 16 or c.rb != 1 or c.warps != 1 or chunks // (c.kh * c.kw) < X_RING_MIN_STEPS:
        return c
    ring = 2 * c.kw * c.block_m * c.kh * KCHUNK * 2
    # the partial tiles' scratch comes after the loop and reuses the ring's memory
    per_sm = arch.ctas_per_sm(32 * c.kw, registers=KW_REGISTERS[(mx, c.block_m, c.rb, c.kh, c.kw)],
                              smem_bytes=max(ring, c.kw * 16 * c.block_m * 4))
    if -(-N // c.block_n) * -(-M // c.block_m) > per_sm * sm_count:
        return c
    return replace(c, xs=2, pf=X_RING_PREFETCH_STEPS if arch.has_tma else 0)


def _split(config: MMAConfig, chunks: int) -> tuple[int, int, int]:
    """(kh, splits, 64-K chunks per split) for ``config`` on a weight of ``chunks`` 64-K chunks."""
    kh = _fit_kh(config.kh, chunks)
    steps = chunks // kh
    split = min(config.split_k, steps)
    per_split = -(-steps // split) * kh
    return kh, -(-chunks // per_split), per_split


def _fit_kw(config: MMAConfig, chunks: int) -> tuple[int, int]:
    """(kh, kw) for ``config`` on a weight of ``chunks`` 64-K chunks: every K slice the same whole
    number of steps (kw halved first, then kh)."""
    kh, kw = _fit_kh(config.kh, chunks), config.kw
    while chunks % (kh * kw):
        if kw > 1:
            kw //= 2
        else:
            kh //= 2
    return kh, kw


def _weights_before_wait(p: MMAPackedFP4, pdl: int) -> int:
    """A launch's PDL mode on ``p``: ``pdl``, except that a mode reading the weights before the wait
    for the kernel before (2 or 3) becomes 1 on the pack's first launch, since that kernel may be the
    one that wrote the pack (later launches follow one that has read it)."""
    if pdl >= 2 and not getattr(p.words, "_fp4moe_launched", False):
        p.words._fp4moe_launched = True
        return 1
    return pdl


def _split_pdl(splits: int, has_pdl: bool) -> bool:
    """Whether a plain wgmma launch of ``splits`` K splits chains its pass and GEMM by PDL (``SPLIT_PDL``)."""
    return SPLIT_PDL and splits > 1 and has_pdl


def _launch_kw(x2, p: MMAPackedFP4, bias, out, config: MMAConfig):
    """The one launch of ``fp4_linear_mma_kw_kernel`` (``config.kw`` > 1): out = x2 @ W^T (+ bias)."""
    import triton

    from ..kernels.linear_mma import (FOLD_E4M3, FOLD_E8M0, decode_asm, fp4_linear_mma_kw_kernel, scale_asm,
                                      x_layout_kw)
    from .linear import device_arch

    if x2.dtype != torch.bfloat16:
        raise TypeError(f"x: the MMA-layout kernel takes bfloat16 activations, got {x2.dtype}")
    M, N = x2.shape[0], p.shape[0]
    chunks = p.words.shape[1]
    kh, kw = _fit_kw(config, chunks)
    mx = p.fmt is not NVFP4
    unused = p.scales
    arch = device_arch(p.words.device)
    has_pdl = arch is not None and arch.has_pdl  # griddepcontrol
    pdl = _weights_before_wait(p, config.pdl if has_pdl else 0)  # without it: an ordinary launch
    fp4_linear_mma_kw_kernel[(triton.cdiv(N, config.block_n), triton.cdiv(M, config.block_m))](
        p.words, p.scales.view(torch.int16), x2, p.global_scale if p.global_scale is not None else unused,
        bias if bias is not None else unused, out, M, N, chunks * KCHUNK, x2.shape[1], x2.stride(0), out.stride(0),
        chunks // kw, RB=config.rb, WARPS=config.warps, KW=kw, KH=kh, BLOCK_M=config.block_m, MXFP4=mx,
        HAS_WG=p.global_scale is not None, HAS_BIAS=bias is not None, FOLD=FOLD_E8M0 if mx else FOLD_E4M3,
        DECODE=decode_asm(p.order), SCALE=scale_asm(mx),
        X_LAYOUT=x_layout_kw(config.block_m, 1 if config.xc else kh, config.warps, kw), XC=config.xc,
        XA=config.xa, EVEN_K=chunks * KCHUNK == x2.shape[1], PDL=pdl, X_STAGES=_x_stages(config, x2, chunks),
        PF=config.pf if arch is not None and arch.has_tma else 0,  # cp.async.bulk.prefetch.L2: bulk-copy GPUs
        num_warps=config.warps * kw, launch_pdl=pdl > 0, **arch_kwargs(x2.device))
    return out


def _x_stages(config: MMAConfig, x2: torch.Tensor, chunks: int) -> int:
    """``config.xs``, or 0 (x in registers) where the ring's 16-byte copies of whole K steps cannot
    read x: K padded to the 64-K chunk, or a row stride the compiler cannot prove 16-byte aligned
    (Triton specialises an integer argument only as a multiple of 16: a stride of 8 mod 16 elements
    would compile to 2-byte copies, which cp.async does not have), or an unaligned start."""
    even_k = chunks * KCHUNK == x2.shape[1]
    return config.xs if even_k and x2.stride(0) % 16 == 0 and x2.data_ptr() % 16 == 0 else 0


def _launch(x2, p: MMAPackedFP4, bias, target, M: int, N: int, config: MMAConfig, grid_m: int, *, plan=None,
            gather: bool = False, stride_ym: int = 0, swiglu: bool = False, globals_=(None, 0),
            plan_ready: bool = False, independent: bool = False):
    """The one launch of ``fp4_linear_mma_kernel`` (plain, or GROUPED over an MoE plan's tiles;
    ``swiglu``: MoE GEMM 1 with its epilogue, N outputs, ``globals_`` as ``ops.moe._weight_globals``,
    ``bias`` [E, 2N] or None; ``plan_ready`` and ``independent`` as ``launch_grouped_mma``'s)."""
    import triton

    from ..kernels.linear_mma import FOLD_E4M3, FOLD_E8M0, decode_asm, fp4_linear_mma_kernel, scale_asm, x_layout

    if x2.dtype != torch.bfloat16:
        raise TypeError(f"x: the MMA-layout kernel takes bfloat16 activations, got {x2.dtype}")
    chunks = p.words.shape[1]
    kh, split, per_split = _split(config, chunks)
    mx = p.fmt is not NVFP4
    unused = p.scales  # pointer arguments a variant does not read (Triton needs a tensor)
    tiles = (plan.tile_expert, plan.tile_start, plan.tile_end) if plan is not None else (unused,) * 3
    # the MoE chain (dispatch -> GEMM -> epilogue) launches with PDL; the plain linear's split-K path does not
    pdl = pdl_kwargs(x2.device) if plan is not None else {"PDL": 0, "launch_pdl": False}
    x_stages = _x_stages(config, x2, chunks)
    if independent and pdl["PDL"] and x_stages:  # x in registers is loaded through L1: wait for it
        pdl = {"PDL": 3, "launch_pdl": True}
    elif plan_ready and pdl["PDL"]:
        pdl = {"PDL": 2, "launch_pdl": True}
    wg, wg_mode = globals_
    if wg is None:
        wg = p.global_scale
    fp4_linear_mma_kernel[(triton.cdiv(N, config.block_n), grid_m, split)](
        p.words, p.scales.view(torch.int16), x2, wg if wg is not None else unused,
        bias if bias is not None else unused, target, *tiles, plan.sorted_token if gather else unused,
        M, N, chunks * KCHUNK, x2.shape[1], x2.stride(0), stride_ym, per_split,
        wg.stride(0) if wg_mode == 2 else 0, bias.stride(0) if swiglu and bias is not None else 0,
        RB=config.rb, WARPS=config.warps, KH=kh, BLOCK_M=config.block_m, MXFP4=mx,
        HAS_WG=p.global_scale is not None, HAS_BIAS=bias is not None, SPLIT_K=split,
        FOLD=FOLD_E8M0 if mx else FOLD_E4M3, DECODE=decode_asm(p.order), SCALE=scale_asm(mx),
        X_LAYOUT=x_layout(config.block_m, kh, config.warps), EVEN_K=chunks * KCHUNK == x2.shape[1],
        GROUPED=plan is not None, GATHER=gather, SWIGLU=swiglu, WG_MODE=wg_mode,
        X_STAGES=x_stages,
        num_warps=config.warps, **pdl, **arch_kwargs(x2.device))
    return split


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
    (``MMAPackedFP4.order``; the MoE experts' is ``ops.moe.MOE_WORD_ORDER``)."""
    from ..formats import get_format
    from ..kernels.linear_mma import FOLD_E4M3, FOLD_E8M0, decode_asm, scale_asm
    from ..plan.crosscompile import CompileRequest

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


def launch_linear_mma(x2: torch.Tensor, p: MMAPackedFP4, bias: torch.Tensor | None, out: torch.Tensor,
                      config: MMAConfig) -> torch.Tensor:
    """One launch: ``out[M, N] = x2[M, K] @ W^T (+ bias)``; x2 bf16 with unit stride along K,
    out with unit stride along N. Compiled CUDA only (Gluon; no interpreter)."""
    import triton


    if config.kw > 1:
        return _launch_kw(x2, p, bias, out, config)
    M = x2.shape[0]
    N = p.shape[0]
    split = _split(config, p.words.shape[1])[1]
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    _launch(x2, p, bias, target, M, N, config, triton.cdiv(M, config.block_m), stride_ym=out.stride(0))
    if split > 1:
        from .linear import reduce_splits

        reduce_splits(target, bias, out)
    return out


def _check_grouped(p: MMAPackedFP4, plan, config: MMAConfig) -> None:
    """What both grouped launches need: the plan made for the configuration's tile height, and the
    experts packed without global scales (the MoE epilogues apply them)."""
    if plan.block_m != config.block_m:
        raise ValueError(f"plan: block_m {plan.block_m} differs from the configuration's {config.block_m}")
    if p.global_scale is not None:
        raise ValueError("p: grouped weights are packed without global scales")


def launch_grouped_mma(x2: torch.Tensor, p: MMAPackedFP4, n_per_expert: int, plan, config: MMAConfig, *,
                       gather: bool, plan_ready: bool = False, out: torch.Tensor | None = None,
                       independent: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Partial sums ``part[s, r, :] = W_e @ x[row(r)]`` over the K share of split s, for every sorted
    row r of an MoE dispatch plan (``ops.dispatch``; its block_m must be ``config.block_m``) that
    one of the plan's tiles covers, e the row's expert. ``p`` packs the experts' weights stacked
    [E * n_per_expert, K] without global scales (the MoE epilogue applies them). Returns part
    [splits, R, n_per_expert] in ``dtype`` (fp32, or bf16: each row's sum rounded once; ``out`` when
    given: a second launch over another class of the plan's experts, ``ops.dispatch.tile_map(rows=...)``,
    writes its rows into the same tensor).
    ``plan_ready``: the plan was written at least two kernels before this one in the PDL chain (MoE
    GEMM 2), so with PDL the kernel reads it and requests its first weight step before it waits for
    the previous kernel (whose launch already waited for the plan's writer to complete).
    ``independent``: nothing this launch reads was written by the kernel before it in the PDL chain,
    and none of its rows either (the second class of ``ops.moe.MMAHeights``, after the first): with
    PDL it runs alongside that kernel's last programs instead of waiting for it, and its last program
    waits for it, so that the next kernel's wait covers both. Only with x through the shared-memory
    ring (``MMAConfig.xs``, where ``_x_stages`` keeps it): x in registers is read through L1, which
    a grid that has not waited may hold stale; elsewhere the launch waits as usual."""
    _check_grouped(p, plan, config)
    if config.kw > 1:
        raise ValueError(f"config.kw: the grouped kernel splits K over programs (split_k), got kw={config.kw}")
    R = plan.sorted_pair.shape[0]
    split = _split(config, p.words.shape[1])[1]
    shape = (split, R, n_per_expert)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype: the partial sums are float32 or bfloat16, got {dtype}")
    if out is None:
        part = torch.empty(shape, dtype=dtype, device=x2.device)
    elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {dtype} {shape}, got {out.dtype} {tuple(out.shape)}")
    else:
        part = out
    if plan.max_tiles == 0:  # a class of experts that no batch of this size can fill
        return part
    _launch(x2, p, None, part, R, n_per_expert, config, plan.max_tiles, plan=plan, gather=gather,
            plan_ready=plan_ready, independent=independent)
    return part


def launch_grouped_mma_swiglu(x2: torch.Tensor, p: MMAPackedFP4, n_out: int, plan, config: MMAConfig,
                              out: torch.Tensor, globals_, bias: torch.Tensor | None,
                              independent: bool = False) -> torch.Tensor:
    """MoE GEMM 1 with its epilogue in the kernel: ``out[r, :] = silu(g) * u`` (bf16) for every
    sorted row r of the plan, where g and u are the row's token times the expert's gate rows [0,
    n_out) and up rows [n_out, 2 n_out), with ``globals_`` (``ops.moe._weight_globals``) and
    ``bias`` [E, 2 n_out] applied as ``moe_partials_epilogue_kernel`` does. ``p`` packs the
    experts' [E * 2 n_out, K] rows without global scales; n_out a multiple of 16; no K split. Rows
    no tile of the plan covers are not written (a class of experts, ``ops.dispatch.tile_map``);
    ``independent`` as ``launch_grouped_mma``'s."""
    _check_grouped(p, plan, config)
    if config.kw > 1 or config.split_k > 1:
        raise ValueError(f"config: the fused SwiGLU epilogue needs whole K per program, got {config}")
    if n_out % ROWS:
        raise ValueError(f"n_out: the up rows start a whole 16-row block after the gate rows, got {n_out}")
    if plan.max_tiles:
        _launch(x2, p, bias, out, plan.sorted_pair.shape[0], n_out, config, plan.max_tiles, plan=plan, gather=True,
                stride_ym=out.stride(0), swiglu=True, globals_=globals_, independent=independent)
    return out


# ----------------------------------------------------------------------------------------------
# prefill on Hopper: wgmma with the weights as the register operand (kernels.gemm_wgmma)


#: the warp-specialized wgmma kernel (``kernels.gemm_ws``): decoded weight tiles in flight and
#: registers per thread of its decode warpgroup (the launch's register cap, ``ws_maxnreg``, fits the
#: SM's registers; ``setmaxnreg`` gives the MMA warps what the decode warpgroup leaves). H200, session
#: 6: 3 tiles, 80 or 112 registers, 8 decode warps or 2 wgmma groups in flight were no faster.
WS_A_STAGES = 2
WS_DECODE_REGS = 96
WS_DECODE_WARPS = 4  # the kernel's decode partition (``gl.warp_specialize`` in kernels/gemm_ws.py)


@dataclass(frozen=True)
class WgmmaConfig:
    """Launch parameters of ``fp4_gemm_wgmma_kernel``: ``warps`` 4 or 8 (one or two warpgroups),
    ``repeats`` 16-row weight blocks per warp (2: 32 * warps weight rows per program, the gate and
    up halves of MoE GEMM 1 in one thread; 1: 16 * warps rows, so that a 256-row activation tile
    still fits the registers), ``block_m`` activation rows per program (the wgmma N side; the
    accumulator holds repeats * block_m / 2 fp32 registers per thread, at most 128), ``stages``
    activation ring depth, ``group_m`` activation tiles per raster group (plain linear only),
    ``tail_m`` (MoE only; 0 = off) the height at which a tile of at most that many rows, an
    expert's short last tile, runs with narrower wgmmas; ``split_k`` (plain linear, not ``ws``)
    programs sharing one output tile along K, whose fp32 partials ``splitk_reduce_kernel`` adds in
    a fixed order (small M: more programs and more weight bytes in flight than the output tiles
    give); ``ws`` the warp-specialized kernel
    (``kernels.gemm_ws``: a decode warpgroup writes the bf16 weight tile to shared memory for the
    ``warps`` = 8 MMA warps; ``stages`` is then its TMA ring, plus ``WS_A_STAGES`` decoded tiles);
    ``persistent`` (plain linear, 256-row tiles of two warpgroups, no split-K) one program per SM
    computing tiles one after the other through one ring (``kernels.gemm_wgmma._gemm_persistent``;
    the launcher runs a program per tile instead where K has fewer than ``stages`` - 2 chunks);
    ``merge_tail`` (MoE, with ``tail_m``) an expert's full tile followed by its short last tile runs
    both: the same decoded weights feed a second, ``tail_m``-row wgmma per chunk, so the short
    tile's weights are neither read nor decoded a second time (its own programs do nothing)."""

    block_m: int = 128
    stages: int = 4
    group_m: int = 8
    warps: int = 4
    repeats: int = 2
    tail_m: int = 0
    split_k: int = 1
    ws: bool = False
    persistent: bool = False
    merge_tail: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"WgmmaConfig.block_m: expected 16, 32, 64, 128 or 256, got {self.block_m}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"WgmmaConfig.split_k: expected 1..64, got {self.split_k}")
        if self.split_k > 1 and (self.tail_m or self.ws):
            raise ValueError(f"WgmmaConfig.split_k: the plain linear of the register-A kernel splits K, not the MoE "
                             f"tails (tail_m) or the warp-specialized kernel (ws), got {self}")
        if not 3 <= self.stages <= 8:
            raise ValueError(f"WgmmaConfig.stages: expected 3..8, got {self.stages}")
        if self.warps not in (4, 8):
            raise ValueError(f"WgmmaConfig.warps: expected 4 or 8, got {self.warps}")
        if not 1 <= self.group_m <= 64:
            raise ValueError(f"WgmmaConfig.group_m: expected 1..64, got {self.group_m}")
        if self.repeats not in (1, 2):
            raise ValueError(f"WgmmaConfig.repeats: expected 1 or 2, got {self.repeats}")
        if self.repeats * self.block_m > 256:
            raise ValueError(f"WgmmaConfig: block_m {self.block_m} with repeats {self.repeats} needs "
                             f"{self.repeats * self.block_m // 2} accumulator registers per thread (at most 128); "
                             "use repeats=1 for 256-row tiles")
        if self.tail_m not in (0, 32, 64, 128) or (self.tail_m and self.tail_m >= self.block_m):
            raise ValueError(f"WgmmaConfig.tail_m: expected 0, or 32, 64 or 128 below block_m {self.block_m}, "
                             f"got {self.tail_m}")
        if self.ws and (self.warps, self.repeats, self.tail_m) != (8, 1, 0):
            raise ValueError(f"WgmmaConfig.ws: the warp-specialized kernel has 8 MMA warps of one repeat and no "
                             f"tail tiles, got warps={self.warps} repeats={self.repeats} tail_m={self.tail_m}")
        if self.persistent and ((self.block_m, self.warps, self.repeats) != (256, 8, 1) or self.split_k > 1
                                or self.tail_m or self.ws):
            raise ValueError(f"WgmmaConfig.persistent: 256-row tiles of two warpgroups of one repeat (one program "
                             f"per SM; shorter tiles fit two programs per SM, which one persistent program would "
                             f"halve), without split_k, tail_m or ws, got {self}")
        if self.merge_tail and not self.tail_m:
            raise ValueError(f"WgmmaConfig.merge_tail: merges an expert's short last tile (tail_m rows) into the tile "
                             f"before it, so it needs tail_m, got {self}")
        if self.ws and self.stages <= WS_A_STAGES:
            raise ValueError(f"WgmmaConfig.stages: the warp-specialized kernel's TMA ring must be deeper than its "
                             f"{WS_A_STAGES} decoded tiles (the copies' lead is the difference), got {self.stages}")

    @property
    def block_n(self) -> int:
        """Weight rows per program."""
        return 16 * self.repeats * self.warps

    def with_tail(self, tail_m: int, block_m: int | None = None) -> WgmmaConfig:
        """This configuration with ``tail_m``-row tails (0: none) and optionally another ``block_m``;
        merged tails stay on only while there are tails to merge."""
        return replace(self, block_m=self.block_m if block_m is None else block_m, tail_m=tail_m,
                       merge_tail=self.merge_tail and tail_m > 0)

    def __str__(self) -> str:
        tail = ("" if self.repeats == 2 else f"_r{self.repeats}") + (f"_t{self.tail_m}" if self.tail_m else "") \
            + (f"_split{self.split_k}" if self.split_k > 1 else "") + ("_ws" if self.ws else "") \
            + ("_p" if self.persistent else "") + ("_mt" if self.merge_tail else "")
        return f"wgmma_n{self.block_n}_m{self.block_m}_s{self.stages}_g{self.group_m}{tail}"

    @classmethod
    def parse(cls, name: str) -> WgmmaConfig:
        """The configuration ``str`` names (benchmark and sweep records), e.g. ``wgmma_n128_m256_s4_g8_r1``."""
        m = re.fullmatch(r"wgmma_n(\d+)_m(\d+)_s(\d+)_g(\d+)(?:_r(\d))?(?:_t(\d+))?(?:_split(\d+))?(_ws)?(_p)?(_mt)?",
                         name)
        repeats = int(m[5] or 2) if m else 2
        if not m or int(m[1]) % (16 * repeats):
            raise ValueError(f"WgmmaConfig.parse: not a configuration name: {name!r}")
        return cls(block_m=int(m[2]), stages=int(m[3]), group_m=int(m[4]), warps=int(m[1]) // (16 * repeats),
                   repeats=repeats, tail_m=int(m[6] or 0), split_k=int(m[7] or 1), ws=bool(m[8]),
                   persistent=bool(m[9]), merge_tail=bool(m[10]))


#: the smallest batch the plain linear runs on the wgmma kernel (SM90); at MAX_M and below the
#: mma.sync decode kernel. H200 (session 8, ``scripts/sweep_small_m.py``,
#: benchmarks/raw/sweep-small-m-h200.json): with split-K and the scales by TMA the wgmma kernel takes
#: 24.3 / 24.5 / 13.6 / 11.1 us at M = 32 on the four GLM-5 shapes against the Triton kernel's 54.1 /
#: 56.2 / 25.1 / 12.4 (M = 64: 28.9 / 29.7 / 15.7 / 12.8 against 60.0 / 62.5 / 28.4 / 14.4). At
#: M = 16 it ties the decode kernel at best (22.5 against 23.1 us on 6144x12288, 22.1 against 17.9 on
#: 12288x6144).
WGMMA_MIN_M = MAX_M + 1

#: up to this many rows the plain linear's wgmma tile is split along K (``choose_wgmma_config``)
WGMMA_SPLIT_MAX_M = 64
#: programs per SM the K split aims for at most, and the fewest 64-K chunks a split keeps
WGMMA_SPLIT_PROGRAMS_PER_SM = 3
WGMMA_SPLIT_MIN_CHUNKS = 8


#: relative time of one program by activation tile height (two warpgroups of one repeat, H200,
#: scripts/sweep_wgmma_tiles.py): a 128-row tile costs 0.56 of a 256-row one (12288x6144, M = 4096:
#: 1,087 vs 964 us for the same rows), a 64-row tile 0.65 of a 128-row one (M = 1024: 325 vs 251)
_WGMMA_TILE_COST = {256: 100, 128: 56, 64: 36}


def choose_wgmma_config(M: int, N: int, K: int, sm_count: int = 132) -> WgmmaConfig:
    """Two warpgroups of 64 weight rows each (128 per program, one register repeat) and the
    activation tile height, of 64, 128 or 256 rows, with the least waves x tile cost: the
    programs' count over the SMs, rounded up, times the program's relative time
    (``_WGMMA_TILE_COST``; taller tiles decode each weight once for more rows). On the H200 this
    picks the fastest of the measured heights, or one within 1%, at all 48 (shape, M) points of the
    GLM-5 sweep, M = 96..16384 (``benchmarks/raw/sweep-wgmma-tiles*-h200.json``); against the earlier single warpgroup of two
    repeats and 128-row tiles it is 9-15% faster at M = 4096 (12288x6144: 1,054 -> 964 us).
    256-row tiles run persistent (one program per SM; session 14, ``sweep_wgmma_tiles.py
    --persistent``: 0-2% faster on 12288x6144, 2.5-7% on 4096x6144, 6-14% on 6144x2048 at M =
    1024..16384). Shorter tiles keep a program per tile: two of them share an SM, which one
    persistent program of their registers would not.

    Small batches (M <= WGMMA_SPLIT_MAX_M) are bound by the weight stream, which one tile row of
    programs cannot keep busy: one warpgroup of two repeats (128 weight rows) over a 32- or 64-row
    tile, K split over the most programs up to WGMMA_SPLIT_PROGRAMS_PER_SM per SM, each keeping at
    least WGMMA_SPLIT_MIN_CHUNKS chunks (H200: within 5% of the best configuration swept at all 8
    GLM-5 points M = 32, 64 of ``sweep_small_m.py``; the farthest, 6144x2048 at M = 64: 12.8
    against 12.3 us)."""
    if M <= WGMMA_SPLIT_MAX_M:
        block_m = 32 if M <= 32 else 64
        programs = -(-M // block_m) * -(-N // 128)
        chunks = -(-K // KCHUNK)
        split = max([s for s in (1, 2, 3, 4, 6, 8) if programs * s <= WGMMA_SPLIT_PROGRAMS_PER_SM * sm_count
                     and chunks // s >= WGMMA_SPLIT_MIN_CHUNKS] or [1])
        return WgmmaConfig(block_m=block_m, stages=4, warps=4, repeats=2, split_k=split)
    tiles_n = -(-N // 128)

    def cost(bm: int) -> tuple[int, int]:
        waves = -(-(-(-M // bm) * tiles_n) // max(sm_count, 1))
        return waves * _WGMMA_TILE_COST[bm], -bm

    return persistent_where_possible(WgmmaConfig(block_m=min(_WGMMA_TILE_COST, key=cost), stages=4, group_m=8,
                                                 warps=8, repeats=1), K)


def persistent_where_possible(config: WgmmaConfig, K: int) -> WgmmaConfig:
    """``config`` as the plain linear runs it on a weight of K columns: 256-row tiles of two
    warpgroups of one repeat run persistent where K has at least ``stages`` - 2 chunks (a ring
    refill then reaches at most into the next tile, what ``_gemm_persistent`` assumes), every other
    configuration a program per tile. The heuristic, the launcher and the planner's candidates
    all ask here."""
    can = (config.block_m, config.warps, config.repeats, config.split_k, config.tail_m, config.ws) == (256, 8, 1, 1, 0,
                                                                                                       False)
    return replace(config, persistent=can and -(-K // KCHUNK) >= config.stages - 2)


def _x_pairs(x2: torch.Tensor) -> torch.Tensor:
    """bf16 activations [rows, K] as int32 pairs (what ``mma_order_rows`` moves)."""
    if x2.dtype != torch.bfloat16:
        raise TypeError(f"x: the wgmma kernel takes bfloat16 activations, got {x2.dtype}")
    if x2.stride(-1) != 1 or x2.stride(0) % 2 or x2.shape[1] % 2 or x2.data_ptr() % 4:
        x2 = x2.contiguous()
    return x2.view(torch.int32)


def mma_order_rows(x2: torch.Tensor, k_stored: int, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, *, pdl: bool = False) -> torch.Tensor:
    """Activations [M, K_X] bf16 -> [R, k_stored] in the packed weights' MMA K order (each 64-K
    chunk's bf16 pairs permuted as ``pack_mma`` permutes the weights' K; K past K_X zero): the
    layout the wgmma kernel's TMA copies into shared memory as it is. ``rows`` [R] int32 gathers
    (MoE GEMM 1: the dispatch plan's sorted_token, whose -1 rows, dropped pairs, come out zero);
    otherwise R = M. One pass over the data. ``pdl``: launched with programmatic dependent launch
    (``kernels.pdl``; the caller checks the device has it)."""
    import triton

    from ..kernels.gemm_wgmma import mma_order_rows_kernel

    if k_stored % KCHUNK or k_stored < x2.shape[1]:
        raise ValueError(f"k_stored: expected a multiple of {KCHUNK} >= K = {x2.shape[1]}, got {k_stored}")
    if rows is not None:
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != x2.device:
            raise ValueError(f"rows: expected a 1-D int32/int64 tensor on {x2.device}, got {rows.dtype} "
                             f"{tuple(rows.shape)} on {rows.device}")
        rows = rows.contiguous()
    xp = _x_pairs(x2)
    R = x2.shape[0] if rows is None else rows.shape[0]
    if out is None:
        out = torch.empty((R, k_stored), dtype=torch.bfloat16, device=x2.device)
    elif tuple(out.shape) != (R, k_stored) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous bf16 [{R}, {k_stored}], got {out.dtype} {tuple(out.shape)}")
    if R == 0:
        return out
    op = out.view(torch.int32)
    block_r, block_q = 16, 128 if k_stored % 256 == 0 else 32
    mma_order_rows_kernel[(triton.cdiv(R, block_r), k_stored // 2 // block_q)](
        xp, rows if rows is not None else xp, op, R, x2.shape[1], xp.stride(0), op.stride(0),
        GATHER=rows is not None, BLOCK_R=block_r, BLOCK_Q=block_q, num_warps=4, PDL=int(pdl), launch_pdl=pdl,
        **arch_kwargs(op.device))
    return out


def _x_desc(xm: torch.Tensor, block_m: int):
    """TMA descriptor of activations in MMA K order [R, K]: [block_m, 64] tiles in the 128-byte
    swizzle that wgmma reads (rows past R are zero-filled by the copy)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if (xm.dtype != torch.bfloat16 or xm.dim() != 2 or xm.stride(1) != 1 or (xm.stride(0) * 2) % 16
            or xm.data_ptr() % 16 or xm.shape[1] % KCHUNK):
        raise ValueError(f"activations for TMA: expected bf16 [R, K] with K a multiple of {KCHUNK}, 16-byte aligned "
                         f"rows and base, got {xm.dtype} {tuple(xm.shape)} strides {tuple(xm.stride())}")
    return TensorDescriptor.from_tensor(xm, [block_m, KCHUNK], _x_smem_layout())


def _w_smem_layout():
    """The weight-word ring's shared layout: plain rows of 128 int32 (each thread reads its own 16
    bytes back), the layout TMA copies them in."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _w_box_rows(config: WgmmaConfig, swiglu: bool) -> int:
    """16-row weight blocks per TMA box: the program's blocks, or for GEMM 1 its gate half (the up
    half is a second copy from I / 16 blocks further)."""
    nb = config.repeats * config.warps
    return nb // 2 if swiglu else nb


def _w_desc(p: MMAPackedFP4, rows: int):
    """TMA descriptor of the packed weight words as [blocks, K/64 * 128] int32, [rows, 128] boxes
    (one chunk of ``rows`` 16-row blocks; blocks past the end read as zeros)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    words = p.words.reshape(p.words.shape[0], -1)
    return TensorDescriptor.from_tensor(words, [rows, 128], _w_smem_layout())


def _s_desc(p: MMAPackedFP4, rows: int):
    """TMA descriptor of the scale pairs as [blocks, K/64 * S] int16 (S = 32 per 64-K chunk for
    NVFP4, 16 for MXFP4), [rows, S] boxes: one chunk of ``rows`` 16-row blocks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    sc = p.scales.view(torch.int16).reshape(p.scales.shape[0], -1)
    return TensorDescriptor.from_tensor(sc, [rows, _scale_pairs_per_chunk(p.fmt)], _s_smem_layout())


def _s_smem_layout():
    """The scale-pair ring's shared layout: plain int16 rows, as TMA copies them."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def _decode_consts(fmt: FP4Format | str, order: str = "nibble") -> dict:
    """The FP4 decode constexprs of the wgmma kernels for ``fmt`` (MXFP4 flag, scale fold, asm)."""
    from ..formats import get_format
    from ..kernels.linear_mma import FOLD_E4M3, FOLD_E8M0, decode_asm, scale_asm

    mx = get_format(fmt) is not NVFP4
    return dict(MXFP4=mx, FOLD=FOLD_E8M0 if mx else FOLD_E4M3, DECODE=decode_asm(order), SCALE=scale_asm(mx))


def _epilogue_signature(out_type: str, bias_type: str = "*bf16") -> dict[str, str]:
    """Signature types of the wgmma kernels' arguments from ``wg_ptr`` on (the epilogue's, the
    dispatch plan's and the sizes), shared by both kernels."""
    return {"wg_ptr": "*fp32", "bias_ptr": bias_type, "out_ptr": out_type, "tile_expert_ptr": "*i32",
            "tile_start_ptr": "*i32", "tile_end_ptr": "*i32", "row_out_ptr": "*i32", "row_w_ptr": "*fp32",
            "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "stride_ge": "i32", "stride_be": "i32",
            "n_tiles_m": "i32"}


def _x_smem_layout():
    """The activation tile's shared layout: the 128-byte swizzle wgmma reads its B operand in."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


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
    from ..plan.crosscompile import CompileRequest

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
        signature = {"w_desc": w_type, "s_desc": _s_desc_type(w_rows, fmt), "x_desc": _x_desc_type(config.block_m),
                     **_epilogue_signature(f"*{out_dtype}", f"*{out_dtype}")}
        return CompileRequest(kernel="fp4moe.kernels.gemm_ws:fp4_gemm_ws_kernel", signature=signature,
                              constexprs=dict(common, A_STAGES=WS_A_STAGES, DECODE_REGS=WS_DECODE_REGS), cc=cc,
                              num_warps=config.warps, divisible_by_16=("out_ptr", "N", "K", "stride_om"),
                              maxnreg=ws_maxnreg(config.warps + WS_DECODE_WARPS))
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


def ws_smem_terms(config: WgmmaConfig, fmt: FP4Format | str) -> list[tuple[str, int, int]]:
    """(name, bytes each, count) of the warp-specialized kernel's explicit shared buffers: the TMA
    ring (activation tile, weight words, scale pairs), the decoded A tiles and the mbarriers
    (``gl.warp_specialize`` adds a little of its own)."""
    nb = config.block_n // ROWS
    return [("activation tile (TMA)", config.block_m * KCHUNK * 2, config.stages),
            ("weight words (TMA)", nb * 32 * 4 * 4, config.stages),
            ("scale pairs (TMA)", nb * _scale_pairs_per_chunk(fmt) * 2, config.stages),
            ("decoded weight tile (bf16)", config.block_n * KCHUNK * 2, WS_A_STAGES),
            ("mbarrier", 8, config.stages + 2 * WS_A_STAGES)]


def _scale_pairs_per_chunk(fmt: FP4Format | str) -> int:
    """int16 scale pairs per 16-row block and 64-K chunk in ``pack_mma``'s layout: ROWS rows of
    KCHUNK / block_size one-byte scales (NVFP4 32, MXFP4 16)."""
    from ..formats import get_format

    return ROWS * (KCHUNK // get_format(fmt).block_size) // 2


def _s_desc_type(rows: int, fmt: FP4Format | str) -> str:
    """The Triton signature type of ``_s_desc``'s descriptor for boxes of ``rows`` 16-row blocks."""
    return f"tensordesc<i16[{rows}, {_scale_pairs_per_chunk(fmt)}],{_s_smem_layout()!r}>"


def wgmma_smem_terms(config: WgmmaConfig, fmt: FP4Format | str) -> list[tuple[str, int, int]]:
    """(name, bytes each, count) of the wgmma kernel's shared memory: the activation, weight-word
    and scale-pair rings (all TMA tiles) and one mbarrier per stage. The epilogue works from
    registers; a ``tail_m`` variant's buffers reuse the same bytes, and a ``merge_tail`` tile's
    activation ring holds the tail's rows too. Checked against compiled kernels in the tests."""
    nb = config.repeats * config.warps  # 16-row weight blocks per program
    rows = config.block_m + (config.tail_m if config.merge_tail else 0)
    return [("activation tile (TMA)", rows * KCHUNK * 2, config.stages),
            ("weight words (TMA)", nb * 32 * 4 * 4, config.stages),
            ("scale pairs (TMA)", nb * _scale_pairs_per_chunk(fmt) * 2, config.stages),
            ("mbarrier", 8, config.stages)]


def launch_linear_wgmma(x2: torch.Tensor, p: MMAPackedFP4, bias: torch.Tensor | None, out: torch.Tensor,
                        config: WgmmaConfig = WgmmaConfig(), *, x_mma_order: bool = False,
                        max_programs: int | None = None) -> torch.Tensor:
    """``out[M, N] = x2[M, K] @ W^T (+ bias)`` on SM90 (wgmma; compiled CUDA only): two launches,
    the pass into MMA K order (``mma_order_rows``) and the GEMM, and with ``config.split_k`` a third,
    the reduction of the fp32 partials (bias and cast there). ``x_mma_order``: x2 already is
    [M, K stored] in MMA K order, contiguous (``ops.quantize.dequantize_activations(k_stored=...)``),
    and the first pass is skipped. ``max_programs``: a persistent configuration's grid (default one
    program per SM; the tests use fewer to give each program many tiles)."""
    import triton

    from ..kernels.gemm_wgmma import fp4_gemm_wgmma_kernel

    if config.tail_m:
        raise ValueError(f"config: tail_m is for the MoE GEMMs, got {config}")
    if max_programs is not None and (not isinstance(max_programs, int) or max_programs < 1):
        raise ValueError(f"max_programs: expected a positive int or None, got {max_programs!r}")
    M, N = x2.shape[0], p.shape[0]
    k_stored = p.words.shape[1] * KCHUNK
    if M == 0:
        return out
    if x_mma_order and (tuple(x2.shape) != (M, k_stored) or x2.dtype != torch.bfloat16 or not x2.is_contiguous()):
        raise ValueError(f"x2: x_mma_order needs a contiguous bf16 [{M}, {k_stored}], got {x2.dtype} {tuple(x2.shape)}")
    split, per_split = wgmma_split(config, p.words.shape[1])
    # split-K (small batches, where launch gaps weigh most): the pass and the GEMM chained by programmatic
    # dependent launch, the GEMM requesting its first weights before its wait (``SPLIT_PDL`` says what was
    # measured). The pass waits for the kernel before it to complete before it lets the GEMM launch, so
    # whatever wrote the weights has finished; with x already in MMA order the GEMM follows that kernel
    # directly, and on a pack's first launch it waits before any load
    pdl = _split_pdl(split, bool(pdl_enabled(out.device)))
    gemm_pdl = 0
    if pdl:
        gemm_pdl = _weights_before_wait(p, 2) if x_mma_order else 2
    x_desc = _x_desc(x2 if x_mma_order else mma_order_rows(x2, k_stored, pdl=pdl), config.block_m)
    tiles_m = triton.cdiv(M, config.block_m)
    unused = p.scales  # pointer arguments the plain variant does not read (Triton needs a tensor)
    w_desc = _w_desc(p, _w_box_rows(config, False))
    target = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=out.device)
    fused_bias = bias if split == 1 else None
    rest = (p.global_scale if p.global_scale is not None else unused,
            fused_bias if fused_bias is not None else unused, target,
            unused, unused, unused, unused, unused, M, N, k_stored, target.stride(-2), 0, 0, tiles_m)
    consts = dict(BLOCK_M=config.block_m, STAGES=config.stages, WG_MODE=1 if p.global_scale is not None else 0,
                  HAS_BIAS=fused_bias is not None, GROUPED=False, SCATTER=False, HAS_RW=False,
                  GROUP_M=config.group_m, WARPS=config.warps, **_decode_consts(p.fmt, p.order))
    grid = (tiles_m * triton.cdiv(N, config.block_n), split)
    if config.persistent:
        config = persistent_where_possible(config, k_stored)
    if config.persistent:  # one program of two warpgroups per SM (registers), each over its share of the tiles
        programs = max_programs or torch.cuda.get_device_properties(out.device).multi_processor_count
        grid = (min(grid[0], programs), 1)
    if config.ws:
        from ..kernels.gemm_ws import fp4_gemm_ws_kernel

        fp4_gemm_ws_kernel[grid](w_desc, _s_desc(p, config.block_n // ROWS), x_desc, *rest, A_STAGES=WS_A_STAGES,
                                 DECODE_REGS=WS_DECODE_REGS, num_warps=config.warps,
                                 maxnreg=ws_maxnreg(config.warps + WS_DECODE_WARPS), **consts,
                                 **arch_kwargs(out.device))
        return out
    fp4_gemm_wgmma_kernel[grid](w_desc, _s_desc(p, _w_box_rows(config, False)), x_desc, x_desc, *rest, per_split,
                                SWIGLU=0,
                                ALPHA=0.0, LIMIT=0.0, OUT_MMA_ORDER=False, REPEATS=config.repeats, TAIL_M=0,
                                PERSISTENT=config.persistent, num_warps=config.warps, PDL=gemm_pdl,
                                launch_pdl=pdl, **consts, **arch_kwargs(out.device))
    if split > 1:
        from .linear import reduce_splits

        reduce_splits(target, bias, out)
    return out


#: split-K wgmma launches (M = 17..64) chain the pass into MMA K order and the GEMM by programmatic
#: dependent launch, the GEMM's first stages - 2 chunks of weights (two for the runtime's 4-stage
#: configurations) requested before its wait. H200, GLM-5 shapes at M = 17, 32, 64
#: (benchmarks/raw/try-wgmma-split-pdl-h200.json, run 3): 3-7% faster on all twelve. The reduction
#: kernel after it launched with PDL too was 8-12% slower on the two large shapes at M = 17 and 32
#: (its programs resident and waiting through the GEMM) though 11-17% faster on 6144x2048, so it
#: launches plainly.
SPLIT_PDL = True


def wgmma_split(config: WgmmaConfig, chunks: int) -> tuple[int, int]:
    """(splits, 64-K chunks per split) of ``config.split_k`` on a weight of ``chunks`` 64-K chunks:
    the chunks evenly over at most split_k programs, none of them empty."""
    per_split = -(-chunks // min(config.split_k, max(chunks, 1)))
    return -(-chunks // per_split), per_split


def ws_maxnreg(warps: int) -> int:
    """The register cap under which one program of ``warps`` warps fits an SM90's register file, a
    multiple of 8 as ``setmaxnreg`` counts (12 warps: 168)."""
    return get_arch("sm90").regs_per_sm // (32 * warps) // 8 * 8


def fuses_activation(n_per_expert: int) -> bool:
    """GEMM 1 can apply the activation in the wgmma kernel: the gate and up halves of each expert's
    2I rows are whole 16-row blocks (I a multiple of 16), one register repeat each."""
    return n_per_expert % (2 * ROWS) == 0


def launch_grouped_wgmma(x2: torch.Tensor, p: MMAPackedFP4, n_per_expert: int, plan, out: torch.Tensor,
                         config: WgmmaConfig, *, gather: bool, x_mma_order: bool = False,
                         out_mma_order: bool = False, swiglu: int = 0, alpha: float = 0.0, limit: float = 0.0,
                         globals_: tuple[torch.Tensor | None, int] = (None, 0), bias: torch.Tensor | None = None,
                         row_weight: torch.Tensor | None = None, scatter: bool = False) -> torch.Tensor:
    """One launch over an MoE dispatch plan (its block_m must be ``config.block_m``): GEMM 1
    (``swiglu`` > 0: gate rows then up rows per expert, n_per_expert = 2I; writes h [R, I]) or
    GEMM 2 (routing weight ``row_weight`` per sorted row, ``scatter`` to the pair rows), with the experts' globals
    ``globals_`` = (tensor, mode) as ``ops.moe._weight_globals`` and bias [E, n_per_expert].
    Activations: ``x_mma_order`` when x2 already is [R, K stored] in MMA K order (GEMM 2 reading the
    h that GEMM 1 wrote with ``out_mma_order``); otherwise one ``mma_order_rows`` pass first
    (``gather``: the plan's token rows). ``out_mma_order`` (GEMM 1) needs ``out`` [R, K stored of
    GEMM 2's weights], zero in its columns past I when I is not a multiple of 64."""
    import triton

    from ..kernels.gemm_wgmma import fp4_gemm_wgmma_kernel

    if plan.block_m != config.block_m:
        raise ValueError(f"plan: block_m {plan.block_m} differs from the configuration's {config.block_m}")
    if config.split_k > 1 or config.persistent:
        raise ValueError(f"config: the grouped GEMMs neither split K over programs nor run persistent, got {config}")
    if swiglu and config.repeats != 2:
        raise ValueError(f"config: GEMM 1 with the fused activation needs repeats=2 (a thread holds a gate row "
                         f"and its up row), got {config}")
    if p.global_scale is not None:
        raise ValueError("p: grouped weights are packed without global scales")
    if swiglu and not fuses_activation(n_per_expert):
        raise ValueError(f"n_per_expert: the fused activation needs 2I a multiple of 32, got {n_per_expert}")
    k_stored = p.words.shape[1] * KCHUNK
    R = plan.sorted_pair.shape[0]
    if x_mma_order and gather:
        raise ValueError("x_mma_order: activations already in MMA order are not gathered again (gather=False)")
    n_out = n_per_expert // 2 if swiglu else n_per_expert
    if out_mma_order:
        if not swiglu:
            raise ValueError("out_mma_order: only GEMM 1 (swiglu > 0) writes its output in MMA K order")
        width = -(-n_out // KCHUNK) * KCHUNK
        if out.dim() != 2 or out.shape[0] != R or out.shape[1] < width or out.stride(1) != 1:
            raise ValueError(f"out: GEMM 1 in MMA K order writes [{R}, {width}] (I = {n_out} padded to {KCHUNK}), "
                             f"got {tuple(out.shape)}")
    if x_mma_order:
        if tuple(x2.shape) != (R, k_stored) or x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
            raise ValueError(f"x2: expected bf16 [{R}, {k_stored}] in MMA K order, got {x2.dtype} {tuple(x2.shape)}")
        xm = x2
    else:
        xm = mma_order_rows(x2, k_stored, plan.sorted_token if gather else None)
    if R == 0:
        return out
    wg, wg_mode = globals_
    unused = plan.sorted_pair
    fp4_gemm_wgmma_kernel[(plan.max_tiles * triton.cdiv(n_out, config.block_n // 2 if swiglu else config.block_n),)](
        _w_desc(p, _w_box_rows(config, bool(swiglu))), _s_desc(p, _w_box_rows(config, bool(swiglu))),
        _x_desc(xm, config.block_m),
        _x_desc(xm, config.tail_m or config.block_m), wg if wg is not None else unused,
        bias if bias is not None else unused, out, plan.tile_expert, plan.tile_start, plan.tile_end,
        plan.sorted_pair if scatter else unused, row_weight if row_weight is not None else unused,
        R, n_per_expert, k_stored, out.stride(0),
        wg.stride(0) if wg_mode == 2 else 0, bias.stride(0) if bias is not None else 0, plan.max_tiles,
        k_stored // KCHUNK, BLOCK_M=config.block_m, STAGES=config.stages, WG_MODE=wg_mode, HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        ALPHA=alpha, LIMIT=limit, GROUPED=True, SCATTER=scatter, HAS_RW=row_weight is not None,
        OUT_MMA_ORDER=out_mma_order, GROUP_M=1, WARPS=config.warps, REPEATS=config.repeats, TAIL_M=config.tail_m,
        MERGE_TAIL=config.merge_tail, num_warps=config.warps, **_decode_consts(p.fmt, p.order), **arch_kwargs(out.device))
    return out
