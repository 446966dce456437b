"""Shared helpers of the quality tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "data" / "eval" / "heldout.jsonl"
REFERENCE_MODELS = ["s4kv-ref-qwen2", "s4kv-ref-llama3"]


def heldout_texts() -> list[str]:
    return [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines()]


def save_tiny(config, tokenizer_file: Path, folder: Path) -> Path:
    """A random model saved with a tokenizer. Plain random weights give near-uniform attention and next-token
    distributions that hide any KV error, so queries/keys and the final norm are scaled up to sharpen both."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(2.0)
            layer.self_attn.k_proj.weight.mul_(2.0)
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def packaged_model(name: str) -> Path:
    """The converted folder of a packaged model (runtime/packaged_models.py); skips where its package is absent."""
    from s4kv.runtime.packaged_models import fetch, gguf_file, lookup

    try:
        gguf_file(lookup(name))
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    return fetch(name)


def committed_model(name: str) -> Path:
    folder = REPO / "models" / name
    if not (folder / "config.json").exists():
        pytest.skip(f"models/{name} is not committed yet (trained on the H200 by tools/device/train.sh)")
    return folder
