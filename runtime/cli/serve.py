"""`s4kv serve MODEL --scheme int4_kivi|int4_saw|bf16 [--port 8000] [vllm serve args...]`

Runs vLLM's own OpenAI-compatible server (``/v1/...``, ``/health``) with S4 KV switched on, i.e. what::

    vllm serve MODEL --kv-cache-dtype int4_per_token_head --attention-backend CUSTOM \\
        --additional-config '{"s4kv": {"scheme": ...}}' --port 8000 [vllm serve args...]

runs, in this process, with three differences (plugin/api_server.py): every setting is checked before the engine
is built (one sentence and exit status 2 for bad input, 3 for a model or feature S4 KV cannot serve); the process
exits 4 when the engine dies; and when an API key is set (``S4KV_API_KEY_FILE`` or ``VLLM_API_KEY``, never
``--api-key``) every route except ``GET /health`` needs it (plugin/api_key.py). ``--scheme bf16`` serves with vLLM's
own bf16 KV cache through the same server. Any other argument goes to `vllm serve` unchanged.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from s4kv.runtime.exit_codes import EXIT_BAD_INPUT, EXIT_UNSUPPORTED
from s4kv.runtime.plugin.api_key import MIDDLEWARE, configured_api_key
from s4kv.runtime.plugin.config import ModelFacts, S4KVConfig, as_sentence, model_rejections, read_model_config
from s4kv.runtime.schemes import (ATTENTION_BACKEND, CONFIG_KEY, DEFAULT_PREFILL_TOKENS_PER_STEP, DEFAULT_SCHEME,
                                  KV_CACHE_DTYPE, SAW_HADAMARD_BLOCKS, SCHEMES, SERVED_SCHEMES,
                                  prefill_capped_scheduler_settings)

ACCEPTS_EXTRA_ARGS = True  # everything s4kv does not know goes to `vllm serve`
BF16 = "bf16"  # vLLM's own KV cache, no S4 KV: the baseline served the same way
# Flags s4kv serve sets itself; passing them too would silently run another KV format.
OWNED_FLAGS = ("--kv-cache-dtype", "--attention-backend", "--additional-config", "--attention-config.backend",
               "-ac.backend")
# Flags that would put the API key into argv, where every process listing and vLLM's log show it.
KEY_FLAGS = ("--api-key",)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def add_scheme_arguments(parser: argparse.ArgumentParser, required: bool = True,
                         schemes: tuple[str, ...] = SCHEMES) -> None:
    parser.add_argument("--scheme", choices=schemes, required=required,
                        default=None if required else DEFAULT_SCHEME, help="S4 KV scheme")
    parser.add_argument("--hadamard-block", type=int, choices=SAW_HADAMARD_BLOCKS,
                        help="int4_saw: size of the block-diagonal Hadamard rotation (default: the whole head)")
    parser.add_argument("--rotate-values", action="store_true", help="int4_saw: rotate values too")
    parser.add_argument("--allow-unsupported-model", action="store_true",
                        help="run a model outside the Qwen2/Qwen2.5/Llama-3 families")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hugging Face id, as for `vllm serve`")
    add_scheme_arguments(parser, schemes=SERVED_SCHEMES)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill-tokens-per-step", type=int, default=DEFAULT_PREFILL_TOKENS_PER_STEP,
                        metavar="TOKENS",
                        help="while requests decode, a step takes at most TOKENS prompt tokens (the plugin's "
                             "scheduler, any KV format: lower p99 inter-token latency under load; default "
                             f"{DEFAULT_PREFILL_TOKENS_PER_STEP}); 0 runs vLLM's own scheduler")
    parser.add_argument("--dry-run", action="store_true",
                        help="check every setting as the server would, print the vllm serve command and exit")
    parser.epilog = "Other arguments are passed to `vllm serve` unchanged."


def scheme_config(args: argparse.Namespace) -> S4KVConfig:
    """The S4 KV options from the command line (errors name the option)."""
    options: dict = {"scheme": args.scheme}
    if args.hadamard_block is not None:
        options["hadamard_block"] = args.hadamard_block
    if args.rotate_values:
        options["rotate_values"] = True
    if args.allow_unsupported_model:
        options["allow_unsupported_model"] = True
    return S4KVConfig.parse(options)


def serve_flags(args: argparse.Namespace, api_key_set: bool) -> list[str]:
    """The `vllm serve` flags: S4 KV's (none for bf16), the key middleware when a key is set, then the user's own."""
    extra = args.extra
    clashing = [arg for arg in extra if _flag_name(arg) in OWNED_FLAGS]
    attention_config = _flag_value(extra, "--attention-config") or _flag_value(extra, "-ac")
    if attention_config is not None and "backend" in attention_config:
        clashing.append(f"the backend in --attention-config {attention_config}")
    if clashing:
        raise ValueError(f"s4kv serve sets the KV cache dtype, the attention backend and the additional config "
                         f"itself; remove {' and '.join(clashing)}.")
    if any(_flag_name(arg) in KEY_FLAGS for arg in extra):
        raise ValueError(
            "s4kv serve takes no --api-key (argv shows in every process listing and in vLLM's log): put the key "
            "in a file named by S4KV_API_KEY_FILE, or in VLLM_API_KEY."
        )
    flags, additional_config = [], {}
    if args.scheme != BF16:
        flags += ["--kv-cache-dtype", KV_CACHE_DTYPE, "--attention-backend", ATTENTION_BACKEND]
        additional_config[CONFIG_KEY] = scheme_config(args).to_options()
    elif args.hadamard_block is not None or args.rotate_values or args.allow_unsupported_model:
        raise ValueError("--hadamard-block, --rotate-values and --allow-unsupported-model are S4 KV options; "
                         "--scheme bf16 takes none of them.")
    scheduler_flags, scheduler_config = prefill_capped_scheduler_settings(args.prefill_tokens_per_step)
    if scheduler_flags and any(_flag_name(arg) == "--scheduler-cls" for arg in extra):
        raise ValueError(f"--scheduler-cls would replace the plugin's prefill-capped scheduler (on by default, "
                         f"--prefill-tokens-per-step {args.prefill_tokens_per_step}); add "
                         f"--prefill-tokens-per-step 0 to run your own.")
    flags += scheduler_flags
    additional_config.update(scheduler_config)
    if additional_config:
        flags += ["--additional-config", json.dumps(additional_config)]
    if api_key_set:
        flags += ["--middleware", MIDDLEWARE]
    return [*flags, "--port", str(args.port), *extra]


def local_model_rejections(args: argparse.Namespace) -> list[str]:
    """What `s4kv check` says about a local model's config.json (ValueError, naming the file or field, when it is
    malformed); vLLM's reading of the config is checked again before the engine starts (api_server.precheck)."""
    try:
        hf_config, name = read_model_config(args.model)
    except FileNotFoundError:
        return []  # a Hugging Face id: vLLM fetches config.json and the same checks run on its reading
    facts = ModelFacts.from_hf_config(hf_config, name)
    return [] if args.scheme == BF16 else model_rejections(scheme_config(args), facts)


def run(args: argparse.Namespace) -> int:
    try:
        api_key = configured_api_key()
        flags = serve_flags(args, api_key_set=api_key is not None)
        reasons = local_model_rejections(args)
    except ValueError as err:
        print(f"s4kv serve: {as_sentence(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if reasons:
        print(f"s4kv serve: {' '.join(reasons)}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    print("s4kv serve: " + shlex.join(["vllm", "serve", args.model, *flags]), flush=True)
    host = _flag_value(args.extra, "--host")
    if api_key is None and host not in LOOPBACK_HOSTS:
        print(f"s4kv serve: no API key is set, so every route is open to anyone who can reach port {args.port} "
              "(set S4KV_API_KEY_FILE or VLLM_API_KEY).", file=sys.stderr, flush=True)
    from s4kv.runtime.plugin import api_server  # imports vLLM

    if args.dry_run:
        return api_server.check_only(["--model", args.model, *flags])
    return api_server.main(["--model", args.model, *flags])


def _flag_name(arg: str) -> str:
    """A flag as vLLM's parser reads it: --max_model_len and --max-model-len are the same flag."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _flag_value(extra: list[str], flag: str) -> str | None:
    for i, arg in enumerate(extra):
        if _flag_name(arg) != flag:
            continue
        if "=" in arg:
            return arg.split("=", 1)[1]
        return extra[i + 1] if i + 1 < len(extra) else None
    return None
