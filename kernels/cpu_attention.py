"""Paged attention over the int4 cache for vLLM's CPU engine: the read rule of kernels/reference.py, batched.

The reference (``reference.paged_attention``) is the oracle: one sequence at a time, every page dequantized and
un-rotated, the NaN-poison bookkeeping on every call. This module reads the same bytes the same way (docs/format.md,
the read rule) with far fewer tensor operations per layer and step, which is what a CPU step pays for:

* sequences whose step has the same query length (every decode of a step, equal prompt lengths) form one group,
  whose pages are gathered once over its block-table rows;
* codes become float32 once; each token's scale and min (a closed int4_kivi block's, per channel) apply to the
  scores and probabilities, ``(q . c) s + (q . 1) m``, which for a decode are far smaller than the keys and values
  (an int4_kivi group of at least 128 query rows dequantizes its keys instead);
* int4_saw keys stay rotated: scores use ``q @ R^T`` against the stored ``k R`` (R orthonormal), and with
  ``rotate_values`` the output is rotated back once, ``(p @ v R) @ R``, instead of every key and value;
* int4_kivi: every block's keys are read per channel; each query's scores against its own block are then replaced
  by its scores against the original keys (the staging pool's rows of the block the step starts in, then the step's
  ``new_keys``), computed over a window of at most 127 + query-length keys per sequence; one causal softmax and
  one product with the values follow;
* a value row holding NaN or inf poisons exactly the queries that see it (as ``reference.weighted_values``); the
  check reads the value parameters, and the masked path runs only when one is not finite.

Torch only; float32 arithmetic like the reference.
"""

from __future__ import annotations

import torch

from .layout import KIVI_BLOCK_SIZE
from .reference import PageViews, check_kivi_read, unpack_nibbles
from .scheme import Int4Scheme
from .staging import check_pool_read

# Largest score tensor (float32 elements) one group computes at once: sequences beyond it run in further groups.
MAX_SCORE_ELEMENTS = 1 << 24


def paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, softmax_scale, scheme: Int4Scheme,
                    staged_keys=None, sequence_slots=None, new_keys=None) -> torch.Tensor:
    """``reference.paged_attention``'s arguments and result (float32 [T, Hq, D]), computed per group of sequences
    with the same query length."""
    num_kv_heads = kv_cache.shape[1]
    check_pool_read(staged_keys, sequence_slots, seq_lens.shape[0], num_kv_heads, query.shape[-1], scheme)
    if scheme.is_kivi:
        check_kivi_read(new_keys, query, num_kv_heads)
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
    """The pages of a group of sequences from one layer's cache, gathered once, as float32 codes and parameters with
    heads first and blocks kept apart, so that the scale and min of each token (or closed int4_kivi block channel)
    can apply to the score and probability tensors instead of to every key and value element."""

    def __init__(self, kv_cache: torch.Tensor, scheme: Int4Scheme, head_dim: int):
        self.kv_cache = kv_cache
        self.scheme = scheme
        self.head_dim = head_dim
        self.rotation = scheme.rotation(head_dim, kv_cache.device)

    def scores(self, q: torch.Tensor, blocks: torch.Tensor):
        """Scores [G, Hkv, R, n, 128] of q [G, Hkv, R, D] (int4_saw: already rotated) against the stored keys of
        ``blocks`` [G, n]: int4_kivi per channel, int4_saw per token. Also returns the gathered pages for
        ``values``."""
        g, n = blocks.shape
        heads = self.kv_cache.shape[1]
        pages = PageViews(self.kv_cache[blocks].view(g * n, heads, -1), self.head_dim)  # one gather of whole pages
        codes = unpack_nibbles(_heads_first(pages.k_codes, g)).float()  # [G, Hkv, n, 128, D]
        params = _heads_first(pages.k_params, g).float()  # [G, Hkv, n, 128, 2]
        if not self.scheme.is_kivi:
            return _per_token_scores(q, codes, params), pages
        # a closed block's params are per channel: (scale, min) of channel c at entry c
        per_channel = params[..., : self.head_dim, :]  # [G, Hkv, n, D, 2]
        if q.shape[2] < KIVI_BLOCK_SIZE:  # fewer query rows than a block has keys: scale the queries per block
            scores = (q[:, :, None] * per_channel[..., None, :, 0]) @ codes.transpose(-1, -2)
            scores = scores + (q[:, :, None] @ per_channel[..., 1, None])  # q . min, [G, Hkv, n, R, 1]
        else:
            keys = codes * per_channel[..., None, :, 0] + per_channel[..., None, :, 1]
            scores = q[:, :, None] @ keys.transpose(-1, -2)
        return scores, pages

    def values(self, pages: PageViews, probs: torch.Tensor, valid_tokens: torch.Tensor, visible: torch.Tensor):
        """probs [G, Hkv, R, n * 128] times the stored values -> [G, Hkv, R, D] (rotated where ``rotate_values``).
        A value row holding NaN or inf (its scale or min) makes the rows of exactly the queries that see it
        (``visible`` [G, Hkv, R, n * 128]) NaN; tokens past a sequence's length (``valid_tokens`` [G, n * 128]) are
        never read."""
        g, heads, r, tokens = probs.shape
        n = tokens // KIVI_BLOCK_SIZE
        params = _heads_first(pages.v_params, g).reshape(g, heads, 1, tokens, 2).float()
        params = params.masked_fill(~valid_tokens[:, None, None, :, None], 0.0)
        broken = ~torch.isfinite(params).all(-1)  # [G, Hkv, 1, tokens]
        any_broken = bool(broken.any())
        if any_broken:
            params = params.masked_fill(broken[..., None], 0.0)
        codes = unpack_nibbles(_heads_first(pages.v_codes, g)).float()  # [G, Hkv, n, 128, D] (channel-major underneath)
        scaled = (probs * params[..., 0]).view(g, heads, r, n, KIVI_BLOCK_SIZE).transpose(2, 3)
        out = (scaled @ codes).sum(2) + (probs * params[..., 1]).sum(-1, keepdim=True)
        if any_broken:
            poisoned = (visible & broken).any(-1, keepdim=True)
            out = out.masked_fill(poisoned, float("nan"))
        return out


def _heads_first(view: torch.Tensor, g: int) -> torch.Tensor:
    """A page view of G * n gathered pages [G * n, Hkv, ...] as [G, Hkv, n, ...]."""
    return view.view(g, -1, *view.shape[1:]).transpose(1, 2)


def _per_token_scores(q: torch.Tensor, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """q [G, Hkv, R, D] against per-token keys codes * scale + min: (q . codes) * scale + sum(q) * min."""
    scale = params[..., 0][..., None, :]
    return (q[:, :, None] @ codes.transpose(-1, -2)) * scale + q.sum(-1)[:, :, None, :, None] * params[..., None, :, 1]


def _attend_group(query, out, reader: _PageReader, block_table, seq_lens, query_start_loc, softmax_scale,
                  seqs: torch.Tensor, q_len: int, staged_keys, sequence_slots, new_keys) -> None:
    """Attention of the sequences ``seqs``, each with ``q_len`` query tokens, into their rows of ``out``."""
    scheme, bsz, device = reader.scheme, KIVI_BLOCK_SIZE, query.device
    num_kv_heads = reader.kv_cache.shape[1]
    g, head_dim = seqs.shape[0], query.shape[-1]
    group = query.shape[1] // num_kv_heads
    lens = seq_lens[seqs].long()
    chunk_start = lens - q_len
    n = -(-int(lens.max()) // bsz)
    block_index = torch.arange(n, device=device)
    blocks = torch.where(block_index < (-(-lens // bsz))[:, None], block_table[seqs, :n].long(), 0)

    rows = query_start_loc[seqs].long()[:, None] + torch.arange(q_len, device=device)  # [G, q_len]
    q = query[rows].float()  # [G, q_len, Hq, D]
    if not scheme.is_kivi:
        q = q @ reader.rotation.T  # scores against the rotated keys: (q R^T) . (k R) = q . k
    # [G, Hkv, R, D], R = group * q_len: a row is (q head of the group, query position)
    q = q.view(g, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, -1, head_dim)
    scores, pages = reader.scores(q, blocks)
    scores = scores.transpose(2, 3).reshape(g, num_kv_heads, -1, n * bsz) * softmax_scale
    q_pos = chunk_start[:, None] + torch.arange(q_len, device=device)  # [G, q_len]
    if scheme.is_kivi:
        scores = _with_own_block_scores(scores, q, q_pos, new_keys, staged_keys, sequence_slots[seqs], rows,
                                        softmax_scale, group)
    k_pos = torch.arange(n * bsz, device=device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [G, q_len, keys]: causal (the own block read above)
    visible = visible[:, None, None].expand(g, num_kv_heads, group, q_len, -1).reshape(g, num_kv_heads, -1, n * bsz)
    probs = scores[..., : n * bsz].masked_fill(~visible, float("-inf")).softmax(-1)
    result = reader.values(pages, probs, k_pos < lens[:, None], visible)
    if scheme.rotate_values:
        result = result @ reader.rotation  # values were read rotated: (p @ v R) @ R = p @ v
    result = result.view(g, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    out[rows.reshape(-1)] = result.reshape(g * q_len, -1, head_dim)


def _with_own_block_scores(scores, q, q_pos, new_keys, staged_keys, slots, rows, softmax_scale, group: int):
    """int4_kivi: the scores of each query against its own block's keys replaced by those against the original keys
    (the ``chunk_start % 128`` rows earlier steps wrote to the block the step starts in, from the pool slot, NaN
    where it is -1; then the step's own keys). Returns the scores, widened where an own-block window runs past the
    cache part (those columns are past every query)."""
    bsz = KIVI_BLOCK_SIZE
    g, heads = scores.shape[:2]
    q_len = rows.shape[1]
    chunk_start = q_pos[:, 0]
    earlier = chunk_start % bsz  # [G]
    width = int(earlier.max()) + q_len
    pool = staged_keys[slots.long().clamp(min=0)].transpose(1, 2)  # [G, 128, Hkv, D]
    pool = pool.float().masked_fill((slots < 0)[:, None, None, None], float("nan"))
    source = torch.cat([pool, new_keys[rows].float()], 1)  # [G, 128 + q_len, Hkv, D]
    w = torch.arange(width, device=rows.device)[None, :]
    index = torch.where(w < earlier[:, None], w, bsz + w - earlier[:, None]).clamp(max=bsz + q_len - 1)
    own_keys = source[torch.arange(g, device=rows.device)[:, None], index].transpose(1, 2)  # [G, Hkv, width, D]
    own_scores = (q @ own_keys.transpose(-1, -2)) * softmax_scale  # [G, Hkv, group * q_len, width]
    positions = (chunk_start - earlier)[:, None] + w  # [G, width], distinct per sequence
    extra = int(positions.max()) + 1 - scores.shape[-1]
    if extra > 0:
        scores = torch.nn.functional.pad(scores, (0, extra))
    index = positions[:, None, None, :].expand(-1, heads, group * q_len, -1)
    same_block = (positions[:, None, :] // bsz == q_pos[:, :, None] // bsz)  # [G, q_len, width]
    same_block = same_block[:, None, None].expand(-1, heads, group, -1, -1).reshape(own_scores.shape)
    return scores.scatter(-1, index, torch.where(same_block, own_scores, scores.gather(-1, index)))
