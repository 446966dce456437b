#!/usr/bin/env python3
"""Kernel benchmark (the kernel-level evidence behind `s4kv bench`), one H200 call, well under 6 minutes.

Decode attention (one query token per sequence) with the attention shapes of Qwen2.5-7B (28 query heads, 4 KV
heads: GQA 7) and Llama-3.1-8B (32 / 8: GQA 4), head_dim 128, bf16 queries, at contexts 1k/4k/16k/32k and
batches 1/32/128/256, for:
  fa3_bf16   vLLM 0.26.0's FlashAttention-3 on a bf16 paged cache (block 16), as its FLASH_ATTN backend
             calls it under CUDA graphs (scheduler metadata, num_splits 32)
  fa3_fp8    the same on vLLM's fp8 (e4m3) cache: queries quantized to fp8 too, descales of 1 (kv_cache_dtype fp8)
  vllm_int4  vLLM 0.26.0's int4_per_token_head path (block 16): unified_attention_int4, RHT of q/out included,
             3D split-KV up to 32 sequences like its TRITON_ATTN backend
  s4kv_kivi, s4kv_saw   s4kv.kernels.attention.paged_attention (block 128) at the launch it picks itself
             (DECODE_LAUNCH with DECODE_SPLITS' plan: what the backend runs)
  s4kv_*_biased, s4kv_*_sub, s4kv_*_ptx, s4kv_*_sub_ptx   DECODE_LAUNCH with each code path forced
             (attention.CODE_PATHS: codes biased or as fp16 subnormal MMA operands, unpacked by Triton ops or by
             inline PTX)
  s4kv_saw_rotv   int4_saw with its rotate_values option (values rotated like keys, as vLLM's int4 does), at the
             committed decode launch
  --launch NAME=SCHEME:FIELD=VALUE,...   more methods: SCHEME's DECODE_LAUNCH with LaunchConfig fields
             replaced, e.g. a register cap, the codes read two bytes per element:
             --launch s4kv_kivi_w128=int4_kivi:wide_code_loads=true,max_registers=128
             or with no field, the committed launch once more, timed after the others: a control column, whose
             ratio to the scheme's own column is this harness's order effect (--launch s4kv_kivi_again=int4_kivi:)
and the store kernels (s4kv store_kv vs vLLM's reshape_and_cache_int4) for a decode step and a prefill chunk.

Every cache is filled through its own store path from the same random K/V, pages are handed out in a
shuffled order (as a long-running server's allocator does), and each output is compared with FA3's
(a sanity check that every kernel computed attention, not a quality measurement). Times are medians
of CUDA-graph replays by triton.testing.do_bench, which clears the L2 before each replay. Achieved
GB/s counts the bytes that must move: the K/V of every context token (int4 136 B, bf16 512 B per token
and KV head) plus q and out. A device-to-device copy gives the bandwidth ceiling.

  python tools/device/bench_kernels.py --out DIR      # writes DIR/kernels.json and DIR/kernels.md, prints the tables
  python tools/device/bench_kernels.py --out DIR --methods fa3_bf16,s4kv_kivi,s4kv_saw --shapes llama-3.1-8b
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

# (query heads, KV heads) of the attention shapes the benchmark knows; the first is the default
SHAPES = {"qwen2.5-7b": (28, 4), "llama-3.1-8b": (32, 8)}
NUM_Q_HEADS, NUM_KV_HEADS = SHAPES["qwen2.5-7b"]
HEAD_DIM = 128
BYTES_PER_TOKEN_HEAD = {"int4": 136, "fp8": 2 * HEAD_DIM, "bf16": 2 * HEAD_DIM * 2}
# code path forced (kernels.attention.CODE_PATHS) -> method-name suffix; no suffix: the committed launch
CODE_PATH_SUFFIX = {None: "", "biased": "_biased", "subnormal": "_sub", "biased+ptx": "_ptx",
                    "subnormal+ptx": "_sub_ptx"}
METHODS = ("fa3_bf16", "fa3_fp8", "vllm_int4") + tuple(f"s4kv_{scheme}{suffix}" for suffix in CODE_PATH_SUFFIX.values()
                                             for scheme in ("kivi", "saw")) + ("s4kv_saw_rotv",)
FORMAT_OF = {method: {"fa3_bf16": "bf16", "fa3_fp8": "fp8"}.get(method, "int4") for method in METHODS}
VLLM_BLOCK_SIZE = 16  # vLLM 0.26.0's default block size for FLASH_ATTN and TRITON_ATTN
S4KV_BLOCK_SIZE = 128  # our backend forces 128 (a KIVI key group is one page)
FA3_MAX_SPLITS = 32  # attention_config.flash_attn_max_num_splits_for_cuda_graph
VLLM_SEQ_THRESHOLD_3D = 32  # TritonAttentionMetadataBuilder: 128 // num_kv_heads, snapped to a capture size
VLLM_SOFTMAX_SEGMENTS = 16
FILL_CHUNK_TOKENS = 1 << 20  # K/V generated and stored this many tokens at a time (bounded memory)
SANITY_MAX_REL_ERR = 0.5  # int4 attention lands near 0.1 of FA3's output; far above means a broken kernel


# ---------------------------------------------------------------- arithmetic (CPU-tested)

def decode_bytes(batch: int, context: int, kv_format: str, num_q_heads: int = NUM_Q_HEADS,
                 num_kv_heads: int = NUM_KV_HEADS) -> int:
    """Fewest bytes one decode step must move: every cached K/V token once, plus q read and out written (bf16)."""
    kv = batch * context * num_kv_heads * BYTES_PER_TOKEN_HEAD[kv_format]
    return kv + 2 * batch * num_q_heads * HEAD_DIM * 2


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
    shape: str = "qwen2.5-7b"
    sm_mhz: int | None = None  # sm_clock_mhz() right after the timing

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.ms / 1e6 if self.ms else None


def render_decode_table(timings: list[Timing], copy_gbps: float | None) -> str:
    """Markdown: one row per (shape, batch, context), one column per method: time, GB/s, speed vs FA3."""
    by_key = {(t.shape, t.batch, t.context, t.method): t for t in timings}
    keys = sorted({(list(SHAPES).index(t.shape), t.shape, t.batch, t.context) for t in timings})
    methods = [m for m in DECODE_METHODS if any(t.method == m for t in timings)]
    lines = ["| shape (GQA) | batch | context | " + " | ".join(methods) + " |",
             "|---|---|---|" + "---|" * len(methods)]
    for _, shape, batch, context in keys:
        fa3 = by_key.get((shape, batch, context, "fa3_bf16"))
        cells = []
        for method in methods:
            t = by_key.get((shape, batch, context, method))
            if t is None or t.ms is None:
                cells.append("not run" if t is None or not t.error else f"failed: {t.error.splitlines()[0][:60]}")
                continue
            cell = f"{t.ms * 1e3:,.0f} us, {t.gbps:,.0f} GB/s"
            if fa3 is not None and fa3.ms:
                cell += f", {fa3.ms / t.ms:.2f}x"
            cells.append(cell)
        group = SHAPES[shape][0] // SHAPES[shape][1]
        lines.append(f"| {shape} ({group}) | {batch} | {context:,} | " + " | ".join(cells) + " |")
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

def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median of CUDA-graph replays of fn (captured after two eager calls, which also JIT-compile)."""
    import triton.testing

    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def sm_clock_mhz() -> int | None:
    """The SM clock over NVML's last sample period, read right after a timing (None without NVML): a memory-bound
    loop timed after others at long contexts measured up to 1.19x slower than the same launch timed first, so the
    rows say at which clock each ran."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # pynvml missing or NVML unavailable: the timing stands without it
        return None


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 4 GiB, bytes read plus written over the median time."""
    import triton.testing

    src = torch.randn(1 << 30, device="cuda")  # 4 GiB of fp32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


@dataclass
class DecodeProblem:
    """One decode step of `batch` sequences of `context` tokens. Every cache format stores the same K/V:
    token t of sequence s is row (s % seqs_per_chunk) * context + t of the random pool (see chunks)."""

    batch: int
    context: int
    query: torch.Tensor  # [batch, Hq, D]
    kv_pool: torch.Tensor  # [2, pool_tokens, Hkv, D], same dtype as query

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def num_q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_pool.shape[2]

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.full((self.batch,), self.context, dtype=torch.int32, device=self.device)

    @property
    def query_start_loc(self) -> torch.Tensor:
        return torch.arange(self.batch + 1, dtype=torch.int32, device=self.device)

    @property
    def seqs_per_chunk(self) -> int:
        return max(1, min(FILL_CHUNK_TOKENS, self.kv_pool.shape[1]) // self.context)

    def chunks(self, block_table: torch.Tensor, block_size: int):
        """(key, value, slot_mapping) pieces covering every cached token, a bounded number of tokens at a time."""
        seqs_per_chunk = self.seqs_per_chunk
        positions = torch.arange(self.context, device=self.device)
        for first in range(0, self.batch, seqs_per_chunk):
            seqs = torch.arange(first, min(self.batch, first + seqs_per_chunk), device=self.device)
            n = len(seqs) * self.context
            slots = slots_for(block_table, seqs.repeat_interleave(self.context), positions.repeat(len(seqs)),
                              block_size)
            yield self.kv_pool[0, :n], self.kv_pool[1, :n], slots


def build_fa3(problem: DecodeProblem, block_table: torch.Tensor, out: torch.Tensor, fp8: bool = False):
    """bf16 (or fp8 e4m3) paged cache (vLLM's NHD layout, K and V halves of one tensor) read by FA3 as FLASH_ATTN
    does. fp8: K, V and the query in e4m3 with descales of 1 (the random K/V are well inside e4m3's range)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    num_kv_heads = problem.num_kv_heads
    dtype = torch.float8_e4m3fn if fp8 else problem.query.dtype
    cache = torch.empty(block_table.numel(), VLLM_BLOCK_SIZE, num_kv_heads, 2 * HEAD_DIM, dtype=dtype,
                        device=problem.device)
    for key, value, slots in problem.chunks(block_table, VLLM_BLOCK_SIZE):
        cache.view(-1, num_kv_heads, 2 * HEAD_DIM)[slots] = torch.cat([key, value], dim=-1).to(dtype)
    key_cache, value_cache = cache.split(HEAD_DIM, dim=-1)
    seq_lens, cu_q = problem.seq_lens, problem.query_start_loc
    query = problem.query.to(dtype)
    descales = {}
    if fp8:
        ones = torch.ones(problem.batch, num_kv_heads, dtype=torch.float32, device=problem.device)
        descales = dict(q_descale=ones, k_descale=ones, v_descale=ones)
    metadata = get_scheduler_metadata(
        batch_size=problem.batch, max_seqlen_q=1, max_seqlen_k=problem.context, num_heads_q=problem.num_q_heads,
        num_heads_kv=num_kv_heads, headdim=HEAD_DIM, cache_seqlens=seq_lens, qkv_dtype=dtype,
        cu_seqlens_q=cu_q, page_size=VLLM_BLOCK_SIZE, causal=True, window_size=(-1, -1), num_splits=FA3_MAX_SPLITS)
    return lambda: flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
        seqused_k=seq_lens, max_seqlen_k=problem.context, softmax_scale=HEAD_DIM ** -0.5, causal=True,
        window_size=[-1, -1], block_table=block_table, softcap=0.0, scheduler_metadata=metadata, fa_version=3,
        num_splits=FA3_MAX_SPLITS, **descales)


def build_vllm_int4(problem: DecodeProblem, block_table: torch.Tensor, out: torch.Tensor):
    """vLLM's int4_per_token_head cache and attention, laid out and called as TritonAttentionImpl does."""
    from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4, unified_attention_int4

    # physical (blocks, block, kv heads, 136): [K codes 64 | K fp32 scale | V codes 64 | V fp32 scale]
    cache = torch.empty(block_table.numel(), VLLM_BLOCK_SIZE, problem.num_kv_heads, 136, dtype=torch.uint8,
                        device=problem.device)
    key_cache, value_cache = cache.split(68, dim=-1)
    as_f32 = cache.view(torch.float32)
    k_scale, v_scale = as_f32[..., 16], as_f32[..., 33]  # bytes 64 and 132
    for key, value, slots in problem.chunks(block_table, VLLM_BLOCK_SIZE):
        reshape_and_cache_int4(key, value, key_cache, value_cache, slots, k_scale_cache=k_scale, v_scale_cache=v_scale)
    segments = (VLLM_SEQ_THRESHOLD_3D, problem.num_q_heads, VLLM_SOFTMAX_SEGMENTS)
    buffers = dict(
        softmax_segm_output=torch.empty(*segments, HEAD_DIM, dtype=torch.float32, device=problem.device),
        softmax_segm_max=torch.empty(*segments, dtype=torch.float32, device=problem.device),
        softmax_segm_expsum=torch.empty(*segments, dtype=torch.float32, device=problem.device))
    seq_lens, cu_q = problem.seq_lens, problem.query_start_loc
    return lambda: unified_attention_int4(
        q=problem.query, k_cache=key_cache, v_cache=value_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
        seqused_k=seq_lens, max_seqlen_k=problem.context, softmax_scale=HEAD_DIM ** -0.5, window_size=(-1, -1),
        block_table=block_table, softcap=0.0, sinks=None, alibi_slopes=None, use_alibi_sqrt=False, qq_bias=None,
        output_scale=None, mm_prefix_range=None, k_scale_cache=k_scale, v_scale_cache=v_scale,
        seq_threshold_3D=VLLM_SEQ_THRESHOLD_3D, num_par_softmax_segments=VLLM_SOFTMAX_SEGMENTS, **buffers)


def fill_s4kv_cache(scheme, problem: DecodeProblem, block_table: torch.Tensor) -> torch.Tensor:
    """Our int4 paged cache of the problem's K/V, written by our store kernel; int4_kivi through a staging pool (a
    chunk's whole sequences in slots 0, 1, ...: every block closes in its chunk, the last open one is staged)."""
    from s4kv.kernels.layout import cache_shape
    from s4kv.kernels.staging import allocate_pool, sequence_staging_slots
    from s4kv.kernels.store import store_kv

    shape = cache_shape(block_table.numel(), problem.num_kv_heads, S4KV_BLOCK_SIZE, HEAD_DIM)
    cache = torch.empty(shape, dtype=torch.uint8, device=problem.device)
    if scheme.is_kivi:
        pool = allocate_pool(min(problem.batch, problem.seqs_per_chunk), problem.num_kv_heads, S4KV_BLOCK_SIZE,
                             HEAD_DIM, problem.kv_pool.dtype, problem.device)
    staging = {}
    for key, value, slots in problem.chunks(block_table, S4KV_BLOCK_SIZE):
        if scheme.is_kivi:
            sequences = [problem.context] * (key.shape[0] // problem.context)
            staging = dict(staged_keys=pool, staging_slots=sequence_staging_slots(sequences, problem.device))
        store_kv(key, value, cache, slots, scheme, **staging)
    return cache


def s4kv_decode_call(scheme, problem: DecodeProblem, cache: torch.Tensor, block_table: torch.Tensor,
                     out: torch.Tensor, workspace, launch=None):
    """One decode step of our paged attention over ``cache`` into ``out``."""
    from s4kv.kernels.attention import paged_attention

    seq_lens, cu_q = problem.seq_lens, problem.query_start_loc
    own_block = {}
    if scheme.is_kivi:
        # the own block from the original keys, as the engine passes them: this step's key (the last token's) and a
        # staging-pool slot per sequence holding the block's earlier keys
        batch, device, context = problem.batch, problem.device, problem.context
        keys = problem.kv_pool[0]
        first_row = (torch.arange(batch, device=device) % problem.seqs_per_chunk) * context
        own_start = (context - 1) // S4KV_BLOCK_SIZE * S4KV_BLOCK_SIZE
        staged = torch.zeros(batch, problem.num_kv_heads, S4KV_BLOCK_SIZE, HEAD_DIM, dtype=keys.dtype, device=device)
        earlier = first_row[:, None] + own_start + torch.arange(context - 1 - own_start, device=device)[None, :]
        staged[:, :, : earlier.shape[1]] = keys[earlier].transpose(1, 2)
        own_block = dict(new_keys=keys[first_row + context - 1].contiguous(), staged_keys=staged,
                         sequence_slots=torch.arange(batch, dtype=torch.int32, device=device))
    return lambda: paged_attention(problem.query, cache, block_table, seq_lens, cu_q, 1, HEAD_DIM ** -0.5, scheme,
                                   out, workspace=workspace, launch=launch, **own_block)


def build_s4kv(options: dict, code_path: str | None, problem: DecodeProblem, block_table: torch.Tensor,
               out: torch.Tensor, launch_options: dict | None = None):
    """Our cache filled by our store kernel, read by our paged attention: the scheme's decode launch with one code
    path, or with ``code_path`` None the launch paged_attention picks itself (DECODE_LAUNCH), or DECODE_LAUNCH with
    ``launch_options`` (LaunchConfig fields) replaced; the split workspace as our backend allocates it (splits by
    DECODE_SPLITS)."""
    from s4kv.kernels.attention import CODE_PATHS, DECODE_LAUNCH, SplitWorkspace
    from s4kv.kernels.scheme import Int4Scheme

    scheme = Int4Scheme.parse(options)
    cache = fill_s4kv_cache(scheme, problem, block_table)
    workspace = SplitWorkspace.allocate(problem.num_q_heads, problem.num_kv_heads, HEAD_DIM, problem.device,
                                        scheme.name, max_num_seqs=problem.batch)
    launch = None if code_path is None else dataclasses.replace(DECODE_LAUNCH[scheme.name], **CODE_PATHS[code_path])
    if launch_options:
        launch = dataclasses.replace(launch or DECODE_LAUNCH[scheme.name], **launch_options)
    return s4kv_decode_call(scheme, problem, cache, block_table, out, workspace, launch)


# method -> (page size, builder(problem, block_table, out) -> call that writes out); FA3 first: the reference
DECODE_METHODS = {
    "fa3_bf16": (VLLM_BLOCK_SIZE, build_fa3),
    "fa3_fp8": (VLLM_BLOCK_SIZE, partial(build_fa3, fp8=True)),
    "vllm_int4": (VLLM_BLOCK_SIZE, build_vllm_int4),
    **{f"s4kv_{scheme}{suffix}": (S4KV_BLOCK_SIZE, partial(build_s4kv, {"scheme": f"int4_{scheme}"}, code_path))
       for code_path, suffix in CODE_PATH_SUFFIX.items() for scheme in ("kivi", "saw")},
    "s4kv_saw_rotv": (S4KV_BLOCK_SIZE, partial(build_s4kv, {"scheme": "int4_saw", "rotate_values": True}, None)),
}


def parse_launch_method(spec: str) -> tuple[str, str, dict]:
    """``NAME=SCHEME:FIELD=VALUE,...`` -> (NAME, SCHEME, {field: value}): a decode method that times SCHEME's
    DECODE_LAUNCH with those LaunchConfig fields replaced (none: the launch itself, a control column). VALUE is
    true, false, none or an integer."""
    from s4kv.kernels.attention import DECODE_LAUNCH, LaunchConfig

    name, sep, rest = spec.partition("=")
    scheme, sep2, fields = rest.partition(":")
    if not (sep and sep2 and name.startswith("s4kv_")):
        raise ValueError(f"--launch {spec!r}: expected s4kv_NAME=SCHEME:[FIELD=VALUE,...]")
    if name in DECODE_METHODS:
        raise ValueError(f"--launch {spec!r}: {name} is already a method")
    if scheme not in DECODE_LAUNCH:
        raise ValueError(f"--launch {spec!r}: scheme {scheme!r} is not one of {', '.join(DECODE_LAUNCH)}")
    known = {field.name for field in dataclasses.fields(LaunchConfig)}
    options = {}
    for item in fields.split(",") if fields else []:
        field, sep3, value = item.partition("=")
        if not sep3 or field not in known:
            raise ValueError(f"--launch {spec!r}: {item!r} is not FIELD=VALUE with a LaunchConfig field "
                             f"({', '.join(sorted(known))})")
        if value in ("true", "false"):
            options[field] = value == "true"
        elif value.isdigit():
            options[field] = int(value)
        elif value == "none":  # max_registers: the compiler's choice
            options[field] = None
        else:
            raise ValueError(f"--launch {spec!r}: {field}={value!r} is neither true, false, none nor an integer")
    return name, scheme, options


def add_launch_method(spec: str) -> str:
    """Registers the method of a --launch spec (parse_launch_method) beside the fixed ones; returns its name."""
    name, scheme, options = parse_launch_method(spec)
    DECODE_METHODS[name] = (S4KV_BLOCK_SIZE, partial(build_s4kv, {"scheme": scheme}, None, launch_options=options))
    FORMAT_OF[name] = "int4"
    return name


def bench_decode(batch: int, context: int, generator: torch.Generator, kv_pool: torch.Tensor,
                 methods: list[str], shape: str) -> list[Timing]:
    """Each method in turn (its cache alone in memory): fill, time, check against FA3's output (FA3 runs first)."""
    num_q_heads, num_kv_heads = SHAPES[shape]
    assert kv_pool.shape[2] == num_kv_heads
    query = torch.randn(batch, num_q_heads, HEAD_DIM, dtype=kv_pool.dtype, device=kv_pool.device)
    problem = DecodeProblem(batch, context, query, kv_pool)
    tables = {size: shuffled_block_table(batch, math.ceil(context / size), generator).to(kv_pool.device)
              for size in (VLLM_BLOCK_SIZE, S4KV_BLOCK_SIZE)}
    timings, reference = [], None
    for method, (block_size, build) in DECODE_METHODS.items():
        if method not in methods:
            continue
        nbytes = decode_bytes(batch, context, FORMAT_OF[method], num_q_heads, num_kv_heads)
        out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
        try:
            ms = median_ms(build(problem, tables[block_size], out))
            mhz = sm_clock_mhz()
            if not torch.isfinite(out).all():
                raise RuntimeError("output has NaN/inf (unwritten or broken)")
            err = None if reference is None else float((out.float() - reference).norm() / reference.norm())
            if method == "fa3_bf16":
                reference = out.float()
            if err is not None and err > SANITY_MAX_REL_ERR:
                raise RuntimeError(f"output differs from FA3's by {err:.3f} (relative): kernel broken?")
            timings.append(Timing(method, batch, context, ms, nbytes, err, shape=shape, sm_mhz=mhz))
        except Exception as exc:  # one broken method must not hide the others' numbers
            traceback.print_exc()
            timings.append(Timing(method, batch, context, None, nbytes, error=f"{type(exc).__name__}: {exc}",
                                  shape=shape))
        torch.cuda.empty_cache()  # the method's cache died with its call: keep peak memory to one format
    line = ", ".join(f"{t.method} {t.ms * 1e3:,.0f} us" if t.ms else f"{t.method} failed" for t in timings)
    print(f"  {shape} batch {batch:3d} context {context:6d}: {line}", flush=True)
    return timings


def bench_store(generator: torch.Generator) -> list[Timing]:
    """A decode step (one token per sequence, random pages and offsets) and an 8192-token prefill chunk."""
    from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4

    from s4kv.kernels.layout import cache_shape
    from s4kv.kernels.scheme import Int4Scheme
    from s4kv.kernels.staging import allocate_pool
    from s4kv.kernels.store import store_kv

    total_tokens = 1 << 19
    int4 = torch.zeros(total_tokens // VLLM_BLOCK_SIZE, VLLM_BLOCK_SIZE, NUM_KV_HEADS, 136, dtype=torch.uint8,
                       device="cuda")
    int4_k, int4_v = int4.split(68, dim=-1)
    int4_k_scale, int4_v_scale = int4.view(torch.float32)[..., 16], int4.view(torch.float32)[..., 33]
    ours = torch.zeros(cache_shape(total_tokens // S4KV_BLOCK_SIZE, NUM_KV_HEADS, S4KV_BLOCK_SIZE, HEAD_DIM),
                       dtype=torch.uint8, device="cuda")
    timings = []
    for tokens, contiguous in ((256, False), (8192, True)):
        if contiguous:  # whole pages, as a prefill chunk fills them
            pages = torch.randperm(total_tokens // S4KV_BLOCK_SIZE, generator=generator)[:tokens // S4KV_BLOCK_SIZE]
            slots = (pages[:, None] * S4KV_BLOCK_SIZE + torch.arange(S4KV_BLOCK_SIZE)).flatten()
        else:
            slots = torch.randperm(total_tokens, generator=generator)[:tokens]
        slots = slots.cuda()
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        value = torch.randn_like(key)
        # int4_kivi's staging pool as the engine passes it: a slot per decoding sequence (each token its own), one
        # per page of the prefill chunk
        sequence = torch.arange(tokens, device="cuda") // (S4KV_BLOCK_SIZE if contiguous else 1)
        pool = allocate_pool(int(sequence[-1]) + 1, NUM_KV_HEADS, S4KV_BLOCK_SIZE, HEAD_DIM, key.dtype, "cuda")
        staging = {"int4_kivi": dict(staged_keys=pool, staging_slots=sequence), "int4_saw": {}}
        calls = {"vllm_int4": lambda: reshape_and_cache_int4(key, value, int4_k, int4_v, slots,
                                                             k_scale_cache=int4_k_scale, v_scale_cache=int4_v_scale)}
        for name in ("int4_kivi", "int4_saw"):
            scheme = Int4Scheme.parse({"scheme": name})
            calls[f"s4kv_{name[5:]}"] = lambda scheme=scheme, name=name: store_kv(key, value, ours, slots, scheme,
                                                                                  **staging[name])
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
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--methods", default="all",
                        help=f"comma list of decode methods or 'all' ({', '.join(METHODS)})")
    parser.add_argument("--launch", action="append", default=[], metavar="NAME=SCHEME:FIELD=VALUE,...",
                        help="one more method: SCHEME's DECODE_LAUNCH with LaunchConfig fields replaced, e.g. "
                             "s4kv_saw_w96=int4_saw:wide_code_loads=true,max_registers=96 (repeatable; always run)")
    parser.add_argument("--no-store", action="store_true", help="skip the store-kernel timings")
    parser.add_argument("--budget-s", type=float, default=300,
                        help="skip the remaining decode configs once this much time has passed")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    methods = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        methods += [add_launch_method(spec) for spec in args.launch]
    except ValueError as exc:
        raise SystemExit(f"bench_kernels.py: {exc}") from None
    unknown = [name for name in shapes if name not in SHAPES] + [name for name in methods
                                                                 if name not in DECODE_METHODS]
    if unknown or not shapes or not methods:
        raise SystemExit(f"bench_kernels.py: unknown shapes or methods {unknown}: shapes {', '.join(SHAPES)}; "
                         f"methods {', '.join(METHODS)}")
    if "fa3_bf16" not in methods:
        raise SystemExit("bench_kernels.py: fa3_bf16 must be among --methods: every output is checked against it")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU (run it on the H200 through tools/device/bench.sh)")
    start = time.monotonic()
    import triton
    import vllm

    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:,.0f} GB/s", flush=True)
    pool_tokens = min(max(batches) * max(contexts), FILL_CHUNK_TOKENS)

    decode: list[Timing] = []
    skipped = []
    for shape in shapes:
        kv_pool = torch.randn(2, pool_tokens, SHAPES[shape][1], HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        # Largest first: the bandwidth-bound configs are the ones that explain the end-to-end numbers, and the
        # launch-bound small ones are what a time budget may drop.
        for batch, context in sorted(((b, c) for b in batches for c in contexts), key=lambda bc: -bc[0] * bc[1]):
            if time.monotonic() - start > args.budget_s:
                skipped.append((shape, batch, context))
                continue
            decode += bench_decode(batch, context, generator, kv_pool, methods, shape)
        del kv_pool
        torch.cuda.empty_cache()
    store = [] if args.no_store else bench_store(generator)

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "vllm": vllm.__version__, "date": now,
            "copy_gbps": copy_gbps, "skipped_for_budget": skipped, "seconds": time.monotonic() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    as_dicts = lambda ts: [{**t.__dict__, "gbps": t.gbps} for t in ts]  # noqa: E731
    (args.out / "kernels.json").write_text(json.dumps({"meta": meta, "decode": as_dicts(decode),
                                                        "store": as_dicts(store)}, indent=1))
    title = f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, vLLM {meta['vllm']}, {meta['date']}"
    shape_list = ", ".join(f"{name} ({SHAPES[name][0]} q / {SHAPES[name][1]} KV heads)" for name in shapes)
    report = f"Decode attention, d {HEAD_DIM}, {shape_list}, {title}\n\n{render_decode_table(decode, copy_gbps)}"
    if store:
        report += (f"\nStore (K+V of new tokens, {NUM_Q_HEADS} q / {NUM_KV_HEADS} KV heads)\n\n"
                   f"{render_store_table(store)}")
    if skipped:
        report += f"\nskipped for the time budget: {skipped}\n"
    (args.out / "kernels.md").write_text(report)
    print("\n" + report)
    failed = [t for t in decode + store if t.error]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
