"""eval_vllm.prompt_records on hand-made flat prompt log-probs (vLLM's FlatLogprobs layout), no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from s4kv.runtime.eval_vllm import prompt_records


def flat_output(token_ids, top_k, tops):
    """vLLM's layout: an empty first position, then per position (prompt token, rank r), top-1 .. top-K."""
    starts, ends, ids, lps, ranks = [0], [0], [], [], []
    for position, next_token in enumerate(token_ids[1:]):
        starts.append(len(ids))
        ranked = tops[position]  # [(token, logprob)] best first, K entries
        own = next((r for r, (t, _) in enumerate(ranked, 1) if t == next_token), top_k + 7)
        own_lp = dict(ranked).get(next_token, -20.0)
        for token, lp, rank in [(next_token, own_lp, own)] + [(t, lp, r) for r, (t, lp) in enumerate(ranked, 1)]:
            ids.append(token)
            lps.append(lp)
            ranks.append(rank)
        ends.append(len(ids))
    return SimpleNamespace(prompt_logprobs=SimpleNamespace(start_indices=starts, end_indices=ends, token_ids=ids,
                                                           logprobs=lps, ranks=ranks))


def test_prompt_records_reads_top_k_and_targets_per_position():
    token_ids = [0, 5, 9]
    tops = [[(5, -0.1), (3, -2.5)], [(4, -0.5), (8, -1.0)]]
    ids, lps, target = prompt_records(flat_output(token_ids, 2, tops), token_ids, 2)
    np.testing.assert_array_equal(ids, [[5, 3], [4, 8]])
    np.testing.assert_allclose(lps, [[-0.1, -2.5], [-0.5, -1.0]])
    np.testing.assert_allclose(target, [-0.1, -20.0])  # 9 is not in the top-2 at the second position


def test_prompt_records_rejects_an_unexpected_layout():
    token_ids = [0, 5, 9]
    output = flat_output(token_ids, 2, [[(5, -0.1), (3, -2.5)], [(4, -0.5), (8, -1.0)]])
    with pytest.raises(RuntimeError, match="expected 4"):
        prompt_records(output, token_ids, 3)  # asked for a different K than vLLM returned
    with pytest.raises(RuntimeError, match="not laid out"):
        prompt_records(output, [0, 6, 9], 2)  # the records belong to other tokens
