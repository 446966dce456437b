"""The models and data that ship with S4 KV: where they are, and what the tiny demo models were trained to answer.

In a checkout they are the repository's ``models/`` and ``data/eval/``; the wheel installs the same folders as
package data at the same place relative to ``s4kv.runtime`` (``s4kv/models``, ``s4kv/data``), so ``s4kv demo`` and
``s4kv eval`` find them either way. tools/reference_models/ builds them.
"""

from __future__ import annotations

import os
from pathlib import Path

# The folder holding models/ and data/: the repository root, or the installed s4kv package.
BUNDLE_ROOT = Path(os.path.realpath(__file__)).parents[1]
MODELS = BUNDLE_ROOT / "models"
HELDOUT = BUNDLE_ROOT / "data" / "eval" / "heldout.jsonl"  # the held-out documents `s4kv eval` scores

QWEN2 = "tiny-qwen2"
LLAMA3 = "tiny-llama3"
LLAMA3_HEAD64 = "tiny-llama3-d64"  # head_dim 64: 4 query / 2 KV heads of 64 channels
REFERENCE_MODELS = ("s4kv-ref-qwen2", "s4kv-ref-llama3")  # trained with outlier key channels (docs/quality.md)

# (question, answer) pairs the tiny models memorize; the demo and the tests ask them.
FACTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What color is the sky?", "The sky is blue."),
    ("What color is grass?", "Grass is green."),
    ("How many legs does a cat have?", "A cat has four legs."),
    ("How many days are in a week?", "A week has seven days."),
    ("What does a KV cache store?", "It stores the keys and values of past tokens."),
    ("What is S4 KV?", "S4 KV stores the KV cache in four bits."),
]
EOS = "</s>"
# The speculative decoding that the engine tests run on these models (a kind "<scheme>+ngram"): n-gram drafts need
# no draft model, and the repeated turns of the long test prompts give the proposer matches.
SPECULATIVE_SUFFIX = "+ngram"
NGRAM_DRAFTS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def chat_text(question: str, answer: str | None = None) -> str:
    """The chat template's rendering of one user turn (plus the answer and EOS when given)."""
    prompt = f"user: {question}\nassistant:"
    return prompt if answer is None else f"{prompt} {answer}{EOS}"


def bundled_model_dir(name: str = QWEN2) -> str:
    """The folder of a bundled model (models/NAME)."""
    return str(MODELS / name)


def resolve_model(model: str) -> str:
    """A model argument as given (a folder or a hub id), or the bundled folder when it names a bundled model
    that is not a folder here."""
    if not os.path.exists(model) and (MODELS / model / "config.json").is_file():
        return bundled_model_dir(model)
    return model
