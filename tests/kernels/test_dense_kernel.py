"""The Triton dense K/V gather for prefill (kernels/dense.py) against the torch reference.

Each sequence's slice of the dense buffer must be ``[its cached prefix, dequantized as the reference reads it |
its fresh key/value rows, copied exactly]``. Interpreter on CPU (fp16, ~30 s of CI), compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kv_batches import cache_with_prefix, dense_reference, make_paged_batch, scheme_head_dims, with_guard_blocks

from s4kv.kernels import reference as ref
from s4kv.kernels.dense import gather_dense_kv
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


@pytest.mark.parametrize("scheme_name,head_dim", scheme_head_dims(SCHEMES))
@pytest.mark.parametrize("seqs", [range(len(SPECS)), range(1, 4)], ids=["whole batch", "slice of the batch"])
def test_gather_dense_kv_matches_reference(gen, kernel_device, scheme_name, head_dim, seqs):
    """A slice of the batch keeps absolute query_start_loc rows, as the backend passes its prefill part."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, SPECS, 4, 2, block_size=128, dtype=torch.float16, device=kernel_device,
                             num_padding=2, head_dim=head_dim)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)  # the backend stores first
    seqs = list(seqs)
    seq_lens = batch.seq_lens[seqs[0] : seqs[-1] + 1]
    cu_seqlens_k = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)]).int()
    total = int(cu_seqlens_k[-1])
    spare = 5  # rows past the last sequence must stay untouched
    dense_k = torch.full((total + spare, 2, head_dim), float("nan"), dtype=torch.float16, device=kernel_device)
    dense_v = torch.full_like(dense_k, float("nan"))
    gather_dense_kv(batch.key, batch.value, cache, batch.block_table[seqs[0] : seqs[-1] + 1], seq_lens,
                    batch.query_start_loc[seqs[0] : seqs[-1] + 2], cu_seqlens_k, int(seq_lens.max()), scheme,
                    dense_k, dense_v)

    assert torch.isnan(dense_k[total:]).all() and torch.isnan(dense_v[total:]).all(), "wrote past the last sequence"
    ks, vs = dense_reference(batch, cache, scheme, seqs)
    starts = batch.query_start_loc.tolist()
    for j, i in enumerate(seqs):
        rows = slice(int(cu_seqlens_k[j]), int(cu_seqlens_k[j + 1]))
        q_len = starts[i + 1] - starts[i]
        for name, got, want in (("K", dense_k[rows], ks[j]), ("V", dense_v[rows], vs[j])):
            assert torch.equal(got[-q_len:], want[-q_len:].half()), (
                f"sequence {i}: fresh {name} rows not copied exactly")
            torch.testing.assert_close(got[:-q_len].float(), want[:-q_len], rtol=2e-3, atol=2e-3,
                                       msg=lambda m: f"sequence {i}, cached {name} prefix: {m}")


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 96])
def test_any_page_size_is_gathered_right_or_rejected(gen, kernel_device, block_size):
    scheme = SCHEMES["saw128"]
    batch = make_paged_batch(gen, [(100, 5), (40, 3)], 4, 2, block_size=block_size, dtype=torch.float16,
                             device=kernel_device)
    cache = with_guard_blocks(cache_with_prefix(batch, scheme, gen, kernel_device), gen)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    cu_seqlens_k = torch.cat([batch.seq_lens.new_zeros(1), batch.seq_lens.cumsum(0)]).int()
    dense_k = torch.full((int(cu_seqlens_k[-1]), 2, 128), float("nan"), dtype=torch.float16, device=kernel_device)
    dense_v = torch.full_like(dense_k, float("nan"))
    try:
        gather_dense_kv(batch.key, batch.value, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                        cu_seqlens_k, int(batch.seq_lens.max()), scheme, dense_k, dense_v)
    except ValueError as error:
        assert "block_size" in str(error)
        return
    ks, vs = dense_reference(batch, cache, scheme, range(2))
    torch.testing.assert_close(dense_k.float(), torch.cat(ks), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dense_v.float(), torch.cat(vs), rtol=2e-3, atol=2e-3)
