"""One engine process of `s4kv bench`: start vLLM with one KV format, run a group of workloads, print the result.

Run by runtime/bench/runner.py as ``python -m s4kv.runtime.bench.engine SPEC.json``; a fresh process per
configuration keeps GPU memory, compile caches and CUDA graphs of one format out of the next one's
numbers. The result is one stdout line, ``RESULT_PREFIX`` + JSON; the parent reads it and vLLM's
"GPU KV cache size: N tokens" from the process's combined log.

A tensor-parallel engine is one such process (vLLM starts a worker per GPU). A data-parallel run is one process
per replica (the spec's ``replica``: rank, size, barrier folder), each on its own GPUs, serving every
size-th request from its rank on; the replicas wait for each other after the warm-up and before each workload,
and report wall-clock start and end times, so the parent can sum their throughput over a common interval.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .matrix import FORMATS, Workload

RESULT_PREFIX = "S4KV_BENCH_RESULT "
# First id of Qwen2's special tokens: prompts stay below it so no request looks like a control sequence.
FIRST_SPECIAL_TOKEN = 151643
WARMUP_REQUESTS = 8
BARRIER_TIMEOUT_S = 900.0  # the parent's time budget ends a run long before this


def token_prompts(workload: Workload, vocab_size: int) -> list[dict[str, list[int]]]:
    """Distinct random token-id prompts (no shared prefixes, so prefix caching cannot shortcut prefill)."""
    import numpy as np

    rng = np.random.default_rng(workload.seed)
    high = min(vocab_size, FIRST_SPECIAL_TOKEN)
    ids = rng.integers(0, high, size=(workload.num_requests, workload.input_len))
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def replica_prompts(workload: Workload, vocab_size: int, rank: int = 0, size: int = 1) -> list[dict[str, list[int]]]:
    """This replica's share of the workload's prompts: every size-th one from its rank on (all of them when alone)."""
    if not 0 <= rank < size:
        raise ValueError(f"replica rank {rank} outside 0..{size - 1}")
    return token_prompts(workload, vocab_size)[rank::size]


def engine_kwargs(spec: dict[str, Any], gpu_total_bytes: int | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of one engine process: dummy weights from the spec's model folder, the engine
    setting of its workloads (tensor parallel size included, a card size as the share of a GPU of
    ``gpu_total_bytes``) and the KV format's own arguments. A data-parallel replica is an engine of
    data_parallel_size 1 on its own GPUs, so no data-parallel argument is passed.

    int4_kivi runs at the max_num_seqs its deployment would (``KVFormat.deployed_max_num_seqs``, on a GPU of
    ``gpu_total_bytes``)."""
    fmt = FORMATS[spec["format"]]
    engine = Workload.from_spec(spec["workloads"][0]).engine
    share = engine.memory_share(gpu_total_bytes)
    max_num_seqs = fmt.deployed_max_num_seqs(spec["model"], engine.max_num_seqs, gpu_total_bytes, share,
                                             engine.tensor_parallel_size)
    return {
        "model": spec["model"],
        "load_format": spec["load_format"],
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "gpu_memory_utilization": share,
        "max_num_seqs": max_num_seqs,
        "max_model_len": engine.max_model_len,
        "tensor_parallel_size": engine.tensor_parallel_size,
        **fmt.engine_kwargs(),
    }


def device_total_bytes() -> int:
    """The engine's first GPU's total memory, as vLLM's platform reads it: through NVML on CUDA, so this process
    makes no CUDA context of its own (it would hold GPU memory beside the engine's and force vLLM's workers to
    spawn)."""
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory(0)


def wait_for_replicas(replica: dict[str, Any] | None, tag: str, timeout: float = BARRIER_TIMEOUT_S) -> None:
    """Barrier of a data-parallel run: mark this replica as ready at ``tag`` in the shared folder, then wait until
    every replica is. Nothing to wait for without replicas."""
    if not replica or replica["size"] <= 1:
        return
    folder = Path(replica["barrier"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{tag}.{replica['rank']}").write_text("ready")
    deadline = time.monotonic() + timeout
    while len(list(folder.glob(f"{tag}.*"))) < replica["size"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas did not all reach {tag!r} within {timeout:.0f} s")
        time.sleep(0.02)


def pin_triton_cache() -> Path:
    """Triton's disk cache of compiled kernels, pinned for this process and the engine processes it starts:
    TRITON_CACHE_DIR, else Triton's own default. Unpinned, torch.compile points TRITON_CACHE_DIR at its own folder
    the first time it loads a kernel, so later compilations of ours would land in one of two places."""
    return Path(os.environ.setdefault("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache")))


def cached_kernels(cache: Path) -> int:
    """Compiled kernels in a Triton disk cache, one folder each: a count that grows during a timed run means a
    kernel was compiled inside it, and the run's time includes that compilation."""
    return sum(1 for entry in cache.iterdir() if entry.is_dir()) if cache.is_dir() else 0


def run_workload(llm, workload: Workload, vocab_size: int, triton_cache: Path,
                 replica: dict[str, Any] | None = None) -> dict[str, Any]:
    from vllm import SamplingParams

    rank, size = (replica["rank"], replica["size"]) if replica else (0, 1)
    prompts = replica_prompts(workload, vocab_size, rank, size)
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    wait_for_replicas(replica, workload.name)
    kernels_before = cached_kernels(triton_cache)
    start_unix = time.time()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    end_unix = time.time()
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if len(produced) != len(prompts) or any(n != workload.output_len for n in produced):
        raise RuntimeError(
            f"{workload.name}: expected {len(prompts)} outputs of {workload.output_len} tokens, "
            f"got {len(produced)} with lengths {sorted(set(produced))}"
        )
    output_tokens = sum(produced)
    input_tokens = len(prompts) * workload.input_len
    return {
        "wall_s": wall,
        "output_tokens": output_tokens,
        "input_tokens": input_tokens,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (output_tokens + input_tokens) / wall,
        "start_unix": start_unix,
        "end_unix": end_unix,
        "triton_compiles": cached_kernels(triton_cache) - kernels_before,
    }


def warm_up(llm, vocab_size: int, max_model_len: int) -> None:
    """Compile every kernel variant a workload meets (prefill, chunked prefill, decode) before timing. The longest
    prompt fills the context, so it is prefilled in several steps (a chunk over a cached prefix, beside decodes):
    without it, a long run met a Triton compilation inside its timed part (measured on the H200)."""
    import numpy as np
    from vllm import SamplingParams

    rng = np.random.default_rng(12345)
    new_tokens = 32
    lengths = [min(n, max_model_len - new_tokens) for n in (100, 700, 3000, max_model_len)] * (WARMUP_REQUESTS // 4)
    prompts = [{"prompt_token_ids": rng.integers(0, min(vocab_size, FIRST_SPECIAL_TOKEN), n).tolist()}
               for n in lengths]
    llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    workloads = [Workload.from_spec(w) for w in spec["workloads"]]
    engine = workloads[0].engine
    vocab_size = int(spec["vocab_size"])
    replica = spec.get("replica")

    triton_cache = pin_triton_cache()
    start = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM

    from s4kv.runtime.schemes import choose_model_runner

    kwargs = engine_kwargs(spec, device_total_bytes())
    choose_model_runner(kwargs.get("additional_config"))
    llm = LLM(**kwargs)
    startup = time.perf_counter() - start
    warm_start = time.perf_counter()
    warm_up(llm, vocab_size, engine.max_model_len)
    warmup = time.perf_counter() - warm_start
    results = {w.name: run_workload(llm, w, vocab_size, triton_cache, replica) for w in workloads}
    payload = {
        "startup_s": startup,
        "warmup_s": warmup,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "vllm": vllm.__version__,
        "gpu_memory_utilization": kwargs["gpu_memory_utilization"],
        "max_num_seqs": kwargs["max_num_seqs"],
        "workloads": results,
    }
    print(RESULT_PREFIX + json.dumps(payload), flush=True)
    # Leave without vLLM's interpreter-exit teardown, which can stall: the parent takes down the engine
    # core with this process group and waits until it is gone before the next engine starts.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m s4kv.runtime.bench.engine SPEC.json")
    main(sys.argv[1])
