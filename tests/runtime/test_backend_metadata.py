"""The GPU backend's metadata builder, without a GPU: which batches it plans as prefill (dense gather + FlashAttention,
host-side sizes) and which it leaves to the fused int4 kernel (graph-safe). vLLM captures full CUDA graphs of
uniform batches of 1 + num_speculative_tokens query tokens per request; such a batch must not be planned on the host,
or the captured graph would keep the capture's buffer sizes and sequence lengths."""

from __future__ import annotations

import pytest
import torch

from model_configs import QWEN25_7B, write_model_dir

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    from s4kv.runtime.backend import S4KVMetadataBuilder

    model = write_model_dir(tmp_path_factory.mktemp("models"), "qwen", QWEN25_7B)
    config = EngineArgs(model=str(model), skip_tokenizer_init=True, load_format="dummy", max_model_len=4096,
                        kv_cache_dtype="int4_per_token_head", attention_backend="CUSTOM",
                        additional_config={"s4kv": {"scheme": "int4_saw"}}).create_engine_config()
    spec = FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=128, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)
    with set_current_vllm_config(config):
        return S4KVMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu"))


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


@pytest.mark.parametrize("query_len", [1, 4, 16])
def test_decode_and_speculative_verification_batches_use_the_fused_kernel(builder, query_len):
    uniform = batch([query_len] * 3, [300, 1000, 17])
    assert builder.build(0, uniform).prefill is None
    assert builder.build_for_cudagraph_capture(uniform).prefill is None


def test_prefill_chunks_are_planned_for_flash_attention(builder, monkeypatch):
    import vllm.v1.attention.backends.fa_utils as fa_utils

    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda: 3)  # no FlashAttention build on the CPU
    mixed = batch([1, 1, 200], [500, 20, 300])  # decodes first, then a 200-token chunk over a 300-token prefix
    plan = builder.build(0, mixed).prefill
    assert plan is not None
    assert (plan.num_decodes, plan.num_decode_tokens, plan.max_query_len, plan.max_seq_len) == (2, 2, 200, 500)
    assert plan.dense_k.shape == (500, 4, 128) and plan.cu_seqlens_k.tolist() == [0, 500]
