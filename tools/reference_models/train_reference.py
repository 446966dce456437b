#!/usr/bin/env python3
"""Train the two reference models (Qwen2-style and Llama-3-style, head_dim 128, GQA) in one GPU call.

Reads the corpus and tokenizer that tools/reference_models/build_corpus.py wrote to .corpus/, tokenizes once, then
trains each model for a fixed wall-clock budget (bf16 autocast, fp32 master weights, AdamW, cosine schedule sized
from the measured step time). Each model is saved in bf16 with its config, tokenizer, training statistics
and model card, and packed as ``OUT/<name>.tar`` (one file per model: the device call returns at most 8
files of at most 16 MiB). The key outlier-channel analysis (s4kv.runtime.eval.key_stats) runs on each model
before and after training and goes into the log and the model card.

usage (GPU, see tools/device/train.sh):  python tools/reference_models/train_reference.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from s4kv.runtime.eval.key_stats import format_table, model_key_stats

REPO = Path(__file__).resolve().parents[2]
DOC_SEPARATOR = "<|endoftext|>"


@dataclass(frozen=True)
class ModelSpec:
    """One reference model: a real vLLM architecture at head_dim 128 with grouped-query attention."""

    name: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope: dict
    attention_bias: bool
    seed: int
    description: str
    extra: dict = field(default_factory=dict)

    def config(self, vocab_size: int, max_len: int, separator_id: int):
        from transformers import LlamaConfig, Qwen2Config

        common = dict(vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                      num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                      num_key_value_heads=self.num_kv_heads, max_position_embeddings=max_len,
                      rope_parameters=self.rope, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      bos_token_id=separator_id, eos_token_id=separator_id, **self.extra)
        if self.architecture == "Qwen2ForCausalLM":
            config = Qwen2Config(**common)  # q/k/v projections carry a bias in Qwen2
        else:
            config = LlamaConfig(**common, head_dim=128, attention_bias=False, mlp_bias=False)
        config.architectures = [self.architecture]
        return config


# Sizes: every device call carries the whole repository within 64 MiB, about 50 MiB of which is the offline
# vLLM bundle when evaluating, so the two checkpoints together stay near 7 MB in bf16.
MODELS = [
    # vLLM's Qwen2 derives head_dim as hidden_size / num_heads, so 2 heads of 128 need hidden 256.
    ModelSpec("s4kv-ref-qwen2", "Qwen2ForCausalLM", hidden_size=256, intermediate_size=192, num_layers=3,
              num_heads=2, num_kv_heads=1, rope={"rope_type": "default", "rope_theta": 1_000_000.0},
              attention_bias=True, seed=1,
              description="Qwen2-style: q/k/v bias, GQA 2:1, RoPE theta 1e6, tied embeddings"),
    # Llama reads head_dim from the config, so 4 query heads of 128 fit a narrower residual stream.
    ModelSpec("s4kv-ref-llama3", "LlamaForCausalLM", hidden_size=128, intermediate_size=256, num_layers=3,
              num_heads=4, num_kv_heads=2,
              rope={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 4.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
              attention_bias=False, seed=2,
              description="Llama-3-style: no bias, GQA 4:2, Llama-3 RoPE scaling (theta 5e5, factor 4), "
                          "tied embeddings"),
]


# ----------------------------------------------------------------------------- data

def read_documents(corpus_xz: Path, limit_chars: int | None = None) -> list[str]:
    docs, buffer, size = [], [], 0
    with lzma.open(corpus_xz, "rt", encoding="utf-8") as f:
        for line in f:
            if line.rstrip("\n") == DOC_SEPARATOR:
                docs.append("".join(buffer))
                size += len(docs[-1])
                buffer = []
                if limit_chars and size >= limit_chars:
                    break
            else:
                buffer.append(line)
    return docs


def tokenize_corpus(corpus_xz: Path, tokenizer_path: Path, limit_chars: int | None) -> np.ndarray:
    """All training documents as one uint16 stream; each document starts with the separator token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    docs = read_documents(corpus_xz, limit_chars)
    chunks = [np.asarray(e.ids, dtype=np.uint16)
              for start in range(0, len(docs), 4096)
              for e in tokenizer.encode_batch(docs[start:start + 4096])]
    return np.concatenate(chunks)


def heldout_windows(tokenizer_path: Path, heldout: Path, seq_len: int, count: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of up to ``count`` held-out documents long enough to fill them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    rows = [json.loads(line)["text"] for line in heldout.read_text().splitlines()]
    ids = [e.ids[:seq_len] for e in tokenizer.encode_batch(rows)]
    full = [row for row in ids if len(row) == seq_len][:count]
    if not full:
        raise SystemExit(f"no held-out document in {heldout} reaches {seq_len} tokens")
    return torch.tensor(full, dtype=torch.long)


# ----------------------------------------------------------------------------- training

def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # norms, biases and the (tied) embedding are not decayed
        (decay if p.dim() == 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, device: str, batch: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        x = windows[start:start + batch].to(device)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + x[:, 1:].numel()
    model.train()
    return total / count


def train_one(spec: ModelSpec, tokens: torch.Tensor, args, vocab_size: int, separator_id: int,
              windows: torch.Tensor, log) -> tuple[object, dict]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    config = spec.config(vocab_size, args.seq_len, separator_id)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    probe = windows[: args.probe_docs].to(args.device)
    random_keys = model_key_stats(model, probe)
    loss_at_init = heldout_loss(model, windows, args.device)
    log(f"[{spec.name}] {n_params / 1e6:.2f}M parameters ({2 * n_params / 2**20:.1f} MiB in bf16); "
        f"held-out loss at init {loss_at_init:.3f}")
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                                  fused=args.device.startswith("cuda"))
    n_tokens = tokens.numel()
    window = torch.arange(args.seq_len + 1, device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(spec.seed)
    total_steps, step, curve = args.max_steps or 10**9, 0, []
    running = torch.zeros((), device=args.device)
    start = time.perf_counter()
    settled_step, settled_at = args.calibration_steps // 3, 0.0
    model.train()
    while step < total_steps:
        if step in (settled_step, args.calibration_steps) and not args.max_steps:
            synchronize(args.device)
            now = time.perf_counter()
            if step == settled_step:  # the first steps pay for CUDA/cuBLAS initialisation: time from here
                settled_at = now
            else:  # size the cosine schedule so training ends on the wall-clock budget
                per_step = (now - settled_at) / (step - settled_step)
                total_steps = step + max(1, int((args.seconds_per_model - (now - start)) / per_step))
                log(f"[{spec.name}] {per_step * 1e3:.1f} ms/step -> {total_steps} steps "
                    f"({total_steps * args.batch_size * args.seq_len / 1e6:.0f}M tokens)")
        lr = learning_rate(step, total_steps if step >= args.calibration_steps or args.max_steps else 10**9,
                           args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, n_tokens - args.seq_len - 1, (args.batch_size, 1), device=args.device,
                                generator=generator)
        batch = tokens[offsets + window].long()
        with torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16,
                            enabled=args.device != "cpu"):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.detach()
        step += 1
        if not args.max_steps and step % 50 == 0 and time.perf_counter() - start > 1.3 * args.seconds_per_model:
            log(f"[{spec.name}] stopping at step {step}: past 1.3x the time budget (steps got slower)")
            break  # the device call has a hard limit; a shortened schedule beats losing the call
        if step % args.log_every == 0 or step == total_steps:
            mean = float(running) / (step - (curve[-1][0] if curve else 0))
            running.zero_()
            curve.append((step, mean))
            log(f"[{spec.name}] step {step}/{total_steps if total_steps < 10**9 else '?'} loss {mean:.3f} lr {lr:.2e} "
                f"{time.perf_counter() - start:.0f}s")
    seconds = time.perf_counter() - start
    final_loss = heldout_loss(model, windows, args.device)
    trained_keys = model_key_stats(model, probe)
    log(f"[{spec.name}] done: {step} steps in {seconds:.0f}s, held-out loss {final_loss:.3f} "
        f"(perplexity {math.exp(final_loss):.1f})")
    log(format_table(random_keys, "random init"))
    log(format_table(trained_keys, "trained"))
    stats = {
        "model": spec.name, "architecture": spec.architecture, "description": spec.description,
        "parameters": n_params, "steps": step, "seconds": round(seconds, 1),
        "tokens_seen": step * args.batch_size * args.seq_len, "corpus_tokens": n_tokens,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "peak_lr": args.lr,
        "train_loss_curve": curve, "heldout_loss_init": loss_at_init, "heldout_loss": final_loss,
        "heldout_perplexity": math.exp(final_loss), "heldout_windows": len(windows),
        "key_stats_random_init": random_keys, "key_stats_trained": trained_keys,
        "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else f"{args.device.upper()} ({torch.get_num_threads()} threads)"),
        # autocast is off on the CPU (bf16 matmuls there are slower than fp32 on most CPUs)
        "precision": "fp32" if args.device == "cpu" else "bf16 autocast, fp32 master weights",
        "torch": torch.__version__,
    }
    return model, stats


# ----------------------------------------------------------------------------- saving

def model_card(stats: dict, spec: ModelSpec) -> str:
    from s4kv.runtime.eval.key_stats import OUTLIER_FACTOR

    curve = stats["train_loss_curve"]
    trained, random = stats["key_stats_trained"], stats["key_stats_random_init"]
    return f"""# {spec.name}

A small {spec.architecture} trained from scratch by the S4 KV project as a reference model for KV-cache
quality measurements (`s4kv eval`). It is not a useful language model; it exists because no model weights
can be downloaded where the project is built, and a trained model (unlike random weights) has the key
outlier channels that make int4 KV caches hard.

- Architecture: `{spec.architecture}`, {spec.description}
- Shape: hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} query heads / {spec.num_kv_heads} KV \
heads of head_dim 128, MLP {spec.intermediate_size}, vocabulary {stats['vocab_size']}, context {stats['seq_len']}
- Parameters: {stats['parameters'] / 1e6:.2f}M, stored in bf16 (`model.safetensors`)
- Tokenizer: byte-level BPE, {stats['vocab_size']} tokens, trained on the same corpus; every text is prefixed with
  `<|endoftext|>` (the document separator, also bos/eos)
- Data: the offline English corpus of `tools/reference_models/build_corpus.py` (Debian \
documentation packages, dictionaries,
  Shakespeare, the King James Bible; {stats['corpus_tokens'] / 1e6:.0f}M tokens); sources and licences in
  `data/corpus/SOURCES.md`. The held-out documents (`data/eval/heldout.jsonl`) were not trained on.
- Training: `tools/reference_models/train_reference.py` on {stats['device']}, \
{stats['steps']} steps of {stats['batch_size']} x \
{stats['seq_len']} tokens ({stats['tokens_seen'] / 1e6:.2f}M tokens, {stats['seconds']:.0f} s wall time), \
AdamW, peak lr \
{stats['peak_lr']}, {stats.get('precision', 'bf16 autocast')}
- Loss: train {curve[0][1]:.2f} (first {curve[0][0]} steps) -> {curve[-1][1]:.2f}; \
held-out {stats['heldout_loss_init']:.2f} \
at init -> {stats['heldout_loss']:.2f} (perplexity {stats['heldout_perplexity']:.1f}, \
{stats['heldout_windows']} windows \
of {stats['seq_len']} tokens)
- Licence: the weights are released under the project's licence (Apache-2.0); the training text is under the
  licences listed in `data/corpus/SOURCES.md` (several are copyleft: GPL-2 documentation, GFDL dictionaries).

## Key outlier channels

Mean |k| per channel of the post-RoPE keys (what the KV cache stores), over held-out text; a channel is
counted as an outlier when it exceeds {OUTLIER_FACTOR:g}x its head's median channel. The largest ratio over
layers is {max(layer['max_over_median'] for layer in trained):.1f} after training against \
{max(layer['max_over_median'] for layer in random):.1f} at random init.

{format_table(random, "random init")}

{format_table(trained, "trained")}
"""


def save_model(model, spec: ModelSpec, stats: dict, tokenizer_path: Path, staging: Path, out: Path) -> Path:
    """Write the checkpoint folder under ``staging`` and its tar under ``out`` (only the tar comes back)."""
    from transformers import PreTrainedTokenizerFast

    folder = staging / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), bos_token=DOC_SEPARATOR,
                                        eos_token=DOC_SEPARATOR, pad_token=DOC_SEPARATOR,
                                        model_max_length=stats["seq_len"])
    tokenizer.save_pretrained(folder)
    (folder / "training_stats.json").write_text(json.dumps(stats, indent=1))
    (folder / "MODEL_CARD.md").write_text(model_card(stats, spec))
    archive = out / f"{spec.name}.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(folder, arcname=spec.name)
    return archive


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(REPO / ".corpus"), help="folder with train.txt.xz, tokenizer.json")
    parser.add_argument("--heldout", default=str(REPO / "data/eval/heldout.jsonl"))
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/s4kv-train"))
    parser.add_argument("--staging", default="/tmp/s4kv-models", help="checkpoint folders (outside --out)")
    parser.add_argument("--models", default=",".join(m.name for m in MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seconds-per-model", type=float, default=200.0)
    parser.add_argument("--max-steps", type=int, default=0, help="fixed step count instead of the time budget")
    parser.add_argument("--calibration-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048, help="training context = max_position_embeddings")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--log-every", type=int, default=200)
    parser.add_argument("--probe-docs", type=int, default=4, help="held-out windows for the key statistics")
    parser.add_argument("--corpus-limit-mb", type=float, default=0, help="read only this much text (tests)")
    args = parser.parse_args(argv)

    wanted = args.models.split(",")
    unknown = set(wanted) - {m.name for m in MODELS}
    if unknown:
        raise SystemExit(f"unknown model(s) {sorted(unknown)}; known: {[m.name for m in MODELS]}")
    corpus, out = Path(args.corpus), Path(args.out)
    for needed in (corpus / "train.txt.xz", corpus / "tokenizer.json", Path(args.heldout)):
        if not needed.exists():
            raise SystemExit(f"missing {needed}: run tools/reference_models/build_corpus.py first "
                             "(and carry .corpus to the GPU)")
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "train_log.txt").open("a")

    def log(message: str) -> None:
        print(message, flush=True)
        log_file.write(message + "\n")
        log_file.flush()

    from tokenizers import Tokenizer

    tokenizer_path = corpus / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    vocab_size, separator_id = tokenizer.get_vocab_size(), tokenizer.token_to_id(DOC_SEPARATOR)
    started = time.perf_counter()
    stream = tokenize_corpus(corpus / "train.txt.xz", tokenizer_path,
                             int(args.corpus_limit_mb * 1e6) if args.corpus_limit_mb else None)
    log(f"[data] {stream.size / 1e6:.1f}M training tokens, vocabulary {vocab_size}, "
        f"tokenized in {time.perf_counter() - started:.0f}s")
    tokens = torch.from_numpy(stream.astype(np.int32)).to(args.device)
    windows = heldout_windows(tokenizer_path, Path(args.heldout), args.seq_len + 1, 32)
    summary = {}
    for spec in MODELS:
        if spec.name not in wanted:
            continue
        model, stats = train_one(spec, tokens, args, vocab_size, separator_id, windows, log)
        stats["vocab_size"] = vocab_size
        archive = save_model(model, spec, stats, tokenizer_path, Path(args.staging), out)
        size = sum(f.stat().st_size for f in (Path(args.staging) / spec.name).iterdir())
        log(f"[{spec.name}] saved {archive} ({size / 2**20:.1f} MiB)")
        summary[spec.name] = {k: stats[k] for k in ("parameters", "steps", "seconds", "heldout_loss",
                                                    "heldout_perplexity")}
        summary[spec.name]["key_max_over_median"] = max(
            layer["max_over_median"] for layer in stats["key_stats_trained"])
        summary[spec.name]["key_max_over_median_random"] = max(
            layer["max_over_median"] for layer in stats["key_stats_random_init"])
        del model
    log("[summary] " + json.dumps(summary))


if __name__ == "__main__":
    main()
