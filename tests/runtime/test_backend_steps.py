"""The GPU path's attention layer (S4KVAttentionImpl with S4KVMetadataBuilder) as the engine drives it, step by step,
without a GPU: the Triton kernels under the interpreter, FlashAttention emulated from its documented semantics
(attention_oracle.emulated_flash). The same steps go through the CPU platform's layer
(the torch reference store and attention, staging after attention in every step), and each step must give both the
same outputs, the same staging pool and the same closed pages: the builder's slices, the staging slots and where the
store stages (in its own launch, or after attention in a step that re-keys a slot), the close over the listed rows
and the FlashAttention prefill are wired as the reference does it.

Steps (decodes first, as vLLM orders a batch): prompts from position 0, a chunk that starts inside a block and ends
inside a later one (its staging must wait until after attention), decodes that close a block, a decode-only step
(no prefill plan) and a chunk that ends on a block boundary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_oracle import emulated_flash
from model_configs import LLAMA31_8B, write_model_dir

from s4kv.kernels import reference as ref
from s4kv.kernels.layout import cache_shape

pytest.importorskip("vllm")
# CPU tensors through the interpreted kernels; on a GPU the device jobs run this layer in the real engine
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels under the interpreter")

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BSZ = 4, 2, 128, 128
LAYER = "model.layers.0.self_attn.attn"
BLOCKS = {"a": [3, 7, 1, 9], "b": [5, 2, 8], "c": [4, 6, 10], "d": [11, 12], "e": [13]}  # physical blocks per sequence
# each step: (sequence, first position, new tokens), decodes first
STEPS = [
    [("a", 0, 300), ("b", 0, 100)],  # two prompts from position 0: staged in the store's launch
    [("a", 300, 1), ("b", 100, 160), ("c", 0, 127)],  # b starts inside block 0, ends inside block 2: staged later
    [("a", 301, 1), ("b", 260, 1), ("c", 127, 1)],  # decodes alone, c's closes its block
    [("a", 302, 1), ("b", 261, 1), ("c", 128, 1), ("d", 0, 5)],
    [("a", 303, 1), ("c", 129, 1), ("d", 5, 123)],  # d's chunk ends on its block's boundary: the block closes
]


def engine_config(scheme: str, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    model = dict(LLAMA31_8B, hidden_size=NUM_Q_HEADS * HEAD_DIM, num_attention_heads=NUM_Q_HEADS,
                 num_key_value_heads=NUM_KV_HEADS, num_hidden_layers=1, torch_dtype="float16")
    return EngineArgs(model=str(write_model_dir(tmp_path, "tiny", model)), skip_tokenizer_init=True,
                      load_format="dummy", max_model_len=1024, dtype="float16", max_num_seqs=8,
                      kv_cache_dtype="int4_per_token_head", attention_backend="CUSTOM",
                      additional_config={"s4kv": {"scheme": scheme}}).create_engine_config()


class Layer:
    """One attention layer of a platform (the GPU path or the CPU reference): its builder, impl, cache, outputs."""

    def __init__(self, config, cpu_platform: bool):
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

        from s4kv.runtime.plugin.backend import S4KVAttentionImpl, S4KVMetadataBuilder
        from s4kv.runtime.plugin.cpu_backend import S4KVCpuAttentionImpl, S4KVCpuMetadataBuilder

        spec = FullAttentionSpec(block_size=BSZ, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.uint8,
                                 kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)
        with set_current_vllm_config(config):
            builder = S4KVCpuMetadataBuilder if cpu_platform else S4KVMetadataBuilder
            impl = S4KVCpuAttentionImpl if cpu_platform else S4KVAttentionImpl
            self.builder = builder(spec, [LAYER], config, torch.device("cpu"))
            self.impl = impl(NUM_Q_HEADS, HEAD_DIM, HEAD_DIM**-0.5, NUM_KV_HEADS, None, None, "int4_per_token_head")
        self.reference = cpu_platform
        self.cache = torch.randint(0, 256, cache_shape(16, NUM_KV_HEADS, BSZ, HEAD_DIM), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(0))
        if self.impl.staged_keys is not None:
            self.impl.staged_keys.fill_(float("nan"))
        self.metadata = None

    def step(self, common, block_table: np.ndarray, query, key, value) -> torch.Tensor:
        if self.builder.staging is not None:
            self.builder.staging.begin_step(block_table, [])  # as the runner hook announces a step
        self.metadata = self.builder.build(0, common)
        if self.reference:  # the order right for any step: the store stages nothing, the forward after attention
            self.metadata.stage_in_store = False
        out = torch.full_like(query, float("nan"))
        self.impl.do_kv_cache_update(self, key, value, self.cache, common.slot_mapping)
        self.impl.forward(self, query, key, value, self.cache, self.metadata, out)
        return out


def common_metadata(step):
    """vLLM's CommonAttentionMetadata of one step, and its host block table."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens = [q for _, _, q in step]
    starts = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for _, c, q in step], dtype=torch.int32)
    table = np.array([BLOCKS[s] + [0] * (4 - len(BLOCKS[s])) for s, _, _ in step], dtype=np.int32)
    slots = torch.tensor([table[i, p // BSZ] * BSZ + p % BSZ for i, (_, c, q) in enumerate(step)
                          for p in range(c, c + q)], dtype=torch.int64)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=len(step),
        num_actual_tokens=int(starts[-1]), max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.from_numpy(table), slot_mapping=slots)
    return common, table


@pytest.fixture(autouse=True)
def emulated_vllm(monkeypatch):
    """FlashAttention emulated (FA3's interface), and each layer's metadata read from the Layer, as vLLM's forward
    context would give it."""
    import vllm.v1.attention.backends.fa_utils as fa_utils

    from s4kv.kernels.prefill_plan import FlashPass
    from s4kv.runtime.plugin import backend

    def flash_attn_varlen_func(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
                               softmax_scale, causal, fa_version):
        assert causal and fa_version == 3
        fa_pass = FlashPass(cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k)
        out.copy_(emulated_flash(q, k, v, fa_pass, softmax_scale).to(out.dtype))

    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda: 3)
    monkeypatch.setattr(fa_utils, "flash_attn_varlen_func", flash_attn_varlen_func, raising=False)
    monkeypatch.setattr(backend, "layer_metadata", lambda layer: layer.metadata)


@pytest.mark.parametrize("scheme", ["int4_kivi", "int4_saw"])
def test_the_gpu_path_layer_follows_the_reference_step_by_step(scheme, tmp_path):
    config = engine_config(scheme, tmp_path)
    gpu, cpu = Layer(config, cpu_platform=False), Layer(config, cpu_platform=True)
    gen = torch.Generator().manual_seed(1)
    staged_in_store = []
    for number, step in enumerate(STEPS, 1):
        common, table = common_metadata(step)
        tokens = common.num_actual_tokens
        query = torch.randn(tokens, NUM_Q_HEADS, HEAD_DIM, generator=gen).half()
        key, value = (torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).half() for _ in range(2))
        out = gpu.step(common, table, query, key, value)
        expected = cpu.step(common, table, query, key, value)
        assert (gpu.metadata.prefill is None) == (number == 3), f"step {number}: the prefill plan"
        staged_in_store.append(gpu.metadata.stage_in_store)
        assert not torch.isnan(out).any(), f"step {number}: NaN in the output"
        error = float((out.float() - expected.float()).norm() / expected.float().norm())
        assert error < 5e-3, f"step {number}: relative error {error:.2e} against the reference layer"
        pages = ref.PageViews(gpu.cache, HEAD_DIM), ref.PageViews(cpu.cache, HEAD_DIM)
        for name in ("k_params", "v_params"):  # a closed page's per-channel scales come from its 128 original keys
            torch.testing.assert_close(getattr(pages[0], name).float(), getattr(pages[1], name).float(), rtol=2e-3,
                                       atol=1e-6, equal_nan=True, msg=lambda m: f"step {number}, {name}: {m}")
        if scheme == "int4_kivi":
            assert torch.equal(gpu.impl.staged_keys.isnan(), cpu.impl.staged_keys.isnan()), f"step {number}: pool"
            assert torch.equal(gpu.impl.staged_keys.nan_to_num(), cpu.impl.staged_keys.nan_to_num()), \
                f"step {number}: the staging pool"
    assert staged_in_store == ([True, False, True, True, True] if scheme == "int4_kivi" else [False] * 5)


@pytest.mark.parametrize("steps", [[("d", 0, 1), ("e", 0, 1), ("a", 1, 150)],  # a chunk from position 1
                                   [("d", 255, 1), ("a", 0, 256)]])  # a prompt filling two blocks
def test_a_dummy_warm_up_step_runs_every_eager_launch_and_writes_nothing(steps, tmp_path):
    """The start-up warm-up's dummy mixed steps (runtime/plugin/warmup.py): vLLM gives them an all-padding slot
    mapping and announces no step to the staging pool, so the store, the block close, the staging copy and the
    gather run and leave the cache and the pool as they were."""
    layer = Layer(engine_config("int4_kivi", tmp_path), cpu_platform=False)
    common, _ = common_metadata(steps)
    common.slot_mapping.fill_(-1)
    tokens = common.num_actual_tokens
    gen = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(tokens, n, HEAD_DIM, generator=gen).half()
                         for n in (NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    cache, pool = layer.cache.clone(), layer.impl.staged_keys.clone()
    layer.metadata = layer.builder.build(0, common)  # no begin_step: the runner announces no dummy step
    assert layer.metadata.prefill is not None and layer.metadata.close_rows.numel() > 0
    layer.impl.do_kv_cache_update(layer, key, value, layer.cache, common.slot_mapping)
    layer.impl.forward(layer, query, key, value, layer.cache, layer.metadata, torch.empty_like(query))
    assert torch.equal(layer.cache, cache)
    assert torch.equal(layer.impl.staged_keys.isnan(), pool.isnan())
    assert torch.equal(layer.impl.staged_keys.nan_to_num(), pool.nan_to_num())
