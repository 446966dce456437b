"""Prefill / chunked-prefill attention on the H200: s4kv (the fused int4 kernel, and the backend's prefill path,
runtime/plugin/backend.flash_prefill: every token's K/V gathered from the int4 cache into dense bf16 pages, then FA3,
one causal pass, for int4_kivi over segments of a chunk's queries per block) against vLLM's FA3 on a bf16 paged
cache. One call, about a minute; then long prompts (32k-128k tokens) prefilled chunk by chunk as vLLM's
chunked prefill schedules them, where each chunk reads the whole prefix before it: the total attention time of
the prompt, FA3 on bf16 against our dense gather + FA3 pass, per chunk and summed.

python tools/device/bench_prefill.py [--prompts 32768,65536,131072] [--chunk 8192]   (needs vLLM 0.26.0's
vllm_flash_attn, e.g. from shared/devicekit); writes $OUT/bench_prefill.json and $OUT/bench_prefill_chunked.json
FLOPs counted: 4 * q_len * (visible keys) * Hq * 128 per sequence (QK^T and PV, causal half on the new part).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from s4kv.kernels.attention import paged_attention
from s4kv.kernels.prefill_plan import PAGE, plan_prefill_pass
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import allocate_pool, sequence_staging_slots
from s4kv.kernels.store import store_kv

HQ, HKV, D = 28, 4, 128
SCALE = D**-0.5
CASES = [  # (sequences, cached prefix, new tokens)
    (2, 0, 8192),
    (1, 14336, 2048),
    (4, 3584, 512),
    (8, 0, 2048),
]


def flops(n, prefix, q_len):
    return 4 * n * HQ * D * q_len * (prefix + (q_len + 1) / 2)


def backend_prefill(scheme, q, new_keys, cache, block_table, seq_lens, cu_q, out):
    """The backend's FlashAttention prefill of these sequences as a call (plan and dense pages made once, as the
    builder makes them per step). The benchmark's chunks start on block boundaries: int4_kivi reads no pool row."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    from s4kv.runtime.plugin.backend import PrefillPlan, flash_prefill

    q_lens = (cu_q[1:] - cu_q[:-1]).cpu()
    pages = plan_prefill_pass(seq_lens.cpu(), q_lens, scheme.is_kivi)
    dense_k = torch.empty(pages.num_pages, PAGE, HKV, D, dtype=q.dtype, device=q.device)
    plan = PrefillPlan(num_decodes=0, num_decode_tokens=0, decode_max_query_len=0, cu_pages=pages.cu_pages.cuda(),
                       flash=pages.flash.to("cuda"), max_query_len=int(q_lens.max()),
                       max_seq_len=int(seq_lens.max()), dense_k=dense_k, dense_v=torch.empty_like(dense_k),
                       fa_version=get_flash_attn_version())
    own_block = {}
    if scheme.is_kivi:
        own_block = dict(new_keys=new_keys, staged_keys=torch.zeros(1, HKV, PAGE, D, dtype=q.dtype, device=q.device),
                         sequence_slots=torch.full_like(seq_lens, -1))
    return lambda: flash_prefill(q, cache, block_table, seq_lens, cu_q, plan, scheme, SCALE, D, out, **own_block)


def bench_cases():
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = "cuda"
    rows = []
    for n, prefix, q_len in CASES:
        ctx = prefix + q_len
        k = torch.randn(n * ctx, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(n * q_len, HQ, D, device=dev, dtype=torch.bfloat16)
        pos = torch.arange(ctx, device=dev)
        new = (pos >= prefix).repeat(n)
        k_new = k[new]
        seq_lens = torch.full((n,), ctx, dtype=torch.int32, device=dev)
        cu_q = torch.arange(0, n * q_len + 1, q_len, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        timings = {}

        # vLLM FLASH_ATTN: everything (prefix and new tokens) from a bf16 paged cache, block 16
        pages16 = -(-ctx // 16)
        bt16 = torch.randperm(n * pages16, device=dev).view(n, pages16).int()
        cache16 = torch.empty(n * pages16, 16, HKV, 2 * D, dtype=torch.bfloat16, device=dev)
        slots16 = (bt16[:, pos // 16].long() * 16 + pos % 16).reshape(-1)
        cache16.view(-1, HKV, 2 * D)[slots16] = torch.cat([k, v], -1)
        kc, vc = cache16.split(D, -1)
        timings["fa3_bf16_paged"] = triton.testing.do_bench(lambda: flash_attn_varlen_func(
            q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=q_len, seqused_k=seq_lens, max_seqlen_k=ctx,
            softmax_scale=SCALE, causal=True, block_table=bt16, fa_version=3), warmup=10, rep=50, return_mode="median")
        ref_out = out.clone()
        del cache16, kc, vc

        pages = -(-ctx // 128)
        bt = torch.randperm(n * pages, device=dev).view(n, pages).int()
        slots = (bt[:, pos // 128].long() * 128 + pos % 128).reshape(-1)
        for name in ("int4_kivi", "int4_saw"):
            scheme = Int4Scheme(name)
            cache = torch.empty(n * pages, HKV, 128 * 136, dtype=torch.uint8, device=dev)
            # int4_kivi stores through its staging pool: sequence i in slot i
            staging = dict(staged_keys=allocate_pool(n, HKV, PAGE, D, k.dtype, dev),
                           staging_slots=sequence_staging_slots([ctx] * n, dev)) if scheme.is_kivi else {}
            store_kv(k, v, cache, slots, scheme, **staging)
            own_block = dict(new_keys=k_new, staged_keys=torch.zeros(1, HKV, PAGE, D, dtype=q.dtype, device=dev),
                             sequence_slots=torch.full_like(seq_lens, -1)) if scheme.is_kivi else {}
            fused = lambda: paged_attention(q, cache, bt, seq_lens, cu_q, q_len, SCALE, scheme, out, **own_block)
            timings[f"s4kv_{name}_fused"] = triton.testing.do_bench(fused, warmup=10, rep=50, return_mode="median")
            err_fused = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            split = backend_prefill(scheme, q, k_new, cache, bt, seq_lens, cu_q, out)
            timings[f"s4kv_{name}_dense_fa3"] = triton.testing.do_bench(split, warmup=10, rep=50, return_mode="median")
            err_split = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            print(f"  {name}: rel err vs bf16: fused {err_fused:.3f} dense+fa3 {err_split:.3f}", flush=True)
            del cache
        fl = flops(n, prefix, q_len)
        for method, ms in timings.items():
            rows.append(dict(seqs=n, prefix=prefix, q_len=q_len, method=method, ms=ms, tflops=fl / ms / 1e9,
                             vs_fa3=timings["fa3_bf16_paged"] / ms))
            print(f"seqs={n} prefix={prefix:<6d} new={q_len:<5d} {method:24s} {ms*1e3:9.1f} us "
                  f"{fl/ms/1e9:6.0f} TFLOP/s "
                  f"{timings['fa3_bf16_paged']/ms:5.2f}x FA3", flush=True)
    return rows


def bench_chunked(prompt_len: int, chunk: int) -> list[dict]:
    """One prompt of prompt_len tokens prefilled chunk by chunk: chunk i attends to the i * chunk tokens before it
    (from the cache) and to itself, causally. Per chunk: FA3 over vLLM's bf16 paged cache against our backend's
    path (runtime/plugin/backend.flash_prefill over dense pages gathered from the int4 cache)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = "cuda"
    k = torch.randn(prompt_len, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.arange(prompt_len, device=dev)
    pages16 = -(-prompt_len // 16)
    bt16 = torch.randperm(pages16, device=dev).view(1, pages16).int()
    cache16 = torch.empty(pages16, 16, HKV, 2 * D, dtype=torch.bfloat16, device=dev)
    cache16.view(-1, HKV, 2 * D)[(bt16[0, pos // 16].long() * 16 + pos % 16)] = torch.cat([k, v], -1)
    kc, vc = cache16.split(D, -1)
    pages = -(-prompt_len // 128)
    bt = torch.randperm(pages, device=dev).view(1, pages).int()
    slots = bt[0, pos // 128].long() * 128 + pos % 128
    caches = {}
    for name in ("int4_kivi", "int4_saw"):
        scheme = Int4Scheme(name)
        cache = torch.empty(pages, HKV, 128 * 136, dtype=torch.uint8, device=dev)
        pool = allocate_pool(1, HKV, PAGE, D, k.dtype, dev)  # int4_kivi's staging pool: the prompt in slot 0
        for first in range(0, prompt_len, chunk):  # as the prefill stores it, one chunk at a time
            rows = slice(first, first + chunk)
            staging = dict(staged_keys=pool, staging_slots=torch.zeros(len(range(prompt_len)[rows]), device=dev,
                                                                      dtype=torch.long)) if scheme.is_kivi else {}
            store_kv(k[rows], v[rows], cache, slots[rows], scheme, **staging)
        caches[name] = (scheme, cache)
    rows = []
    for start in range(0, prompt_len, chunk):
        q_len = min(chunk, prompt_len - start)
        ctx = start + q_len
        q = torch.randn(q_len, HQ, D, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        timings = {"fa3_bf16_paged": triton.testing.do_bench(lambda: flash_attn_varlen_func(
            q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=q_len, seqused_k=seq_lens, max_seqlen_k=ctx,
            softmax_scale=SCALE, causal=True, block_table=bt16, fa_version=3), warmup=5, rep=20, return_mode="median")}
        ref_out = out.float()
        for name, (scheme, cache) in caches.items():
            dense_fa3 = backend_prefill(scheme, q, k[start:ctx], cache, bt, seq_lens, cu_q, out)
            timings[f"s4kv_{name}_dense_fa3"] = triton.testing.do_bench(dense_fa3, warmup=5, rep=20,
                                                                         return_mode="median")
            err = float((out.float() - ref_out).norm() / ref_out.norm())
            if not err < 0.5:
                raise RuntimeError(f"{name}: chunk at {start} differs from FA3 by {err:.3f}: broken gather?")
        for method, ms in timings.items():
            rows.append(dict(prompt=prompt_len, chunk=chunk, prefix=start, q_len=q_len, method=method, ms=ms,
                             tflops=flops(1, start, q_len) / ms / 1e9))
    return rows


def chunked_summary(rows: list[dict]) -> str:
    """Markdown: per prompt length, each method's summed attention time over all chunks and its ratio to FA3."""
    lines = ["| prompt | chunk | method | attention, all chunks | x FA3 (time) | last chunk |",
             "|---|---|---|---|---|---|"]
    for prompt in sorted({r["prompt"] for r in rows}):
        mine = [r for r in rows if r["prompt"] == prompt]
        total = {m: sum(r["ms"] for r in mine if r["method"] == m) for m in dict.fromkeys(r["method"] for r in mine)}
        last = {r["method"]: r["ms"] for r in mine if r["prefix"] == max(x["prefix"] for x in mine)}
        for method, ms in total.items():
            lines.append(f"| {prompt:,} | {mine[0]['chunk']:,} | {method} | {ms:,.1f} ms | "
                         f"{ms / total['fa3_bf16_paged']:.2f}x | {last[method]:,.2f} ms |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="32768,65536,131072", help="long prompt lengths ('' for none)")
    parser.add_argument("--chunk", type=int, default=8192, help="tokens per prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--no-cases", action="store_true", help="only the long prompts")
    args = parser.parse_args()
    out = os.environ.get("OUT", ".")
    if not args.no_cases:
        with open(os.path.join(out, "bench_prefill.json"), "w") as f:
            json.dump(bench_cases(), f, indent=1)
    rows = []
    for prompt in [int(p) for p in args.prompts.split(",") if p]:
        rows += bench_chunked(prompt, args.chunk)
        torch.cuda.empty_cache()
    if rows:
        with open(os.path.join(out, "bench_prefill_chunked.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print(chunked_summary(rows))


if __name__ == "__main__":
    main()
