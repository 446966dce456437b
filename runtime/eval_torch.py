"""The torch engine of `s4kv eval`: the Hugging Face model, no vLLM, K/V through each format's torch reference.

Every layer's post-RoPE keys and values pass through a transform (torch_kv.py) that stores them the way the
format's KV cache would and hands attention what that cache gives back:

* ``s4kv_kivi`` / ``s4kv_saw``: the S4 KV torch reference (``s4kv.kernels.reference``): each sequence and layer
  owns a paged int4 cache; new tokens are written with ``store_kv`` (so KIVI blocks close exactly as in vLLM:
  per channel when one write holds the whole block, else staged) and attention reads ``dequantize_sequence``;
* ``bf16_fa3``: K/V rounded to bf16 (what a bf16 cache holds); the reference of the comparison;
* ``fp8_fa3``: K/V cast to fp8 e4m3 with scale 1 (saturating), as vLLM's fp8 cache without checkpoint scales;
* ``vllm_int4``: an emulation of vLLM's int4_per_token_head: a 128-wide Hadamard with fixed random signs, then
  per-token asymmetric int4 (fp16 scale and min here; vLLM packs its zero point into an fp32 scale).

It runs on the CPU in float32, so CI can check that the metrics are computed correctly on real models.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from s4kv.kernels import reference as ref
from s4kv.kernels.hadamard import block_hadamard
from s4kv.kernels.layout import HEAD_DIM, cache_shape
from s4kv.kernels.scheme import Int4Scheme

from .eval_data import RegimeInputs
from .quality import Greedy, TeacherForced
from .torch_kv import KVTransform, kv_transform

BLOCK_SIZE = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class PagedInt4Cache:
    """Per (layer, sequence) paged int4 caches of one S4 KV scheme; tokens are stored once, in arrival order.

    ``write_chunk`` tokens go to ``store_kv`` per call (None: all new tokens in one call, as one prefill writes them;
    1: one token per call, as decode steps write them, so every int4_kivi block closes staged)."""

    def __init__(self, scheme: Int4Scheme, write_chunk: int | None = None):
        self.scheme = scheme
        self.write_chunk = write_chunk
        self.caches: dict[tuple[int, int], torch.Tensor] = {}
        self.lengths: dict[tuple[int, int], int] = {}

    def _cache_for(self, slot: tuple[int, int], num_kv_heads: int, length: int, device) -> torch.Tensor:
        blocks = -(-length // BLOCK_SIZE)
        cache = self.caches.get(slot)
        if cache is None or cache.shape[0] < blocks:
            grown = torch.zeros(cache_shape(blocks, num_kv_heads, BLOCK_SIZE), dtype=torch.uint8, device=device)
            if cache is not None:
                grown[: cache.shape[0]] = cache
            cache = self.caches[slot] = grown
        return cache

    def __call__(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        batch, num_kv_heads, length, head_dim = key.shape
        if head_dim != HEAD_DIM:
            raise ValueError(f"S4 KV needs head_dim {HEAD_DIM}, the model has {head_dim}")
        keys, values = [], []
        for b in range(batch):
            slot = (layer_idx, b)
            stored = self.lengths.get(slot, 0)
            cache = self._cache_for(slot, num_kv_heads, length, key.device)
            step = self.write_chunk or max(length - stored, 1)
            for start in range(stored, length, step):  # only tokens the cache has not seen yet, as in a paged cache
                new = slice(start, min(start + step, length))
                ref.store_kv(key[b, :, new].transpose(0, 1).float(), value[b, :, new].transpose(0, 1).float(),
                             cache, torch.arange(new.start, new.stop, device=key.device), self.scheme)
            self.lengths[slot] = max(stored, length)
            k, v = ref.dequantize_sequence(cache, torch.arange(cache.shape[0], device=key.device), length, self.scheme)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return torch.stack(keys), torch.stack(values)


def round_to(dtype: torch.dtype) -> KVTransform:
    return lambda layer_idx, key, value: (key.to(dtype).float(), value.to(dtype).float())


def fp8_e4m3(layer_idx: int, key: torch.Tensor, value: torch.Tensor):
    def cast(x):
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return cast(key), cast(value)


class RotatedPerTokenInt4:
    """Emulation of vLLM's int4_per_token_head: random-sign Hadamard over the head, per-token int4."""

    def __init__(self, seed: int = 0x9E3779B9):
        signs = torch.randint(0, 2, (HEAD_DIM,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
        self.rotation = signs[:, None].float() * block_hadamard(HEAD_DIM, HEAD_DIM)  # orthonormal

    def _round_trip(self, x: torch.Tensor) -> torch.Tensor:
        rotation = self.rotation.to(x.device)
        codes, scale, minimum = ref.quantize_per_token(x.float() @ rotation)
        return ref.dequantize_per_token(codes, scale, minimum) @ rotation.T

    def __call__(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        return self._round_trip(key), self._round_trip(value)


# name (as in bench_matrix.FORMATS) -> a fresh transform for one batch of sequences
TORCH_FORMATS: dict[str, Callable[[], KVTransform]] = {
    "bf16_fa3": lambda: round_to(torch.bfloat16),
    "fp8_fa3": lambda: fp8_e4m3,
    "vllm_int4": RotatedPerTokenInt4,
    "s4kv_kivi": lambda: PagedInt4Cache(Int4Scheme("int4_kivi")),
    "s4kv_saw": lambda: PagedInt4Cache(Int4Scheme("int4_saw")),
}


@torch.no_grad()
def teacher_forced(model, windows: list[list[int]], make_transform: Callable[[], KVTransform], top_k: int,
                   batch_size: int = 8, keep_full: bool = False) -> tuple[TeacherForced, np.ndarray | None]:
    """Top-k and target log-probs at every position after the first; with ``keep_full`` also [S, N, V]."""
    top_ids, top_lp, target_lp, full = [], [], [], []
    for start in range(0, len(windows), batch_size):
        ids = torch.tensor(windows[start:start + batch_size], device=model.device)
        with kv_transform(model, make_transform()):
            logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, :-1]
        top = logprobs.topk(top_k, dim=-1)
        top_ids.append(top.indices.cpu().numpy())
        top_lp.append(top.values.cpu().numpy())
        target_lp.append(logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu().numpy())
        if keep_full:
            full.append(logprobs.cpu().numpy())
    record = TeacherForced(np.concatenate(top_ids), np.concatenate(top_lp), np.concatenate(target_lp),
                           np.array(windows)[:, 1:])
    return record, (np.concatenate(full) if keep_full else None)


@torch.no_grad()
def greedy(model, prompts: list[list[int]], generate: int, make_transform: Callable[[], KVTransform],
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


def run_format(model, inputs: list[RegimeInputs], make_transform: Callable[[], KVTransform], top_k: int,
               batch_size: int = 8) -> dict[str, tuple[TeacherForced, Greedy]]:
    """Teacher-forced and greedy records of one format for every regime."""
    return {
        i.regime.name: (teacher_forced(model, i.windows, make_transform, top_k, batch_size)[0],
                        greedy(model, i.prompts, i.regime.generate, make_transform, batch_size))
        for i in inputs
    }
