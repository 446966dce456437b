"""Paged attention over the int4 cache for vLLM's CPU engine: the read rule of kernels/reference.py, batched.

The reference (``reference.paged_attention``) is the oracle: one sequence at a time, every page dequantized and
un-rotated, the NaN-poison bookkeeping on every call. This module reads the same bytes the same way (docs/format.md,
the read rule) with far fewer tensor operations per layer and step, which is what a CPU step pays for:

* sequences whose step has the same query length (every decode of a step, equal prompt lengths) form one group;
  a group dequantizes its pages in one gather over its block-table rows, [G, Hkv, tokens, D];
* int4_saw keys stay rotated: scores use ``q @ R^T`` against the stored ``k R`` (R orthonormal), and with
  ``rotate_values`` the output is rotated back once, ``(p @ v R) @ R``, instead of every key and value;
* int4_kivi: the cache part holds every block per channel and a query sees it only before its own block; its own
  block's original keys (the staging pool's rows of the block the step starts in, then the step's ``new_keys``)
  form a short second part of the key axis, visible only inside the query's own block. One softmax over both parts
  reads exactly the rule's keys, each value once;
* a value row holding NaN or inf poisons exactly the queries that see it (as ``reference.weighted_values``); the
  check reads the value parameters, and the masked path runs only when one is not finite.

Torch only; float32 arithmetic like the reference.
"""

from __future__ import annotations

import torch

from .layout import KIVI_BLOCK_SIZE
from .reference import PageViews, check_kivi_read, staged_flags, unpack_nibbles
from .scheme import Int4Scheme
from .staging import check_pool_read

# Largest score tensor (float32 elements) one group computes at once: sequences beyond it run in further groups.
MAX_SCORE_ELEMENTS = 1 << 24
UNREACHABLE = 1 << 62  # the position of an own-block row past a sequence's keys: after every query


def paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, scheme: Int4Scheme,
                    staged_keys=None, sequence_slots=None, new_keys=None) -> torch.Tensor:
    """``reference.paged_attention``'s arguments and result (float32 [T, Hq, D]), computed per group of sequences
    with the same query length."""
    num_kv_heads = kv_cache.shape[1]
    check_pool_read(staged_keys, sequence_slots, seq_lens.shape[0], num_kv_heads, query.shape[-1], scheme)
    if scheme.is_kivi:
        check_kivi_read(new_keys, staged_keys, query, num_kv_heads)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    reader = _PageReader(kv_cache, scheme, query.shape[-1])
    for q_len in torch.unique(q_lens).tolist():
        if q_len == 0:
            continue
        seqs = (q_lens == q_len).nonzero().squeeze(1)
        longest = int(seq_lens[seqs].max())
        cost = query.shape[1] * q_len * (longest + 2 * KIVI_BLOCK_SIZE + q_len)
        step = max(1, MAX_SCORE_ELEMENTS // cost)
        for part in seqs.split(step):
            _attend_group(query, out, reader, block_table, seq_lens, query_start_loc, softmax_scale, part, q_len,
                          staged_keys, sequence_slots, new_keys)
    return out


class _PageReader:
    """Dequantizes the pages of a group of sequences from one layer's cache, [G, Hkv, blocks * 128, D] float32:
    int4_kivi keys per channel (a closed block flagged as staged, written without a pool, per token), int4_saw keys
    per token still rotated, values per token (rotated where ``rotate_values``). Value parameters of tokens past a
    sequence's length are zeroed, so those rows are 0, not whatever the page held."""

    def __init__(self, kv_cache: torch.Tensor, scheme: Int4Scheme, head_dim: int):
        self.pages = PageViews(kv_cache, head_dim)
        self.scheme = scheme
        self.head_dim = head_dim
        self.rotation = scheme.rotation(head_dim, kv_cache.device)

    def read(self, blocks: torch.Tensor, full_blocks: torch.Tensor, valid_tokens: torch.Tensor):
        """``blocks`` [G, n] page ids, ``full_blocks`` [G, n] bool (all 128 tokens stored), ``valid_tokens``
        [G, n * 128] bool. Returns keys, values [G, Hkv, n * 128, D] and the value params [G, Hkv, n * 128, 2]."""
        p, d = self.pages, self.head_dim
        g, n = blocks.shape
        heads = p.k_codes.shape[1]
        # [G, Hkv, n, 128, D]: codes unpacked after moving heads first, so the unpacked tensor is laid out as used
        k_codes = unpack_nibbles(p.k_codes[blocks].transpose(1, 2)).float()
        raw_k_params = p.k_params[blocks].transpose(1, 2)  # [G, Hkv, n, 128, 2] fp16
        k_params = raw_k_params.float()
        if self.scheme.is_kivi:
            # a closed block's params are per channel: (scale, min) of channel c at entry c
            keys = k_codes * k_params[..., None, :d, 0] + k_params[..., None, :d, 1]
            flagged = staged_flags(raw_k_params) & full_blocks[:, None]  # [G, Hkv, n]
            if flagged.any():
                staged = (k_codes * k_params[..., :1].abs() + k_params[..., 1:]) @ self.rotation
                keys = torch.where(flagged[..., None, None], staged, keys)
        else:
            keys = k_codes * k_params[..., :1].abs() + k_params[..., 1:]  # abs: the staged flag's sign bit
        v_params = p.v_params[blocks].transpose(1, 2).reshape(g, heads, n * KIVI_BLOCK_SIZE, 2).float()
        v_params = v_params.masked_fill(~valid_tokens[:, None, :, None], 0.0)
        v_codes = unpack_nibbles(p.v_codes[blocks].transpose(1, 2)).float().view(g, heads, n * KIVI_BLOCK_SIZE, d)
        values = v_codes * v_params[..., :1] + v_params[..., 1:]
        return keys.reshape(g, heads, n * KIVI_BLOCK_SIZE, d), values, v_params


def _attend_group(query, out, reader: _PageReader, block_table, seq_lens, query_start_loc, softmax_scale,
                  seqs: torch.Tensor, q_len: int, staged_keys, sequence_slots, new_keys) -> None:
    """Attention of the sequences ``seqs``, each with ``q_len`` query tokens, into their rows of ``out``."""
    scheme, bsz, device = reader.scheme, KIVI_BLOCK_SIZE, query.device
    num_kv_heads = reader.pages.k_codes.shape[1]
    g, head_dim = seqs.shape[0], query.shape[-1]
    group = query.shape[1] // num_kv_heads
    lens = seq_lens[seqs].long()
    chunk_start = lens - q_len
    n = -(-int(lens.max()) // bsz)
    block_index = torch.arange(n, device=device)
    used = block_index < (-(-lens // bsz))[:, None]
    blocks = torch.where(used, block_table[seqs, :n].long(), 0)
    k_pos = torch.arange(n * bsz, device=device)
    keys, values, v_params = reader.read(blocks, (block_index + 1) * bsz <= lens[:, None], k_pos < lens[:, None])

    rows = query_start_loc[seqs].long()[:, None] + torch.arange(q_len, device=device)  # [G, q_len]
    q = query[rows].float()  # [G, q_len, Hq, D]
    if not scheme.is_kivi:
        q = q @ reader.rotation.T  # scores against the rotated keys: (q R^T) . (k R) = q . k
    q = q.view(g, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, -1, head_dim)
    q_pos = (chunk_start[:, None] + torch.arange(q_len, device=device))[:, :, None]  # [G, q_len, 1]
    if scheme.is_kivi:
        visible = k_pos < q_pos // bsz * bsz  # the cache part: the blocks before the query's own, per channel
        own_keys, own_pos = _own_block_keys(new_keys, staged_keys, sequence_slots[seqs], rows, chunk_start, q_len)
        own_visible = (own_pos[:, None, :] <= q_pos) & (own_pos[:, None, :] // bsz == q_pos // bsz)
        own_values = values.gather(2, own_pos.clamp(max=n * bsz - 1)[:, None, :, None].expand(
            -1, num_kv_heads, -1, head_dim))
        keys, values = torch.cat([keys, own_keys], 2), torch.cat([values, own_values], 2)
        visible = torch.cat([visible, own_visible], 2)
        v_params = torch.cat([v_params, v_params.gather(2, own_pos.clamp(max=n * bsz - 1)[:, None, :, None].expand(
            -1, num_kv_heads, -1, 2))], 2)
    else:
        visible = k_pos <= q_pos
    # [G, Hkv, group * q_len, keys]: a row is (q head in the group, query position)
    scores = (q @ keys.transpose(-1, -2)) * softmax_scale
    mask = visible[:, None, None].expand(g, num_kv_heads, group, q_len, -1).reshape(scores.shape)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    broken = ~torch.isfinite(v_params).all(-1)  # [G, Hkv, keys]
    if broken.any():
        values = values.masked_fill(broken[..., None], 0.0)
        poisoned = torch.einsum("gqk,ghk->ghq", visible.float(), broken.float()) > 0  # [G, Hkv, q_len]
        result = probs @ values
        result = result.view(g, num_kv_heads, group, q_len, head_dim).masked_fill(
            poisoned[:, :, None, :, None], float("nan")).view(result.shape)
    else:
        result = probs @ values
    if scheme.rotate_values:
        result = result @ reader.rotation  # values were read rotated: (p @ v R) @ R = p @ v
    result = result.view(g, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    out[rows.reshape(-1)] = result.reshape(g * q_len, -1, head_dim)


def _own_block_keys(new_keys, staged_keys, slots, rows, chunk_start, q_len: int):
    """int4_kivi's original keys of each sequence's own blocks, [G, Hkv, W, D] float32, and their positions [G, W]:
    the ``chunk_start % 128`` rows earlier steps wrote to the block the step starts in, from the pool slot (NaN where
    the slot is -1), then the step's own ``q_len`` keys. Positions past a sequence's last key repeat its last row
    and get position UNREACHABLE."""
    bsz = KIVI_BLOCK_SIZE
    earlier = chunk_start % bsz  # [G]
    width = int(earlier.max()) + q_len
    pool = staged_keys[slots.long().clamp(min=0)].float()  # [G, Hkv, 128, D]
    pool = pool.masked_fill((slots < 0)[:, None, None, None], float("nan"))
    step = new_keys[rows].float().transpose(1, 2)  # [G, Hkv, q_len, D]
    source = torch.cat([pool, step], 2)
    w = torch.arange(width, device=rows.device)[None, :]
    index = torch.where(w < earlier[:, None], w, bsz + w - earlier[:, None]).clamp(max=bsz + q_len - 1)
    own = source.gather(2, index[:, None, :, None].expand(-1, source.shape[1], -1, source.shape[3]))
    # past a sequence's own keys: a position no query reaches (its row is a repeat, never visible)
    positions = torch.where(w < earlier[:, None] + q_len, (chunk_start - earlier)[:, None] + w, UNREACHABLE)
    return own, positions
