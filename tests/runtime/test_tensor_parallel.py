"""S4 KV under tensor parallelism, decided without a GPU (docs/parallel.md).

vLLM shards attention by heads: at tensor parallel size tp each rank holds num_heads / tp query heads and
max(1, num_kv_heads / tp) KV heads, and builds its attention layers, KV-cache spec and metadata builder from those
counts. For the Llama-3.1-70B shape (64 query / 8 KV heads) at TP 2 that is 32 / 4 per rank; at TP 8, 8 / 1. Here
vLLM's own VllmConfig for those layouts goes through our checks, and the backend is built from the per-rank counts
vLLM reports: the split-KV workspace, the page shape and its bytes, the attention impl. The kernels at those head
counts: tests/kernels/test_attention_tp_ranks.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from s4kv.runtime.sizing import capacity, catalog, model_shapes
from s4kv.runtime.plugin.config import S4KVConfig, check_vllm_config

from model_configs import QWEN25_7B, write_model_dir

pytest.importorskip("vllm")

LLAMA70B_CONFIG = "configs/llama-3.1-70b-instruct.json"
S4KV_ARGS = {"kv_cache_dtype": "int4_per_token_head", "attention_backend": "CUSTOM"}


def int4_page_spec(kv_heads: int):
    """vLLM's KV-cache spec of one rank's attention layer for int4_per_token_head pages of 128 tokens."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    return FullAttentionSpec(block_size=128, num_kv_heads=kv_heads, head_size=128, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory, request):
    root = request.config.rootpath
    config = json.loads((root / LLAMA70B_CONFIG).read_text())
    return write_model_dir(tmp_path_factory.mktemp("models"), "llama-3.1-70b-instruct", config)


def vllm_config(model_dir, tp: int, scheme: str | None = "int4_kivi", dp: int = 1):
    from vllm.engine.arg_utils import EngineArgs

    args = {"model": str(model_dir), "skip_tokenizer_init": True, "load_format": "dummy", "max_model_len": 2048,
            "tensor_parallel_size": tp, "data_parallel_size": dp}
    if scheme:
        args.update(S4KV_ARGS, additional_config={"s4kv": {"scheme": scheme}})
    return EngineArgs(**args).create_engine_config()


@pytest.mark.parametrize("tp, q_per_rank, kv_per_rank", [(1, 64, 8), (2, 32, 4), (8, 8, 1)])
@pytest.mark.parametrize("scheme", ["int4_kivi", "int4_saw"])
def test_engine_check_accepts_tensor_parallel_layouts(llama70b, tp, q_per_rank, kv_per_rank, scheme):
    config = vllm_config(llama70b, tp, scheme)
    assert config.parallel_config.tensor_parallel_size == tp
    assert check_vllm_config(config) == S4KVConfig.parse({"scheme": scheme})
    model, parallel = config.model_config, config.parallel_config
    assert (model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel)) == (q_per_rank, kv_per_rank)


def test_kv_heads_replicated_over_more_ranks_than_heads(tmp_path):
    """Qwen2.5-7B's 4 KV heads at TP 4 (28 query heads split 7 per rank) leave one per rank; at TP 8 vLLM cannot
    split its 28 query heads at all, and says so before S4 KV is asked."""
    qwen = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    config = vllm_config(qwen, 4)
    assert check_vllm_config(config) is not None
    assert config.model_config.get_num_kv_heads(config.parallel_config) == 1
    with pytest.raises(Exception, match="divisible"):
        vllm_config(qwen, 8)


@pytest.mark.parametrize("tp", [2, 8])
def test_backend_is_sized_from_the_heads_of_one_rank(llama70b, tp):
    config = vllm_config(llama70b, tp)
    q_heads = config.model_config.get_num_attention_heads(config.parallel_config)
    kv_heads = config.model_config.get_num_kv_heads(config.parallel_config)
    spec = int4_page_spec(kv_heads)
    from vllm.config import set_current_vllm_config

    from s4kv.kernels.layout import PageLayout
    from s4kv.runtime.plugin.backend import S4KVAttentionBackend, S4KVAttentionImpl, S4KVMetadataBuilder

    with set_current_vllm_config(config):
        builder = S4KVMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu"))
        impl = S4KVAttentionImpl(q_heads, 128, 128**-0.5, kv_heads, None, None, "int4_per_token_head")
        reason = S4KVAttentionBackend.supports_combination(128, torch.bfloat16, "int4_per_token_head", 128,
                                                           False, False, False, False, None)
    assert reason is None
    # the split-KV decode buffers hold this rank's query heads: paged_attention refuses any other count
    assert (builder.workspace.num_q_heads, builder.workspace.num_kv_heads) == (q_heads, kv_heads)
    assert builder.workspace.part_ml.shape[0] % q_heads == 0
    assert (impl.num_heads, impl.num_kv_heads) == (q_heads, kv_heads)
    # one page per rank holds this rank's KV heads, and vLLM budgets exactly the bytes our layout fills
    shape = S4KVAttentionBackend.get_kv_cache_shape(10, 128, kv_heads, 128, "int4_per_token_head")
    assert shape == (10, kv_heads, PageLayout(128, 128).page_bytes)
    assert spec.page_size_bytes == math.prod(shape[1:])


def test_capacity_plan_counts_kv_bytes_per_rank_as_vllm_pages_do(llama70b):
    """`s4kv capacity` (what the CDK toolkit deploys) plans the 70B on an 8 x H200 instance at the layout with the
    most concurrent requests (TP 8: the weights split eight ways leave the most KV per GPU), vLLM's config of exactly
    those flags passes our checks, and the plan sizes int4 blocks per GPU from the KV heads of one rank, as vLLM's
    page spec does."""
    model = model_shapes.load(str(llama70b))
    instance = catalog.instance_type("p5en.48xlarge")
    plan = capacity.plan(model, instance, "int4_kivi", context=8192)
    assert (plan.tensor_parallel, plan.data_parallel) == (8, 1)
    assert plan.vllm_args()[:2] == ["--tensor-parallel-size", "8"]
    config = vllm_config(llama70b, plan.tensor_parallel, dp=plan.data_parallel)
    assert config.parallel_config.world_size_across_dp == 8
    assert check_vllm_config(config) == S4KVConfig.parse({"scheme": "int4_kivi"})
    kv_heads = config.model_config.get_num_kv_heads(config.parallel_config)
    spec = int4_page_spec(kv_heads)
    fmt = capacity.KV_FORMATS["int4"]
    planned_block_bytes = (fmt.block_size * model.num_layers * math.ceil(model.num_kv_heads / plan.tensor_parallel)
                           * fmt.bytes_per_head_token(model.head_dim))
    assert planned_block_bytes == spec.page_size_bytes * model.num_layers
