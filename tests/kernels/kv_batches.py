"""Builders and checks shared by the kernel tests: paged batches as vLLM schedules them, poisoned caches,
the byte regions a store may write, cache comparison and attention over the unquantized K/V (with the float64
oracle of tests/attention_oracle.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from attention_oracle import causal_attention

from s4kv.kernels import reference as ref
from s4kv.kernels.layout import KIVI_BLOCK_SIZE, PageLayout, cache_shape
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import STAGE_BY_CALLER, allocate_pool, sequence_staging_slots
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS

NULL_BLOCK = 0  # never handed to a sequence: it stays poisoned, and block-table padding points at it
HEAD_DIM = 128  # the helpers' default; tests parametrized over SUPPORTED_HEAD_DIMS pass their own


def scheme_head_dims(schemes: dict[str, Int4Scheme]) -> list[tuple[str, int]]:
    """(scheme name, head_dim) for every supported head_dim the scheme's Hadamard block divides (int4_saw's block
    128 does not fit head_dim 64: that combination is refused, tests/kernels/test_reference.py)."""
    return [(name, d) for name, scheme in schemes.items() for d in SUPPORTED_HEAD_DIMS
            if scheme.hadamard_block is None or d % scheme.hadamard_block == 0]


def entry_bytes(layout: PageLayout, region: str, entry: int) -> list[int]:
    """Region-relative byte addresses of one entry (a token, or a closed KIVI block's channel for k_params) of a
    page region, from docs/format.md: K codes token-major, V codes channel-major, params 4 bytes per entry."""
    start = getattr(layout, region)
    half = layout.half_dim
    if region == "k_codes":
        return [start + half * entry + j for j in range(half)]
    if region == "v_codes":
        return [start + j * layout.block_size + entry for j in range(half)]
    return [start + 4 * entry + j for j in range(4)]


def poisoned_cache(num_blocks: int, num_kv_heads: int, block_size: int, gen: torch.Generator, device,
                   head_dim: int = HEAD_DIM) -> torch.Tensor:
    """A cache full of random bytes: whatever a kernel reads without writing it first is garbage (often NaN/inf)."""
    shape = cache_shape(num_blocks, num_kv_heads, block_size, head_dim)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=gen.device).to(device)


def with_guard_blocks(cache: torch.Tensor, gen: torch.Generator, num_blocks: int = 4) -> torch.Tensor:
    """The same cache as a view into a larger poisoned buffer: a kernel that reads past the last page (a bug the
    test is about to report) reads garbage instead of faulting and taking the whole test run down."""
    guard = torch.randint(0, 256, (num_blocks, *cache.shape[1:]), generator=gen, dtype=torch.uint8,
                          device=gen.device).to(cache.device)
    return torch.cat([cache, guard])[: cache.shape[0]]


def random_keys(gen: torch.Generator, num_tokens: int, num_heads: int, dtype, device,
                head_dim: int = HEAD_DIM) -> torch.Tensor:
    """Keys shaped like a real model's: a few channels with large magnitude and an offset (KIVI's motivation)."""
    x = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=gen.device)
    outlier = torch.rand(num_heads, head_dim, generator=gen, device=gen.device) < 0.06
    scale = 1.0 + 5.0 * outlier
    offset = 2.0 * outlier * torch.randn(num_heads, head_dim, generator=gen, device=gen.device)
    return (x * scale + offset).to(device=device, dtype=dtype)


def random_values(gen: torch.Generator, num_tokens: int, num_heads: int, dtype, device,
                  head_dim: int = HEAD_DIM) -> torch.Tensor:
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=gen.device).to(device=device, dtype=dtype)


@dataclass
class PagedBatch:
    """One scheduler step: per sequence a cached prefix of ``context`` tokens and ``q_len`` new tokens.

    ``key``/``value``/``slot_mapping`` hold the new tokens followed by ``num_padding`` padding rows (slot -1,
    NaN data); ``query`` holds only the real new tokens. ``staged_keys`` is int4_kivi's staging pool for the batch's
    stores (NaN until a store stages into it), sequence i in slot i: ``prefix_staging``, ``step_staging`` and
    ``pool_read`` give the arguments of the prefix's store, the step's store and the step's attention.
    """

    specs: list[tuple[int, int]]
    block_size: int
    num_blocks: int
    block_table: torch.Tensor  # int32 [S, max_blocks], padded with NULL_BLOCK
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    max_query_len: int
    seq_keys: list[torch.Tensor]  # per sequence, all its keys [seq_len, Hkv, head_dim]
    seq_values: list[torch.Tensor]
    query: torch.Tensor  # [T, Hq, head_dim]
    key: torch.Tensor  # [T + padding, Hkv, head_dim]
    value: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [T + padding]
    prefix_key: torch.Tensor  # the cached prefixes of all sequences, [P, Hkv, head_dim]
    prefix_value: torch.Tensor
    prefix_slots: torch.Tensor  # int64 [P]
    staged_keys: torch.Tensor  # [S, Hkv, 128, head_dim], the keys' dtype

    def prefix_staging(self, scheme: Int4Scheme) -> dict:
        """store_kv's staging arguments for the prefixes' store (one batch): int4_kivi's pool; none for int4_saw."""
        if not scheme.is_kivi:
            return {}
        slots = sequence_staging_slots([context for context, _ in self.specs], self.key.device)
        return dict(staged_keys=self.staged_keys, staging_slots=slots)

    def step_staging(self, scheme: Int4Scheme) -> dict:
        """store_kv's staging arguments for the step's store (``key``'s rows, padding included), after the prefixes'
        store: as the engine stores before attention, staging nothing (stage "by_caller"), so the pool keeps the rows
        attention reads and the step can be stored again (another cache, the kernel) from the same pool."""
        if not scheme.is_kivi:
            return {}
        slots = sequence_staging_slots([q_len for _, q_len in self.specs], self.key.device)
        padding = torch.full((self.key.shape[0] - self.num_tokens,), -1, device=self.key.device)
        return dict(staged_keys=self.staged_keys, staging_slots=torch.cat([slots, padding]), stage=STAGE_BY_CALLER)

    def pool_read(self, scheme: Int4Scheme) -> dict:
        """Attention's int4_kivi arguments after the step's store: the step's keys and the pool; none for int4_saw."""
        if not scheme.is_kivi:
            return {}
        slots = torch.arange(len(self.specs), dtype=torch.int32, device=self.key.device)
        return dict(new_keys=self.key, staged_keys=self.staged_keys, sequence_slots=slots)

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key.shape[2]


def make_paged_batch(
    gen: torch.Generator,
    specs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    device,
    spare_blocks: int = 2,
    num_padding: int = 0,
    head_dim: int = HEAD_DIM,
) -> PagedBatch:
    """Random data and a shuffled block table for ``specs`` = [(context, q_len), ...]."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    seq_lens = [context + q_len for context, q_len in specs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks  # + the null block and unused, poisoned ones
    pool = (torch.randperm(num_blocks - 1, generator=gen, device=gen.device) + 1).tolist()
    block_table = torch.full((len(specs), max(blocks_per_seq) + 1), NULL_BLOCK, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]

    def slots(seq: int, start: int, stop: int) -> torch.Tensor:
        positions = torch.arange(start, stop)
        return block_table[seq].long()[positions // block_size] * block_size + positions % block_size

    seq_keys = [random_keys(gen, n, num_kv_heads, dtype, device, head_dim) for n in seq_lens]
    seq_values = [random_values(gen, n, num_kv_heads, dtype, device, head_dim) for n in seq_lens]
    nan_rows = torch.full((num_padding, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    q_lens = [q_len for _, q_len in specs]
    return PagedBatch(
        specs=list(specs),
        block_size=block_size,
        num_blocks=num_blocks,
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        seq_keys=seq_keys,
        seq_values=seq_values,
        query=torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen, device=gen.device).to(device, dtype),
        key=torch.cat([k[c:] for k, (c, _) in zip(seq_keys, specs)] + [nan_rows]),
        value=torch.cat([v[c:] for v, (c, _) in zip(seq_values, specs)] + [nan_rows]),
        slot_mapping=torch.cat([slots(i, c, c + q) for i, (c, q) in enumerate(specs)]
                               + [torch.full((num_padding,), -1)]).to(device),
        prefix_key=torch.cat([k[:c] for k, (c, _) in zip(seq_keys, specs)]),
        prefix_value=torch.cat([v[:c] for v, (c, _) in zip(seq_values, specs)]),
        prefix_slots=torch.cat([slots(i, 0, c) for i, (c, _) in enumerate(specs)]).to(device),
        staged_keys=allocate_pool(len(specs), num_kv_heads, KIVI_BLOCK_SIZE, head_dim, dtype, device).fill_(
            float("nan")),
    )


def cache_with_prefix(batch: PagedBatch, scheme: Int4Scheme, gen: torch.Generator, device) -> torch.Tensor:
    """A poisoned cache holding every sequence's cached prefix, written by the reference in one prefill (int4_kivi:
    its open blocks staged in ``batch.staged_keys``)."""
    cache = poisoned_cache(batch.num_blocks, batch.num_kv_heads, batch.block_size, gen, device, batch.head_dim)
    if batch.prefix_slots.numel():
        ref.store_kv(batch.prefix_key, batch.prefix_value, cache, batch.prefix_slots, scheme,
                     **batch.prefix_staging(scheme))
    return cache


@dataclass
class StagingPool:
    """int4_kivi's staging pool as the engine hands it to a batch: ``staged_keys`` [slots, Hkv, 128, D] and, per
    sequence, its slot (``store_slots``, for every token it stores) and ``sequence_slots`` (int32, what attention
    reads: the slot where the sequence ends inside a block, else -1)."""

    staged_keys: torch.Tensor
    store_slots: list[int]
    sequence_slots: torch.Tensor

    def per_token(self, batch: PagedBatch) -> torch.Tensor:
        """staging_slots of batch.key's rows (padding rows included: -1, never read)."""
        rows = [torch.full((q_len,), slot) for (_, q_len), slot in zip(batch.specs, self.store_slots)]
        return torch.cat(rows + [torch.full((batch.key.shape[0] - batch.num_tokens,), -1)]).to(batch.key.device)


def cache_and_pool_with_prefix(batch: PagedBatch, gen: torch.Generator, device,
                               spare_slots: int = 3) -> tuple[torch.Tensor, StagingPool]:
    """A poisoned cache and a staging pool of NaN holding every sequence's cached prefix, written by the reference
    with the pool in one prefill (its open blocks' keys in the pool, the rest of the pool never written). Slots are
    a random choice among ``num_seqs + spare_slots``: unused ones stay NaN."""
    kivi = Int4Scheme("int4_kivi")
    cache = poisoned_cache(batch.num_blocks, batch.num_kv_heads, batch.block_size, gen, device, batch.head_dim)
    num_seqs = len(batch.specs)
    staged_keys = torch.full((num_seqs + spare_slots, batch.num_kv_heads, batch.block_size, batch.head_dim),
                             float("nan"), dtype=batch.key.dtype, device=device)
    store_slots = torch.randperm(num_seqs + spare_slots, generator=gen, device=gen.device)[:num_seqs].tolist()
    ends_open = [int(n) % batch.block_size != 0 for n in batch.seq_lens.tolist()]
    pool = StagingPool(staged_keys, store_slots,
                       torch.tensor([s if o else -1 for s, o in zip(store_slots, ends_open)], dtype=torch.int32,
                                    device=device))
    if batch.prefix_slots.numel():
        prefix_slots = torch.cat([torch.full((context,), slot) for (context, _), slot in zip(batch.specs, store_slots)])
        ref.store_kv(batch.prefix_key, batch.prefix_value, cache, batch.prefix_slots, kivi, staged_keys,
                     prefix_slots.to(device))
    return cache, pool


def written_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int, scheme: Int4Scheme):
    """What a store of ``slot_mapping`` writes: (tokens bool [num_blocks, B], closed bool [num_blocks]).

    ``tokens`` are the slots written per token; ``closed`` the int4_kivi blocks whose last slot is written, whose
    keys and key params are all rewritten (per channel, docs/format.md).
    """
    slots = slot_mapping.long().cpu()
    slots = slots[slots >= 0]
    tokens = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    tokens[slots] = True
    tokens = tokens.view(num_blocks, block_size)
    closed = tokens[:, -1] if scheme.is_kivi else torch.zeros(num_blocks, dtype=torch.bool)
    return tokens, closed.clone()


def written_byte_mask(slot_mapping: torch.Tensor, kv_cache: torch.Tensor, scheme: Int4Scheme,
                      head_dim: int) -> torch.Tensor:
    """bool [num_blocks, 1, page_bytes]: the bytes a store of ``slot_mapping`` may change (same for every KV head).

    Computed from the byte layout in docs/format.md (kernels/layout.py), not from the reference's page views.
    """
    num_blocks, _, page = kv_cache.shape
    lay = PageLayout.of_cache(kv_cache, head_dim)
    bsz = lay.block_size
    tokens, closed = written_slots(slot_mapping, num_blocks, bsz, scheme)
    mask = torch.zeros(num_blocks, 1, page, dtype=torch.bool)
    for blk, off in tokens.nonzero().tolist():
        for region in ("k_codes", "v_codes", "v_params", "k_params"):
            mask[blk, 0, entry_bytes(lay, region, off)] = True
    mask[closed, 0, lay.k_codes : lay.v_codes] = True
    mask[closed, 0, lay.k_params :] = True
    return mask.to(kv_cache.device)


def assert_caches_match(actual: torch.Tensor, expected: torch.Tensor, before: torch.Tensor,
                        slot_mapping: torch.Tensor, scheme: Int4Scheme, max_code_mismatch: float = 0.01,
                        head_dim: int = HEAD_DIM) -> None:
    """``actual`` (a kernel's store) against ``expected`` (the reference's), both started from ``before``.

    Outside the written slots no byte may change. Inside, codes may differ by +-1 on a small fraction (x/scale
    landing on .5 under a different rounding of the rotation), params must agree to fp16 precision.
    """
    mask = written_byte_mask(slot_mapping, before, scheme, head_dim).expand_as(before)
    changed = (actual != before) & ~mask
    if changed.any():
        blk, head, byte = changed.nonzero()[0].tolist()
        raise AssertionError(f"{int(changed.sum())} bytes outside the written slots changed, first at block {blk} "
                             f"head {head} byte {byte} ({PageLayout.of_cache(before, head_dim)})")
    assert torch.equal(expected[~mask], before[~mask]), "the reference wrote outside its slots"

    num_blocks, num_heads, page = before.shape
    block_size = PageLayout.of_cache(before, head_dim).block_size
    tokens, closed = (m.to(before.device) for m in written_slots(slot_mapping, num_blocks, block_size, scheme))
    keys = tokens | closed[:, None]
    got, want = ref.PageViews(actual, head_dim), ref.PageViews(expected, head_dim)
    for name, rows in (("k_codes", keys), ("v_codes", tokens)):
        a = ref.unpack_nibbles(getattr(got, name)).int()
        b = ref.unpack_nibbles(getattr(want, name)).int()
        diff = (a - b).transpose(1, 2)[rows]  # [written rows, heads, head_dim]
        if diff.numel() == 0:
            continue
        worst = int(diff.abs().max())
        frac = float((diff != 0).float().mean())
        assert worst <= 1, f"{name}: a code differs by {worst} from the reference ({frac:.2%} of codes differ)"
        assert frac <= max_code_mismatch, f"{name}: {frac:.2%} of codes differ by 1 (allowed {max_code_mismatch:.2%})"
    for name, rows in (("k_params", keys), ("v_params", tokens)):
        a = getattr(got, name).transpose(1, 2)[rows].float()
        b = getattr(want, name).transpose(1, 2)[rows].float()
        # a NaN scale marks a broken vector (it dequantizes to NaN whatever its min): its min is unspecified
        broken = torch.isnan(b[..., 0])
        a[..., 1][broken] = b[..., 1][broken] = 0
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-6, equal_nan=True, msg=lambda m: f"{name}: {m}")


def unquantized_attention(batch: PagedBatch, softmax_scale: float) -> torch.Tensor:
    """float64 attention of the batch's queries over the original (unquantized) keys and values."""
    starts = batch.query_start_loc.tolist()
    out = [causal_attention(batch.query[starts[i] : starts[i + 1]], k, v, softmax_scale)
           for i, (k, v) in enumerate(zip(batch.seq_keys, batch.seq_values))]
    return torch.cat(out)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (Frobenius)."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm())


def poison_fresh_values(batch: PagedBatch, positions: dict[int, int]) -> None:
    """Set the value at ``positions[seq]`` (a position among sequence seq's new tokens) to NaN, in batch.value
    (what a store writes) and in batch.seq_values (what the oracle reads): queries before it must stay finite."""
    starts = batch.query_start_loc.tolist()
    for seq, position in positions.items():
        context = batch.specs[seq][0]
        assert context <= position < int(batch.seq_lens[seq]), "the poisoned value must be a new token"
        batch.value[starts[seq] + position - context, 0, 5] = float("nan")
        batch.seq_values[seq][position, 0, 5] = float("nan")


def assert_poisoned_rows(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """The rows that are NaN in ``out`` [T, Hq, 128] are exactly those NaN in ``expected``, and some are not."""
    got = torch.isnan(out.float()).any(-1)
    want = torch.isnan(expected).any(-1)
    assert want.any() and not want.all(), f"{what}: the case must poison some query rows and spare others"
    wrong = (got != want).nonzero().tolist()
    assert not wrong, (f"{what}: {len(wrong)} (token, head) rows NaN where the oracle is not or the reverse, "
                       f"first {wrong[0]}")
