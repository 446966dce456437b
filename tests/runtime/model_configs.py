"""config.json contents for the accept/reject cases of the plugin tests (published shapes, trimmed to what the
checks and vLLM's config parsing read). No weights anywhere: every case must be decided from config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu",
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "tie_word_embeddings": False,
}

# name -> (config.json, words the rejection sentence must contain)
REJECTED_MODELS = {
    "head_dim_96": (
        dict(LLAMA31_8B, hidden_size=3072, num_attention_heads=32, num_key_value_heads=8, head_dim=96),
        ["head_dim 96", "head_dim 64 and 128 only"],
    ),
    "head_dim_256": (
        dict(LLAMA31_8B, hidden_size=4096, num_attention_heads=16, num_key_value_heads=4, head_dim=256),
        ["head_dim 256", "head_dim 64 and 128 only"],
    ),
    "mla": (
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
         "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 128, "num_hidden_layers": 61,
         "vocab_size": 129280},
        ["multi-head latent attention (MLA)"],
    ),
    "sliding_window_mistral": (
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32,
         "vocab_size": 32000, "sliding_window": 4096, "rope_theta": 10000.0},
        ["sliding-window attention"],
    ),
    "sliding_window_qwen2": (
        dict(QWEN25_7B, use_sliding_window=True, sliding_window=4096, max_window_layers=14),
        ["sliding-window attention"],
    ),
    "hybrid": (
        dict(QWEN25_7B, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", head_dim=128,
             layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 7),
        ["hybrid model"],
    ),
    "encoder_decoder": (
        {"architectures": ["BartForConditionalGeneration"], "model_type": "bart", "d_model": 1024,
         "hidden_size": 1024, "num_attention_heads": 8, "is_encoder_decoder": True, "vocab_size": 50265},
        ["encoder-decoder model"],
    ),
    "llama2_family": (
        dict(LLAMA31_8B, vocab_size=32000, rope_theta=10000.0, rope_scaling=None, num_key_value_heads=32),
        ["outside the Qwen2, Qwen2.5 and Llama-3 families", '"allow_unsupported_model": true'],
    ),
    "qwen3_family": (
        dict(QWEN25_7B, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128),
        ["outside the Qwen2, Qwen2.5 and Llama-3 families"],
    ),
    # vLLM's Qwen2 computes head_dim = hidden_size / heads (2688 / 28 = 96) and ignores the head_dim field.
    "qwen2_head_dim_field_ignored": (
        dict(QWEN25_7B, hidden_size=2688, head_dim=128),
        ["head_dim 96", "head_dim 64 and 128 only"],
    ),
    # 32 query heads on one KV head: a decode tile of 32 rows, beyond the largest group the kernels are tested at
    "gqa_group_32": (
        dict(LLAMA31_8B, num_key_value_heads=1),
        ["32 query heads per KV head", "groups of at most 16"],
    ),
    "logit_softcapping": (
        dict(LLAMA31_8B, attn_logit_softcapping=50.0),
        ["soft-caps its attention logits"],
    ),
    # Gemma-3 multimodal: the language model's settings live under text_config (head_dim 256, sliding layers).
    "gemma3_multimodal": (
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_attention_heads": 8,
                         "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 34, "vocab_size": 262208,
                         "sliding_window": 1024, "rope_theta": 1000000.0,
                         "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5
                         + ["sliding_attention"] * 4},
         "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}},
        ["head_dim 256", "sliding-window attention", "outside the Qwen2, Qwen2.5 and Llama-3 families"],
    ),
}
# config.json contents that are not a usable config: name -> (raw file text, words of the one-sentence error)
MALFORMED_CONFIGS = {
    "a_list": ("[]", ["must be a JSON object, got a list"]),
    "null": ("null", ["must be a JSON object, got null"]),
    "a_string": ('"Qwen2"', ["must be a JSON object, got a string"]),
    "not_json": ('{"architectures": ["Qwen2ForCausalLM"],', ["config.json is not valid JSON", "line 1"]),
    "architectures_string": (json.dumps(dict(QWEN25_7B, architectures="Qwen2ForCausalLM")),
                             ["architectures", "must be a list of strings, got a string"]),
    "layer_types_string": (json.dumps(dict(QWEN25_7B, layer_types="full_attention")),
                           ["layer_types", "must be a list of strings"]),
    "vocab_size_string": (json.dumps(dict(QWEN25_7B, vocab_size="152064")),
                          ["vocab_size", "must be an integer, got a string"]),
    "text_config_list": (json.dumps(dict(QWEN25_7B, text_config=[])), ["text_config", "must be an object"]),
}
# Llama-3.2-1B: head_dim 64 (2048 / 32), 16 layers
LLAMA32_1B = dict(LLAMA31_8B, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=64, num_hidden_layers=16, tie_word_embeddings=True,
                  rope_scaling=dict(LLAMA31_8B["rope_scaling"], factor=32.0))
ACCEPTED_MODELS = {"qwen2.5-7b": QWEN25_7B, "llama-3.1-8b": LLAMA31_8B, "llama-3.2-1b": LLAMA32_1B}


def write_model_dir(root: Path, name: str, config: dict | str) -> Path:
    """A model folder holding only config.json (and no weights); a str is written as the file's raw text."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path
