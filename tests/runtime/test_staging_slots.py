"""int4_kivi's staging-slot assignment (runtime/plugin/staging.py), step by step as the engine drives it: which slot
each token and sequence carries, re-keying to the block a step ends in, release on close, on finish/preemption and
when a block id is written from offset 0 again, and a loud failure when the pool runs out. The last tests check that
the slots the assignment hands the store make every closed page a function of its keys alone (the reference store),
and where the store may stage the open pages' keys in its own launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from s4kv.kernels import reference as ref
from s4kv.kernels.layout import cache_shape
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import (STAGE_AFTER_CLOSE, STAGE_BY_CALLER, STAGE_IN_STORE, allocate_pool,
                                  staging_overwrites_reads)
from s4kv.runtime.plugin.staging import (NO_SLOT, SlotAssignment, StagingAssignmentError, StagingBuffers,
                                         StagingPoolExhausted, announce_step, block_closing_rows, departed_requests)

BSZ = 128


def step(slots: SlotAssignment, contexts, queries, table):
    return slots.assign(np.array(contexts), np.array(queries), np.array(table))


def test_prefill_then_decode_keeps_one_slot_rekeyed_to_the_open_block():
    slots = SlotAssignment(4, BSZ)
    table = [[7, 3, 9]]
    assert step(slots, [0], [200], table).tolist() == [0] and slots.held == {3: 0}  # closes 7, ends inside 3
    for c in range(200, 255):  # decode inside block 3
        assert step(slots, [c], [1], table).tolist() == [0] and slots.held == {3: 0}
    # writes block 3's last slot: the step still carries the slot (attention reads the block's earlier keys from
    # it), and it is free from the next step on
    assert step(slots, [255], [1], table).tolist() == [0] and slots.held == {}
    assert slots.num_free == 4
    step_slots = step(slots, [256], [1], table)  # the first token of block 9 takes a slot again
    assert slots.held == {9: step_slots[0]}


def test_a_chunk_that_closes_and_opens_reuses_its_slot_and_aligned_steps_take_none():
    slots = SlotAssignment(2, BSZ)
    table = [[5, 6, 8, 2]]
    step(slots, [0], [100], table)
    step_slots = step(slots, [100], [250], table)  # closes 5 (staged rows in the slot), 6, opens 8
    assert step_slots.tolist() == [0] and slots.held == {8: 0}
    slots = SlotAssignment(2, BSZ)
    step_slots = step(slots, [0], [256], table)  # two whole blocks in one step: no slot at all
    assert step_slots.tolist() == [NO_SLOT] and slots.num_free == 2


def test_a_slot_freed_by_a_close_serves_another_sequence_from_the_next_step():
    slots = SlotAssignment(1, BSZ)
    step(slots, [0], [127], [[4]])
    step_slots = step(slots, [127, 0], [1, 0], [[4], [0]])  # sequence 0 closes its block
    assert step_slots.tolist() == [0, NO_SLOT]
    step_slots = step(slots, [128, 0], [0, 10], [[4, 1], [6, 0]])  # sequence 1 starts: the one slot is free
    assert step_slots.tolist() == [NO_SLOT, 0] and slots.held == {6: 0}


def test_a_slot_freed_by_a_close_is_not_taken_in_the_same_step():
    slots = SlotAssignment(2, BSZ)
    step(slots, [0, 0], [127, 5], [[4], [7]])
    slots.release_blocks([7])  # sequence 1 finished: one slot free besides sequence 0's
    # sequence 0 closes block 4 while two new sequences start a block each: its slot is still read this step
    with pytest.raises(StagingPoolExhausted, match="no free slot for sequence 2"):
        step(slots, [127, 0, 0], [1, 3, 3], [[4], [8], [9]])
    slots = SlotAssignment(2, BSZ)
    step(slots, [0], [127], [[4]])
    assert step(slots, [127, 0], [1, 3], [[4], [8]]).tolist() == [0, 1]


def test_finished_and_preempted_blocks_give_their_slots_back():
    slots = SlotAssignment(2, BSZ)
    step(slots, [0, 0], [10, 20], [[3], [4]])
    assert slots.num_free == 0
    with pytest.raises(StagingPoolExhausted, match="no free slot"):
        step(slots, [10, 20, 0], [1, 1, 5], [[3], [4], [5]])
    slots.release_blocks([4, 99])  # sequence 1 finished (and an id that holds no slot)
    assert slots.held == {3: 0}
    assert step(slots, [10, 0], [1, 5], [[3], [5]]).tolist() == [0, 1]


def test_a_block_written_from_offset_0_again_drops_its_stale_slot():
    slots = SlotAssignment(2, BSZ)
    step(slots, [0], [50], [[12]])  # block 12 open with slot 0; its request then vanishes unreleased
    step_slots = step(slots, [0], [300], [[30, 12, 13]])  # another request writes 12 from offset 0
    assert slots.held == {13: step_slots[0]} and slots.num_free == 1


def test_continuing_a_block_without_a_slot_fails_loudly():
    with pytest.raises(StagingAssignmentError, match="holds no keys"):
        step(SlotAssignment(2, BSZ), [64], [1], [[3]])


def test_buffers_fill_tokens_and_sequences_and_ignore_unannounced_builds():
    buffers = StagingBuffers(num_slots=4, block_size=BSZ, max_tokens=64, device=torch.device("cpu"))
    table = np.zeros((8, 4), dtype=np.int32)
    table[:3, 0] = [10, 11, 12]
    query_start = torch.tensor([0, 5, 6, 8, 8], dtype=torch.int32)  # the 4th row is CUDA-graph padding
    seq_lens = torch.tensor([5, 1, 2, 0], dtype=torch.int32)
    buffers.begin_step(table, [])
    tokens, seqs = buffers.build(10, 4, query_start, seq_lens)
    assert tokens.tolist() == [0] * 5 + [1] + [2, 2] + [NO_SLOT, NO_SLOT]
    assert seqs.tolist() == [0, 1, 2, NO_SLOT]
    address = buffers.staging_slots.data_ptr()
    held = buffers.slots.held
    tokens, seqs = buffers.build(10, 4, query_start, seq_lens)  # a dummy run: no step announced
    assert tokens.tolist() == [NO_SLOT] * 10 and seqs.tolist() == [NO_SLOT] * 4 and buffers.slots.held == held
    assert tokens.data_ptr() == address  # the persistent buffer, as full CUDA graphs replay it


def test_the_runner_hook_releases_finished_and_preempted_requests_and_announces_the_step():
    from types import SimpleNamespace as NS

    buffers = StagingBuffers(num_slots=3, block_size=BSZ, max_tokens=16, device=torch.device("cpu"))
    buffers.slots.assign(np.array([0, 0, 0]), np.array([5, 6, 7]), np.array([[3], [4], [5]]))
    table = np.array([[5, 0], [9, 0]], dtype=np.int32)
    runner = NS(attn_groups=[[NS(kv_cache_group_id=0, metadata_builders=[NS(staging=buffers), NS()])]],
                requests={"done": NS(block_ids=([3],)), "preempted": NS(block_ids=([4],)),
                          "running": NS(block_ids=([5],))},
                input_batch=NS(block_table=[NS(block_table=NS(np=table))]))
    output = NS(finished_req_ids={"done", "unknown"}, preempted_req_ids={"preempted"}, total_num_scheduled_tokens=0)
    departed = departed_requests(runner, output)
    announce_step(runner, output, departed)  # a step without tokens: releases, announces nothing
    assert buffers.slots.held == {5: 2}
    assert buffers.build(2, 2, torch.tensor([0, 1, 2]), torch.tensor([8, 1]))[0].tolist() == [NO_SLOT] * 2
    announce_step(runner, NS(finished_req_ids=set(), preempted_req_ids=None, total_num_scheduled_tokens=2), [])
    tokens, seqs = buffers.build(2, 2, torch.tensor([0, 1, 2]), torch.tensor([8, 1]))
    # the running request continues slot 2, a new one takes a released slot
    assert tokens[0] == 2 and tokens[1] in (0, 1) and seqs.tolist() == tokens.tolist()


def test_block_closing_rows_of_a_mixed_batch():
    # a decode at position 127, a decode at 500, a 200-token chunk from 100 (positions 127 and 255), a padding
    # sequence of no tokens, a prefill of 5, a 256-token prefill (127, 255)
    query_start = np.array([0, 1, 2, 202, 202, 207, 463])
    seq_lens = np.array([128, 501, 300, 40, 5, 256])
    rows = block_closing_rows(query_start, seq_lens, BSZ)
    assert rows.dtype == np.int32 and rows.tolist() == [0, 2 + 27, 2 + 155, 207 + 127, 207 + 255]
    assert block_closing_rows(np.array([0, 1, 2]), np.array([300, 17]), BSZ).size == 0
    assert block_closing_rows(np.array([0]), np.array([], dtype=np.int64), BSZ).size == 0


@pytest.mark.parametrize("block_size", [BSZ, 16])
def test_block_closing_rows_match_a_loop_over_every_token(block_size):
    rng = np.random.default_rng(block_size)
    for _ in range(300):
        num_seqs = int(rng.integers(1, 10))
        query_lens = rng.choice([0, 1, 1, 1, 2, 15, 16, 17, 127, 128, 129, 300], num_seqs)
        contexts = rng.integers(0, 700, num_seqs)
        query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        seq_lens = (contexts + query_lens).astype(np.int32)
        expected = [int(query_start[i]) + j for i in range(num_seqs) for j in range(int(query_lens[i]))
                    if (contexts[i] + j) % block_size == block_size - 1]
        rows = block_closing_rows(query_start, seq_lens, block_size)
        assert rows.dtype == np.int32 and rows.tolist() == expected


def test_a_kivi_builder_owns_the_buffers_and_a_saw_builder_none(tmp_path):
    from test_backend_metadata import make_builder

    from model_configs import QWEN25_7B, write_model_dir

    model_dir = write_model_dir(tmp_path, "qwen", QWEN25_7B)
    kivi = make_builder(model_dir, None, scheme="int4_kivi")
    assert kivi.staging.slots.num_slots == kivi.vllm_config.scheduler_config.max_num_seqs
    assert kivi.staging.staging_slots.shape[0] == kivi.vllm_config.scheduler_config.max_num_batched_tokens
    assert make_builder(model_dir, None).staging is None


def test_the_assigned_slots_make_pages_a_function_of_their_keys():
    """Two sequences through the reference store, with the slots the assignment gives: in one batch with one
    prefill each, and as uneven chunks then decode steps, interleaved, in other pages, with a preemption (release
    and recompute) in between. The closed pages must hold identical bytes."""
    torch.manual_seed(0)
    scheme, heads, dim, length = Int4Scheme("int4_kivi"), 2, 64, 300
    keys = [torch.randn(length, heads, dim, dtype=torch.float16) for _ in range(2)]
    values = [torch.randn(length, heads, dim, dtype=torch.float16) for _ in range(2)]

    def run(schedule, tables):
        """schedule: list of steps, each a list of (sequence, context, query); tables: block ids per sequence."""
        cache = torch.randint(0, 256, cache_shape(16, heads, BSZ, dim), dtype=torch.uint8)
        pool = allocate_pool(2, heads, BSZ, dim, torch.float16, "cpu").fill_(float("nan"))
        slots = SlotAssignment(2, BSZ)
        for entries in schedule:
            if entries == "preempt 1":  # sequence 1 loses its pages; it is recomputed from token 0
                slots.release_blocks(tables[1])
                continue
            table = np.array([tables[s] for s, _, _ in entries])
            step_slots = slots.assign(np.array([c for _, c, _ in entries]), np.array([q for _, _, q in entries]),
                                      table)
            key = torch.cat([keys[s][c:c + q] for s, c, q in entries])
            value = torch.cat([values[s][c:c + q] for s, c, q in entries])
            mapping = torch.cat([torch.tensor([tables[s][p // BSZ] * BSZ + p % BSZ for p in range(c, c + q)])
                                 for s, c, q in entries])
            staging = torch.from_numpy(np.repeat(step_slots, [q for _, _, q in entries]))
            ref.store_kv(key, value, cache, mapping, scheme, pool, staging)
        return cache

    one_batch = run([[(0, 0, length), (1, 0, length)]], {0: [0, 1, 2], 1: [3, 4, 5]})
    chunks = [[(0, 0, 70)], [(0, 70, 100), (1, 0, 129)], "preempt 1",
              [(1, 0, 7)], [(1, 7, 200), (0, 170, 80)]] + [[(0, 250 + i, 1), (1, 207 + i, 1)] for i in range(50)]
    pressured = run(chunks, {0: [9, 10, 11], 1: [14, 12, 13]})
    for s, (a, b) in enumerate([([0, 1], [9, 10]), ([3, 4], [14, 12])]):
        assert torch.equal(one_batch[a], pressured[b]), f"sequence {s}: closed pages differ"


def run_three_steps(stage_of_step) -> tuple[torch.Tensor, torch.Tensor]:
    """One int4_kivi sequence stored in three steps (ends inside block 3; closes it and ends inside block 1; one
    decode), each stored as ``stage_of_step(first position, new tokens)`` says: a store_kv stage, or "after
    attention" (the store stages nothing, then stage_open_keys). Returns the cache and the pool."""
    torch.manual_seed(1)
    scheme, heads, dim = Int4Scheme("int4_kivi"), 2, 64
    key, value = (torch.randn(300, heads, dim, dtype=torch.float16) for _ in range(2))
    table = np.array([[3, 1, 5]])
    slots = SlotAssignment(2, BSZ)
    cache = torch.randint(0, 256, cache_shape(8, heads, BSZ, dim), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(2))
    pool = allocate_pool(2, heads, BSZ, dim, torch.float16, "cpu").fill_(float("nan"))
    for c, q in ((0, 100), (100, 150), (250, 1)):
        step_slots = slots.assign(np.array([c]), np.array([q]), table)
        mapping = torch.tensor([int(table[0, p // BSZ]) * BSZ + p % BSZ for p in range(c, c + q)])
        staging = torch.from_numpy(np.repeat(step_slots, [q]))
        stage = stage_of_step(c, q)
        if stage == "after attention":
            before = pool.clone()
            ref.store_kv(key[c:c + q], value[c:c + q], cache, mapping, scheme, pool, staging, stage=STAGE_BY_CALLER)
            assert torch.equal(pool.isnan(), before.isnan()) and torch.equal(pool.nan_to_num(), before.nan_to_num())
            ref.stage_open_keys(key[c:c + q], mapping, pool, staging)
        else:
            ref.store_kv(key[c:c + q], value[c:c + q], cache, mapping, scheme, pool, staging, stage=stage)
    return cache, pool.nan_to_num(7.0)


def engine_stage(c: int, q: int) -> str:
    """The backend's choice (S4KVMetadata.stage_in_store) for a one-sequence step."""
    return "after attention" if staging_overwrites_reads([0, q], [c + q], BSZ) else STAGE_IN_STORE


def test_the_engine_staging_gives_the_bytes_of_the_store_that_stages_after_its_closes():
    """The engine stages in the store's launch where the step's staging overwrites no pool row it reads, else after
    attention (the store stages nothing, the pool keeps the rows attention reads): the same cache and pool as a
    store that stages after its closes, every step."""
    assert [engine_stage(c, q) for c, q in ((0, 100), (100, 150), (250, 1))] == [
        STAGE_IN_STORE, "after attention", STAGE_IN_STORE]
    engine = run_three_steps(engine_stage)
    after_close = run_three_steps(lambda c, q: STAGE_AFTER_CLOSE)
    assert torch.equal(engine[0], after_close[0]) and torch.equal(engine[1], after_close[1])


def test_staging_in_the_store_where_it_overwrites_reads_would_close_the_block_from_the_wrong_keys():
    """Why the engine checks: the second step starts inside block 3 and ends inside block 1, re-keying the slot;
    staged before the close, block 1's first rows overwrite the rows block 3's close reads as its originals."""
    in_store = run_three_steps(lambda c, q: STAGE_IN_STORE)
    after_close = run_three_steps(lambda c, q: STAGE_AFTER_CLOSE)
    assert not torch.equal(in_store[0][3], after_close[0][3])  # block 3, closed in the second step
    assert torch.equal(in_store[0][1], after_close[0][1]) and torch.equal(in_store[1], after_close[1])


