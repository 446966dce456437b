"""int4_kivi with a staging pool: a closed block's bytes are a function of its 128 keys alone, whatever filled it.

The reference (kernels/reference.py) with ``staged_keys``/``staging_slots`` closes every block per channel from the
original keys, reading the ones written by earlier batches back from the pool. These tests write the same
sequence in many patterns (one prefill, chunks of many sizes, one token at a time, random chunkings, batched beside
another sequence or alone, recomputed after a preemption into other pages, behind a prefix-cache hit) and require
identical bytes in every page of the sequence. CPU only, torch reference; the Triton store kernel is compared with
it in test_store_kernel.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from kv_batches import entry_bytes, poisoned_cache, random_keys, random_values

from s4kv.kernels import reference as ref
from s4kv.kernels.layout import KIVI_BLOCK_SIZE, PageLayout
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS
from s4kv.kernels.scheme import Int4Scheme

KIVI = Int4Scheme("int4_kivi")
B = KIVI_BLOCK_SIZE
NUM_KV_HEADS = 2
NUM_BLOCKS = 16
NUM_STAGING_SLOTS = 3
DTYPE = torch.bfloat16


def poisoned_pool(gen: torch.Generator, head_dim: int) -> torch.Tensor:
    """A staging pool full of garbage (NaN and huge values among them): a close that reads a slot row nobody wrote
    this block's key into turns the block's params into garbage, and the byte comparison fails."""
    shape = (NUM_STAGING_SLOTS, NUM_KV_HEADS, B, head_dim)
    bits = torch.randint(-2**15, 2**15, shape, generator=gen, dtype=torch.int16)
    return bits.view(DTYPE)


class Sequence:
    """One sequence's keys/values and its block table row (physical pages)."""

    def __init__(self, gen: torch.Generator, length: int, blocks: list[int], head_dim: int):
        self.key = random_keys(gen, length, NUM_KV_HEADS, DTYPE, "cpu", head_dim)
        self.value = random_values(gen, length, NUM_KV_HEADS, DTYPE, "cpu", head_dim)
        self.blocks = blocks

    def moved_to(self, blocks: list[int]) -> "Sequence":
        """The same tokens in other pages."""
        moved = object.__new__(Sequence)
        moved.key, moved.value, moved.blocks = self.key, self.value, blocks
        return moved

    def slots(self, start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        return torch.tensor(self.blocks)[pos // B] * B + pos % B


def write(cache, pool, steps) -> None:
    """Run store steps; a step is a list of (sequence, start, stop, staging slot) rows, stored in one batch with a
    padding row (slot -1, NaN key) between sequences, as vLLM pads."""
    for step in steps:
        keys, values, slots, staging = [], [], [], []
        for seq, start, stop, slot in step:
            head_dim = seq.key.shape[-1]
            keys += [seq.key[start:stop], torch.full((1, NUM_KV_HEADS, head_dim), float("nan"), dtype=DTYPE)]
            values += [seq.value[start:stop], torch.full((1, NUM_KV_HEADS, head_dim), float("nan"), dtype=DTYPE)]
            slots += [seq.slots(start, stop), torch.tensor([-1])]
            staging += [torch.full((stop - start + 1,), slot)]
        ref.store_kv(torch.cat(keys), torch.cat(values), cache, torch.cat(slots), KIVI, staged_keys=pool,
                     staging_slots=torch.cat(staging))


def chunked(length: int, sizes) -> list[tuple[int, int]]:
    """[(start, stop)] covering 0..length with chunk sizes taken in turn from ``sizes``."""
    bounds, at, i = [], 0, 0
    while at < length:
        stop = min(length, at + sizes[i % len(sizes)])
        bounds.append((at, stop))
        at, i = stop, i + 1
    return bounds


def pages_of(cache: torch.Tensor, seq: Sequence, length: int) -> torch.Tensor:
    """The sequence's pages in logical order, whole: every pattern starts from the same poisoned cache, so even the
    unwritten slots of the open page must agree."""
    return cache[torch.tensor(seq.blocks[: -(-length // B)])]


def same_tokens(pages: torch.Tensor, other: torch.Tensor, length: int, head_dim: int) -> bool:
    """Pages [n, Hkv, page_bytes] of two sequences in different physical pages: closed pages whole, the last (open)
    page in the entries of its written tokens (its other slots hold each page's own poison)."""
    closed = length // B
    if not torch.equal(pages[:closed], other[:closed]):
        return False
    written = length - closed * B
    if written == 0:
        return True
    lay = PageLayout(B, head_dim)
    entries = [byte for region in ("k_codes", "v_codes", "v_params", "k_params") for t in range(written)
               for byte in entry_bytes(lay, region, t)]
    return torch.equal(pages[closed][:, entries], other[closed][:, entries])


def patterns(length: int, seed: int) -> dict[str, list[tuple[int, int]]]:
    rng = random.Random(seed)
    random_chunks = [rng.choice([1, 2, 3, 17, 64, 127, 128, 129, 200]) for _ in range(40)]
    return {
        "one prefill": [(0, length)],
        "one token at a time": chunked(length, [1]),
        "chunks of 7": chunked(length, [7]),
        "chunks of 100": chunked(length, [100]),
        "chunks of 128": chunked(length, [128]),
        "chunks of 129": chunked(length, [129]),
        "a prefill of 45, then decode": [(0, 45)] + [(t, t + 1) for t in range(45, length)],
        "random chunks": chunked(length, random_chunks),
    }


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("length", [256, 301])
def test_pages_are_identical_whatever_the_write_pattern(gen, head_dim, length):
    seq = Sequence(gen, length, [5, 2, 9, 11, 3], head_dim)
    start_cache = poisoned_cache(NUM_BLOCKS, NUM_KV_HEADS, B, gen, "cpu", head_dim)
    start_pool = poisoned_pool(gen, head_dim)
    results = {}
    for name, bounds in patterns(length, seed=length * head_dim).items():
        cache, pool = start_cache.clone(), start_pool.clone()
        write(cache, pool, [[(seq, a, b, 1)] for a, b in bounds])
        results[name] = pages_of(cache, seq, length)
    for name, pages in results.items():
        assert torch.equal(pages, results["one prefill"]), f"{name}: pages differ from one prefill"


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_a_closed_block_is_per_channel_from_its_original_keys(gen, head_dim):
    """Decode-filled blocks hold exactly quantize_per_channel(originals), never staged codes, and read back as such."""
    length = 260
    seq = Sequence(gen, length, [4, 1, 7], head_dim)
    cache = poisoned_cache(NUM_BLOCKS, NUM_KV_HEADS, B, gen, "cpu", head_dim)
    pool = poisoned_pool(gen, head_dim)
    write(cache, pool, [[(seq, a, b, 0)] for a, b in chunked(length, [1])])
    pages = ref.PageViews(cache, head_dim)
    for j, blk in enumerate(seq.blocks[:2]):
        for h in range(NUM_KV_HEADS):
            codes, scale, minimum = ref.quantize_per_channel(seq.key[B * j : B * (j + 1), h].float())
            assert torch.equal(ref.unpack_nibbles(pages.k_codes[blk, h]), codes)
            assert torch.equal(pages.k_params[blk, h, :head_dim, 0], scale)
            assert torch.equal(pages.k_params[blk, h, :head_dim, 1], minimum)
    k_hat, _ = ref.dequantize_sequence(cache, torch.tensor(seq.blocks), length, KIVI, head_dim)
    per_channel = torch.stack([ref.dequantize_per_channel(*ref.quantize_per_channel(seq.key[:B, h].float()))
                               for h in range(NUM_KV_HEADS)], 1)
    assert torch.equal(k_hat[:B], per_channel)
    # the open block: its keys are staged in the pool, exactly (the model's own bf16 keys)
    assert torch.equal(pool[0][:, : length - 2 * B].transpose(0, 1), seq.key[2 * B :])


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_batched_beside_other_sequences_or_alone(gen, head_dim):
    """Two sequences decoding and prefilling in the same batches with different slots: each one's pages equal its
    pages written alone in one prefill."""
    a = Sequence(gen, 290, [3, 8, 12], head_dim)
    b = Sequence(gen, 200, [6, 1], head_dim)
    start_cache = poisoned_cache(NUM_BLOCKS, NUM_KV_HEADS, B, gen, "cpu", head_dim)
    start_pool = poisoned_pool(gen, head_dim)
    alone = start_cache.clone()
    write(alone, start_pool.clone(), [[(a, 0, 290, 0)], [(b, 0, 200, 1)]])
    together = start_cache.clone()
    pool = start_pool.clone()
    # b's prompt in chunks of 50 while a decodes, then both decode, a finishing later
    steps = [[(a, 0, 100, 0)], [(a, 100, 101, 0), (b, 0, 50, 1)], [(b, 50, 100, 1), (a, 101, 102, 0)]]
    steps += [[(a, t, t + 1, 0), (b, 100 + t - 102, 100 + t - 101, 1)] for t in range(102, 202)]
    steps += [[(a, t, t + 1, 0)] for t in range(202, 290)]
    write(together, pool, steps)
    for seq, length in ((a, 290), (b, 200)):
        assert torch.equal(pages_of(together, seq, length), pages_of(alone, seq, length))


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_recompute_after_preemption_into_other_pages(gen, head_dim):
    """A preempted sequence loses its pages and its staging slot; recomputed later from token 0 into other pages
    and another slot, whose pool rows hold an earlier owner's keys, its pages come out byte for byte the same."""
    length = 330
    seq = Sequence(gen, length, [2, 5, 7], head_dim)
    other = Sequence(gen, 250, [9, 10], head_dim)
    start_cache = poisoned_cache(NUM_BLOCKS, NUM_KV_HEADS, B, gen, "cpu", head_dim)
    start_pool = poisoned_pool(gen, head_dim)
    undisturbed = start_cache.clone()
    write(undisturbed, start_pool.clone(), [[(seq, a, b, 0)] for a, b in chunked(length, [64])])

    cache, pool = start_cache.clone(), start_pool.clone()
    write(cache, pool, [[(seq, a, b, 0)] for a, b in chunked(200, [64])])  # preempted with an open block
    write(cache, pool, [[(other, a, b, 1)] for a, b in chunked(250, [90])])  # slot 1 now holds other's keys
    moved = seq.moved_to([11, 12, 13])
    write(cache, pool, [[(moved, 0, 150, 1)]] + [[(moved, t, t + 1, 1)] for t in range(150, length)])
    assert same_tokens(pages_of(cache, moved, length), pages_of(undisturbed, seq, length), length, head_dim)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_prefix_cache_hit_continues_into_identical_pages(gen, head_dim):
    """A second request shares the first's two full blocks (a prefix-cache hit) and writes the rest itself: its own
    pages equal those of the same tokens written from scratch, and the shared pages are untouched."""
    first = Sequence(gen, 256 + 40, [1, 4, 6], head_dim)
    second = Sequence(gen, 256 + 170, [1, 4, 8, 14], head_dim)  # its first 256 tokens are first's
    second.key[:256], second.value[:256] = first.key[:256], first.value[:256]
    start_cache = poisoned_cache(NUM_BLOCKS, NUM_KV_HEADS, B, gen, "cpu", head_dim)
    start_pool = poisoned_pool(gen, head_dim)
    scratch = start_cache.clone()
    alone = second.moved_to([2, 3, 8, 14])
    write(scratch, start_pool.clone(), [[(alone, a, b, 0)] for a, b in chunked(426, [1])])

    cache, pool = start_cache.clone(), start_pool.clone()
    write(cache, pool, [[(first, a, b, 0)] for a, b in chunked(296, [100])])
    shared = cache[[1, 4]].clone()
    write(cache, pool, [[(second, 256, 300, 2)]] + [[(second, t, t + 1, 2)] for t in range(300, 426)])
    assert torch.equal(cache[[1, 4]], shared)
    assert torch.equal(cache[[1, 4]], scratch[[2, 3]])
    assert torch.equal(cache[[8, 14]], scratch[[8, 14]])


def test_staging_errors_name_the_problem(gen):
    head_dim = 64
    seq = Sequence(gen, 130, [1, 2], head_dim)
    cache = poisoned_cache(4, NUM_KV_HEADS, B, gen, "cpu", head_dim)
    pool = poisoned_pool(gen, head_dim)
    write(cache, pool, [[(seq, 0, 100, 0)]])
    with pytest.raises(ValueError, match="closes a block begun in an earlier batch but has no staging slot"):
        write(cache, pool, [[(seq, 100, 130, -1)]])
    with pytest.raises(ValueError, match="staged_keys must be"):
        ref.store_kv(seq.key[:1], seq.value[:1], cache, seq.slots(0, 1), KIVI, staged_keys=pool.float(),
                     staging_slots=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="int4_kivi needs its staging pool: staged_keys and staging_slots"):
        ref.store_kv(seq.key[:1], seq.value[:1], cache, seq.slots(0, 1), KIVI)
    with pytest.raises(ValueError, match="int4_kivi needs its staging pool"):
        ref.store_kv(seq.key[:1], seq.value[:1], cache, seq.slots(0, 1), KIVI,
                     staging_slots=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="int4_saw takes no staging pool"):
        ref.store_kv(seq.key[:1], seq.value[:1], cache, seq.slots(0, 1), Int4Scheme("int4_saw"), staged_keys=pool,
                     staging_slots=torch.zeros(1, dtype=torch.long))
