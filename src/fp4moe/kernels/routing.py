"""MoE routing: @triton.jit bodies (launchers, policy and the torch reference in ``fp4moe.ops.routing``).

One program routes ``BLOCK_T`` tokens; each token's whole row of E router logits is one tile
row (``BLOCK_E`` = next power of two >= E, the padding masked). Selection is ``TOP_K`` rounds of
"largest available score, lowest expert id among equals", so the k experts come out in
descending score order, ties by id, exactly as the reference sorts them.

Bit-exactness with the reference: every floating-point step is an IEEE fp32 add, multiply or
``div_rn`` in the reference's order; sums over experts run sequentially in slot (or expert id)
order; ``exp_f32`` below is the reference's ``exp_f32`` (``fp4moe.ops.routing``) operation for
operation, because ``tl.exp`` and ``torch.exp`` differ (numpy's exp, the interpreter's, differs
from torch's in ~9% of fp32 inputs; the GPU's ``ex2.approx`` differs more). The launcher
compiles with ``enable_fp_fusion=False`` (no FMA contraction) and ``enable_reflect_ftz=False``.
"""

import triton
import triton.language as tl

from .pdl import pdl_enter

KIND_SOFTMAX = tl.constexpr(0)
KIND_SIGMOID_BIAS = tl.constexpr(1)
KIND_GPT_OSS = tl.constexpr(2)

PASS_EXACT = tl.constexpr(0)  # top-k, weights
PASS_OEA_MARK = tl.constexpr(1)  # top-k0, mark the active experts
PASS_OEA_FILL = tl.constexpr(2)  # top-k0 + fill from the active set, weights, exact-routing stats

# exp_f32 constants: the fp32 values of fp4moe.ops.routing.EXP_F32 (tested equal there)
_EXP_LO = tl.constexpr(-104.0)
_EXP_HI = tl.constexpr(89.0)
_LOG2E = tl.constexpr(1.4426950216293335)  # fp32(1 / ln 2)
_LN2_HI = tl.constexpr(0.693145751953125)  # ln 2 with 16 significant bits: n * _LN2_HI is exact
_LN2_LO = tl.constexpr(1.428606765330187e-06)  # fp32(ln 2 - _LN2_HI)
_C2 = tl.constexpr(0.5)
_C3 = tl.constexpr(0.1666666716337204)
_C4 = tl.constexpr(0.0416666679084301)
_C5 = tl.constexpr(0.008333333767950535)
_C6 = tl.constexpr(0.0013888889225199819)
_C7 = tl.constexpr(0.00019841270113829523)
_FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # 2**-126
_SUM_EPS = tl.constexpr(9.999999682655225e-21)  # fp32(1e-20), the sigmoid_bias renormalisation epsilon


@triton.jit
def exp_f32(x):
    """exp(x) for finite fp32 x, within 1.2 ulp; results below 2**-126 are flushed to 0.

    Cody-Waite reduction x = n ln2 + r (|r| <= ln2/2), a degree-7 Taylor polynomial in Horner
    form, then two exact multiplications by powers of two built from their bits.
    """
    xc = tl.minimum(tl.maximum(x, _EXP_LO), _EXP_HI)
    n = tl.floor(xc * _LOG2E + 0.5)
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    p = r * _C7 + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + 1.0
    p = p * r + 1.0
    ni = n.to(tl.int32)
    n1 = ni >> 1
    n2 = ni - n1
    y = p * ((n1 + 127) << 23).to(tl.float32, bitcast=True)
    y = y * ((n2 + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(y < _FLT_MIN, 0.0, y)


@triton.jit
def exp_f32_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    """Grid (cdiv(N, BLOCK),): y[i] = exp_f32(x[i]) for fp32 [N] (tests pin exp_f32 to its reference)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
    tl.store(y_ptr + offs, exp_f32(x), mask=offs < N)


@triton.jit
def _select_keys(sel, cols):
    """int64 keys that order [BLOCK_T, BLOCK_E] candidates as ``_pick`` chooses them: the fp32
    ``sel`` in the high word (its bits made monotonic as signed integers; -0 and +0 both 0, since
    they compare equal), BLOCK_E - 1 - id in the low word, so that one integer max finds the
    largest ``sel`` and, among equal ones, the lowest id. ``sel`` holds no NaN."""
    BLOCK_E: tl.constexpr = sel.shape[1]
    bits = tl.where(sel == 0.0, 0, sel.to(tl.int32, bitcast=True))
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    low = (-cols + (BLOCK_E - 1)).to(tl.int64)  # tensor first (the interpreter fails on constexpr - tensor then [None, :])
    return (ordered.to(tl.int64) << 32) | low[None, :]


@triton.jit
def _pick(key, val, avail, cols):
    """One selection round over [BLOCK_T, BLOCK_E] tiles: the available expert with the largest
    ``sel`` (lowest id among equals), found by one max over ``_select_keys`` (the chain of a
    token's top-k is one reduction per round; its value's reduction is off that chain). Returns
    (idx [BLOCK_T], its ``val`` (0 if none), found, avail without it); idx is BLOCK_E where no
    expert is available."""
    BLOCK_E: tl.constexpr = key.shape[1]
    NONE: tl.constexpr = -9223372036854775808  # below every key (an available sel is finite)
    m = tl.max(tl.where(avail, key, NONE), axis=1)
    found = m != NONE
    idx = tl.where(found, -(m & 0xFFFFFFFF).to(tl.int32) + (BLOCK_E - 1), BLOCK_E)
    chosen = cols[None, :] == idx[:, None]
    v = tl.max(tl.where(chosen, val, float("-inf")), axis=1)
    v = tl.where(found, v, 0.0)
    return idx, v, found, avail & (~chosen)


@triton.jit
def _group_mask(sel, elig, cols, gsize, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                BLOCK_G: tl.constexpr):
    """Grouped top-k (DeepSeek-V3): experts [g*gsize, (g+1)*gsize) form group g; a group's score
    is the sum of its two largest ``sel`` (its largest when gsize == 1); the TOPK_GROUP best groups
    (lowest group id among equals) stay eligible, the others do not."""
    BLOCK_T: tl.constexpr = sel.shape[0]
    grp = cols // gsize
    gcols = tl.arange(0, BLOCK_G)
    gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
    for g in range(N_GROUP):
        ing = elig & (grp == g)[None, :]
        a = tl.max(tl.where(ing, sel, float("-inf")), axis=1)
        ai = tl.min(tl.where(ing & (sel == a[:, None]), cols[None, :], sel.shape[1]), axis=1)
        b = tl.max(tl.where(ing & (cols[None, :] != ai[:, None]), sel, float("-inf")), axis=1)
        score = tl.where(gsize >= 2, a + b, a)
        gscore = tl.where(gcols[None, :] == g, score[:, None], gscore)
    gavail = (gcols[None, :] < N_GROUP) & (gscore == gscore)
    keep = gscore != gscore  # all False, [BLOCK_T, BLOCK_G]
    for j in range(TOPK_GROUP):
        m = tl.max(tl.where(gavail, gscore, float("-inf")), axis=1)
        gi = tl.min(tl.where(gavail & (gscore == m[:, None]), gcols[None, :], BLOCK_G), axis=1)
        pick = gcols[None, :] == gi[:, None]
        keep = keep | pick
        gavail = gavail & (~pick)
    out = elig & (cols[None, :] < 0)
    for g in range(N_GROUP):
        kept = tl.max(tl.where(gcols[None, :] == g, keep.to(tl.int32), 0), axis=1) > 0
        out = out | (elig & (grp == g)[None, :] & kept[:, None])
    return out


@triton.jit
def routing_kernel(
    logits_ptr,  # [T, E] fp32/bf16/fp16 router logits (stride_t, 1)
    bias_ptr,  # [E] fp32 correction bias (HAS_BIAS) or unused
    ids_ptr,  # [T, TOP_K] int32 out (PASS 0, 2); -1 marks a slot OEA could not fill
    weights_ptr,  # [T, TOP_K] fp32 out (PASS 0, 2)
    bad_ptr,  # [T] int32 out (PASS 0, 2): 1 where the token's logits (or the bias) hold NaN/Inf
    active_ptr,  # [E] int32, zeroed: PASS 1 sets the experts in some token's top-K0; PASS 2 reads it
    exact_ptr,  # [E] int32, zeroed: PASS 2 sets the experts exact top-k routing would choose
    kept_ptr,  # [T] fp32 out (PASS 2): chosen mass / exact top-k mass (ops.routing defines mass)
    T, E, stride_t, gsize,  # gsize = E // N_GROUP
    scale,  # routed_scaling_factor (fp32), KIND_SIGMOID_BIAS only
    KIND: tl.constexpr, PASS: tl.constexpr, TOP_K: tl.constexpr, K0: tl.constexpr,
    RENORM: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
):
    """Grid (cdiv(T, BLOCK_T),); one program routes tokens [pid*BLOCK_T, (pid+1)*BLOCK_T).

    Scores per token (fp32): sel chooses, val weighs.
      softmax:      sel = x,          val = exp_f32(x - max x)
      sigmoid_bias: s = 1 / (1 + exp_f32(-x)), sel = s + bias, val = s
      gpt_oss:      sel = x (+ bias), val = exp_f32(sel - max sel)
    Rows with NaN/Inf are routed as if all logits were 0 and get NaN weights and bad = 1.
    """
    tl.static_assert(BLOCK_K >= TOP_K)
    tl.static_assert(K0 <= TOP_K)
    pdl_enter(PDL)
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    t_mask = offs_t < T
    c_mask = cols < E
    rows = logits_ptr + offs_t.to(tl.int64)[:, None] * stride_t
    x = tl.load(rows + cols[None, :], mask=t_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
    nonfinite = (x != x) | (tl.abs(x) == float("inf"))
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
        nonfinite = nonfinite | ((b != b) | (tl.abs(b) == float("inf")))[None, :]
        if KIND == KIND_GPT_OSS:  # finite logit + finite bias can still overflow the selection score
            nonfinite = nonfinite | (tl.abs(x + b[None, :]) == float("inf"))
    bad = tl.max(nonfinite.to(tl.int32), axis=1) > 0
    x = tl.where(bad[:, None], 0.0, x)

    if KIND == KIND_SOFTMAX:
        sel = x
        m = tl.max(tl.where(c_mask[None, :], x, float("-inf")), axis=1)
        val = exp_f32(x - m[:, None])
    elif KIND == KIND_SIGMOID_BIAS:
        s = tl.math.div_rn(tl.full([BLOCK_T, BLOCK_E], 1.0, tl.float32), 1.0 + exp_f32(-x))
        if HAS_BIAS:
            sel = s + tl.where(bad[:, None], 0.0, b[None, :])
        else:
            sel = s
        val = s
    else:
        if HAS_BIAS:
            sel = x + tl.where(bad[:, None], 0.0, b[None, :])
        else:
            sel = x
        m = tl.max(tl.where(c_mask[None, :], sel, float("-inf")), axis=1)
        val = exp_f32(sel - m[:, None])
    sel = tl.where(c_mask[None, :], sel, float("-inf"))

    elig = c_mask[None, :] & (offs_t[:, None] >= 0)
    if N_GROUP > 1:
        elig = _group_mask(sel, elig, cols, gsize, N_GROUP, TOPK_GROUP, BLOCK_G)

    key = _select_keys(sel, cols)
    if PASS == PASS_OEA_MARK:
        avail = elig
        for j in range(K0):
            idx, v, found, avail = _pick(key, val, avail, cols)
            # a NaN/Inf token (routed as if its logits were 0) must not widen the others' choice
            tl.store(active_ptr + idx, tl.full([BLOCK_T], 1, tl.int32), mask=t_mask & found & ~bad)
    else:
        kcols = tl.arange(0, BLOCK_K)
        ids_t = tl.full([BLOCK_T, BLOCK_K], -1, tl.int32)
        vals_t = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        mass = tl.zeros([BLOCK_T], tl.float32)  # sum of the chosen vals, in slot order
        avail = elig
        for j in range(K0):  # the launcher passes K0 = TOP_K for PASS_EXACT
            idx, v, found, avail = _pick(key, val, avail, cols)
            slot = (kcols[None, :] == j) & found[:, None]
            ids_t = tl.where(slot, idx[:, None], ids_t)
            vals_t = tl.where(slot, v[:, None], vals_t)
            mass = mass + v
        if PASS == PASS_OEA_FILL:
            active = tl.load(active_ptr + cols, mask=c_mask, other=0) > 0
            avail = avail & active[None, :]
            for j in range(K0, TOP_K):
                idx, v, found, avail = _pick(key, val, avail, cols)
                slot = (kcols[None, :] == j) & found[:, None]
                ids_t = tl.where(slot, idx[:, None], ids_t)
                vals_t = tl.where(slot, v[:, None], vals_t)
                mass = mass + v
            # what exact top-k routing would have chosen: its mass and its experts
            exact_avail = elig
            exact_mass = tl.zeros([BLOCK_T], tl.float32)
            for j in range(TOP_K):
                idx, v, found, exact_avail = _pick(key, val, exact_avail, cols)
                exact_mass = exact_mass + v
                tl.store(exact_ptr + idx, tl.full([BLOCK_T], 1, tl.int32), mask=t_mask & found & ~bad)
            kept = tl.math.div_rn(mass, exact_mass)
            tl.store(kept_ptr + offs_t, tl.where(bad, float("nan"), kept), mask=t_mask)

        if KIND == KIND_SOFTMAX:
            if RENORM:
                w = tl.math.div_rn(vals_t, tl.broadcast_to(mass[:, None], [BLOCK_T, BLOCK_K]))
            else:
                total = tl.zeros([BLOCK_T], tl.float32)  # sum over all E in expert-id order
                for e in range(0, E):
                    xe = tl.load(logits_ptr + offs_t.to(tl.int64) * stride_t + e, mask=t_mask,
                                 other=0.0).to(tl.float32)
                    total = total + exp_f32(tl.where(bad, 0.0, xe) - m)
                w = tl.math.div_rn(vals_t, tl.broadcast_to(total[:, None], [BLOCK_T, BLOCK_K]))
        elif KIND == KIND_SIGMOID_BIAS:
            if RENORM:
                denom = mass + _SUM_EPS
                w = tl.math.div_rn(vals_t, tl.broadcast_to(denom[:, None], [BLOCK_T, BLOCK_K])) * scale
            else:
                w = vals_t * scale
        else:
            w = tl.math.div_rn(vals_t, tl.broadcast_to(mass[:, None], [BLOCK_T, BLOCK_K]))
        w = tl.where(bad[:, None], float("nan"), w)
        out = offs_t.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
        o_mask = t_mask[:, None] & (kcols[None, :] < TOP_K)
        tl.store(ids_ptr + out, ids_t, mask=o_mask)
        tl.store(weights_ptr + out, w, mask=o_mask)
        tl.store(bad_ptr + offs_t, bad.to(tl.int32), mask=t_mask)
