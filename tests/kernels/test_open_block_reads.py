"""int4_kivi with its staging pool: attention and the dense gather read the open block's keys from the pool.

After the store of a step, a sequence that ends inside a block has that block's keys, as the model produced them, in
its pool slot (``staged_keys[slot, head, offset]``); every closed block is per channel from its original keys. The
readers (reference.paged_attention / dequantize_sequence, the Triton attention kernel, the dense gather) take the
pool and one slot per sequence (-1 where the last block is full). Checked here: the reference against an
independent float64 oracle over [per-channel round trips of the closed blocks' keys | the original open keys] and
per-token round trips of the values, and the kernels' pool-argument errors. The kernels' reads under the read rule
(each query's own block from the original keys): test_own_block_attention.py and test_own_block_prefill.py.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import causal_attention
from kv_batches import cache_and_pool_with_prefix, make_paged_batch, relative_error

from s4kv.kernels import reference as ref
from s4kv.kernels.attention import paged_attention
from s4kv.kernels.scheme import Int4Scheme
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


def stored_batch(gen, specs, head_dim, kernel_device, num_q_heads=8, num_kv_heads=2):
    """A batch, its cache and pool with the cached prefixes, then the batch's own store (the reference)."""
    batch = make_paged_batch(gen, specs, num_q_heads, num_kv_heads, block_size=B, dtype=torch.float16,
                             device=kernel_device, num_padding=2, head_dim=head_dim)
    cache, pool = cache_and_pool_with_prefix(batch, gen, kernel_device)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, KIVI, pool.staged_keys, pool.per_token(batch))
    return batch, cache, pool


def reference_attention(batch, cache, pool) -> torch.Tensor:
    return ref.paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                               SOFTMAX_SCALE, KIVI, pool.staged_keys, pool.sequence_slots)


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


def test_bad_pool_arguments_get_clear_errors(gen, kernel_device):
    batch, cache, pool = stored_batch(gen, [(100, 1)], 64, kernel_device)
    out = torch.empty_like(batch.query)
    args = (batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1, SOFTMAX_SCALE)
    new_keys = {"new_keys": batch.key}
    with pytest.raises(ValueError, match="staged_keys and sequence_slots go together, and only with int4_kivi"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys)
    with pytest.raises(ValueError, match="staged_keys and sequence_slots go together, and only with int4_kivi"):
        paged_attention(*args, Int4Scheme("int4_saw"), out, staged_keys=pool.staged_keys,
                        sequence_slots=pool.sequence_slots)
    with pytest.raises(ValueError, match=r"sequence_slots must be int32 \[1\]"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots.long(),
                        **new_keys)
    with pytest.raises(ValueError, match=r"staged_keys must be \[slots, 2, 128, 64\]"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys[:, :1], sequence_slots=pool.sequence_slots,
                        **new_keys)
    with pytest.raises(ValueError, match="staged_keys must be torch.float16"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys.float(), sequence_slots=pool.sequence_slots,
                        **new_keys)
