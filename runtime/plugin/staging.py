"""int4_kivi's staging pool in the engine: which pool slot holds the original keys of each sequence's open block,
step by step, and when a slot is given back (docs/format.md, "The staging pool").

* ``SlotAssignment`` (numpy, no vLLM): slots keyed by the physical block id of an open block. Per step, for a
  sequence with context ``c`` and ``q`` new tokens, its open block ``c // 128`` keeps the slot recorded for it (when
  ``c % 128 != 0``), a sequence starting a block takes a free slot if the step ends inside a block, and the slot is
  re-keyed to the block the step ends in, or released when the step ends on a block boundary (the block closed),
  free for other blocks from the next step on. A block written from offset 0 drops any slot still recorded for its
  id (vLLM freed and reallocated it).
* ``StagingBuffers``: the builder's persistent ``staging_slots`` (per token) and ``sequence_slots`` (per sequence)
  device buffers, fixed addresses that full CUDA-graph replays read like the slot mapping.
* ``block_closing_rows``: the rows of a batch that close a block, from the host query starts and sequence lengths,
  so the store's close of a step with prefill runs over those rows alone.
* ``install_step_hook``: vLLM 0.26 tells only the model runner which requests finished or were preempted
  (``SchedulerOutput.finished_req_ids``, ``preempted_req_ids``) and only the runner holds the block table on the
  host. A wrapper of the V1 runner's ``GPUModelRunner._update_states`` (the CPU runner inherits it) hands both to
  every int4_kivi builder before the step's metadata is built.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm.s4kv")

NO_SLOT = -1


class StagingPoolExhausted(RuntimeError):
    """Every staging slot is held by an open block: a slot was not released (an engine bug, never a fallback)."""


class StagingAssignmentError(RuntimeError):
    """A sequence continues a block the pool holds no keys for."""


class SlotAssignment:
    """Slots of one staging pool, keyed by the physical id of the open block whose original keys they hold."""

    def __init__(self, num_slots: int, block_size: int):
        self.num_slots = num_slots
        self.block_size = block_size
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot is taken first
        self._slot_of_block = np.full(0, NO_SLOT, dtype=np.int32)  # indexed by physical block id

    @property
    def held(self) -> dict[int, int]:
        """block id -> slot, for every open block that holds a slot."""
        blocks = np.flatnonzero(self._slot_of_block >= 0)
        return {int(b): int(self._slot_of_block[b]) for b in blocks}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def release_blocks(self, block_ids: Iterable[int]) -> None:
        """Give back the slots recorded for these block ids (a finished or preempted request's blocks)."""
        self._release(np.fromiter((int(b) for b in block_ids), dtype=np.int64))

    def assign(self, context_lens: np.ndarray, query_lens: np.ndarray, block_table: np.ndarray) -> np.ndarray:
        """One step. Returns the slot every token of sequence ``i`` carries this step [num_seqs]: the slot of the
        block the step starts in when that block began earlier (the store's close reads its earlier keys there and
        attention reads them as the block's originals), else a new slot when the step ends inside a block, else -1.
        The slot is re-keyed to the block the step ends in; a slot whose block closes in this step is free from the
        next step on, so no other block is staged into it while this step still reads it."""
        bsz = self.block_size
        c = np.asarray(context_lens, dtype=np.int64)
        q = np.asarray(query_lens, dtype=np.int64)
        table = np.asarray(block_table)
        slots = np.full(len(q), NO_SLOT, dtype=np.int32)
        seqs = np.flatnonzero(q > 0)  # the rest are padding rows
        end = c[seqs] + q[seqs]
        self._grow(int(table[seqs].max()) + 1 if seqs.size else 0)

        cont = seqs[c[seqs] % bsz != 0]
        cont_blocks = table[cont, c[cont] // bsz]
        slots[cont] = self._slot_of_block[cont_blocks]
        missing = cont[slots[cont] < 0]
        if missing.size:
            i = int(missing[0])
            raise StagingAssignmentError(
                f"sequence {i} continues block {int(table[i, c[i] // bsz])} at offset {int(c[i] % bsz)}, but the "
                "staging pool holds no keys for it (a block begun outside this engine's steps cannot close per "
                "channel)")
        # blocks this step writes from offset 0 were freed and reallocated by vLLM if a slot is still recorded for them
        first = -(-c[seqs] // bsz)
        count = -(-end // bsz) - first
        rows = np.repeat(seqs, count)
        cols = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
        reallocated = table[rows, cols]
        ends_open = end % bsz != 0
        opens = seqs[ends_open]
        new = opens[slots[opens] < 0]
        available = len(self._free) + int((self._slot_of_block[reallocated] >= 0).sum())
        if new.size > available:
            raise StagingPoolExhausted(
                f"int4_kivi's staging pool has no free slot for sequence {int(new[available])}: all {self.num_slots} "
                f"slots are held by open blocks ({int((self._slot_of_block >= 0).sum())} recorded), so a finished or "
                "preempted request's slot was not released")

        self._slot_of_block[cont_blocks] = NO_SLOT
        self._release(reallocated)
        taken = self._free[len(self._free) - new.size:][::-1]
        del self._free[len(self._free) - new.size:]
        slots[new] = taken
        self._slot_of_block[table[opens, end[ends_open] // bsz]] = slots[opens]
        closing = seqs[~ends_open]
        self._free.extend(int(s) for s in slots[closing] if s >= 0)
        return slots

    def _grow(self, num_blocks: int) -> None:
        if num_blocks > self._slot_of_block.shape[0]:
            grown = np.full(max(num_blocks, 2 * self._slot_of_block.shape[0]), NO_SLOT, dtype=np.int32)
            grown[: self._slot_of_block.shape[0]] = self._slot_of_block
            self._slot_of_block = grown

    def _release(self, blocks: np.ndarray) -> None:
        blocks = blocks[blocks < self._slot_of_block.shape[0]]
        held = self._slot_of_block[blocks]
        self._free.extend(int(s) for s in held[held >= 0])
        self._slot_of_block[blocks] = NO_SLOT


class StagingBuffers:
    """A builder's slot assignment and its persistent per-token / per-sequence slot buffers on the device."""

    def __init__(self, num_slots: int, block_size: int, max_tokens: int, device: torch.device):
        self.slots = SlotAssignment(num_slots, block_size)
        pin = device.type == "cuda"
        self._token_host = torch.full((max_tokens,), NO_SLOT, dtype=torch.int32, pin_memory=pin)
        self._seq_host = torch.full((num_slots,), NO_SLOT, dtype=torch.int32, pin_memory=pin)
        self.staging_slots = self._token_host.to(device)
        self.sequence_slots = self._seq_host.to(device)
        self._block_table: np.ndarray | None = None  # set by the runner hook for the step about to be built

    def begin_step(self, block_table: np.ndarray, released_block_ids: Iterable[int]) -> None:
        """Called by the runner before a step's metadata is built: release finished/preempted requests' slots and
        remember the host block table of the batch (rows in the batch's order)."""
        self.slots.release_blocks(released_block_ids)
        self._block_table = block_table

    def build(self, num_tokens: int, num_seqs: int, query_start_loc_cpu: torch.Tensor,
              seq_lens_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's ``staging_slots`` [num_tokens] and ``sequence_slots`` [num_seqs] (views of the persistent
        buffers). A build the runner did not announce (a dummy, profiling or capture run, whose slot mapping is all
        -1) gets -1 everywhere and changes no assignment."""
        if num_tokens > self._token_host.shape[0] or num_seqs > self._seq_host.shape[0]:
            raise ValueError(f"a batch of {num_tokens} tokens and {num_seqs} sequences exceeds the staging buffers "
                             f"({self._token_host.shape[0]} tokens, {self._seq_host.shape[0]} sequences)")
        token_host = self._token_host.numpy()
        seq_host = self._seq_host.numpy()
        token_host[:num_tokens] = NO_SLOT
        seq_host[:num_seqs] = NO_SLOT
        if self._block_table is not None:
            block_table, self._block_table = self._block_table, None
            starts = query_start_loc_cpu[: num_seqs + 1].numpy()
            query_lens = np.diff(starts)
            context_lens = seq_lens_cpu[:num_seqs].numpy() - query_lens
            step_slots = self.slots.assign(context_lens, query_lens, block_table[:num_seqs])
            used = int(starts[-1])
            token_host[:used] = np.repeat(step_slots, query_lens)
            seq_host[:num_seqs] = step_slots
        self.staging_slots[:num_tokens].copy_(self._token_host[:num_tokens], non_blocking=True)
        self.sequence_slots[:num_seqs].copy_(self._seq_host[:num_seqs], non_blocking=True)
        return self.staging_slots[:num_tokens], self.sequence_slots[:num_seqs]


def block_closing_rows(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """The rows of a batch that write their block's last slot, ascending, int32 (the store's ``close_rows``).
    Sequence ``i`` has ``q = query_start_loc[i + 1] - query_start_loc[i]`` new tokens ending at ``seq_lens[i]``:
    row ``query_start_loc[i] + j`` holds position ``p = seq_lens[i] - q + j``, and closes when ``p % block_size ==
    block_size - 1``. The same rows as reference.closing_rows finds in the slot mapping, here from host lengths: the
    builder's slot mapping is on the device, and reading it back would wait for the GPU every step."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    ends = np.asarray(seq_lens, dtype=np.int64)
    first_pos = ends - np.diff(starts)
    closes = ends // block_size - first_pos // block_size  # per sequence: the multiples of block_size in (first, end]
    first_row = starts[:-1] + (block_size - 1 - first_pos) % block_size
    nth = np.arange(int(closes.sum())) - np.repeat(np.cumsum(closes) - closes, closes)
    return (np.repeat(first_row, closes) + nth * block_size).astype(np.int32)


def staging_builders(runner: Any) -> list[tuple[int, Any]]:
    """(kv cache group id, builder) for every builder of the runner that assigns staging slots."""
    found = []
    for groups in getattr(runner, "attn_groups", ()):
        for group in groups:
            for builder in group.metadata_builders:
                if getattr(builder, "staging", None) is not None:
                    found.append((group.kv_cache_group_id, builder))
    return found


def departed_requests(runner: Any, scheduler_output: Any) -> list[Any]:
    """The cached states (``CachedRequestState``) of the requests that leave the batch for good (finished, aborted)
    or until they are recomputed (preempted), read before the runner drops them."""
    gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
    return [runner.requests[r] for r in gone if r in runner.requests]


def announce_step(runner: Any, scheduler_output: Any, departed: list[Any]) -> None:
    """After the runner updated its batch: every staging builder releases the departed requests' slots and, for a
    step that runs the model (its metadata is built next), gets the batch's host block table."""
    for group_id, builder in staging_builders(runner):
        released = [block for state in departed for block in state.block_ids[group_id]]
        if scheduler_output.total_num_scheduled_tokens > 0:
            builder.staging.begin_step(runner.input_batch.block_table[group_id].block_table.np, released)
        else:
            builder.staging.slots.release_blocks(released)


def install_step_hook() -> None:
    """Wrap vLLM 0.26's V1 ``GPUModelRunner._update_states`` once per process (idempotent; the plugin's version
    gate, version.py, refuses every other vLLM before this runs)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states
    if getattr(original, "s4kv_staging_hook", False):
        return

    @functools.wraps(original)
    def _update_states(self, scheduler_output):
        departed = departed_requests(self, scheduler_output)
        result = original(self, scheduler_output)
        announce_step(self, scheduler_output, departed)
        return result

    _update_states.s4kv_staging_hook = True
    GPUModelRunner._update_states = _update_states
    logger.debug("S4 KV: int4_kivi staging slots follow GPUModelRunner._update_states")
