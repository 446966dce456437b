"""int4_kivi's max_num_seqs where the user chose none: the staging pool's cap of the capacity plan.

int4_kivi keeps one staging slot per max_num_seqs in every layer (staging.py), allocated before vLLM profiles
memory, so the pool comes out of the KV cache. At vLLM's default max_num_seqs for its OpenAI server (256, or 1,024 on
GPUs of 70 GiB or more other than the A100) the pool would take 64% of an 8B model's KV on a 24 GB card.
`s4kv capacity` and the CDK app pass a cap that keeps the pool within an eighth of the KV budget
(runtime/sizing/capacity.py); `s4kv serve` applies the same rule, on the GPU it runs on, when --max-num-seqs is not
given. With --kv-cache-memory-bytes the cache is sized apart from the pool, so nothing is capped.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from s4kv.runtime.sizing import capacity, model_shapes

from .config import S4KVConfig

logger = logging.getLogger("vllm.s4kv")


def gpu_total_bytes() -> int | None:
    """The first GPU's total memory as vLLM's platform reads it (through NVML where it can, so this process makes no
    CUDA context beside the engine's); None off CUDA."""
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory(0) if current_platform.is_cuda() else None


def capped_max_num_seqs(vllm_config: Any, total_bytes: int) -> int | None:
    """int4_kivi's max_num_seqs under the plan's staging cap on a GPU of ``total_bytes``, where it is below the one
    vLLM resolved; None where the cap does not bind or the KV cache is sized explicitly."""
    cache = vllm_config.cache_config
    if cache.kv_cache_memory_bytes is not None:
        return None
    model = vllm_config.model_config
    resolved = vllm_config.scheduler_config.max_num_seqs
    try:
        shape = model_shapes.from_config(model.hf_config.to_dict(), name=model.model)
    except ValueError as err:  # a model outside the supported families (allow_unsupported_model)
        logger.warning("S4 KV: int4_kivi's max_num_seqs stays at %d, uncapped: %s; pass --max-num-seqs to keep its "
                       "staging pool within the KV memory", resolved, err)
        return None
    tp = vllm_config.parallel_config.tensor_parallel_size
    capped = capacity.kivi_max_num_seqs(shape, total_bytes, cache.gpu_memory_utilization, tp, default=resolved)
    return capped if capped < resolved else None


def cap_kivi_max_num_seqs(args: Namespace, vllm_config: Any, config: S4KVConfig | None) -> int | None:
    """Set ``args.max_num_seqs`` (the engine is built from ``args`` later) to int4_kivi's capped count where the user
    gave none and the cap binds; returns it, or None when nothing changed."""
    if config is None or not config.scheme.is_kivi or args.max_num_seqs is not None:
        return None
    total = gpu_total_bytes()
    if total is None:
        return None
    capped = capped_max_num_seqs(vllm_config, total)
    if capped is None:
        return None
    args.max_num_seqs = capped
    logger.info("S4 KV: max_num_seqs %d for int4_kivi (vLLM's default %d): its staging pool then takes at most an "
                "eighth of the KV memory, as `s4kv capacity` plans it; pass --max-num-seqs to choose another",
                capped, vllm_config.scheduler_config.max_num_seqs)
    return capped
