"""Host planning of the FlashAttention prefill pass over dense pages (kernels/dense.py), numpy.

Every prefill sequence's K/V is gathered into 128-token dense pages, sequence i's page p at ``cu_pages[i] + p``, and
one FA call reads them through a block table with ``seqused_k`` keys per batch entry, causal (bottom-right aligned).
int4_saw: an entry per sequence over all its keys. int4_kivi (the read rule, docs/kernel-api.md): a chunk's queries
are cut into segments, the queries of one sequence inside one 128-token block b (contiguous rows of the query), and
an entry per segment reads the blocks before b per channel and block b itself from its original keys. Block b is
both: its per-channel page for the later segments of its sequence, its own page of original keys for segment b. So
a sequence's pages are its blocks' pages, then an own page for each block its chunk touches except the last (that
block is no later segment's earlier block: its own keys go in its page), ``cu_pages[i] + cdiv(seq_len, 128) + (b -
first block)``; dense.gather_dense_kv writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAGE = 128  # the dense pages' size: int4_kivi's block, so a block is one page


@dataclass(frozen=True)
class FlashPass:
    """The flash_attn_varlen_func call over the dense pages (host tensors, int32), causal."""

    cu_seqlens_q: torch.Tensor  # [entries + 1], rows of the prefill part of the query
    block_table: torch.Tensor  # [entries, max pages]
    seqused_k: torch.Tensor  # [entries]
    max_seqlen_q: int
    max_seqlen_k: int

    def to(self, device) -> "FlashPass":
        return FlashPass(*(t.to(device, non_blocking=True) for t in (self.cu_seqlens_q, self.block_table,
                                                                     self.seqused_k)),
                         self.max_seqlen_q, self.max_seqlen_k)


@dataclass(frozen=True)
class PrefillPass:
    cu_pages: torch.Tensor  # [num_seqs + 1] int32: sequence i's dense pages start at cu_pages[i]
    num_pages: int
    flash: FlashPass
    own_pages: int = 0  # of num_pages, int4_kivi's second pages of blocks its chunks touch (at most one per block)


def plan_prefill_pass(seq_lens: torch.Tensor, query_lens: torch.Tensor, is_kivi: bool) -> PrefillPass:
    """The pages and the FA pass for prefill sequences of ``seq_lens`` tokens (this step's included) of which the
    last ``query_lens`` are this step's queries, in query order (host int tensors). Planned in numpy: the builder runs
    it every step with a prefill, and numpy's small-array operations cost the host a fraction of torch's."""
    seq_lens, query_lens = seq_lens.numpy().astype(np.int64), query_lens.numpy().astype(np.int64)
    blocks = (seq_lens + PAGE - 1) // PAGE
    if not is_kivi:
        cu_pages = _cumulative(blocks)
        flash = FlashPass(_int32(_cumulative(query_lens)), _block_table(cu_pages[:-1], blocks - 1, cu_pages[1:] - 1),
                          _int32(seq_lens), int(query_lens.max()), int(seq_lens.max()))
        return PrefillPass(_int32(cu_pages), int(cu_pages[-1]), flash)
    # an entry per (sequence, block its chunk touches): every block from the chunk's first to the sequence's last
    context = seq_lens - query_lens
    first = context // PAGE
    touched = blocks - first
    own_pages = touched - 1
    cu_pages = _cumulative(blocks + own_pages)
    seq = np.repeat(np.arange(len(blocks)), touched)
    block = first[seq] + np.arange(int(touched.sum())) - np.repeat(_cumulative(touched)[:-1], touched)
    start, last = cu_pages[:-1][seq], blocks[seq] - 1
    own = np.where(block == last, start + block, start + blocks[seq] + block - first[seq])
    used = np.minimum(seq_lens[seq], (block + 1) * PAGE)
    segment_q = used - np.maximum(context[seq], block * PAGE)
    flash = FlashPass(_int32(_cumulative(segment_q)), _block_table(start, block, own), _int32(used),
                      int(segment_q.max()), int(used.max()))
    return PrefillPass(_int32(cu_pages), int(cu_pages[-1]), flash, int(own_pages.sum()))


def _cumulative(counts: np.ndarray) -> np.ndarray:
    """[0, c0, c0 + c1, ...]."""
    return np.concatenate([[0], np.cumsum(counts)])


def _block_table(start: np.ndarray, count: np.ndarray, last: np.ndarray) -> torch.Tensor:
    """Rows ``start, start + 1, ..., start + count - 1, last``, padded with ``last`` (never read: past seqused_k)."""
    j = np.arange(int(count.max()) + 1)[None, :]
    return _int32(np.where(j < count[:, None], start[:, None] + j, last[:, None]))


def _int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
