"""Host planning of the FlashAttention prefill passes over dense pages (kernels/dense.py), plain torch.

Every prefill sequence's K/V is gathered into 128-token dense pages, sequence i's page p at ``cu_pages[i] + p``, and
FA reads them through a block table with ``seqused_k`` keys per batch entry. int4_saw: one causal pass per sequence
over all its keys. int4_kivi (the read rule, docs/kernel-api.md): a chunk's queries are cut into segments, the
queries of one sequence inside one 128-token block b (contiguous rows of the query); pass ``closed`` attends each
segment to the keys of blocks < b (per channel, non-causal: all visible; no keys for b = 0), pass ``own`` to its own
block's keys up to its last query (the original keys, causal, bottom-right aligned); the two are merged by their
log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import cdiv

PAGE = 128  # the dense pages' size: int4_kivi's block, so a block is one page


@dataclass(frozen=True)
class FlashPass:
    """One flash_attn_varlen_func call over the dense pages (host tensors, int32)."""

    cu_seqlens_q: torch.Tensor  # [entries + 1], rows of the prefill part of the query
    block_table: torch.Tensor  # [entries, max pages]
    seqused_k: torch.Tensor  # [entries]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool

    def to(self, device) -> "FlashPass":
        return FlashPass(*(t.to(device, non_blocking=True) for t in (self.cu_seqlens_q, self.block_table,
                                                                     self.seqused_k)),
                         self.max_seqlen_q, self.max_seqlen_k, self.causal)


@dataclass(frozen=True)
class PrefillPasses:
    cu_pages: torch.Tensor  # [num_seqs + 1] int32: sequence i's dense pages start at cu_pages[i]
    num_pages: int
    passes: tuple[FlashPass, ...]  # int4_saw: (causal,); int4_kivi: (closed, own), closed dropped when no segment
    # has an earlier block


def plan_prefill_passes(seq_lens: torch.Tensor, query_lens: torch.Tensor, is_kivi: bool) -> PrefillPasses:
    """The passes for prefill sequences of ``seq_lens`` tokens (this step's included) of which the last
    ``query_lens`` are this step's queries, in query order (host int tensors)."""
    seq_lens = seq_lens.tolist()
    query_lens = query_lens.tolist()
    pages = [cdiv(n, PAGE) for n in seq_lens]
    cu_pages = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    if not is_kivi:
        one = FlashPass(
            cu_seqlens_q=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
            block_table=_tables([list(range(int(cu_pages[i]), int(cu_pages[i + 1]))) for i in range(len(pages))]),
            seqused_k=torch.tensor(seq_lens, dtype=torch.int32), max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens), causal=True)
        return PrefillPasses(cu_pages, int(cu_pages[-1]), (one,))
    cu_q, closed_rows, closed_used, own_rows, own_used = [0], [], [], [], []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        context = n - q
        first = int(cu_pages[i])
        for b in range(context // PAGE, cdiv(n, PAGE)):
            start, end = max(context, b * PAGE), min(n, (b + 1) * PAGE)
            cu_q.append(cu_q[-1] + end - start)
            closed_rows.append(list(range(first, first + b)) or [first])
            closed_used.append(b * PAGE)
            own_rows.append([first + b])
            own_used.append(end - b * PAGE)
    cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    own = FlashPass(cu_seqlens_q, _tables(own_rows), torch.tensor(own_used, dtype=torch.int32), max_q,
                    max(own_used), causal=True)
    if max(closed_used) == 0:
        return PrefillPasses(cu_pages, int(cu_pages[-1]), (own,))
    closed = FlashPass(cu_seqlens_q, _tables(closed_rows), torch.tensor(closed_used, dtype=torch.int32), max_q,
                       max(closed_used), causal=False)
    return PrefillPasses(cu_pages, int(cu_pages[-1]), (closed, own))


def _tables(rows: list[list[int]]) -> torch.Tensor:
    """Block-table rows padded with each row's first page (never read: past seqused_k)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.int32)
