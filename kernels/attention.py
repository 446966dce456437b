"""Paged attention that reads the int4 cache directly (Triton).

One kernel serves decode, prefill and chunked prefill with a cached prefix (mixed batches as vLLM schedules
them). A program owns BLOCK_Q query tokens x all GROUP query heads of one KV head, so every K/V tile is loaded
and dequantized once per KV head (GQA shared). Rows of the [BLOCK_M, head_dim] query tile are (token, head) pairs.

Scores are taken in the space the keys are stored in: int4_saw keys are rotated, so the program rotates Q once (the
rotation is orthonormal, scores are unchanged); int4_kivi blocks closed per channel hold unrotated keys and use Q as
is. int4_kivi reads a query's own block (the 128-token page holding its position) from the original keys in the
model dtype: this step's rows of ``new_keys`` and, for the tokens of the block an earlier step wrote, the staging
pool (kernels/staging.py); only the tile(s) of a program's own blocks take that path. Values always come from the
cache. With rotated values the output is un-rotated at the end.

Decode batches (max_query_len == 1) with a workspace split the context over NUM_SPLITS programs (flash-decoding)
and a second kernel merges the partial softmaxes. Grids depend only on the token count, the number of sequences
and constants, never on sequence lengths: the kernels are CUDA-graph safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layout import KIVI_BLOCK_SIZE, PageLayout, cdiv, check_head_dim, next_power_of_2, tile_tokens
from .scheme import Int4Scheme
from .staging import check_new_keys, check_pool_read
from .triton_common import load_channel_params, load_token_params, rotate_halves

LOG2E = 1.4426950408889634
# the 16-bit floats whose mantissa ulp is exactly 1, as bits: a code ORed in is the float bias + code
BF16_CODE_BIAS, FP16_CODE_BIAS = (0x4300, 128.0), (0x6400, 1024.0)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile (tokens per loop step, divides the page), warps and software-pipeline stages of one launch, and how
    the kernel turns 4-bit codes into MMA operands: ``subnormal_codes`` picks the number format (_codes_as_float),
    ``ptx_unpack`` does the unpacking with inline PTX, two codes per instruction (_unpack_ptx; GPU only: the
    Triton interpreter cannot run PTX)."""

    tile: int
    num_warps: int
    num_stages: int
    subnormal_codes: bool = False
    ptx_unpack: bool = False
    # each token's or channel's (scale, min) as one 32-bit load instead of two 2-byte ones: a 2-byte load per thread
    # cannot be an asynchronous copy, so the software pipeline leaves it a load every tile waits for (the profile's
    # largest stall in int4_kivi's decode)
    paired_param_loads: bool = False
    # ptxas register cap (None: the compiler's choice): the paired loads took int4_kivi's decode from 168 to 185
    # registers, one program fewer per SM; at 168 it fits three again, with no spills
    max_registers: int | None = None
    # codes read two bytes per element (int16) instead of one: keys as four channel quarters, values as the even and
    # odd tokens of a tile (_load_key_parts, _load_value_parts). From 8-bit elements Triton lays both MMA operands
    # out four 16-bit values per thread (kWidth 4), which the hardware fragments do not match: q is reloaded from
    # shared memory each tile and moved into place, P takes 64-bit shared loads and moves, and each byte's nibbles
    # are spread into 16-bit lanes with PRMT. From 16-bit elements (kWidth 2) q and P load with ldmatrix and a pair's
    # nibbles come out with a mask and at most a shift (_ptx_unpack_quarters_source; tools/device/sass_stats.py
    # counts both loops)
    wide_code_loads: bool = False
    # the tiles that every live row of a program sees wholly (all before the first row's position, the program's
    # smallest) run without the causal/length mask: no visibility select on the scores, no guard for an all-masked
    # row maximum, per-token params loaded unmasked. Only the tile or two at the end of a program's
    # range run the masked code, in a loop of their own (int4_saw's one loop splits in two; int4_kivi's loop before
    # the own blocks, already whole, drops its masks). The decode loop is issue bound, and the masks cost selects
    # and compares in every tile; the price is the tail tile's loads, no longer prefetched during the tile before
    unmasked_full_tiles: bool = False
    # a tile's two row sums (of P, and of P times the per-token value minimum) in one reduction. The tile's columns
    # are spread over the program's warps, so every row reduction is a round trip through shared memory with its
    # barriers: one instead of two takes 3 CTA barriers a tile out of the loop (sm_90: int4_saw 12 -> 9, int4_kivi
    # 18 -> 15), about the same instructions otherwise (tools/device/sass_stats.py)
    joint_row_sums: bool = False
    # decode with keys per token (int4_saw), codes read two bytes per element: the GQA group as the MMA's N (8 or
    # more columns) and the keys, then the values, as its M operand, each warp its own TILE / num_warps tokens of a
    # tile with its own softmax state, merged once per program (_attend_group_as_n). A group of 4-7 fills 8 of the
    # m16n8k16 MMA's 16 rows as M but all 8 columns as N: half the MMAs, and no row maximum, row sum or P crosses
    # warps inside the loop (2 CTA barriers a tile, the pipeline's, where the tile loop has 12), for twice the
    # accumulator registers
    group_as_n: bool = False

    def with_group_as_n(self) -> "LaunchConfig":
        """This launch with the group-as-N loop in place of the tile loop: the tile loop's options
        (unmasked_full_tiles, joint_row_sums) off, which paged_attention refuses beside it."""
        return replace(self, group_as_n=True, unmasked_full_tiles=False, joint_row_sums=False)


# The ways codes become MMA operands, by name (LaunchConfig fields): what the GPU tests check and the tuning and
# benchmark tools sweep. "+ptx" needs the GPU compiler.
CODE_PATHS = {"biased": {"subnormal_codes": False, "ptx_unpack": False},
              "subnormal": {"subnormal_codes": True, "ptx_unpack": False},
              "biased+ptx": {"subnormal_codes": False, "ptx_unpack": True},
              "subnormal+ptx": {"subnormal_codes": True, "ptx_unpack": True}}

# measured on the H200 (docs/performance.md, levers and tuning log): each scheme's fastest code path at batch 32-256,
# launch shape from tools/device/tune_attention.py and the split sweep (int4_saw's 128-token tile: faster than 64 at
# batch 1-8 and at most points of 32-256), split counts in DECODE_SPLITS. Stages: Triton's pipeliner gives each load
# a prefetch distance of (num_stages - 1) // (indirection levels + 1), and the page index read from the block table
# is one level. At 3 stages the distance is 1, and the loop waits for every copy it issued before each tile's compute
# (`DEPBAR.LE SB0, 0x0`, tools/device/sass_stats.py): no load overlaps the program's own compute. At 5 the next
# tile's copies stay in flight; 7 change nothing more. Codes read two bytes per element (wide_code_loads) with
# the register caps that measured fastest with them: int4_saw at 96 fits five programs per SM. The wholly seen tiles
# unmasked (unmasked_full_tiles): level at short contexts, up to 1.08x at 32k. A tile's row sums in one reduction
# (joint_row_sums): int4_kivi 1.00-1.03x, int4_saw 0.997-1.02x (H100); 0.98-1.04x, medians 1.02x and 1.01x (H200).
DECODE_LAUNCH = {"int4_kivi": LaunchConfig(tile=128, num_warps=4, num_stages=5, subnormal_codes=True, ptx_unpack=True,
                                           paired_param_loads=True, max_registers=128, wide_code_loads=True,
                                           unmasked_full_tiles=True, joint_row_sums=True),
                 "int4_saw": LaunchConfig(tile=128, num_warps=4, num_stages=5, subnormal_codes=True, ptx_unpack=True,
                                          paired_param_loads=True, max_registers=96, wide_code_loads=True,
                                          unmasked_full_tiles=True, joint_row_sums=True)}
PREFILL_LAUNCH = LaunchConfig(tile=64, num_warps=4, num_stages=2)


def kept_launch_options(scheme_name: str) -> dict:
    """The DECODE_LAUNCH fields of a scheme that launch sweeps keep while they vary the tile, warps, stages and code
    path: how the kernel loads the codes and the parameters, the register cap measured with that, whether the
    wholly seen tiles run unmasked and whether a tile's row sums share one reduction."""
    launch = DECODE_LAUNCH[scheme_name]
    return {"paired_param_loads": launch.paired_param_loads, "max_registers": launch.max_registers,
            "wide_code_loads": launch.wide_code_loads, "unmasked_full_tiles": launch.unmasked_full_tiles,
            "joint_row_sums": launch.joint_row_sums}

# The subnormal code path faults (illegal address) on the H200 at head_dim 64, where the biased one passes the GPU
# tests: a default launch at another head_dim takes the biased codes, an explicit one is refused.
SUBNORMAL_HEAD_DIMS = (128,)


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence i owning global query block q_block, where sequence i's blocks start at qsl[i] // BLOCK_Q + i."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _codes_as_float(nibbles, SUBNORMAL: tl.constexpr, IS_BF16: tl.constexpr, CODE_BIAS_BITS: tl.constexpr,
                    CODE_BIAS: tl.constexpr):
    """4-bit codes as exact 16-bit floats without an int->float conversion (the slow path on the SMs).

    Biased (default): OR the code into the mantissa of CODE_BIAS (128.0 in bf16, 1024.0 in fp16, whose ulp is 1),
    bitcast, then subtract CODE_BIAS in the same 16-bit type (exact). The bias must come off before the dot:
    Hopper's tensor cores do not keep full fp32 precision while accumulating, and a 100x bias would magnify that
    loss (seen: 3% error). SUBNORMAL: the code's bits are an fp16 subnormal, code * 2^-24, exact with no OR and
    no subtract; the other MMA operand is fp16 and the caller multiplies the fp32 result by CODE_SCALE = 2^24."""
    # One return per constexpr branch: Triton keeps compiling past a return inside a constexpr `if`, so an early
    # return of fp16 beside a later bf16 one fails to compile (the interpreter, which runs Python, does not see it).
    if SUBNORMAL:
        codes = nibbles.to(tl.int16).to(tl.float16, bitcast=True)
    elif IS_BF16:
        codes = (nibbles.to(tl.int16) | CODE_BIAS_BITS).to(tl.bfloat16, bitcast=True) - tl.full([1, 1], CODE_BIAS,
                                                                                                 tl.bfloat16)
    else:
        codes = (nibbles.to(tl.int16) | CODE_BIAS_BITS).to(tl.float16, bitcast=True) - tl.full([1, 1], CODE_BIAS,
                                                                                                tl.float16)
    return codes


# Inline PTX for _unpack_ptx: 4 packed code bytes in $4 (element k = byte k) become their 4 low-nibble codes in
# $0, $1 and their 4 high-nibble codes in $2, $3, two 16-bit lanes per register (element k in lane k % 2). One
# prmt spreads two bytes into the two lanes; one lop3 masks a nibble per lane and ORs the bias exponent in; one
# packed subtract takes the bias off: about 1.6 instructions per code where per-element Triton ops take ~3.3.
_PTX_SPREAD = """
    .reg .b32 lo01, lo23, hi01, hi23, shifted;
    prmt.b32 lo01, $4, 0, 0x4140;
    prmt.b32 lo23, $4, 0, 0x4342;
    shr.b32 shifted, $4, 4;
    prmt.b32 hi01, shifted, 0, 0x4140;
    prmt.b32 hi23, shifted, 0, 0x4342;"""


def _ptx_unpack_source(bias_bits: int | None = None, subtract: str | None = None) -> str:
    """The asm of one code format: no bias = fp16 subnormals (mask only), else OR the bias in, then subtract it."""
    if bias_bits is None:
        body = "".join(f"\n    and.b32 ${out}, {src}, 0x000F000F;"
                       for out, src in enumerate(("lo01", "lo23", "hi01", "hi23")))
        return "{" + _PTX_SPREAD + body + "\n}"
    bias = f"0x{bias_bits:04X}{bias_bits:04X}"
    body = f"\n    .reg .b32 t, bias;\n    mov.b32 bias, {bias};" + "".join(
        f"\n    lop3.b32 t, {src}, 0x000F000F, {bias}, 0xEA;\n    {subtract} ${out}, t, bias;"
        for out, src in enumerate(("lo01", "lo23", "hi01", "hi23")))
    return "{" + _PTX_SPREAD + body + "\n}"


# Inline PTX for _unpack_quarters: two int16 elements in $4 (element k in lane k, each two code bytes) become nibble n
# of both in $n, n = 0..3, element k in lane k. The nibbles of a pair sit where the 16-bit lanes want them, so no
# byte spreading: a mask with the bias ORed in (one lop3) and the packed subtract per two codes, and a shift per
# nibble that must move. fp16 has 10 mantissa bits, so a byte's high nibble can stay where it is (bits 4-7, 16 x
# the code, exact; the caller divides by 16) and one shift by 8 serves the second byte; bf16's 7 bits cannot hold it.
def _ptx_unpack_quarters_source(bias_bits: int | None = None, subtract: str | None = None,
                                high_in_place: bool = False) -> str:
    """The asm of one code format, as _ptx_unpack_source's; ``high_in_place``: nibbles 1 and 3 as 16 x the code."""
    lines = [".reg .b32 shifted, t, bias;"]
    if bias_bits is not None:
        lines.append(f"mov.b32 bias, 0x{bias_bits:04X}{bias_bits:04X};")
    for nibble in range(4):
        shift = 8 * (nibble // 2) if high_in_place else 4 * nibble
        mask = "0x00F000F0" if high_in_place and nibble % 2 else "0x000F000F"
        src = "$4" if shift == 0 else "shifted"
        if shift and not (high_in_place and nibble == 3):  # in place, nibble 3 reuses nibble 2's shift
            lines.append(f"shr.b32 shifted, $4, {shift};")
        if bias_bits is None:
            lines.append(f"and.b32 ${nibble}, {src}, {mask};")
        else:
            lines += [f"lop3.b32 t, {src}, {mask}, bias, 0xEA;", f"{subtract} ${nibble}, t, bias;"]
    return "{\n    " + "\n    ".join(lines) + "\n}"


_PTX_SUBNORMAL = tl.constexpr(_ptx_unpack_source())
_PTX_BIASED_BF16 = tl.constexpr(_ptx_unpack_source(BF16_CODE_BIAS[0], "sub.rn.bf16x2"))
_PTX_BIASED_FP16 = tl.constexpr(_ptx_unpack_source(FP16_CODE_BIAS[0], "sub.rn.f16x2"))
_PTX_QUARTERS_SUBNORMAL = tl.constexpr(_ptx_unpack_quarters_source(high_in_place=True))
_PTX_QUARTERS_BIASED_BF16 = tl.constexpr(_ptx_unpack_quarters_source(BF16_CODE_BIAS[0], "sub.rn.bf16x2"))
_PTX_QUARTERS_BIASED_FP16 = tl.constexpr(_ptx_unpack_quarters_source(FP16_CODE_BIAS[0], "sub.rn.f16x2",
                                                                     high_in_place=True))


@triton.jit
def _unpack_ptx(packed, SUBNORMAL: tl.constexpr, IS_BF16: tl.constexpr):
    """(low-nibble codes, high-nibble codes) of uint8 ``packed``, bit-identical to _codes_as_float's."""
    if SUBNORMAL:
        lo, hi = tl.inline_asm_elementwise(_PTX_SUBNORMAL, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    elif IS_BF16:
        lo, hi = tl.inline_asm_elementwise(_PTX_BIASED_BF16, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(_PTX_BIASED_FP16, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _unpack_quarters(packed, PTX_UNPACK: tl.constexpr, SUBNORMAL: tl.constexpr, IS_BF16: tl.constexpr,
                     CODE_BIAS_BITS: tl.constexpr, CODE_BIAS: tl.constexpr):
    """Nibbles 0-3 of int16 ``packed`` (the low and high nibble of its first byte, then of its second), exact, as
    _codes_as_float makes them; in the fp16 formats nibbles 1 and 3 as 16 x the code (_high_part_scale)."""
    if PTX_UNPACK:
        if SUBNORMAL:
            parts = tl.inline_asm_elementwise(_PTX_QUARTERS_SUBNORMAL, "=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.float16,) * 4, is_pure=True, pack=2)
        elif IS_BF16:
            parts = tl.inline_asm_elementwise(_PTX_QUARTERS_BIASED_BF16, "=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        else:
            parts = tl.inline_asm_elementwise(_PTX_QUARTERS_BIASED_FP16, "=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.float16,) * 4, is_pure=True, pack=2)
    else:
        # a high nibble as the PTX leaves it: in place (16 x the code) in the fp16 formats, shifted down in bf16
        HIGH_SHIFT: tl.constexpr = 0 if SUBNORMAL or not IS_BF16 else 4
        HIGH_MASK: tl.constexpr = 0x0F << (4 - HIGH_SHIFT)
        second = packed >> 8
        parts = (_codes_as_float(packed & 0x0F, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS),
                 _codes_as_float((packed >> HIGH_SHIFT) & HIGH_MASK, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS),
                 _codes_as_float(second & 0x0F, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS),
                 _codes_as_float((second >> HIGH_SHIFT) & HIGH_MASK, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS))
    return parts



@triton.jit
def _query_parts(x_lo, x_hi, WIDE: tl.constexpr):
    """Query rows given as their two halves (channels j and HALF + j), split as the codes are read: halves, or,
    read two bytes at a time (LaunchConfig.wide_code_loads), quarters 2i, HALF + 2i, 2i + 1, HALF + 2i + 1 (byte j
    of a token holds channels j and HALF + j, layout.py)."""
    if WIDE:
        a, c = tl.split(tl.reshape(x_lo, [x_lo.shape[0], x_lo.shape[1] // 2, 2]))
        b, d = tl.split(tl.reshape(x_hi, [x_hi.shape[0], x_hi.shape[1] // 2, 2]))
        parts = (a, b, c, d)
    else:
        parts = (x_lo, x_hi)
    return parts


@triton.jit
def _load_key_parts(k_tile_ptr, WIDE: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    PTX_UNPACK: tl.constexpr, SUBNORMAL: tl.constexpr, IS_BF16: tl.constexpr,
                    CODE_BIAS_BITS: tl.constexpr, CODE_BIAS: tl.constexpr, HALF: tl.constexpr):
    """A tile's key codes as [TILE, channels] parts over _query_parts' channels, exact (_load_codes); ``k_tile_ptr``:
    the tile's first key code byte."""
    slots = tl.arange(0, TILE)
    if WIDE:  # token t's int16 word i holds bytes 2i and 2i + 1
        i = tl.arange(0, HALF // 2)
        words = k_tile_ptr.to(tl.pointer_type(tl.int16))
        parts = _unpack_quarters(tl.load(words + slots[:, None] * (HALF // 2) + i[None, :]), PTX_UNPACK,
                                 SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS)
    else:
        parts = _load_codes(k_tile_ptr, slots, False, BLOCK_SIZE, PTX_UNPACK, SUBNORMAL, IS_BF16,
                            CODE_BIAS_BITS, CODE_BIAS, HALF)
    return parts


@triton.jit
def _load_value_parts(v_tile_ptr, WIDE: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      PTX_UNPACK: tl.constexpr, SUBNORMAL: tl.constexpr, IS_BF16: tl.constexpr,
                      CODE_BIAS_BITS: tl.constexpr, CODE_BIAS: tl.constexpr, HALF: tl.constexpr):
    """A tile's value codes (``v_tile_ptr``: the tile's first byte in the page's channel-major value region), exact:
    two [TILE, HALF] halves (_load_codes), or, read two bytes at a time, four [TILE // 2, HALF] parts: channels j
    and HALF + j of the tile's even tokens, then of its odd ones (_accumulate_values pairs them with P's columns)."""
    if WIDE:  # channel byte j's int16 word i holds tokens 2i and 2i + 1
        pair = tl.arange(0, TILE // 2)
        j = tl.arange(0, HALF)
        words = v_tile_ptr.to(tl.pointer_type(tl.int16))
        packed = tl.trans(tl.load(words + j[:, None] * (BLOCK_SIZE // 2) + pair[None, :]))
        parts = _unpack_quarters(packed, PTX_UNPACK, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS)
    else:
        parts = _load_codes(v_tile_ptr, tl.arange(0, TILE), True, BLOCK_SIZE, PTX_UNPACK, SUBNORMAL, IS_BF16,
                            CODE_BIAS_BITS, CODE_BIAS, HALF)
    return parts


@triton.jit
def _accumulate_values(acc_lo, acc_hi, p_scaled, v_parts):
    """acc + P @ V for the value parts of _load_value_parts: two halves, or (channels j and HALF + j) of the even
    tokens, then of the odd ones, each against P's columns of those tokens."""
    if len(v_parts) == 4:
        p_even, p_odd = tl.split(tl.reshape(p_scaled, [p_scaled.shape[0], p_scaled.shape[1] // 2, 2]))
        acc_lo = tl.dot(p_odd, v_parts[2], tl.dot(p_even, v_parts[0], acc_lo))
        acc_hi = tl.dot(p_odd, v_parts[3], tl.dot(p_even, v_parts[1], acc_hi))
    else:
        acc_lo = tl.dot(p_scaled, v_parts[0], acc_lo)
        acc_hi = tl.dot(p_scaled, v_parts[1], acc_hi)
    return acc_lo, acc_hi


@triton.jit
def _load_codes(codes_ptr, offset, CHANNEL_MAJOR: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                PTX_UNPACK: tl.constexpr, SUBNORMAL: tl.constexpr, IS_BF16: tl.constexpr,
                CODE_BIAS_BITS: tl.constexpr, CODE_BIAS: tl.constexpr, HALF: tl.constexpr):
    """A tile's codes as two [TILE, HALF] halves (channels j and j + HALF), exact, in the query dtype; ``codes_ptr``:
    the first byte of the tile's K or V codes, ``offset`` the tile's slots from it.

    Unmasked: slots past a sequence's end hold stale bytes, but every code is a finite 0..15 and the caller
    zeroes what such slots contribute (scores masked to -inf, value params loaded as 0). A mask that varies
    along the contiguous dimension would also cost the vector loads of the channel-major V region."""
    ch = tl.arange(0, HALF)
    if CHANNEL_MAJOR:  # V: byte j of token t at j * BLOCK_SIZE + t (layout.py); the transpose is a layout change
        packed = tl.trans(tl.load(codes_ptr + ch[:, None] * BLOCK_SIZE + offset[None, :]))
    else:
        packed = tl.load(codes_ptr + offset[:, None] * HALF + ch[None, :])
    if PTX_UNPACK:
        lo, hi = _unpack_ptx(packed, SUBNORMAL, IS_BF16)
    else:
        lo = _codes_as_float(packed & 15, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS)
        hi = _codes_as_float(packed >> 4, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS)
    return lo, hi


@triton.jit
def _dot_parts(a_parts, b_parts):
    """sum_i a_i @ b_i^T over parts split alike (_query_parts, _load_key_parts), accumulated in one fp32 tile."""
    raw = tl.dot(a_parts[0], tl.trans(b_parts[0]))
    for part in tl.static_range(1, len(b_parts)):
        raw = tl.dot(a_parts[part], tl.trans(b_parts[part]), raw)
    return raw


@triton.jit
def _scores_per_token(q_parts, q_sum_scaled, k_parts, k_params, offset, written, qk_scale,
                      CODE_SCALE: tl.constexpr, PAIRED: tl.constexpr, ALL_WRITTEN: tl.constexpr):
    """Q K^T times the softmax scale qk_scale for keys quantized per token: (Q . codes) * scale_t * qk_scale +
    sum(Q) * qk_scale * min_t (``q_sum_scaled``), q rotated like the keys; Q and the codes split alike
    (_query_parts); ALL_WRITTEN: the params load unmasked (load_token_params). The scale goes into the per-token
    and per-row factors, not into each score."""
    s_t, m_t = load_token_params(k_params, offset, written, PAIRED, ALL_WRITTEN)
    raw = _dot_parts(q_parts, k_parts)
    return raw * (s_t * (CODE_SCALE * qk_scale))[None, :] + q_sum_scaled[:, None] * m_t[None, :]


@triton.jit
def _scores_per_channel(q_lo, q_hi, k_parts, k_params, qk_scale, CODE_SCALE: tl.constexpr, HALF: tl.constexpr,
                        PAIRED: tl.constexpr, HIGH_PART_SCALE: tl.constexpr):
    """Q K^T times the softmax scale qk_scale for a KIVI block closed per channel (unrotated keys, per-channel
    params): ((Q * scale) . codes + Q . min) * qk_scale, the scale on the row's bias and in the one multiply that
    takes the codes' scale off. Q * scale is split like the codes (_query_parts: halves, or with four parts quarters
    whose odd ones hold high nibbles, _high_part_scale). The product of two fp16 values is exact in fp32, so each
    rounds once to dt as a packed fp16 multiply would; the high part's power of two then goes on in dt, exact but
    where the result is subnormal."""
    s_lo, m_lo, s_hi, m_hi = load_channel_params(k_params, HALF, PAIRED)
    dt = q_lo.dtype
    q32_lo = q_lo.to(tl.float32)
    q32_hi = q_hi.to(tl.float32)
    bias = tl.sum(q32_lo * m_lo, 1) + tl.sum(q32_hi * m_hi, 1)
    qs_parts = _query_parts((q32_lo * s_lo).to(dt), (q32_hi * s_hi).to(dt) * HIGH_PART_SCALE, len(k_parts) == 4)
    return _dot_parts(qs_parts, k_parts) * (CODE_SCALE * qk_scale) + (bias * qk_scale)[:, None]


@triton.jit
def _scores_from_originals(q_rows, row_live, new_keys_ptr, new_key_rows, staged_keys_ptr, pool_page,
                           pool_stride_token, offset, k_pos, context, seq_len, slot, HALF: tl.constexpr):
    """Q K^T for int4_kivi keys of the query's own block, from the original keys (model dtype, as the query): this
    step's tokens (k_pos >= context) from ``new_keys``, the earlier ones of the block the step starts in from the
    staging pool row ``slot``. Where that needs a slot and it is -1 the scores are NaN: an assignment bug then shows
    in the output of every query that reads those keys."""
    ch = tl.arange(0, HALF)
    q_lo = tl.load(q_rows + ch[None, :], mask=row_live[:, None], other=0.0)
    q_hi = tl.load(q_rows + HALF + ch[None, :], mask=row_live[:, None], other=0.0)
    fresh = ((k_pos >= context) & (k_pos < seq_len))[:, None]
    staged = k_pos < context
    from_pool = (staged & (slot >= 0))[:, None]
    new_rows = new_keys_ptr + new_key_rows[:, None] + ch[None, :]
    pool_rows = staged_keys_ptr + pool_page + offset[:, None] * pool_stride_token + ch[None, :]
    k_lo = tl.where(fresh, tl.load(new_rows, mask=fresh, other=0.0), tl.load(pool_rows, mask=from_pool, other=0.0))
    k_hi = tl.where(fresh, tl.load(new_rows + HALF, mask=fresh, other=0.0),
                    tl.load(pool_rows + HALF, mask=from_pool, other=0.0))
    scores = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
    return tl.where((staged & (slot < 0))[None, :], float("nan"), scores)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    """tl.reduce's combine for two sums at once."""
    return a0 + a1, b0 + b1


@triton.jit
def _tile_regions(tile, seq, kv_head, cache_u8_ptr, block_table_ptr, block_table_stride, stride_block, stride_head,
                  TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr):
    """Pointers to a K/V tile in its page (layout.py, head_dim D = 2 * HALF): (its first key code byte, its first
    byte in the channel-major value codes, the page's per-channel key params as fp16 (int4_kivi's closed blocks), the
    tile's first per-token key and value (scale, min) pairs as fp16). Each region is a pointer and the tile a scalar
    step into it: the tensor offsets (slots, channels) are then the same every tile, and a load's address one add
    (page and in-page offsets as one tensor were redone in 64 bits every tile, and an index into the cache as int16
    or fp16 halved the byte offset: a signed division)."""
    start = tile * TILE
    physical = tl.load(block_table_ptr + seq * block_table_stride + start // BLOCK_SIZE).to(tl.int64)
    page_ptr = cache_u8_ptr + (physical * stride_block + kv_head * stride_head)
    in_page = tl.multiple_of(start % BLOCK_SIZE, TILE)  # aligned: vector loads
    k_channel_params = (page_ptr + (2 * HALF + 4) * BLOCK_SIZE).to(tl.pointer_type(tl.float16))
    v_token_params = (page_ptr + 2 * HALF * BLOCK_SIZE).to(tl.pointer_type(tl.float16)) + 2 * in_page
    return (page_ptr + in_page * HALF, page_ptr + HALF * BLOCK_SIZE + in_page, k_channel_params,
            k_channel_params + 2 * in_page, v_token_params)


@triton.jit
def _attend_tile(tile, m_i, l_i, acc_lo, acc_hi, acc_min, q_lo, q_hi, qr_parts, qr_sum_scaled, q_rows, row_live,
                 may_live, q_pos, seq, q_start, context, seq_len, kv_end, kv_head, qk_scale, cache_u8_ptr,
                 block_table_ptr, block_table_stride, stride_block, stride_head, new_keys_ptr, new_keys_stride_t,
                 new_keys_stride_h, staged_keys_ptr, pool_page, pool_stride_token, slot,
                 TAIL: tl.constexpr, FULL: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_Q: tl.constexpr, IS_KIVI: tl.constexpr, PTX_UNPACK: tl.constexpr, SUBNORMAL: tl.constexpr,
                 CODE_SCALE: tl.constexpr, IS_BF16: tl.constexpr, CODE_BIAS_BITS: tl.constexpr,
                 CODE_BIAS: tl.constexpr, HALF: tl.constexpr, PAIRED: tl.constexpr, WIDE: tl.constexpr,
                 HIGH_PART_SCALE: tl.constexpr, JOINT_SUMS: tl.constexpr):
    """One K/V tile into the online softmax (m_i, l_i) and the accumulators. TAIL: one of the program's last tiles,
    which may hold keys of a query's own block (int4_kivi reads them from the original keys) or keys some row may not
    see; FULL (never with TAIL): every live row sees every key of the tile, so it runs without the visibility and
    written-slot masks (LaunchConfig.unmasked_full_tiles). q_lo, q_hi: the query rows' halves (int4_kivi scales them
    per channel each block); qr_parts: int4_saw's rotated rows split as the codes are read (_query_parts; WIDE:
    LaunchConfig.wide_code_loads), qr_sum_scaled their sums times qk_scale; JOINT_SUMS: LaunchConfig.joint_row_sums.
    Scores come out of the _scores_* functions already times qk_scale (log2 units)."""
    dt = q_lo.dtype
    start = tile * TILE
    logical_block = start // BLOCK_SIZE
    k_codes, v_codes, k_params, k_token_params, v_token_params = _tile_regions(
        tile, seq, kv_head, cache_u8_ptr, block_table_ptr, block_table_stride, stride_block, stride_head, TILE,
        BLOCK_SIZE, HALF)
    slots = tl.arange(0, TILE)
    offset = start % BLOCK_SIZE + slots
    k_pos = start + slots
    # slots past the sequence end hold stale bytes: never let them reach the P @ V product
    written = k_pos < seq_len
    # the key codes are loaded outside the branches: Triton's pipeliner prefetches only top-level loads
    k_parts = _load_key_parts(k_codes, WIDE, TILE, BLOCK_SIZE, PTX_UNPACK, SUBNORMAL, IS_BF16, CODE_BIAS_BITS,
                              CODE_BIAS, HALF)
    if IS_KIVI:
        if not TAIL:  # a block before the program's own blocks: closed for every row, per channel
            scores = _scores_per_channel(q_lo, q_hi, k_parts, k_params, qk_scale, CODE_SCALE, HALF, PAIRED,
                                         HIGH_PART_SCALE)
        else:
            new_key_rows = ((q_start - context + k_pos).to(tl.int64) * new_keys_stride_t
                            + kv_head * new_keys_stride_h)
            scores = _scores_from_originals(q_rows, row_live, new_keys_ptr, new_key_rows, staged_keys_ptr,
                                            pool_page, pool_stride_token, offset, k_pos, context, seq_len,
                                            slot, HALF) * qk_scale
            if BLOCK_Q > 1 and logical_block < (kv_end - 1) // BLOCK_SIZE:
                # the program's later rows are in the next block: this one is closed for them (a decode program
                # has one row, so never: the constexpr test keeps the second score matrix out of its registers)
                closed = _scores_per_channel(q_lo, q_hi, k_parts, k_params, qk_scale, CODE_SCALE, HALF, PAIRED,
                                         HIGH_PART_SCALE)
                own = (q_pos // BLOCK_SIZE == logical_block)[:, None]
                scores = tl.where(own, scores, closed)
    else:
        scores = _scores_per_token(qr_parts, qr_sum_scaled, k_parts, k_token_params, slots, written, qk_scale,
                                   CODE_SCALE, PAIRED, FULL)
    # rows past may_live are dead and the compiler can tell (the kernel's MAY_LIVE_ROWS): the selects on may_live
    # make their softmax constants, which fold away. The cross-warp row maximum passes through shared memory, where
    # the compiler would lose that a dead row's maximum is -inf, hence the select after it too
    if FULL:
        # every key is written and seen by every live row, so each row's maximum is finite from the first tile on
        # (a dead row's q is 0: its scores are 0, and its output is never stored)
        scores = tl.where(may_live[:, None], scores, float("-inf"))
        m_new = tl.where(may_live, tl.maximum(m_i, tl.max(scores, 1)), float("-inf"))
        m_ref = tl.where(may_live, m_new, 0.0)
    else:
        if BLOCK_Q == 1:
            # one query token (decode): its position is kv_end - 1, so the causal test is the length test; a dead
            # row's scores stay finite (q = 0) and are never stored
            visible = may_live[:, None] & (k_pos < kv_end)[None, :]
        else:
            visible = row_live[:, None] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos < kv_end)[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.where(may_live, tl.maximum(m_i, tl.max(scores, 1)), float("-inf"))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_ref[:, None])
    alpha = tl.where(may_live, tl.exp2(m_i - m_ref), 1.0)
    v_parts = _load_value_parts(v_codes, WIDE, TILE, BLOCK_SIZE, PTX_UNPACK, SUBNORMAL, IS_BF16, CODE_BIAS_BITS,
                                CODE_BIAS, HALF)
    sv, mv = load_token_params(v_token_params, slots, written, PAIRED, FULL)
    p_sv = tl.where(may_live[:, None], p * sv[None, :], 0.0)
    p_mv = tl.where(may_live[:, None], p * mv[None, :], 0.0)
    if BLOCK_Q > 1 and not FULL:
        # a broken value (NaN scale) must poison only the queries that see it: p = 0 for a later token,
        # but 0 * NaN is NaN, so select on visibility. A decode row sees exactly the written slots, whose
        # params are loaded as 0 past the end: there the select changes nothing, and on the H200 it made
        # int4_kivi decode (128-token tiles) about 30% slower at batch 256. In a FULL tile every row sees
        # every key.
        p_sv = tl.where(visible, p_sv, 0.0)
        p_mv = tl.where(visible, p_mv, 0.0)
    acc_lo, acc_hi = _accumulate_values(acc_lo * alpha[:, None], acc_hi * alpha[:, None], p_sv.to(dt), v_parts)
    if JOINT_SUMS:
        p_sum, pmv_sum = tl.reduce((p, p_mv), 1, _add_pairs)
    else:
        p_sum = tl.sum(p, 1)
        pmv_sum = tl.sum(p_mv, 1)
    l_i = l_i * alpha + p_sum
    acc_min = acc_min * alpha + pmv_sum
    return m_new, l_i, acc_lo, acc_hi, acc_min


@triton.jit
def _attend_group_as_n(first_tile, last_tile, qr_parts, qr_sum_scaled, seq, seq_len, kv_head, qk_scale, cache_u8_ptr,
                       block_table_ptr, block_table_stride, stride_block, stride_head, TILE: tl.constexpr,
                       WARPS: tl.constexpr, BLOCK_SIZE: tl.constexpr, PTX_UNPACK: tl.constexpr,
                       SUBNORMAL: tl.constexpr, CODE_SCALE: tl.constexpr, IS_BF16: tl.constexpr,
                       CODE_BIAS_BITS: tl.constexpr, CODE_BIAS: tl.constexpr, HALF: tl.constexpr,
                       PAIRED: tl.constexpr):
    """Decode over tiles [first_tile, last_tile) of keys per token with the query rows as the MMA's N
    (LaunchConfig.group_as_n): scores^T = K q^T per warp, [WARPS, SUB, N], then out^T += V^T P^T with the
    channel-major value codes as V^T. qr_parts: the rotated query rows [N, HALF // 2] split as the codes are read
    (_query_parts, wide); qr_sum_scaled: their sums times qk_scale. Warp w takes tokens w * SUB .. w * SUB + SUB - 1
    of every tile (the batched dots' first axis is the warp) and keeps its own online softmax; the warps merge once
    at the end. Returns (m, l, acc_lo, acc_hi, acc_min) as the tile loop leaves them (_attend_tile)."""
    SUB: tl.constexpr = TILE // WARPS
    N: tl.constexpr = qr_parts[0].shape[0]
    dt = qr_parts[0].dtype
    # q^T, the MMA's B operand, the same for every warp
    qt0 = tl.broadcast_to(tl.trans(qr_parts[0])[None, :, :], (WARPS, HALF // 2, N))
    qt1 = tl.broadcast_to(tl.trans(qr_parts[1])[None, :, :], (WARPS, HALF // 2, N))
    qt2 = tl.broadcast_to(tl.trans(qr_parts[2])[None, :, :], (WARPS, HALF // 2, N))
    qt3 = tl.broadcast_to(tl.trans(qr_parts[3])[None, :, :], (WARPS, HALF // 2, N))
    m_i = tl.full([WARPS, N], float("-inf"), tl.float32)
    l_i = tl.zeros([WARPS, N], tl.float32)
    acc_lo = tl.zeros([WARPS, HALF, N], tl.float32)
    acc_hi = tl.zeros([WARPS, HALF, N], tl.float32)
    acc_min = tl.zeros([WARPS, N], tl.float32)
    slots = tl.arange(0, WARPS)[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [WARPS, SUB]: a warp's tokens
    pairs = tl.arange(0, WARPS)[:, None] * (SUB // 2) + tl.arange(0, SUB // 2)[None, :]  # their int16 value words
    i = tl.arange(0, HALF // 2)
    j = tl.arange(0, HALF)
    for tile in range(first_tile, last_tile):
        k_codes, v_codes, _, k_params, v_params = _tile_regions(
            tile, seq, kv_head, cache_u8_ptr, block_table_ptr, block_table_stride, stride_block, stride_head, TILE,
            BLOCK_SIZE, HALF)
        # token t's int16 word i holds bytes 2i and 2i + 1: the four parts are _query_parts' channel quarters
        k_words = k_codes.to(tl.pointer_type(tl.int16))
        k_parts = _unpack_quarters(tl.load(k_words + slots[:, :, None] * (HALF // 2) + i[None, None, :]), PTX_UNPACK,
                                   SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS)
        raw = tl.dot(k_parts[3], qt3, tl.dot(k_parts[2], qt2, tl.dot(k_parts[1], qt1, tl.dot(k_parts[0], qt0))))
        # slots past the sequence end hold stale bytes; a decode row sees every written slot
        written = (tile * TILE + slots) < seq_len
        s_t, m_t = load_token_params(k_params, slots, written, PAIRED)
        scores = raw * (s_t * (CODE_SCALE * qk_scale))[:, :, None] + m_t[:, :, None] * qr_sum_scaled[None, None, :]
        scores = tl.where(written[:, :, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_ref[:, None, :])
        alpha = tl.exp2(m_i - m_ref)
        sv, mv = load_token_params(v_params, slots, written, PAIRED)
        # channel byte j's int16 word holds tokens 2i and 2i + 1: parts (channel j, HALF + j) of the even tokens,
        # then of the odd ones, against P^T's rows of those tokens
        p_even, p_odd = tl.split(tl.permute(tl.reshape((p * sv[:, :, None]).to(dt), [WARPS, SUB // 2, 2, N]),
                                            (0, 1, 3, 2)))
        v_words = v_codes.to(tl.pointer_type(tl.int16))
        v_parts = _unpack_quarters(tl.load(v_words + j[None, :, None] * (BLOCK_SIZE // 2) + pairs[:, None, :]),
                                   PTX_UNPACK, SUBNORMAL, IS_BF16, CODE_BIAS_BITS, CODE_BIAS)
        acc_lo = tl.dot(v_parts[2], p_odd, tl.dot(v_parts[0], p_even, acc_lo * alpha[:, None, :]))
        acc_hi = tl.dot(v_parts[3], p_odd, tl.dot(v_parts[1], p_even, acc_hi * alpha[:, None, :]))
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_min = acc_min * alpha + tl.sum(p * mv[:, :, None], 1)
        m_i = m_new
    m = tl.max(m_i, 0)
    weight = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m)[None, :])  # 0 for a warp that saw no key
    return (m, tl.sum(l_i * weight, 0), tl.trans(tl.sum(acc_lo * weight[:, None, :], 0)),
            tl.trans(tl.sum(acc_hi * weight[:, None, :], 0)), tl.sum(acc_min * weight, 0))


# Runtime values must not pick kernel variants: Triton would otherwise compile one per "== 1 / multiple of 16"
# value of num_seqs and per 16-byte alignment of the (sliced) metadata pointers, and a new variant met while
# serving is a JIT stall of seconds. The metadata is read with scalar loads, where alignment buys nothing.
@triton.jit(do_not_specialize=["num_seqs"],
            do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr",
                                            "sequence_slots_ptr"])
def _paged_attention_kernel(
    q_ptr, out_ptr, cache_u8_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_ml_ptr, new_keys_ptr, staged_keys_ptr, sequence_slots_ptr,
    qk_scale, num_seqs,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, block_table_stride, stride_block, stride_head,
    new_keys_stride_t, new_keys_stride_h, pool_stride_slot, pool_stride_head, pool_stride_token,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IS_KIVI: tl.constexpr, HADAMARD_BLOCK: tl.constexpr,
    ROTATE_V: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PTX_UNPACK: tl.constexpr, SUBNORMAL: tl.constexpr, CODE_SCALE: tl.constexpr,
    IS_BF16: tl.constexpr, CODE_BIAS_BITS: tl.constexpr, CODE_BIAS: tl.constexpr, HALF: tl.constexpr,
    PAIRED_PARAMS: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    DECODE: tl.constexpr, WIDE_CODES: tl.constexpr, HIGH_PART_SCALE: tl.constexpr,
    UNMASKED_FULL_TILES: tl.constexpr, JOINT_ROW_SUMS: tl.constexpr, GROUP_AS_N: tl.constexpr, WARPS: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # every query is one token: a program per sequence, no search, its loads in one round trip
        seq = q_block
    else:
        seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if DECODE:
        local_block = tl.zeros([], tl.int32)
    else:
        local_block = q_block - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    kv_end = context + tl.minimum(q_len, (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE)
    tiles_per_split = _tiles_per_split(num_tiles, NUM_SPLITS, MIN_SPLIT_TILES)
    first_tile = split * tiles_per_split
    # a split past the context does nothing, not even load q: the merge reads the live splits only (_live_splits),
    # so one grid serves short contexts and long ones
    if (local_block * BLOCK_Q < q_len) & (first_tile < num_tiles):
        rows = tl.arange(0, BLOCK_M)
        q_tok = local_block * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_live = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
        # rows that may hold a live query, bounded where the compiler can tell from the layout: a thread of a 16-row
        # MMA tile holds rows r and r + 8, so with the GQA group in the first 8 its second row is dead (_attend_tile)
        MAY_LIVE_ROWS: tl.constexpr = 8 if BLOCK_M == 16 and BLOCK_Q * GROUP <= 8 else BLOCK_M
        may_live = rows < MAY_LIVE_ROWS
        q_pos = context + q_tok
        ch = tl.arange(0, HALF)
        q_rows = q_ptr + (q_start + q_tok).to(tl.int64)[:, None] * q_stride_t + head[:, None] * q_stride_h
        q_lo = tl.load(q_rows + ch[None, :], mask=row_live[:, None], other=0.0)
        q_hi = tl.load(q_rows + HALF + ch[None, :], mask=row_live[:, None], other=0.0)
        if SUBNORMAL:  # the codes are fp16 subnormals: every MMA operand goes to fp16 (bf16 q converts exactly)
            q_lo = q_lo.to(tl.float16)
            q_hi = q_hi.to(tl.float16)
        dt = q_lo.dtype
        qr_lo32, qr_hi32 = rotate_halves(q_lo, q_hi, HADAMARD_BLOCK, HALF)
        qr_lo = qr_lo32.to(dt)
        qr_hi = qr_hi32.to(dt)
        # the per-token scores' sum(q) term, with the softmax scale taken here once (_scores_per_token)
        qr_sum_scaled = (tl.sum(qr_lo.to(tl.float32), 1) + tl.sum(qr_hi.to(tl.float32), 1)) * qk_scale
        # the channels whose codes come 16 x too large: q takes the 1/16 (a power of two: the same rounding)
        qr_parts = _query_parts(qr_lo, (qr_hi32 * HIGH_PART_SCALE).to(dt), WIDE_CODES)

        slot = tl.full([], -1, tl.int32)
        pool_page = tl.zeros([], tl.int64)
        first_own_block = tl.zeros([], tl.int32)
        if IS_KIVI:
            # the own blocks of this program's queries: every tile from first_own_block on is read from the
            # original keys for the rows in its block (a multi-query program may span two blocks)
            first_own_block = (context + local_block * BLOCK_Q) // BLOCK_SIZE
            slot = tl.load(sequence_slots_ptr + seq)
            pool_page = slot.to(tl.int64) * pool_stride_slot + kv_head * pool_stride_head

        last_tile = tl.minimum(num_tiles, first_tile + tiles_per_split)

        if GROUP_AS_N:
            m_i, l_i, acc_lo, acc_hi, acc_min = _attend_group_as_n(
                first_tile, last_tile, qr_parts, qr_sum_scaled, seq, seq_len, kv_head, qk_scale, cache_u8_ptr,
                block_table_ptr, block_table_stride, stride_block, stride_head, TILE, WARPS, BLOCK_SIZE, PTX_UNPACK,
                SUBNORMAL, CODE_SCALE, IS_BF16, CODE_BIAS_BITS, CODE_BIAS, HALF, PAIRED_PARAMS)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
            acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
            acc_min = tl.zeros([BLOCK_M], tl.float32)  # P @ (per-token value min), the same for every channel
            # Two loops: the tiles every live row sees wholly, then the program's tail. int4_kivi's tail starts at
            # the program's own blocks, so the per-channel tiles before them cost neither registers nor branches
            # for the own-block path (original keys, a second score matrix). With UNMASKED_FULL_TILES the first
            # loop runs without masks (LaunchConfig.unmasked_full_tiles), and int4_saw's tail starts at the first
            # tile holding a key past the first row's position (the program's smallest: later rows see more);
            # without it int4_saw runs every tile in the first loop, masked.
            tail_tile = last_tile
            if IS_KIVI:
                tail_tile = tl.maximum(tl.minimum(first_own_block * (BLOCK_SIZE // TILE), last_tile), first_tile)
            elif UNMASKED_FULL_TILES:
                tail_tile = tl.maximum(tl.minimum((context + local_block * BLOCK_Q + 1) // TILE, last_tile),
                                       first_tile)
            for tile in range(first_tile, tail_tile):
                m_i, l_i, acc_lo, acc_hi, acc_min = _attend_tile(
                    tile, m_i, l_i, acc_lo, acc_hi, acc_min, q_lo, q_hi, qr_parts, qr_sum_scaled, q_rows, row_live,
                    may_live, q_pos, seq, q_start, context, seq_len, kv_end, kv_head, qk_scale, cache_u8_ptr,
                    block_table_ptr, block_table_stride, stride_block, stride_head, new_keys_ptr, new_keys_stride_t,
                    new_keys_stride_h, staged_keys_ptr, pool_page, pool_stride_token, slot,
                    False, UNMASKED_FULL_TILES, TILE, BLOCK_SIZE, BLOCK_Q, IS_KIVI, PTX_UNPACK, SUBNORMAL, CODE_SCALE,
                    IS_BF16, CODE_BIAS_BITS, CODE_BIAS, HALF, PAIRED_PARAMS, WIDE_CODES, HIGH_PART_SCALE,
                    JOINT_ROW_SUMS)
            # not pipelined: the tail is a tile or two per program (int4_saw's decode: at most one, in the last split).
            # Its first tile's loads start once the first loop is done, pipelined or not (as the last tile of one
            # loop they were prefetched during the tile before: what the split costs); a pipeline would overlap
            # only a second tile's loads, for more code and shared memory, and buffering int4_kivi's 16-bit
            # original-key tiles would take the shared memory that lets a second program share the SM (occupancy).
            for tile in tl.range(tail_tile, last_tile, num_stages=1):
                m_i, l_i, acc_lo, acc_hi, acc_min = _attend_tile(
                    tile, m_i, l_i, acc_lo, acc_hi, acc_min, q_lo, q_hi, qr_parts, qr_sum_scaled, q_rows, row_live,
                    may_live, q_pos, seq, q_start, context, seq_len, kv_end, kv_head, qk_scale, cache_u8_ptr,
                    block_table_ptr, block_table_stride, stride_block, stride_head, new_keys_ptr, new_keys_stride_t,
                    new_keys_stride_h, staged_keys_ptr, pool_page, pool_stride_token, slot,
                    True, False, TILE, BLOCK_SIZE, BLOCK_Q, IS_KIVI, PTX_UNPACK, SUBNORMAL, CODE_SCALE, IS_BF16,
                    CODE_BIAS_BITS, CODE_BIAS, HALF, PAIRED_PARAMS, WIDE_CODES, HIGH_PART_SCALE, JOINT_ROW_SUMS)
        acc_lo = acc_lo * CODE_SCALE + acc_min[:, None]
        acc_hi = acc_hi * (CODE_SCALE * HIGH_PART_SCALE) + acc_min[:, None]

        # normalized output of this program (0 where it saw no key)
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None]
        o_lo = acc_lo * inv_l
        o_hi = acc_hi * inv_l
        if ROTATE_V:
            o_lo, o_hi = rotate_halves(o_lo.to(dt), o_hi.to(dt), HADAMARD_BLOCK, HALF)
        token = (q_start + q_tok).to(tl.int64)
        if NUM_SPLITS == 1:
            out_rows = out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + ch[None, :]
            tl.store(out_rows, o_lo.to(out_ptr.dtype.element_ty), mask=row_live[:, None])
            tl.store(out_rows + HALF, o_hi.to(out_ptr.dtype.element_ty), mask=row_live[:, None])
        else:
            # decode: one token per sequence; partials indexed by (sequence, query head, split)
            part = ((seq * GROUP * tl.num_programs(1) + head) * NUM_SPLITS + split).to(tl.int64)
            acc_rows = part_acc_ptr + part[:, None] * (2 * HALF) + ch[None, :]
            tl.store(acc_rows, o_lo, mask=row_live[:, None])
            tl.store(acc_rows + HALF, o_hi, mask=row_live[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_live)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_live)


@triton.jit
def _tiles_per_split(num_tiles, NUM_SPLITS: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """Tiles of a sequence per split: an even share of NUM_SPLITS, but at least MIN_SPLIT_TILES (DecodePlan)."""
    return tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), MIN_SPLIT_TILES)


@triton.jit
def _live_splits(seq_len, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """How many of a decode row's NUM_SPLITS splits hold a tile (_tiles_per_split each): a short context leaves the
    last splits empty (and unwritten)."""
    num_tiles = tl.cdiv(seq_len, TILE)
    return tl.cdiv(num_tiles, _tiles_per_split(num_tiles, NUM_SPLITS, MIN_SPLIT_TILES))


@triton.jit(do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr"])  # see _paged_attention_kernel
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, seq_lens_ptr, out_stride_t, out_stride_h,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # the three loads in one memory round trip before the partials' loads, not two: the test reads seq_len too
    # (a row with a query has seq_len >= 1), so the compiler cannot sink its load past the branch (at batch 1 the
    # merge is a third of the step, and its round trips are most of it)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if (q_end > q_start) & (seq_len > 0):
        split = tl.arange(0, NUM_SPLITS)
        live = split < _live_splits(seq_len, TILE, NUM_SPLITS, MIN_SPLIT_TILES)
        part = (seq * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS + split
        m = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"))
        l = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0)
        m_max = tl.max(m, 0)
        # each partial is normalized by its own denominator l: weight it by l * exp(m - m_max)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max) * l)
        ch = tl.arange(0, HEAD_DIM)
        partial = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + ch[None, :], mask=live[:, None], other=0.0)
        partial = tl.where(weight[:, None] > 0, partial, 0.0)
        out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + q_start.to(tl.int64) * out_stride_t + head * out_stride_h + ch,
                 out.to(out_ptr.dtype.element_ty))


class DecodePlan(NamedTuple):
    """How a decode batch runs. ``splits``: the split count (the grid's third axis); ``min_split_tiles``: the fewest
    tiles a split takes, so a context of fewer than splits x min_split_tiles tiles fills fewer splits (the rest exit
    at once): the split count a sequence gets follows its context inside the batch's fixed grid."""

    splits: int
    min_split_tiles: int = 1

    def live_splits(self, num_tiles: int) -> int:
        """The splits a sequence of ``num_tiles`` tiles fills (what the kernels' _live_splits computes)."""
        return cdiv(num_tiles, max(cdiv(num_tiles, self.splits), self.min_split_tiles))


# Split-KV decode per scheme, by the KV-head programs per SM a batch gives unsplit (num_seqs * num_kv_heads / SMs):
# (up to this many per SM, splits, min split tiles) (DecodePlan's fields), first match. A function of the
# batch size only, for a model and device, so every CUDA graph (captured per batch size) keeps its grid. Measured on
# the H200 at each scheme's launches (tools/device/sweep_splits.py; `--apply` writes this table).
DECODE_SPLITS = {
    "int4_kivi": ((0.043, 64, 1), (0.121, 32, 1), (0.343, 16, 1), (0.686, 8, 1), (1.371, 4, 4), (2.743, 2, 1),
                  (math.inf, 1, 1)),
    "int4_saw": ((0.043, 64, 1), (0.121, 32, 1), (0.343, 16, 1), (0.686, 8, 1), (1.371, 4, 4), (2.743, 2, 1),
                 (math.inf, 1, 1)),
}


def decode_plan(num_seqs: int, num_kv_heads: int, num_sms: int, table) -> DecodePlan:
    """The DecodePlan of a decode batch of ``num_seqs`` sequences by ``table`` (a DECODE_SPLITS entry)."""
    per_sm = num_seqs * num_kv_heads / num_sms
    return next(DecodePlan(*entry[1:]) for entry in table if per_sm <= entry[0])


@dataclass
class SplitWorkspace:
    """Partial-softmax buffers for split-KV decode, allocated once (before CUDA-graph capture).

    ``plans[n]`` is the DecodePlan of a decode batch of n sequences, for n up to ``max_num_seqs`` (vLLM's
    max_num_seqs: no batch is larger); the buffers hold the largest ``n * plans[n].splits``, so every batch fits.
    """

    part_acc: torch.Tensor  # [rows, head_dim] fp32, each split's output normalized by its own softmax denominator
    part_ml: torch.Tensor  # [rows, 2] fp32 (running max in log2 units, softmax denominator)
    num_q_heads: int
    num_kv_heads: int
    plans: tuple[DecodePlan, ...]

    @classmethod
    def allocate(cls, num_q_heads: int, num_kv_heads: int, head_dim: int, device, scheme_name: str | None = None,
                 max_num_seqs: int = 256, num_splits: int | None = None,
                 num_sms: int | None = None) -> "SplitWorkspace":
        """Plans by DECODE_SPLITS[scheme_name] for the device's SMs (``num_sms``: 8 off the GPU), or ``num_splits`` (a
        power of two) for every batch size, on the tile loop (DecodePlan(num_splits))."""
        check_head_dim(head_dim)
        if (num_splits is None) == (scheme_name is None):
            raise ValueError("give the scheme whose DECODE_SPLITS rule sizes the workspace, or a fixed num_splits")
        if scheme_name is not None and scheme_name not in DECODE_SPLITS:
            raise ValueError(f"no split rule for {scheme_name!r}: one of {', '.join(DECODE_SPLITS)}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits must be a power of two (the merge kernel's tile), got {num_splits}")
        device = torch.device(device)
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        plans = tuple(DecodePlan(num_splits) if num_splits else
                      decode_plan(n, num_kv_heads, num_sms, DECODE_SPLITS[scheme_name]) if n else DecodePlan(1)
                      for n in range(max_num_seqs + 1))
        rows = max(n * plan.splits for n, plan in enumerate(plans)) * num_q_heads
        return cls(
            part_acc=torch.empty(rows, head_dim, dtype=torch.float32, device=device),
            part_ml=torch.empty(rows, 2, dtype=torch.float32, device=device),
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, plans=plans,
        )

    @property
    def max_num_seqs(self) -> int:
        return len(self.plans) - 1

    def plan(self, num_seqs: int) -> DecodePlan:
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"decode batch of {num_seqs} sequences, but the split workspace was allocated for "
                             f"max_num_seqs {self.max_num_seqs}")
        return self.plans[num_seqs]


def _high_part_scale(launch: LaunchConfig, dtype: torch.dtype) -> float:
    """The factor that takes the high-nibble parts of wide code loads back to their codes: key quarters 1 and 3
    (channels HALF + 2i, HALF + 2i + 1) and the values' channels HALF + j. The fp16 formats (subnormal codes, or
    biased with fp16 queries) keep a byte's high nibble in place as 16 x the code (_unpack_quarters): 1/16; else 1."""
    in_place = launch.wide_code_loads and (launch.subnormal_codes or dtype == torch.float16)
    return 0.0625 if in_place else 1.0


def _code_format(dtype: torch.dtype, subnormal: bool) -> dict:
    """How _codes_as_float builds MMA operands from codes. Biased: exponent bits of 128.0 (bf16) or 1024.0 (fp16),
    the 16-bit float whose mantissa ulp is exactly 1. Subnormal: fp16 code * 2^-24, scaled back by 2^24 in fp32."""
    if dtype == torch.bfloat16:
        biased = dict(IS_BF16=True, CODE_BIAS_BITS=BF16_CODE_BIAS[0], CODE_BIAS=BF16_CODE_BIAS[1])
    elif dtype == torch.float16:
        biased = dict(IS_BF16=False, CODE_BIAS_BITS=FP16_CODE_BIAS[0], CODE_BIAS=FP16_CODE_BIAS[1])
    else:
        raise ValueError(f"query must be bf16 or fp16, got {dtype}")
    return dict(biased, SUBNORMAL=subnormal, CODE_SCALE=2.0**24 if subnormal else 1.0)


def paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len: int,
                    softmax_scale: float, scheme: Int4Scheme, out, workspace: SplitWorkspace | None = None,
                    launch: LaunchConfig | None = None, staged_keys=None, sequence_slots=None,
                    new_keys=None) -> None:
    """Causal attention of query [T, Hq, D] over the int4 paged cache of head_dim D into out [T, Hq, D].

    Values, and int4_saw keys, are read from the cache for every key. int4_kivi reads each query's own block from
    the original keys (docs/kernel-api.md): ``new_keys`` [>= T, Hkv, D] (the step's keys, what the store got; rows
    past T are never read) for this step's tokens, and the staging pool ``staged_keys`` [slots, Hkv, 128, D] at
    ``sequence_slots`` int32 [num_seqs] (the slot of the block each sequence's step starts in, -1 where the step
    starts on a block boundary) for the earlier tokens of that block; every earlier block per channel. Both in the
    query's dtype; int4_saw takes neither."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query must be [T, Hq, D] with Hq a multiple of {num_kv_heads}, got {tuple(query.shape)}")
    check_pool_read(staged_keys, sequence_slots, seq_lens.shape[0], num_kv_heads, head_dim, scheme)
    if scheme.is_kivi and (staged_keys.dtype != query.dtype or staged_keys.stride(-1) != 1):
        raise ValueError(f"staged_keys must be {query.dtype} (the query's dtype) with contiguous channels, got "
                         f"{staged_keys.dtype} strides {staged_keys.stride()}")
    layout = PageLayout.of_cache(kv_cache, head_dim)
    block_size = layout.block_size
    if scheme.is_kivi and block_size != KIVI_BLOCK_SIZE:
        raise ValueError(f"int4_kivi needs block_size {KIVI_BLOCK_SIZE}, got {block_size}")
    if scheme.is_kivi:
        check_new_keys(new_keys, num_tokens, num_kv_heads, head_dim, query.dtype)
    else:  # int4_saw reads every key from the cache: the arguments are unused
        new_keys, staged_keys, sequence_slots = query, query, seq_lens
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    decode = max_query_len == 1
    default_launch = launch is None
    plan = workspace.plan(num_seqs) if (decode and workspace is not None) else DecodePlan(1)
    if decode:
        block_q, launch = 1, launch or DECODE_LAUNCH[scheme.name]
        # the MMA takes 16 query rows as M, 8 as N (LaunchConfig.group_as_n)
        block_m = max(8 if launch.group_as_n else 16, next_power_of_2(group))
    else:
        block_m = max(64, next_power_of_2(group))
        block_q, launch = block_m // group, launch or PREFILL_LAUNCH
    tile = tile_tokens(block_size, launch.tile)
    if launch.group_as_n:
        # _attend_group_as_n: one query token a program, keys per token, 16-bit code words, and at least 32 tokens a
        # warp (16 keys as the MMA's M, 16 even and 16 odd value tokens as its K); the tile loop's options do not apply
        needs = ("a decode batch (max_query_len 1)" if not decode else "keys per token (int4_saw)" if scheme.is_kivi
                 else "codes read two bytes per element (wide_code_loads)" if not launch.wide_code_loads
                 else "at least 32 tokens a warp" if tile < 32 * launch.num_warps
                 else "no tile-loop option (unmasked_full_tiles, joint_row_sums)"
                 if launch.unmasked_full_tiles or launch.joint_row_sums else None)
        if needs:
            raise ValueError(f"LaunchConfig.group_as_n needs {needs}: got {scheme.name}, max_query_len "
                             f"{max_query_len}, a {tile}-token tile over {launch.num_warps} warps")
    if launch.wide_code_loads and launch.unmasked_full_tiles and not decode and not scheme.is_kivi:
        # int4_saw with several queries a program gave NaN (64-token tiles) and an illegal address (128-token tiles)
        # on the H100 with both, where each alone and int4_kivi with both pass the GPU tests
        raise ValueError("LaunchConfig.wide_code_loads with unmasked_full_tiles faults on the GPU for int4_saw with "
                         f"more than one query a sequence (max_query_len {max_query_len}): turn one of them off")
    if launch.subnormal_codes and head_dim not in SUBNORMAL_HEAD_DIMS:
        if not default_launch:
            raise ValueError(f"LaunchConfig.subnormal_codes is validated on the GPU at head_dim "
                             f"{', '.join(map(str, SUBNORMAL_HEAD_DIMS))} only, not {head_dim}: use the biased codes")
        launch = replace(launch, subnormal_codes=False)
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    if launch.ptx_unpack and interpreted:
        if not default_launch:
            raise ValueError("LaunchConfig.ptx_unpack runs inline PTX, which the Triton interpreter cannot run")
        # the default launch off the GPU: the Triton-op unpack gives bit-identical operands (tests/kernels, gpu)
        launch = replace(launch, ptx_unpack=False)
    # the interpreter compiles nothing: a register cap is for ptxas only
    compiler_options = {} if launch.max_registers is None or interpreted else {"maxnreg": launch.max_registers}
    num_splits = plan.splits
    if num_splits > 1 and (workspace.num_q_heads != num_q_heads or workspace.part_acc.shape[1] != head_dim):
        raise ValueError("workspace was allocated for another number of query heads or another head_dim")
    dummy = out if num_splits == 1 else None
    # query blocks: a sequence's start at qsl[i] // block_q + i (_find_sequence); a decode's only one at i
    grid = (num_seqs if decode else num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, out, kv_cache, block_table, seq_lens, query_start_loc,
        workspace.part_acc if num_splits > 1 else dummy, workspace.part_ml if num_splits > 1 else dummy,
        new_keys, staged_keys, sequence_slots,
        softmax_scale * LOG2E, num_seqs,
        *query.stride()[:2], *out.stride()[:2], block_table.stride()[0], *kv_cache.stride()[:2],
        *new_keys.stride()[:2], *(staged_keys.stride()[:3] if scheme.is_kivi else (0, 0, 0)),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE=tile, BLOCK_SIZE=block_size,
        IS_KIVI=scheme.is_kivi, HADAMARD_BLOCK=scheme.hadamard_block_for(head_dim),
        ROTATE_V=scheme.rotate_values, NUM_SPLITS=num_splits, PTX_UNPACK=launch.ptx_unpack, HALF=layout.half_dim,
        PAIRED_PARAMS=launch.paired_param_loads,
        MIN_SPLIT_TILES=plan.min_split_tiles, DECODE=decode, WIDE_CODES=launch.wide_code_loads,
        HIGH_PART_SCALE=_high_part_scale(launch, query.dtype),
        UNMASKED_FULL_TILES=launch.unmasked_full_tiles, JOINT_ROW_SUMS=launch.joint_row_sums,
        GROUP_AS_N=launch.group_as_n, WARPS=launch.num_warps,
        **_code_format(query.dtype, launch.subnormal_codes),
        num_warps=launch.num_warps, num_stages=launch.num_stages, **compiler_options,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_q_heads)](
            out, workspace.part_acc, workspace.part_ml, query_start_loc, seq_lens, *out.stride()[:2],
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, TILE=tile, MIN_SPLIT_TILES=plan.min_split_tiles,
        )

