"""The float64 attention every kernel and benchmark test compares against (kernel tests, tools/bench_kernels)."""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Plain float64 attention: q [q_len, Hq, 128] are the last q_len positions of k, v [seq_len, Hkv, 128]."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seq_len, q_len = k.shape[0], q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
    key_pos = torch.arange(seq_len, device=q.device)
    allowed = key_pos[None, :] <= torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
