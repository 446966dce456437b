#!/usr/bin/env python3
"""Kernel benchmark (issue 2; the kernel-level evidence for issue 4), one H200 call, well under 6 minutes.

Decode attention (one query token per sequence) with the Qwen2.5-7B attention shape (28 query heads,
4 KV heads, head_dim 128, bf16 queries) at contexts 1k/4k/16k/32k and batches 1/32/256, for:
  fa3_bf16   vLLM 0.26.0's FlashAttention-3 on a bf16 paged cache (block 16), as its FLASH_ATTN backend
             calls it under CUDA graphs (scheduler metadata, num_splits 32)
  vllm_int4  vLLM 0.26.0's int4_per_token_head path (block 16): unified_attention_int4, RHT of q/out included,
             3D split-KV up to 32 sequences like its TRITON_ATTN backend
  s4kv_kivi, s4kv_saw   s4kv.kernels.attention.paged_attention (block 128)
and the store kernels (s4kv store_kv vs vLLM's reshape_and_cache_int4) for a decode step and a prefill chunk.

Every cache is filled through its own store path from the same random K/V, pages are handed out in a
shuffled order (as a long-running server's allocator does), and each output is compared with FA3's
(a sanity check that every kernel computed attention, not a quality measurement). Times are medians
of CUDA-graph replays by triton.testing.do_bench, which clears the L2 before each replay. Achieved
GB/s counts the bytes that must move: the K/V of every context token (int4 136 B, bf16 512 B per token
and KV head) plus q and out. A device-to-device copy gives the bandwidth ceiling.

  python tools/bench_kernels.py --out DIR      # writes DIR/kernels.json and DIR/kernels.md, prints the tables
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 28, 4, 128
BYTES_PER_TOKEN_HEAD = {"int4": 136, "bf16": 2 * HEAD_DIM * 2}
METHODS = ("fa3_bf16", "vllm_int4", "s4kv_kivi", "s4kv_saw")
FORMAT_OF = {"fa3_bf16": "bf16", "vllm_int4": "int4", "s4kv_kivi": "int4", "s4kv_saw": "int4"}
VLLM_BLOCK_SIZE = 16  # vLLM 0.26.0's default block size for FLASH_ATTN and TRITON_ATTN
S4KV_BLOCK_SIZE = 128  # our backend forces 128 (a KIVI key group is one page)
FA3_MAX_SPLITS = 32  # attention_config.flash_attn_max_num_splits_for_cuda_graph
VLLM_SEQ_THRESHOLD_3D = 32  # TritonAttentionMetadataBuilder: 128 // num_kv_heads, snapped to a capture size
VLLM_SOFTMAX_SEGMENTS = 16
FILL_CHUNK_TOKENS = 1 << 20  # K/V generated and stored this many tokens at a time (bounded memory)
SANITY_MAX_REL_ERR = 0.5  # int4 attention lands near 0.1 of FA3's output; far above means a broken kernel


# ---------------------------------------------------------------- arithmetic (CPU-tested)

def decode_bytes(batch: int, context: int, kv_format: str) -> int:
    """Fewest bytes one decode step must move: every cached K/V token once, plus q read and out written (bf16)."""
    kv = batch * context * NUM_KV_HEADS * BYTES_PER_TOKEN_HEAD[kv_format]
    return kv + 2 * batch * NUM_Q_HEADS * HEAD_DIM * 2


def store_bytes(tokens: int, kv_format: str) -> int:
    """Store: read bf16 K and V of the new tokens, write them in the cache format."""
    return tokens * NUM_KV_HEADS * (BYTES_PER_TOKEN_HEAD["bf16"] + BYTES_PER_TOKEN_HEAD[kv_format])


def shuffled_block_table(batch: int, pages_per_seq: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, pages_per_seq] int32: every page used once, in random order (no two sequences share one)."""
    return torch.randperm(batch * pages_per_seq, generator=generator).to(torch.int32).view(batch, pages_per_seq)


def slots_for(block_table: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """vLLM slot ids (page * block_size + offset) of token `positions[i]` of sequence `seqs[i]`."""
    pages = block_table[seqs.long(), (positions // block_size).long()].long()
    return pages * block_size + positions.long() % block_size


@dataclass(frozen=True)
class Timing:
    """One measurement; for a store, `batch` is the number of tokens stored and `context` is 0."""

    method: str
    batch: int
    context: int
    ms: float | None
    bytes: int
    rel_err_vs_fa3: float | None = None
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.ms / 1e6 if self.ms else None


def render_decode_table(timings: list[Timing], copy_gbps: float | None) -> str:
    """Markdown: one row per (batch, context), one column per method: time, GB/s, speed vs FA3."""
    by_key = {(t.batch, t.context, t.method): t for t in timings}
    keys = sorted({(t.batch, t.context) for t in timings})
    methods = [m for m in METHODS if any(t.method == m for t in timings)]
    lines = ["| batch | context | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for batch, context in keys:
        fa3 = by_key.get((batch, context, "fa3_bf16"))
        cells = []
        for method in methods:
            t = by_key.get((batch, context, method))
            if t is None or t.ms is None:
                cells.append("not run" if t is None or not t.error else f"failed: {t.error.splitlines()[0][:60]}")
                continue
            cell = f"{t.ms * 1e3:,.0f} us, {t.gbps:,.0f} GB/s"
            if fa3 is not None and fa3.ms:
                cell += f", {fa3.ms / t.ms:.2f}x"
            cells.append(cell)
        lines.append(f"| {batch} | {context:,} | " + " | ".join(cells) + " |")
    ceiling = f"; copy ceiling {copy_gbps:,.0f} GB/s" if copy_gbps else ""
    lines.append("")
    lines.append(f"median CUDA-graph replay; GB/s = bytes that must move / time{ceiling}; "
                 "Nx = FA3 time / this time (above 1 is faster than FA3)")
    return "\n".join(lines) + "\n"


def render_store_table(timings: list[Timing]) -> str:
    lines = ["| tokens | method | time | GB/s |", "|---|---|---|---|"]
    for t in timings:
        result = f"{t.ms * 1e3:,.1f} us | {t.gbps:,.0f}" if t.ms else f"failed | {(t.error or '').splitlines()[0][:60]}"
        lines.append(f"| {t.batch:,} | {t.method} | {result} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- GPU side

def median_ms(fn) -> float:
    """Median of CUDA-graph replays of fn (captured after two eager calls, which also JIT-compile)."""
    import triton.testing

    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 4 GiB, bytes read plus written over the median time."""
    import triton.testing

    src = torch.randn(1 << 30, device="cuda")  # 4 GiB of fp32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


class Caches:
    """The four paged caches of one (batch, context) config, filled with the same random K/V."""

    def __init__(self, batch: int, context: int, generator: torch.Generator, kv_pool: torch.Tensor):
        from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4

        from s4kv.kernels.layout import cache_shape
        from s4kv.kernels.scheme import Int4Scheme
        from s4kv.kernels.store import store_kv

        self.batch, self.context = batch, context
        small_pages = math.ceil(context / VLLM_BLOCK_SIZE)
        big_pages = math.ceil(context / S4KV_BLOCK_SIZE)
        self.table_small = shuffled_block_table(batch, small_pages, generator).cuda()
        self.table_big = shuffled_block_table(batch, big_pages, generator).cuda()
        n_small, n_big = batch * small_pages, batch * big_pages
        # vLLM's logical (blocks, kv heads, block, content) cache is physically NHD: (blocks, block, kv heads, content)
        self.bf16 = torch.empty(n_small, VLLM_BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.int4 = torch.empty(n_small, VLLM_BLOCK_SIZE, NUM_KV_HEADS, 136, dtype=torch.uint8, device="cuda")
        self.int4_k, self.int4_v = self.int4.split(68, dim=-1)
        as_f32 = self.int4.view(torch.float32)  # 34 floats per (slot, head): K scale at byte 64, V scale at 132
        self.int4_k_scale, self.int4_v_scale = as_f32[..., 16], as_f32[..., 33]
        self.schemes = {"s4kv_kivi": Int4Scheme.parse({"scheme": "int4_kivi"}),
                        "s4kv_saw": Int4Scheme.parse({"scheme": "int4_saw"})}
        self.s4kv = {name: torch.empty(cache_shape(n_big, NUM_KV_HEADS, S4KV_BLOCK_SIZE), dtype=torch.uint8,
                                       device="cuda") for name in self.schemes}
        seqs_per_chunk = max(1, FILL_CHUNK_TOKENS // context)
        for first in range(0, batch, seqs_per_chunk):
            seqs = torch.arange(first, min(batch, first + seqs_per_chunk), device="cuda")
            n = len(seqs) * context
            seq_ids = seqs.repeat_interleave(context)
            positions = torch.arange(context, device="cuda").repeat(len(seqs))
            key, value = kv_pool[0, :n], kv_pool[1, :n]
            small = slots_for(self.table_small, seq_ids, positions, VLLM_BLOCK_SIZE)
            self.bf16.view(-1, NUM_KV_HEADS, 2 * HEAD_DIM)[small] = torch.cat([key, value], dim=-1)
            reshape_and_cache_int4(key, value, self.int4_k, self.int4_v, small,
                                   k_scale_cache=self.int4_k_scale, v_scale_cache=self.int4_v_scale)
            big = slots_for(self.table_big, seq_ids, positions, S4KV_BLOCK_SIZE)
            for name, scheme in self.schemes.items():
                store_kv(key, value, self.s4kv[name], big, scheme)
        torch.cuda.synchronize()

    def gib(self) -> float:
        tensors = [self.bf16, self.int4, *self.s4kv.values()]
        return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def decode_calls(caches: Caches, query: torch.Tensor) -> dict:
    """method -> (zero-argument call that writes its output, output tensor)."""
    from vllm.v1.attention.ops.int4_per_token_head import unified_attention_int4
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    from s4kv.kernels.attention import SplitWorkspace, paged_attention

    batch, context = caches.batch, caches.context
    scale = HEAD_DIM ** -0.5
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    outs = {m: torch.full_like(query, float("nan")) for m in METHODS}  # poisoned: every element must be written
    calls = {}

    fa3_meta = get_scheduler_metadata(
        batch_size=batch, max_seqlen_q=1, max_seqlen_k=context, num_heads_q=NUM_Q_HEADS,
        num_heads_kv=NUM_KV_HEADS, headdim=HEAD_DIM, cache_seqlens=seq_lens, qkv_dtype=torch.bfloat16,
        cu_seqlens_q=cu_q, page_size=VLLM_BLOCK_SIZE, causal=True, window_size=(-1, -1), num_splits=FA3_MAX_SPLITS)
    k_bf16, v_bf16 = caches.bf16.split(HEAD_DIM, dim=-1)
    calls["fa3_bf16"] = lambda: flash_attn_varlen_func(
        q=query, k=k_bf16, v=v_bf16, out=outs["fa3_bf16"], cu_seqlens_q=cu_q, max_seqlen_q=1,
        seqused_k=seq_lens, max_seqlen_k=context, softmax_scale=scale, causal=True, window_size=[-1, -1],
        block_table=caches.table_small, softcap=0.0, scheduler_metadata=fa3_meta, fa_version=3,
        num_splits=FA3_MAX_SPLITS)

    segm = dict(
        softmax_segm_output=torch.empty(VLLM_SEQ_THRESHOLD_3D, NUM_Q_HEADS, VLLM_SOFTMAX_SEGMENTS, HEAD_DIM,
                                        dtype=torch.float32, device="cuda"),
        softmax_segm_max=torch.empty(VLLM_SEQ_THRESHOLD_3D, NUM_Q_HEADS, VLLM_SOFTMAX_SEGMENTS,
                                     dtype=torch.float32, device="cuda"),
        softmax_segm_expsum=torch.empty(VLLM_SEQ_THRESHOLD_3D, NUM_Q_HEADS, VLLM_SOFTMAX_SEGMENTS,
                                        dtype=torch.float32, device="cuda"))
    calls["vllm_int4"] = lambda: unified_attention_int4(
        q=query, k_cache=caches.int4_k, v_cache=caches.int4_v, out=outs["vllm_int4"], cu_seqlens_q=cu_q,
        max_seqlen_q=1, seqused_k=seq_lens, max_seqlen_k=context, softmax_scale=scale, window_size=(-1, -1),
        block_table=caches.table_small, softcap=0.0, sinks=None, alibi_slopes=None, use_alibi_sqrt=False,
        qq_bias=None, output_scale=None, mm_prefix_range=None, k_scale_cache=caches.int4_k_scale,
        v_scale_cache=caches.int4_v_scale, seq_threshold_3D=VLLM_SEQ_THRESHOLD_3D,
        num_par_softmax_segments=VLLM_SOFTMAX_SEGMENTS, **segm)

    workspace = SplitWorkspace.allocate(batch, NUM_Q_HEADS, "cuda")
    for name, scheme in caches.schemes.items():
        rotation = scheme.rotation("cuda")
        calls[name] = (lambda name=name, scheme=scheme, rotation=rotation: paged_attention(
            query, caches.s4kv[name], caches.table_big, seq_lens, cu_q, 1, scale, scheme, rotation, outs[name],
            workspace=workspace))
    return {m: (calls[m], outs[m]) for m in METHODS}


def bench_decode(batch: int, context: int, generator: torch.Generator, kv_pool: torch.Tensor) -> list[Timing]:
    caches = Caches(batch, context, generator, kv_pool)
    print(f"  batch {batch} context {context}: caches {caches.gib():.1f} GiB", flush=True)
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    timings = []
    reference = None
    for method, (call, out) in decode_calls(caches, query).items():
        nbytes = decode_bytes(batch, context, FORMAT_OF[method])
        try:
            ms = median_ms(call)
            if not torch.isfinite(out).all():
                raise RuntimeError("output has NaN/inf (unwritten or broken)")
            if method == "fa3_bf16":
                reference = out.float()
            err = None if reference is None else float((out.float() - reference).norm() / reference.norm())
            if err is not None and err > SANITY_MAX_REL_ERR:
                raise RuntimeError(f"output differs from FA3 by {err:.3f} (relative): kernel broken?")
            timings.append(Timing(method, batch, context, ms, nbytes, err))
        except Exception as exc:  # one broken method must not hide the others' numbers
            traceback.print_exc()
            timings.append(Timing(method, batch, context, None, nbytes, error=f"{type(exc).__name__}: {exc}"))
    del caches
    torch.cuda.empty_cache()
    return timings


def bench_store(generator: torch.Generator) -> list[Timing]:
    """A decode step (one token per sequence, random pages and offsets) and an 8192-token prefill chunk."""
    from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4

    from s4kv.kernels.layout import cache_shape
    from s4kv.kernels.scheme import Int4Scheme
    from s4kv.kernels.store import store_kv

    total_tokens = 1 << 19
    int4 = torch.zeros(total_tokens // VLLM_BLOCK_SIZE, VLLM_BLOCK_SIZE, NUM_KV_HEADS, 136, dtype=torch.uint8,
                       device="cuda")
    int4_k, int4_v = int4.split(68, dim=-1)
    int4_k_scale, int4_v_scale = int4.view(torch.float32)[..., 16], int4.view(torch.float32)[..., 33]
    ours = torch.zeros(cache_shape(total_tokens // S4KV_BLOCK_SIZE, NUM_KV_HEADS, S4KV_BLOCK_SIZE),
                       dtype=torch.uint8, device="cuda")
    timings = []
    for tokens, contiguous in ((256, False), (8192, True)):
        if contiguous:
            slots = torch.randperm(total_tokens // S4KV_BLOCK_SIZE, generator=generator)[:tokens // S4KV_BLOCK_SIZE]
            slots = (slots[:, None] * S4KV_BLOCK_SIZE + torch.arange(S4KV_BLOCK_SIZE)).flatten()
        else:
            slots = torch.randperm(total_tokens, generator=generator)[:tokens]
        slots = slots.cuda()
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        value = torch.randn_like(key)
        calls = {"vllm_int4": lambda: reshape_and_cache_int4(key, value, int4_k, int4_v, slots,
                                                             k_scale_cache=int4_k_scale,
                                                             v_scale_cache=int4_v_scale)}
        for name in ("int4_kivi", "int4_saw"):
            scheme = Int4Scheme.parse({"scheme": name})
            calls[f"s4kv_{name[5:]}"] = lambda scheme=scheme: store_kv(key, value, ours, slots, scheme)
        for method, call in calls.items():
            try:
                timings.append(Timing(method, tokens, 0, median_ms(call), store_bytes(tokens, "int4")))
            except Exception as exc:
                traceback.print_exc()
                timings.append(Timing(method, tokens, 0, None, store_bytes(tokens, "int4"),
                                      error=f"{type(exc).__name__}: {exc}"))
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--contexts", default="1024,4096,16384,32768")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--budget-s", type=float, default=300,
                        help="skip the remaining decode configs once this much time has passed")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU (run it on the H200 through tools/device_bench.sh)")
    start = time.monotonic()
    import triton
    import vllm

    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:,.0f} GB/s", flush=True)
    largest = max(batches) * max(contexts)
    pool_tokens = min(largest, FILL_CHUNK_TOKENS)
    kv_pool = torch.randn(2, pool_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")

    decode: list[Timing] = []
    skipped = []
    for batch in batches:
        for context in contexts:
            if time.monotonic() - start > args.budget_s:
                skipped.append((batch, context))
                continue
            decode += bench_decode(batch, context, generator, kv_pool)
    store = bench_store(generator)

    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "vllm": vllm.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "copy_gbps": copy_gbps, "skipped_for_budget": skipped, "seconds": time.monotonic() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    as_dicts = lambda ts: [{**t.__dict__, "gbps": t.gbps} for t in ts]  # noqa: E731
    (args.out / "kernels.json").write_text(json.dumps({"meta": meta, "decode": as_dicts(decode),
                                                        "store": as_dicts(store)}, indent=1))
    title = f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, vLLM {meta['vllm']}, {meta['date']}"
    report = (f"Decode attention, Qwen2.5-7B shape ({NUM_Q_HEADS} q / {NUM_KV_HEADS} KV heads, d {HEAD_DIM}), "
              f"{title}\n\n{render_decode_table(decode, copy_gbps)}\nStore (K+V of new tokens)\n\n"
              f"{render_store_table(store)}")
    if skipped:
        report += f"\nskipped for the time budget: {skipped}\n"
    (args.out / "kernels.md").write_text(report)
    print("\n" + report)
    failed = [t for t in decode + store if t.error]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
