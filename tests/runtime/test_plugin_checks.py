"""Every accept/reject rule of the plugin, decided from config.json alone (no GPU, no weights, no engine).

The same rules run in three places; each is exercised here: `s4kv check` (the CLI a user runs), `s4kv serve`'s
pre-check (``--dry-run``: vLLM's own parser and config, then our checks, before any engine exists), and the engine's
own check on a real vLLM VllmConfig built from the same config.json (``check_vllm_config``, what the backend calls
while vLLM builds the model, before weights load). The three agree case by case.
"""

from __future__ import annotations

import json

import os

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

from s4kv.runtime.exit_codes import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNSUPPORTED

from model_configs import (
    ACCEPTED_MODELS,
    LLAMA31_8B,
    MALFORMED_CONFIGS,
    QWEN25_7B,
    REJECTED_MODELS,
    write_model_dir,
)

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
    assert code == EXIT_UNSUPPORTED, out
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
    assert code == 3, out
    assert_one_sentence_per_cause(out, ["int4_saw hadamard_block 128 does not divide head_dim 64",
                                        "choose one of (32, 64)"])
    for block in ("32", "64"):
        assert run_cli(capsys, "check", str(model), "--scheme", "int4_saw", "--hadamard-block", block)[0] == 0


def test_family_opt_in_lifts_only_the_family_rule(tmp_path, capsys):
    llama2 = write_model_dir(tmp_path, "llama2", REJECTED_MODELS["llama2_family"][0])
    code, out = run_cli(capsys, "check", str(llama2), "--allow-unsupported-model")
    assert code == EXIT_OK, out
    mistral = write_model_dir(tmp_path, "mistral", REJECTED_MODELS["sliding_window_mistral"][0])
    code, out = run_cli(capsys, "check", str(mistral), "--allow-unsupported-model")
    assert code == EXIT_UNSUPPORTED and "sliding-window attention" in out and "families" not in out, out


def test_check_block_size(tmp_path, capsys):
    model = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    code, out = run_cli(capsys, "check", str(model), "--block-size", "16")
    assert code == EXIT_UNSUPPORTED
    assert_one_sentence_per_cause(out, ["int4_kivi needs --block-size 128", "got 16"])
    assert run_cli(capsys, "check", str(model), "--block-size", "128")[0] == 0


def test_check_missing_config_is_bad_input(tmp_path, capsys):
    code, out = run_cli(capsys, "check", str(tmp_path / "nothing-here"))
    assert code == EXIT_BAD_INPUT and "no config.json" in out


@pytest.mark.parametrize("case", sorted(MALFORMED_CONFIGS))
@pytest.mark.parametrize("command", ["check", "serve"])
def test_malformed_config_is_bad_input_in_one_sentence(case, command, tmp_path, capsys):
    text, words = MALFORMED_CONFIGS[case]
    model = write_model_dir(tmp_path, case, text)
    argv = [command, str(model)] + (["--scheme", "int4_kivi", "--dry-run"] if command == "serve" else [])
    code, out = run_cli(capsys, *argv)
    assert code == EXIT_BAD_INPUT, out
    (line,) = [line for line in out.splitlines() if line.startswith(f"s4kv {command}: ")]
    assert_one_sentence_per_cause(line, words)
    assert "/".join("Qwen2") not in out


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
        (EngineFacts(v2_model_runner=True), ["V1 model runner", "VLLM_USE_V2_MODEL_RUNNER=0"], False),
        (EngineFacts(dual_batch_overlap=True), ["int4_kivi cannot run with dual batch overlap"], False),
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
def serve_dry_run(capsys, model, *flags: str) -> tuple[int, str]:
    return run_cli(capsys, "serve", str(model), "--dry-run", *flags)


def refusal(out: str) -> str:
    """The one line `s4kv serve` refuses with (the command it prints first is not part of it)."""
    lines = [line for line in out.splitlines()
             if line.startswith("s4kv serve: ") and not line.startswith("s4kv serve: vllm serve ")
             and "no API key" not in line]
    assert len(lines) == 1, out
    return lines[0]


def test_serve_builds_the_vllm_command(tmp_path, capsys):
    good = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    code, out = serve_dry_run(capsys, good, "--scheme", "int4_saw", "--hadamard-block", "64", "--port", "8123",
                              "--max-model-len", "4096")
    assert code == EXIT_OK, out
    command = out.split("s4kv serve: ", 1)[1].splitlines()[0]
    assert command.startswith(f"vllm serve {good} --kv-cache-dtype int4_per_token_head --attention-backend CUSTOM")
    assert '"scheme": "int4_saw", "hadamard_block": 64' in command
    assert command.endswith("--port 8123 --max-model-len 4096")
    assert "--middleware" not in command  # no key set: nothing to demand
    code, out = serve_dry_run(capsys, good, "--scheme", "bf16", "--prefill-tokens-per-step", "0")
    assert code == EXIT_OK and f"vllm serve {good} --port 8000\n" in out, out


def test_serve_runs_the_plugins_prefill_capped_scheduler_for_any_format_unless_told_not_to(tmp_path, capsys):
    good = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    saw = {"scheme": "int4_saw", "rotate_values": False}
    for scheme, s4kv, cap in (("int4_kivi", {"scheme": "int4_kivi"}, []), ("bf16", None, []),
                              ("int4_saw", saw, ["--prefill-tokens-per-step", "4096"])):
        code, out = serve_dry_run(capsys, good, "--scheme", scheme, *cap)
        assert code == EXIT_OK, out
        command = out.split("s4kv serve: ", 1)[1].splitlines()[0]
        assert "--scheduler-cls s4kv.runtime.plugin.scheduler.prefill_capped_scheduler" in command
        config = json.loads(command.split("--additional-config ", 1)[1].split(" --port")[0].strip("'"))
        scheduler = {"prefill_tokens_per_step": int(cap[1]) if cap else 2048}
        assert config == {"s4kv_scheduler": scheduler, **({"s4kv": s4kv} if s4kv else {})}
    # 0: vLLM's own scheduler, and a scheduler of the user's own then goes through
    code, out = serve_dry_run(capsys, good, "--scheme", "bf16", "--prefill-tokens-per-step", "0",
                              "--scheduler-cls", "x.Y")
    assert code == EXIT_OK and f"vllm serve {good} --port 8000 --scheduler-cls x.Y\n" in out, out
    code, out = serve_dry_run(capsys, good, "--scheme", "int4_kivi", "--prefill-tokens-per-step", "-1")
    assert code == EXIT_BAD_INPUT and "must be a number of tokens (0: vLLM's own scheduler)" in refusal(out)
    code, out = serve_dry_run(capsys, good, "--scheme", "int4_kivi", "--scheduler_cls", "x.Y")
    assert code == EXIT_BAD_INPUT and "add --prefill-tokens-per-step 0 to run your own" in refusal(out)
    # without chunked prefill a prompt over the cap would hold the queue while requests decode: refused before the
    # engine starts, unless vLLM's own scheduler runs
    no_chunks = ("--max-model-len", "4096", "--no-enable-chunked-prefill")
    code, out = serve_dry_run(capsys, good, "--scheme", "int4_kivi", *no_chunks)
    assert code == EXIT_BAD_INPUT and "needs chunked prefill" in refusal(out)
    assert "s4kv serve --prefill-tokens-per-step 0" in refusal(out)
    code, out = serve_dry_run(capsys, good, "--scheme", "int4_kivi", "--prefill-tokens-per-step", "0", *no_chunks)
    assert code == EXIT_OK, out


def test_serve_with_a_key_loads_the_middleware_and_never_prints_the_key(tmp_path, capsys, monkeypatch):
    good = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    key_file = tmp_path / "key"
    key_file.write_text("sekrit-123\n")
    monkeypatch.setenv("S4KV_API_KEY_FILE", str(key_file))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    code, out = serve_dry_run(capsys, good, "--scheme", "int4_kivi")
    assert code == EXIT_OK, out
    assert "--middleware s4kv.runtime.plugin.api_key.ApiKeyMiddleware" in out and "sekrit" not in out


@pytest.mark.parametrize("flags, status, words", [
    # engine features S4 KV refuses, before vLLM builds the engine
    (["--scheme", "int4_kivi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
      '"prompt_lookup_max": 3}'], EXIT_UNSUPPORTED, ["int4_kivi cannot run with speculative decoding"]),
    (["--scheme", "int4_saw", "--kv-cache-dtype-skip-layers", "0"], EXIT_UNSUPPORTED,
     ["int4_saw cannot keep some layers in bf16", "--kv-cache-dtype-skip-layers 0"]),
    (["--scheme", "int4_kivi", "--block-size", "16"], EXIT_UNSUPPORTED, ["needs --block-size 128", "got 16"]),
    (["--scheme", "int4_kivi", "--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
     EXIT_UNSUPPORTED, ["cannot run with a KV connector"]),
    # settings that contradict what s4kv serve sets, or vLLM's own validation
    (["--scheme", "int4_saw", "--attention-config", '{"backend": "FLASH_ATTN"}'], EXIT_BAD_INPUT,
     ["sets the KV cache dtype, the attention backend", "remove the backend in --attention-config"]),
    (["--scheme", "int4_saw", "--attention-backend", "FLASH_ATTN"], EXIT_BAD_INPUT, ["remove --attention-backend"]),
    (["--scheme", "int4_saw", "--kv-cache-dtype=fp8"], EXIT_BAD_INPUT, ["remove --kv-cache-dtype=fp8"]),
    (["--scheme", "int4_kivi", "--max-model-len", "100000"], EXIT_BAD_INPUT,
     ["max_model_len (100000) is greater than", "32768", "lower --max-model-len"]),
    (["--scheme", "int4_kivi", "--api-key", "sekrit"], EXIT_BAD_INPUT, ["takes no --api-key", "S4KV_API_KEY_FILE"]),
    (["--scheme", "int4_kivi", "--api_key=sekrit"], EXIT_BAD_INPUT, ["takes no --api-key"]),
    (["--scheme", "int4_kivi", "--api-server-count", "2", "--headless"], EXIT_BAD_INPUT,
     ["runs one HTTP API server process", "remove --api-server-count and --headless"]),
    (["--scheme", "int4_kivi", "--kv_cache_dtype", "fp8"], EXIT_BAD_INPUT, ["remove --kv_cache_dtype"]),
    (["--scheme", "bf16", "--hadamard-block", "64"], EXIT_BAD_INPUT, ["--scheme bf16 takes none of them"]),
    (["--scheme", "int4_kivi", "--hadamard-block", "64"], EXIT_BAD_INPUT, ["unknown option(s) ['hadamard_block']"]),
])
def test_serve_refuses_before_the_engine_in_one_sentence(flags, status, words, tmp_path, capsys):
    model = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    code, out = serve_dry_run(capsys, model, *flags)
    assert code == status, out
    assert_one_sentence_per_cause(refusal(out), words)
    assert "sekrit" not in out


def test_serve_refuses_in_a_real_process_without_a_traceback(tmp_path):
    """The whole output of the `s4kv` process (vLLM's logging included): the command line, then one sentence."""
    import subprocess
    import sys

    model = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    done = subprocess.run([sys.executable, "-m", "s4kv.runtime.cli", "serve", str(model), "--scheme", "int4_kivi",
                           "--host", "127.0.0.1", "--speculative-config", '{"method": "ngram", '
                           '"num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == EXIT_UNSUPPORTED, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "s4kv serve: int4_kivi cannot run with speculative decoding: rejected draft tokens would rewrite keys of a "
        "block that was already quantized per channel.")


def test_serve_refuses_a_missing_model_folder(capsys):
    code, out = serve_dry_run(capsys, "/nonexistent/model", "--scheme", "int4_kivi")
    assert code == EXIT_BAD_INPUT
    assert_one_sentence_per_cause(refusal(out), ["no model folder at /nonexistent/model"])


@pytest.mark.parametrize("environ, words", [
    ({"S4KV_API_KEY_FILE": "/nonexistent/key"}, ["cannot be read"]),
    ({"S4KV_API_KEY_FILE": "EMPTY"}, ["holds no key"]),
    ({"S4KV_API_KEY_FILE": "EMPTY", "VLLM_API_KEY": "k"}, ["either S4KV_API_KEY_FILE or VLLM_API_KEY"]),
])
def test_serve_refuses_unusable_key_settings(environ, words, tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").write_text("\n")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, str(tmp_path / "empty") if value == "EMPTY" else value)
    code, out = serve_dry_run(capsys, write_model_dir(tmp_path, "qwen", QWEN25_7B), "--scheme", "int4_kivi")
    assert code == EXIT_BAD_INPUT
    assert_one_sentence_per_cause(refusal(out), words)


# The cases vLLM 0.26.0 itself can build a config for; the others (hybrid Qwen3-Next, BART, Gemma-3 multimodal) fail
# in vLLM's own model inspection, so only `s4kv check` and `s4kv serve` judge them.
VLLM_CONFIGURABLE = sorted(set(REJECTED_MODELS) - {"hybrid", "encoder_decoder", "gemma3_multimodal"})


@pytest.mark.parametrize("case", sorted(REJECTED_MODELS) + sorted(ACCEPTED_MODELS))
def test_check_serve_and_engine_agree(case, tmp_path, capsys):
    """`s4kv check`, `s4kv serve`'s pre-check and the engine's own check on vLLM's config: the same verdict, each
    naming the same causes in one sentence per cause."""
    from s4kv.runtime.plugin.config import check_vllm_config

    config, words = REJECTED_MODELS[case] if case in REJECTED_MODELS else (ACCEPTED_MODELS[case], [])
    model = write_model_dir(tmp_path, case, config)
    expected = EXIT_UNSUPPORTED if words else EXIT_OK
    check_code, check_out = run_cli(capsys, "check", str(model), "--scheme", "int4_kivi")
    serve_code, serve_out = serve_dry_run(capsys, model, "--scheme", "int4_kivi")
    assert (check_code, serve_code) == (expected, expected), check_out + serve_out
    if words:
        assert_one_sentence_per_cause(check_out, words)
        assert_one_sentence_per_cause(refusal(serve_out), words)
    if case not in VLLM_CONFIGURABLE + sorted(ACCEPTED_MODELS):
        return
    vllm_config = _vllm_config(model, additional_config={"s4kv": {"scheme": "int4_kivi"}}, **S4KV_ENGINE_ARGS)
    if not words:
        assert check_vllm_config(vllm_config) is not None
        return
    with pytest.raises(S4KVConfigError) as err:
        check_vllm_config(vllm_config)
    assert_one_sentence_per_cause(str(err.value), words)


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


def test_serve_refuses_a_key_in_a_config_file(tmp_path, capsys):
    """vLLM's --config YAML is read into the same arguments, and vLLM would log the key among them."""
    (tmp_path / "serve.yaml").write_text("api-key: sekrit\n")
    code, out = serve_dry_run(capsys, write_model_dir(tmp_path, "qwen", QWEN25_7B), "--scheme", "int4_kivi",
                              "--config", str(tmp_path / "serve.yaml"))
    assert code == EXIT_BAD_INPUT
    assert_one_sentence_per_cause(refusal(out), ["not even in a --config file"])
    assert "sekrit" not in out


@pytest.mark.parametrize("additional_config, preset, expected", [
    ({"s4kv": {"scheme": "int4_kivi"}}, None, "0"),  # kivi: V1 chosen
    ({"s4kv": {"scheme": "int4_kivi"}}, "1", "1"),  # the user's choice is kept (the engine check then refuses it)
    ({"s4kv": {"scheme": "int4_saw"}}, None, None),  # saw runs on either runner: vLLM's default stays
    (None, None, None),  # no S4 KV: nothing changes
])
def test_choose_model_runner_selects_v1_only_for_kivi(monkeypatch, additional_config, preset, expected):
    from s4kv.runtime.schemes import V2_MODEL_RUNNER_ENV, choose_model_runner

    monkeypatch.delenv(V2_MODEL_RUNNER_ENV, raising=False)
    if preset is not None:
        monkeypatch.setenv(V2_MODEL_RUNNER_ENV, preset)
    choose_model_runner(additional_config)
    assert os.environ.get(V2_MODEL_RUNNER_ENV) == expected
