"""The prefill-capped scheduler (runtime/plugin/scheduler.py): its budget rule, its option, and the real CPU engine
running with it: no step that decodes takes more than its cap of prompt tokens, and greedy outputs are unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_subprocess import run_engine_job

from s4kv.runtime.plugin.scheduler import _capped, prefill_cap, step_budget



def test_a_step_with_decodes_gets_one_token_per_running_request_plus_the_cap():
    assert step_budget(8192, num_running=20, decoding=True, cap=2048) == 2068
    assert step_budget(8192, num_running=20, decoding=False, cap=2048) == 8192  # nothing decodes: vLLM's budget
    assert step_budget(2000, num_running=20, decoding=True, cap=2048) == 2000  # never above vLLM's budget


@pytest.mark.parametrize("config", [None, {}, {"s4kv_scheduler": {}},
                                    {"s4kv_scheduler": {"prefill_tokens_per_step": 0}},
                                    {"s4kv_scheduler": {"prefill_tokens_per_step": True}},
                                    {"s4kv_scheduler": {"prefill_tokens_per_step": "2048"}}])
def test_a_missing_or_bad_cap_is_refused_with_the_option_to_set(config):
    with pytest.raises(ValueError, match=r'additional_config\["s4kv_scheduler"\]\["prefill_tokens_per_step"\]'):
        prefill_cap(config)
    assert prefill_cap({"s4kv_scheduler": {"prefill_tokens_per_step": 2048}, "s4kv": {"scheme": "int4_kivi"}}) == 2048


def test_the_scheduler_refuses_an_engine_without_chunked_prefill():
    """Without chunked prefill, vLLM admits no prompt longer than the step's budget: with the cap that budget is
    small whenever a request decodes, so the scheduler would hold such a prompt and the queue behind it."""
    class VllmScheduler:  # the part of vLLM's scheduler the cap reads
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            self.max_num_scheduled_tokens = 8192

    def config(chunked):
        return SimpleNamespace(additional_config={"s4kv_scheduler": {"prefill_tokens_per_step": 2048}},
                               scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked))

    assert _capped(VllmScheduler)(vllm_config=config(True)).prefill_cap == 2048
    with pytest.raises(ValueError, match=r"needs chunked prefill: .* \(2048 tokens\)"):
        _capped(VllmScheduler)(vllm_config=config(False))


SCRIPT = """
import gc, json, sys
sys.path.insert(0, "tests/runtime")
from cpu_engine_job import engine_kwargs
from vllm import LLM, SamplingParams
from vllm.distributed import cleanup_dist_env_and_memory
from s4kv.runtime.bundled_models import FACTS, chat_text
from s4kv.runtime.plugin.scheduler import CAP_OPTION, CONFIG_KEY, QUALNAME

CAP = 16
prompts = [chat_text(q) for q, _ in FACTS]
# four sequences at a time, two of them short: as they end, two waiting prompts arrive beside two decodes
greedy = [SamplingParams(temperature=0, max_tokens=3 if i % 4 < 2 else 24) for i in range(len(prompts))]
result = {}
for name in ("vllm", "capped"):
    kwargs = dict(engine_kwargs("int4_kivi"), max_num_batched_tokens=512, max_num_seqs=4)
    steps = []
    if name == "capped":
        kwargs.update(scheduler_cls=QUALNAME,
                      additional_config=dict(kwargs["additional_config"], **{CONFIG_KEY: {CAP_OPTION: CAP}}))
    llm = LLM("models/tiny-qwen2", **kwargs)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule

    def recorded(*args, **kw):
        running = len(scheduler.running)
        decoding = any(not r.is_prefill_chunk for r in scheduler.running)
        out = schedule(*args, **kw)
        steps.append([running, decoding, out.total_num_scheduled_tokens])
        return out

    scheduler.schedule = recorded
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    result[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "steps": steps,
                    "scheduler": type(scheduler).__name__, "prompt_lens": [len(o.prompt_token_ids) for o in outputs]}
    del llm, scheduler, schedule
    gc.collect()
    cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(dict(result, cap=CAP)))
"""


def test_the_cpu_engine_with_the_cap_takes_at_most_the_cap_beside_decodes_and_generates_the_same():
    result = run_engine_job(["-c", SCRIPT], timeout=900)
    vllm, capped, cap = result["vllm"], result["capped"], result["cap"]
    assert capped["scheduler"].startswith("PrefillCapped")
    assert capped["tokens"] == vllm["tokens"]  # greedy: the same tokens, only scheduled differently
    assert min(capped["prompt_lens"]) > cap // 2  # prompts long enough that two do not fit the cap
    # vLLM's scheduler takes several prompts into a step that decodes; the capped one never exceeds its budget
    assert any(decoding and total > running + cap for running, decoding, total in vllm["steps"])
    decoding_steps = [(running, total) for running, decoding, total in capped["steps"] if decoding]
    assert decoding_steps and all(total <= running + cap for running, total in decoding_steps)
    assert len(capped["steps"]) > len(vllm["steps"])  # the prompts spread over more steps


def test_the_factory_keeps_vllms_choice_of_async_scheduling(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from s4kv.runtime.plugin import scheduler

    built = []
    monkeypatch.setattr(scheduler, "_capped", lambda base: lambda **kwargs: built.append(base))
    for async_scheduling, base in ((True, AsyncScheduler), (False, Scheduler)):
        config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
        scheduler.prefill_capped_scheduler(vllm_config=config, kv_cache_config=None)
        assert built[-1] is base
    monkeypatch.undo()
    assert issubclass(scheduler._capped(AsyncScheduler), AsyncScheduler)
    assert scheduler._capped(AsyncScheduler).__name__ == "PrefillCappedAsyncScheduler"
