"""FP4 weights re-ordered once into tensor-core operand order: the pack that the mma.sync
(``ops.mma_sync``) and wgmma (``ops.wgmma``) kernels read.

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

from dataclasses import dataclass

import torch

from ..formats import NVFP4, FP4Format, e4m3_to_e5m3, e5m3_to_e4m3, get_format, pack_fp4, unpack_fp4
from ..quantize import FP4Tensor
from ..tuning import current_tuning
from ._runtime import check_weight_scales

ROWS = 16  # weight rows per block (the MMA's M)


KCHUNK = 64  # K per 4 words of a lane


#: per stored bit order, the bit positions in its word of value p's E2M1 code bits (mantissa,
#: exponent low, exponent high, sign); ``kernels.linear_mma.DECODE_ASMS`` decodes each, and
#: ``pack_words`` / ``word_codes`` (the pack, its inverse and the tests) take the placement from
#: here only. "nibble": nibble p (13 integer operations per word). "rotation": register j (values
#: j, j + 4) from the word shifted or rotated by 6, 12, 2, 8 (9 operations; found by an exact-cover
#: search). The plain linear's decode is faster in the nibble order and the MoE layer's grouped GEMMs
#: in the rotation order (docs/performance-engineering.md, ``MoETuning.word_order``), so each pack
#: records its order.
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


def pack_mma(w: FP4Tensor, order: str = "nibble") -> MMAPackedFP4:
    """Re-order a 2-D FP4 weight [N, K] into MMA operand order, its words in bit order ``order``
    (``WORD_ORDERS``; any device; ``LinearTuning.pack_rows`` rows at a time). Checks the scales with one host sync:
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
    step = current_tuning().linear.pack_rows
    for r0 in range(0, N, step):
        r1 = min(r0 + step, N)
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


def _weights_before_wait(p: MMAPackedFP4, pdl: int) -> int:
    """A launch's PDL mode on ``p``: ``pdl``, except that a mode reading the weights before the wait
    for the kernel before (2 or 3) becomes 1 on the pack's first launch, since that kernel may be the
    one that wrote the pack (later launches follow one that has read it)."""
    if pdl >= 2 and not getattr(p.words, "_fp4moe_launched", False):
        p.words._fp4moe_launched = True
        return 1
    return pdl


def _scale_pairs_per_chunk(fmt: FP4Format | str) -> int:
    """int16 scale pairs per 16-row block and 64-K chunk in ``pack_mma``'s layout: ROWS rows of
    KCHUNK / block_size one-byte scales (NVFP4 32, MXFP4 16)."""
    return ROWS * (KCHUNK // get_format(fmt).block_size) // 2
