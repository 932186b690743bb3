"""The decode kernels' inline PTX (``kernels.linear_mma``: ``DECODE_ASMS``, ``scale_asm``), run
instruction by instruction on CPU by a small interpreter of the instructions it uses
(``ptx_interp``), for every E2M1 code at every value position of a word and every stored scale
code of both formats.

The asm itself only runs in compiled CUDA (Gluon); the GPU tests check the kernels bit for bit
against the reference. This test checks the arithmetic of the text the kernels embed on a
machine without a GPU: each decoded bf16 value, times the kernel's fold, must be exactly
``E2M1(code) * scale``, with -0 kept, for words laid out as ``ops.mma_layout.pack_words`` writes
them, in each stored bit order with its own decode.
"""

from __future__ import annotations

import pytest
import torch

from fp4moe.formats import E2M1_VALUES, e4m3_to_e5m3
from fp4moe.kernels.linear_mma import DECODE_ASMS, FOLD_E4M3, FOLD_E8M0, decode_asm, scale_asm
from fp4moe.ops.mma_pack import WORD_ORDERS, pack_words, word_codes
from ptx_interp import INSTRUCTIONS, bf16_to_float, instructions_of, run_ptx

# output k of the decode holds value VALUE[k] of its word; outputs 0, 1, 4, 5 use the first scale pair
VALUE = [0, 4, 1, 5, 2, 6, 3, 7]
ROW_G = [True, True, False, False, True, True, False, False]


def _nvfp4_scales() -> list[tuple[int, float]]:
    """(stored byte, scale) for every positive finite non-zero E4M3 scale."""
    out = []
    for b in range(1, 0x7F):
        e4m3 = torch.tensor([b], dtype=torch.uint8)
        scale = float(e4m3.view(torch.float8_e4m3fn).float())
        out.append((int(e4m3_to_e5m3(e4m3)), scale))
    return out


def _mxfp4_scales() -> list[tuple[int, float]]:
    """(stored byte, scale) for the E8M0 exponents the decoder takes (-106..27, the range
    ``check_weight_scale_range`` admits)."""
    return [(e + 127, 2.0 ** e) for e in range(-106, 28)]


@pytest.mark.parametrize("order", sorted(WORD_ORDERS))
@pytest.mark.parametrize("mxfp4", [False, True], ids=["nvfp4", "mxfp4"])
def test_decode_asm_is_exact_for_every_code_and_scale(mxfp4, order):
    scales = _mxfp4_scales() if mxfp4 else _nvfp4_scales()
    fold = FOLD_E8M0 if mxfp4 else FOLD_E4M3
    n = len(scales)
    code_g = torch.tensor([c for c, _ in scales])
    scale_g = torch.tensor([v for _, v in scales], dtype=torch.float64)
    other = torch.tensor([(7 * i + 3) % n for i in range(n)])  # the other row's scale: another value
    code_h, scale_h = code_g[other], scale_g[other]
    sg, sh = run_ptx(scale_asm(mxfp4), [code_g | (code_h << 8)], 2)
    # per scale pair, 128 words: every code at every value position, the other values random
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, 128, 8), generator=g)
    word = torch.arange(128)
    codes[:, word, word // 16] = word % 16
    out = run_ptx(decode_asm(order), [pack_words(codes, order), sg[:, None], sh[:, None]], 8)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    for k in range(8):
        got = bf16_to_float(out[k]).double() * fold
        want = values[codes[..., VALUE[k]]] * (scale_g if ROW_G[k] else scale_h)[:, None]
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), (mxfp4, order, k)


@pytest.mark.parametrize("order", sorted(WORD_ORDERS))
def test_word_bits_place_every_bit_once_and_round_trip(order):
    """Each order of ``WORD_ORDERS`` is a permutation of the word's 32 bits, and ``word_codes``
    inverts ``pack_words``; the orders differ, so a word read in the wrong one decodes wrongly."""
    assert sorted(b for value in WORD_ORDERS[order] for b in value) == list(range(32))
    codes = torch.randint(0, 16, (1000, 8), generator=torch.Generator().manual_seed(1))
    words = pack_words(codes, order)
    assert words.dtype == torch.int32 and torch.equal(word_codes(words, order), codes)
    other = next(o for o in WORD_ORDERS if o != order)
    assert not torch.equal(word_codes(words, other), codes)


def test_unknown_order_is_refused():
    assert set(DECODE_ASMS) == set(WORD_ORDERS)  # every stored order has its decode
    with pytest.raises(ValueError, match="order"):
        decode_asm("nibbles")
    with pytest.raises(ValueError, match="order"):
        pack_words(torch.zeros(1, 8, dtype=torch.int64), "rotate")


def test_interpreter_knows_every_instruction_of_the_asm():
    assert instructions_of("".join(DECODE_ASMS.values()) + scale_asm(False)) <= INSTRUCTIONS
