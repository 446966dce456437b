"""Runs the real vLLM engine (the CPU platform) on one tiny model with several KV formats and prints one JSON line.

Used by test_plugin_cpu_engine.py in a subprocess of its own (vLLM's engine keeps process-wide state), and by
hand: ``VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/runtime/cpu_engine_job.py models/tiny-qwen2 bf16 int4_kivi``.
Settings force the paths that matter for a paged int4 cache: chunked prefill (prompts longer than one 64-token
step), prompts that close a 128-token page, batches mixing prefill and decode, and prefix-cache hits. A scheme
name ending in ``+ngram`` adds n-gram speculative decoding (3 draft tokens; the long prompt repeats earlier turns,
so drafts are proposed and some accepted): verification batches, rejected drafts' slots written again.
"""

from __future__ import annotations

import gc
import json
import sys

from s4kv.runtime.bundled_models import FACTS, NGRAM_DRAFTS, SPECULATIVE_SUFFIX, chat_text

# A context of several turns followed by a question: 160+ tokens, so a 128-token page closes during prefill.
LONG_PROMPT = "".join(chat_text(q, a) for q, a in FACTS[:7]) + chat_text(FACTS[9][0])
MAX_TOKENS = 24




def engine_kwargs(scheme: str) -> dict:
    common = dict(
        max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
        enable_prefix_caching=True, enforce_eager=True, dtype="bfloat16", seed=0,
        gpu_memory_utilization=0.3, kv_cache_memory_bytes=32 * 2**20,
    )
    if scheme.endswith(SPECULATIVE_SUFFIX):
        scheme = scheme.removesuffix(SPECULATIVE_SUFFIX)
        common.update(speculative_config=NGRAM_DRAFTS, disable_log_stats=False)
    if scheme == "bf16":
        return common
    return dict(common, kv_cache_dtype="int4_per_token_head", attention_config={"backend": "CUSTOM"},
                additional_config={"s4kv": {"scheme": scheme}})


def attention_impls(model) -> list[str]:
    return sorted({type(module.impl).__name__ for module in model.modules() if hasattr(module, "impl")})


def accepted_draft_tokens(llm) -> int:
    """Draft tokens the target model accepted (the engine must keep stats: disable_log_stats=False)."""
    counts = [m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"]
    return int(sum(counts))


def run_scheme(model: str, scheme: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs(scheme))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [chat_text(q) for q, _ in FACTS] + [LONG_PROMPT]
    batch = llm.generate(prompts, greedy, use_tqdm=False)  # one batch: prefills and decodes interleave
    again = llm.generate([LONG_PROMPT], greedy, use_tqdm=False)[0]  # its first page now comes from the prefix cache
    core = llm.llm_engine.engine_core.engine_core  # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    result = {
        "texts": [o.outputs[0].text for o in batch],
        "token_ids": [list(o.outputs[0].token_ids) for o in batch],
        "long_prompt_tokens": len(batch[-1].prompt_token_ids),
        "repeat_token_ids": list(again.outputs[0].token_ids),
        "repeat_cached_tokens": again.num_cached_tokens,
        "num_blocks": core.vllm_config.cache_config.num_gpu_blocks,
        "block_size": core.vllm_config.cache_config.block_size,
        "attention_impls": llm.apply_model(attention_impls)[0],
        "accepted_draft_tokens": accepted_draft_tokens(llm) if scheme.endswith(SPECULATIVE_SUFFIX) else None,
    }
    del llm, core
    gc.collect()
    return result


def main(argv: list[str]) -> int:
    from vllm.distributed import cleanup_dist_env_and_memory

    model, schemes = argv[0], argv[1:]
    results = {}
    for scheme in schemes:
        results[scheme] = run_scheme(model, scheme)
        cleanup_dist_env_and_memory()
    print("RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
