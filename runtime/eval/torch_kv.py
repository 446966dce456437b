"""A hook into Hugging Face attention: every layer's post-RoPE keys and values pass through a transform.

transformers 5 looks attention functions up by name (``config._attn_implementation``). We register one
more name that hands ``(layer_idx, key, value)`` to the transform active in the current context, then runs
the stock SDPA attention on what the transform returns. Key statistics (key_stats.py) read keys through it,
and the CPU evaluation path (eval_torch.py) quantizes K/V through it exactly where a KV cache would.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

KV_HOOK = "s4kv_kv_hook"

# (layer_idx, key [B, Hkv, T, D], value [B, Hkv, T, D]) -> (key, value), same shapes; or (key, value, visible):
# keys and values [B, Hkv, S, D] and the bool mask [1, 1, new tokens, S] of what each query sees, which replaces the
# causal mask (what a query reads can depend on its position beyond causality: int4_kivi's open block)
KVTransform = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]

_active: contextvars.ContextVar[KVTransform | None] = contextvars.ContextVar("s4kv_kv_transform", default=None)
_registered = False


def _hooked_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    transform = _active.get()
    if transform is not None:
        # A transform is many small tensor ops (the paged int4 reference: several per stored token); on a CPU one
        # torch thread runs them several times faster than two (no hand-off per op), while the model's matrix
        # products around it keep every thread.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            new_key, new_value, *visible = transform(module.layer_idx, key, value)
        finally:
            torch.set_num_threads(threads)
        key, value = new_key.to(key.dtype), new_value.to(value.dtype)
        if visible:
            attention_mask = visible[0]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Make ``KV_HOOK`` a valid attn_implementation (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(KV_HOOK, _hooked_attention)
    AttentionMaskInterface.register(KV_HOOK, sdpa_mask)
    _registered = True


@contextlib.contextmanager
def kv_transform(model, transform: KVTransform) -> Iterator[None]:
    """Within the block, ``model``'s attention sees K/V only after ``transform``."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(KV_HOOK)
    token = _active.set(transform)
    try:
        yield
    finally:
        _active.reset(token)
        model.set_attn_implementation(previous)
