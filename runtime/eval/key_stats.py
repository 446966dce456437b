"""Per-channel key magnitude statistics: do a model's keys have outlier channels?

Trained transformers concentrate key energy in a few channels (mostly low-frequency RoPE pairs); random
weights do not. Those channels stretch a per-token int4 range, which is what makes int4 keys hard and what
KIVI (per-channel keys) and SAW (Hadamard-rotated keys) address. The statistics are taken on the keys
as the KV cache stores them: after RoPE, one 128-channel vector per token and KV head.
"""

from __future__ import annotations

import torch

from .torch_kv import kv_transform

OUTLIER_FACTOR = 4.0  # a channel is an outlier when its mean |k| is this many times the head's median channel


def collect_keys(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Post-RoPE keys of every layer for ``input_ids`` [B, T]: a list of [B, Hkv, T, D] float32 tensors."""
    keys: dict[int, torch.Tensor] = {}

    def record(layer_idx, key, value):
        keys[layer_idx] = key.detach().float()
        return key, value

    with torch.no_grad(), kv_transform(model, record):
        model(input_ids=input_ids)
    return [keys[i] for i in sorted(keys)]


def channel_stats(keys: torch.Tensor) -> dict:
    """Statistics of one layer's keys [B, Hkv, T, D]: per KV head, how far the largest channels stand out."""
    heads = []
    for h in range(keys.shape[1]):
        k = keys[:, h].reshape(-1, keys.shape[-1])  # [tokens, D]
        channel_mag = k.abs().mean(0)  # mean |k| per channel
        median = channel_mag.median().clamp_min(1e-12)
        top = torch.topk(channel_mag, 4)
        token_absmax = k.abs().amax(-1)
        heads.append({
            "max_over_median": float(channel_mag.max() / median),
            "outlier_channels": int((channel_mag > OUTLIER_FACTOR * median).sum()),
            "top_channels": top.indices.tolist(),
            "top_over_median": [round(float(v / median), 2) for v in top.values],
            # per-token dynamic range relative to the typical value: what one int4 scale must span
            "token_absmax_over_channel_median": float(token_absmax.mean() / median),
        })
    return {
        "max_over_median": max(h["max_over_median"] for h in heads),
        "outlier_channels": sum(h["outlier_channels"] for h in heads),
        "heads": heads,
    }


def model_key_stats(model, input_ids: torch.Tensor) -> list[dict]:
    """``channel_stats`` of every layer."""
    return [channel_stats(k) for k in collect_keys(model, input_ids)]


def format_table(stats: list[dict], title: str) -> str:
    """A small Markdown table: one row per layer."""
    rows = [f"| {title} layer | max/median channel mean |k| | channels > {OUTLIER_FACTOR:g}x median | top channels |",
            "|---|---|---|---|"]
    for i, layer in enumerate(stats):
        tops = "; ".join(",".join(str(c) for c in h["top_channels"][:2]) for h in layer["heads"])
        rows.append(f"| {i} | {layer['max_over_median']:.1f} | {layer['outlier_channels']} | {tops} |")
    return "\n".join(rows)
