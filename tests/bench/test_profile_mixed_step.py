"""tools/device/profile_mixed_step.py: the profile's arithmetic on synthetic events, and one format end to end in
vLLM's CPU engine on a bundled tiny model (about a minute on 2 cores)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from tools.device import profile_mixed_step as pms


def event(name: str, start: float, end: float, device: DeviceType = DeviceType.CUDA):
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=device, time_range=span)


def test_kernel_profile_sums_per_kernel_and_counts_overlaps_once():
    prof = SimpleNamespace(events=lambda: [
        event("gemm", 0, 10), event("gemm", 20, 30), event("attn", 5, 12), event("attn", 40, 41),
        event("vllm::unified_attention_with_output", 0, 7, DeviceType.CPU),
        event("vllm::unified_attention_with_output", 8, 9, DeviceType.CPU),
        event("aten::mm", 0, 100, DeviceType.CPU),
    ])
    p = pms.kernel_profile(prof, wall_us=50.0)
    assert p["kernels"] == [["gemm", 20, 2], ["attn", 8, 2]]
    assert p["kernel_us"] == 28
    assert p["busy_us"] == 12 + 10 + 1  # [0, 12] + [20, 30] + [40, 41]
    assert p["host_ops"] == [["vllm::unified_attention_with_output", 8, 2]]
    assert p["wall_us"] == 50.0
    assert p["span_us"] == 41 and p["idle_in_span_us"] == 41 - 23
    assert p["largest_gaps"] == [[10, "gemm", "attn"], [8, "attn", "gemm"]]  # [30, 40] and [12, 20]


def test_configs_name_a_format_and_optionally_the_v1_runner():
    assert pms.parse_config("bf16_fa3") == ("bf16_fa3", False)
    assert pms.parse_config("s4kv_saw:v1") == ("s4kv_saw", True)
    with pytest.raises(SystemExit, match="unknown format 'bf17'"):
        pms.parse_config("bf17:v1")


def test_table_lists_skipped_and_failed_configs():
    spec = {"decodes": 2, "context": 64, "prompt_len": 64, "prompts": 3, "repeats": 2}
    text = pms.table([{"config": "bf16_fa3", "status": "skipped"}, {"config": "s4kv_saw", "status": "failed"}], spec)
    assert "| bf16_fa3 | skipped |" in text and "| s4kv_saw | failed |" in text
    assert text.startswith("2 decodes of 64-token prompts; a mixed step adds the prefill of 3 64-token prompts.")
    del spec["prompts"]  # a run saved before --prompts prefilled one
    assert "adds the prefill of one 64-token prompt." in pms.table([], spec)


def test_prompts_must_be_at_least_one(capsys):
    with pytest.raises(SystemExit):
        pms.main(["--prompts", "0"])
    assert "--prompts must be at least 1" in capsys.readouterr().err


def ok_result(config: str, wall_ms: float, busy_ms: float, forward_ms: float, update_ms: float) -> dict:
    profile = {"wall_us": 1e3 * wall_ms, "busy_us": 1e3 * busy_ms, "kernel_us": 1e3 * busy_ms, "kernels": [],
               "host_ops": []}
    host = {"S4KVAttentionImpl.forward": [forward_ms, 32], "S4KVAttentionImpl.do_kv_cache_update": [update_ms, 32],
            "paged_attention": [forward_ms / 2, 32]}  # nested inside forward: not added again
    return {"config": config, "status": "ok", "decode_step_ms": 8.0, "mixed_step_ms": wall_ms,
            "host_ms": {"mixed": host, "decode": {}}, "mixed_profile": profile, "decode_profile": profile}


def test_plot_draws_wall_busy_and_host_time_per_config(tmp_path):
    spec = {"decodes": 8, "context": 2048, "prompt_len": 2048, "repeats": 10}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"spec": spec, "results": [ok_result("bf16_fa3", 50.0, 43.0, 5.0, 2.0),
                                                           ok_result("s4kv_saw:v1", 52.0, 44.0, 13.0, 5.0),
                                                           {"config": "s4kv_kivi", "status": "skipped"}]}))
    assert pms.main(["--plot", str(saved), "--out", str(tmp_path / "out")]) == 0
    svg = (tmp_path / "out" / "mixed_step.svg").read_text()
    assert 'data-group="mixed step (wall)" data-format="s4kv_saw:v1" data-value="52"' in svg
    assert 'data-group="GPU busy" data-format="bf16_fa3" data-value="43"' in svg
    assert 'data-group="host in attention" data-format="s4kv_saw:v1" data-value="18"' in svg
    assert "s4kv int4_saw, V1 model runner" in svg and 'data-format="s4kv_kivi"' not in svg
    assert "| s4kv_kivi | skipped |" in (tmp_path / "out" / "mixed_step.md").read_text()


@pytest.mark.slow
def test_one_format_in_the_cpu_engine(tmp_path):
    pytest.importorskip("vllm")
    from s4kv.runtime.bundled_models import QWEN2, bundled_model_dir

    model = Path(bundled_model_dir(QWEN2))
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    status = pms.main(["--out", str(tmp_path), "--model", str(model), "--load-format", "auto", "--configs",
                       "s4kv_saw", "--decodes", "2", "--context", "64", "--prompt-len", "160", "--prompts", "2",
                       "--repeats", "2", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
                       "--timeout-s", "600"])
    assert status == 0
    (result,) = json.loads((tmp_path / "mixed_step.json").read_text())["results"]
    assert result["status"] == "ok" and len(result["mixed_steps_ms"]) == 2 and len(result["decode_steps_ms"]) == 6
    assert 0 < result["decode_step_ms"] and 0 < result["mixed_step_ms"]
    for kind in ("decode_profile", "mixed_profile"):
        ops = {name: n for name, _, n in result[kind]["host_ops"]}
        assert ops["vllm::unified_attention_with_output"] == layers  # one attention call per layer and step
    for kind in ("decode", "mixed"):  # the CPU engine runs attention eagerly in both kinds of step
        seconds, calls = result["host_ms"][kind]["S4KVAttentionImpl.forward"]
        assert seconds > 0 and calls == layers
    assert "| s4kv_saw |" in (tmp_path / "mixed_step.md").read_text()
    assert "the prefill of 2 160-token prompts" in (tmp_path / "mixed_step.md").read_text()
    assert 'data-group="GPU busy" data-format="s4kv_saw"' in (tmp_path / "mixed_step.svg").read_text()
