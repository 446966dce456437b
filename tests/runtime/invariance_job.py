"""Greedy outputs of one model through the real vLLM engine (CPU platform) under several loads, per KV format; prints
one JSON line. Used by test_load_invariance.py in a subprocess of its own; by hand:
``VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/runtime/invariance_job.py models/s4kv-ref-qwen2 bf16 int4_kivi``.

Prompts are held-out text cut into token-id prompts that share a 256-token prefix (two full pages) and end at
different offsets inside a page. Each batch also records, per generated token, the margin of the greedy choice over
the runner-up (``<condition>_margins``). One engine per condition and format:

* ``reference``: ample KV, prefix caching off, every prompt's prefill in one step (the batch), then each prompt
  alone in the same engine (``alone``);
* ``preempted``: KV for a few sequences only (requests are preempted and recomputed), prefix caching on, 48-token
  prefill chunks (chunk boundaries fall inside pages);
* ``chunked``: ample KV, prefix caching on, 200-token prefill chunks (later prompts of the batch hit the blocks
  earlier ones computed), then the same batch again in the same engine (``cached``: every prompt's full pages
  from the prefix cache).
"""

from __future__ import annotations

import gc
import json
import sys

from s4kv.runtime.bundled_models import HELDOUT
from s4kv.runtime.eval.data import load_heldout

SHARED_PREFIX = 256
TAILS = (5, 40, 77, 127, 128, 150, 99, 3)  # tokens after the shared prefix: inside, at and past a page end
GENERATE = 48
BLOCKS_UNDER_PRESSURE = 8  # pages of 128 tokens: about two of the eight requests at a time

CONDITIONS = {
    "reference": dict(enable_prefix_caching=False, max_num_batched_tokens=4096),
    "preempted": dict(enable_prefix_caching=True, max_num_batched_tokens=48,
                      num_gpu_blocks_override=BLOCKS_UNDER_PRESSURE),
    "chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=200),
}


def prompts(tokenizer) -> list[list[int]]:
    stream = tokenizer("\n\n".join(load_heldout(HELDOUT)[:40]), add_special_tokens=False)["input_ids"]
    prefix = stream[:SHARED_PREFIX]
    out, at = [], SHARED_PREFIX
    for tail in TAILS:
        out.append(prefix + stream[at:at + tail])
        at += tail
    return out


def engine_kwargs(scheme: str, condition: str, dtype: str) -> dict:
    # 128-token pages for every format (S4 KV's size; vLLM's GPU default for bf16 is 16), so that
    # num_gpu_blocks_override means the same tokens for all of them on every platform
    common = dict(max_model_len=512, max_num_seqs=16, enable_chunked_prefill=True, enforce_eager=True, block_size=128,
                  dtype=dtype, seed=0, kv_cache_memory_bytes=64 * 2**20, disable_log_stats=False,
                  **CONDITIONS[condition])
    if scheme == "bf16":
        return common
    return dict(common, kv_cache_dtype="int4_per_token_head", attention_config={"backend": "CUSTOM"},
                additional_config={"s4kv": {"scheme": scheme}})


def staged_layers(model) -> int:
    """Attention layers that hold an int4_kivi staging pool."""
    return sum(getattr(module.impl, "staged_keys", None) is not None for module in model.modules()
               if hasattr(module, "impl"))


def choice_margins(logprobs) -> list[float]:
    """Per generated token, how far the greedy choice led the runner-up (top-1 minus top-2 log-probability)."""
    margins = []
    for position in logprobs:
        best, second = sorted((entry.logprob for entry in position.values()), reverse=True)[:2]
        margins.append(best - second)
    return margins


def run(model: str, scheme: str, condition: str, dtype: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, **engine_kwargs(scheme, condition, dtype))
    greedy = SamplingParams(temperature=0, max_tokens=GENERATE, ignore_eos=True, logprobs=2)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts(llm.get_tokenizer())]
    batch = llm.generate(requests, greedy, use_tqdm=False)
    result = {condition: [list(o.outputs[0].token_ids) for o in batch],
              f"{condition}_margins": [choice_margins(o.outputs[0].logprobs) for o in batch]}
    if condition == "reference":
        result["alone"] = [list(llm.generate([r], greedy, use_tqdm=False)[0].outputs[0].token_ids) for r in requests]
    if condition == "chunked":
        again = llm.generate(requests, greedy, use_tqdm=False)
        result["cached"] = [list(o.outputs[0].token_ids) for o in again]
        result["cached_stats"] = {"cached_tokens": [o.num_cached_tokens or 0 for o in again]}
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name in ("vllm:num_preemptions",)}
    result[f"{condition}_stats"] = {
        "preemptions": int(metrics.get("vllm:num_preemptions", 0)),
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in batch),
        "staged_layers": llm.apply_model(staged_layers)[0],
        "prompt_tokens": [len(o.prompt_token_ids) for o in batch],
    }
    del llm
    gc.collect()
    return result


def main(argv: list[str]) -> int:
    import argparse

    from vllm.distributed import cleanup_dist_env_and_memory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("formats", nargs="+", help="bf16 (the model's dtype, unquantized), int4_kivi, int4_saw")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (vLLM dtype)")
    args = parser.parse_args(argv)
    results: dict[str, dict] = {}
    for scheme in args.formats:
        results[scheme] = {}
        for condition in CONDITIONS:
            results[scheme].update(run(args.model, scheme, condition, args.dtype))
            cleanup_dist_env_and_memory()
    print("RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
