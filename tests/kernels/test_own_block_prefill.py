"""The FlashAttention prefill under the read rule: dense pages gathered from the int4 cache (kernels/dense.py) and
the pass planned on the host (kernels/prefill_plan.py): for int4_kivi an entry per segment of a chunk's queries in
one block, whose own block is read from a page of its original keys.

On the CPU FlashAttention is emulated in float64 from its documented semantics (attention_oracle.emulated_flash:
paged K/V through a block table, ``seqused_k`` keys, causal bottom-right aligned), so the gather and the segment
planning are checked against the rule's oracle; the GPU test runs vLLM's FA itself.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import emulated_flash
from kv_batches import relative_error
from own_block_oracle import B, KIVI, batch_rule_attention, stored_step

from s4kv.kernels import reference as ref
from s4kv.kernels.dense import gather_dense_kv
from s4kv.kernels.prefill_plan import plan_prefill_pass
from s4kv.kernels.scheme import Int4Scheme
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS

pytestmark = [
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

SOFTMAX_SCALE = 0.1
# a chunk starting mid-block spanning three blocks, a prefill from 0 ending inside block 1, one chunk closing the
# block it starts in, a chunk starting on a block boundary
PREFILLS = [(100, 200), (0, 150), (30, 98), (256, 20)]
SPARE_PAGES = 2  # NaN pages past the plan's last one: nothing may write them


def gathered_pages(batch, cache, pool, scheme, slots=None):
    """(plan, dense_k, dense_v): the pages the backend hands FlashAttention, NaN-poisoned before the gather, with
    SPARE_PAGES more at the end."""
    q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    plan = plan_prefill_pass(batch.seq_lens.cpu(), q_lens.cpu(), scheme.is_kivi)
    device = cache.device
    shape = (plan.num_pages + SPARE_PAGES, B, batch.num_kv_heads, batch.head_dim)
    dense_k = torch.full(shape, float("nan"), dtype=torch.float16, device=device)
    dense_v = torch.full_like(dense_k, float("nan"))
    own = {}
    if scheme.is_kivi:
        own = dict(new_keys=batch.key, staged_keys=pool.staged_keys,
                   sequence_slots=pool.sequence_slots if slots is None else slots,
                   query_start_loc=batch.query_start_loc)
    gather_dense_kv(cache, batch.block_table, batch.seq_lens, plan.cu_pages.to(device),
                    int(batch.seq_lens.max()), scheme, dense_k, dense_v, batch.head_dim, **own)
    assert torch.isnan(dense_k[plan.num_pages :]).all() and torch.isnan(dense_v[plan.num_pages :]).all(), \
        "wrote past the last page"
    return plan, dense_k, dense_v


def emulated_prefill(batch, cache, pool, scheme):
    """The backend's FlashAttention prefill (flash_prefill) with FA emulated: the gathers, then the one pass."""
    plan, dense_k, dense_v = gathered_pages(batch, cache, pool, scheme)
    return emulated_flash(batch.query, dense_k, dense_v, plan.flash, SOFTMAX_SCALE), plan


def test_kivi_segments_read_earlier_blocks_per_channel_and_their_own_from_its_own_page():
    plan = plan_prefill_pass(torch.tensor([300, 150, 128, 276]), torch.tensor([200, 150, 98, 20]), True)
    flash = plan.flash
    # each sequence's blocks, then an own page for every block its chunk touches but the last
    assert plan.cu_pages.tolist() == [0, 5, 8, 9, 12] and (plan.num_pages, plan.own_pages) == (12, 3)
    # (100, 200): blocks 0, 1, 2 with 28, 128, 44 queries; (0, 150): 128, 22; (30, 98): 98; (256, 20): 20
    assert flash.cu_seqlens_q.tolist() == [0, 28, 156, 200, 328, 350, 448, 468]
    assert flash.seqused_k.tolist() == [128, 256, 300, 128, 150, 128, 276]
    rows = [row[: (used + B - 1) // B] for row, used in zip(flash.block_table.tolist(), flash.seqused_k.tolist())]
    assert rows == [[3], [0, 4], [0, 1, 2], [7], [5, 6], [8], [9, 10, 11]]
    assert (flash.max_seqlen_q, flash.max_seqlen_k) == (128, 300)
    saw = plan_prefill_pass(torch.tensor([300, 150]), torch.tensor([200, 150]), False)
    assert saw.cu_pages.tolist() == [0, 3, 5] and saw.own_pages == 0 and saw.flash.seqused_k.tolist() == [300, 150]
    assert saw.flash.cu_seqlens_q.tolist() == [0, 200, 350] and saw.flash.block_table.tolist() == [[0, 1, 2], [3, 4, 4]]


def test_segments_of_random_batches_follow_the_layout():
    """The plan against the layout written out segment by segment (kernels/prefill_plan.py), on 200 random batches
    of 1-6 prefill sequences: chunks from position 0 or mid-prefix, on and off block edges, 1 to 700 tokens."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        n_seqs = int(torch.randint(1, 7, (1,), generator=gen))
        contexts = torch.randint(0, 900, (n_seqs,), generator=gen) * torch.randint(0, 2, (n_seqs,), generator=gen)
        q_lens = torch.randint(1, 701, (n_seqs,), generator=gen)
        plan = plan_prefill_pass(contexts + q_lens, q_lens, True)
        cu_pages, cu_q, used, tables = [0], [0], [], []
        for context, q in zip(contexts.tolist(), q_lens.tolist()):
            n = context + q
            first, last, start = context // B, (n - 1) // B, cu_pages[-1]
            for b in range(first, last + 1):
                cu_q.append(cu_q[-1] + min(n, (b + 1) * B) - max(context, b * B))
                used.append(min(n, (b + 1) * B))
                own = start + b if b == last else start + last + 1 + b - first
                tables.append(list(range(start, start + b)) + [own])
            cu_pages.append(start + last + 1 + last - first)
        assert plan.cu_pages.tolist() == cu_pages and plan.num_pages == cu_pages[-1]
        assert plan.own_pages == cu_pages[-1] - sum((n + B - 1) // B for n in (contexts + q_lens).tolist())
        assert plan.flash.cu_seqlens_q.tolist() == cu_q and plan.flash.seqused_k.tolist() == used
        table = plan.flash.block_table.tolist()
        assert [row[: len(t)] for row, t in zip(table, tables)] == tables
        assert all(0 <= page < plan.num_pages for row in table for page in row), "padding must name a real page"
        assert (plan.flash.max_seqlen_q, plan.flash.max_seqlen_k) == (
            max(b - a for a, b in zip(cu_q, cu_q[1:])), max(used))


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_kivi_prefill_follows_the_rule(gen, kernel_device, head_dim):
    batch, cache, pool = stored_step(gen, PREFILLS, head_dim, kernel_device, num_q_heads=4)
    out, _ = emulated_prefill(batch, cache, pool, KIVI)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    assert not torch.isnan(out).any()
    assert relative_error(out, expected) < 2e-3


def test_saw_prefill_reads_every_token_from_the_cache(gen, kernel_device):
    scheme = Int4Scheme("int4_saw", 64, rotate_values=True)
    batch, cache, _ = stored_step(gen, PREFILLS, 64, kernel_device, scheme=scheme)
    out, _ = emulated_prefill(batch, cache, None, scheme)
    assert relative_error(out, batch_rule_attention(batch, SOFTMAX_SCALE, scheme)) < 2e-3


def test_own_pages_hold_the_original_keys_and_the_blocks_values(gen, kernel_device):
    """After the gather each block a chunk touches has an own page of its original keys (pool rows for the block it
    starts in, new_keys after): the last block in its page, an earlier one in a page of its own, with the block's
    values beside them; every block before the last is in its page per channel (what later segments read), as the
    reference dequantizes it, and every value as the reference does. Without a slot exactly the pool rows it needed
    are NaN."""
    batch, cache, pool = stored_step(gen, PREFILLS, 64, kernel_device)
    missing = pool.sequence_slots.clone()
    missing[0] = -1
    plan, dense_k, dense_v = gathered_pages(batch, cache, pool, KIVI, slots=missing)
    cu = plan.cu_pages.tolist()
    for i, ((context, q_len), keys) in enumerate(zip(PREFILLS, batch.seq_keys)):
        n = context + q_len
        first, last = context // B, (n - 1) // B
        assert cu[i + 1] - cu[i] == last + 1 + last - first
        k_hat, v_hat = ref.dequantize_sequence(cache, batch.block_table[i], n, KIVI, 64)
        pages = dense_v[cu[i] : cu[i] + last + 1].flatten(0, 1)
        torch.testing.assert_close(pages[:n].float(), v_hat, rtol=2e-3, atol=2e-3, msg=lambda m: f"{i} values: {m}")
        assert (pages[n:] == 0).all() and (dense_k[cu[i] + last][n - last * B :] == 0).all(), f"{i}: rows past the end"
        closed = dense_k[cu[i] : cu[i] + last].flatten(0, 1)
        torch.testing.assert_close(closed.float(), k_hat[: last * B], rtol=2e-3, atol=2e-3,
                                   msg=lambda m: f"sequence {i}, blocks before the last per channel: {m}")
        for b in range(first, last + 1):
            own = cu[i] + b if b == last else cu[i] + last + 1 + b - first
            rows = dense_k[own][: min(n, (b + 1) * B) - b * B]
            originals = keys[b * B : min(n, (b + 1) * B)]
            staged = max(0, context - b * B)  # the block's rows before the chunk: from the pool
            if i == 0 and staged:
                assert torch.isnan(rows[:staged]).all() and not torch.isnan(rows[staged:]).any()
                assert torch.equal(rows[staged:], originals[staged:])
            else:
                assert torch.equal(rows, originals), f"sequence {i} block {b}: own keys"
            if b != last:
                assert torch.equal(dense_v[own], dense_v[cu[i] + b]), f"sequence {i} block {b}: own values"
