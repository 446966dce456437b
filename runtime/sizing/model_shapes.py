"""The numbers of a model that size its weights and its KV cache, read from a Hugging Face config.json.

Offline only: a config.json path, a model folder, the local Hugging Face cache, or one of the few
well-known models below (so ``cdk synth -c modelId=Qwen/Qwen2.5-7B-Instruct`` works with no network).
No torch, no transformers, no vLLM import.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Bytes per weight by checkpoint dtype. vLLM's dtype "auto" serves float32 checkpoints in 16 bits.
_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 2.0, "float8_e4m3fn": 1.0}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    weight_bytes_per_param: float = 2.0
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def num_params(self) -> int:
        """Estimate from the shapes (biases and norms are noise): within ~1% of the published counts."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        if self.num_experts:
            mlp = self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size
            mlp += self.hidden_size * self.num_experts  # router
            mlp += 3 * self.hidden_size * self.shared_expert_intermediate_size
        else:
            mlp = 3 * self.hidden_size * self.intermediate_size  # gated MLP: gate, up, down
        per_layer = q_and_o + k_and_v + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings

    @property
    def weight_bytes(self) -> int:
        return int(self.num_params * self.weight_bytes_per_param)


def _first(config: dict, *keys: str, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _weight_bytes_per_param(config: dict) -> float:
    quant = config.get("quantization_config") or {}
    if quant.get("bits"):  # AWQ / GPTQ style
        return quant["bits"] / 8
    if quant.get("quant_method") == "fp8":
        return 1.0
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return _DTYPE_BYTES.get(dtype, 2.0)


def from_config(config: dict, name: str = "model") -> ModelShape:
    """Build a ModelShape from a config.json dict (multimodal configs: their ``text_config``)."""
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    required = {
        "num_hidden_layers": _first(config, "num_hidden_layers", "n_layer"),
        "hidden_size": _first(config, "hidden_size", "n_embd"),
        "num_attention_heads": _first(config, "num_attention_heads", "n_head"),
        "vocab_size": config.get("vocab_size"),
    }
    missing = [key for key, value in required.items() if value is None]
    if missing:
        raise ValueError(f"{name}: config.json lacks {', '.join(missing)}; is it a decoder-only LLM config?")
    hidden = int(required["hidden_size"])
    heads = int(required["num_attention_heads"])
    num_experts = int(_first(config, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if not shared and config.get("n_shared_experts"):
        shared = int(config["n_shared_experts"]) * int(config.get("moe_intermediate_size") or 0)
    return ModelShape(
        name=name,
        num_layers=int(required["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(_first(config, "num_key_value_heads", "num_kv_heads", default=heads)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(_first(config, "intermediate_size", "n_inner", default=4 * hidden)),
        vocab_size=int(required["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(_first(config, "max_position_embeddings", "n_positions", default=4096)),
        weight_bytes_per_param=_weight_bytes_per_param(config),
        num_experts=num_experts,
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=shared,
    )


def _preset(layers, hidden, heads, kv, inter, vocab, tie, max_pos) -> dict:
    return {
        "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
        "tie_word_embeddings": tie, "max_position_embeddings": max_pos, "torch_dtype": "bfloat16",
    }


# The config.json fields that matter, for the model families S4 KV supports (Qwen2.5, Llama-3; values from
# their config.json files). Anything else: pass the config.json path, or have the model in the local HF cache.
PRESETS: dict[str, dict] = {
    "Qwen/Qwen2.5-0.5B-Instruct": _preset(24, 896, 14, 2, 4864, 151936, True, 32768),
    "Qwen/Qwen2.5-1.5B-Instruct": _preset(28, 1536, 12, 2, 8960, 151936, True, 32768),
    "Qwen/Qwen2.5-3B-Instruct": _preset(36, 2048, 16, 2, 11008, 151936, True, 32768),
    "Qwen/Qwen2.5-7B-Instruct": _preset(28, 3584, 28, 4, 18944, 152064, False, 32768),
    "Qwen/Qwen2.5-14B-Instruct": _preset(48, 5120, 40, 8, 13824, 152064, False, 32768),
    "Qwen/Qwen2.5-32B-Instruct": _preset(64, 5120, 40, 8, 27648, 152064, False, 32768),
    "Qwen/Qwen2.5-72B-Instruct": _preset(80, 8192, 64, 8, 29568, 152064, False, 32768),
    "meta-llama/Llama-3.1-8B-Instruct": _preset(32, 4096, 32, 8, 14336, 128256, False, 131072),
    "meta-llama/Llama-3.1-70B-Instruct": _preset(80, 8192, 64, 8, 28672, 128256, False, 131072),
}


def _hf_cache_config(model_id: str) -> Path | None:
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    snapshots = Path(hub) / ("models--" + model_id.replace("/", "--")) / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1] if found else None


def load(model: str) -> ModelShape:
    """``model`` is a config.json path, a folder holding one, a preset id, or an id in the local HF cache."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        return from_config(config, name=config.get("_name_or_path") or model)
    if model in PRESETS:
        return from_config(PRESETS[model], name=model)
    cached = _hf_cache_config(model)
    if cached:
        return from_config(json.loads(cached.read_text()), name=model)
    raise ValueError(
        f"no config for {model!r}: not a file or folder, not in the local Hugging Face cache, and not one "
        f"of the built-in models ({', '.join(PRESETS)}); pass the path of its config.json"
    )
