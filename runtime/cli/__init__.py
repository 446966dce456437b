"""`s4kv` command line: one entry point, one module per subcommand.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int`` and is imported
only when its subcommand runs, so ``s4kv capacity`` never imports torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    # name: (module under s4kv.runtime, one-line help)
    "serve": ("cli.serve", "serve a model with int4 KV through vLLM's OpenAI-compatible server"),
    "check": ("cli.check", "say whether a model is supported, from its config.json, without loading weights"),
    "demo": ("cli.demo", "offline quick start: serve the bundled model with int4 KV and ask it a question"),
    "capacity": ("sizing.capacity", "KV capacity and vLLM settings for a model on an EC2 instance type"),
    "eval": ("eval.evaluate", "quality of each KV format against bf16 KV on the same prompts"),
    "bench": ("bench.runner", "end-to-end throughput of each KV format, one engine per configuration"),
    "model": ("packaged_models", "pretrained models shipped in PyPI packages as GGUF, converted once for vLLM"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="s4kv", description="S4 KV: int4 KV cache for vLLM 0.26.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module)
        if name in _argv_commands():
            importlib.import_module(f"s4kv.runtime.{module}").add_arguments(sub_parser)
    return parser


def _argv_commands() -> set[str]:
    # Only the invoked subcommand's module is imported to build its arguments.
    return {arg for arg in sys.argv[1:] if arg in SUBCOMMANDS}


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args, extra = build_parser().parse_known_args()
    module = importlib.import_module(f"s4kv.runtime.{args._module}")
    if extra and not getattr(module, "ACCEPTS_EXTRA_ARGS", False):
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return int(module.run(args) or 0)

