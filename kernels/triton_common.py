"""Small Triton helpers shared by the store and attention kernels."""

import triton
import triton.language as tl

QMAX = tl.constexpr(15.0)
EPS = tl.constexpr(2.0**-14)  # same as reference.EPS


@triton.jit
def hadamard_quadrant(HADAMARD_BLOCK: tl.constexpr, HALF: tl.constexpr, IS_BF16: tl.constexpr):
    """The HALF x HALF top-left quadrant of the unnormalized block-diagonal Sylvester Hadamard (rotate_halves says
    how it gives the other three), in bf16 or fp16.

    Entry (i, j) is (-1)^popcount(i & j) inside a diagonal block and 0 outside: built from the indices,
    so no matrix is loaded, and +-1 is exact in fp16/bf16 (the 1/sqrt(b) is applied in fp32 after the dot). The
    parity goes straight into the sign bit of 1.0's 16-bit pattern: integer operations only, no conversions.
    """
    i = tl.arange(0, HALF)[:, None]
    j = tl.arange(0, HALF)[None, :]
    bits = (i % HADAMARD_BLOCK) & (j % HADAMARD_BLOCK)
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    # the parity as the sign bit of 1.0 (0x3F80 in bf16, 0x3C00 in fp16)
    sign = ((bits & 1) << 15) | (0x3F80 if IS_BF16 else 0x3C00)
    if HADAMARD_BLOCK < HALF:  # blocks within a half: 0 off the diagonal blocks
        sign = tl.where((i // HADAMARD_BLOCK) == (j // HADAMARD_BLOCK), sign, 0)
    quadrant = sign.to(tl.int16).to(tl.bfloat16 if IS_BF16 else tl.float16, bitcast=True)
    return quadrant


@triton.jit
def rotate_halves(x_lo, x_hi, HADAMARD_BLOCK: tl.constexpr, HALF: tl.constexpr):
    """(x @ R) for fp16/bf16 x given as its two HALF-channel halves; R = blockdiag(H_b) / sqrt(b). Returns fp32.

    The +-1 signs are exact in 16 bits, so the products are exact and the dots run on tensor cores (fp32 values:
    rotate_halves_fp32, not an fp32 dot, which is TF32 or, as "ieee", slow). One quadrant Q of R's sign pattern
    serves all four: a block spanning both halves is Sylvester's [[Q, Q], [Q, -Q]], blocks within a half repeat Q on
    the diagonal and leave the off-diagonal quadrants 0. So two dots and one generated quadrant, not four of each
    (the pattern is built per program, which every decode split pays before its first tile).
    """
    q = hadamard_quadrant(HADAMARD_BLOCK, HALF, x_lo.dtype == tl.bfloat16)
    a = tl.dot(x_lo, q)
    b = tl.dot(x_hi, q)
    norm = 1.0 / tl.sqrt(HADAMARD_BLOCK * 1.0)
    if HADAMARD_BLOCK > HALF:
        return (a + b) * norm, (a - b) * norm
    return a * norm, b * norm


@triton.jit
def rotate_halves_fp32(x_lo, x_hi, HADAMARD_BLOCK: tl.constexpr, HALF: tl.constexpr):
    """rotate_halves for fp32 values at about fp32 precision and range, still on tensor cores.

    Each row is first scaled by a power of two that brings its largest magnitude into [2^14, 2^15): fp16 holds it
    (a key of norm above 65504 would otherwise become inf), and the scale is exact both ways. Then x = hi + lo,
    hi the fp16 rounding of x and lo the fp16 rounding of the rest (21 significant bits together), each rotated
    exactly. A row holding inf or NaN stays non-finite."""
    down, up = _row_pow2_scales(x_lo, x_hi)
    x_lo = x_lo * down[:, None]
    x_hi = x_hi * down[:, None]
    hi_lo = x_lo.to(tl.float16)
    hi_hi = x_hi.to(tl.float16)
    y_lo, y_hi = rotate_halves(hi_lo, hi_hi, HADAMARD_BLOCK, HALF)
    r_lo, r_hi = rotate_halves((x_lo - hi_lo.to(tl.float32)).to(tl.float16),
                               (x_hi - hi_hi.to(tl.float32)).to(tl.float16), HADAMARD_BLOCK, HALF)
    return (y_lo + r_lo) * up[:, None], (y_hi + r_hi) * up[:, None]


@triton.jit
def _row_pow2_scales(x_lo, x_hi):
    """Per row, (2^(14 - e), 2^(e - 14)) with 2^e <= max |x| < 2^(e + 1), built from the exponent bits (exact);
    e is clamped so that both stay normal fp32 (rows of all zeros, subnormals, inf and NaN included)."""
    amax = tl.maximum(tl.max(tl.abs(x_lo), 1), tl.max(tl.abs(x_hi), 1))
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # e + 127
    biased = tl.minimum(tl.maximum(biased, 15), 254)
    down = ((268 - biased) << 23).to(tl.float32, bitcast=True)  # exponent 14 - e, biased 141 - e + 127
    up = ((biased - 14) << 23).to(tl.float32, bitcast=True)  # exponent e - 14
    return down, up


@triton.jit
def load_token_params(params, offset, written, PAIRED: tl.constexpr, ALL_WRITTEN: tl.constexpr = False):
    """fp32 (scale, min) of the tokens at ``offset`` of a page's per-token params region, which starts at the fp16
    pointer ``params``; 0 for slots not written. PAIRED: each (scale, min) pair as one 32-bit load, else two 2-byte
    loads (LaunchConfig.paired_param_loads says why and where). ALL_WRITTEN: the caller knows every slot is
    written, so the loads take no mask (``written`` is ignored)."""
    if ALL_WRITTEN:
        if PAIRED:
            pair = tl.load(params.to(tl.pointer_type(tl.int32)) + offset)
            scale, minimum = split_fp16_pair(pair)
        else:
            scale = tl.load(params + offset * 2).to(tl.float32)
            minimum = tl.load(params + offset * 2 + 1).to(tl.float32)
    elif PAIRED:
        pair = tl.load(params.to(tl.pointer_type(tl.int32)) + offset, mask=written, other=0)
        scale, minimum = split_fp16_pair(pair)
    else:
        scale = tl.load(params + offset * 2, mask=written, other=0.0).to(tl.float32)
        minimum = tl.load(params + offset * 2 + 1, mask=written, other=0.0).to(tl.float32)
    return scale, minimum


@triton.jit
def load_channel_params(params, HALF: tl.constexpr, PAIRED: tl.constexpr):
    """fp32 (scale, min) of channels 0..HALF-1 and HALF..2*HALF-1 of a closed KIVI block, each [1, HALF];
    ``params``: the fp16 pointer to the block's per-channel params; PAIRED as in load_token_params."""
    ch = tl.arange(0, HALF)
    if PAIRED:
        pairs = params.to(tl.pointer_type(tl.int32))  # a (scale, min) pair per 32-bit word
        s_lo, m_lo = split_fp16_pair(tl.load(pairs + ch))
        s_hi, m_hi = split_fp16_pair(tl.load(pairs + HALF + ch))
    else:
        s_lo = tl.load(params + ch * 2).to(tl.float32)
        m_lo = tl.load(params + ch * 2 + 1).to(tl.float32)
        s_hi = tl.load(params + 2 * HALF + ch * 2).to(tl.float32)
        m_hi = tl.load(params + 2 * HALF + ch * 2 + 1).to(tl.float32)
    return s_lo[None, :], m_lo[None, :], s_hi[None, :], m_hi[None, :]


@triton.jit
def split_fp16_pair(pair):
    """fp32 (low half, high half) of 32-bit words each holding two fp16 values (little-endian: the first is low)."""
    low = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def finite_rows(x_lo, x_hi):
    """1 for rows whose values (both halves) are all finite, 0 otherwise."""
    ok_lo = (x_lo == x_lo) & (tl.abs(x_lo) != float("inf"))
    ok_hi = (x_hi == x_hi) & (tl.abs(x_hi) != float("inf"))
    return tl.minimum(tl.min(ok_lo.to(tl.int32), 1), tl.min(ok_hi.to(tl.int32), 1))


@triton.jit
def scale_and_min(lo, hi, finite):
    """fp16-rounded (scale, min) from a range, NaN scale where the input or the fp16 params are not finite."""
    scale = tl.maximum((hi - lo) / QMAX, EPS).to(tl.float16).to(tl.float32)
    minimum = lo.to(tl.float16).to(tl.float32)
    good = (finite != 0) & (tl.abs(scale) != float("inf")) & (tl.abs(minimum) != float("inf"))
    return tl.where(good, scale, float("nan")), minimum


@triton.jit
def encode(x, scale, minimum):
    """int4 codes (as uint8) of x against broadcastable scale and min."""
    codes = tl.floor((x - minimum) / scale + 0.5)
    codes = tl.where(codes == codes, codes, 0.0)  # NaN scale -> code 0 (the NaN scale carries the poison)
    return tl.minimum(tl.maximum(codes, 0.0), QMAX).to(tl.uint8)
