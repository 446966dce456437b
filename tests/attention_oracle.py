"""The float64 attention every kernel and benchmark test compares against (kernel tests,
tools/device/bench_kernels.py)."""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Plain float64 attention: q [q_len, Hq, 128] are the last q_len positions of k, v [seq_len, Hkv, 128].

    Each query reads only the keys and values it may see (a slice, not a mask), so a NaN or inf at a later
    position cannot reach it: 0 * NaN in a masked product would."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seq_len, q_len = k.shape[0], q.shape[0]
    out = torch.empty_like(q)
    for i in range(q_len):
        visible = seq_len - q_len + i + 1
        scores = torch.einsum("hd,khd->hk", q[i], k[:visible]) * softmax_scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[:visible])
    return out
