"""One engine process of `s4kv bench`: start vLLM with one KV format, run a group of workloads, print the result.

Run by runtime/bench.py as ``python -m s4kv.runtime.bench_engine SPEC.json``; a fresh process per
configuration keeps GPU memory, compile caches and CUDA graphs of one format out of the next one's
numbers. The result is one stdout line, ``RESULT_PREFIX`` + JSON; the parent reads it and vLLM's
"GPU KV cache size: N tokens" from the process's combined log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .bench_matrix import FORMATS, Workload

RESULT_PREFIX = "S4KV_BENCH_RESULT "
# First id of Qwen2's special tokens: prompts stay below it so no request looks like a control sequence.
FIRST_SPECIAL_TOKEN = 151643
WARMUP_REQUESTS = 8


def token_prompts(workload: Workload, vocab_size: int) -> list[dict[str, list[int]]]:
    """Distinct random token-id prompts (no shared prefixes, so prefix caching cannot shortcut prefill)."""
    import numpy as np

    rng = np.random.default_rng(workload.seed)
    high = min(vocab_size, FIRST_SPECIAL_TOKEN)
    ids = rng.integers(0, high, size=(workload.num_requests, workload.input_len))
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def run_workload(llm, workload: Workload, vocab_size: int) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = token_prompts(workload, vocab_size)
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if len(produced) != workload.num_requests or any(n != workload.output_len for n in produced):
        raise RuntimeError(
            f"{workload.name}: expected {workload.num_requests} outputs of {workload.output_len} tokens, "
            f"got {len(produced)} with lengths {sorted(set(produced))}"
        )
    output_tokens = sum(produced)
    input_tokens = workload.num_requests * workload.input_len
    return {
        "wall_s": wall,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (output_tokens + input_tokens) / wall,
    }


def warm_up(llm, vocab_size: int, max_model_len: int) -> None:
    """Compile every kernel variant a workload meets (prefill, chunked prefill, decode) before timing."""
    import numpy as np
    from vllm import SamplingParams

    rng = np.random.default_rng(12345)
    new_tokens = 32
    lengths = [min(n, max_model_len - new_tokens) for n in (100, 700, 1500, 3000)] * (WARMUP_REQUESTS // 4)
    prompts = [{"prompt_token_ids": rng.integers(0, min(vocab_size, FIRST_SPECIAL_TOKEN), n).tolist()}
               for n in lengths]
    llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    fmt = FORMATS[spec["format"]]
    workloads = [Workload.from_spec(w) for w in spec["workloads"]]
    engine = workloads[0].engine
    vocab_size = int(spec["vocab_size"])

    start = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM

    llm = LLM(
        model=spec["model"],
        load_format=spec["load_format"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_num_seqs=engine.max_num_seqs,
        max_model_len=engine.max_model_len,
        **fmt.engine_kwargs(),
    )
    startup = time.perf_counter() - start
    warm_up(llm, vocab_size, engine.max_model_len)
    results = {w.name: run_workload(llm, w, vocab_size) for w in workloads}
    payload = {
        "startup_s": startup,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
        "vllm": vllm.__version__,
        "workloads": results,
    }
    print(RESULT_PREFIX + json.dumps(payload), flush=True)
    # Leave without vLLM's interpreter-exit teardown, which can stall: the parent takes down the engine
    # core with this process group and waits until it is gone before the next engine starts.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m s4kv.runtime.bench_engine SPEC.json")
    main(sys.argv[1])
