"""eval_vllm.flat_records on hand-made flat log-probs (vLLM's FlatLogprobs layout), no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from s4kv.runtime.eval.vllm_engine import flat_records


def flat_logprobs(targets, top_k, tops):
    """vLLM's layout: per position (the position's own token, rank r), then top-1 .. top-K."""
    starts, ends, ids, lps, ranks = [], [], [], [], []
    for position, target in enumerate(targets):
        starts.append(len(ids))
        ranked = tops[position]  # [(token, logprob)] best first, K entries
        own = next((r for r, (t, _) in enumerate(ranked, 1) if t == target), top_k + 7)
        own_lp = dict(ranked).get(target, -20.0)
        for token, lp, rank in [(target, own_lp, own)] + [(t, lp, r) for r, (t, lp) in enumerate(ranked, 1)]:
            ids.append(token)
            lps.append(lp)
            ranks.append(rank)
        ends.append(len(ids))
    return SimpleNamespace(start_indices=starts, end_indices=ends, token_ids=ids, logprobs=lps, ranks=ranks)


def test_flat_records_reads_top_k_and_targets_per_position():
    targets = [5, 9]
    tops = [[(5, -0.1), (3, -2.5)], [(4, -0.5), (8, -1.0)]]
    ids, lps, target = flat_records(flat_logprobs(targets, 2, tops), targets, 2)
    np.testing.assert_array_equal(ids, [[5, 3], [4, 8]])
    np.testing.assert_allclose(lps, [[-0.1, -2.5], [-0.5, -1.0]])
    np.testing.assert_allclose(target, [-0.1, -20.0])  # 9 is not in the top-2 at the second position


def test_flat_records_rejects_an_unexpected_layout():
    targets = [5, 9]
    flat = flat_logprobs(targets, 2, [[(5, -0.1), (3, -2.5)], [(4, -0.5), (8, -1.0)]])
    with pytest.raises(RuntimeError, match="expected 4"):
        flat_records(flat, targets, 3)  # asked for a different K than vLLM returned
    with pytest.raises(RuntimeError, match="not laid out"):
        flat_records(flat, [6, 9], 2)  # the records belong to other tokens
    with pytest.raises(RuntimeError, match="3 positions"):
        flat_records(flat, [5, 9, 1], 2)  # fewer positions than forced tokens
