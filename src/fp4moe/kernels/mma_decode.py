"""Gluon device functions shared by the kernels that read FP4 weights in MMA-operand order
(``kernels.linear_mma``, ``kernels.gemm_wgmma``, ``kernels.gemm_ws``): the decode of packed words
and their scale pairs straight into the bf16 A operand, in registers, and programmatic dependent
launch for Gluon kernels (``kernels.pdl`` is its @triton.jit form).

The decode's inline PTX arrives as constexprs (``DECODE``, ``SCALE``): the launchers build them
with ``kernels.linear_mma.decode_asm`` and ``scale_asm``, whose comments have the arithmetic.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _pdl_wait():
    """Wait for the previous grid to complete (its writes visible)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pdl_release():
    """Let the next grid launch once every program of this one has come here (or exited)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _pdl_enter():
    """``kernels.pdl.pdl_enter`` for Gluon kernels: wait for the previous grid, then let the next launch."""
    _pdl_wait()
    _pdl_release()


@gluon.jit
def _decode_words(w, s, WORD_AXIS: gl.constexpr, DECODE: gl.constexpr, SCALE: gl.constexpr):
    """Packed words [..., 4] (``WORD_AXIS`` the last) and their scale pairs [...] -> the 8 bf16
    fragment values of every word, [..., 4, i0, i1, i2] (``DECODE``'s nibble order)."""
    sg, sh = gl.inline_asm_elementwise(SCALE, "=r,=r,h", [s], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    sg, _ = gl.broadcast(gl.expand_dims(sg, WORD_AXIS), w)
    sh, _ = gl.broadcast(gl.expand_dims(sh, WORD_AXIS), w)
    o000, o001, o010, o011, o100, o101, o110, o111 = gl.inline_asm_elementwise(
        DECODE, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [w, sg, sh],
        dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    return gl.join(gl.join(gl.join(o000, o001), gl.join(o010, o011)),
                   gl.join(gl.join(o100, o101), gl.join(o110, o111)))


@gluon.jit
def decode_a_operand(w, s, NB: gl.constexpr, KH: gl.constexpr, DECODE: gl.constexpr, SCALE: gl.constexpr,
                     a_layout: gl.constexpr):
    """Packed words [NB, KH, 32, 4] (16-row blocks, 64-K chunks, lane, word) and their scale pairs
    [NB, KH, 32] -> the bf16 A operand [16 NB, 64 KH] (MMA K order) in ``a_layout``: the decoded
    registers already are the operand (mma.sync's A fragments; wgmma's register A has the same
    per-warp layout), which the conversion asserts."""
    v = _decode_words(w, s, 3, DECODE, SCALE)  # [NB, KH, 32, 4, i0, i1, i2]
    v = gl.reshape(v, [NB, KH, 8, 4, 4, 2, 2, 2])  # lane -> (g, t)
    v = gl.permute(v, [0, 6, 2, 1, 4, 7, 3, 5])  # [rb, i1, g, kc, kl, i2, t, i0]
    return gl.convert_layout(gl.reshape(v, [16 * NB, 64 * KH]), a_layout, assert_trivial=True)


@gluon.jit
def decode_a_operand_kw(w, s, KW: gl.constexpr, NB: gl.constexpr, KH: gl.constexpr, DECODE: gl.constexpr,
                        SCALE: gl.constexpr, a_layout: gl.constexpr):
    """``decode_a_operand`` with a leading K-slice dimension: words [KW, NB, KH, 32, 4] and scale
    pairs [KW, NB, KH, 32] -> the bf16 A operand [KW, 16 NB, 64 KH]."""
    v = _decode_words(w, s, 4, DECODE, SCALE)  # [KW, NB, KH, 32, 4, i0, i1, i2]
    v = gl.reshape(v, [KW, NB, KH, 8, 4, 4, 2, 2, 2])
    v = gl.permute(v, [0, 1, 7, 3, 2, 5, 8, 4, 6])  # [s, rb, i1, g, kc, kl, i2, t, i0]
    return gl.convert_layout(gl.reshape(v, [KW, 16 * NB, 64 * KH]), a_layout, assert_trivial=True)
