"""The one vLLM version gate: S4 KV reaches into vLLM 0.26.0's internals (attention-backend registry, KV-cache specs,
metadata builders), so any other version is refused before they are touched."""

from __future__ import annotations

VLLM_VERSION = "0.26.0"


def vllm_version_mismatch(installed: str) -> str | None:
    """Why the installed vLLM (its ``__version__``, local build tags such as ``+cpu`` ignored) cannot host S4 KV, in
    one sentence, or None when it is the supported version."""
    if installed.split("+")[0] != VLLM_VERSION:
        return f"S4 KV supports vLLM {VLLM_VERSION} only, found vLLM {installed}."
    return None
