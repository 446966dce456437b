"""int4_kivi with its staging pool: attention and the dense gather read the open block's keys from the pool.

After the store of a step, a sequence that ends inside a block has that block's keys, as the model produced them, in
its pool slot (``staged_keys[slot, head, offset]``); every closed block is per channel from its original keys. The
readers (reference.paged_attention / dequantize_sequence, the Triton attention kernel, the dense gather) take the
pool and one slot per sequence (-1 where the last block is full). Checked here: the reference against an
independent float64 oracle over [per-channel round trips of the closed blocks' keys | the original open keys] and
per-token round trips of the values; the kernels against the reference, with a poisoned cache, a pool of NaN
outside the rows the store wrote, NaN outputs, odd sizes, many pages and sequences ending on, just after and just
before block boundaries, at head_dim 64 and 128. Interpreter on the CPU (fp16), compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import causal_attention
from kv_batches import cache_and_pool_with_prefix, dense_reference, make_paged_batch, relative_error

from s4kv.kernels import reference as ref
from s4kv.kernels.attention import SplitWorkspace, paged_attention
from s4kv.kernels.dense import gather_dense_kv
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.store import store_kv
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS

pytestmark = [
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

KIVI = Int4Scheme("int4_kivi")
B = 128
SOFTMAX_SCALE = 0.1
# (context, q_len): a prefill ending on a block boundary (no slot), one ending inside its first block, a decode
# that closes a block, one that opens a new block, a chunk that closes a block and opens the next, a chunk inside
# an open block, a prefill over five pages
MIXED = [(0, 128), (0, 70), (127, 1), (128, 1), (250, 11), (100, 40), (3, 1), (0, 600)]
DECODE = [(0, 1), (126, 1), (127, 1), (128, 1), (300, 1), (5, 1), (1000, 1)]


def stored_then_read(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What int4_kivi with a pool gives back for a sequence's original keys/values [n, Hkv, D], computed from the
    quantizers alone (no page, no store): each full block's keys per channel, the open block's keys as they are,
    every value per token."""
    k = keys.float().clone()
    for start in range(0, keys.shape[0] // B * B, B):
        for h in range(keys.shape[1]):
            k[start : start + B, h] = ref.dequantize_per_channel(*ref.quantize_per_channel(keys[start : start + B, h]))
    return k, ref.dequantize_per_token(*ref.quantize_per_token(values.float()))


def stored_batch(gen, specs, head_dim, kernel_device, num_q_heads=8, num_kv_heads=2, kernel_store=False):
    """A batch, its cache and pool with the cached prefixes, then the batch's own store (reference or kernel)."""
    batch = make_paged_batch(gen, specs, num_q_heads, num_kv_heads, block_size=B, dtype=torch.float16,
                             device=kernel_device, num_padding=2, head_dim=head_dim)
    cache, pool = cache_and_pool_with_prefix(batch, gen, kernel_device)
    store = store_kv if kernel_store else ref.store_kv
    store(batch.key, batch.value, cache, batch.slot_mapping, KIVI, pool.staged_keys, pool.per_token(batch))
    return batch, cache, pool


def reference_attention(batch, cache, pool) -> torch.Tensor:
    return ref.paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                               SOFTMAX_SCALE, KIVI, pool.staged_keys, pool.sequence_slots)


def kernel_attention(batch, cache, pool, workspace=None, sequence_slots=None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    batch.max_query_len, SOFTMAX_SCALE, KIVI, out, workspace=workspace,
                    staged_keys=pool.staged_keys,
                    sequence_slots=pool.sequence_slots if sequence_slots is None else sequence_slots)
    return out


def assert_close_to_reference(out, expected, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    err = relative_error(out, expected)
    assert err < 1e-2, f"{what}: relative error {err:.2e} against the reference"
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reference_attends_to_closed_blocks_per_channel_and_the_open_keys_as_they_are(gen, head_dim, specs):
    batch, cache, pool = stored_batch(gen, specs, head_dim, "cpu")
    out = reference_attention(batch, cache, pool)
    starts = batch.query_start_loc.tolist()
    for i, (keys, values) in enumerate(zip(batch.seq_keys, batch.seq_values)):
        k, v = stored_then_read(keys, values)
        expected = causal_attention(batch.query[starts[i] : starts[i + 1]], k, v, SOFTMAX_SCALE)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"sequence {i} {batch.specs[i]}: {m}")
    # the pool is what makes the difference: without it the open blocks are read from their staged codes
    without = ref.paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                  SOFTMAX_SCALE, KIVI)
    assert relative_error(without, out) > 1e-3


def test_reference_refuses_an_open_block_without_a_slot(gen):
    batch, cache, pool = stored_batch(gen, [(0, 128), (100, 40)], 64, "cpu")
    ref.paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, SOFTMAX_SCALE,
                        KIVI, pool.staged_keys, pool.sequence_slots)  # sequence 0 ends on a boundary: -1 is right
    missing = pool.sequence_slots.clone()
    missing[1] = -1
    with pytest.raises(ValueError, match="a sequence of 140 tokens ends in an open block but has no staging slot"):
        ref.paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                            SOFTMAX_SCALE, KIVI, pool.staged_keys, missing)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_mixed_batch_matches_the_reference(gen, kernel_device, head_dim, group):
    batch, cache, pool = stored_batch(gen, MIXED, head_dim, kernel_device, num_q_heads=2 * group)
    expected = reference_attention(batch, cache, pool)
    assert_close_to_reference(kernel_attention(batch, cache, pool), expected, f"GQA {group} head_dim {head_dim}")


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("num_splits", [None, 8], ids=["one pass", "split"])
def test_kernel_decode_matches_the_reference(gen, kernel_device, head_dim, num_splits):
    """The Triton store with the pool, then decode attention: with no workspace, and split over 8 programs per
    sequence (the open tile lands in one split or another, some splits are empty)."""
    batch, cache, pool = stored_batch(gen, DECODE, head_dim, kernel_device, num_q_heads=14, kernel_store=True)
    workspace = None
    if num_splits is not None:
        workspace = SplitWorkspace.allocate(14, 2, head_dim, kernel_device, num_splits=num_splits)
        workspace.part_acc.fill_(float("nan"))
        workspace.part_ml.fill_(float("nan"))
    expected = reference_attention(batch, cache, pool)
    assert_close_to_reference(kernel_attention(batch, cache, pool, workspace), expected,
                              f"head_dim {head_dim} num_splits {num_splits}")


def test_kernel_poisons_exactly_the_queries_that_read_an_open_block_without_a_slot(gen, kernel_device):
    """A chunk of positions 100-139 whose sequence lost its slot: the queries at 128 onward read the open block
    (NaN), the ones before it only the closed block 0 (finite, as the reference gives them); other sequences
    are untouched."""
    batch, cache, pool = stored_batch(gen, [(100, 40), (200, 1)], 64, kernel_device)
    expected = reference_attention(batch, cache, pool)
    missing = pool.sequence_slots.clone()
    missing[0] = -1
    out = kernel_attention(batch, cache, pool, sequence_slots=missing)
    nan_rows = torch.isnan(out).any(-1).all(-1).cpu()
    assert nan_rows.tolist() == [p >= 128 for p in range(100, 140)] + [False]
    finite = ~nan_rows
    torch.testing.assert_close(out[finite].float(), expected[finite], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_dense_gather_reads_the_cached_open_keys_from_the_pool(gen, kernel_device, head_dim):
    """The prefix's open-block rows equal the original keys exactly (the pool holds them in the model dtype), the
    rest of the prefix the reference's reading, the fresh rows are copied."""
    specs = [(100, 40), (250, 11), (0, 70), (128, 3), (600, 5)]
    batch, cache, pool = stored_batch(gen, specs, head_dim, kernel_device)
    cu_seqlens_k = torch.cat([batch.seq_lens.new_zeros(1), batch.seq_lens.cumsum(0)]).int()
    total = int(cu_seqlens_k[-1])
    dense_k = torch.full((total + 3, 2, head_dim), float("nan"), dtype=torch.float16, device=kernel_device)
    dense_v = torch.full_like(dense_k, float("nan"))
    gather_dense_kv(batch.key, batch.value, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    cu_seqlens_k, int(batch.seq_lens.max()), KIVI, dense_k, dense_v, pool.staged_keys,
                    pool.sequence_slots)
    assert torch.isnan(dense_k[total:]).all(), "wrote past the last sequence"
    ks, vs = dense_reference(batch, cache, KIVI, range(len(specs)), pool)
    for i in range(len(specs)):
        rows = slice(int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1]))
        open_start = int(batch.seq_lens[i]) // B * B
        assert torch.equal(dense_k[rows][open_start:], batch.seq_keys[i][open_start:]), f"sequence {i}: open keys"
        torch.testing.assert_close(dense_k[rows].float(), ks[i], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(dense_v[rows].float(), vs[i], rtol=2e-3, atol=2e-3)
    # without slots: sequence 4 reads cached positions 512-599 from its open block (NaN), sequence 0 has none
    # cached there (its open rows 128-139 are fresh, copied), so it stays finite
    missing = pool.sequence_slots.clone()
    missing[[0, 4]] = -1
    dense_k.fill_(float("nan"))
    gather_dense_kv(batch.key, batch.value, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    cu_seqlens_k, int(batch.seq_lens.max()), KIVI, dense_k, dense_v, pool.staged_keys, missing)
    broken = torch.isnan(dense_k[:total]).any(-1).any(-1).cpu()
    assert broken.nonzero().flatten().tolist() == list(range(int(cu_seqlens_k[4]) + 512, int(cu_seqlens_k[4]) + 600))


def test_bad_pool_arguments_get_clear_errors(gen, kernel_device):
    batch, cache, pool = stored_batch(gen, [(100, 1)], 64, kernel_device)
    out = torch.empty_like(batch.query)
    args = (batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1, SOFTMAX_SCALE)
    with pytest.raises(ValueError, match="staged_keys and sequence_slots go together, and only with int4_kivi"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys)
    with pytest.raises(ValueError, match="staged_keys and sequence_slots go together, and only with int4_kivi"):
        paged_attention(*args, Int4Scheme("int4_saw"), out, staged_keys=pool.staged_keys,
                        sequence_slots=pool.sequence_slots)
    with pytest.raises(ValueError, match=r"sequence_slots must be int32 \[1\]"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots.long())
    with pytest.raises(ValueError, match=r"staged_keys must be \[slots, 2, 128, 64\]"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys[:, :1], sequence_slots=pool.sequence_slots)
    with pytest.raises(ValueError, match="staged_keys must be torch.float16"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys.float(), sequence_slots=pool.sequence_slots)
