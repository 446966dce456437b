"""The attention kernel at the head counts one tensor-parallel rank of Llama-3.1-70B sees (docs/parallel.md).

At TP 2 a rank holds 32 query and 4 KV heads, at TP 8 8 and 1: GQA groups of 8, which test_attention_kernel.py
(groups 1, 4, 7) does not cover. The split-KV workspace is allocated as the backend allocates it, from the rank's
head counts. Without CUDA this runs under the Triton interpreter (conftest.py), fp16, small batches.
"""

from __future__ import annotations

import pytest
import torch
from kv_batches import relative_error
from own_block_oracle import batch_rule_attention, stored_step

from s4kv.kernels.attention import SplitWorkspace, paged_attention
from s4kv.kernels.scheme import Int4Scheme

pytestmark = [
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

SCHEMES = {"kivi": Int4Scheme("int4_kivi"), "saw128": Int4Scheme("int4_saw", 128)}
RANK_HEADS = {"tp2": (32, 4), "tp8": (8, 1)}  # (query heads, KV heads) of one rank of the 70B
SOFTMAX_SCALE = 128**-0.5
MIXED = [(0, 70), (127, 1), (200, 20), (300, 1)]  # a fresh prefill, a chunk over a prefix, decodes
DECODE = [(0, 1), (127, 1), (300, 1), (5, 1)]
MAX_REL_ERR = 1e-2


def attend(batch, cache, pool, scheme, workspace=None) -> torch.Tensor:
    own_block = {} if pool is None else dict(new_keys=batch.key, staged_keys=pool.staged_keys,
                                             sequence_slots=pool.sequence_slots)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    batch.max_query_len, SOFTMAX_SCALE, scheme, out, workspace=workspace, **own_block)
    return out


@pytest.mark.parametrize("rank", list(RANK_HEADS))
@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_attention_at_the_heads_of_one_rank(gen, kernel_device, rank, scheme_name, specs):
    scheme = SCHEMES[scheme_name]
    num_q_heads, num_kv_heads = RANK_HEADS[rank]
    batch, cache, pool = stored_step(gen, specs, 128, kernel_device, num_q_heads, num_kv_heads, scheme, num_padding=1)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, scheme)
    workspace = None
    if specs is DECODE:
        # as S4KVMetadataBuilder allocates it, from this rank's heads; a small target forces several splits
        workspace = SplitWorkspace.allocate(num_q_heads, num_kv_heads, 128, kernel_device, num_splits=8)
        assert workspace.plan(len(DECODE)).splits > 1
        workspace.part_acc.fill_(float("nan"))
        workspace.part_ml.fill_(float("nan"))
    out = attend(batch, cache, pool, scheme, workspace)
    assert not torch.isnan(out).any(), f"{rank} {scheme_name}: NaN in the output"
    err = relative_error(out.cpu(), expected)
    assert err < MAX_REL_ERR, f"{rank} {scheme_name}: relative error {err:.2e} against the read rule's oracle"
