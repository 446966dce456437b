"""`s4kv check MODEL_OR_CONFIG [--scheme ...] [--block-size N]`: can S4 KV serve this model, and if not, why.

Reads only config.json (a local folder, a config.json path, or a Hugging Face id already in the local cache): no
GPU, no weights, no network, no vLLM. Runs the same checks the engine runs at start-up (config.py).
Exit status: 0 supported, 1 not supported, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from s4kv.kernels.layout import bytes_per_token
from s4kv.runtime.plugin.config import EngineFacts, ModelFacts, engine_rejections, model_rejections, read_model_config
from s4kv.runtime.schemes import KV_FORMATS

from .serve import add_scheme_arguments, scheme_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="local model folder, its config.json, or a Hugging Face id in the local cache")
    add_scheme_arguments(parser, required=False)
    parser.add_argument("--block-size", type=int, help="the --block-size you will pass to vLLM, if any")


def verdict(model: str, args: argparse.Namespace) -> tuple[bool, str]:
    """(supported, one line for the user)."""
    config = scheme_config(args)
    hf_config, name = read_model_config(model)
    facts = ModelFacts.from_hf_config(hf_config, name)
    reasons = engine_rejections(config, EngineFacts(block_size=args.block_size))
    reasons += model_rejections(config, facts)
    if reasons:
        return False, f"{name}: not supported with {config.scheme.name}. " + " ".join(reasons)
    family = facts.family or "outside the validated families (allowed by allow_unsupported_model)"
    int4_bytes = bytes_per_token(facts.head_dim)
    density = KV_FORMATS["bf16"].bytes_per_head_token(facts.head_dim) / int4_bytes
    return True, (
        f"{name}: supported with {config.scheme.name} ({family}, head_dim {facts.head_dim}); KV cache "
        f"{int4_bytes} B per token and KV head, {density:.2f}x denser than bf16."
    )


def run(args: argparse.Namespace) -> int:
    try:
        supported, line = verdict(args.model, args)
    except (OSError, ValueError) as err:
        print(f"s4kv check: {err}", file=sys.stderr)
        return 2
    print(line)
    return 0 if supported else 1
