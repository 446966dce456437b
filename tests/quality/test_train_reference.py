"""tools/reference_models/train_reference.py end to end on the CPU: a few steps on a small corpus, then load what it
saved.

The real run is on the H200 (tools/device/train.sh); this catches a broken script before a GPU call is spent.
"""

from __future__ import annotations

import json
import lzma
import tarfile

import pytest
import torch

from quality_helpers import heldout_texts
from tools.reference_models import build_corpus
from tools.reference_models import train_reference


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    corpus = tmp / "corpus"
    corpus.mkdir()
    docs = heldout_texts()
    with lzma.open(corpus / "train.txt.xz", "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(doc + "\n" + build_corpus.DOC_SEPARATOR + "\n")
    build_corpus.train_tokenizer(corpus / "train.txt.xz", 512, corpus / "tokenizer.json")
    out = tmp / "out"
    train_reference.main(["--corpus", str(corpus), "--out", str(out), "--staging", str(tmp / "staging"),
                          "--device", "cpu", "--max-steps", "3", "--batch-size", "2", "--seq-len", "64",
                          "--log-every", "1", "--probe-docs", "2"])
    return train_reference, out


def test_each_model_comes_back_as_one_tar_with_a_loadable_checkpoint(trained, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    train_reference, out = trained
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{m.name}.tar" for m in train_reference.MODELS]
                                                           + ["train_log.txt"])
    for spec in train_reference.MODELS:
        with tarfile.open(out / f"{spec.name}.tar") as tar:
            tar.extractall(tmp_path, filter="data")
        folder = tmp_path / spec.name
        files = {p.name for p in folder.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md"} <= files
        config = AutoConfig.from_pretrained(folder)
        assert config.architectures == [spec.architecture]
        assert (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) == 128
        assert config.num_attention_heads > config.num_key_value_heads
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert next(model.parameters()).dtype == torch.bfloat16
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
        assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids("<|endoftext|>")
        assert torch.isfinite(model(input_ids=ids).logits).all()
        stats = json.loads((folder / "training_stats.json").read_text())
        assert stats["steps"] == 3 and len(stats["key_stats_trained"]) == config.num_hidden_layers


def test_qwen2_has_qkv_bias_and_llama_uses_llama3_rope(trained, tmp_path):
    train_reference, _ = trained
    specs = {m.architecture: m for m in train_reference.MODELS}
    qwen = specs["Qwen2ForCausalLM"].config(512, 64, 0)
    llama = specs["LlamaForCausalLM"].config(512, 64, 0)
    assert qwen.rope_parameters["rope_theta"] == 1e6
    assert llama.rope_parameters["rope_type"] == "llama3" and not llama.attention_bias
