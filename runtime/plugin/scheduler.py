"""A vLLM scheduler that caps the prompt tokens a step takes while requests are decoding.

vLLM 0.26's V1 scheduler fills every step up to ``max_num_batched_tokens`` (8,192 by default for the OpenAI server),
so where the KV cache has room a step can hold several whole prompts beside the running decodes, and every
decoding request waits for that step: its inter-token latency is the step's length. A KV cache with more room (int4
holds 3.76x the tokens of bf16) admits more prompts at once, and its slowest inter-token gaps grow with them.
``max_num_batched_tokens`` itself cannot cap only those steps (it also bounds a prompt's step when nothing decodes,
and a 2,048-token prompt beside its decodes then no longer fits one step), and the V1 scheduler ignores
``max_num_partial_prefills``.

This scheduler (any KV format) gives a step ``running requests + prefill_tokens_per_step`` tokens while any
running request decodes, and vLLM's full budget otherwise: a prompt of up to the cap still prefills in one step, a
second waits for the next. The trade is the user's: lower p99 inter-token latency under load, later first tokens
for prompts that arrive together. Enable it with

    --scheduler-cls s4kv.runtime.plugin.scheduler.prefill_capped_scheduler
    --additional-config '{"s4kv_scheduler": {"prefill_tokens_per_step": 2048}}'

(the ``s4kv`` key of an int4 KV cache goes into the same object); ``s4kv serve`` writes both, with a cap of
2,048 unless ``--prefill-tokens-per-step`` says otherwise.
"""

from __future__ import annotations

import functools
from typing import Any

from s4kv.runtime.schemes import PREFILL_CAP_OPTION as CAP_OPTION
from s4kv.runtime.schemes import PREFILL_CAPPED_SCHEDULER as QUALNAME
from s4kv.runtime.schemes import SCHEDULER_CONFIG_KEY as CONFIG_KEY


def prefill_cap(additional_config: Any) -> int:
    """The cap from ``additional_config["s4kv_scheduler"]["prefill_tokens_per_step"]``: a positive token count."""
    options = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    cap = options.get(CAP_OPTION) if isinstance(options, dict) else None
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f'{QUALNAME} needs additional_config["{CONFIG_KEY}"]["{CAP_OPTION}"], a positive number of '
                         f"tokens (e.g. 2048), got {cap!r}")
    return cap


def check_config(vllm_config: Any) -> int:
    """The cap, once the engine's config shows the scheduler can keep it (ValueError names what to change): without
    chunked prefill vLLM stops admitting at a prompt longer than the step's budget, so such a prompt, and the queue
    behind it, would wait until no request decodes."""
    cap = prefill_cap(vllm_config.additional_config)
    if not vllm_config.scheduler_config.enable_chunked_prefill:
        raise ValueError(f"{QUALNAME} needs chunked prefill: without it a prompt longer than its cap ({cap} tokens) "
                         f"waits, with every request behind it, until no request decodes; enable chunked prefill, or "
                         f"run vLLM's own scheduler (s4kv serve --prefill-tokens-per-step 0)")
    return cap


def step_budget(full_budget: int, num_running: int, decoding: bool, cap: int) -> int:
    """A step's token budget: vLLM's full one, or where a running request decodes one token per running request
    (its decode, or a share of a chunked prompt's next chunk) plus the cap, never more than the full one."""
    return min(full_budget, num_running + cap) if decoding else full_budget


@functools.cache
def _capped(base: type) -> type:
    class PrefillCapped(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.prefill_cap = check_config(self.vllm_config)
            self.full_step_budget = self.max_num_scheduled_tokens

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            decoding = any(not request.is_prefill_chunk for request in self.running)
            self.max_num_scheduled_tokens = step_budget(
                self.full_step_budget, len(self.running) * (1 + self.num_spec_tokens), decoding, self.prefill_cap)
            return super().schedule(*args, **kwargs)

    PrefillCapped.__name__ = PrefillCapped.__qualname__ = f"PrefillCapped{base.__name__}"
    return PrefillCapped


def prefill_capped_scheduler(*, vllm_config: Any, **kwargs: Any) -> Any:
    """The engine's scheduler (``--scheduler-cls`` resolves to this and calls it as a class): vLLM's async
    scheduler or its plain one, as the engine's ``async_scheduling`` decided, with the step cap."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
    return _capped(base)(vllm_config=vllm_config, **kwargs)
