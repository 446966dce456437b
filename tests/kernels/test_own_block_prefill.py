"""The FlashAttention prefill under the read rule: dense pages gathered from the int4 cache (kernels/dense.py), the
passes planned on the host (kernels/prefill_plan.py) and, for int4_kivi, two passes merged by log-sum-exp.

On the CPU FlashAttention is emulated here in float64 from its documented semantics (paged K/V through a block
table, ``seqused_k`` keys, causal bottom-right aligned, output 0 and log-sum-exp -inf without keys), so the gather,
the segment planning and the merge are checked against the rule's oracle; the GPU test runs vLLM's FA itself.
"""

from __future__ import annotations

import pytest
import torch
from kv_batches import relative_error
from own_block_oracle import B, KIVI, batch_rule_attention, stored_step

from s4kv.kernels.dense import gather_dense_kv, gather_own_keys
from s4kv.kernels.prefill_plan import FlashPass, plan_prefill_passes
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


def emulated_flash(q, dense_k, dense_v, fa_pass: FlashPass, softmax_scale):
    """(out float64 [T, Hq, D], lse float64 [Hq, T]) of one flash_attn_varlen_func call, from its documentation."""
    group = q.shape[1] // dense_k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    cu = fa_pass.cu_seqlens_q.tolist()
    for e in range(len(cu) - 1):
        used = int(fa_pass.seqused_k[e])
        if used == 0:
            continue
        pages = fa_pass.block_table[e].long()
        k = dense_k.cpu()[pages].flatten(0, 1)[:used].double().repeat_interleave(group, 1)
        v = dense_v.cpu()[pages].flatten(0, 1)[:used].double().repeat_interleave(group, 1)
        rows = q[cu[e] : cu[e + 1]].cpu().double()
        scores = torch.einsum("qhd,khd->hqk", rows, k) * softmax_scale
        if fa_pass.causal:
            n_q = rows.shape[0]
            visible = torch.arange(used)[None, :] <= (used - n_q + torch.arange(n_q))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        lse[:, cu[e] : cu[e + 1]] = torch.logsumexp(scores, -1)
        out[cu[e] : cu[e + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, lse


def merged(first, second):
    """merge_attn_states in float64: the two partial softmaxes weighted by their log-sum-exp."""
    (o1, l1), (o2, l2) = first, second
    total = torch.logaddexp(l1, l2)
    w1, w2 = (l1 - total).exp().T[..., None], (l2 - total).exp().T[..., None]
    return o1 * w1 + o2 * w2


def emulated_prefill(batch, cache, pool, scheme):
    """The backend's FlashAttention prefill (flash_prefill) with FA emulated: gather, passes, own keys, merge."""
    q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    plan = plan_prefill_passes(batch.seq_lens.cpu(), q_lens.cpu(), scheme.is_kivi)
    device = cache.device
    shape = (plan.num_pages + 2, B, batch.num_kv_heads, batch.head_dim)
    dense_k = torch.full(shape, float("nan"), dtype=torch.float16, device=device)
    dense_v = torch.full_like(dense_k, float("nan"))
    cu_pages = plan.cu_pages.to(device)
    gather_dense_kv(cache, batch.block_table, batch.seq_lens, cu_pages, int(batch.seq_lens.max()), scheme, dense_k,
                    dense_v, batch.head_dim)
    assert torch.isnan(dense_k[plan.num_pages :]).all(), "wrote past the last page"
    if not scheme.is_kivi:
        return emulated_flash(batch.query, dense_k, dense_v, plan.passes[0], SOFTMAX_SCALE)[0], plan
    closed = [emulated_flash(batch.query, dense_k, dense_v, p, SOFTMAX_SCALE) for p in plan.passes[:-1]]
    gather_own_keys(batch.key, pool.staged_keys, pool.sequence_slots, batch.seq_lens, batch.query_start_loc,
                    cu_pages, batch.max_query_len, dense_k)
    own = emulated_flash(batch.query, dense_k, dense_v, plan.passes[-1], SOFTMAX_SCALE)
    return (merged(closed[0], own) if closed else own[0]), plan


def test_kivi_segments_cut_each_chunk_at_block_edges():
    plan = plan_prefill_passes(torch.tensor([300, 150, 128, 276]), torch.tensor([200, 150, 98, 20]), True)
    closed, own = plan.passes
    assert plan.cu_pages.tolist() == [0, 3, 5, 6, 9]
    # (100, 200): blocks 0, 1, 2 with 28, 128, 44 queries; (0, 150): 128, 22; (30, 98): 98; (256, 20): 20
    assert closed.cu_seqlens_q.tolist() == [0, 28, 156, 200, 328, 350, 448, 468]
    assert closed.seqused_k.tolist() == [0, 128, 256, 0, 128, 0, 256]
    assert own.seqused_k.tolist() == [128, 128, 44, 128, 22, 128, 20]
    assert own.block_table[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert closed.block_table[2, :2].tolist() == [0, 1] and closed.block_table[6, :2].tolist() == [6, 7]
    assert (closed.causal, own.causal, closed.max_seqlen_q, closed.max_seqlen_k) == (False, True, 128, 256)
    first_chunks = plan_prefill_passes(torch.tensor([100, 128]), torch.tensor([100, 128]), True)
    assert len(first_chunks.passes) == 1 and first_chunks.passes[0].causal, "no earlier block: the own pass only"
    saw = plan_prefill_passes(torch.tensor([300, 150]), torch.tensor([200, 150]), False).passes
    assert len(saw) == 1 and saw[0].seqused_k.tolist() == [300, 150] and saw[0].cu_seqlens_q.tolist() == [0, 200, 350]


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_kivi_two_pass_prefill_follows_the_rule(gen, kernel_device, head_dim):
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


def test_own_keys_are_the_originals_and_a_missing_slot_is_nan(gen, kernel_device):
    """After gather_own_keys the pages of the blocks a chunk touches hold its original keys exactly (pool rows for
    the block it starts in, new_keys after); without a slot exactly the pool rows it needed are NaN."""
    batch, cache, pool = stored_step(gen, PREFILLS, 64, kernel_device)
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).cpu()
    plan = plan_prefill_passes(batch.seq_lens.cpu(), q_lens, True)
    cu_pages = plan.cu_pages.to(kernel_device)
    dense_k = torch.full((plan.num_pages, B, 2, 64), float("nan"), dtype=torch.float16, device=kernel_device)
    dense_v = torch.full_like(dense_k, float("nan"))
    gather_dense_kv(cache, batch.block_table, batch.seq_lens, cu_pages, int(batch.seq_lens.max()), KIVI, dense_k,
                    dense_v, 64)
    missing = pool.sequence_slots.clone()
    missing[0] = -1
    gather_own_keys(batch.key, pool.staged_keys, missing, batch.seq_lens, batch.query_start_loc, cu_pages,
                    batch.max_query_len, dense_k)
    for i, ((context, _), keys) in enumerate(zip(PREFILLS, batch.seq_keys)):
        n = int(batch.seq_lens[i])
        rows = dense_k[int(plan.cu_pages[i]) : int(plan.cu_pages[i + 1])].flatten(0, 1)[:n]
        first = context // B * B
        if i == 0:
            assert torch.isnan(rows[first:context]).all() and not torch.isnan(rows[context:]).any()
            assert torch.equal(rows[context:], keys[context:])
        else:
            assert torch.equal(rows[first:], keys[first:]), f"sequence {i}: own-block keys"
