"""A vLLM logits processor that forces each step's token: teacher forcing through decode steps (eval_vllm.py).

Every logit but the forced token's becomes -inf, so greedy sampling picks it; the log-probabilities vLLM returns
are taken from the raw logits before any processor (its default ``logprobs_mode``), so they are the model's.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCED_KEY = "s4kv_forced"  # SamplingParams.extra_args entry: the token ids to force, one per step


class ForcedTokens(AdapterLogitsProcessor):
    """Per request with ``extra_args[FORCED_KEY]``: the next token is the listed one (all other logits -inf)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        forced = (params.extra_args or {}).get(FORCED_KEY)
        if forced is None:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            token = forced[len(output_ids)]
            keep = logits[token].clone()
            logits.fill_(float("-inf"))
            logits[token] = keep
            return logits

        return force
