"""int4_kivi's staging pool: the original keys of open blocks, until the block closes per channel.

A KIVI key group is one 128-token page, quantized per channel once all 128 keys are there. Keys arrive over several
batches (chunked prefill, decode steps), so the keys of a page that is not full yet are kept, in the model's dtype,
in a pool of slots beside the int4 cache: ``staged_keys[slot, kv_head, offset, :]``, one slot per sequence with an
open page. The store (reference.store_kv, store.store_kv) closes a page from the batch's own rows plus the pool's
rows for the offsets earlier batches wrote, then copies the keys of pages still open into their slot (``stage``,
below). The page's bytes are then a function of its 128 keys alone, whatever the write pattern. int4_kivi stores
and reads always take the pool; int4_saw takes none. docs/format.md gives the design: who assigns slots, how they
are released, what the pool costs in KV capacity.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import KIVI_BLOCK_SIZE

# When a store copies the keys of pages still open into the pool (store_kv's ``stage``). A sequence keeps one slot,
# and a batch that starts inside a page and ends inside a later one re-keys it to the later page, whose first rows
# then overwrite rows the batch still reads as the earlier page's originals (the close, attention's own page):
STAGE_AFTER_CLOSE = "after_close"  # after the batch's closes: right for any batch without attention in between
STAGE_IN_STORE = "in_store"  # in the store's own launch: for a batch where staging_overwrites_reads is False
STAGE_BY_CALLER = "by_caller"  # not by the store: the caller calls stage_open_keys (the engine, after attention)
STAGES = (STAGE_AFTER_CLOSE, STAGE_IN_STORE, STAGE_BY_CALLER)


def allocate_pool(num_slots: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                  device) -> torch.Tensor:
    """An empty staging pool [num_slots, num_kv_heads, block_size, head_dim] of the model's dtype."""
    return torch.empty(num_slots, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)


def sequence_staging_slots(tokens_per_sequence, device) -> torch.Tensor:
    """staging_slots for a store outside the engine (tests, tools) whose rows are the tokens of whole sequences, one
    sequence after the other: sequence i's rows stage into pool slot i (a pool of allocate_pool(len(...), ...))."""
    counts = torch.as_tensor(tokens_per_sequence, device=device)
    return torch.arange(counts.shape[0], device=device).repeat_interleave(counts)


def check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")


def staging_overwrites_reads(query_start_loc, seq_lens, block_size: int = KIVI_BLOCK_SIZE) -> bool:
    """Whether staging a batch's open pages before its closes and attention would overwrite pool rows they read.
    Sequence ``i`` has ``q = query_start_loc[i + 1] - query_start_loc[i]`` new tokens ending at ``seq_lens[i]``
    (host arrays). Its step reads pool rows ``[0, s)`` of its slot, the earlier keys of the page it starts in
    (``s`` = its first position % block_size), and stages rows ``[0, e)`` of a later page it ends inside into the
    same slot (``e`` = its end % block_size): they overlap iff ``s > 0``, ``e > 0`` and the step crosses a page
    boundary. Decodes, prompts from position 0 and chunks that start on a page boundary never do."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    ends = np.asarray(seq_lens, dtype=np.int64)[: starts.shape[0] - 1]
    first = ends - np.diff(starts)
    crosses = (ends - 1) // block_size > first // block_size
    return bool(np.any((first % block_size != 0) & (ends % block_size != 0) & crosses))


def check_pool_given(scheme, staged_keys, slots, slots_name: str) -> None:
    """int4_kivi stores and reads with its staging pool every time (a closed page is quantized per channel from its
    original keys, a query reads its own page's originals): ``staged_keys`` and the slots (``slots_name``) are both
    required; int4_saw takes neither."""
    given = staged_keys is not None, slots is not None
    if scheme.is_kivi and not all(given):
        raise ValueError(f"int4_kivi needs its staging pool: staged_keys and {slots_name} (kernels/staging.py; "
                         f"outside the engine allocate_pool and sequence_staging_slots build them)")
    if not scheme.is_kivi and any(given):
        raise ValueError(f"{scheme.name} takes no staging pool (staged_keys, {slots_name}): only int4_kivi stages "
                         f"keys")


def check_staging(staged_keys: torch.Tensor, staging_slots: torch.Tensor, key: torch.Tensor, block_size: int) -> None:
    """A pool that fits the batch's keys (same heads, head_dim and dtype: the model's keys, unrounded) and a slot
    entry for every token."""
    if tuple(staged_keys.shape[1:]) != (key.shape[1], block_size, key.shape[2]) or staged_keys.dtype != key.dtype:
        raise ValueError(f"staged_keys must be [slots, {key.shape[1]}, {block_size}, {key.shape[2]}] {key.dtype} (the "
                         f"model's keys, unrounded), got {tuple(staged_keys.shape)} {staged_keys.dtype}")
    if staging_slots.shape[0] < key.shape[0]:
        raise ValueError(f"staging_slots holds {staging_slots.shape[0]} entries for {key.shape[0]} tokens")


def check_pool_read(staged_keys, sequence_slots, num_seqs: int, num_kv_heads: int, head_dim: int, scheme) -> None:
    """The pool and per-sequence slots an attention read takes: int4_kivi always (check_pool_given), one int32 slot
    per sequence, a pool of the cache's heads, 128-token pages and head_dim; int4_saw none."""
    check_pool_given(scheme, staged_keys, sequence_slots, "sequence_slots")
    if not scheme.is_kivi:
        return
    if staged_keys.dim() != 4 or tuple(staged_keys.shape[1:]) != (num_kv_heads, KIVI_BLOCK_SIZE, head_dim):
        raise ValueError(f"staged_keys must be [slots, {num_kv_heads}, {KIVI_BLOCK_SIZE}, {head_dim}], got "
                         f"{tuple(staged_keys.shape)}")
    if sequence_slots.dtype != torch.int32 or tuple(sequence_slots.shape) != (num_seqs,):
        raise ValueError(f"sequence_slots must be int32 [{num_seqs}] (one per sequence), got {sequence_slots.dtype} "
                         f"{tuple(sequence_slots.shape)}")


def check_new_keys(new_keys, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """The step's keys an int4_kivi attention read takes for its own blocks: [>= T, Hkv, D] in the query's dtype with
    contiguous channels (vLLM's ``key``; rows past the T query tokens are CUDA-graph padding, never read)."""
    if new_keys is None:
        raise ValueError("int4_kivi attention needs new_keys (the step's keys): a query's own block is read from the "
                         "original keys")
    if (new_keys.dim() != 3 or new_keys.shape[0] < num_tokens or tuple(new_keys.shape[1:]) != (num_kv_heads, head_dim)
            or new_keys.dtype != dtype or new_keys.stride(-1) != 1):
        raise ValueError(f"new_keys must be [>= {num_tokens}, {num_kv_heads}, {head_dim}] {dtype} with contiguous "
                         f"channels, got {tuple(new_keys.shape)} {new_keys.dtype} strides {new_keys.stride()}")
