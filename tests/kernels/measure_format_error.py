"""Measures the round-trip error of each way a key or value can be stored, with the torch reference.

The numbers in docs/format.md ("The KIVI block's error, by how it closed") come from this script (CPU, ~10 s):

    python tests/kernels/measure_format_error.py

Keys are synthetic (no model weights here): ~N(0, 1) per channel, plus a variant where 6% of the channels have
6x the magnitude and an offset, as trained keys do (the reason KIVI quantizes keys per channel). Each row stores
8 KV heads x 8 blocks of 128 tokens through ``reference.store_kv`` in the named way and reports the relative rms
error ||x_hat - x|| / ||x|| and the largest element error in units of the data's rms.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # kv_batches and what it imports
from kv_batches import HEAD_DIM, poisoned_cache  # noqa: E402

from s4kv.kernels import reference as ref  # noqa: E402
from s4kv.kernels.scheme import Int4Scheme  # noqa: E402
from s4kv.kernels.staging import allocate_pool  # noqa: E402

HEADS, BLOCKS, B = 8, 8, 128
KIVI, SAW = Int4Scheme("int4_kivi"), Int4Scheme("int4_saw")


def synthetic_keys(gen: torch.Generator, outliers: bool) -> torch.Tensor:
    x = torch.randn(BLOCKS * B, HEADS, HEAD_DIM, generator=gen)
    if outliers:
        mask = torch.rand(HEADS, HEAD_DIM, generator=gen) < 0.06
        x = x * (1 + 5 * mask) + 2 * mask * torch.randn(HEADS, HEAD_DIM, generator=gen)
    return x


def stored_keys(keys: torch.Tensor, scheme: Int4Scheme, tokens_per_call: int, seq_len: int, gen) -> torch.Tensor:
    """Write ``keys`` (one sequence in blocks 0..BLOCKS-1) ``tokens_per_call`` at a time (int4_kivi through its
    staging pool, slot 0); read the first seq_len."""
    cache = poisoned_cache(BLOCKS, HEADS, B, gen, "cpu")
    slots = torch.arange(BLOCKS * B)
    pool = allocate_pool(1, HEADS, B, HEAD_DIM, keys.dtype, "cpu")
    for start in range(0, seq_len, tokens_per_call):
        stop = min(seq_len, start + tokens_per_call)
        staging = dict(staged_keys=pool, staging_slots=torch.zeros(stop - start, dtype=torch.long)) \
            if scheme.is_kivi else {}
        ref.store_kv(keys[start:stop], keys[start:stop], cache, slots[start:stop], scheme, **staging)
    k_hat, _ = ref.dequantize_sequence(cache, torch.arange(BLOCKS), seq_len, scheme, HEAD_DIM)
    return k_hat


def errors(x_hat: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    rms = x.pow(2).mean().sqrt()
    return float((x_hat - x).norm() / x.norm()), float((x_hat - x).abs().max() / rms)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    n = BLOCKS * B
    last_block = slice(B * (BLOCKS - 1), n - 1)  # the 127 keys of a block left open
    ways = {  # name -> (keys -> (stored and read back, the keys they stand for))
        "kivi, block closed in one batch (prefill): per channel from the original keys":
            lambda k: (stored_keys(k, KIVI, n, n, gen), k),
        "kivi, open block (staged): per token after the 128-wide Hadamard":
            lambda k: (stored_keys(k, KIVI, n, n - 1, gen)[last_block], k[last_block]),
        "kivi, block closed by decode (1 token per step): per channel from the original keys (the pool's)":
            lambda k: (stored_keys(k, KIVI, 1, n, gen), k),
        "kivi, block closed by 32-token chunks: per channel from the original keys (the pool's)":
            lambda k: (stored_keys(k, KIVI, 32, n, gen), k),
        "saw (hadamard_block 128): per token after the Hadamard":
            lambda k: (stored_keys(k, SAW, n, n, gen), k),
        "per token, no rotation (kivi's values; for keys a naive scheme)":
            lambda k: (ref.dequantize_per_token(*ref.quantize_per_token(k)), k),
    }
    print("| how the keys are stored | rel. rms error, N(0,1) keys | max error / rms | "
          "rel. rms error, keys with outlier channels | max error / rms |")
    print("|---|---|---|---|---|")
    data = [synthetic_keys(gen, outliers=False), synthetic_keys(gen, outliers=True)]
    for name, way in ways.items():
        cells = [f"{v:.3f}" for keys in data for v in errors(*way(keys))]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
