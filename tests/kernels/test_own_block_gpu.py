"""The read rule on the GPU at real sizes (bf16, compiled kernels, vLLM's FlashAttention): the decode kernel with its
default launch and split-KV workspace, and the backend's FlashAttention prefill (runtime/plugin/backend.flash_prefill:
one causal pass, int4_kivi's over segments with their own pages), each against the float64 oracle of
own_block_oracle.py. Needs CUDA and vLLM's FA (the device jobs: tools/device/ownread_gpu.sh).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from kv_batches import relative_error
from own_block_oracle import B, KIVI, batch_rule_attention, stored_step

from s4kv.kernels.attention import CODE_PATHS, DECODE_LAUNCH, SUBNORMAL_HEAD_DIMS, SplitWorkspace, paged_attention
from s4kv.kernels.prefill_plan import plan_prefill_pass
from s4kv.kernels.scheme import Int4Scheme

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and vLLM's FlashAttention")]

SOFTMAX_SCALE = 0.088
# (query heads, KV heads, head_dim): Llama-3 8B's GQA 4 at 128, SmolLM2's 9/3 at 64
SHAPES = [(32, 8, 128), (9, 3, 64)]
SCHEMES = {"kivi": KIVI, "saw": Int4Scheme("int4_saw"), "saw-rotv": Int4Scheme("int4_saw", 64, rotate_values=True)}
# decodes at offsets 0, 1 and 127 of their block (127 closes it), long contexts
DECODE = [(4096, 1), (4097, 1), (4223, 1), (0, 1), (32767, 1), (1000, 1), (128, 1), (2047, 1)]
# a chunk starting mid-block over 17 blocks, a first chunk from 0, one closing the block it starts in, a chunk on a
# block boundary after a long prefix, a small chunk mid-block
PREFILL = [(100, 2000), (0, 700), (30, 98), (4096, 512), (5000, 37)]


def bf16_step(specs, num_q_heads, num_kv_heads, head_dim, scheme, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, cache, pool = stored_step(gen, specs, head_dim, "cuda", num_q_heads, num_kv_heads, scheme,
                                     kernel_store=True, dtype=torch.bfloat16)
    return batch, cache, pool


def _cases():
    return [(name, shape) for name in SCHEMES for shape in SHAPES
            if SCHEMES[name].hadamard_block is None or shape[2] % SCHEMES[name].hadamard_block == 0]


@functools.cache
def decode_case(name, shape):
    """The decode batch of a (scheme, shape), its stored cache and pool, and the oracle's output: made once for
    every code path."""
    num_q, num_kv, head_dim = shape
    batch, cache, pool = bf16_step(DECODE, num_q, num_kv, head_dim, SCHEMES[name], 7)
    return batch, cache, pool, batch_rule_attention(batch, SOFTMAX_SCALE, SCHEMES[name])


@pytest.mark.parametrize("wide", [False, True], ids=["bytes", "wide"])
@pytest.mark.parametrize("codes", list(CODE_PATHS))
@pytest.mark.parametrize("name,shape", _cases())
def test_decode_follows_the_rule(name, shape, codes, wide):
    """Every code path (attention.CODE_PATHS) of the scheme's decode launch, split-KV as the backend sizes it, with
    the codes read a byte or two bytes per element (LaunchConfig.wide_code_loads)."""
    num_q, num_kv, head_dim = shape
    scheme = SCHEMES[name]
    launch = dataclasses.replace(DECODE_LAUNCH[scheme.name], **CODE_PATHS[codes], wide_code_loads=wide)
    if launch.subnormal_codes and head_dim not in SUBNORMAL_HEAD_DIMS:
        pytest.skip("the subnormal codes are refused at this head_dim (test_attention_kernel.py)")
    batch, cache, pool, expected = decode_case(name, shape)
    workspace = SplitWorkspace.allocate(num_q, num_kv, head_dim, "cuda", scheme.name, max_num_seqs=len(DECODE))
    out = torch.full_like(batch.query, float("nan"))
    pool_args = {} if pool is None else dict(staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots)
    paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1, SOFTMAX_SCALE,
                    scheme, out, workspace=workspace, launch=launch, new_keys=batch.key, **pool_args)
    assert not torch.isnan(out).any()
    assert relative_error(out.cpu(), expected) < 1e-2


@pytest.mark.parametrize("name,shape", _cases())
def test_flash_prefill_follows_the_rule(name, shape):
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    from s4kv.runtime.plugin.backend import PrefillPlan, flash_prefill

    num_q, num_kv, head_dim = shape
    scheme = SCHEMES[name]
    batch, cache, pool = bf16_step(PREFILL, num_q, num_kv, head_dim, scheme, 11)
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).cpu()
    pages = plan_prefill_pass(batch.seq_lens.cpu(), q_lens, scheme.is_kivi)
    dense_k = torch.full((pages.num_pages, B, num_kv, head_dim), float("nan"), dtype=batch.key.dtype, device="cuda")
    plan = PrefillPlan(num_decodes=0, num_decode_tokens=0, decode_max_query_len=0,
                       cu_pages=pages.cu_pages.cuda(), flash=pages.flash.to("cuda"),
                       max_query_len=batch.max_query_len, max_seq_len=int(batch.seq_lens.max()), dense_k=dense_k,
                       dense_v=torch.full_like(dense_k, float("nan")), fa_version=get_flash_attn_version())
    out = torch.full_like(batch.query, float("nan"))
    pool_args = {} if pool is None else dict(new_keys=batch.key, staged_keys=pool.staged_keys,
                                             sequence_slots=pool.sequence_slots)
    flash_prefill(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, plan, scheme,
                  SOFTMAX_SCALE, head_dim, out, **pool_args)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, scheme)
    assert not torch.isnan(out).any()
    assert relative_error(out.cpu(), expected) < 1e-2
    if scheme.is_kivi:  # the Triton kernel's multi-query path reads the same
        fused = torch.full_like(batch.query, float("nan"))
        paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                        batch.max_query_len, SOFTMAX_SCALE, scheme, fused, new_keys=batch.key,
                        staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots)
        assert relative_error(fused.cpu(), expected) < 1e-2
