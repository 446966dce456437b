"""One vLLM engine of `s4kv eval`: start vLLM with one KV format, score the windows, generate from the prompts.

Run by runtime/eval/evaluate.py as ``python -m s4kv.runtime.eval.vllm_engine SPEC.json``, one process per format, so
each format gets a clean GPU and vLLM's process tree ends with it. SPEC holds the model, the format name
(runtime/bench/matrix.py's FORMATS), engine settings and the token ids; the records are written to SPEC["out"]
as an .npz (per regime: top-k ids and log-probs, target log-probs, greedy tokens).

Teacher forcing sends a window's first ``prefill`` tokens as the prompt (prefilled as vLLM serves a prompt) and
forces every later token with a logits processor (``ForcedTokens``: all logits but the forced token's go to
-inf), so each of them runs as a decode step that reads its whole context from the KV cache. ``logprobs=K``
returns, per generated position, the forced token's log-probability and the top-K of the next-token
distribution, both from the raw logits, before any processor (vLLM's default ``logprobs_mode``), with
``flat_logprobs`` (flat lists, not a dict per position). The first forced token is predicted by the prefill, not by
a decode step, so it is checked but not scored (eval_data.Regime.scored).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from s4kv.runtime.bench.matrix import FORMATS
from s4kv.runtime.schemes import CONFIG_KEY

# exit status of a worker whose engine cannot run the format on this machine (vLLM raised NotImplementedError at
# start-up, e.g. its CPU engine's fp8 cache without AVX-512); the last line of its output says why
UNSUPPORTED_EXIT = 3
# the largest KV page of any format (S4 KV's, kernels/layout.BLOCK_SIZE): a sequence's KV rounds up to whole pages
PAGE_TOKENS = 128
# With an explicit KV cache size vLLM skips its memory profiling and uses gpu_memory_utilization only to check, at
# start-up, that this share of the device is free: a small share lets two evals share one GPU
# (tools/device/real_model.sh runs its two conditions side by side)
START_UP_FREE_SHARE = 0.3
# KV cache reserved over what every sequence of the spec needs at once (vLLM's pages may be smaller than
# PAGE_TOKENS, and its CPU engine pads them), so that no request is ever preempted
KV_HEADROOM = 2


def engine_sizing(spec: dict, config) -> dict:
    """Context length, KV cache, batch: what the spec's sequences need, not the model's or the device's maximum.

    Every window and prompt of a regime runs at once (``max_num_seqs``) and the cache holds all of them, at bf16's
    bytes per token (no format stores more), with ``KV_HEADROOM``: no request is preempted. Chunked prefill is off
    and a step's token budget is one full sequence, so every prompt is prefilled in one step, as the eval describes
    it. vLLM's defaults would instead, on its CPU engine, allocate and initialise 85% of the host's RAM as KV cache
    and run its start-up warm-up over a 4096-token batch (minutes on two cores), and could chunk a window's prompt
    where the step's budget ends; none of that is what the eval measures.
    """
    lengths = [len(w) + 1 for r in spec["regimes"] for w in r["windows"]]  # + the token sampled after the last
    lengths += [len(p) + r["generate"] for r in spec["regimes"] for p in r["prompts"]]
    pages = sum(-(-n // PAGE_TOKENS) for n in lengths)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bf16_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V
    max_num_seqs = max(max(len(r["windows"]), len(r["prompts"])) for r in spec["regimes"])
    return {"max_model_len": max(lengths), "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max(max(lengths), max_num_seqs), "enable_chunked_prefill": False,
            "kv_cache_memory_bytes": KV_HEADROOM * pages * PAGE_TOKENS * bf16_bytes_per_token,
            "gpu_memory_utilization": START_UP_FREE_SHARE}


def format_engine_kwargs(name: str, allow_unsupported_model: bool) -> dict:
    """A format's engine arguments; with ``allow_unsupported_model`` the S4 KV formats' options carry the plugin's
    opt-in for a model outside its validated families (the other formats have no such check)."""
    from s4kv.runtime.plugin.config import ALLOW_UNSUPPORTED_MODEL  # imports torch: only in the worker

    kwargs = FORMATS[name].engine_kwargs()
    additional = kwargs.get("additional_config") or {}
    if allow_unsupported_model and CONFIG_KEY in additional:
        kwargs["additional_config"] = {**additional,
                                       CONFIG_KEY: {**additional[CONFIG_KEY], ALLOW_UNSUPPORTED_MODEL: True}}
    return kwargs


def flat_records(flat, targets: list[int], top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top ids [N, K], top log-probs [N, K], target log-probs [N]) from vLLM's flat log-probs of N positions.

    With ``flat_logprobs`` vLLM stores, for each position, the position's own token (the prompt's next token, or the
    sampled one) with its rank, followed by the top-K tokens in rank order: K + 1 entries, duplicates kept.
    """
    starts, ends = np.asarray(flat.start_indices), np.asarray(flat.end_indices)
    if len(starts) != len(targets) or np.any(ends - starts != top_k + 1):
        raise RuntimeError(f"unexpected log-probs for {len(targets)} positions: {len(starts)} positions, "
                           f"entries per position {sorted(set((ends - starts).tolist()))} (expected {top_k + 1})")
    ids, logprobs, ranks = np.asarray(flat.token_ids), np.asarray(flat.logprobs, np.float32), np.asarray(flat.ranks)
    rows = starts[:, None] + np.arange(top_k + 1)
    if np.any(ids[rows[:, 0]] != np.asarray(targets)) or np.any(ranks[rows[:, 1:]] != np.arange(1, top_k + 1)):
        raise RuntimeError("vLLM's log-probs are not laid out as (forced token, top-1 .. top-K)")
    return ids[rows[:, 1:]], logprobs[rows[:, 1:]], logprobs[rows[:, 0]]


def forced_records(llm, windows: list[list[int]], prefill: int, top_k: int):
    """Teacher-forced records of the windows: ``prefill`` tokens as the prompt, every later token forced."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from s4kv.runtime.plugin.forced_tokens import FORCED_KEY

    params = [SamplingParams(max_tokens=len(w) - prefill, temperature=0.0, ignore_eos=True, logprobs=top_k,
                             flat_logprobs=True, detokenize=False, extra_args={FORCED_KEY: w[prefill:]})
              for w in windows]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w[:prefill]) for w in windows], params, use_tqdm=False)
    records = []
    for output, window in zip(outputs, windows):
        generated = output.outputs[0]
        if list(generated.token_ids) != window[prefill:]:
            raise RuntimeError("the forced tokens were not generated: the logits processor did not apply")
        ids, logprobs, target = flat_records(generated.logprobs, window[prefill:], top_k)
        records.append((ids[1:], logprobs[1:], target[1:]))  # position 0 came from the prefill (Regime.scored)
    return records


def run(spec: dict) -> None:
    # This process exists for one engine: keep vLLM's engine core in it instead of spawning another process
    # (a second import of vLLM and torch), which more than halves start-up on the CPU engine.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from s4kv.runtime.plugin.forced_tokens import ForcedTokens
    from s4kv.runtime.schemes import choose_model_runner

    fmt = FORMATS[spec["format"]]
    top_k = spec["top_k"]
    format_kwargs = format_engine_kwargs(fmt.name, spec.get("allow_unsupported_model", False))
    choose_model_runner(format_kwargs.get("additional_config"))
    try:
        llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, max_logprobs=top_k, enable_prefix_caching=False,
                  logits_processors=[ForcedTokens], **engine_sizing(spec, AutoConfig.from_pretrained(spec["model"])),
                  **spec["engine"], **format_kwargs)
    except NotImplementedError as unsupported:
        print(f"vLLM cannot run {fmt.name} on this machine: {unsupported}", flush=True)
        raise SystemExit(UNSUPPORTED_EXIT) from None
    arrays: dict[str, np.ndarray] = {}
    for regime in spec["regimes"]:
        name, windows, prompts = regime["name"], regime["windows"], regime["prompts"]
        records = forced_records(llm, windows, regime["prefill"], top_k)
        arrays[f"{name}_top_ids"] = np.stack([r[0] for r in records])
        arrays[f"{name}_top_logprobs"] = np.stack([r[1] for r in records])
        arrays[f"{name}_target_logprobs"] = np.stack([r[2] for r in records])
        sampling = SamplingParams(max_tokens=regime["generate"], temperature=0.0, ignore_eos=True, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        arrays[f"{name}_greedy"] = np.array([list(o.outputs[0].token_ids) for o in outputs], dtype=np.int64)
    np.savez(spec["out"], **arrays)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m s4kv.runtime.eval.vllm_engine SPEC.json")
    run(json.loads(open(sys.argv[1]).read()))
