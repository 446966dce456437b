"""The vLLM path of `s4kv eval` (worker process, forced decode steps, log-prob parsing, greedy) on vLLM's CPU
engine.

The same token ids go through vLLM (bf16 weights and KV) and through the torch engine (float32, K/V rounded
to bf16): teacher-forced records must agree up to bf16 arithmetic, which checks that the logits processor forces
every window token (the worker checks that the generated ids are the window's) and that the worker reads the
log-probs at the right positions and in rank order, with one prefilled token (the default) and with half of each
window prefilled. About 30 s per CPU engine start.
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import pytest
from quality_helpers import heldout_texts

from s4kv.runtime.eval.data import Regime, build_inputs
from s4kv.runtime.eval.torch_engine import TORCH_FORMATS, load_model, run_format
from s4kv.runtime.eval.evaluate import compare, vllm_records

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the CPU vLLM engine (setup_env.sh)"),
]


@pytest.mark.parametrize("prefill", [1, 32], ids=["all-decode", "half-prefilled"])
@pytest.mark.parametrize("tiny_model", ["qwen2"], indirect=True)  # the worker is model-agnostic; one model is enough
def test_vllm_records_match_the_torch_engine(tiny_model, tmp_path, prefill):
    from transformers import AutoTokenizer

    regimes = [Regime("short", 3, 64, 2, 16, 6, prefill)]
    inputs = build_inputs(AutoTokenizer.from_pretrained(tiny_model), heldout_texts(), regimes)
    args = argparse.Namespace(top_k=5, enforce_eager=True, allow_unsupported_model=False)
    from_vllm = vllm_records(args, str(tiny_model), "bf16_fa3", inputs, tmp_path)
    from_torch = run_format(load_model(str(tiny_model)), inputs, TORCH_FORMATS["bf16_fa3"], top_k=5)
    vllm_tf, torch_tf = from_vllm["short"][0], from_torch["short"][0]
    assert vllm_tf.top_ids.shape == (3, 64 - prefill - 1, 5) and from_vllm["short"][1].tokens.shape == (2, 6)
    assert np.all(np.diff(vllm_tf.top_logprobs, axis=-1) <= 0)  # best first
    # bf16 arithmetic on one side only: an absolute 0.15 nat, and 1% (under three bf16 ulps) on the large
    # log-probs of unlikely targets (-20 to -30 nat), where the absolute error grows with the magnitude
    np.testing.assert_allclose(vllm_tf.target_logprobs, torch_tf.target_logprobs, atol=0.15, rtol=0.01)
    metrics = compare(from_torch, from_vllm)["short"]
    assert metrics["top1_agreement"] > 0.9 and metrics["mean_kl"] < 0.01, metrics
