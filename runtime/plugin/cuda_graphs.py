"""A full CUDA graph for every decode batch up to max_num_seqs.

vLLM 0.26 replays a full CUDA graph for a batch of decodes only at a capture size no larger than max_num_seqs
(``vllm/v1/cudagraph_dispatcher.py``: a batch is padded to the next capture size, and a padded size past
max_num_seqs has no full-graph key). Its default capture sizes are 1, 2, 4 and multiples of 8 (of 16 from 256) up
to twice max_num_seqs, at most 512 (``VllmConfig._set_cudagraph_sizes``). Where max_num_seqs is off that stride
(17, 100, 300, ...), the largest decode batches, which a loaded server runs most, replay only the piecewise graphs:
attention runs eagerly. vLLM's own backends launch C++ ops there; S4 KV launches Triton kernels from Python, several
a layer, and such a step is bound by the host: int4_kivi's decode steps at max_num_seqs 17 took about twice as long
as in a full graph (docs/results/performance.md). So `s4kv serve` adds max_num_seqs to vLLM's capture sizes when the
user chose none: one more graph, captured at start-up.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

logger = logging.getLogger("vllm.s4kv")


def largest_decode_batch(vllm_config: Any) -> int:
    """Tokens in a batch of max_num_seqs decodes (each a token plus its speculative drafts)."""
    return (1 + vllm_config.num_speculative_tokens) * vllm_config.scheduler_config.max_num_seqs


def sizes_with_largest_decode_batch(vllm_config: Any) -> list[int] | None:
    """vLLM's capture sizes plus the largest decode batch, where decodes replay full graphs of their own
    (FULL_AND_PIECEWISE, FULL_DECODE_ONLY) and that batch is within the largest capture size but not one of the sizes;
    else None: every decode batch already has its full graph, or, past the largest size, runs without a graph in any
    backend."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    sizes = list(compilation.cudagraph_capture_sizes or ())
    largest = largest_decode_batch(vllm_config)
    if (mode is None or not mode.separate_routine() or mode.decode_mode() != CUDAGraphMode.FULL
            or largest > (compilation.max_cudagraph_capture_size or 0) or largest in sizes):
        return None
    return sorted(sizes + [largest])


def capture_sizes_chosen(args: Namespace) -> bool:
    """Whether the `vllm serve` arguments name capture sizes (``--cudagraph-capture-sizes`` or in
    ``--compilation-config``)."""
    compilation = getattr(args, "compilation_config", None)
    return (getattr(args, "cudagraph_capture_sizes", None) is not None
            or getattr(compilation, "cudagraph_capture_sizes", None) is not None)


def cover_largest_decode_batch(args: Namespace, vllm_config: Any) -> list[int] | None:
    """Set ``args.cudagraph_capture_sizes`` (the engine is built from ``args`` later) to vLLM's sizes plus the
    largest decode batch where that batch would run without its full graph; returns the new sizes, or None when
    nothing changed. Sizes the user chose are kept, with a warning if they leave that batch out."""
    if capture_sizes_chosen(args):
        warn_missing_decode_graph(vllm_config)
        return None
    sizes = sizes_with_largest_decode_batch(vllm_config)
    if sizes is None:
        return None
    args.cudagraph_capture_sizes = sizes
    largest = largest_decode_batch(vllm_config)
    logger.info("S4 KV: CUDA-graph capture sizes %s (vLLM's, plus %d, the largest decode batch, which then replays "
                "a full graph)", sizes, largest)
    return sizes


def warn_missing_decode_graph(vllm_config: Any) -> bool:
    """Log a warning, and return True, where the largest decode batch would run without its full graph (an engine
    built outside `s4kv serve`: `vllm serve`, the Python API, or capture sizes chosen by the user)."""
    if sizes_with_largest_decode_batch(vllm_config) is None:
        return False
    largest = largest_decode_batch(vllm_config)
    logger.warning("S4 KV: the CUDA-graph capture sizes %s leave out %d, the largest decode batch (max_num_seqs x "
                   "decode tokens): such steps run attention outside a full CUDA graph, bound by the host; add %d to "
                   "--cudagraph-capture-sizes (s4kv serve adds it when no sizes are given)",
                   list(vllm_config.compilation_config.cudagraph_capture_sizes), largest, largest)
    return True
