"""`s4kv bench` arguments as its command line gives them, for tests that call bench.run directly."""

import argparse
from pathlib import Path

from s4kv.runtime.bench import runner as bench


def bench_args(out: Path, **overrides) -> argparse.Namespace:
    """The defaults of every `s4kv bench` option, with ``overrides``."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--out", str(out)])
    for name, value in overrides.items():
        if not hasattr(args, name):
            raise AttributeError(f"s4kv bench has no option {name!r}")
        setattr(args, name, value)
    return args
