"""The CPU engine's batched attention (kernels/cpu_attention.py) against the torch reference it replaces in the CPU
backend (kernels/reference.paged_attention), on fresh random data in poisoned caches with shuffled pages: both
schemes (and int4_saw with rotated values), head_dim 64 and 128, GQA groups 1 to 7, many pages, odd lengths, mixed
prefill + decode batches, prefix-cached starts inside and on block edges, int4_kivi's own block from the staging pool
and the step's keys, a missing pool slot, NaN-poisoned values, and groups split by the score budget. The two
compute the same float32 attention in different orders, so they agree to float32 rounding, and NaN in exactly the
same (token, head) rows.

Speed against the reference: ``PYTHONPATH=tests python tests/kernels/bench_cpu_attention.py`` prints a table.
"""

from __future__ import annotations

import pytest
import torch
from kv_batches import scheme_head_dims
from own_block_oracle import KIVI, stored_step

from s4kv.kernels import cpu_attention, reference
from s4kv.kernels.scheme import Int4Scheme

pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning")

SOFTMAX_SCALE = 0.125
SCHEMES = {"int4_kivi": KIVI, "int4_saw": Int4Scheme("int4_saw"),
           "int4_saw-rotv": Int4Scheme("int4_saw", hadamard_block=32, rotate_values=True)}
# (context, new tokens): decodes at block offsets 0, 1 and 127 (closing the block) and deep in a long sequence; a
# prefill from 0 over two blocks; chunks starting mid-block (the pool's rows) spanning up to three blocks; a
# prefix-cached start on a block edge; odd lengths
MIXED = [(0, 1), (128, 1), (257, 1), (127, 1), (1000, 1), (0, 150), (100, 200), (30, 98), (256, 37), (383, 1),
         (260, 7), (5, 7)]
DECODES = [(c, 1) for c in (0, 1, 126, 127, 128, 129, 300, 511, 777, 1023)]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Many small tensor ops: one thread runs them faster than two (as in the reference tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def both(batch, cache, pool, scheme, sequence_slots=None, dtype=None):
    """(batched, reference) outputs of one step; ``dtype`` casts the query and step keys (the model's dtype)."""
    query = batch.query if dtype is None else batch.query.to(dtype)
    args = (query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, SOFTMAX_SCALE, scheme)
    kwargs = {}
    if pool is not None:
        slots = pool.sequence_slots if sequence_slots is None else sequence_slots
        new_keys = batch.key if dtype is None else batch.key.to(dtype)
        staged = pool.staged_keys if dtype is None else pool.staged_keys.to(dtype)
        kwargs = dict(staged_keys=staged, sequence_slots=slots, new_keys=new_keys)
    return cpu_attention.paged_attention(*args, **kwargs), reference.paged_attention(*args, **kwargs)


def assert_same(fast: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert fast.dtype == torch.float32 and fast.shape == expected.shape, what
    assert torch.equal(torch.isnan(fast), torch.isnan(expected)), f"{what}: NaN in different places"
    torch.testing.assert_close(fast, expected, rtol=1e-4, atol=5e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name,head_dim", scheme_head_dims(SCHEMES))
@pytest.mark.parametrize("group,num_kv_heads", [(1, 2), (3, 3), (7, 1)])
def test_mixed_prefill_and_decode_batches_match_the_reference(gen, name, head_dim, group, num_kv_heads):
    scheme = SCHEMES[name]
    batch, cache, pool = stored_step(gen, MIXED, head_dim, "cpu", num_q_heads=group * num_kv_heads,
                                     num_kv_heads=num_kv_heads, scheme=scheme)
    fast, expected = both(batch, cache, pool, scheme)
    assert not torch.isnan(expected).any()
    assert_same(fast, expected, f"{name} head_dim {head_dim} GQA {group}")


@pytest.mark.parametrize("name,head_dim", scheme_head_dims(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_batches_of_many_pages_in_the_model_dtype(gen, name, head_dim, dtype):
    """One group of ten decodes (contexts up to eight pages), inputs in bf16 as vLLM's CPU engine runs them."""
    scheme = SCHEMES[name]
    batch, cache, pool = stored_step(gen, DECODES, head_dim, "cpu", num_q_heads=9, num_kv_heads=3, scheme=scheme)
    fast, expected = both(batch, cache, pool, scheme, dtype=dtype)
    assert_same(fast, expected, f"{name} {dtype}")


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_broken_value_poisons_the_same_queries(gen, name):
    """NaN values in a chunk from 0, in a chunk over a prefix crossing a block edge and in a decode's own token."""
    scheme = SCHEMES[name]
    batch, cache, pool = stored_step(gen, [(0, 70), (100, 40), (300, 1), (128, 1)], 64, "cpu", scheme=scheme,
                                     poison={0: 30, 1: 120, 2: 300})
    fast, expected = both(batch, cache, pool, scheme)
    assert torch.isnan(expected).any() and not torch.isnan(expected).all()
    assert_same(fast, expected, name)


def test_a_needed_pool_row_without_a_slot_is_nan_in_the_same_queries(gen):
    """Sequence 0's chunk starts at 100 inside block 0 and sequence 2's decode at offset 44: without their slots the
    queries that need pool rows are NaN, the others (blocks after the start block, a decode at offset 0) are not."""
    batch, cache, pool = stored_step(gen, [(100, 200), (256, 1), (300, 1)], 64, "cpu")
    missing = pool.sequence_slots.clone()
    missing[0] = missing[2] = -1
    fast, expected = both(batch, cache, pool, KIVI, sequence_slots=missing)
    assert torch.isnan(expected).any() and not torch.isnan(expected).all()
    assert_same(fast, expected, "slot -1")


def test_groups_split_by_the_score_budget(gen, monkeypatch):
    """A budget so small that every sequence runs in a group of its own gives the same output (other padding, so
    equal to float32 rounding)."""
    batch, cache, pool = stored_step(gen, MIXED, 64, "cpu")
    whole, expected = both(batch, cache, pool, KIVI)
    monkeypatch.setattr(cpu_attention, "MAX_SCORE_ELEMENTS", 1)
    split, _ = both(batch, cache, pool, KIVI)
    assert_same(whole, expected, "one group per query length")
    assert_same(split, expected, "one group per sequence")


def test_bad_arguments_are_refused_as_the_reference_refuses_them(gen):
    batch, cache, pool = stored_step(gen, [(100, 3)], 64, "cpu")
    args = (batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, SOFTMAX_SCALE, KIVI)
    with pytest.raises(ValueError, match="int4_kivi needs its staging pool"):
        cpu_attention.paged_attention(*args, new_keys=batch.key)
    with pytest.raises(ValueError, match="needs the step's keys"):
        cpu_attention.paged_attention(*args, staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots)
    with pytest.raises(ValueError, match="sequence_slots must be int32"):
        cpu_attention.paged_attention(*args, staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots.long(),
                                      new_keys=batch.key)
