"""The plugin as vLLM loads it: through the installed ``vllm.general_plugins`` entry point, in fresh processes,
and the real engine failing at start-up (before any weight is read: the model folders hold no weights) with our
one-sentence causes."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from s4kv.runtime.bundled_models import LLAMA3, bundled_model_dir

pytest.importorskip("vllm")


def python(code: str, timeout: int = 600, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **env))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


def test_entry_point_is_installed():
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "s4kv"]
    assert entry.value == "s4kv.runtime.plugin:register"


def test_importing_the_plugin_is_cheap():
    out = python("import sys, s4kv.runtime.plugin; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    assert out.strip() == "['torch']"  # the kernels' scheme module needs torch; vLLM is imported only by register()


def test_vllm_loads_the_plugin_through_its_entry_point():
    out = python("""
        import json
        from vllm.plugins import load_general_plugins
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        load_general_plugins()
        print(json.dumps({
            "custom": E.CUSTOM.get_path(),
            "cpu_path": E.CPU_ATTN.get_path(),
            # no vLLM config is current (and none asks for s4kv): the route hands back vLLM's own class
            "cpu_class": E.CPU_ATTN.get_class().__module__ + "." + E.CPU_ATTN.get_class().__name__,
        }))
    """)
    paths = json.loads(out.strip().splitlines()[-1])
    assert paths == {
        "custom": "s4kv.runtime.plugin.backend.S4KVAttentionBackend",
        "cpu_path": "s4kv.runtime.plugin.route_CPU_ATTN",
        "cpu_class": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
    }


def test_engine_start_up_rejections(tmp_path):
    """vLLM's LLM(...) with our options fails while it builds the model, naming the cause."""
    base = json.loads((Path(bundled_model_dir(LLAMA3)) / "config.json").read_text())
    for name, changes in {"head96": {"head_dim": 96}, "llama2": {"vocab_size": 32000, "rope_theta": 10000.0}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(dict(base, **changes)))
    out = python(f"""
        import json
        from vllm import LLM
        from vllm.distributed import cleanup_dist_env_and_memory

        def start(model, **kwargs):
            try:
                LLM(model, skip_tokenizer_init=True, max_model_len=512, enforce_eager=True,
                    gpu_memory_utilization=0.3, kv_cache_memory_bytes=2**24, **kwargs)
            except Exception as err:
                cleanup_dist_env_and_memory()
                return type(err).__name__ + ": " + str(err)
            return "started"

        if __name__ == "__main__":
            s4kv = dict(kv_cache_dtype="int4_per_token_head", additional_config={{"s4kv": {{"scheme": "int4_kivi"}}}})
            custom = dict(attention_config={{"backend": "CUSTOM"}})
            print("RESULT " + json.dumps({{
                "head96": start("{tmp_path / 'head96'}", **s4kv, **custom),
                "llama2": start("{tmp_path / 'llama2'}", **s4kv, **custom),
                "no_custom": start("{bundled_model_dir(LLAMA3)}", **s4kv),
                "no_kv_dtype": start("{bundled_model_dir(LLAMA3)}",
                                     additional_config={{"s4kv": {{"scheme": "int4_saw"}}}}, **custom),
            }}))
    """, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    results = json.loads(out.strip().splitlines()[-1][len("RESULT "):])
    assert results["head96"].startswith("S4KVConfigError: ")
    assert results["head96"].endswith("head96 has head_dim 96; int4_kivi supports head_dim 64 and 128 only (its int4 "
                                      "page and kernels are built for those).")
    family = "llama2 (LlamaForCausalLM, model_type 'llama') is outside the Qwen2, Qwen2.5 and Llama-3"
    assert family in results["llama2"]
    assert "add --attention-backend CUSTOM" in results["no_custom"]
    kv_dtype = "int4_saw needs --kv-cache-dtype int4_per_token_head (its page budget), got 'auto'."
    assert kv_dtype in results["no_kv_dtype"]


@pytest.fixture
def registry():
    """vLLM's backend registry, restored after the test (register() writes process-wide state)."""
    from vllm.v1.attention.backends import registry as vllm_registry

    saved = dict(vllm_registry._ATTN_OVERRIDES)
    yield vllm_registry
    vllm_registry._ATTN_OVERRIDES.clear()
    vllm_registry._ATTN_OVERRIDES.update(saved)


def test_version_gate(registry, monkeypatch):
    import vllm

    from s4kv.runtime import plugin
    from s4kv.runtime.plugin.config import S4KVConfigError

    assert plugin.incompatibility() is None  # the installed vLLM 0.26.0 passes every probe
    monkeypatch.setattr(vllm, "__version__", "0.27.1")
    monkeypatch.setattr(plugin, "_incompatibility", None)
    plugin.register()
    assert registry.AttentionBackendEnum.CUSTOM.get_path() == "s4kv.runtime.plugin.IncompatibleVllm"
    with pytest.raises(S4KVConfigError, match=r"S4 KV supports vLLM 0\.26\.0 only, found vLLM 0\.27\.1\."):
        registry.AttentionBackendEnum.CUSTOM.get_class()


def test_custom_slot_held_by_another_plugin(registry):
    from s4kv.runtime import plugin

    registry.register_backend(registry.AttentionBackendEnum.CUSTOM, "other.plugin.Backend")
    with pytest.raises(RuntimeError, match=r"another plugin already holds it \(other\.plugin\.Backend\)"):
        plugin.register()


def test_cpu_route_follows_the_current_config(registry, tmp_path):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from s4kv.runtime import plugin
    from s4kv.runtime.plugin.config import S4KVConfigError

    plugin.register()
    model = bundled_model_dir(LLAMA3)
    s4kv = dict(kv_cache_dtype="int4_per_token_head", additional_config={"s4kv": {"scheme": "int4_kivi"}})
    cases = {
        "plain": EngineArgs(model=model),
        "s4kv": EngineArgs(model=model, attention_backend="CUSTOM", **s4kv),
        "no_custom": EngineArgs(model=model, **s4kv),
    }
    configs = {name: args.create_engine_config() for name, args in cases.items()}
    with set_current_vllm_config(configs["plain"]):
        assert plugin.route_CPU_ATTN.__name__ == "CPUAttentionBackend"
    with set_current_vllm_config(configs["s4kv"]):
        assert plugin.route_CPU_ATTN.__name__ == "S4KVCpuAttentionBackend"
    with set_current_vllm_config(configs["no_custom"]):
        with pytest.raises(S4KVConfigError, match="--attention-backend CUSTOM"):
            plugin.resolve_route("CPU_ATTN")
