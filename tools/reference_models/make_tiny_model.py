#!/usr/bin/env python3
"""Build the tiny offline models (models/tiny-qwen2 and models/tiny-llama3 at head_dim 128, models/tiny-llama3-d64 at
head_dim 64): a BPE tokenizer (``tokenizers``), a 2-layer Llama-3-shaped transformer, trained for a few hundred steps
on CPU to memorize the short question/answer pairs of ``s4kv.runtime.bundled_models.FACTS``.

Why trained and not random: a memorizing model answers with large logit margins, so greedy output is a meaningful
yardstick (int4 KV must reproduce the bf16 answer), and the offline demo prints a readable answer.
The same weights are written as a Llama-3-shaped folder (rope_theta 5e5, the Llama-3 hallmark S4 KV's family check
uses) and as a Qwen2-shaped folder (zero q/k/v biases, so both compute the same function). The head_dim-64 model
(4 query / 2 KV heads of 64 channels, the head size of Llama-3.2-1B, Qwen2.5-0.5B and SmolLM2) is written as a
Llama-3-shaped folder only.

usage: python tools/reference_models/make_tiny_model.py [OUT_DIR] [--steps N] [--head-dim 128|64]
(default OUT_DIR: models/ of this repository)
Takes about 10 minutes on 2 CPU cores; the result is committed, so the demo and the tests never train.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass

from s4kv.runtime.bundled_models import EOS, FACTS, LLAMA3, LLAMA3_HEAD64, QWEN2, chat_text

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@dataclass(frozen=True)
class TinyShape:
    hidden_size: int = 256
    num_attention_heads: int = 2  # head_dim = hidden_size / heads: 128 here, 64 in HEAD64_SHAPE
    num_key_value_heads: int = 1
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    rope_theta: float = 500000.0
    max_position_embeddings: int = 1024
    vocab_size: int = 384

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


HEAD64_SHAPE = TinyShape(num_attention_heads=4, num_key_value_heads=2)
# head_dim -> (shape, the folders written: (name, architecture, model_type))
FLAVOURS = {
    128: (TinyShape(), ((LLAMA3, "LlamaForCausalLM", "llama"), (QWEN2, "Qwen2ForCausalLM", "qwen2"))),
    64: (HEAD64_SHAPE, ((LLAMA3_HEAD64, "LlamaForCausalLM", "llama"),)),
}


def build_tokenizer(shape: TinyShape):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [chat_text(q, a) for q, a in FACTS] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def _training_batch(tok, rng: random.Random, batch: int, length: int):
    """Rows of chat turns packed back to back, so answers are learnt after long, varied contexts too."""
    import torch

    eos_id = tok.token_to_id(EOS)
    rows = []
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < length + 1:
            question, answer = rng.choice(FACTS)
            ids += tok.encode(chat_text(question, answer)).ids
            if rng.random() < 0.3:
                ids.append(eos_id)
        rows.append(ids[: length + 1])
    data = torch.tensor(rows)
    return data[:, :-1], data[:, 1:]


def train(shape: TinyShape, tok, steps: int = 400, seed: int = 0, log=print):
    """A LlamaForCausalLM (transformers) trained to memorize FACTS; returns the model in float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = LlamaConfig(**_hf_fields(shape, tok), attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        inputs, targets = _training_batch(tok, rng, batch=8, length=256)
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"[tiny-model] step {step:4d} loss {loss.item():.3f}")
    return model.eval()


def _hf_fields(shape: TinyShape, tok) -> dict:
    return dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id(EOS),
    )


def write_model_dirs(model, tok, shape: TinyShape, out_dir: str, folders) -> list[str]:
    """Write the Llama-3-shaped and the Qwen2-shaped folder (bf16 safetensors, tokenizer, chat template)."""
    import torch
    from safetensors.torch import save_file

    tied = "lm_head.weight"  # tie_word_embeddings: the checkpoint holds only the embedding
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != tied}
    fields = _hf_fields(shape, tok)
    written = []
    for name, architecture, model_type in folders:
        path = os.path.join(out_dir, name)
        os.makedirs(path, exist_ok=True)
        weights = dict(state)
        config = dict(fields, architectures=[architecture], model_type=model_type, torch_dtype="bfloat16",
                      hidden_act="silu", initializer_range=0.02, use_cache=True)
        if model_type == "qwen2":
            config.pop("head_dim")  # vLLM's Qwen2 derives it: hidden_size / num_attention_heads
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_hidden_layers)
            for layer in range(shape.num_hidden_layers):
                kv_width = shape.num_key_value_heads * fields["head_dim"]
                for proj, width in (("q", shape.hidden_size), ("k", kv_width), ("v", kv_width)):
                    bias = torch.zeros(width, dtype=torch.bfloat16)
                    weights[f"model.layers.{layer}.self_attn.{proj}_proj.bias"] = bias
        else:
            config.update(attention_bias=False, mlp_bias=False)
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        _write_json(os.path.join(path, "config.json"), config)
        _write_json(os.path.join(path, "generation_config.json"),
                    {"bos_token_id": fields["bos_token_id"], "eos_token_id": fields["eos_token_id"]})
        tok.save(os.path.join(path, "tokenizer.json"))
        _write_json(os.path.join(path, "tokenizer_config.json"), {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": EOS, "unk_token": "<unk>",
            "model_max_length": shape.max_position_embeddings, "chat_template": CHAT_TEMPLATE,
        })
        written.append(path)
    return written


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")


def build(out_dir: str, steps: int = 400, log=print, head_dim: int = 128) -> list[str]:
    """Tokenizer + training + the model folders of this head_dim (FLAVOURS) under out_dir; returns their paths."""
    shape, folders = FLAVOURS[head_dim]
    tok = build_tokenizer(shape)
    model = train(shape, tok, steps=steps, log=log)
    return write_model_dirs(model, tok, shape, out_dir, folders)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=os.path.join(REPO, "models"))
    parser.add_argument("--steps", type=int, default=500, help="training steps (batch 8 x 256 tokens)")
    parser.add_argument("--head-dim", type=int, choices=(128, 64), default=128,
                        help="128: tiny-llama3 and tiny-qwen2; 64: tiny-llama3-d64")
    args = parser.parse_args()
    for path in build(args.out_dir, steps=args.steps, head_dim=args.head_dim):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
