"""Gather the K/V of prefill sequences from the int4 cache into dense bf16/fp16 pages for FlashAttention (Triton).

Prefill is compute-bound: FlashAttention on tensor cores beats any int4-reading kernel there, so the backend runs a
prefill chunk through FA over the sequence's K/V dequantized from the cache (the store has run: every token of the
sequence is there, this step's included), as 128-token pages ``dense[page, token, kv_head, :]`` that FA reads
through a block table (sequence i's page p at ``cu_pages[i] + p``). Values and int4_saw keys are each token's
per-token dequantization (un-rotated). int4_kivi keys are read under the rule of docs/kernel-api.md in one causal FA
pass over segments (kernels/prefill_plan.py), and one launch writes what each segment reads: every block before a
sequence's last per channel (what queries of later blocks see), and the blocks the chunk touches with their
original keys (the step's ``new_keys`` rows and the staging pool's rows for the earlier tokens of the block the step
starts in), what the queries of each block see of it: the last block in its own page, every earlier one in an own
page after the sequence's pages, with its values beside them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import KIVI_BLOCK_SIZE, PageLayout, cdiv, tile_tokens
from .scheme import Int4Scheme
from .staging import check_new_keys, check_pool_read
from .triton_common import load_channel_params, load_token_params, rotate_halves_fp32

TILE = 64


@triton.jit
def _keys_per_channel(k_lo, k_hi, k_params, HALF: tl.constexpr):
    s_lo, m_lo, s_hi, m_hi = load_channel_params(k_params, HALF, False)
    return k_lo * s_lo + m_lo, k_hi * s_hi + m_hi


@triton.jit
def _keys_per_token(k_lo, k_hi, k_params, offset, written, HADAMARD_BLOCK: tl.constexpr,
                    HALF: tl.constexpr):
    """Per-token dequantization, then back from the rotated space (R is its own inverse)."""
    s_t, m_t = load_token_params(k_params, offset, written, False)
    return rotate_halves_fp32(k_lo * s_t[:, None] + m_t[:, None], k_hi * s_t[:, None] + m_t[:, None], HADAMARD_BLOCK,
                              HALF)


# The backend passes metadata sliced past the decodes (seq_lens[nd:], ...): their addresses must not pick kernel
# variants (a JIT stall while serving); they are read with scalar loads.
@triton.jit(do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "cu_pages_ptr", "query_start_loc_ptr",
                                            "sequence_slots_ptr"])
def _gather_dense_kernel(
    cache_u8_ptr, block_table_ptr, seq_lens_ptr, cu_pages_ptr, dense_k_ptr, dense_v_ptr,
    new_keys_ptr, staged_keys_ptr, sequence_slots_ptr, query_start_loc_ptr,
    dense_stride_page, dense_stride_t, dense_stride_h, block_table_stride, stride_block, stride_head,
    new_keys_stride_t, new_keys_stride_h, pool_stride_slot, pool_stride_head, pool_stride_token,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IS_KIVI: tl.constexpr, HADAMARD_BLOCK: tl.constexpr,
    ROTATE_V: tl.constexpr, HALF: tl.constexpr,
):
    """Program (sequence, tile of its pages, head): the tile's values, and its keys per token (int4_saw) or, for
    int4_kivi, per channel (a block before the last: what later segments read) or as the originals (the last
    block, its queries' own); a block before the last that the chunk touches also gets an own page of its original
    keys and its values (kernels/prefill_plan.py)."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if tile * TILE // BLOCK_SIZE * BLOCK_SIZE < seq_len:  # every tile of the sequence's pages, its last one's too
        pos = tile * TILE + tl.arange(0, TILE)
        written = pos < seq_len
        ch = tl.arange(0, HALF)
        logical_block = tile * TILE // BLOCK_SIZE
        physical = tl.load(block_table_ptr + seq * block_table_stride + logical_block).to(tl.int64)
        page_ptr = cache_u8_ptr + (physical * stride_block + head * stride_head)
        offset = (tile * TILE) % BLOCK_SIZE + tl.arange(0, TILE)

        v_bytes = tl.load(page_ptr + HALF * BLOCK_SIZE + offset[:, None] + ch[None, :] * BLOCK_SIZE,
                          mask=written[:, None], other=0)  # channel-major (layout.py)
        s_v, m_v = load_token_params((page_ptr + 2 * HALF * BLOCK_SIZE).to(tl.pointer_type(tl.float16)), offset,
                                     written, False)
        v_lo = (v_bytes & 15).to(tl.float32) * s_v[:, None] + m_v[:, None]
        v_hi = (v_bytes >> 4).to(tl.float32) * s_v[:, None] + m_v[:, None]
        if ROTATE_V:
            v_lo, v_hi = rotate_halves_fp32(v_lo, v_hi, HADAMARD_BLOCK, HALF)

        # rows past the sequence's end are written as 0: FA masks them, and 0 * garbage could be NaN
        live = written[:, None]
        seq_page = tl.load(cu_pages_ptr + seq)
        rows = offset[:, None] * dense_stride_t + head * dense_stride_h + ch[None, :]
        dense = (seq_page + logical_block).to(tl.int64) * dense_stride_page + rows
        out_dtype = dense_k_ptr.dtype.element_ty
        v_lo = tl.where(live, v_lo, 0.0).to(out_dtype)
        v_hi = tl.where(live, v_hi, 0.0).to(out_dtype)
        tl.store(dense_v_ptr + dense, v_lo)
        tl.store(dense_v_ptr + dense + HALF, v_hi)

        k_params = (page_ptr + (2 * HALF + 4) * BLOCK_SIZE).to(tl.pointer_type(tl.float16))  # layout.py: (D + 4) * B
        if IS_KIVI:
            q_start = tl.load(query_start_loc_ptr + seq)
            context = seq_len - (tl.load(query_start_loc_ptr + seq + 1) - q_start)
            first = context // BLOCK_SIZE
            last = (seq_len - 1) // BLOCK_SIZE
            if logical_block != last:  # a full block, closed: per channel, what later segments read
                k_bytes = tl.load(page_ptr + offset[:, None] * HALF + ch[None, :])
                k_lo, k_hi = _keys_per_channel((k_bytes & 15).to(tl.float32), (k_bytes >> 4).to(tl.float32),
                                               k_params, HALF)
                tl.store(dense_k_ptr + dense, k_lo.to(out_dtype))
                tl.store(dense_k_ptr + dense + HALF, k_hi.to(out_dtype))
            if logical_block >= first:  # touched by the chunk: its original keys in its own page
                # the last block's own page is its page; an earlier block's follows the sequence's pages
                own_page = tl.where(logical_block == last, seq_page + logical_block,
                                    seq_page + last + 1 + logical_block - first)
                own = own_page.to(tl.int64) * dense_stride_page + rows
                o_lo, o_hi = _original_keys(new_keys_ptr, staged_keys_ptr, sequence_slots_ptr, seq, head, pos,
                                            offset, context, seq_len, q_start, new_keys_stride_t, new_keys_stride_h,
                                            pool_stride_slot, pool_stride_head, pool_stride_token, HALF)
                tl.store(dense_k_ptr + own, o_lo.to(out_dtype))
                tl.store(dense_k_ptr + own + HALF, o_hi.to(out_dtype))
                if logical_block != last:
                    tl.store(dense_v_ptr + own, v_lo)
                    tl.store(dense_v_ptr + own + HALF, v_hi)
        else:
            k_bytes = tl.load(page_ptr + offset[:, None] * HALF + ch[None, :], mask=live, other=0)
            k_lo, k_hi = _keys_per_token((k_bytes & 15).to(tl.float32), (k_bytes >> 4).to(tl.float32), k_params,
                                         offset, written, HADAMARD_BLOCK, HALF)
            tl.store(dense_k_ptr + dense, tl.where(live, k_lo, 0.0).to(out_dtype))
            tl.store(dense_k_ptr + dense + HALF, tl.where(live, k_hi, 0.0).to(out_dtype))


@triton.jit
def _original_keys(new_keys_ptr, staged_keys_ptr, sequence_slots_ptr, seq, head, pos, offset, context, seq_len,
                   q_start, new_keys_stride_t, new_keys_stride_h, pool_stride_slot, pool_stride_head,
                   pool_stride_token, HALF: tl.constexpr):
    """int4_kivi's original keys at positions ``pos`` (one block, from the chunk's block on): the step's rows
    ``new_keys[q_start + pos - context]`` from the chunk's start, the staging pool's rows of the sequence's slot
    before it, NaN where a pool row is needed and the slot is -1, 0 past the sequence's end; fp32 halves."""
    ch = tl.arange(0, HALF)
    fresh = ((pos >= context) & (pos < seq_len))[:, None]
    staged = (pos < context)[:, None]
    slot = tl.load(sequence_slots_ptr + seq)
    from_pool = staged & (slot >= 0)
    new_rows = (new_keys_ptr + (q_start + pos - context).to(tl.int64)[:, None] * new_keys_stride_t
                + head * new_keys_stride_h + ch[None, :])
    pool_rows = (staged_keys_ptr + slot.to(tl.int64) * pool_stride_slot + head * pool_stride_head
                 + offset[:, None] * pool_stride_token + ch[None, :])
    k_lo = tl.where(fresh, tl.load(new_rows, mask=fresh, other=0.0), tl.load(pool_rows, mask=from_pool, other=0.0))
    k_hi = tl.where(fresh, tl.load(new_rows + HALF, mask=fresh, other=0.0),
                    tl.load(pool_rows + HALF, mask=from_pool, other=0.0))
    missing = staged & (slot < 0)
    return tl.where(missing, float("nan"), k_lo.to(tl.float32)), tl.where(missing, float("nan"), k_hi.to(tl.float32))


def _check_pages(dense_k: torch.Tensor, dense_v: torch.Tensor, block_size: int, num_kv_heads: int,
                 head_dim: int) -> None:
    """Both page buffers [pages, block_size, Hkv, head_dim] with contiguous channels and one layout: the kernels
    address both with dense_k's strides."""
    pages_of = (block_size, num_kv_heads, head_dim)
    if dense_k.dim() != 4 or tuple(dense_k.shape[1:]) != pages_of or dense_k.stride(-1) != 1:
        raise ValueError(f"dense pages must be [pages, {block_size}, {num_kv_heads}, {head_dim}] with contiguous "
                         f"channels, got {tuple(dense_k.shape)} strides {dense_k.stride()}")
    if dense_v.shape != dense_k.shape or dense_v.stride() != dense_k.stride():
        raise ValueError(f"dense_k and dense_v must have one shape and layout, got {tuple(dense_k.shape)} strides "
                         f"{dense_k.stride()} and {tuple(dense_v.shape)} strides {dense_v.stride()}")


def gather_dense_kv(kv_cache, block_table, seq_lens, cu_pages, max_seq_len: int, scheme: Int4Scheme, dense_k,
                    dense_v, head_dim: int, new_keys=None, staged_keys=None, sequence_slots=None,
                    query_start_loc=None) -> None:
    """Write every token of every sequence, K and V, into the dense pages dense_k/dense_v [pages, block_size, Hkv,
    head_dim] (FlashAttention's paged layout), sequence i's page p at ``cu_pages[i] + p``, dequantized from the int4
    cache (the store has run). Rows past a sequence's end are 0.

    int4_kivi (kernels/prefill_plan.py, and its cu_pages) also takes what its queries read their own block from, as
    attention.paged_attention does: ``new_keys`` [>= T, Hkv, D] (the step's keys, rows at ``query_start_loc``), the
    staging pool ``staged_keys`` at ``sequence_slots`` (the slot of the block each sequence's chunk starts in). Its
    blocks before the last are written per channel (closed: what the queries of later blocks read); the last block
    holds its original keys; every earlier block the chunk touches gets an own page of its original keys, with its
    values, at ``cu_pages[i] + cdiv(seq_len, 128) + b - first block``. The originals: the step's rows from the
    chunk's start, the pool's before it (NaN where such a row is needed and the slot is -1). int4_saw takes none of
    them."""
    num_seqs = seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[1]
    layout = PageLayout.of_cache(kv_cache, head_dim)
    block_size = layout.block_size
    check_pool_read(staged_keys, sequence_slots, num_seqs, num_kv_heads, head_dim, scheme)
    if scheme.is_kivi:
        if block_size != KIVI_BLOCK_SIZE:
            raise ValueError(f"int4_kivi needs block_size {KIVI_BLOCK_SIZE}, got {block_size}")
        check_new_keys(new_keys, 0, num_kv_heads, head_dim, staged_keys.dtype)
        if staged_keys.stride(-1) != 1:
            raise ValueError(f"staged_keys must have contiguous channels, got strides {staged_keys.stride()}")
        if query_start_loc is None or query_start_loc.shape[0] < num_seqs + 1:
            raise ValueError(f"int4_kivi needs query_start_loc [>= {num_seqs + 1}]: where each chunk starts")
        own = (new_keys, staged_keys, sequence_slots, query_start_loc,
               *new_keys.stride()[:2], *staged_keys.stride()[:3])
    else:
        if new_keys is not None or query_start_loc is not None:
            raise ValueError(f"{scheme.name} takes no new_keys or query_start_loc: only int4_kivi reads originals")
        own = (dense_k, dense_k, seq_lens, seq_lens, 0, 0, 0, 0, 0)  # unread
    _check_pages(dense_k, dense_v, block_size, num_kv_heads, head_dim)
    if num_seqs == 0 or max_seq_len == 0:
        return
    tile = tile_tokens(block_size, TILE)
    grid = (num_seqs, cdiv(max_seq_len, block_size) * block_size // tile, num_kv_heads)
    _gather_dense_kernel[grid](
        kv_cache, block_table, seq_lens, cu_pages, dense_k, dense_v, *own[:4],
        *dense_k.stride()[:3], block_table.stride()[0], *kv_cache.stride()[:2], *own[4:],
        BLOCK_SIZE=block_size, TILE=tile, IS_KIVI=scheme.is_kivi, HADAMARD_BLOCK=scheme.hadamard_block_for(head_dim),
        ROTATE_V=scheme.rotate_values, HALF=layout.half_dim,
    )
