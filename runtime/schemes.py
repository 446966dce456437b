"""The names every part of S4 KV shares: the two schemes and their options, the vLLM settings that select them,
and the KV formats (bytes per token, tokens per page) that sizing, benchmarks and the CDK app count with.

Standard library only: the CDK app, ``s4kv capacity`` and the kernels import this module without torch or vLLM.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping, MutableMapping, get_args

# --- the schemes ---------------------------------------------------------------------------------------------
SchemeName = Literal["int4_kivi", "int4_saw"]
KIVI: SchemeName = "int4_kivi"
SAW: SchemeName = "int4_saw"
SCHEMES: tuple[SchemeName, ...] = get_args(SchemeName)
DEFAULT_SCHEME: SchemeName = KIVI
# The keys of additional_config["s4kv"] each scheme accepts.
SCHEME_OPTIONS: dict[SchemeName, frozenset[str]] = {
    KIVI: frozenset({"scheme"}),
    SAW: frozenset({"scheme", "hadamard_block", "rotate_values"}),
}
SAW_HADAMARD_BLOCKS = (32, 64, 128)  # block sizes of int4_saw's block-diagonal Hadamard rotation (default: the head)
# The head sizes both schemes are built for; kernels/layout.py lays out their pages and says why these.
SUPPORTED_HEAD_DIMS = (64, 128)
# The most query heads per KV head (the GQA group) the kernels are tested at: a decode program holds its sequence's
# group in one 16-row MMA tile, and 16 (Llama-3.1-405B) is the largest group in the supported families. A larger
# group would run 32-64-row tiles, a shape the GPU tests do not cover.
MAX_GQA_GROUP = 16

# --- how vLLM 0.26.0 is told to run them ---------------------------------------------------------------------
CONFIG_KEY = "s4kv"  # additional_config key
# vLLM 0.26 cannot learn a new --kv-cache-dtype string from a plugin; both schemes reuse this one's page budget.
KV_CACHE_DTYPE = "int4_per_token_head"
ATTENTION_BACKEND = "CUSTOM"


def find_options(additional_config: Any) -> Any | None:
    """Our options inside vLLM's additional_config, or None when the user did not ask for S4 KV."""
    if isinstance(additional_config, Mapping):
        return additional_config.get(CONFIG_KEY)
    return None


V2_MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

# The plugin's prefill-capped scheduler (runtime/plugin/scheduler.py), for any KV format: vLLM's --scheduler-cls
# and the additional_config entry that sets its cap.
PREFILL_CAPPED_SCHEDULER = "s4kv.runtime.plugin.scheduler.prefill_capped_scheduler"
SCHEDULER_CONFIG_KEY = "s4kv_scheduler"
PREFILL_CAP_OPTION = "prefill_tokens_per_step"
# `s4kv serve`'s cap unless told otherwise: on an H100 serving the Llama-3.1-8B shape with 2,048-token prompts it cut
# p99 inter-token latency at 8-12 requests/s and 48 in flight for every KV format at the same tokens/s, where 1,024
# cost a fifth of the throughput at 48 in flight and 4,096 kept more of the long gaps (docs/results/performance.md).
DEFAULT_PREFILL_TOKENS_PER_STEP = 2048


def prefill_capped_scheduler_settings(cap: int) -> tuple[list[str], dict[str, Any]]:
    """The vLLM flags and the additional_config entry for ``--prefill-tokens-per-step cap`` (`s4kv serve`, `s4kv
    bench --serve`): the prefill-capped scheduler with ``cap``, or for 0 none (vLLM's own scheduler); ValueError for
    a negative cap."""
    if cap < 0:
        raise ValueError(f"--prefill-tokens-per-step must be a number of tokens (0: vLLM's own scheduler), got {cap}.")
    if cap == 0:
        return [], {}
    return ["--scheduler-cls", PREFILL_CAPPED_SCHEDULER], {SCHEDULER_CONFIG_KEY: {PREFILL_CAP_OPTION: cap}}


def choose_model_runner(additional_config: Any, environ: MutableMapping[str, str] = os.environ) -> None:
    """Select vLLM's V1 model runner in ``environ`` (a vLLM process's environment) for int4_kivi, whose staging slots
    follow that runner (kernels/staging.py); vLLM 0.26 picks its V2 runner by default for dense models. Call before
    vLLM builds its config. A runner the user chose is kept: the engine check then refuses V2 with the reason."""
    options = find_options(additional_config)
    if not isinstance(options, Mapping) or options.get("scheme") != KIVI or V2_MODEL_RUNNER_ENV in environ:
        return
    environ[V2_MODEL_RUNNER_ENV] = "0"
    logging.getLogger("vllm.s4kv").info("S4 KV: int4_kivi runs on vLLM's V1 model runner (%s=0)",
                                        V2_MODEL_RUNNER_ENV)

# --- KV formats: what one token of one KV head costs in the cache --------------------------------------------
KvFormatName = Literal["bf16", "fp8", "int4"]


@dataclass(frozen=True)
class KvFormat:
    """A KV-cache storage format as vLLM pages it: bytes per token and KV head, tokens per page."""

    name: KvFormatName
    block_size: int  # tokens per vLLM page

    def bytes_per_head_token(self, head_dim: int) -> int:
        # int4: head_dim/2 bytes of codes for K and for V, plus an fp16 (scale, min) pair for each (S4 KV and vLLM's
        # int4_per_token_head alike: 136 at head_dim 128, 72 at 64).
        return {"bf16": 4 * head_dim, "fp8": 2 * head_dim, "int4": head_dim + 8}[self.name]


KV_FORMATS: dict[KvFormatName, KvFormat] = {
    "bf16": KvFormat("bf16", 16), "fp8": KvFormat("fp8", 16), "int4": KvFormat("int4", 128),
}
# What a deployment can serve: one of the schemes, or plain bf16 KV; and the KV format each one stores.
ServedScheme = Literal["int4_kivi", "int4_saw", "bf16"]
SCHEME_FORMAT: dict[ServedScheme, KvFormatName] = {KIVI: "int4", SAW: "int4", "bf16": "bf16"}
SERVED_SCHEMES: tuple[ServedScheme, ...] = get_args(ServedScheme)
