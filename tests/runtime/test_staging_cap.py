"""int4_kivi's max_num_seqs capped by its staging pool where the user chose none (runtime/plugin/staging_cap.py),
through `s4kv serve`'s own pre-check on vLLM's real config (the CPU build; the GPU's total memory is what NVML would
report on the instance): the same count `s4kv capacity` plans for that instance."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from model_configs import LLAMA31_8B, QWEN25_7B, write_model_dir  # noqa: E402

from s4kv.runtime.plugin import api_server, staging_cap  # noqa: E402
from s4kv.runtime.sizing import capacity, catalog, model_shapes  # noqa: E402

G5 = catalog.instance_type("g5.xlarge")  # one A10G, 22,888 MiB


def prechecked(monkeypatch, model, *flags: str, total: int | None = G5.gpu_bytes):
    """The `vllm serve` arguments after `s4kv serve`'s pre-check on a GPU of ``total`` bytes (None: no CUDA)."""
    monkeypatch.setattr(staging_cap, "gpu_total_bytes", lambda: total)
    args = api_server.parse(["--model", str(model), "--max-model-len", "4096", *flags])
    api_server.precheck(args)
    return args


def kivi(scheme: str = "int4_kivi") -> tuple[str, ...]:
    return "--kv-cache-dtype", "int4_per_token_head", "--attention-backend", "CUSTOM", \
        "--additional-config", f'{{"s4kv": {{"scheme": "{scheme}"}}}}'


@pytest.mark.parametrize("name, config", [("llama", LLAMA31_8B), ("qwen", QWEN25_7B)])
def test_the_cap_is_the_capacity_plans(name, config, tmp_path):
    model = write_model_dir(tmp_path, name, config)
    planned = capacity.plan(model_shapes.load(str(model)), G5, "int4_kivi", context=4096).max_num_seqs
    # Llama-3.1-8B: 21.6e9 of the A10G's share - 2 GiB - 16.06e9 of weights leaves 3.4e9 of KV, an eighth of it
    # 51 slots of 8 MiB: 48 in steps of 16. Qwen2.5-7B's slots are 3.5 MiB: 4.2e9 / 8 holds 143: 128.
    assert planned == {"llama": 48, "qwen": 128}[name]
    # vLLM's config at the plan's share and the GPU's default of 256 (the CPU build resolves 128)
    args = api_server.parse(["--model", str(model), "--max-model-len", "4096", "--max-num-seqs", "256",
                             "--gpu-memory-utilization", str(capacity.GPU_MEMORY_UTILIZATION), *kivi()])
    vllm_config, _ = api_server._checked_engine_config(args)
    assert staging_cap.capped_max_num_seqs(vllm_config, G5.gpu_bytes) == planned


def test_serve_caps_int4_kivi_where_the_user_chose_no_max_num_seqs(tmp_path, monkeypatch):
    model = write_model_dir(tmp_path, "llama", LLAMA31_8B)
    # at vLLM's own share (0.92): 22.1e9 leaves 3.87e9 of KV, 57 slots: 48, below the CPU build's default of 128
    assert prechecked(monkeypatch, model, *kivi()).max_num_seqs == 48
    assert prechecked(monkeypatch, model, *kivi(), "--gpu-memory-utilization", "0.5").max_num_seqs == 16  # the least


def test_the_cap_leaves_what_the_user_or_another_format_chose(tmp_path, monkeypatch):
    model = write_model_dir(tmp_path, "llama", LLAMA31_8B)
    assert prechecked(monkeypatch, model, *kivi(), "--max-num-seqs", "200").max_num_seqs == 200
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("max-num-seqs: 200\n")  # chosen in a --config file: vLLM's parser puts it into args
    assert prechecked(monkeypatch, model, *kivi(), "--config", str(config_file)).max_num_seqs == 200
    assert prechecked(monkeypatch, model, *kivi("int4_saw")).max_num_seqs is None  # vLLM's default
    assert prechecked(monkeypatch, model).max_num_seqs is None  # vLLM's own bf16
    # an explicit KV budget is not shared with the pool
    assert prechecked(monkeypatch, model, *kivi(), "--kv-cache-memory-bytes", str(2 << 30)).max_num_seqs is None
    assert prechecked(monkeypatch, model, *kivi(), total=None).max_num_seqs is None  # no CUDA GPU
    # on an H200 (0.9 of 140 GiB) the pool fits an eighth at vLLM's own default: nothing to cap
    assert prechecked(monkeypatch, model, *kivi(), total=143_771 << 20).max_num_seqs is None


def test_a_config_without_a_shape_leaves_the_count_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # vLLM's loggers stop at "vllm"
    config = {k: v for k, v in LLAMA31_8B.items() if k != "num_hidden_layers"}  # what from_config cannot size
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.9),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: config), model="m"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), scheduler_config=SimpleNamespace(max_num_seqs=256))
    with caplog.at_level(logging.WARNING, logger="vllm.s4kv"):
        assert staging_cap.capped_max_num_seqs(vllm_config, G5.gpu_bytes) is None
    assert "max_num_seqs stays at 256, uncapped" in caplog.text and "lacks num_hidden_layers" in caplog.text
