"""One vLLM engine of `s4kv eval`: start vLLM with one KV format, score the windows, generate from the prompts.

Run by runtime/evaluate.py as ``python -m s4kv.runtime.eval_vllm SPEC.json``, one process per format, so each
format gets a clean GPU and vLLM's process tree ends with it. SPEC holds the model, the format name
(runtime/bench_matrix.FORMATS), engine settings and the token ids; the records are written to SPEC["out"]
as an .npz (per regime: top-k ids and log-probs, target log-probs, greedy tokens).

Teacher forcing uses ``prompt_logprobs=K``: vLLM returns, for every prompt position after the first, the
top-K log-probabilities of the next-token distribution (raw logits, before any sampling processing) plus the
log-probability of the prompt's own next token.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from .bench_matrix import FORMATS


def prompt_records(output, token_ids: list[int], top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top ids [N, K], top log-probs [N, K], target log-probs [N]) for positions 1..len-1 of one prompt."""
    positions = list(output.prompt_logprobs)[1:]
    if len(positions) != len(token_ids) - 1:
        raise RuntimeError(f"vLLM returned {len(positions)} prompt positions for {len(token_ids)} tokens")
    ids = np.zeros((len(positions), top_k), dtype=np.int64)
    lps = np.full((len(positions), top_k), -np.inf, dtype=np.float32)
    target = np.zeros(len(positions), dtype=np.float32)
    for n, (position, next_token) in enumerate(zip(positions, token_ids[1:])):
        ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in position.items() if lp.rank is not None)
        top = [(tok, value) for rank, tok, value in ranked if rank <= top_k][:top_k]
        if len(top) < top_k:
            raise RuntimeError(f"position {n}: vLLM returned {len(top)} ranked tokens, expected {top_k}")
        ids[n], lps[n] = [t for t, _ in top], [v for _, v in top]
        target[n] = position[next_token].logprob
    return ids, lps, target


def run(spec: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    fmt = FORMATS[spec["format"]]
    top_k = spec["top_k"]
    llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, max_logprobs=top_k, enable_prefix_caching=False,
              **spec["engine"], **fmt.engine_kwargs())
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
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
