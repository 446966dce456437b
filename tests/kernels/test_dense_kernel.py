"""The Triton dense K/V gather for prefill (kernels/dense.gather_dense_kv) against the torch reference.

Every token of each sequence, this step's included (the store has run), is read from the int4 cache as the
reference reads it (reference.dequantize_sequence: full int4_kivi blocks per channel, the rest per token,
un-rotated) into dense pages [pages, block_size, Hkv, D], sequence i's page p at cu_pages[i] + p, rows past a
sequence's end 0; int4_kivi's last block holds its original keys. int4_kivi's own pages of the earlier blocks a
chunk touches: test_own_block_prefill.py. Interpreter on CPU (fp16), compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kv_batches import cache_with_prefix, make_paged_batch, scheme_head_dims, with_guard_blocks

from s4kv.kernels import reference as ref
from s4kv.kernels.dense import gather_dense_kv
from s4kv.kernels.prefill_plan import plan_prefill_pass
from s4kv.kernels.scheme import Int4Scheme

# Interpreter noise: garbage (poisoned) pages overflow; numpy deprecates 1-element array indices.
pytestmark = [
    pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

SCHEMES = {
    "kivi": Int4Scheme("int4_kivi"),
    "saw128": Int4Scheme("int4_saw", 128),
    "saw64-rotv": Int4Scheme("int4_saw", 64, rotate_values=True),
    "saw32": Int4Scheme("int4_saw", 32),
}
# (context, q_len): fresh prefill, chunks over cached prefixes (one closes a KIVI block), decodes at block edges
SPECS = [(0, 37), (200, 20), (100, 40), (127, 1), (256, 5)]
SPARE_PAGES = 2  # pages past the last sequence's must stay untouched


def gathered(batch, cache, scheme, seqs, head_dim):
    """(dense_k, dense_v, cu_pages) of the sequences ``seqs`` (a contiguous slice of the batch), as the backend
    gathers its prefill part: int4_kivi with the step's keys and pool, and its own pages in cu_pages
    (kernels/prefill_plan.py)."""
    rows = slice(seqs[0], seqs[-1] + 1)
    seq_lens = batch.seq_lens[rows]
    if scheme.is_kivi:  # 128-token pages and the own pages of the blocks each chunk touches
        q_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
        cu_pages = plan_prefill_pass(seq_lens.cpu(), q_lens[rows].cpu(), True).cu_pages.to(cache.device)
    else:  # pages of any block size
        pages = -(-seq_lens // batch.block_size)
        cu_pages = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).int()
    shape = (int(cu_pages[-1]) + SPARE_PAGES, batch.block_size, batch.num_kv_heads, head_dim)
    dense_k = torch.full(shape, float("nan"), dtype=torch.float16, device=cache.device)
    dense_v = torch.full_like(dense_k, float("nan"))
    own = batch.pool_read(scheme)
    if own:
        own["sequence_slots"] = own["sequence_slots"][rows]
        own["query_start_loc"] = batch.query_start_loc[seqs[0] : seqs[-1] + 2]
    gather_dense_kv(cache, batch.block_table[rows], seq_lens, cu_pages, int(seq_lens.max()), scheme, dense_k, dense_v,
                    head_dim, **own)
    return dense_k, dense_v, cu_pages


def assert_gathered_as_the_reference_reads(batch, cache, scheme, seqs, head_dim, dense_k, dense_v, cu_pages):
    assert torch.isnan(dense_k[-SPARE_PAGES:]).all() and torch.isnan(dense_v[-SPARE_PAGES:]).all(), (
        "wrote past the last page")
    bsz = batch.block_size
    for j, i in enumerate(seqs):
        n = int(batch.seq_lens[i])
        k_hat, v_hat = ref.dequantize_sequence(cache, batch.block_table[i], n, scheme, head_dim)
        if scheme.is_kivi:  # the last block: its queries' own, the original keys
            last = (n - 1) // bsz * bsz
            k_hat[last:] = batch.seq_keys[i][last:n].float()
        pages = int(cu_pages[j]) + torch.arange(-(-n // bsz), device=dense_k.device)
        for name, dense, want in (("K", dense_k, k_hat), ("V", dense_v, v_hat)):
            rows = dense[pages].flatten(0, 1)
            torch.testing.assert_close(rows[:n].float(), want, rtol=2e-3, atol=2e-3,
                                       msg=lambda m: f"sequence {i} {name}: {m}")
            assert (rows[n:] == 0).all(), f"sequence {i} {name}: rows past the end are not 0"


@pytest.mark.parametrize("scheme_name,head_dim", scheme_head_dims(SCHEMES))
@pytest.mark.parametrize("seqs", [range(len(SPECS)), range(1, 4)], ids=["whole batch", "slice of the batch"])
def test_gather_dense_kv_matches_reference(gen, kernel_device, scheme_name, head_dim, seqs):
    """A slice of the batch, as the backend passes its prefill part."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, SPECS, 4, 2, block_size=128, dtype=torch.float16, device=kernel_device,
                             num_padding=2, head_dim=head_dim)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    # the backend stores first
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    seqs = list(seqs)
    assert_gathered_as_the_reference_reads(batch, cache, scheme, seqs, head_dim,
                                           *gathered(batch, cache, scheme, seqs, head_dim))


@pytest.mark.parametrize("scheme_name", ["kivi", "saw128", "saw64-rotv"])
def test_vectors_past_fp16_range_once_rotated_are_gathered_finite(gen, kernel_device, scheme_name):
    """A key and a value with all 128 channels at 9000 (fp16 holds them) rotate to a first channel of 9000 * sqrt(b):
    101,823 for a 128-block, 72,000 for a 64-block, past fp16's 65504. The cache holds them with finite params;
    the gather must un-rotate them to 9000 again, not inf or NaN (FlashAttention then gives NaN)."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, [(200, 20)], 4, 2, block_size=128, dtype=torch.float16, device=kernel_device)
    for tensors in (batch.seq_keys, batch.seq_values):
        tensors[0][[5, 150], 1] = 9000.0  # a closed block (per channel for int4_kivi) and the open one
    batch.prefix_key, batch.prefix_value = batch.seq_keys[0][:200], batch.seq_values[0][:200]
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    dense_k, dense_v, cu_pages = gathered(batch, cache, scheme, [0], 128)
    k_hat, v_hat = ref.dequantize_sequence(cache, batch.block_table[0], 220, scheme, 128)
    if scheme.is_kivi:  # the last block holds the original keys
        k_hat[128:] = batch.seq_keys[0][128:220].float()
    dense_k, dense_v = (d[: int(cu_pages[1])].flatten(0, 1)[:220] for d in (dense_k, dense_v))
    for name, got, want in (("K", dense_k, k_hat), ("V", dense_v, v_hat)):
        assert torch.isfinite(got).all(), f"{name}: {int((~torch.isfinite(got)).sum())} non-finite gathered values"
        torch.testing.assert_close(got[[5, 150], 1].float(), want[[5, 150], 1], rtol=2e-3, atol=0.5,
                                   msg=lambda m: f"{name}, the large rows: {m}")
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 96])
def test_any_page_size_is_gathered_right_or_rejected(gen, kernel_device, block_size):
    scheme = SCHEMES["saw128"]
    batch = make_paged_batch(gen, [(100, 5), (40, 3)], 4, 2, block_size=block_size, dtype=torch.float16,
                             device=kernel_device)
    cache = with_guard_blocks(cache_with_prefix(batch, scheme, gen, kernel_device), gen)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    try:
        dense = gathered(batch, cache, scheme, [0, 1], 128)
    except ValueError as error:
        assert "block_size" in str(error)
        return
    assert_gathered_as_the_reference_reads(batch, cache, scheme, [0, 1], 128, *dense)


def test_pages_of_another_shape_or_layout_are_rejected(gen, kernel_device):
    """The kernel addresses dense_v with dense_k's strides: a dense_v of another shape or layout would be written
    wrong, so it is refused."""
    scheme = SCHEMES["saw128"]
    batch = make_paged_batch(gen, [(100, 5)], 4, 2, block_size=128, dtype=torch.float16, device=kernel_device)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    dense_k = torch.zeros(2, 128, 2, 128, dtype=torch.float16, device=kernel_device)
    cu_pages = torch.tensor([0, 1], dtype=torch.int32, device=kernel_device)
    for dense_v in (torch.zeros(3, 128, 2, 128, dtype=torch.float16, device=kernel_device),
                    torch.zeros(2, 2, 128, 128, dtype=torch.float16, device=kernel_device).transpose(1, 2)):
        with pytest.raises(ValueError, match="one shape and layout"):
            gather_dense_kv(cache, batch.block_table, batch.seq_lens, cu_pages, 105, scheme, dense_k, dense_v, 128)


def test_kivi_needs_its_originals_and_saw_takes_none(gen, kernel_device):
    """int4_kivi's gather writes its queries' own blocks from the original keys: without the step's keys, the pool
    or where each chunk starts it is refused, not gathered per token; int4_saw refuses them."""
    batch = make_paged_batch(gen, [(100, 40)], 4, 2, block_size=128, dtype=torch.float16, device=kernel_device)
    kivi, saw = SCHEMES["kivi"], SCHEMES["saw128"]
    cache = cache_with_prefix(batch, kivi, gen, kernel_device)
    dense_k = torch.zeros(3, 128, 2, 128, dtype=torch.float16, device=kernel_device)
    cu_pages = torch.tensor([0, 2], dtype=torch.int32, device=kernel_device)
    full = dict(batch.pool_read(kivi), query_start_loc=batch.query_start_loc)

    def gather(scheme, **own):
        gather_dense_kv(cache, batch.block_table, batch.seq_lens, cu_pages, 140, scheme, dense_k, dense_k.clone(),
                        128, **own)

    for left_out, message in (("new_keys", "needs new_keys"), ("staged_keys", "staging pool"),
                              ("query_start_loc", "needs query_start_loc")):
        with pytest.raises(ValueError, match=message):
            gather(kivi, **{k: v for k, v in full.items() if k != left_out})
    with pytest.raises(ValueError, match="takes no new_keys or query_start_loc"):
        gather(saw, new_keys=batch.key, query_start_loc=batch.query_start_loc)
    with pytest.raises(ValueError, match="takes no staging pool"):
        gather(saw, staged_keys=full["staged_keys"], sequence_slots=full["sequence_slots"])
