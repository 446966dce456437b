"""The read rule of int4 attention as a float64 oracle, written from the rule itself (docs/kernel-api.md), with the
batches, caches and staging pools the own-block kernel tests share.

For a query at position p of a sequence, own block b = p // 128: values are every token's per-token round trip;
int4_saw keys the per-token round trip after the rotation; int4_kivi keys of blocks before b the per-channel round
trip of the block's 128 original keys, keys of block b (up to p) the original keys themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kv_batches import PagedBatch, make_paged_batch, poison_fresh_values, poisoned_cache

from s4kv.kernels import reference as ref
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import STAGE_BY_CALLER

B = 128
KIVI = Int4Scheme("int4_kivi")


def per_token_round_trip(x: torch.Tensor, rot: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, H, D] quantized per token (after ``x @ rot``) and dequantized back to the original space, float64."""
    y = x.double() if rot is None else x.double() @ rot.double()
    back = ref.dequantize_per_token(*ref.quantize_per_token(y.float())).double()
    return back if rot is None else back @ rot.double().T


def per_channel_round_trip(block_keys: torch.Tensor) -> torch.Tensor:
    """One block's 128 original keys [128, H, D], each head quantized per channel and dequantized, float64."""
    out = torch.empty(block_keys.shape, dtype=torch.float64, device=block_keys.device)
    for h in range(block_keys.shape[1]):
        out[:, h] = ref.dequantize_per_channel(*ref.quantize_per_channel(block_keys[:, h].float())).double()
    return out


def rule_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, softmax_scale: float,
                   scheme: Int4Scheme) -> torch.Tensor:
    """float64 output of query [q_len, Hq, D], the last q_len positions of one sequence whose original keys and values
    are [seq_len, Hkv, D], under the read rule. A NaN/inf value reaches exactly the queries that see it."""
    seq_len, num_kv_heads, head_dim = keys.shape
    q_len = query.shape[0]
    group = query.shape[1] // num_kv_heads
    device = keys.device
    rot = scheme.rotation(head_dim, device).double()
    v = per_token_round_trip(values, rot if scheme.rotate_values else None)
    if not scheme.is_kivi:
        k_saw = per_token_round_trip(keys, rot)
    closed = [per_channel_round_trip(keys[s : s + B]) for s in range(0, seq_len // B * B, B)]
    out = torch.empty(query.shape, dtype=torch.float64, device=device)
    for i in range(q_len):
        p = seq_len - q_len + i
        if scheme.is_kivi:
            b = p // B
            k = torch.cat(closed[:b] + [keys[b * B : p + 1].double()])
        else:
            k = k_saw[: p + 1]
        kk = k.repeat_interleave(group, 1)
        vv = v[: p + 1].repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[i].double(), kk) * softmax_scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), vv)
    return out


def batch_rule_attention(batch: PagedBatch, softmax_scale: float, scheme: Int4Scheme) -> torch.Tensor:
    """rule_attention of every sequence of the batch, float64 on the CPU (computed on the batch's device)."""
    starts = batch.query_start_loc.tolist()
    return torch.cat([rule_attention(batch.query[starts[i] : starts[i + 1]], k, v, softmax_scale, scheme)
                      for i, (k, v) in enumerate(zip(batch.seq_keys, batch.seq_values))]).cpu()


@dataclass
class StepPool:
    """int4_kivi's staging pool as attention sees it in a step: ``staged_keys`` after the step's store, which closes
    blocks but stages nothing yet (store_kv's stage "by_caller", as the engine stores a step whose staging would
    overwrite rows attention reads: kernels/staging.py), and ``sequence_slots`` (runtime/plugin/staging.py: the
    slot of the block each sequence's step starts in, a fresh one where the step starts on a block boundary; every
    token of the sequence carries it)."""

    staged_keys: torch.Tensor
    sequence_slots: torch.Tensor


def stored_step(gen, specs, head_dim, device, num_q_heads=4, num_kv_heads=2, scheme=KIVI, kernel_store=False,
                spare_slots=3, num_padding=3, dtype=torch.float16,
                poison: dict[int, int] | None = None) -> tuple[PagedBatch, torch.Tensor, StepPool | None]:
    """A batch of ``specs`` [(context, q_len)], a poisoned cache holding the cached prefixes (one earlier step, its
    open blocks staged) and then the batch's own store, with int4_kivi's pool (NaN outside the rows a store staged);
    shuffled pages and slots. ``batch.key`` rows past the step are NaN (CUDA-graph padding). ``poison`` {sequence:
    position}: a NaN value there (kv_batches.poison_fresh_values)."""
    from s4kv.kernels.store import store_kv

    batch = make_paged_batch(gen, specs, num_q_heads, num_kv_heads, block_size=B, dtype=dtype, device=device,
                             num_padding=num_padding, head_dim=head_dim)
    if poison:
        poison_fresh_values(batch, poison)
    cache = poisoned_cache(batch.num_blocks, num_kv_heads, B, gen, device, head_dim)
    store = store_kv if kernel_store else ref.store_kv
    if not scheme.is_kivi:
        if batch.prefix_slots.numel():
            ref.store_kv(batch.prefix_key, batch.prefix_value, cache, batch.prefix_slots, scheme)
        store(batch.key, batch.value, cache, batch.slot_mapping, scheme)
        return batch, cache, None
    n = len(specs)
    staged_keys = torch.full((n + spare_slots, num_kv_heads, B, head_dim), float("nan"), dtype=dtype, device=device)
    slots = torch.randperm(n + spare_slots, generator=gen)[:n]
    if batch.prefix_slots.numel():
        prefix_rows = torch.cat([torch.full((c,), int(s)) for (c, _), s in zip(specs, slots)]).to(device)
        ref.store_kv(batch.prefix_key, batch.prefix_value, cache, batch.prefix_slots, scheme, staged_keys,
                     prefix_rows)
    rows = [torch.full((q,), int(s)) for (_, q), s in zip(specs, slots)]
    rows.append(torch.full((batch.key.shape[0] - batch.num_tokens,), -1))
    staging_slots = torch.cat(rows).to(device=device, dtype=torch.int32)
    store(batch.key, batch.value, cache, batch.slot_mapping, scheme, staged_keys, staging_slots,
          stage=STAGE_BY_CALLER)
    return batch, cache, StepPool(staged_keys, slots.to(device=device, dtype=torch.int32))
