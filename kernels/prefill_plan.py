"""Host planning of the FlashAttention prefill pass over dense pages (kernels/dense.py), plain torch.

Every prefill sequence's K/V is gathered into 128-token dense pages, sequence i's page p at ``cu_pages[i] + p``, and
one FA call reads them through a block table with ``seqused_k`` keys per batch entry, causal (bottom-right aligned).
int4_saw: an entry per sequence over all its keys. int4_kivi (the read rule, docs/kernel-api.md): a chunk's queries
are cut into segments, the queries of one sequence inside one 128-token block b (contiguous rows of the query), and
an entry per segment reads the blocks before b per channel and block b itself from its original keys. Block b is
both: its per-channel page for the later segments of its sequence, its own page of original keys for segment b. So
a sequence's pages are its blocks' pages, then an own page for each block its chunk touches except the last (that
block is no later segment's earlier block: its own keys go in its page), ``cu_pages[i] + cdiv(seq_len, 128) + (b -
first block)``; gather_own_keys writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import cdiv

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
    last ``query_lens`` are this step's queries, in query order (host int tensors)."""
    seq_lens = seq_lens.tolist()
    query_lens = query_lens.tolist()
    if not is_kivi:
        pages = [cdiv(n, PAGE) for n in seq_lens]
        cu_pages = _cumulative(pages)
        flash = FlashPass(
            cu_seqlens_q=torch.tensor(_cumulative(query_lens), dtype=torch.int32),
            block_table=_tables([list(range(cu_pages[i], cu_pages[i + 1])) for i in range(len(pages))]),
            seqused_k=torch.tensor(seq_lens, dtype=torch.int32), max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens))
        return PrefillPass(torch.tensor(cu_pages, dtype=torch.int32), cu_pages[-1], flash)
    cu_pages, cu_q, rows, used, own_pages = [0], [0], [], [], 0
    for n, q in zip(seq_lens, query_lens):
        first, blocks = (n - q) // PAGE, cdiv(n, PAGE)
        start = cu_pages[-1]
        for b in range(first, blocks):
            cu_q.append(cu_q[-1] + min(n, (b + 1) * PAGE) - max(n - q, b * PAGE))
            own = start + b if b == blocks - 1 else start + blocks + b - first
            rows.append(list(range(start, start + b)) + [own])
            used.append(min(n, (b + 1) * PAGE))
        cu_pages.append(start + blocks + (blocks - 1 - first))
        own_pages += blocks - 1 - first
    flash = FlashPass(torch.tensor(cu_q, dtype=torch.int32), _tables(rows), torch.tensor(used, dtype=torch.int32),
                      max(b - a for a, b in zip(cu_q, cu_q[1:])), max(used))
    return PrefillPass(torch.tensor(cu_pages, dtype=torch.int32), cu_pages[-1], flash, own_pages)


def _cumulative(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _tables(rows: list[list[int]]) -> torch.Tensor:
    """Block-table rows padded with each row's first page (never read: past seqused_k)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.int32)
