"""Quantize-on-write: new K/V tokens into their slots of the paged int4 cache (Triton).

``store_kv`` stores keys and values per token in one launch (rotation fused for int4_saw keys, optional for its
values, and for the staged keys of an open int4_kivi block); for int4_kivi a second launch then closes every block
whose last slot was written in this batch, per channel from the original keys: the batch's own rows and the staging
pool's rows (staging.py, required) for the slots earlier batches wrote. The keys of blocks still open go into the
pool (``stage``, staging.py): by a third launch after the close, which may read the same slot; or inside the store's
launch, for a batch whose staging overwrites no pool row the batch reads; or later by the caller
(``stage_open_keys``). Launches follow each other on one stream. Grids depend only on the number of tokens and KV
heads, except a close over the closing rows the caller lists (``close_rows``: eager steps, whose caller knows them
on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import KIVI_BLOCK_SIZE, PageLayout, cdiv
from .scheme import Int4Scheme
from .staging import STAGE_AFTER_CLOSE, STAGE_IN_STORE, check_pool_given, check_stage, check_staging
from .triton_common import encode, finite_rows, rotate_halves, scale_and_min

TOKENS_PER_PROGRAM = 16


# num_tokens and the metadata's addresses vary per step: no kernel variant per value (a JIT stall while serving)
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr", "staging_slot_ptr"])
def _store_per_token_kernel(
    key_ptr, value_ptr, slot_ptr, cache_u8_ptr, cache_f16_ptr, staged_ptr, staging_slot_ptr,
    num_tokens, key_stride_t, key_stride_h, value_stride_t, value_stride_h, stride_block, stride_head,
    staged_stride_slot, staged_stride_head,
    K_CODES_OFFSET: tl.constexpr, K_PARAMS_OFFSET: tl.constexpr, V_CODES_OFFSET: tl.constexpr,
    V_PARAMS_OFFSET: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROTATE_VALUES: tl.constexpr,
    HADAMARD_BLOCK: tl.constexpr, TOKENS: tl.constexpr, HALF: tl.constexpr, STAGE: tl.constexpr,
):
    """Program (token tile, head): the tile's keys (rotated, codes token-major) and values (rotated iff
    ROTATE_VALUES, codes channel-major) per token into their slots; if STAGE (int4_kivi), also the original keys
    of the tokens whose block stays open after this batch into their staging slot (_stage_rows)."""
    head = tl.program_id(1)
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0
    ch = tl.arange(0, HALF)
    block = tl.where(live, slot // BLOCK_SIZE, 0)
    offset = tl.where(live, slot % BLOCK_SIZE, 0)
    page = block * stride_block + head * stride_head
    key = key_ptr + tok[:, None].to(tl.int64) * key_stride_t + head * key_stride_h + ch[None, :]
    k_lo = tl.load(key, mask=live[:, None], other=0.0)
    k_hi = tl.load(key + HALF, mask=live[:, None], other=0.0)
    if STAGE:
        _stage_rows(k_lo, k_hi, tok, slot, slot_ptr, staged_ptr, staging_slot_ptr, num_tokens, head,
                    staged_stride_slot, staged_stride_head, BLOCK_SIZE, HALF)
    packed, scale, minimum = _quantize_per_token(k_lo, k_hi, True, HADAMARD_BLOCK, HALF)
    tl.store(cache_u8_ptr + (page + K_CODES_OFFSET + offset * HALF)[:, None] + ch[None, :], packed,
             mask=live[:, None])
    _store_token_params(cache_f16_ptr, (page + K_PARAMS_OFFSET) // 2 + offset * 2, scale, minimum, live)
    value = value_ptr + tok[:, None].to(tl.int64) * value_stride_t + head * value_stride_h + ch[None, :]
    v_lo = tl.load(value, mask=live[:, None], other=0.0)
    v_hi = tl.load(value + HALF, mask=live[:, None], other=0.0)
    packed, scale, minimum = _quantize_per_token(v_lo, v_hi, ROTATE_VALUES, HADAMARD_BLOCK, HALF)
    # V codes are channel-major (layout.py): byte j of token t at j * BLOCK_SIZE + t
    tl.store(cache_u8_ptr + (page + V_CODES_OFFSET + offset)[:, None] + ch[None, :] * BLOCK_SIZE, packed,
             mask=live[:, None])
    _store_token_params(cache_f16_ptr, (page + V_PARAMS_OFFSET) // 2 + offset * 2, scale, minimum, live)


@triton.jit
def _quantize_per_token(x_lo, x_hi, ROTATE: tl.constexpr, HADAMARD_BLOCK: tl.constexpr, HALF: tl.constexpr):
    """Packed codes [tokens, HALF] and fp32 (scale, min) per token of the rows whose halves are ``x_lo``,
    ``x_hi``, after the block-diagonal Hadamard if ROTATE."""
    if ROTATE:
        y_lo, y_hi = rotate_halves(x_lo, x_hi, HADAMARD_BLOCK, HALF)
    else:
        y_lo, y_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    lo = tl.minimum(tl.min(y_lo, 1), tl.min(y_hi, 1))
    hi = tl.maximum(tl.max(y_lo, 1), tl.max(y_hi, 1))
    scale, minimum = scale_and_min(lo, hi, finite_rows(y_lo, y_hi))
    packed = encode(y_lo, scale[:, None], minimum[:, None]) | (encode(y_hi, scale[:, None], minimum[:, None]) << 4)
    return packed, scale, minimum


@triton.jit
def _store_token_params(cache_f16_ptr, params, scale, minimum, live):
    """(fp16 scale, fp16 min) per token at fp16 index ``params`` of the cache."""
    tl.store(cache_f16_ptr + params, scale.to(tl.float16), mask=live)
    tl.store(cache_f16_ptr + params + 1, minimum.to(tl.float16), mask=live)


# the metadata's addresses vary per step (see _store_per_token_kernel)
@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "staging_slot_ptr", "close_rows_ptr"])
def _kivi_close_kernel(
    key_ptr, slot_ptr, cache_u8_ptr, cache_f16_ptr, staged_ptr, staging_slot_ptr, close_rows_ptr,
    key_stride_t, key_stride_h, stride_block, stride_head, staged_stride_slot, staged_stride_head,
    K_PARAMS_OFFSET: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, ROWS_GIVEN: tl.constexpr,
):
    """Program (i, head) for batch row ``tok`` = i, or close_rows[i] if ROWS_GIVEN: if the row filled its block's
    last slot, quantize the block's keys per channel from the originals: this batch's rows, and the staging pool's
    rows for the slots earlier batches wrote."""
    if ROWS_GIVEN:
        tok = tl.load(close_rows_ptr + tl.program_id(0))
    else:
        tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if (slot >= 0) & (slot % BLOCK_SIZE == BLOCK_SIZE - 1):
        t = tl.arange(0, BLOCK_SIZE)
        ch = tl.arange(0, HALF)
        page = (slot // BLOCK_SIZE) * stride_block + head * stride_head
        k_params = (page + K_PARAMS_OFFSET) // 2
        # slot t of the block is in this batch iff row tok - 127 + t holds it (a sequence's rows are contiguous)
        src = tok - (BLOCK_SIZE - 1) + t
        src_slot = tl.load(slot_ptr + src, mask=src >= 0, other=-1)
        fresh = (src >= 0) & (src_slot == slot - (BLOCK_SIZE - 1) + t)
        all_fresh = tl.min(fresh.to(tl.int32), 0) == 1
        key = key_ptr + src[:, None].to(tl.int64) * key_stride_t + head * key_stride_h + ch[None, :]
        k_lo = tl.load(key, mask=fresh[:, None], other=0.0).to(tl.float32)
        k_hi = tl.load(key + HALF, mask=fresh[:, None], other=0.0).to(tl.float32)
        pool_slot = tl.load(staging_slot_ptr + tok).to(tl.int64)
        from_pool = (fresh == 0) & (pool_slot >= 0)
        staged = (staged_ptr + pool_slot * staged_stride_slot + head * staged_stride_head
                  + t[:, None] * (2 * HALF) + ch[None, :])
        k_lo = tl.where(fresh[:, None], k_lo, tl.load(staged, mask=from_pool[:, None], other=0.0).to(tl.float32))
        k_hi = tl.where(fresh[:, None], k_hi,
                        tl.load(staged + HALF, mask=from_pool[:, None], other=0.0).to(tl.float32))
        # a block begun in an earlier batch without a staging slot: NaN scales make the bug visible
        usable = (all_fresh | (pool_slot >= 0)).to(tl.int32)
        finite_lo = tl.min(((k_lo == k_lo) & (tl.abs(k_lo) != float("inf"))).to(tl.int32), 0) * usable
        finite_hi = tl.min(((k_hi == k_hi) & (tl.abs(k_hi) != float("inf"))).to(tl.int32), 0) * usable
        s_lo, m_lo = scale_and_min(tl.min(k_lo, 0), tl.max(k_lo, 0), finite_lo)
        s_hi, m_hi = scale_and_min(tl.min(k_hi, 0), tl.max(k_hi, 0), finite_hi)
        codes = encode(k_lo, s_lo[None, :], m_lo[None, :]) | (encode(k_hi, s_hi[None, :], m_hi[None, :]) << 4)
        tl.store(cache_u8_ptr + page + t[:, None] * HALF + ch[None, :], codes)
        channel_params = k_params + ch * 2
        tl.store(cache_f16_ptr + channel_params, s_lo.to(tl.float16))
        tl.store(cache_f16_ptr + channel_params + 1, m_lo.to(tl.float16))
        tl.store(cache_f16_ptr + channel_params + 2 * HALF, s_hi.to(tl.float16))
        tl.store(cache_f16_ptr + channel_params + 2 * HALF + 1, m_hi.to(tl.float16))
        if 4 * HALF < 2 * BLOCK_SIZE:  # head_dim < 128: clear the rest, so the bytes depend on the keys alone
            rest = 4 * HALF + tl.arange(0, 2 * BLOCK_SIZE - 4 * HALF)
            tl.store(cache_f16_ptr + k_params + rest, tl.zeros_like(rest).to(tl.float16))


# num_tokens and the metadata's addresses vary per step: no kernel variant per value (see _store_per_token_kernel)
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr", "staging_slot_ptr"])
def _kivi_stage_kernel(
    key_ptr, slot_ptr, staged_ptr, staging_slot_ptr, num_tokens,
    key_stride_t, key_stride_h, staged_stride_slot, staged_stride_head,
    BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr,
):
    """Program (token tile, head): the original keys of the tile's tokens whose block stays open after this batch
    into their staging slot (_stage_rows)."""
    head = tl.program_id(1)
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    ch = tl.arange(0, HALF)
    src = key_ptr + tok[:, None].to(tl.int64) * key_stride_t + head * key_stride_h + ch[None, :]
    live = slot >= 0
    _stage_rows(tl.load(src, mask=live[:, None]), tl.load(src + HALF, mask=live[:, None]), tok, slot, slot_ptr,
                staged_ptr, staging_slot_ptr, num_tokens, head, staged_stride_slot, staged_stride_head, BLOCK_SIZE,
                HALF)


@triton.jit
def _stage_rows(k_lo, k_hi, tok, slot, slot_ptr, staged_ptr, staging_slot_ptr, num_tokens, head,
                staged_stride_slot, staged_stride_head, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr):
    """The key halves ``k_lo``, ``k_hi`` of batch rows ``tok`` (int64 slots ``slot``, -1 for none) into the
    staging slot of each row whose block stays open after this batch (the batch does not write its last slot)."""
    offset = slot % BLOCK_SIZE
    last = tok + (BLOCK_SIZE - 1) - offset  # the row that would write the block's last slot in this batch
    last_slot = tl.load(slot_ptr + last, mask=(slot >= 0) & (last < num_tokens), other=-1).to(tl.int64)
    closes = last_slot == slot - offset + BLOCK_SIZE - 1
    pool_slot = tl.load(staging_slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    stage = (slot >= 0) & (closes == 0) & (pool_slot >= 0)
    ch = tl.arange(0, HALF)
    dst = (staged_ptr + pool_slot[:, None] * staged_stride_slot + head * staged_stride_head
           + offset[:, None] * (2 * HALF) + ch[None, :])
    tl.store(dst, k_lo, mask=stage[:, None])
    tl.store(dst + HALF, k_hi, mask=stage[:, None])


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             scheme: Int4Scheme, staged_keys: torch.Tensor | None = None,
             staging_slots: torch.Tensor | None = None, stage: str = STAGE_AFTER_CLOSE,
             close_rows: torch.Tensor | None = None) -> None:
    """Quantize key/value [T, Hkv, D] (fp16/bf16, any token/head strides) into kv_cache at slot_mapping.

    int4_kivi's staging pool ``staged_keys`` [slots, Hkv, 128, D] (model dtype, contiguous), ``staging_slots``
    [>= T] (the pool slot of each token's block, -1 for none) and ``stage`` as in reference.store_kv: int4_kivi
    requires the pool, int4_saw takes neither. ``stage`` (staging.py) "in_store" copies the open blocks' keys
    inside the store's launch, one launch fewer than "after_close". int4_kivi's optional ``close_rows`` (int32
    [n], on the cache's device) lists every row whose slot is its block's last (position % 128 == 127), each once:
    the close then runs one program per listed row and KV head (none for n = 0) instead of one per row, and a row
    left out leaves its block open. Without it the grid depends on T alone (a CUDA graph's replays)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"key/value must be [T, Hkv, head_dim] with contiguous channels, got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    layout = PageLayout.of_cache(kv_cache, head_dim)
    block_size = layout.block_size
    if scheme.is_kivi and block_size != KIVI_BLOCK_SIZE:
        raise ValueError(f"int4_kivi needs block_size {KIVI_BLOCK_SIZE}, got {block_size}")
    check_pool_given(scheme, staged_keys, staging_slots, "staging_slots")
    check_stage(stage)
    if scheme.is_kivi:
        check_staging(staged_keys, staging_slots, key, block_size)
        if not staged_keys.is_contiguous():
            raise ValueError("staged_keys must be contiguous")
    _check_close_rows(scheme, close_rows)
    if num_tokens == 0:
        return
    cache_f16 = kv_cache.view(torch.float16)
    in_store = scheme.is_kivi and stage == STAGE_IN_STORE
    _store_per_token_kernel[(cdiv(num_tokens, TOKENS_PER_PROGRAM), num_kv_heads)](
        key, value, slot_mapping, kv_cache, cache_f16,
        staged_keys if in_store else key, staging_slots if in_store else slot_mapping,
        num_tokens, *key.stride()[:2], *value.stride()[:2], *kv_cache.stride()[:2],
        *(staged_keys.stride()[:2] if in_store else (0, 0)),
        K_CODES_OFFSET=layout.k_codes, K_PARAMS_OFFSET=layout.k_params,
        V_CODES_OFFSET=layout.v_codes, V_PARAMS_OFFSET=layout.v_params, BLOCK_SIZE=block_size,
        ROTATE_VALUES=scheme.rotate_values, HADAMARD_BLOCK=scheme.hadamard_block_for(head_dim),
        TOKENS=TOKENS_PER_PROGRAM, HALF=layout.half_dim, STAGE=in_store,
    )
    if not scheme.is_kivi:
        return
    num_programs = num_tokens if close_rows is None else close_rows.shape[0]
    if num_programs:
        _kivi_close_kernel[(num_programs, num_kv_heads)](
            key, slot_mapping, kv_cache, cache_f16, staged_keys, staging_slots, close_rows,
            *key.stride()[:2], *kv_cache.stride()[:2], *staged_keys.stride()[:2], K_PARAMS_OFFSET=layout.k_params,
            BLOCK_SIZE=block_size, HALF=layout.half_dim,
            ROWS_GIVEN=close_rows is not None,
            # over every row most programs exit at once (their token does not close a block): 4 warps fit twice the
            # programs per SM as 8 and measured 1.4-1.8x faster on the H200 over prefill chunks and decode batches;
            # 2 lose at decode. Over listed rows 4 warps also measured fastest (an 8192-token chunk's 64 closes:
            # 12.3 us against 19.0 at 8)
            num_warps=4,
        )
    if stage == STAGE_AFTER_CLOSE:
        stage_open_keys(key, slot_mapping, staged_keys, staging_slots)


def _check_close_rows(scheme: Int4Scheme, close_rows: torch.Tensor | None) -> None:
    """close_rows, where given: int4_kivi only (int4_saw closes no block), a 1-D int32 tensor."""
    if close_rows is None:
        return
    if not scheme.is_kivi:
        raise ValueError(f"{scheme.name} takes no close_rows: only int4_kivi closes blocks")
    if close_rows.dim() != 1 or close_rows.dtype != torch.int32:
        raise ValueError(f"close_rows must be int32 [n], got {close_rows.dtype} {tuple(close_rows.shape)}")


def stage_open_keys(key: torch.Tensor, slot_mapping: torch.Tensor, staged_keys: torch.Tensor,
                    staging_slots: torch.Tensor) -> None:
    """Copy the original keys of the tokens whose block stays open after this batch into their staging slot
    (reference.stage_open_keys)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    check_staging(staged_keys, staging_slots, key, staged_keys.shape[2])
    if num_tokens == 0:
        return
    grid = (cdiv(num_tokens, TOKENS_PER_PROGRAM), num_kv_heads)
    _kivi_stage_kernel[grid](
        key, slot_mapping, staged_keys, staging_slots, num_tokens,
        *key.stride()[:2], *staged_keys.stride()[:2],
        BLOCK_SIZE=staged_keys.shape[2], HALF=head_dim // 2, TOKENS=TOKENS_PER_PROGRAM,
    )
