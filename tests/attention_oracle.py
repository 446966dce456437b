"""The float64 attention every kernel and benchmark test compares against (kernel tests,
tools/device/bench_kernels.py), and FlashAttention's varlen call emulated from its documentation (the prefill and
backend tests without a GPU)."""

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


def emulated_flash(q, dense_k, dense_v, fa_pass, softmax_scale):
    """The float64 output [T, Hq, D] of one causal flash_attn_varlen_func call, from its documentation: paged K/V
    ``dense_k``/``dense_v`` [pages, block, Hkv, D] through ``fa_pass`` (kernels.prefill_plan.FlashPass: an entry per
    query range, its pages and its ``seqused_k`` keys), causal bottom-right aligned."""
    group = q.shape[1] // dense_k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu = fa_pass.cu_seqlens_q.tolist()
    for e in range(len(cu) - 1):
        used = int(fa_pass.seqused_k[e])
        pages = fa_pass.block_table[e].long()
        k = dense_k.cpu()[pages].flatten(0, 1)[:used].double().repeat_interleave(group, 1)
        v = dense_v.cpu()[pages].flatten(0, 1)[:used].double().repeat_interleave(group, 1)
        rows = q[cu[e] : cu[e + 1]].cpu().double()
        scores = torch.einsum("qhd,khd->hqk", rows, k) * softmax_scale
        n_q = rows.shape[0]
        visible = torch.arange(used)[None, :] <= (used - n_q + torch.arange(n_q))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[e] : cu[e + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
