"""One vLLM engine of `s4kv eval`: start vLLM with one KV format, score the windows, generate from the prompts.

Run by runtime/evaluate.py as ``python -m s4kv.runtime.eval_vllm SPEC.json``, one process per format, so each
format gets a clean GPU and vLLM's process tree ends with it. SPEC holds the model, the format name
(runtime/bench_matrix.FORMATS), engine settings and the token ids; the records are written to SPEC["out"]
as an .npz (per regime: top-k ids and log-probs, target log-probs, greedy tokens).

Teacher forcing uses ``prompt_logprobs=K``: vLLM returns, for every prompt position after the first, the
top-K log-probabilities of the next-token distribution (raw logits, before any sampling processing) plus the
log-probability of the prompt's own next token (``flat_logprobs``: flat lists, not a dict per position).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from .bench_matrix import FORMATS


def prompt_records(output, token_ids: list[int], top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top ids [N, K], top log-probs [N, K], target log-probs [N]) for positions 1..len-1 of one prompt.

    With ``flat_logprobs`` vLLM stores, for each position after the first, the prompt's own next token (with
    its rank) followed by the top-K tokens in rank order: K + 1 entries, duplicates kept.
    """
    flat = output.prompt_logprobs
    starts, ends = np.asarray(flat.start_indices[1:]), np.asarray(flat.end_indices[1:])
    if len(starts) != len(token_ids) - 1 or np.any(ends - starts != top_k + 1):
        raise RuntimeError(f"unexpected prompt log-probs for a {len(token_ids)}-token prompt: {len(starts)} positions, "
                           f"entries per position {sorted(set((ends - starts).tolist()))} (expected {top_k + 1})")
    ids, logprobs, ranks = np.asarray(flat.token_ids), np.asarray(flat.logprobs, np.float32), np.asarray(flat.ranks)
    rows = starts[:, None] + np.arange(top_k + 1)
    if np.any(ids[rows[:, 0]] != np.asarray(token_ids[1:])) or np.any(ranks[rows[:, 1:]] != np.arange(1, top_k + 1)):
        raise RuntimeError("vLLM's prompt log-probs are not laid out as (prompt token, top-1 .. top-K)")
    return ids[rows[:, 1:]], logprobs[rows[:, 1:]], logprobs[rows[:, 0]]


def run(spec: dict) -> None:
    # This process exists for one engine: keep vLLM's engine core in it instead of spawning another process
    # (a second import of vLLM and torch), which more than halves start-up on the CPU engine.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    fmt = FORMATS[spec["format"]]
    top_k = spec["top_k"]
    llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, max_logprobs=top_k, enable_prefix_caching=False,
              **spec["engine"], **fmt.engine_kwargs())
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False,
                             flat_logprobs=True)
    arrays: dict[str, np.ndarray] = {}
    for regime in spec["regimes"]:
        name, windows, prompts = regime["name"], regime["windows"], regime["prompts"]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], scoring, use_tqdm=False)
        records = [prompt_records(o, w, top_k) for o, w in zip(outputs, windows)]
        arrays[f"{name}_top_ids"] = np.stack([r[0] for r in records])
        arrays[f"{name}_top_logprobs"] = np.stack([r[1] for r in records])
        arrays[f"{name}_target_logprobs"] = np.stack([r[2] for r in records])
        sampling = SamplingParams(max_tokens=regime["generate"], temperature=0.0, ignore_eos=True, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        arrays[f"{name}_greedy"] = np.array([list(o.outputs[0].token_ids) for o in outputs], dtype=np.int64)
    np.savez(spec["out"], **arrays)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m s4kv.runtime.eval_vllm SPEC.json")
    run(json.loads(open(sys.argv[1]).read()))
