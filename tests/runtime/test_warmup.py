"""runtime/plugin/warmup.py: the start-up warm-up of the eager-step kernels on vLLM's V1 runner. The dummy steps'
sizes against vLLM 0.26's mixed dummy batch, the warm-up on the real CPU engine's runner (both schemes), and the hook
in the GPU worker.
tests/runtime/test_backend_steps.py runs the GPU path's layer through the same dummy steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_subprocess import run_engine_job

from s4kv.runtime.plugin.config import BLOCK_SIZE
from s4kv.runtime.plugin.warmup import mixed_steps

pytest.importorskip("vllm")


def dummy_batch(num_tokens: int, max_num_seqs: int, profile_seq_lens: int | None = None):
    """(decode count, prefill tokens, prefill's first position) of vLLM 0.26's mixed dummy batch
    (GPUModelRunner._dummy_run with create_mixed_batch)."""
    decodes = min(max_num_seqs - 1, num_tokens // 2)
    prefill = num_tokens - decodes
    seq_len = profile_seq_lens if profile_seq_lens is not None else prefill + 1
    return decodes, prefill, seq_len - prefill


@pytest.mark.parametrize("max_num_seqs", [2, 3, 4, 8, 64, 129, 130, 256, 1024])
def test_the_steps_cross_a_block_from_inside_it_and_fill_two_blocks_from_position_0(max_num_seqs):
    chunk, prompt = mixed_steps(8192, max_num_seqs)
    decodes, tokens, first = dummy_batch(max_num_seqs=max_num_seqs, **chunk)
    assert decodes >= 1 and first == 1
    assert first < BLOCK_SIZE <= first + tokens - 1 < 2 * BLOCK_SIZE - 1  # closes block 0, ends inside block 1
    decodes, tokens, first = dummy_batch(max_num_seqs=max_num_seqs, **prompt)
    assert decodes >= 1 and first == 0 and tokens == 2 * BLOCK_SIZE


def test_no_steps_for_one_sequence_a_step_or_a_small_token_budget():
    assert mixed_steps(8192, 1) == []
    assert mixed_steps(2 * BLOCK_SIZE, 256) == []


def test_the_hook_runs_the_warm_up_after_vllms_in_the_v1_runner_only(monkeypatch):
    from vllm.v1.worker import gpu_worker

    from s4kv.runtime.plugin import warmup

    calls = []
    monkeypatch.setattr(gpu_worker, "kernel_warmup", lambda worker: calls.append(("vllm", worker)))
    monkeypatch.setattr(warmup, "warm_up_eager_steps", lambda runner: calls.append(("s4kv", runner)))
    warmup.install_warmup_hook()
    warmup.install_warmup_hook()  # idempotent: one wrapper
    v1 = SimpleNamespace(use_v2_model_runner=False, model_runner="v1 runner")
    v2 = SimpleNamespace(use_v2_model_runner=True, model_runner="v2 runner")
    gpu_worker.kernel_warmup(v1)
    gpu_worker.kernel_warmup(v2)
    assert calls == [("vllm", v1), ("s4kv", "v1 runner"), ("vllm", v2)]


def test_a_failed_warm_up_step_is_reported_and_the_start_goes_on(monkeypatch):
    from s4kv.runtime.plugin import warmup

    def failing_dummy_run(**_):
        raise RuntimeError("no room")

    from s4kv.runtime.plugin.backend import S4KVMetadataBuilder

    builder = object.__new__(S4KVMetadataBuilder)  # the class is what marks S4 KV's attention, staging or not
    group = SimpleNamespace(kv_cache_group_id=0, metadata_builders=[builder])
    runner = SimpleNamespace(attn_groups=[[group]], max_num_tokens=8192,
                             scheduler_config=SimpleNamespace(max_num_seqs=8), _dummy_run=failing_dummy_run)
    warnings = []
    monkeypatch.setattr(warmup.logger, "warning", lambda message, *args: warnings.append(message % args))
    assert warmup.warm_up_eager_steps(runner) is False
    assert len(warnings) == 1 and "RuntimeError: no room" in warnings[0] and "will compile them" in warnings[0]
    assert warmup.warm_up_eager_steps(SimpleNamespace(attn_groups=[])) is False  # no S4 KV layer: nothing to do
    other = SimpleNamespace(attn_groups=[[SimpleNamespace(kv_cache_group_id=0, metadata_builders=[object()])]])
    assert warmup.warm_up_eager_steps(other) is False and len(warnings) == 1


def test_the_slot_mapping_is_launched_on_the_runners_block_tables_for_no_tokens():
    import torch

    from s4kv.runtime.plugin import warmup

    calls = []
    block_tables = SimpleNamespace(compute_slot_mapping=lambda *args: calls.append(args))
    runner = SimpleNamespace(device=torch.device("cpu"), input_batch=SimpleNamespace(block_table=block_tables))
    warmup.warm_up_slot_mapping(runner)
    [(num_reqs, query_start_loc, positions)] = calls
    assert num_reqs == 1 and query_start_loc.tolist() == [0, 0]  # one sequence, no tokens: only padding written
    assert query_start_loc.dtype == torch.int32 and positions.dtype == torch.int64  # the V1 runner's dtypes


@pytest.mark.parametrize("scheme", ["int4_kivi", "int4_saw"])
def test_the_warm_up_on_the_cpu_engine_changes_no_output(scheme):
    """The two dummy steps through the real engine's runner (vLLM's CPU platform, the scheme's CPU layer), between
    two greedy generations of a prompt that closes a page: the same tokens after as before."""
    script = """
import json, sys
sys.path.insert(0, "tests/runtime")
from cpu_engine_job import LONG_PROMPT, engine_kwargs
from vllm import LLM, SamplingParams
from s4kv.runtime.plugin.warmup import warm_up_eager_steps
llm = LLM("models/tiny-qwen2", **dict(engine_kwargs(sys.argv[1]), max_num_batched_tokens=512))
greedy = SamplingParams(temperature=0, max_tokens=16)
before = list(llm.generate([LONG_PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
warmed = warm_up_eager_steps(runner)
after = list(llm.generate([LONG_PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)
print("RESULT " + json.dumps({"warmed": warmed, "before": before, "after": after}))
"""
    result = run_engine_job(["-c", script, scheme], timeout=600)
    assert result["warmed"] and len(result["before"]) >= 8
    assert result["after"] == result["before"]
