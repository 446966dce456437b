#!/usr/bin/env python3
"""Build the tiny offline models (models/tiny-qwen2 and models/tiny-llama3 at head_dim 128, models/tiny-llama3-d64 at
head_dim 64): a BPE tokenizer made with `tokenizers`, weights trained on CPU to memorize short question/answer pairs
(runtime/tiny_model.py says why).

usage: python tools/make_tiny_model.py [OUT_DIR] [--steps N] [--head-dim 128|64]   (default OUT_DIR: models/)
Takes about 10 minutes on 2 CPU cores; the result is committed, so the demo and the tests never train.
"""

import argparse
import os
import sys

from s4kv.runtime.tiny_model import build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=os.path.join(REPO, "models"))
    parser.add_argument("--steps", type=int, default=500, help="training steps (batch 8 x 256 tokens)")
    parser.add_argument("--head-dim", type=int, choices=(128, 64), default=128,
                        help="128: tiny-llama3 and tiny-qwen2; 64: tiny-llama3-d64")
    args = parser.parse_args()
    for path in build(args.out_dir, steps=args.steps, head_dim=args.head_dim):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
