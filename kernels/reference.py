"""Plain torch reference of both int4 page formats and of paged attention over them.

Written for clarity, not speed: it is the oracle for every kernel test and the attention path of the
CPU engine. Semantics (shared with the Triton kernels in store.py and attention.py):

* asymmetric int4: ``scale = max((max - min) / 15, EPS)``; scale and min are rounded to fp16 *before* the
  codes are computed, ``code = clamp(floor((x - min) / scale + 0.5), 0, 15)``, ``x_hat = code * scale + min``;
* a vector holding NaN or +-inf (or whose scale/min overflow fp16) gets a NaN scale: it dequantizes to NaN,
  so a broken input shows up in the attention output instead of turning into plausible numbers;
* int4_saw: keys (and values if ``rotate_values``) are quantized per token after ``x @ R``, ``R`` the
  block-diagonal Hadamard; attention un-rotates implicitly (R is orthonormal);
* int4_kivi: values per token, unrotated. Keys of an open (partially filled) block are staged per token after
  the full-head rotation, and their originals kept in the staging pool (kernels/staging.py, required): every block
  is quantized per channel from its 128 original keys when its last slot is written;
* attention (the read rule, docs/format.md): values and int4_saw keys are dequantized from the cache as stored,
  for every key including the step's own. int4_kivi keys of blocks before the query's own block are read per
  channel from the cache; keys of the query's own block are the original keys: the step's own ``new_keys`` for
  its tokens, the staging pool's row for the block's tokens written by earlier steps.
"""

from __future__ import annotations

import torch

from .layout import KIVI_BLOCK_SIZE, PageLayout, cdiv
from .scheme import Int4Scheme
from .staging import (STAGE_AFTER_CLOSE, STAGE_IN_STORE, check_pool_given, check_pool_read, check_stage,
                      check_staging)

QMAX = 15
EPS = 2.0**-14  # smallest normal fp16: a constant vector keeps a representable, positive scale


# ---------------------------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------------------------
def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.float()
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    scale = torch.clamp((hi - lo) / QMAX, min=EPS).half().float()
    minimum = lo.half().float()
    bad = ~(torch.isfinite(x).all(dim, keepdim=True) & torch.isfinite(scale) & torch.isfinite(minimum))
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    codes = torch.floor((x - minimum) / scale + 0.5).nan_to_num(0.0).clamp(0, QMAX).to(torch.uint8)
    return codes, scale.squeeze(dim).half(), minimum.squeeze(dim).half()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x[..., D] -> codes uint8[..., D] (0..15), scale fp16[...], min fp16[...]."""
    return _quantize(x, -1)


def quantize_per_channel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x[tokens, D] -> codes uint8[tokens, D], scale fp16[D], min fp16[D] (one group of tokens)."""
    return _quantize(x, 0)


def dequantize_per_token(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[..., None] + minimum.float()[..., None]


def dequantize_per_channel(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + minimum.float()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes[..., D] -> bytes[..., D/2]: byte j = channel j (low nibble) | channel j + D/2 (high nibble)."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# page views
# ---------------------------------------------------------------------------------------------------------------
class PageViews:
    """Typed views into a uint8 cache [num_blocks, num_kv_heads, block_size * (head_dim + 8)] of head_dim-wide
    heads; writes go to the cache."""

    def __init__(self, kv_cache: torch.Tensor, head_dim: int):
        if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3:
            raise ValueError(
                f"kv_cache must be uint8 [blocks, kv_heads, page_bytes], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
        lay = PageLayout.of_cache(kv_cache, head_dim)
        nb, nh, _ = kv_cache.shape
        b = self.block_size = lay.block_size
        self.head_dim = head_dim
        half = lay.half_dim
        self.k_codes = kv_cache[:, :, lay.k_codes : lay.v_codes].view(nb, nh, b, half)
        # channel-major in memory; the view is [block, head, token, byte] like k_codes
        self.v_codes = kv_cache[:, :, lay.v_codes : lay.v_params].view(nb, nh, half, b).transpose(2, 3)
        self.v_params = kv_cache[:, :, lay.v_params : lay.k_params].view(torch.float16).view(nb, nh, b, 2)
        self.k_params = kv_cache[:, :, lay.k_params : lay.page_bytes].view(torch.float16).view(nb, nh, b, 2)


# ---------------------------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------------------------
def store_kv(key, value, kv_cache, slot_mapping, scheme: Int4Scheme, staged_keys=None, staging_slots=None,
             stage: str = STAGE_AFTER_CLOSE) -> None:
    """Quantize key/value [T, Hkv, D] into their slots; slot < 0 marks padding and is skipped.

    int4_kivi with ``staged_keys`` (the layer's staging pool, kernels/staging.py) and ``staging_slots`` (per token,
    the pool slot of its block): every block whose last slot this batch writes is closed per channel from its
    original keys, the earlier ones read back from the pool, and the keys of blocks still open afterwards are
    copied into it: after the closes ("after_close"), before them ("in_store": the same bytes iff
    staging_overwrites_reads is False for the batch), or not at all ("by_caller": the engine then calls
    stage_open_keys after attention, which still reads the earlier keys of the block a step starts in from the
    slot that block's successor is staged into). int4_kivi requires the pool, int4_saw takes neither.
    """
    head_dim = key.shape[-1]
    pages = PageViews(kv_cache, head_dim)
    bsz = pages.block_size
    if scheme.is_kivi and bsz != KIVI_BLOCK_SIZE:
        raise ValueError(f"int4_kivi needs block_size {KIVI_BLOCK_SIZE}, got {bsz}")
    check_pool_given(scheme, staged_keys, staging_slots, "staging_slots")
    check_stage(stage)
    if scheme.is_kivi:
        check_staging(staged_keys, staging_slots, key, bsz)
    rot = scheme.rotation(head_dim, key.device)
    slots = slot_mapping.long()
    live = (slots >= 0).nonzero().squeeze(1)
    blk, off = slots[live] // bsz, slots[live] % bsz
    k = key[live].float() @ rot
    v = value[live].float()
    if scheme.rotate_values:
        v = v @ rot
    for x, codes_view, params_view in ((k, pages.k_codes, pages.k_params), (v, pages.v_codes, pages.v_params)):
        codes, scale, minimum = quantize_per_token(x)
        codes_view[blk, :, off] = pack_nibbles(codes)
        params_view[blk, :, off] = torch.stack([scale, minimum], -1)
    if not scheme.is_kivi:
        return
    if stage == STAGE_IN_STORE:
        stage_open_keys(key, slot_mapping, staged_keys, staging_slots)
    staging_slots = staging_slots.long()
    for i in closing_rows(slots, bsz).tolist():
        fresh = rows_in_batch(slots, i, bsz)
        src = torch.arange(i - bsz + 1, i + 1, device=slots.device).clamp(min=0)
        staged = fresh.logical_not().any()
        if staged and staging_slots[i] < 0:
            raise ValueError(f"token {i} closes a block begun in an earlier batch but has no staging slot")
        originals = key[src]
        if staged:
            originals = torch.where(fresh[:, None, None], originals, staged_keys[staging_slots[i]].transpose(0, 1))
        _write_per_channel(pages, int(slots[i]) // bsz, originals)
    if stage == STAGE_AFTER_CLOSE:
        stage_open_keys(key, slot_mapping, staged_keys, staging_slots)


def stage_open_keys(key, slot_mapping, staged_keys, staging_slots) -> None:
    """Copy the original keys of the tokens whose block stays open after this batch into their staging slot."""
    bsz = staged_keys.shape[2]
    check_staging(staged_keys, staging_slots, key, bsz)
    slots = slot_mapping.long()
    live = (slots >= 0).nonzero().squeeze(1)
    stays_open = live[~closes_in_batch(slots, live, bsz)]
    pool_slots = staging_slots.long()[stays_open]
    if (pool_slots < 0).any():
        raise ValueError("a token of a block that stays open has no staging slot")
    staged_keys[pool_slots, :, slots[stays_open] % bsz] = key[stays_open].to(staged_keys.dtype)


def closing_rows(slots: torch.Tensor, bsz: int) -> torch.Tensor:
    """Rows of the batch that write their block's last slot."""
    return ((slots % bsz == bsz - 1) & (slots >= 0)).nonzero().squeeze(1)


def rows_in_batch(slots: torch.Tensor, i: int, bsz: int) -> torch.Tensor:
    """bool [bsz]: which of the block's slots the batch writes itself, for row i writing its last slot. A
    sequence's rows are contiguous with consecutive slots, so slot o of the block is row i - (bsz - 1) + o."""
    src = torch.arange(i - bsz + 1, i + 1, device=slots.device)
    expected = slots[i] - (bsz - 1) + torch.arange(bsz, device=slots.device)
    return (src >= 0) & (slots[src.clamp(min=0)] == expected)


def closes_in_batch(slots: torch.Tensor, rows: torch.Tensor, bsz: int) -> torch.Tensor:
    """bool per row of ``rows``: the batch also writes the last slot of the row's block (the row bsz - 1 - offset
    further on holds it)."""
    last = rows + (bsz - 1) - slots[rows] % bsz
    inside = last < slots.shape[0]
    return inside & (slots[last.clamp(max=slots.shape[0] - 1)] == slots[rows] - slots[rows] % bsz + bsz - 1)


def _write_per_channel(pages: PageViews, blk: int, originals: torch.Tensor) -> None:
    """Quantize a block's 128 original keys [B, Hkv, D] per channel into its K codes and K params."""
    head_dim = originals.shape[-1]
    for h in range(originals.shape[1]):
        codes, scale, minimum = quantize_per_channel(originals[:, h].float())
        pages.k_codes[blk, h] = pack_nibbles(codes)
        # below head_dim 128 the channels' params fill the first head_dim entries and the rest is cleared, so the
        # closed block's bytes depend on its keys alone
        pages.k_params[blk, h] = 0
        pages.k_params[blk, h, :head_dim] = torch.stack([scale, minimum], -1)


# ---------------------------------------------------------------------------------------------------------------
# read + attention
# ---------------------------------------------------------------------------------------------------------------
def dequantize_sequence(kv_cache, block_table_row, seq_len: int, scheme: Int4Scheme, head_dim: int):
    """The first seq_len keys and values of one sequence as stored, [seq_len, Hkv, head_dim] float32, in the
    original space (an open int4_kivi block's per-token codes: paged_attention reads its originals instead)."""
    pages = PageViews(kv_cache, head_dim)
    bsz = pages.block_size
    rot = scheme.rotation(head_dim, kv_cache.device)
    nblocks = cdiv(seq_len, bsz)
    blocks = block_table_row[:nblocks].long()
    k_codes = unpack_nibbles(pages.k_codes[blocks])  # [n, Hkv, B, D]
    kp = pages.k_params[blocks]
    k = dequantize_per_token(k_codes, kp[..., 0], kp[..., 1]) @ rot
    if scheme.is_kivi:  # full blocks are closed, per channel
        closed = torch.arange(nblocks, device=kv_cache.device) * bsz + bsz <= seq_len
        per_channel = dequantize_per_channel(k_codes, kp[..., None, :head_dim, 0], kp[..., None, :head_dim, 1])
        k = torch.where(closed[:, None, None, None], per_channel, k)
    vp = pages.v_params[blocks]
    v = dequantize_per_token(unpack_nibbles(pages.v_codes[blocks]), vp[..., 0], vp[..., 1])
    if scheme.rotate_values:
        v = v @ rot

    def tokens_first(x):
        return x.transpose(1, 2).reshape(nblocks * bsz, -1, head_dim)[:seq_len]

    return tokens_first(k), tokens_first(v)


def paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, scheme: Int4Scheme,
                    staged_keys=None, sequence_slots=None, new_keys=None):
    """Causal attention of query [T, Hq, D] over the paged int4 cache, after the step's store; returns float32
    [T, Hq, D].

    int4_kivi needs the step's keys ``new_keys`` [>= T, Hkv, D] (the rows the store got) and its staging pool:
    ``staged_keys`` [slots, Hkv, 128, D] and ``sequence_slots`` int32 [num_seqs], the pool slot of the block each
    sequence's step starts in (read only where the step starts inside a block, -1 for none). A query sees the keys
    of its own block as the originals, every earlier block per channel from the cache (the module docstring); one
    that needs a pool row of a sequence without a slot gets NaN."""
    check_pool_read(staged_keys, sequence_slots, seq_lens.shape[0], kv_cache.shape[1], query.shape[-1], scheme)
    if scheme.is_kivi:
        check_kivi_read(new_keys, query, kv_cache.shape[1])
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    num_kv_heads = kv_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]].float()
        q_len = q.shape[0]
        if q_len == 0:
            continue
        k, v = dequantize_sequence(kv_cache, block_table[i], seq_len, scheme, query.shape[-1])
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1)) * softmax_scale
        chunk_start = seq_len - q_len
        q_pos = torch.arange(chunk_start, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        if scheme.is_kivi:
            # the own-block keys from the first block the step touches on; a query takes them only in its own block
            own_start = chunk_start // KIVI_BLOCK_SIZE * KIVI_BLOCK_SIZE
            own = own_block_keys(new_keys[starts[i] : starts[i + 1]], staged_keys, int(sequence_slots[i]),
                                 chunk_start)
            own_scores = torch.einsum("qhd,khd->hqk", q, own.repeat_interleave(group, dim=1)) * softmax_scale
            same_block = k_pos[None, own_start:] // KIVI_BLOCK_SIZE == q_pos[:, None] // KIVI_BLOCK_SIZE
            scores[..., own_start:] = torch.where(same_block, own_scores, scores[..., own_start:])
        causal = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[starts[i] : starts[i + 1]] = weighted_values(scores.softmax(-1), v.repeat_interleave(group, dim=1), causal)
    return out


def own_block_keys(step_keys: torch.Tensor, staged_keys: torch.Tensor, slot: int, chunk_start: int) -> torch.Tensor:
    """int4_kivi's original keys [chunk_start // 128 * 128 .. seq_len), float32: the rows of the block the step
    starts in that earlier steps wrote, from pool slot ``slot`` (NaN without a slot), then the step's own keys."""
    earlier = chunk_start % KIVI_BLOCK_SIZE
    if slot >= 0:
        pool_rows = staged_keys[slot, :, :earlier].transpose(0, 1).float()
    else:
        pool_rows = torch.full((earlier, *step_keys.shape[1:]), float("nan"), device=step_keys.device)
    return torch.cat([pool_rows, step_keys.float()])


def check_kivi_read(new_keys, query: torch.Tensor, num_kv_heads: int) -> None:
    """int4_kivi attention reads the query's own block from the original keys: the step's (the pool's are checked
    by check_pool_read)."""
    if new_keys is None:
        raise ValueError("int4_kivi attention needs the step's keys (new_keys): a query reads its own block's "
                         "original keys")
    expected = (num_kv_heads, query.shape[-1])
    if new_keys.dim() != 3 or tuple(new_keys.shape[1:]) != expected or new_keys.shape[0] < query.shape[0]:
        raise ValueError(f"new_keys must be [>= {query.shape[0]} tokens, {expected[0]}, {expected[1]}] (the step's "
                         f"keys), got {tuple(new_keys.shape)}")


def weighted_values(probs: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """probs [H, q, k] @ v [k, H, 128] -> [q, H, 128], where a value row holding NaN or inf makes the output of
    exactly the queries that see it (``visible`` [q, k]) NaN. A plain product would also poison the queries that
    cannot see it, whose probability is 0: 0 * NaN is NaN."""
    broken = ~torch.isfinite(v).all(-1)  # [k, H]
    out = torch.einsum("hqk,khd->qhd", probs, v.masked_fill(broken[..., None], 0.0))
    poisoned = (visible.to(v.dtype) @ broken.to(v.dtype)) > 0  # [q, H]
    return out.masked_fill(poisoned[..., None], float("nan"))
