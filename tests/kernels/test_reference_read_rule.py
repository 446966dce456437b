"""The read rule of the torch reference's attention (kernels/reference.paged_attention, docs/format.md): for a query
at position p, values and int4_saw keys as stored per token; int4_kivi keys of the blocks before p's block per
channel, keys of p's own block the original keys (the step's own ``new_keys``, the staging pool's row for the
block's tokens written by earlier steps). So what a position sees depends on the tokens up to it alone, whatever
the steps' chunking or batching.

Checked against a float64 oracle written from the rule (quantizer round trips, no page, no store, one query at a
time): sequences stored step by step as the engine schedules them (prefills of several pages, chunks starting
inside a block, steps closing the block they start in and ending inside the next, decodes at offsets 127 and 0),
every step's store, attention and staging as the engine runs them, in a poisoned cache with spare pages and a pool
of NaN outside the rows written (and stale rows of the blocks a reused slot held before), at head_dim 64 and 128,
GQA groups 1, 3 and 7.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from kv_batches import NULL_BLOCK, poisoned_cache, random_keys, random_values

from s4kv.kernels import reference as ref
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import STAGE_BY_CALLER
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS

pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning")



@pytest.fixture(autouse=True)
def one_torch_thread():
    """The oracle and the reference are many small tensor ops, which one thread runs several times faster than
    two (no hand-off per op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


B = 128
KIVI = Int4Scheme("int4_kivi")
SAW = Int4Scheme("int4_saw")
SAW_ROTATED_VALUES = Int4Scheme("int4_saw", hadamard_block=32, rotate_values=True)
SOFTMAX_SCALE = 0.09
# per sequence, the tokens of each of its steps: a one-shot prefill of three pages; a chunk starting inside block 0
# and closing it; a prefill ending at offset 127, then decodes at offsets 127 (closing the block), 0 and 1; chunks of
# 48 over six pages (starting inside blocks, closing blocks); steps starting on block boundaries
HISTORIES = [[300], [100, 40, 1, 97], [127, 1, 1, 1], [48] * 14 + [3], [128, 128, 5, 1]]


@dataclass
class Sequence:
    keys: torch.Tensor  # every key of the sequence [n, Hkv, D], the model's dtype
    values: torch.Tensor
    queries: torch.Tensor  # [n, Hq, D]
    steps: list[int]
    blocks: list[int]  # the block table row
    stored: int = 0  # tokens written by the steps so far


@dataclass
class Engine:
    """A paged cache and staging pool of one layer, filled step by step as the engine does (runtime/plugin/staging.py):
    a sequence keeps one pool slot while it ends inside a block; a step carries it on every token (the slot of the
    block it starts in, else a free one when it ends inside a block), the store closes blocks from it, attention
    reads the start block's earlier keys from it, and only then are the keys of the block left open staged into it
    (re-keyed). A slot whose block closed is free from the next step on, for any sequence: the pool is NaN until
    written and then holds whatever its earlier blocks left there."""

    scheme: Int4Scheme
    cache: torch.Tensor
    staged_keys: torch.Tensor | None
    free_slots: list[int]
    slot_of_seq: dict[int, int] = field(default_factory=dict)

def make_sequences(gen, histories, num_q_heads, num_kv_heads, head_dim, dtype, spare_blocks=3):
    """Random K/V/queries per sequence and a shuffled block table; block 0 (block-table padding) and the spare
    blocks are never written."""
    lengths = [sum(steps) for steps in histories]
    num_blocks = 1 + sum(-(-n // B) for n in lengths) + spare_blocks
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    sequences = []
    for n, steps in zip(lengths, histories):
        used = -(-n // B)
        blocks, physical = physical[:used], physical[used:]
        sequences.append(Sequence(random_keys(gen, n, num_kv_heads, dtype, "cpu", head_dim),
                                  random_values(gen, n, num_kv_heads, dtype, "cpu", head_dim),
                                  torch.randn(n, num_q_heads, head_dim, generator=gen).to(dtype), list(steps), blocks))
    return sequences, num_blocks


def make_engine(gen, scheme, sequences, num_blocks, num_kv_heads, head_dim, dtype) -> Engine:
    num_slots = len(sequences) + 2
    pool = None
    if scheme.is_kivi:
        pool = torch.full((num_slots, num_kv_heads, B, head_dim), float("nan"), dtype=dtype)
    return Engine(scheme, poisoned_cache(num_blocks, num_kv_heads, B, gen, "cpu", head_dim), pool,
                  torch.randperm(num_slots, generator=gen).tolist())


@dataclass
class Step:
    seqs: list[int]
    chunk_starts: list[int]
    query: torch.Tensor
    new_keys: torch.Tensor
    out: torch.Tensor
    sequence_slots: torch.Tensor | None


def run_step(engine: Engine, sequences: list[Sequence], seqs: list[int], slot_override=None) -> Step:
    """The next chunk of each sequence in ``seqs``, batched in that order (plus two NaN padding rows): its store,
    its attention, the staging of the open blocks' keys. ``slot_override`` {seq: slot} replaces what attention gets
    as that sequence's slot."""
    keys, values, queries, slots, staging, seq_lens, q_lens, chunk_starts, seq_slots = ([] for _ in range(9))
    closed_slots = []
    for i in seqs:
        s = sequences[i]
        c = s.stored
        q = s.steps.pop(0)
        end = c + q
        positions = torch.arange(c, end)
        slot = engine.slot_of_seq.pop(i) if c % B else -1
        if slot < 0 and end % B:
            slot = engine.free_slots.pop()
        if end % B:
            engine.slot_of_seq[i] = slot
        elif slot >= 0:
            closed_slots.append(slot)
        keys.append(s.keys[c:end])
        values.append(s.values[c:end])
        queries.append(s.queries[c:end])
        slots.append(torch.tensor(s.blocks)[positions // B] * B + positions % B)
        staging.append(torch.full((q,), slot))
        seq_slots.append(slot_override[i] if slot_override and i in slot_override else slot)
        chunk_starts.append(c)
        seq_lens.append(end)
        q_lens.append(q)
        s.stored = end
    num_kv_heads, head_dim = keys[0].shape[1:]
    padding = torch.full((2, num_kv_heads, head_dim), float("nan"), dtype=keys[0].dtype)
    new_keys = torch.cat(keys + [padding])
    slot_mapping = torch.cat(slots + [torch.full((2,), -1)])
    staging_slots = torch.cat(staging + [torch.full((2,), -1)]).int()
    pool_args = {}
    if engine.scheme.is_kivi:
        ref.store_kv(new_keys, torch.cat(values + [padding]), engine.cache, slot_mapping, engine.scheme,
                     engine.staged_keys, staging_slots, stage=STAGE_BY_CALLER)
        pool_args = dict(staged_keys=engine.staged_keys, sequence_slots=torch.tensor(seq_slots, dtype=torch.int32))
    else:
        ref.store_kv(new_keys, torch.cat(values + [padding]), engine.cache, slot_mapping, engine.scheme)
    width = max(len(sequences[i].blocks) for i in seqs) + 1
    block_table = torch.full((len(seqs), width), NULL_BLOCK, dtype=torch.int32)
    for row, i in enumerate(seqs):
        block_table[row, : len(sequences[i].blocks)] = torch.tensor(sequences[i].blocks)
    query = torch.cat(queries)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = ref.paged_attention(query, engine.cache, block_table, torch.tensor(seq_lens, dtype=torch.int32),
                              query_start_loc, SOFTMAX_SCALE, engine.scheme, new_keys=new_keys, **pool_args)
    if engine.scheme.is_kivi:
        ref.stage_open_keys(new_keys, slot_mapping, engine.staged_keys, staging_slots)
    engine.free_slots.extend(closed_slots)  # a stack: the next new block takes the last freed slot
    return Step(list(seqs), chunk_starts, query, new_keys, out, pool_args.get("sequence_slots"))


# ---------------------------------------------------------------------------------------------------------------
# the oracle: the rule, one query at a time, float64
# ---------------------------------------------------------------------------------------------------------------
def per_token_round_trip(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """Per-token int4 round trip of x [n, Hkv, D], after ``rotation`` (rotated in float32 as the store does, so
    the codes are the store's) and back."""
    x = x.float() if rotation is None else x.float() @ rotation
    x_hat = ref.dequantize_per_token(*ref.quantize_per_token(x)).double()
    return x_hat if rotation is None else x_hat @ rotation.double().T


def per_channel_blocks(keys: torch.Tensor) -> torch.Tensor:
    """Every full block of keys [n, Hkv, D] through one per-channel round trip per block and head."""
    out = torch.full(keys.shape, float("nan"), dtype=torch.float64)
    for start in range(0, keys.shape[0] // B * B, B):
        for h in range(keys.shape[1]):
            out[start : start + B, h] = ref.dequantize_per_channel(
                *ref.quantize_per_channel(keys[start : start + B, h].float())).double()
    return out


def oracle(scheme: Int4Scheme, seq: Sequence, positions: range, missing_before: int = 0) -> torch.Tensor:
    """float64 attention of the queries at ``positions`` of one sequence under the read rule. ``missing_before``:
    the own-block keys at positions below it are unavailable (no pool slot), so a query that needs one is NaN."""
    head_dim = seq.keys.shape[-1]
    rotation = scheme.rotation(head_dim)
    values = per_token_round_trip(seq.values, rotation if scheme.rotate_values else None)
    stored_keys = per_channel_blocks(seq.keys) if scheme.is_kivi else per_token_round_trip(seq.keys, rotation)
    group = seq.queries.shape[1] // seq.keys.shape[1]
    out = []
    for p in positions:
        k = stored_keys[: p + 1].clone()
        if scheme.is_kivi:
            own = p // B * B
            k[own:] = seq.keys[own : p + 1].double()
            k[own:missing_before] = float("nan")
        k, v = k.repeat_interleave(group, 1), values[: p + 1].repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", seq.queries[p].double(), k) * SOFTMAX_SCALE
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def rows(step: Step, sequences, i: int) -> slice:
    at = step.seqs.index(i)
    start = sum(sequences[j].stored - step.chunk_starts[k] for k, j in enumerate(step.seqs[:at]))
    return slice(start, start + sequences[i].stored - step.chunk_starts[at])


def run_history(engine, sequences, check=True) -> dict[int, torch.Tensor]:
    """Every step until all sequences are written; per sequence, its outputs of all positions in order."""
    outputs = {i: [] for i in range(len(sequences))}
    while any(s.steps for s in sequences):
        step = run_step(engine, sequences, [i for i, s in enumerate(sequences) if s.steps])
        assert step.out.dtype == torch.float32 and step.out.shape == step.query.shape
        for at, i in enumerate(step.seqs):
            got = step.out[rows(step, sequences, i)]
            outputs[i].append(got)
            if check:
                positions = range(step.chunk_starts[at], sequences[i].stored)
                want = oracle(engine.scheme, sequences[i], positions)
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m: (
                    f"{engine.scheme.name} sequence {i}, positions {positions.start}-{positions.stop - 1}: {m}"))
    return {i: torch.cat(o) for i, o in outputs.items()}


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------
# int4_kivi in three head layouts (the rule's own-block cases are its), int4_saw in one; both head_dims each
LAYOUTS = [pytest.param(KIVI, q, kv, d, id=f"kivi-{q}q{kv}kv-d{d}")
           for q, kv, d in ((3, 3, 64), (6, 2, 128), (7, 1, 64), (7, 1, 128))]
LAYOUTS += [pytest.param(SAW, 6, 2, 128, id="saw-6q2kv-d128"),
            pytest.param(SAW_ROTATED_VALUES, 6, 2, 64, id="saw32-rotv-6q2kv-d64")]


@pytest.mark.parametrize("scheme, num_q_heads, num_kv_heads, head_dim", LAYOUTS)
def test_every_step_reads_what_the_rule_says(gen, scheme, head_dim, num_q_heads, num_kv_heads):
    dtype = torch.bfloat16 if head_dim == 64 else torch.float16
    sequences, num_blocks = make_sequences(gen, HISTORIES, num_q_heads, num_kv_heads, head_dim, dtype)
    engine = make_engine(gen, scheme, sequences, num_blocks, num_kv_heads, head_dim, dtype)
    run_history(engine, sequences)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("scheme", [KIVI, SAW], ids=["kivi", "saw"])
def test_what_a_position_sees_does_not_depend_on_the_steps(gen, scheme, head_dim):
    """The same three sequences written in other chunks (one-shot prefills, chunks of 48 or 200, decode steps),
    batched together or each alone: every position's output is the same."""
    lengths = [261, 130, 384]
    chunkings = {
        "prefill": [[n] for n in lengths],
        "chunks of 48": [[48] * (n // 48) + [n % 48] * bool(n % 48) for n in lengths],
        "chunks of 200, then decodes": [[200] + [1] * (n - 200) if n > 200 else [n] for n in lengths],
        "prefill 127, then decodes": [[127] + [1] * (n - 127) for n in lengths],
    }
    results = {}
    for name, histories in chunkings.items():
        sequences, num_blocks = make_sequences(torch.Generator().manual_seed(5), histories, 4, 2, head_dim,
                                               torch.bfloat16)
        engine = make_engine(gen, scheme, sequences, num_blocks, 2, head_dim, torch.bfloat16)
        results[name] = run_history(engine, sequences, check=name == "chunks of 48")
    sequences, num_blocks = make_sequences(torch.Generator().manual_seed(5), chunkings["prefill"], 4, 2, head_dim,
                                           torch.bfloat16)
    engine = make_engine(gen, scheme, sequences, num_blocks, 2, head_dim, torch.bfloat16)
    results["alone"] = {i: run_step(engine, sequences, [i]).out for i in range(len(lengths))}
    for name, outputs in results.items():
        for i in range(len(lengths)):
            torch.testing.assert_close(outputs[i], results["prefill"][i], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{scheme.name} {name}, sequence {i}: {m}")


def test_a_query_that_needs_a_pool_row_without_a_slot_is_nan(gen):
    """A chunk at positions 100-139 whose sequence has no slot: the queries at 100-127 read block 0's keys 0-99
    from the pool and are NaN; those at 128 onward see block 0 per channel and their own block's new keys, as the
    oracle says; the other sequences of the batch (a decode at offset 5, a prefill) are untouched."""
    sequences, num_blocks = make_sequences(gen, [[100, 40], [5, 1], [70]], 4, 2, 64, torch.float16)
    engine = make_engine(gen, KIVI, sequences, num_blocks, 2, 64, torch.float16)
    run_step(engine, sequences, [0, 1])
    step = run_step(engine, sequences, [0, 1, 2], slot_override={0: -1})
    got = step.out[rows(step, sequences, 0)]
    nan_rows = torch.isnan(got).any(-1)
    assert nan_rows.all(-1).tolist() == [p < 128 for p in range(100, 140)] and nan_rows.any(-1).equal(
        nan_rows.all(-1))
    want = oracle(KIVI, sequences[0], range(100, 140), missing_before=100)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, equal_nan=True)
    for i, positions in ((1, range(5, 6)), (2, range(0, 70))):
        torch.testing.assert_close(step.out[rows(step, sequences, i)].double(), oracle(KIVI, sequences[i], positions),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", [KIVI, SAW_ROTATED_VALUES], ids=["kivi", "saw32-rotv"])
def test_a_broken_value_poisons_only_the_queries_that_see_it(gen, scheme):
    """A NaN value (stored with a NaN scale) makes every query that sees it NaN, the earlier ones exact."""
    sequences, num_blocks = make_sequences(gen, [[70], [100, 40]], 8, 2, 128, torch.float16)
    sequences[0].values[30, 0, 5] = float("nan")
    sequences[1].values[120, 1, 7] = float("nan")
    engine = make_engine(gen, scheme, sequences, num_blocks, 2, 128, torch.float16)
    run_step(engine, sequences, [1])
    step = run_step(engine, sequences, [0, 1])
    for i, positions, first_broken in ((0, range(0, 70), 30), (1, range(100, 140), 120)):
        got = step.out[rows(step, sequences, i)]
        assert torch.isnan(got).any(-1).any(-1).tolist() == [p >= first_broken for p in positions]
        torch.testing.assert_close(got.double(), oracle(scheme, sequences[i], positions), rtol=1e-4, atol=1e-5,
                                   equal_nan=True)


def test_kivi_attention_needs_the_step_keys_and_the_pool(gen):
    sequences, num_blocks = make_sequences(gen, [[20]], 2, 2, 64, torch.float16)
    engine = make_engine(gen, KIVI, sequences, num_blocks, 2, 64, torch.float16)
    step = run_step(engine, sequences, [0])
    args = (step.query, engine.cache, torch.tensor([sequences[0].blocks], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32), SOFTMAX_SCALE, KIVI)
    pool = dict(staged_keys=engine.staged_keys, sequence_slots=step.sequence_slots)
    with pytest.raises(ValueError, match=r"int4_kivi attention needs the step's keys \(new_keys\)"):
        ref.paged_attention(*args, **pool)
    with pytest.raises(ValueError, match=r"int4_kivi needs its staging pool: staged_keys and sequence_slots"):
        ref.paged_attention(*args, new_keys=step.new_keys)
    with pytest.raises(ValueError, match=r"new_keys must be \[>= 20 tokens, 2, 64\] \(the step's keys\)"):
        ref.paged_attention(*args, new_keys=step.new_keys[:19], **pool)
    with pytest.raises(ValueError, match=r"new_keys must be \[>= 20 tokens, 2, 64\]"):
        ref.paged_attention(*args, new_keys=step.new_keys[:, :1], **pool)
