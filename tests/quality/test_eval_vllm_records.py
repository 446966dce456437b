"""vllm_engine.flat_records on hand-made flat log-probs (vLLM's FlatLogprobs layout) and vllm_engine.engine_sizing,
no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from s4kv.runtime.eval.vllm_engine import (KV_HEADROOM, PAGE_TOKENS, START_UP_FREE_SHARE, engine_sizing, flat_records,
                                           format_engine_kwargs)


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


def test_engine_sizing_holds_every_sequence_at_once_and_prefills_each_prompt_in_one_step():
    # two regimes: 3 windows of 300 tokens (3 pages each with the sampled token) and 2 prompts of 40 + 10 generated
    # (1 page each); 4 long windows of 1000 (8 pages each) and no prompts
    spec = {"regimes": [{"windows": [[1] * 300] * 3, "prompts": [[1] * 40] * 2, "generate": 10},
                        {"windows": [[1] * 1000] * 4, "prompts": [], "generate": 5}]}
    config = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64, hidden_size=576,
                             num_attention_heads=9)
    sizing = engine_sizing(spec, config)
    bf16_token = 2 * 30 * 3 * 64 * 2
    assert sizing == {"max_model_len": 1001, "max_num_seqs": 4, "max_num_batched_tokens": 1001,
                      "enable_chunked_prefill": False,
                      "kv_cache_memory_bytes": KV_HEADROOM * (3 * 3 + 2 * 1 + 4 * 8) * PAGE_TOKENS * bf16_token,
                      "gpu_memory_utilization": START_UP_FREE_SHARE}
    # no head_dim in the config: hidden_size / heads; many short sequences: the budget covers one token each
    del config.head_dim
    many = {"regimes": [{"windows": [[1] * 10] * 300, "prompts": [], "generate": 1}]}
    sizing = engine_sizing(many, config)
    assert (sizing["max_num_seqs"], sizing["max_num_batched_tokens"], sizing["max_model_len"]) == (300, 300, 11)
    assert sizing["kv_cache_memory_bytes"] == KV_HEADROOM * 300 * PAGE_TOKENS * bf16_token


def test_allow_unsupported_model_reaches_only_the_s4kv_formats_options():
    from s4kv.runtime.plugin.config import ALLOW_UNSUPPORTED_MODEL, S4KVConfig

    kivi = format_engine_kwargs("s4kv_saw_rotv", True)["additional_config"]["s4kv"]
    assert kivi == {"scheme": "int4_saw", "rotate_values": True, ALLOW_UNSUPPORTED_MODEL: True}
    assert S4KVConfig.parse(kivi).allow_unsupported_model  # the plugin reads it
    assert "allow_unsupported_model" not in format_engine_kwargs("s4kv_kivi", False)["additional_config"]["s4kv"]
    assert format_engine_kwargs("fp8_fa3", True) == format_engine_kwargs("fp8_fa3", False)  # no additional_config
