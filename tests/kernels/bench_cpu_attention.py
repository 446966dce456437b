"""Speed of the CPU engine's batched attention (kernels/cpu_attention.py) against the torch reference it replaces,
one SmolLM2-shaped layer (9 query / 3 KV heads of 64, bf16, one torch thread): decode batches and a mixed batch.
Prints milliseconds per call of each and their ratio (a measurement, not a test):

    PYTHONPATH=tests python tests/kernels/bench_cpu_attention.py     # tests/: the oracles the data comes from
"""

from __future__ import annotations

import time

import torch
from own_block_oracle import KIVI, stored_step

from s4kv.kernels import cpu_attention, reference
from s4kv.kernels.scheme import Int4Scheme

SOFTMAX_SCALE = 0.125
SCHEMES = {"int4_kivi": KIVI, "int4_saw": Int4Scheme("int4_saw")}
BATCHES = (("8 decodes, 256 context", [(255, 1)] * 8), ("32 decodes, 1024 context", [(1023, 1)] * 32),
           ("4 prefills of 128 + 4 decodes", [(0, 128)] * 4 + [(200, 1)] * 4))
MIN_SECONDS = 0.5  # per (scheme, batch, implementation): at least three calls and this long


def ms_per_call(attend, batch, cache, pool, scheme) -> float:
    kwargs = {} if pool is None else dict(staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots,
                                          new_keys=batch.key)
    calls, started = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - started < MIN_SECONDS:
        attend(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, SOFTMAX_SCALE, scheme,
               **kwargs)
        calls += 1
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    torch.set_num_threads(1)  # many small tensor ops: one thread runs them faster than two
    gen = torch.Generator().manual_seed(0)
    print("| scheme | batch (one layer) | kernels/cpu_attention ms | reference ms | speed-up |")
    print("|---|---|---:|---:|---:|")
    for name, scheme in SCHEMES.items():
        for label, specs in BATCHES:
            batch, cache, pool = stored_step(gen, specs, 64, "cpu", num_q_heads=9, num_kv_heads=3, scheme=scheme,
                                             dtype=torch.bfloat16)
            batched, ref = (ms_per_call(attend, batch, cache, pool, scheme)
                            for attend in (cpu_attention.paged_attention, reference.paged_attention))
            print(f"| {name} | {label} | {batched:.1f} | {ref:.1f} | {ref / batched:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
