"""The GPU backend's metadata builder, without a GPU: which rows it plans on the host for the dense gather +
FlashAttention (prefill chunks, exact host lengths) and which it leaves to the fused int4 kernel, which reads the
sequence lengths on the device. With speculative decoding a decode row has 1 + drafts query tokens, vLLM's host
length of it is only an upper bound (async scheduling assumes every draft accepted), and vLLM captures uniform
batches of such rows in full CUDA graphs: none of that may be planned on the host."""

from __future__ import annotations

import pytest
import torch

from model_configs import QWEN25_7B, write_model_dir

from s4kv.runtime.bundled_models import NGRAM_DRAFTS

pytest.importorskip("vllm")


def make_builder(model_dir, speculative: dict | None, scheme: str = "int4_saw", cpu: bool = False):
    """The builder of the CUDA path (its kernels' metadata, built on the CPU here), or the CPU platform's."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    from s4kv.runtime.plugin.backend import S4KVMetadataBuilder
    from s4kv.runtime.plugin.cpu_backend import S4KVCpuMetadataBuilder

    config = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", max_model_len=4096,
                        kv_cache_dtype="int4_per_token_head", attention_backend="CUSTOM",
                        additional_config={"s4kv": {"scheme": scheme}},
                        speculative_config=speculative).create_engine_config()
    spec = FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=128, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)
    with set_current_vllm_config(config):
        builder = S4KVCpuMetadataBuilder if cpu else S4KVMetadataBuilder
        return builder(spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("models"), "qwen", QWEN25_7B)


@pytest.fixture(scope="module")
def plain(model_dir):
    return make_builder(model_dir, None)


@pytest.fixture(scope="module")
def drafting(model_dir):
    return make_builder(model_dir, NGRAM_DRAFTS)


@pytest.fixture(autouse=True)
def flash_attention_version(monkeypatch):
    import vllm.v1.attention.backends.fa_utils as fa_utils

    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda: 3)  # no FlashAttention build on the CPU


def batch(query_lens: list[int], context_lens: list[int]):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32)
    blocks = -(-int(seq_lens.max()) // 128)
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=len(query_lens),
        num_actual_tokens=int(starts[-1]), max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.arange(len(query_lens) * blocks, dtype=torch.int32).view(len(query_lens), blocks),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
    )


def test_decodes_are_one_token_without_drafts_and_one_plus_drafts_with_them(plain, drafting):
    assert plain.reorder_batch_threshold == 1
    assert drafting.reorder_batch_threshold == 1 + NGRAM_DRAFTS["num_speculative_tokens"]


@pytest.mark.parametrize("builder_name, query_len", [("plain", 1), ("drafting", 1), ("drafting", 4)])
def test_batches_of_decodes_are_never_planned_on_the_host(request, builder_name, query_len):
    builder = request.getfixturevalue(builder_name)
    uniform = batch([query_len] * 3, [300, 1000, 17])
    assert builder.build(0, uniform).prefill is None
    assert builder.build_for_cudagraph_capture(uniform).prefill is None


def test_prefill_chunks_are_planned_for_flash_attention(plain):
    plan = plain.build(0, batch([1, 1, 200], [500, 20, 300])).prefill  # decodes first, then a 200-token chunk
    assert plan is not None
    assert (plan.num_decodes, plan.num_decode_tokens, plan.decode_max_query_len) == (2, 2, 1)
    assert (plan.max_query_len, plan.max_seq_len) == (200, 500)
    # int4_saw: the chunk's sequence as 4 dense 128-token pages, one causal FA pass over all 500 keys
    assert plan.dense_k.shape == (4, 128, 4, 128) and plan.cu_pages.tolist() == [0, 4]
    assert plan.flash.seqused_k.tolist() == [500] and plan.flash.block_table.tolist() == [[0, 1, 2, 3]]
    assert plan.flash.cu_seqlens_q.tolist() == [0, 200]


def test_steps_with_prefill_slice_their_decode_and_prefill_rows_once(model_dir, plain):
    """Every layer's attention reads the decodes' and the prefills' metadata from views the builder sliced once per
    step (S4KVMetadata.decode_rows, prefill_rows); a step of decodes alone has none, a step of prefills alone no
    decode rows."""
    kivi = make_builder(model_dir, None, "int4_kivi")
    m = kivi.build(0, batch([1, 1, 200, 5], [500, 20, 300, 0]))
    d, p = m.decode_rows, m.prefill_rows
    assert torch.equal(d.block_table, m.block_table[:2]) and torch.equal(p.block_table, m.block_table[2:])
    assert d.seq_lens.tolist() == [501, 21] and p.seq_lens.tolist() == [500, 5]
    assert d.query_start_loc.tolist() == [0, 1, 2] and p.query_start_loc.tolist() == [2, 202, 207]
    assert torch.equal(d.sequence_slots, m.sequence_slots[:2]) and torch.equal(p.sequence_slots, m.sequence_slots[2:])
    assert plain.build(0, batch([1, 200], [500, 300])).decode_rows.sequence_slots is None  # int4_saw has no pool
    prefills_only = plain.build(0, batch([200], [300]))
    assert prefills_only.decode_rows is None and prefills_only.prefill_rows.seq_lens.tolist() == [500]
    decodes = plain.build(0, batch([1, 1], [500, 20]))
    assert decodes.decode_rows is None and decodes.prefill_rows is None


def test_rows_with_drafts_stay_with_the_fused_kernel_beside_a_prefill_chunk(drafting):
    plan = drafting.build(0, batch([4, 4, 200], [500, 20, 300])).prefill
    assert (plan.num_decodes, plan.num_decode_tokens, plan.decode_max_query_len) == (2, 8, 4)
    assert plan.flash.cu_seqlens_q.tolist() == [0, 200] and plan.flash.seqused_k.tolist() == [500]


def test_int4_kivi_prefill_is_planned_as_one_pass_over_block_segments(model_dir):
    """A 200-token chunk from position 100 beside a decode: three segments (its queries in blocks 0, 1 and 2), each
    over the blocks before its own per channel and its own block from an own page of original keys (the last block's
    is its page, blocks 0 and 1 get pages 3 and 4 after the sequence's three)."""
    plan = make_builder(model_dir, None, "int4_kivi").build(0, batch([1, 200], [500, 100])).prefill
    assert plan.cu_pages.tolist() == [0, 5] and plan.dense_k.shape == plan.dense_v.shape == (5, 128, 4, 128)
    assert plan.flash.cu_seqlens_q.tolist() == [0, 28, 156, 200] and plan.flash.seqused_k.tolist() == [128, 256, 300]
    assert plan.flash.block_table.tolist() == [[3, 3, 3], [0, 4, 4], [0, 1, 2]]
    assert (plan.flash.max_seqlen_q, plan.flash.max_seqlen_k) == (128, 300)


def test_the_dense_budget_counts_the_sequences_pages_and_int4_kivi_own_pages_come_on_top(model_dir):
    """A 200-token chunk from position 100: three pages of the sequence (4 KV heads x 128 channels, bf16: 256 KiB
    of K and V each) plus int4_kivi's two own pages. A budget of exactly the three keeps FlashAttention; one byte less
    sends the prefill to the int4 kernel (no plan)."""
    kivi = make_builder(model_dir, None, "int4_kivi")
    page_bytes = 2 * 128 * 4 * 128 * 2
    kivi.dense_budget_bytes = 3 * page_bytes
    plan = kivi.build(0, batch([1, 200], [500, 100])).prefill
    assert plan is not None and plan.dense_k.shape[0] == 5
    kivi.dense_budget_bytes = 3 * page_bytes - 1
    assert kivi.build(0, batch([1, 200], [500, 100])).prefill is None


def test_int4_kivi_steps_with_prefill_list_their_closing_rows(model_dir, plain):
    """The store's close of a step with prefill (eager) runs over the rows that write a block's last slot, which the
    builder lists from the host lengths; decode-only steps (full CUDA graphs) and int4_saw list none."""
    kivi = make_builder(model_dir, None, "int4_kivi")
    # a decode at position 127, a decode at 500, a 200-token chunk over positions 100..299, a 5-token prefill
    mixed = batch([1, 1, 200, 5], [127, 500, 100, 0])
    rows = kivi.build(0, mixed).close_rows
    assert rows.dtype == torch.int32 and rows.device == kivi.device and rows.tolist() == [0, 2 + 27, 2 + 155]
    assert kivi.build(0, batch([1, 1, 100], [500, 20, 130])).close_rows.tolist() == []  # positions 130..229
    assert kivi.build(0, batch([1, 1], [127, 255])).close_rows is None
    assert kivi.build_for_cudagraph_capture(batch([1, 1], [127, 255])).close_rows is None
    assert plain.build(0, mixed).close_rows is None
    # the CPU platform's torch store finds them itself
    assert make_builder(model_dir, None, "int4_kivi", cpu=True).build(0, mixed).close_rows is None
    # a configuration that captures the KV-cache update inside piecewise CUDA graphs would freeze the grid: none listed
    kivi.update_runs_eagerly = False
    assert kivi.build(0, mixed).close_rows is None


def test_int4_kivi_stages_in_the_store_unless_the_step_overwrites_pool_rows_it_reads(model_dir, plain):
    """int4_kivi's store stages the open blocks' keys in its own launch (S4KVMetadata.stage_in_store) in every step
    but one with a chunk that starts inside a block and ends inside a later one (it re-keys its slot while the close
    and attention still read the first block's earlier rows there); decode-only steps and their CUDA-graph capture
    always; int4_saw stages nothing; a KV update inside piecewise graphs never (its launch would be frozen)."""
    kivi = make_builder(model_dir, None, "int4_kivi")
    decodes = batch([1, 1], [127, 255])
    assert kivi.build(0, decodes).stage_in_store
    assert kivi.build_for_cudagraph_capture(decodes).stage_in_store
    assert kivi.build(0, batch([1, 1, 1000], [500, 20, 0])).stage_in_store  # a prompt from position 0
    assert kivi.build(0, batch([1, 300], [500, 256])).stage_in_store  # a chunk from a block boundary
    assert kivi.build(0, batch([1, 100], [500, 130])).stage_in_store  # a chunk inside one block
    assert kivi.build(0, batch([1, 126], [500, 130])).stage_in_store  # a chunk that ends on a block boundary
    assert not kivi.build(0, batch([1, 127], [500, 130])).stage_in_store  # ends one position into the next block
    assert not plain.build(0, batch([1, 127], [500, 130])).stage_in_store
    kivi.update_runs_eagerly = False
    assert not kivi.build(0, decodes).stage_in_store


def test_closing_rows_only_where_the_kv_update_runs_outside_piecewise_graphs():
    from vllm.config import CompilationConfig, CUDAGraphMode

    from s4kv.runtime.plugin.backend import kv_update_runs_eagerly

    attention, updates = ["vllm::unified_attention_with_output"], ["vllm::unified_kv_cache_update",
                                                                   "vllm::unified_mla_kv_cache_update"]
    piecewise = CUDAGraphMode.FULL_AND_PIECEWISE
    assert kv_update_runs_eagerly(CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE, splitting_ops=attention))
    assert kv_update_runs_eagerly(CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY))
    # vLLM's default: splitting_ops filled in later, with the update among them
    assert kv_update_runs_eagerly(CompilationConfig(cudagraph_mode=piecewise))
    assert kv_update_runs_eagerly(CompilationConfig(cudagraph_mode=piecewise, splitting_ops=attention + updates))
    assert not kv_update_runs_eagerly(CompilationConfig(cudagraph_mode=piecewise, splitting_ops=attention))
    assert not kv_update_runs_eagerly(CompilationConfig(cudagraph_mode=piecewise, splitting_ops=attention + updates,
                                                        use_inductor_graph_partition=True))
