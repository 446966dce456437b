"""Our part of a vLLM config: ``additional_config["s4kv"]`` and the checks that decide whether S4 KV can run.

Everything here is plain Python over dicts and small dataclasses, so ``s4kv check`` can judge a model from its
config.json without vLLM, a GPU or weights; the engine runs the very same checks on facts read from its VllmConfig
(``check_vllm_config``) while it builds the model, before any weight is loaded.
Each rejection is one sentence that names the cause and, where there is one, the fix.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from s4kv.kernels.layout import KIVI_BLOCK_SIZE
from s4kv.kernels.scheme import Int4Scheme
from s4kv.runtime.schemes import (ATTENTION_BACKEND, CONFIG_KEY, KIVI, KV_CACHE_DTYPE, MAX_GQA_GROUP,
                                 SUPPORTED_HEAD_DIMS, find_options)

from .version import VLLM_VERSION, vllm_version_mismatch

logger = logging.getLogger("vllm.s4kv")

# One page per kernel block of 128 tokens for both schemes (a KIVI key group is one full page).
BLOCK_SIZE = KIVI_BLOCK_SIZE
# Our own option next to the scheme's options: run a model outside the families the schemes were validated on.
ALLOW_UNSUPPORTED_MODEL = "allow_unsupported_model"

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
SUPPORTED_FAMILIES = "Qwen2, Qwen2.5 and Llama-3"
_MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "minicpm3"}
_FULL_ATTENTION_LAYER = "full_attention"
_SLIDING_LAYER_TYPES = {"sliding_attention", "chunked_attention"}
# vLLM's implementation of these computes head_dim = hidden_size / num_attention_heads and ignores a head_dim field.
_HEAD_DIM_FROM_HIDDEN_SIZE = {"Qwen2ForCausalLM"}


@dataclass(frozen=True)
class S4KVConfig:
    """The parsed ``additional_config["s4kv"]``: the scheme plus our own opt-in for other model families."""

    scheme: Int4Scheme
    allow_unsupported_model: bool = False

    @classmethod
    def parse(cls, options: Any) -> "S4KVConfig":
        if not isinstance(options, Mapping):
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"] must be an object like {{"scheme": "{KIVI}"}}, got {options!r}'
            )
        scheme_options = dict(options)
        allow = scheme_options.pop(ALLOW_UNSUPPORTED_MODEL, False)
        if not isinstance(allow, bool):
            raise ValueError(f"{ALLOW_UNSUPPORTED_MODEL} must be true or false, got {allow!r}")
        return cls(scheme=Int4Scheme.parse(scheme_options), allow_unsupported_model=allow)

    def to_options(self) -> dict[str, Any]:
        """The ``additional_config["s4kv"]`` dict that parses back to this config."""
        options: dict[str, Any] = {"scheme": self.scheme.name}
        if not self.scheme.is_kivi:
            if self.scheme.hadamard_block is not None:
                options["hadamard_block"] = self.scheme.hadamard_block
            options["rotate_values"] = self.scheme.rotate_values
        if self.allow_unsupported_model:
            options[ALLOW_UNSUPPORTED_MODEL] = True
        return options


# ---------------------------------------------------------------------------------------------------------------
# facts about the model and the engine settings
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the checks need to know about a model, from its config.json (or vLLM's reading of it)."""

    name: str
    architectures: tuple[str, ...]
    model_type: str
    head_dim: int | None
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    vocab_size: int = 0
    rope_theta: float = 0.0
    rope_type: str = ""
    uses_mla: bool = False
    sliding_window: bool = False
    hybrid: bool = False
    encoder_decoder: bool = False
    dual_chunk_attention: bool = False
    logit_softcapping: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Any, name: str = "model") -> "ModelFacts":
        """Facts from a config.json dict. Raises ValueError, naming the field, when a field has the wrong type.
        A multimodal config keeps its language model's settings under ``text_config``, as vLLM reads them."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"the config.json of {name} must be a JSON object, got {_json_kind(cfg)}.")
        text = _field(cfg, "text_config", Mapping, name) or cfg
        where = f"{name} (text_config)" if text is not cfg else name
        layer_types = set(_field(text, "layer_types", list, where, items=str) or [])
        rope = _field(text, "rope_parameters", Mapping, where) or _field(text, "rope_scaling", Mapping, where) or {}
        if _field(text, "use_sliding_window", bool, where) is False:  # Qwen2 keeps a sliding_window it does not use
            window_in_use = False
        else:
            window_in_use = bool(text.get("sliding_window") or text.get("attention_chunk_size"))
        hybrid_markers = (
            "layers_block_type", "hybrid_override_pattern", "mamba_d_state", "ssm_cfg", "linear_attn_config"
        )
        architectures = tuple(_field(cfg, "architectures", list, name, items=str) or ())
        model_type = _field(cfg, "model_type", str, name) or ""
        num_attention_heads = _field(text, "num_attention_heads", int, where) or 0
        return cls(
            name=name,
            architectures=architectures,
            model_type=model_type,
            head_dim=_head_dim(text, architectures, where),
            num_attention_heads=num_attention_heads,
            num_kv_heads=_field(text, "num_key_value_heads", int, where) or num_attention_heads,
            vocab_size=_field(text, "vocab_size", int, where) or 0,
            rope_theta=float(_field(text, "rope_theta", float, where) or _field(rope, "rope_theta", float, where) or 0),
            rope_type=str(rope.get("rope_type") or rope.get("type") or ""),
            uses_mla=bool(text.get("kv_lora_rank")) or model_type in _MLA_MODEL_TYPES,
            sliding_window=window_in_use or bool(layer_types & _SLIDING_LAYER_TYPES),
            hybrid=bool(layer_types - _SLIDING_LAYER_TYPES - {_FULL_ATTENTION_LAYER})
            or any(text.get(key) for key in hybrid_markers),
            encoder_decoder=bool(cfg.get("is_encoder_decoder") or text.get("is_encoder_decoder")),
            dual_chunk_attention=bool(text.get("dual_chunk_attention_config")),
            logit_softcapping=bool(_field(text, "attn_logit_softcapping", float, where)),
        )

    @classmethod
    def from_model_config(cls, model_config: Any) -> "ModelFacts":
        """Facts from vLLM's ModelConfig: the config.json reading, corrected by vLLM's own derived flags."""
        hf = model_config.hf_text_config
        facts = cls.from_hf_config(hf.to_dict(), name=str(model_config.model))
        architectures = tuple(getattr(model_config.hf_config, "architectures", None) or facts.architectures)
        derived_head_dim = any(a in _HEAD_DIM_FROM_HIDDEN_SIZE for a in architectures)
        return replace(
            facts,
            architectures=architectures,
            head_dim=facts.head_dim if derived_head_dim else model_config.get_head_size(),
            uses_mla=facts.uses_mla or bool(model_config.use_mla),
            sliding_window=facts.sliding_window or model_config.get_sliding_window() is not None,
            hybrid=facts.hybrid or bool(model_config.is_hybrid),
            encoder_decoder=facts.encoder_decoder or bool(model_config.is_encoder_decoder),
        )

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head (1 where the config does not say)."""
        if self.num_attention_heads <= 0 or self.num_kv_heads <= 0:
            return 1
        return self.num_attention_heads // self.num_kv_heads

    @property
    def family(self) -> str | None:
        """"qwen2" or "llama3" when the model is in a family the schemes were validated on, else None."""
        known = [SUPPORTED_ARCHITECTURES[a] for a in self.architectures if a in SUPPORTED_ARCHITECTURES]
        expected_type = known[0] if known else None
        if expected_type is None or self.model_type != expected_type:
            return None
        if expected_type == "qwen2":
            return "qwen2"
        # Llama-2 and Llama-3 share architecture and model_type; Llama-3 has the 128k vocabulary and rope_theta 5e5.
        if self.vocab_size >= 128000 or self.rope_theta >= 500000 or self.rope_type == "llama3":
            return "llama3"
        return None


def _head_dim(cfg: Mapping[str, Any], architectures: tuple[str, ...], where: str) -> int | None:
    """The head size the model's vLLM implementation uses."""
    hidden, heads = _field(cfg, "hidden_size", int, where), _field(cfg, "num_attention_heads", int, where)
    derived = hidden // heads if hidden and heads else None
    if any(a in _HEAD_DIM_FROM_HIDDEN_SIZE for a in architectures):
        return derived
    return _field(cfg, "head_dim", int, where) or derived


def _field(cfg: Mapping[str, Any], key: str, kind: type, where: str, items: type | None = None) -> Any:
    """cfg[key] when present and of the expected JSON type, else None; ValueError naming the field otherwise."""
    value = cfg.get(key)
    if value is None:
        return None
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and (items is None or all(isinstance(item, items) for item in value))
    if not ok:
        expected = {float: "a number", int: "an integer", str: "a string", bool: "true or false",
                    Mapping: "an object", list: f"a list of {_JSON_KINDS.get(items, 'values')}"}[kind]
        raise ValueError(f"{key} in the config.json of {where} must be {expected}, got {_json_kind(value)}.")
    return value


_JSON_KINDS = {str: "strings", int: "integers"}


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kind = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}
    return f"{kind.get(type(value), type(value).__name__)} {json.dumps(value)[:40]}"


@dataclass(frozen=True)
class EngineFacts:
    """The engine settings the checks need; the defaults are what `s4kv serve` passes."""

    vllm_version: str = VLLM_VERSION
    kv_cache_dtype: str = KV_CACHE_DTYPE
    attention_backend: str | None = ATTENTION_BACKEND
    block_size: int | None = None  # None: not set by the user (the backend then picks 128)
    speculative_decoding: bool = False
    kv_connector: bool = False
    context_parallel: bool = False
    kv_cache_dtype_skip_layers: tuple[str, ...] = field(default_factory=tuple)
    v2_model_runner: bool = False
    dual_batch_overlap: bool = False

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "EngineFacts":
        import vllm

        cache = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        transfer = vllm_config.kv_transfer_config
        backend = vllm_config.attention_config.backend
        return cls(
            vllm_version=vllm.__version__,
            kv_cache_dtype=str(cache.cache_dtype),
            attention_backend=backend.name if backend is not None else None,
            block_size=cache.block_size if cache.user_specified_block_size else None,
            speculative_decoding=vllm_config.speculative_config is not None,
            kv_connector=transfer is not None and bool(transfer.is_kv_transfer_instance),
            context_parallel=parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1,
            kv_cache_dtype_skip_layers=tuple(cache.kv_cache_dtype_skip_layers or ()),
            v2_model_runner=bool(vllm_config.use_v2_model_runner),
            dual_batch_overlap=bool(parallel.enable_dbo),
        )


# ---------------------------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------------------------
def engine_rejections(config: S4KVConfig, engine: EngineFacts) -> list[str]:
    scheme = config.scheme.name
    reasons = []
    version_problem = vllm_version_mismatch(engine.vllm_version)
    if version_problem is not None:
        reasons.append(version_problem)
    if engine.attention_backend != ATTENTION_BACKEND:
        reasons.append(missing_backend_message(config, engine.attention_backend))
    if engine.kv_cache_dtype != KV_CACHE_DTYPE:
        reasons.append(
            f"{scheme} needs --kv-cache-dtype {KV_CACHE_DTYPE} (its page budget), got {engine.kv_cache_dtype!r}."
        )
    if engine.block_size is not None and engine.block_size != BLOCK_SIZE:
        reasons.append(
            f"{scheme} needs --block-size {BLOCK_SIZE} (one int4 page per 128 tokens), got {engine.block_size}."
        )
    if engine.speculative_decoding and config.scheme.is_kivi:
        reasons.append(
            "int4_kivi cannot run with speculative decoding: rejected draft tokens would rewrite keys of a block "
            "that was already quantized per channel."
        )
    if engine.v2_model_runner and config.scheme.is_kivi:
        reasons.append(
            "int4_kivi's staging slots follow vLLM's V1 model runner, and vLLM picked its V2 runner for this model: "
            "set VLLM_USE_V2_MODEL_RUNNER=0."
        )
    if engine.dual_batch_overlap and config.scheme.is_kivi:
        reasons.append(
            "int4_kivi cannot run with dual batch overlap: its micro-batches would assign staging slots apart."
        )
    if engine.kv_connector:
        reasons.append(
            f"{scheme} cannot run with a KV connector: connectors move pages in vLLM's own layouts, not S4 KV's."
        )
    if engine.context_parallel:
        reasons.append(f"{scheme} does not support decode or prefill context parallelism.")
    if engine.kv_cache_dtype_skip_layers:
        reasons.append(
            f"{scheme} cannot keep some layers in bf16 (--kv-cache-dtype-skip-layers "
            f"{','.join(engine.kv_cache_dtype_skip_layers)}): every attention layer uses the int4 page."
        )
    return reasons


def model_rejections(config: S4KVConfig, model: ModelFacts) -> list[str]:
    scheme = config.scheme.name
    reasons = []
    if model.head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(
            f"{model.name} has head_dim {model.head_dim}; {scheme} supports head_dim "
            f"{' and '.join(map(str, SUPPORTED_HEAD_DIMS))} only (its int4 page and kernels are built for those)."
        )
    else:
        try:
            config.scheme.hadamard_block_for(model.head_dim)
        except ValueError as err:
            reasons.append(f"{model.name}: {err}.")
    if model.gqa_group > MAX_GQA_GROUP:
        reasons.append(
            f"{model.name} has {model.gqa_group} query heads per KV head ({model.num_attention_heads} and "
            f"{model.num_kv_heads}); {scheme}'s kernels are tested at groups of at most {MAX_GQA_GROUP}."
        )
    if model.uses_mla:
        reasons.append(f"{model.name} uses multi-head latent attention (MLA), which {scheme} does not support.")
    if model.sliding_window:
        reasons.append(f"{model.name} uses sliding-window attention, which {scheme} does not support.")
    if model.hybrid:
        reasons.append(
            f"{model.name} is a hybrid model (attention mixed with other layer types), which {scheme} does not support."
        )
    if model.encoder_decoder:
        reasons.append(f"{model.name} is an encoder-decoder model; {scheme} supports decoder-only self-attention.")
    if model.dual_chunk_attention:
        reasons.append(f"{model.name} uses dual-chunk attention, which {scheme} does not support.")
    if model.logit_softcapping:
        reasons.append(f"{model.name} soft-caps its attention logits, which {scheme} does not support.")
    if model.family is None and not config.allow_unsupported_model:
        reasons.append(
            f"{model.name} ({'/'.join(model.architectures) or 'no architecture'}, model_type {model.model_type!r}) is "
            f"outside the {SUPPORTED_FAMILIES} families S4 KV is validated on; to run it anyway pass "
            f"--allow-unsupported-model to s4kv serve or s4kv check, or set "
            f'"{ALLOW_UNSUPPORTED_MODEL}": true in the s4kv options of vllm serve or Python.'
        )
    return reasons


def missing_backend_message(config: S4KVConfig, selected: str | None) -> str:
    return (
        f"S4 KV options were given ({config.scheme.name}) but the attention backend is "
        f"{selected or 'automatic'}, not {ATTENTION_BACKEND}: add --attention-backend {ATTENTION_BACKEND} "
        f'(Python: attention_config={{"backend": "{ATTENTION_BACKEND}"}}), otherwise vLLM would run a different '
        f"KV format."
    )


def as_sentence(err: Exception) -> str:
    """An error's message as printed on the command line: one line ending in a full stop."""
    text = " ".join(str(err).split())
    return text if text.endswith(".") else text + "."


class S4KVConfigError(ValueError):
    """S4 KV cannot run with this model or these settings; the message holds one sentence per cause."""


def check_vllm_config(vllm_config: Any) -> S4KVConfig | None:
    """Our config from a VllmConfig, after every check; None when S4 KV was not asked for. Raises S4KVConfigError."""
    options = find_options(vllm_config.additional_config)
    if options is None:
        return None
    try:
        config = S4KVConfig.parse(options)
    except ValueError as err:
        raise S4KVConfigError(str(err)) from None
    reasons = engine_rejections(config, EngineFacts.from_vllm_config(vllm_config))
    reasons += model_rejections(config, ModelFacts.from_model_config(vllm_config.model_config))
    if reasons:
        raise S4KVConfigError(" ".join(reasons))
    return config


def read_model_config(model: str) -> tuple[dict[str, Any], str]:
    """config.json of a model, never downloading: a local folder, a config.json path, or a Hugging Face id that is
    already in the local Hugging Face cache. Returns (config, display name)."""
    if os.path.isdir(model):
        path, name = os.path.join(model, "config.json"), os.path.basename(os.path.normpath(model))
    elif os.path.isfile(model):
        path, name = model, os.path.splitext(os.path.basename(model))[0]
    else:
        path, name = _cached_hub_config(model), model
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(
            f"no config.json for {model!r}: pass a local model folder, its config.json, or a Hugging Face id "
            "already in the local cache (nothing is downloaded)."
        )
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle), name
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err.msg}, line {err.lineno} column {err.colno}).") from None


def _cached_hub_config(repo_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repository id
        return None
    return found if isinstance(found, str) else None
