"""The torch engine of `s4kv eval`: the Hugging Face model, no vLLM, K/V through each format's torch reference.

Every layer's post-RoPE keys and values pass through a transform (torch_kv.py) that stores them the way the
format's KV cache would and hands attention what that cache gives back:

* ``s4kv_kivi`` / ``s4kv_saw``: the S4 KV torch reference (``s4kv.kernels.reference``): each sequence and layer
  owns a paged int4 cache; new tokens are written with ``store_kv`` and attention reads ``dequantize_sequence``;
  int4_kivi with a staging pool (kernels/staging.py), one slot per sequence: every closed block per channel from
  its original keys; attention reads as the engine does (docs/format.md, the read rule): a query sees the blocks
  before its own per channel and its own block's original keys (the transform hands attention both key sets and
  a mask, own_block_visibility);
* ``bf16_fa3``: K/V rounded to bf16 (what a bf16 cache holds); the reference of the comparison;
* ``fp8_fa3``: K/V cast to fp8 e4m3 with scale 1 (saturating), as vLLM's fp8 cache without checkpoint scales;
* ``vllm_int4``: an emulation of vLLM's int4_per_token_head: a head-wide Hadamard with fixed random signs, then
  per-token asymmetric int4 (fp16 scale and min here; vLLM packs its zero point into an fp32 scale).

It runs on the CPU in float32, so CI can check that the metrics are computed correctly on real models.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from s4kv.kernels import reference as ref
from s4kv.kernels.hadamard import block_hadamard
from s4kv.kernels.layout import check_head_dim, cache_shape
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import allocate_pool
from s4kv.runtime.schemes import KIVI, SAW

from .data import RegimeInputs
from .metrics import Greedy, TeacherForced
from .torch_kv import KVTransform, kv_transform

BLOCK_SIZE = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
POOL_DTYPE = torch.bfloat16  # what int4_kivi's staging pool holds in a bf16 deployment


class PagedInt4Cache:
    """One paged int4 cache per layer for a batch of sequences of one S4 KV scheme; tokens are stored once, in
    arrival order, every sequence of the batch in the same ``store_kv`` call, as vLLM stores one engine step.

    With ``prefill_tokens`` set, the first ``prefill_tokens`` tokens of the sequences go to ``store_kv`` in one call
    (their prompts' prefill) and every later position in a call of its own (decode steps). None: all new tokens of
    a forward in one call. Sequence b owns blocks ``b * blocks_per_sequence`` onward, so a block only ever holds one
    sequence's tokens, and, for int4_kivi, slot b of the layer's staging pool (kernels/staging.py)."""

    def __init__(self, scheme: Int4Scheme, prefill_tokens: int | None = None):
        self.scheme = scheme
        self.prefill_tokens = prefill_tokens
        self.caches: dict[int, torch.Tensor] = {}  # layer -> [batch * blocks_per_sequence, kv_heads, page bytes]
        self.lengths: dict[int, int] = {}  # layer -> tokens stored per sequence
        self.pools: dict[int, torch.Tensor] = {}  # layer -> int4_kivi staging pool [batch, kv_heads, 128, head_dim]

    def _cache_for(self, layer_idx: int, batch: int, num_kv_heads: int, head_dim: int, length: int,
                   device) -> torch.Tensor:
        blocks = -(-length // BLOCK_SIZE)
        cache = self.caches.get(layer_idx)
        if cache is None or cache.shape[0] < batch * blocks:
            grown = torch.zeros(cache_shape(batch * blocks, num_kv_heads, BLOCK_SIZE, head_dim), dtype=torch.uint8,
                                device=device)
            if cache is not None:  # each sequence's blocks move to its new, longer range
                old = cache.shape[0] // batch
                grown.view(batch, blocks, *grown.shape[1:])[:, :old] = cache.view(batch, old, *cache.shape[1:])
            cache = self.caches[layer_idx] = grown
        return cache

    def __call__(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        batch, num_kv_heads, length, head_dim = key.shape
        check_head_dim(head_dim)
        stored = self.lengths.get(layer_idx, 0)
        cache = self._cache_for(layer_idx, batch, num_kv_heads, head_dim, length, key.device)
        blocks = cache.shape[0] // batch
        first_slot = torch.arange(batch, device=key.device)[:, None] * blocks * BLOCK_SIZE
        # only tokens the cache has not seen yet, as in a paged cache
        bounds = [stored, length] if self.prefill_tokens is None else \
            sorted({stored, length, *range(max(stored, self.prefill_tokens), length)})
        staging = {}
        if self.scheme.is_kivi:
            if layer_idx not in self.pools:
                self.pools[layer_idx] = allocate_pool(batch, num_kv_heads, BLOCK_SIZE, head_dim, torch.float32,
                                                      key.device)
            staging["staged_keys"] = self.pools[layer_idx]
        for start, stop in zip(bounds, bounds[1:]):
            slots = first_slot + torch.arange(start, stop, device=key.device)  # [batch, tokens]
            if self.scheme.is_kivi:  # every token of sequence b stages into slot b
                staging["staging_slots"] = torch.arange(batch, device=key.device).repeat_interleave(stop - start)
            ref.store_kv(key[:, :, start:stop].transpose(1, 2).reshape(-1, num_kv_heads, head_dim).float(),
                         value[:, :, start:stop].transpose(1, 2).reshape(-1, num_kv_heads, head_dim).float(),
                         cache, slots.reshape(-1), self.scheme, **staging)
        self.lengths[layer_idx] = max(stored, length)
        keys, values = [], []
        for b in range(batch):
            k, v = ref.dequantize_sequence(cache, torch.arange(b * blocks, (b + 1) * blocks, device=key.device),
                                           length, self.scheme, head_dim)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        keys, values = torch.stack(keys), torch.stack(values)
        if not self.scheme.is_kivi:
            return keys, values
        # the stored keys and the original keys side by side, the mask picking one per (query, key): the blocks
        # before the query's own as stored (per channel), its own block's originals. The engine holds originals in
        # the served model's dtype (the step's keys, the pool): bf16, as the bf16_fa3 reference's cache
        visible = own_block_visibility(stored, length, key.device)
        originals = key.to(POOL_DTYPE).float()
        return torch.cat([keys, originals], 2), torch.cat([values, values], 2), visible[None, None]


def own_block_visibility(start: int, length: int, device) -> torch.Tensor:
    """For int4_kivi, bool [length - start, 2 * length]: which stored keys (first half) and which original keys
    (second half) the query at each position from ``start`` on sees: stored keys of the blocks before its own,
    original keys of its own block up to itself."""
    position = torch.arange(start, length, device=device)[:, None]
    key_position = torch.arange(length, device=device)[None, :]
    causal = key_position <= position
    own = causal & (key_position // BLOCK_SIZE == position // BLOCK_SIZE)
    return torch.cat([causal & ~own, own], 1)


def round_to(dtype: torch.dtype) -> KVTransform:
    return lambda layer_idx, key, value: (key.to(dtype).float(), value.to(dtype).float())


def fp8_e4m3(layer_idx: int, key: torch.Tensor, value: torch.Tensor):
    def cast(x):
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return cast(key), cast(value)


class RotatedPerTokenInt4:
    """Emulation of vLLM's int4_per_token_head: random-sign Hadamard over the head, per-token int4."""

    def __init__(self, seed: int = 0x9E3779B9):
        self.seed = seed
        self.rotations: dict[int, torch.Tensor] = {}  # by head_dim

    def _rotation(self, head_dim: int) -> torch.Tensor:
        if head_dim not in self.rotations:
            signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(self.seed)) * 2 - 1
            self.rotations[head_dim] = signs[:, None].float() * block_hadamard(head_dim, head_dim)  # orthonormal
        return self.rotations[head_dim]

    def _round_trip(self, x: torch.Tensor) -> torch.Tensor:
        rotation = self._rotation(x.shape[-1]).to(x.device)
        codes, scale, minimum = ref.quantize_per_token(x.float() @ rotation)
        return ref.dequantize_per_token(codes, scale, minimum) @ rotation.T

    def __call__(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        return self._round_trip(key), self._round_trip(value)


# name (as in bench/matrix.py FORMATS) -> a fresh transform for one batch of sequences, given how many tokens of a
# sequence its first write holds (PagedInt4Cache; the other formats keep no state between tokens)
TransformFactory = Callable[..., KVTransform]
TORCH_FORMATS: dict[str, TransformFactory] = {
    "bf16_fa3": lambda prefill_tokens=None: round_to(torch.bfloat16),
    "fp8_fa3": lambda prefill_tokens=None: fp8_e4m3,
    "vllm_int4": lambda prefill_tokens=None: RotatedPerTokenInt4(),
    "s4kv_kivi": lambda prefill_tokens=None: PagedInt4Cache(Int4Scheme(KIVI), prefill_tokens),
    "s4kv_saw": lambda prefill_tokens=None: PagedInt4Cache(Int4Scheme(SAW), prefill_tokens),
    "s4kv_saw_rotv": lambda prefill_tokens=None: PagedInt4Cache(Int4Scheme(SAW, rotate_values=True),
                                                                prefill_tokens),
}


@torch.no_grad()
def teacher_forced(model, windows: list[list[int]], make_transform: TransformFactory, top_k: int,
                   batch_size: int = 8, keep_full: bool = False, prefill: int = 1,
                   ) -> tuple[TeacherForced, np.ndarray | None]:
    """Top-k and target log-probs of tokens ``prefill + 1`` onward (Regime.scored), the first ``prefill`` tokens of
    each window stored as one prefill and the rest one token per write; with ``keep_full`` also [S, N, V].

    One forward pass reads every position's context back from the stored format, as a decode step does."""
    scored = slice(prefill + 1, None)  # the tokens; position p's logits predict token p + 1
    top_ids, top_lp, target_lp, full = [], [], [], []
    for start in range(0, len(windows), batch_size):
        ids = torch.tensor(windows[start:start + batch_size], device=model.device)
        with kv_transform(model, make_transform(prefill)):
            logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, prefill:-1]
        top = logprobs.topk(top_k, dim=-1)
        top_ids.append(top.indices.cpu().numpy())
        top_lp.append(top.values.cpu().numpy())
        target_lp.append(logprobs.gather(-1, ids[:, scored, None]).squeeze(-1).cpu().numpy())
        if keep_full:
            full.append(logprobs.cpu().numpy())
    record = TeacherForced(np.concatenate(top_ids), np.concatenate(top_lp), np.concatenate(target_lp),
                           np.array(windows)[:, scored])
    return record, (np.concatenate(full) if keep_full else None)


@torch.no_grad()
def greedy(model, prompts: list[list[int]], generate: int, make_transform: TransformFactory,
           batch_size: int = 8) -> Greedy:
    """Greedy continuation of equal-length prompts, ``generate`` tokens each, through a KV cache."""
    from transformers import DynamicCache

    outputs = []
    for start in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[start:start + batch_size], device=model.device)
        cache, produced = DynamicCache(), []
        with kv_transform(model, make_transform()):
            for _ in range(generate):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
                ids = logits.argmax(-1, keepdim=True)
                produced.append(ids)
        outputs.append(torch.cat(produced, 1).cpu().numpy())
    return Greedy(np.concatenate(outputs))


def load_model(path: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.to(device).eval()


def run_format(model, inputs: list[RegimeInputs], make_transform: TransformFactory, top_k: int,
               batch_size: int = 8) -> dict[str, tuple[TeacherForced, Greedy]]:
    """Teacher-forced and greedy records of one format for every regime."""
    return {
        i.regime.name: (teacher_forced(model, i.windows, make_transform, top_k, batch_size,
                                       prefill=i.regime.prefill)[0],
                        greedy(model, i.prompts, i.regime.generate, make_transform, batch_size))
        for i in inputs
    }
