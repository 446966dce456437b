"""Models for the quality tests: tiny random ones built here (the committed ones are in quality_helpers)."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest
from quality_helpers import heldout_texts, save_tiny
from tools.reference_models import build_corpus


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A 512-token BPE trained on the held-out text, the same way build_corpus.py trains the real one."""
    folder = tmp_path_factory.mktemp("tokenizer")
    with lzma.open(folder / "text.xz", "wt", encoding="utf-8") as f:
        for text in heldout_texts():
            f.write(text + "\n" + build_corpus.DOC_SEPARATOR + "\n")
    build_corpus.train_tokenizer(folder / "text.xz", 512, folder / "tokenizer.json")
    return folder / "tokenizer.json"


@pytest.fixture(scope="session", params=["qwen2", "llama3"])
def tiny_model(request, tiny_tokenizer, tmp_path_factory) -> Path:
    """A randomly initialised model of each architecture with head_dim 128 and GQA, saved with a tokenizer."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=512, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=512,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    if request.param == "qwen2":
        config = Qwen2Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    else:
        config = LlamaConfig(hidden_size=128, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 4.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 128}, **common)
    config.architectures = ["Qwen2ForCausalLM" if request.param == "qwen2" else "LlamaForCausalLM"]
    return save_tiny(config, tiny_tokenizer, tmp_path_factory.mktemp(f"tiny-{request.param}"))
