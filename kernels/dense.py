"""Gather the K/V of prefill sequences into a dense bf16/fp16 buffer for FlashAttention (Triton).

Prefill is compute-bound: FlashAttention on tensor cores beats any int4-reading kernel there, so the backend
hands a prefill chunk to FA over ``[cached prefix dequantized from int4 | the chunk's fresh K/V]``. Only the
prefix comes from the cache (in the original, un-rotated space); the new tokens are copied exactly, as vLLM's
own FA path sees them. int4_kivi with its staging pool (kernels/staging.py) reads the cached part of a sequence's
open block from the pool: the original keys, as attention does. The buffer is varlen: sequence i occupies rows
``cu_seqlens_k[i] : cu_seqlens_k[i + 1]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import KIVI_BLOCK_SIZE, PageLayout, tile_tokens
from .scheme import Int4Scheme
from .staging import check_pool_read
from .triton_common import (kivi_block_is_per_channel, load_channel_params, load_key_token_params, load_token_params,
                            rotate_halves_fp32)

TILE = 64


@triton.jit
def _keys_per_channel(k_lo, k_hi, cache_f16_ptr, k_params, HALF: tl.constexpr):
    s_lo, m_lo, s_hi, m_hi = load_channel_params(cache_f16_ptr, k_params, HALF)
    return k_lo * s_lo + m_lo, k_hi * s_hi + m_hi


@triton.jit
def _keys_per_token(k_lo, k_hi, cache_f16_ptr, k_params, offset, cached, HADAMARD_BLOCK: tl.constexpr,
                    HALF: tl.constexpr):
    """Per-token dequantization, then back from the rotated space (R is its own inverse)."""
    s_t, m_t = load_key_token_params(cache_f16_ptr, k_params, offset, cached)
    return rotate_halves_fp32(k_lo * s_t[:, None] + m_t[:, None], k_hi * s_t[:, None] + m_t[:, None], HADAMARD_BLOCK,
                              HALF)


@triton.jit
def _keys_from_pool(staged_keys_ptr, pool_page, pool_stride_token, offset, cached, slot, HALF: tl.constexpr):
    """The open int4_kivi block's original keys from the staging pool, fp32; NaN where the sequence has no slot
    (-1), an assignment bug that must show in the attention output."""
    ch = tl.arange(0, HALF)
    rows = staged_keys_ptr + pool_page + offset[:, None] * pool_stride_token + ch[None, :]
    readable = (cached & (slot >= 0))[:, None]
    k_lo = tl.load(rows, mask=readable, other=0.0).to(tl.float32)
    k_hi = tl.load(rows + HALF, mask=readable, other=0.0).to(tl.float32)
    return tl.where(slot >= 0, k_lo, float("nan")), tl.where(slot >= 0, k_hi, float("nan"))


# The backend passes metadata sliced past the decodes (seq_lens[nd:], ...): their addresses must not pick kernel
# variants (a JIT stall while serving); they are read with scalar loads.
@triton.jit(do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr",
                                            "cu_seqlens_k_ptr", "sequence_slots_ptr"])
def _gather_dense_kernel(
    key_ptr, value_ptr, cache_u8_ptr, cache_f16_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    cu_seqlens_k_ptr, dense_k_ptr, dense_v_ptr, staged_keys_ptr, sequence_slots_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h, dense_stride_t, dense_stride_h,
    block_table_stride, stride_block, stride_head, pool_stride_slot, pool_stride_head, pool_stride_token,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IS_KIVI: tl.constexpr, HAS_POOL: tl.constexpr,
    HADAMARD_BLOCK: tl.constexpr, ROTATE_V: tl.constexpr, HALF: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if tile * TILE < seq_len:
        q_start = tl.load(query_start_loc_ptr + seq)
        prefix = seq_len - (tl.load(query_start_loc_ptr + seq + 1) - q_start)
        pos = tile * TILE + tl.arange(0, TILE)
        cached = pos < prefix
        fresh = (pos >= prefix) & (pos < seq_len)
        ch = tl.arange(0, HALF)
        logical_block = tile * TILE // BLOCK_SIZE
        physical = tl.load(block_table_ptr + seq * block_table_stride + logical_block).to(tl.int64)
        page = physical * stride_block + head * stride_head
        offset = (tile * TILE) % BLOCK_SIZE + tl.arange(0, TILE)

        k_bytes = tl.load(cache_u8_ptr + page + offset[:, None] * HALF + ch[None, :], mask=cached[:, None], other=0)
        k_lo = (k_bytes & 15).to(tl.float32)
        k_hi = (k_bytes >> 4).to(tl.float32)
        k_params = (page + (2 * HALF + 4) * BLOCK_SIZE) // 2  # layout.py: (D + 4) * B
        if IS_KIVI:
            if HAS_POOL and (logical_block + 1) * BLOCK_SIZE > seq_len:  # the open block (docs/format.md)
                slot = tl.load(sequence_slots_ptr + seq)
                pool_page = slot.to(tl.int64) * pool_stride_slot + head * pool_stride_head
                k_lo, k_hi = _keys_from_pool(staged_keys_ptr, pool_page, pool_stride_token, offset, cached, slot, HALF)
            elif kivi_block_is_per_channel(cache_f16_ptr, k_params, logical_block, seq_len, BLOCK_SIZE):
                k_lo, k_hi = _keys_per_channel(k_lo, k_hi, cache_f16_ptr, k_params, HALF)
            else:
                k_lo, k_hi = _keys_per_token(k_lo, k_hi, cache_f16_ptr, k_params, offset, cached, HADAMARD_BLOCK, HALF)
        else:
            k_lo, k_hi = _keys_per_token(k_lo, k_hi, cache_f16_ptr, k_params, offset, cached, HADAMARD_BLOCK, HALF)

        v_bytes = tl.load(cache_u8_ptr + page + HALF * BLOCK_SIZE + offset[:, None] + ch[None, :] * BLOCK_SIZE,
                          mask=cached[:, None], other=0)  # channel-major (layout.py)
        s_v, m_v = load_token_params(cache_f16_ptr, (page + 2 * HALF * BLOCK_SIZE) // 2, offset, cached)
        v_lo = (v_bytes & 15).to(tl.float32) * s_v[:, None] + m_v[:, None]
        v_hi = (v_bytes >> 4).to(tl.float32) * s_v[:, None] + m_v[:, None]
        if ROTATE_V:
            v_lo, v_hi = rotate_halves_fp32(v_lo, v_hi, HADAMARD_BLOCK, HALF)

        src = (q_start + pos - prefix).to(tl.int64)
        key_rows = key_ptr + src[:, None] * key_stride_t + head * key_stride_h + ch[None, :]
        value_rows = value_ptr + src[:, None] * value_stride_t + head * value_stride_h + ch[None, :]
        k_lo = tl.where(cached[:, None], k_lo, tl.load(key_rows, mask=fresh[:, None], other=0.0).to(tl.float32))
        k_hi = tl.where(cached[:, None], k_hi, tl.load(key_rows + HALF, mask=fresh[:, None], other=0.0).to(tl.float32))
        v_lo = tl.where(cached[:, None], v_lo, tl.load(value_rows, mask=fresh[:, None], other=0.0).to(tl.float32))
        v_hi = tl.where(cached[:, None], v_hi,
                        tl.load(value_rows + HALF, mask=fresh[:, None], other=0.0).to(tl.float32))

        dst = (tl.load(cu_seqlens_k_ptr + seq) + pos).to(tl.int64)
        live = (pos < seq_len)[:, None]
        dense = dst[:, None] * dense_stride_t + head * dense_stride_h + ch[None, :]
        out_dtype = dense_k_ptr.dtype.element_ty
        tl.store(dense_k_ptr + dense, k_lo.to(out_dtype), mask=live)
        tl.store(dense_k_ptr + dense + HALF, k_hi.to(out_dtype), mask=live)
        tl.store(dense_v_ptr + dense, v_lo.to(out_dtype), mask=live)
        tl.store(dense_v_ptr + dense + HALF, v_hi.to(out_dtype), mask=live)


def gather_dense_kv(key, value, kv_cache, block_table, seq_lens, query_start_loc, cu_seqlens_k, max_seq_len: int,
                    scheme: Int4Scheme, dense_k, dense_v, staged_keys=None, sequence_slots=None) -> None:
    """Write [prefix from the int4 cache | fresh key/value] of every sequence into dense_k/dense_v [N, Hkv, D].

    ``query_start_loc[i]`` indexes ``key``/``value`` (absolute rows, so a slice of a larger batch can be passed
    without re-basing); ``cu_seqlens_k`` ([num_seqs + 1], starts at 0) places each sequence in the dense buffer.
    int4_kivi with its staging pool: ``staged_keys`` [slots, Hkv, 128, D] and ``sequence_slots`` int32 [num_seqs]
    (sliced like ``seq_lens``), as for attention.paged_attention; the prefix's open-block keys come from the pool.
    """
    num_seqs = seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[1]
    head_dim = key.shape[-1]
    check_pool_read(staged_keys, sequence_slots, num_seqs, num_kv_heads, head_dim, scheme)
    has_pool = staged_keys is not None
    if has_pool and staged_keys.stride(-1) != 1:
        raise ValueError(f"staged_keys must have contiguous channels, got strides {staged_keys.stride()}")
    layout = PageLayout.of_cache(kv_cache, head_dim)
    block_size = layout.block_size
    if scheme.is_kivi and block_size != KIVI_BLOCK_SIZE:
        raise ValueError(f"int4_kivi needs block_size {KIVI_BLOCK_SIZE}, got {block_size}")
    if num_seqs == 0 or max_seq_len == 0:
        return
    tile = tile_tokens(block_size, TILE)
    grid = (num_seqs, triton.cdiv(max_seq_len, tile), num_kv_heads)
    _gather_dense_kernel[grid](
        key, value, kv_cache, kv_cache.view(torch.float16), block_table, seq_lens, query_start_loc, cu_seqlens_k,
        dense_k, dense_v, staged_keys if has_pool else key, sequence_slots if has_pool else seq_lens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), dense_k.stride(0), dense_k.stride(1),
        block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        *(staged_keys.stride()[:3] if has_pool else (0, 0, 0)),
        BLOCK_SIZE=block_size, TILE=tile, IS_KIVI=scheme.is_kivi, HAS_POOL=has_pool,
        HADAMARD_BLOCK=scheme.hadamard_block_for(head_dim), ROTATE_V=scheme.rotate_values, HALF=layout.half_dim,
    )
