"""The eager-step kernels of S4 KV's attention on vLLM's V1 model runner compiled while the engine starts, not at
the first requests (int4_kivi always runs on that runner; int4_saw does where vLLM's V1 runner is chosen).

vLLM's start-up warm-up (the V1 model runner's dummy run of a few tokens per sequence, then CUDA-graph capture of
decode batches) never closes a KV block, never prefills beside decodes and never stages an open block's keys, so
the kernels of those steps (the dense prefill gather over a cached prefix; int4_kivi's store staging variants, block
close and staging copy after attention) would be compiled by the first requests that need them: seconds each, while
every running request waits (vLLM's JIT monitor logs "Triton kernel JIT compilation during inference"). After vLLM's
own kernel warm-up, two dummy mixed steps run those launches once (``warm_up_eager_steps``):

* decodes beside a chunk that starts inside a block and ends inside a later one: the dense gather of the cached
  prefix (int4_kivi: with the originals' pages, the close over listed rows, the staging copy after attention), the
  decode rows of a mixed step;
* decodes beside a prompt from position 0 that fills two blocks: int4_kivi's staging copy in its own launch.

The V1 runner also computes each real step's slot mapping with a Triton kernel of vLLM's that no dummy
run launches (vLLM warms it up for Qwen models only), so it is launched once here too, on the runner's own block
tables with a batch of no tokens (``warm_up_slot_mapping``).

Dummy steps write nothing: their slot mapping is all padding (-1), which the store and the close skip, and the
staging slots of a step the runner did not announce are -1 everywhere (staging.StagingBuffers.build).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .config import BLOCK_SIZE

logger = logging.getLogger("vllm.s4kv")


def mixed_steps(max_num_tokens: int, max_num_seqs: int) -> list[dict[str, int]]:
    """The ``_dummy_run`` arguments of the two warm-up steps (see the module docstring), or none where the engine
    runs one sequence a step or its token budget has no room for them.

    A dummy mixed batch of ``n`` tokens (vLLM 0.26, ``create_mixed_batch``) holds ``min(max_num_seqs - 1, n // 2)``
    one-token decodes and one prefill of the rest; the prefill's sequence is one token longer than its chunk (a
    chunk from position 1), or every sequence is ``profile_seq_lens`` long (the prefill's length: a prompt from
    position 0)."""
    def prefill_tokens(n: int) -> int:
        return n - min(max_num_seqs - 1, n // 2)

    if max_num_seqs < 2:
        return []
    sizes = range(2, 4 * BLOCK_SIZE + 1)
    # a chunk from position 1 past the first block's end, ending inside the second block
    chunk = next(n for n in sizes if BLOCK_SIZE <= prefill_tokens(n) < 2 * BLOCK_SIZE - 1)
    # a prompt that fills two blocks
    prompt = next(n for n in sizes if prefill_tokens(n) == 2 * BLOCK_SIZE)
    if max(chunk, prompt) > max_num_tokens:
        return []
    return [{"num_tokens": chunk}, {"num_tokens": prompt, "profile_seq_lens": 2 * BLOCK_SIZE}]


def has_s4kv_attention(runner: Any) -> bool:
    """Whether any attention group of the runner is built by S4 KV's backend."""
    from .backend import S4KVMetadataBuilder

    return any(isinstance(builder, S4KVMetadataBuilder) for groups in getattr(runner, "attn_groups", ())
               for group in groups for builder in group.metadata_builders)


def warm_up_eager_steps(runner: Any) -> bool:
    """Run the warm-up steps on a V1 model runner whose attention is S4 KV's; False, with a warning, where it is
    not, the engine's budget has no room for them or a step raised."""
    import torch
    from vllm.config import CUDAGraphMode

    if not has_s4kv_attention(runner):
        return False
    steps = mixed_steps(runner.max_num_tokens, runner.scheduler_config.max_num_seqs)
    if not steps:
        logger.warning("S4 KV: the eager-step kernels are not warmed up (max_num_seqs %d, %d tokens a step): "
                       "the first requests that prefill beside decodes will compile them",
                       runner.scheduler_config.max_num_seqs, runner.max_num_tokens)
        return False
    try:
        with torch.inference_mode():
            for step in steps:
                runner._dummy_run(cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
                                  create_mixed_batch=True, skip_eplb=True, **step)
            warm_up_slot_mapping(runner)
    except Exception as error:  # an optimization of the start: the engine serves without it, and says so
        logger.warning("S4 KV: the eager-step kernels are not warmed up (%s: %s): the first requests that "
                       "prefill beside decodes will compile them", type(error).__name__, error)
        return False
    logger.info("S4 KV: the eager-step kernels compiled (%d dummy mixed steps, the slot mapping)", len(steps))
    return True


def warm_up_slot_mapping(runner: Any) -> None:
    """Launch the V1 runner's slot-mapping kernel once on its own block tables (so with the arguments, and the JIT
    key, of a real step) for one sequence of no tokens: it writes only padding into the runner's slot-mapping
    buffers, which every step rewrites before use."""
    import torch

    query_start_loc = torch.zeros(2, dtype=torch.int32, device=runner.device)
    positions = torch.zeros(1, dtype=torch.int64, device=runner.device)
    runner.input_batch.block_table.compute_slot_mapping(1, query_start_loc, positions)


def install_warmup_hook() -> None:
    """Run warm_up_eager_steps after vLLM's ``kernel_warmup`` in the GPU worker (idempotent). The CPU worker never
    calls ``kernel_warmup``, and its attention runs no Triton kernels."""
    from vllm.v1.worker import gpu_worker

    original = gpu_worker.kernel_warmup
    if getattr(original, "s4kv_warmup_hook", False):
        return

    @functools.wraps(original)
    def kernel_warmup(worker):
        original(worker)
        if not worker.use_v2_model_runner:
            warm_up_eager_steps(worker.model_runner)

    kernel_warmup.s4kv_warmup_hook = True
    gpu_worker.kernel_warmup = kernel_warmup
