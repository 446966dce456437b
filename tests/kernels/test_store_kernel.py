"""The Triton store kernel (kernels/store.py) against the torch reference, byte for byte.

Without CUDA it runs under the Triton interpreter (set up in conftest.py), fp16 only, small shapes: about a
minute of CI. With CUDA the same tests run the compiled kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kv_batches import (HEAD_DIM, assert_caches_match, cache_with_prefix, make_paged_batch, poisoned_cache,
                        random_keys, scheme_head_dims)

from s4kv.kernels import reference as ref
from s4kv.kernels import store
from s4kv.runtime.plugin.staging import block_closing_rows
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import (STAGE_BY_CALLER, STAGE_IN_STORE, allocate_pool, sequence_staging_slots,
                                  staging_overwrites_reads)
from s4kv.kernels.store import store_kv

SCHEMES = {
    "kivi": Int4Scheme("int4_kivi"),
    "saw128": Int4Scheme("int4_saw", 128),
    "saw64-rotv": Int4Scheme("int4_saw", 64, rotate_values=True),
    "saw32": Int4Scheme("int4_saw", 32),
    "saw32-rotv": Int4Scheme("int4_saw", 32, rotate_values=True),
}
# (context, q_len): prefills that fill and close blocks, chunks over cached prefixes, decodes at block edges
BATCHES = {
    "mixed": [(0, 150), (127, 1), (60, 80), (3, 1), (128, 1)],
    "decode": [(126, 1), (127, 1), (0, 1), (255, 1), (40, 1)],
    "prefill": [(0, 256), (0, 17)],
}


def store_both(batch, scheme, gen, device):
    """(kernel cache, reference cache, cache before) after storing the batch's new tokens over its prefix."""
    before = cache_with_prefix(batch, scheme, gen, device)
    expected = before.clone()
    ref.store_kv(batch.key, batch.value, expected, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    actual = before.clone()
    store_kv(batch.key, batch.value, actual, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    return actual, expected, before


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("scheme_name,head_dim", scheme_head_dims(SCHEMES))
def test_store_kernel_matches_reference(gen, kernel_device, scheme_name, head_dim, batch_name):
    scheme = SCHEMES[scheme_name]
    num_kv_heads = {"mixed": 2, "decode": 3, "prefill": 1}[batch_name]
    batch = make_paged_batch(gen, BATCHES[batch_name], num_q_heads=num_kv_heads, num_kv_heads=num_kv_heads,
                             block_size=128, dtype=torch.float16, device=kernel_device, num_padding=3,
                             head_dim=head_dim)
    actual, expected, before = store_both(batch, scheme, gen, kernel_device)
    assert_caches_match(actual, expected, before, batch.slot_mapping, scheme, head_dim=head_dim)


@pytest.mark.parametrize("scheme_name", ["saw128", "saw32-rotv"])
def test_store_kernel_small_pages(gen, kernel_device, scheme_name):
    """int4_saw works with any block size that is a multiple of 16 (vLLM uses 128)."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, [(0, 70), (20, 13), (31, 1)], num_q_heads=2, num_kv_heads=2, block_size=16,
                             dtype=torch.float16, device=kernel_device, num_padding=2)
    actual, expected, before = store_both(batch, scheme, gen, kernel_device)
    assert_caches_match(actual, expected, before, batch.slot_mapping, scheme)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_store_kernel_kivi_decode_steps_close_a_block(gen, kernel_device, head_dim):
    """Decode steps across a block edge, each from the reference's state: staging, the close, the next block."""
    scheme = SCHEMES["kivi"]
    batch = make_paged_batch(gen, [(124, 8), (250, 8)], num_q_heads=2, num_kv_heads=2, block_size=128,
                             dtype=torch.float16, device=kernel_device, head_dim=head_dim)
    state = cache_with_prefix(batch, scheme, gen, kernel_device)
    pool = batch.staged_keys
    staging = torch.tensor([0, 1], device=kernel_device)  # sequence i stages into slot i (batch.prefix_staging)
    for step in range(8):
        rows = torch.tensor([step, 8 + step])  # one new token per sequence, as vLLM schedules a decode
        key, value, slots = batch.key[rows], batch.value[rows], batch.slot_mapping[rows]
        actual, actual_pool = state.clone(), pool.clone()
        store_kv(key, value, actual, slots, scheme, staged_keys=actual_pool, staging_slots=staging)
        expected, expected_pool = state.clone(), pool.clone()
        ref.store_kv(key, value, expected, slots, scheme, staged_keys=expected_pool, staging_slots=staging)
        assert_caches_match(actual, expected, state, slots, scheme, head_dim=head_dim)
        assert torch.equal(actual_pool.view(torch.int16), expected_pool.view(torch.int16)), f"pool after {step}"
        state, pool = expected, expected_pool


@pytest.mark.parametrize("scheme_name", ["kivi", "saw64-rotv"])
def test_store_kernel_takes_strided_key_and_value(gen, kernel_device, scheme_name):
    """vLLM hands key/value as views into the fused qkv projection output: token stride != heads * 128."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, [(0, 130), (5, 3)], num_q_heads=2, num_kv_heads=2, block_size=128,
                             dtype=torch.float16, device=kernel_device, num_padding=1)
    qkv = torch.randn(batch.key.shape[0], 8, HEAD_DIM, generator=gen).to(kernel_device, torch.float16)
    qkv[:, 4:6], qkv[:, 6:8] = batch.key, batch.value
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    assert not key.is_contiguous()
    before = cache_with_prefix(batch, scheme, gen, kernel_device)
    actual, expected = before.clone(), before.clone()
    store_kv(key, value, actual, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    ref.store_kv(batch.key, batch.value, expected, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    assert_caches_match(actual, expected, before, batch.slot_mapping, scheme)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, on purpose
@pytest.mark.parametrize("scheme_name", ["kivi", "saw128"])
def test_store_kernel_marks_nonfinite_tokens_with_a_nan_scale(gen, kernel_device, scheme_name):
    scheme = SCHEMES[scheme_name]
    num_heads = 2
    key = random_keys(gen, 6, num_heads, torch.float16, kernel_device)
    value = random_keys(gen, 6, num_heads, torch.float16, kernel_device)
    key[1, 0, 3] = float("inf")
    value[4, 1, 100] = float("nan")
    slots = torch.tensor([5, 6, 7, 300, 301, 302], device=kernel_device)
    before = poisoned_cache(4, num_heads, 128, gen, kernel_device)
    actual, expected = before.clone(), before.clone()
    staging = {}
    if scheme.is_kivi:  # two sequences of three tokens
        pool = allocate_pool(2, num_heads, 128, HEAD_DIM, torch.float16, kernel_device)
        staging = dict(staged_keys=pool, staging_slots=sequence_staging_slots([3, 3], kernel_device))
    store_kv(key, value, actual, slots, scheme, **staging)
    ref.store_kv(key, value, expected, slots, scheme, **staging)
    assert_caches_match(actual, expected, before, slots, scheme)
    pages = ref.PageViews(actual, HEAD_DIM)
    assert torch.isnan(pages.k_params[0, 0, 6, 0]) and torch.isfinite(pages.k_params[0, 1, 6, 0])
    assert torch.isnan(pages.v_params[2, 1, 45, 0]) and torch.isfinite(pages.v_params[2, 0, 45, 0])


def test_store_kernel_all_padding_changes_nothing(gen, kernel_device):
    key = torch.full((5, 2, HEAD_DIM), float("nan"), dtype=torch.float16, device=kernel_device)
    cache = poisoned_cache(3, 2, 128, gen, kernel_device)
    before = cache.clone()
    pool = torch.full((1, 2, 128, HEAD_DIM), float("nan"), dtype=torch.float16, device=kernel_device)
    for scheme in (SCHEMES["kivi"], SCHEMES["saw32-rotv"]):
        staging = dict(staged_keys=pool, staging_slots=torch.full((5,), -1, device=kernel_device)) \
            if scheme.is_kivi else {}
        store_kv(key, key, cache, torch.full((5,), -1, device=kernel_device), scheme, **staging)
        store_kv(key[:0], key[:0], cache, torch.zeros(0, dtype=torch.long, device=kernel_device), scheme, **staging)
    assert torch.equal(cache, before)
    assert torch.isnan(pool).all()


def test_bad_inputs_get_clear_errors(kernel_device):
    cache = torch.zeros(3, 2, 64 * 136, dtype=torch.uint8, device=kernel_device)
    slots = torch.zeros(1, dtype=torch.long, device=kernel_device)
    for head_dim, error in ((96, "support head_dim 64 and 128, got 96"),
                            (64, r"must be \[blocks, kv_heads, block_size \* 72\] for head_dim 64")):
        key = torch.zeros(1, 2, head_dim, dtype=torch.float16, device=kernel_device)
        with pytest.raises(ValueError, match=error):
            store_kv(key, key, cache, slots, SCHEMES["saw32"])
    key = torch.zeros(1, 2, HEAD_DIM, dtype=torch.float16, device=kernel_device)
    with pytest.raises(ValueError, match="int4_kivi needs block_size 128"):
        store_kv(key, key, cache, slots, SCHEMES["kivi"])
    with pytest.raises(ValueError, match=r"key/value must be \[T, Hkv, head_dim\]"):
        store_kv(key, key[..., :64], cache, slots, SCHEMES["kivi"])
    cache64 = torch.zeros(3, 2, 128 * 72, dtype=torch.uint8, device=kernel_device)
    with pytest.raises(ValueError, match="hadamard_block 128 does not divide head_dim 64"):
        store_kv(key[..., :64], key[..., :64], cache64, slots, SCHEMES["saw128"])
    cache128 = torch.zeros(3, 2, 128 * 136, dtype=torch.uint8, device=kernel_device)
    pool = allocate_pool(1, 2, 128, HEAD_DIM, torch.float16, kernel_device)
    with pytest.raises(ValueError, match="int4_kivi needs its staging pool: staged_keys and staging_slots"):
        store_kv(key, key, cache128, slots, SCHEMES["kivi"])
    with pytest.raises(ValueError, match="int4_kivi needs its staging pool"):
        store_kv(key, key, cache128, slots, SCHEMES["kivi"], staged_keys=pool)
    with pytest.raises(ValueError, match="int4_saw takes no staging pool"):
        store_kv(key, key, cache128, slots, SCHEMES["saw128"], staged_keys=pool, staging_slots=slots)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_store_kernel_kivi_staging_matches_reference(gen, kernel_device, head_dim):
    """Two sequences with staging slots through chunks and decode steps that close blocks begun in earlier batches,
    a chunk that closes one block and opens the next in the same slot, and padding rows: after every step the
    kernel's cache matches the reference's and its pool is bit-identical."""
    scheme = SCHEMES["kivi"]
    num_heads = 2
    lengths = {0: 300, 1: 260}
    blocks = {0: [3, 7, 1], 1: [5, 2, 8]}
    keys = {s: random_keys(gen, n, num_heads, torch.float16, kernel_device, head_dim) for s, n in lengths.items()}
    values = {s: random_keys(gen, n, num_heads, torch.float16, kernel_device, head_dim) for s, n in lengths.items()}
    # (sequence, start, stop) per step; sequence s owns staging slot 2 - s (slot 1 is never used: stays poison)
    steps = [[(0, 0, 100), (1, 0, 30)], [(0, 100, 101), (1, 30, 200)], [(0, 101, 128), (1, 200, 201)],
             [(0, 128, 250), (1, 201, 202)], [(1, 202, 260), (0, 250, 251)], [(0, 251, 300)]]
    state = poisoned_cache(9, num_heads, 128, gen, kernel_device, head_dim)
    pool = torch.randn(3, num_heads, 128, head_dim, generator=gen).to(kernel_device, torch.float16) * 1e3
    nan_row = torch.full((1, num_heads, head_dim), float("nan"), dtype=torch.float16, device=kernel_device)
    for step in steps:
        key = torch.cat([torch.cat([keys[s][a:b], nan_row]) for s, a, b in step])
        value = torch.cat([torch.cat([values[s][a:b], nan_row]) for s, a, b in step])
        pos = [torch.arange(a, b) for _, a, b in step]
        slots = torch.cat([torch.cat([torch.tensor(blocks[s])[p // 128] * 128 + p % 128, torch.tensor([-1])])
                           for (s, _, _), p in zip(step, pos)]).to(kernel_device)
        staging = torch.cat([torch.full((b - a + 1,), 2 - s) for s, a, b in step]).to(kernel_device)
        actual, expected = state.clone(), state.clone()
        actual_pool, expected_pool = pool.clone(), pool.clone()
        store_kv(key, value, actual, slots, scheme, staged_keys=actual_pool, staging_slots=staging)
        ref.store_kv(key, value, expected, slots, scheme, staged_keys=expected_pool, staging_slots=staging)
        assert_caches_match(actual, expected, state, slots, scheme, head_dim=head_dim)
        assert torch.equal(actual_pool.view(torch.int16), expected_pool.view(torch.int16)), f"pool after {step}"
        state, pool = expected, expected_pool


def test_store_kernel_kivi_close_without_a_staging_slot_is_poisoned(gen, kernel_device):
    """A block begun in an earlier batch whose closing token has no slot (an assignment bug): NaN scales, so the
    broken page shows up in attention instead of plausible numbers (the reference raises)."""
    scheme = SCHEMES["kivi"]
    key = random_keys(gen, 128, 1, torch.float16, kernel_device, 64)
    cache = poisoned_cache(2, 1, 128, gen, kernel_device, 64)
    pool = torch.zeros(1, 1, 128, 64, dtype=torch.float16, device=kernel_device)
    slots = torch.arange(128, 256, device=kernel_device)
    store_kv(key[:100], key[:100], cache, slots[:100], scheme, staged_keys=pool, staging_slots=torch.zeros(
        100, dtype=torch.long, device=kernel_device))
    store_kv(key[100:], key[100:], cache, slots[100:], scheme, staged_keys=pool, staging_slots=torch.full(
        (28,), -1, device=kernel_device))
    assert torch.isnan(ref.PageViews(cache, 64).k_params[1, 0, :64, 0]).all()


class Launches:
    """Stands in for a kernel of kernels/store.py and records the grid of every launch."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch) -> dict[str, Launches]:
    """The store's kernels by name, each recording its launches."""
    recorders = {}
    for name in ("_store_per_token_kernel", "_kivi_close_kernel", "_kivi_stage_kernel"):
        recorders[name] = Launches(getattr(store, name))
        monkeypatch.setattr(store, name, recorders[name])
    return recorders


def grids(launches: dict[str, Launches]) -> dict[str, list[tuple]]:
    """The grids launched since the last call, per kernel (and forget them)."""
    taken = {name: recorder.grids for name, recorder in launches.items()}
    for recorder in launches.values():
        recorder.grids = []
    return taken


@pytest.mark.parametrize("scheme_name,head_dim", scheme_head_dims({n: SCHEMES[n] for n in ("kivi", "saw32-rotv")}))
def test_keys_and_values_are_stored_in_one_launch(gen, kernel_device, launches, scheme_name, head_dim):
    """One per-token program per 16 rows and KV head stores both K and V: an odd batch over many pages, padding
    rows included, gives the reference's bytes; int4_kivi then closes (a program per row) and stages."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, [(0, 37), (126, 3), (300, 1), (5, 130)], num_q_heads=3, num_kv_heads=3,
                             block_size=128, dtype=torch.float16, device=kernel_device, num_padding=3,
                             head_dim=head_dim, spare_blocks=5)
    actual, expected, before = store_both(batch, scheme, gen, kernel_device)
    assert_caches_match(actual, expected, before, batch.slot_mapping, scheme, head_dim=head_dim)
    rows = batch.key.shape[0]
    assert rows == 174
    expected_grids = {"_store_per_token_kernel": [(11, 3)], "_kivi_close_kernel": [], "_kivi_stage_kernel": []}
    if scheme.is_kivi:  # step_staging stores with stage "by_caller"
        expected_grids["_kivi_close_kernel"] = [(rows, 3)]
    assert grids(launches) == expected_grids


# (sequence, first position, end) per step, stored in vLLM's order (sequences one after the other, CUDA-graph
# padding rows at the end); a sequence's tokens stage into its own pool slot
CLOSE_STEPS = [
    [("a", 0, 100), ("b", 0, 30)],  # two prefills, no block closes: no close launch at all
    [("a", 100, 101), ("b", 30, 200), ("c", 0, 129)],  # b continues its open block from the pool and closes it
    [("b", 200, 201), ("a", 101, 256), ("d", 0, 127)],  # a closes two blocks, its first from the pool
    [("a", 256, 257), ("c", 129, 140), ("b", 201, 255)],  # decodes and a chunk that stops one short of a close
    [("b", 255, 256), ("d", 127, 128), ("a", 257, 258), ("c", 140, 141)],  # two decodes close a block each
    [("c", 141, 300), ("d", 128, 129), ("b", 256, 260)],  # a chunk closes a block begun by decodes
]


class CloseSteps:
    """CLOSE_STEPS' sequences over a poisoned cache and pool: blocks 0, 6, 8, 10 and pool slots 1 and 5 are never
    written, and three NaN padding rows end every step."""

    lengths = {"a": 258, "b": 260, "c": 300, "d": 129}
    blocks = {"a": [9, 2, 14], "b": [5, 11, 1], "c": [7, 3, 12], "d": [13, 4]}
    pool_slots = {"a": 3, "b": 0, "c": 4, "d": 2}
    num_heads, num_padding = 2, 3

    def __init__(self, gen, device, head_dim: int):
        self.device = device
        self.keys = {s: random_keys(gen, n, self.num_heads, torch.float16, device, head_dim)
                     for s, n in self.lengths.items()}
        self.values = {s: random_keys(gen, n, self.num_heads, torch.float16, device, head_dim)
                       for s, n in self.lengths.items()}
        self.nan_rows = torch.full((self.num_padding, self.num_heads, head_dim), float("nan"), dtype=torch.float16,
                                   device=device)
        self.cache = poisoned_cache(15, self.num_heads, 128, gen, device, head_dim)
        self.pool = torch.randn(6, self.num_heads, 128, head_dim, generator=gen).to(device, torch.float16) * 1e3
        self.pool[1, :, 5:9] = float("nan")

    def batch(self, step) -> SimpleNamespace:
        """One step: store_kv's arguments (key, value, slots: the slot mapping, staging: the staging slots), its host
        lengths (query_start_loc, seq_lens) and the closing rows the builder would list from them (close_rows)."""
        padding = torch.full((self.num_padding,), -1)
        positions = [torch.arange(a, b) for _, a, b in step]
        query_start_loc = np.cumsum([0] + [b - a for _, a, b in step])
        seq_lens = np.array([b for _, _, b in step])
        return SimpleNamespace(
            key=torch.cat([self.keys[s][a:b] for s, a, b in step] + [self.nan_rows]),
            value=torch.cat([self.values[s][a:b] for s, a, b in step] + [self.nan_rows]),
            slots=torch.cat([torch.tensor(self.blocks[s])[p // 128] * 128 + p % 128
                             for (s, _, _), p in zip(step, positions)] + [padding]).to(self.device),
            staging=torch.cat([torch.full((b - a,), self.pool_slots[s]) for s, a, b in step]
                              + [padding]).to(self.device),
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            close_rows=torch.from_numpy(block_closing_rows(query_start_loc, seq_lens, 128)).to(self.device),
        )


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_kivi_close_over_listed_rows_matches_the_close_over_every_row(gen, kernel_device, launches, head_dim):
    """Step by step from one state, the close over the rows block_closing_rows lists (what the engine's builder
    passes for a step with prefill) writes the same cache and pool bytes as the close over every row, which match
    the reference's; it launches one program per listed row and KV head, none when no block closes."""
    scheme = SCHEMES["kivi"]
    steps = CloseSteps(gen, kernel_device, head_dim)
    state, pool = steps.cache, steps.pool
    closes = []
    for step in CLOSE_STEPS:
        b = steps.batch(step)
        key, value, slots, staging, rows = b.key, b.value, b.slots, b.staging, b.close_rows
        assert rows.tolist() == ref.closing_rows(slots.cpu(), 128).tolist()
        stores = {}
        for name, close_rows in (("every row", None), ("listed rows", rows)):
            cache, staged = state.clone(), pool.clone()
            store_kv(key, value, cache, slots, scheme, staged_keys=staged, staging_slots=staging,
                     close_rows=close_rows)
            stores[name] = cache, staged
            grid = (key.shape[0] if close_rows is None else len(rows), steps.num_heads)
            assert grids(launches)["_kivi_close_kernel"] == ([grid] if grid[0] else []), f"{name}, {step}"
        expected, expected_pool = state.clone(), pool.clone()
        ref.store_kv(key, value, expected, slots, scheme, staged_keys=expected_pool, staging_slots=staging)
        (every, every_pool), (listed, listed_pool) = stores["every row"], stores["listed rows"]
        assert torch.equal(listed, every), f"cache after {step}"
        assert torch.equal(listed_pool.view(torch.int16), every_pool.view(torch.int16)), f"pool after {step}"
        assert_caches_match(listed, expected, state, slots, scheme, head_dim=head_dim)
        assert torch.equal(listed_pool.view(torch.int16), expected_pool.view(torch.int16)), f"pool after {step}"
        state, pool = expected, expected_pool
        closes.append(len(rows))
    assert closes == [0, 2, 2, 0, 2, 1]  # as CLOSE_STEPS describes


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_kivi_staging_in_the_store_launch(gen, kernel_device, launches, head_dim):
    """Step by step, as the engine's eager steps store: the close over the listed rows, and the open blocks' keys
    staged in the store's own launch (stage "in_store", no stage launch) where staging_overwrites_reads says the
    step allows it, else by a stage launch after the store. Both give the bytes of the reference that stages after
    its closes; and the kernel staging in its launch gives the reference's "in_store" bytes at every step, the
    steps that forbid it (whose closes then read the overwritten rows) included."""
    scheme = SCHEMES["kivi"]
    steps = CloseSteps(gen, kernel_device, head_dim)
    state, pool = steps.cache, steps.pool
    allowed = []
    for step in CLOSE_STEPS:
        b = steps.batch(step)
        key, value, slots, staging = b.key, b.value, b.slots, b.staging
        in_store = not staging_overwrites_reads(b.query_start_loc, b.seq_lens)
        allowed.append(in_store)
        expected, expected_pool = state.clone(), pool.clone()
        ref.store_kv(key, value, expected, slots, scheme, staged_keys=expected_pool, staging_slots=staging)
        for stage in (STAGE_IN_STORE, STAGE_BY_CALLER):
            cache, staged = state.clone(), pool.clone()
            store_kv(key, value, cache, slots, scheme, staged_keys=staged, staging_slots=staging, stage=stage,
                     close_rows=b.close_rows)
            assert grids(launches)["_kivi_stage_kernel"] == [], f"{stage}, {step}"
            if stage == STAGE_BY_CALLER:
                store.stage_open_keys(key, slots, staged, staging)
            if stage == STAGE_BY_CALLER or in_store:
                assert_caches_match(cache, expected, state, slots, scheme, head_dim=head_dim)
                assert torch.equal(staged.view(torch.int16), expected_pool.view(torch.int16)), f"{stage}, {step}"
            if stage == STAGE_IN_STORE:
                same_order, same_order_pool = state.clone(), pool.clone()
                ref.store_kv(key, value, same_order, slots, scheme, staged_keys=same_order_pool,
                             staging_slots=staging, stage=STAGE_IN_STORE)
                assert_caches_match(cache, same_order, state, slots, scheme, head_dim=head_dim)
                assert torch.equal(staged.view(torch.int16), same_order_pool.view(torch.int16)), f"{step}"
        grids(launches)
        state, pool = expected, expected_pool
    assert allowed == [True, False, True, True, True, False]  # b's and c's chunks start and end inside blocks


def test_close_rows_are_int32_and_int4_kivi_only(kernel_device):
    key = torch.zeros(2, 1, HEAD_DIM, dtype=torch.float16, device=kernel_device)
    cache = torch.zeros(2, 1, 128 * 136, dtype=torch.uint8, device=kernel_device)
    slots = torch.arange(2, device=kernel_device)
    pool = dict(staged_keys=allocate_pool(1, 1, 128, HEAD_DIM, torch.float16, kernel_device),
                staging_slots=torch.zeros(2, dtype=torch.long, device=kernel_device))
    with pytest.raises(ValueError, match=r"close_rows must be int32 \[n\], got torch.int64"):
        store_kv(key, key, cache, slots, SCHEMES["kivi"], **pool, close_rows=slots)
    with pytest.raises(ValueError, match="int4_saw takes no close_rows"):
        store_kv(key, key, cache, slots, SCHEMES["saw128"], close_rows=slots.int())
