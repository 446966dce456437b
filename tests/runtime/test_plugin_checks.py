"""Every accept/reject rule of the plugin, decided from config.json alone (no GPU, no weights, no engine).

The same rules run in three places; each is exercised here: `s4kv check` (the CLI a user runs), `s4kv serve`'s
pre-check, and the engine's own check on a real vLLM VllmConfig built from the same config.json
(``check_vllm_config``, what the backend calls while vLLM builds the model, before weights load).
"""

from __future__ import annotations

import pytest

from s4kv.runtime import cli
from s4kv.runtime.plugin.config import (
    EngineFacts,
    ModelFacts,
    S4KVConfig,
    S4KVConfigError,
    engine_rejections,
    model_rejections,
)

from model_configs import ACCEPTED_MODELS, LLAMA31_8B, QWEN25_7B, REJECTED_MODELS, write_model_dir

KIVI = S4KVConfig.parse({"scheme": "int4_kivi"})
SAW = S4KVConfig.parse({"scheme": "int4_saw"})


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_one_sentence_per_cause(text: str, words: list[str]) -> None:
    for word in words:
        assert word in text, f"{word!r} missing from: {text}"
    assert text.rstrip().endswith("."), text


# ------------------------------------------------------------------------------------------ models, via the CLI
@pytest.mark.parametrize("case", sorted(REJECTED_MODELS))
@pytest.mark.parametrize("scheme", ["int4_kivi", "int4_saw"])
def test_check_rejects_model(case, scheme, tmp_path, capsys):
    config, words = REJECTED_MODELS[case]
    model = write_model_dir(tmp_path, case, config)
    code, out = run_cli(capsys, "check", str(model), "--scheme", scheme)
    assert code == 1, out
    assert out.startswith(f"{case}: not supported with {scheme}."), out
    assert_one_sentence_per_cause(out, words)


@pytest.mark.parametrize("case", sorted(ACCEPTED_MODELS))
def test_check_accepts_supported_families(case, tmp_path, capsys):
    model = write_model_dir(tmp_path, case, ACCEPTED_MODELS[case])
    code, out = run_cli(capsys, "check", str(model / "config.json"), "--scheme", "int4_saw")
    assert code == 0, out
    head_dim = ACCEPTED_MODELS[case].get("head_dim", 128)
    density = {128: "136 B per token and KV head, 3.76x", 64: "72 B per token and KV head, 3.56x"}[head_dim]
    assert "supported with int4_saw" in out and f"head_dim {head_dim}" in out and density in out, out


def test_check_refuses_a_hadamard_block_wider_than_the_head(tmp_path, capsys):
    model = write_model_dir(tmp_path, "llama-3.2-1b", ACCEPTED_MODELS["llama-3.2-1b"])
    code, out = run_cli(capsys, "check", str(model), "--scheme", "int4_saw", "--hadamard-block", "128")
    assert code == 1, out
    assert_one_sentence_per_cause(out, ["int4_saw hadamard_block 128 does not divide head_dim 64",
                                        "choose one of (32, 64)"])
    for block in ("32", "64"):
        assert run_cli(capsys, "check", str(model), "--scheme", "int4_saw", "--hadamard-block", block)[0] == 0


def test_family_opt_in_lifts_only_the_family_rule(tmp_path, capsys):
    llama2 = write_model_dir(tmp_path, "llama2", REJECTED_MODELS["llama2_family"][0])
    code, out = run_cli(capsys, "check", str(llama2), "--allow-unsupported-model")
    assert code == 0, out
    mistral = write_model_dir(tmp_path, "mistral", REJECTED_MODELS["sliding_window_mistral"][0])
    code, out = run_cli(capsys, "check", str(mistral), "--allow-unsupported-model")
    assert code == 1 and "sliding-window attention" in out and "families" not in out, out


def test_check_block_size(tmp_path, capsys):
    model = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    code, out = run_cli(capsys, "check", str(model), "--block-size", "16")
    assert code == 1
    assert_one_sentence_per_cause(out, ["int4_kivi needs --block-size 128", "got 16"])
    assert run_cli(capsys, "check", str(model), "--block-size", "128")[0] == 0


def test_check_missing_config_is_bad_input(tmp_path, capsys):
    code, out = run_cli(capsys, "check", str(tmp_path / "nothing-here"))
    assert code == 2 and "no config.json" in out


# ------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "options, words",
    [
        ({"scheme": "int8_kivi"}, ["unknown s4kv scheme 'int8_kivi'"]),
        ({"scheme": "int4_kivi", "hadamard_block": 64}, ["unknown option(s) ['hadamard_block'] for int4_kivi"]),
        ({"scheme": "int4_saw", "group": 32}, ["unknown option(s) ['group'] for int4_saw"]),
        ({"scheme": "int4_saw", "hadamard_block": 48}, ["hadamard_block must be one of (32, 64, 128)"]),
        ({"scheme": "int4_saw", "allow_unsupported_model": "yes"}, ["allow_unsupported_model must be true or false"]),
        ({}, ['need a "scheme"']),
        ("int4_kivi", ['must be an object like {"scheme": "int4_kivi"}']),
    ],
)
def test_bad_options_are_rejected(options, words):
    with pytest.raises(ValueError) as err:
        S4KVConfig.parse(options)
    for word in words:
        assert word in str(err.value)


def test_options_round_trip():
    for options in ({"scheme": "int4_kivi"}, {"scheme": "int4_saw", "hadamard_block": 32, "rotate_values": True},
                    {"scheme": "int4_kivi", "allow_unsupported_model": True}):
        config = S4KVConfig.parse(options)
        assert S4KVConfig.parse(config.to_options()) == config


# ------------------------------------------------------------------------------------------ engine settings
@pytest.mark.parametrize(
    "facts, kivi_words, saw_rejects",
    [
        (EngineFacts(vllm_version="0.27.0"), ["supports vLLM 0.26.0 only, found vLLM 0.27.0"], True),
        (EngineFacts(attention_backend=None), ["add --attention-backend CUSTOM", "automatic"], True),
        (EngineFacts(attention_backend="TRITON_ATTN"), ["backend is TRITON_ATTN, not CUSTOM"], True),
        (EngineFacts(kv_cache_dtype="fp8"), ["needs --kv-cache-dtype int4_per_token_head", "'fp8'"], True),
        (EngineFacts(block_size=16), ["needs --block-size 128", "got 16"], True),
        (EngineFacts(speculative_decoding=True), ["int4_kivi cannot run with speculative decoding"], False),
        (EngineFacts(kv_connector=True), ["cannot run with a KV connector"], True),
        (EngineFacts(context_parallel=True), ["context parallelism"], True),
        (EngineFacts(kv_cache_dtype_skip_layers=("0", "27")), ["--kv-cache-dtype-skip-layers 0,27"], True),
    ],
)
def test_engine_rejections(facts, kivi_words, saw_rejects):
    (reason,) = engine_rejections(KIVI, facts)
    assert_one_sentence_per_cause(reason, kivi_words)
    assert bool(engine_rejections(SAW, facts)) == saw_rejects
    assert engine_rejections(KIVI, EngineFacts()) == []


def test_llama3_is_told_apart_from_llama2():
    assert ModelFacts.from_hf_config(LLAMA31_8B).family == "llama3"
    assert ModelFacts.from_hf_config(QWEN25_7B).family == "qwen2"
    assert ModelFacts.from_hf_config(REJECTED_MODELS["llama2_family"][0]).family is None
    assert model_rejections(KIVI, ModelFacts.from_hf_config(LLAMA31_8B, "x")) == []


# ------------------------------------------------------------------------------------------ serve's pre-check
def test_serve_prechecks_and_builds_the_vllm_command(tmp_path, capsys):
    bad = write_model_dir(tmp_path, "head96", REJECTED_MODELS["head_dim_96"][0])
    code, out = run_cli(capsys, "serve", str(bad), "--scheme", "int4_kivi", "--dry-run")
    assert code == 1 and "head_dim 96" in out
    good = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    code, out = run_cli(capsys, "serve", str(good), "--scheme", "int4_saw", "--hadamard-block", "64", "--port", "8123",
                        "--dry-run", "--max-model-len", "4096")
    assert code == 0, out
    command = out.strip().split("s4kv serve: ", 1)[1]
    assert command.startswith(f"vllm serve {good} --kv-cache-dtype int4_per_token_head --attention-backend CUSTOM")
    assert '"scheme": "int4_saw", "hadamard_block": 64' in command
    assert command.endswith("--port 8123 --max-model-len 4096")
    code, out = run_cli(capsys, "serve", str(good), "--scheme", "int4_saw", "--attention-backend", "FLASH_ATTN")
    assert code == 2 and "remove --attention-backend" in out


# ------------------------------------------------------------------------------------------ the engine's check
def _vllm_config(model_dir, **engine_kwargs):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", max_model_len=2048)
    args.update(engine_kwargs)
    return EngineArgs(**args).create_engine_config()


S4KV_ENGINE_ARGS = dict(kv_cache_dtype="int4_per_token_head", attention_backend="CUSTOM")


@pytest.mark.parametrize("case", ["head_dim_96", "sliding_window_qwen2", "llama2_family", "qwen3_family"])
def test_engine_check_on_vllm_config(case, tmp_path):
    from s4kv.runtime.plugin.config import check_vllm_config

    config, words = REJECTED_MODELS[case]
    vllm_config = _vllm_config(write_model_dir(tmp_path, case, config),
                               additional_config={"s4kv": {"scheme": "int4_kivi"}}, **S4KV_ENGINE_ARGS)
    with pytest.raises(S4KVConfigError) as err:
        check_vllm_config(vllm_config)
    assert_one_sentence_per_cause(str(err.value), words)


def test_engine_check_accepts_and_reads_engine_flags(tmp_path):
    from s4kv.runtime.plugin.config import check_vllm_config

    model = write_model_dir(tmp_path, "llama", LLAMA31_8B)
    ok = _vllm_config(model, additional_config={"s4kv": {"scheme": "int4_saw"}}, **S4KV_ENGINE_ARGS)
    assert check_vllm_config(ok) == SAW
    assert check_vllm_config(_vllm_config(model)) is None  # not asked for: S4 KV stays out of the way
    head_dim_64 = write_model_dir(tmp_path, "llama-3.2-1b", ACCEPTED_MODELS["llama-3.2-1b"])
    for options in ({"scheme": "int4_kivi"}, {"scheme": "int4_saw"}, {"scheme": "int4_saw", "hadamard_block": 32}):
        assert check_vllm_config(_vllm_config(head_dim_64, additional_config={"s4kv": options}, **S4KV_ENGINE_ARGS))
    too_wide = _vllm_config(head_dim_64, additional_config={"s4kv": {"scheme": "int4_saw", "hadamard_block": 128}},
                            **S4KV_ENGINE_ARGS)
    with pytest.raises(S4KVConfigError, match="hadamard_block 128 does not divide head_dim 64"):
        check_vllm_config(too_wide)
    without_backend = _vllm_config(model, kv_cache_dtype="int4_per_token_head",
                                   additional_config={"s4kv": {"scheme": "int4_saw"}})
    with pytest.raises(S4KVConfigError, match="add --attention-backend CUSTOM"):
        check_vllm_config(without_backend)
    small_blocks = _vllm_config(model, block_size=16, additional_config={"s4kv": {"scheme": "int4_kivi"}},
                                **S4KV_ENGINE_ARGS)
    with pytest.raises(S4KVConfigError, match="needs --block-size 128"):
        check_vllm_config(small_blocks)


@pytest.mark.parametrize(
    "engine_kwargs, words, saw_accepted",
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
         ["int4_kivi cannot run with speculative decoding"], True),
        (dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
         ["int4_kivi cannot run with a KV connector"], False),
        (dict(kv_cache_dtype_skip_layers=["0"]), ["--kv-cache-dtype-skip-layers 0"], False),
    ],
)
def test_engine_check_on_engine_features(engine_kwargs, words, saw_accepted, tmp_path):
    """Speculative decoding, KV connectors and bf16 layers, as vLLM's own config reports them."""
    from s4kv.runtime.plugin.config import check_vllm_config

    model = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    kivi = _vllm_config(model, additional_config={"s4kv": {"scheme": "int4_kivi"}}, **S4KV_ENGINE_ARGS, **engine_kwargs)
    with pytest.raises(S4KVConfigError) as err:
        check_vllm_config(kivi)
    assert_one_sentence_per_cause(str(err.value), words)
    saw = _vllm_config(model, additional_config={"s4kv": {"scheme": "int4_saw"}}, **S4KV_ENGINE_ARGS, **engine_kwargs)
    if saw_accepted:
        assert check_vllm_config(saw) == SAW
    else:
        with pytest.raises(S4KVConfigError):
            check_vllm_config(saw)
