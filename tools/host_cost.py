#!/usr/bin/env python3
"""Host time of one attention layer per int4 scheme, every kernel launch replaced by a counting no-op (no GPU).

    python -m tools.host_cost                     # Llama-3.1-8B's attention shape, 16 decodes of 2,048 tokens
    python -m tools.host_cost --json FILE         # the same, also as JSON

What the attention path costs the host beyond its launches: the backend's KV update and forward for a decode-only
layer and for a mixed layer (the decodes and one prompt's prefill), and each kernel wrapper alone with the
mixed layer's arguments (argument checks, page layout, split plan, grid). vLLM's FlashAttention call is stubbed too,
so only our Python is timed. In vLLM's eager (mixed) steps the host launches each layer's attention while the GPU
runs the layer before, so this Python, plus one Triton launch per kernel (18-33 us on the H200's host:
docs/performance.md, levers), is what a mixed step's host pays per layer; the launch rows count those launches.
Medians of ``--calls`` calls on one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

SCHEMES = ("int4_saw", "int4_kivi")
# Llama-3.1-8B's attention per GPU: 32 query heads, 8 KV heads, head_dim 128
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
KERNELS = {"attention": ("_paged_attention_kernel", "_merge_splits_kernel"),
           "store": ("_store_per_token_kernel", "_kivi_close_kernel", "_kivi_stage_kernel"),
           "dense": ("_gather_dense_kernel",)}


class NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing but count the launch."""

    launches = 0

    def __getitem__(self, grid):
        return self._launch

    @staticmethod
    def _launch(*args, **kwargs) -> None:
        NoLaunch.launches += 1


def launches_of(call: Callable[[], Any]) -> int:
    """Triton launches one ``call`` makes."""
    before = NoLaunch.launches
    call()
    return NoLaunch.launches - before


def host_us(call: Callable[[], Any], calls: int) -> float:
    """Median host microseconds of ``call`` over ``calls`` calls, after a warm-up."""
    for _ in range(max(10, calls // 20)):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def stub_launches() -> None:
    """Every kernel of kernels/attention.py, store.py and dense.py, and vLLM's FlashAttention call, as a no-op."""
    from vllm.v1.attention.backends import fa_utils

    from s4kv.kernels import attention, dense, store

    for module, names in ((attention, KERNELS["attention"]), (store, KERNELS["store"]), (dense, KERNELS["dense"])):
        for name in names:
            setattr(module, name, NoLaunch())
    fa_utils.flash_attn_varlen_func = lambda *args, **kwargs: None


class Layer:
    """One attention layer's inputs on the CPU: the int4 cache of ``decodes`` sequences of ``context`` tokens and
    one ``prompt``-token prompt, a step's q/k/v, and the metadata the builder would make for a decode-only and for
    a mixed step."""

    def __init__(self, scheme_name: str, decodes: int, context: int, prompt: int):
        from s4kv.kernels.attention import SplitWorkspace
        from s4kv.kernels.layout import cache_shape, cdiv
        from s4kv.kernels.prefill_plan import PAGE, plan_prefill_pass
        from s4kv.kernels.scheme import Int4Scheme
        from s4kv.kernels.staging import allocate_pool, staging_overwrites_reads
        from s4kv.runtime.plugin.backend import PrefillPlan, S4KVMetadata, with_sequence_rows

        self.scheme = Int4Scheme.parse({"scheme": scheme_name})
        dtype = torch.float16
        tokens = decodes + prompt
        blocks_per_seq = cdiv(max(context + 1, prompt), PAGE)
        self.cache = torch.zeros(cache_shape((decodes + 1) * blocks_per_seq, KV_HEADS, PAGE, HEAD_DIM),
                                 dtype=torch.uint8)
        self.query = torch.randn(tokens, Q_HEADS, HEAD_DIM, dtype=dtype)
        self.key = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
        self.value = torch.randn_like(self.key)
        self.output = torch.empty_like(self.query)
        self.pool = (allocate_pool(decodes + 1, KV_HEADS, PAGE, HEAD_DIM, dtype, "cpu") if self.scheme.is_kivi
                     else None)
        table = torch.arange((decodes + 1) * blocks_per_seq, dtype=torch.int32).view(decodes + 1, -1)
        seq_lens = torch.tensor([context + 1] * decodes + [prompt], dtype=torch.int32)
        query_start = torch.tensor(list(range(decodes + 1)) + [tokens], dtype=torch.int32)
        slots = torch.cat([table[:decodes, context // PAGE].long() * PAGE + context % PAGE,
                           table[decodes, 0].long() * PAGE + torch.arange(prompt)])
        workspace = SplitWorkspace.allocate(Q_HEADS, KV_HEADS, HEAD_DIM, "cpu", scheme_name=scheme_name,
                                            max_num_seqs=256, num_sms=132)
        sequence_slots = torch.arange(decodes + 1, dtype=torch.int32) if self.scheme.is_kivi else None
        staging = torch.cat([sequence_slots[:decodes], torch.full((prompt,), decodes, dtype=torch.int32)]) \
            if self.scheme.is_kivi else None
        plan = plan_prefill_pass(seq_lens[decodes:], torch.tensor([prompt], dtype=torch.int32), self.scheme.is_kivi)
        dense_k = torch.empty(plan.num_pages, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype)
        closing = torch.tensor([tokens - 1 - i * PAGE for i in range(prompt // PAGE)][::-1], dtype=torch.int32)

        def metadata(n_seqs: int, n_tokens: int, prefill: PrefillPlan | None) -> S4KVMetadata:
            return with_sequence_rows(S4KVMetadata(
                num_actual_tokens=n_tokens, max_query_len=prompt if prefill else 1,
                query_start_loc=query_start[: n_seqs + 1], max_seq_len=int(seq_lens[:n_seqs].max()),
                seq_lens=seq_lens[:n_seqs], block_table=table[:n_seqs], slot_mapping=slots[:n_tokens],
                workspace=workspace, prefill=prefill,
                staging_slots=staging[:n_tokens] if staging is not None else None,
                sequence_slots=sequence_slots[:n_seqs] if sequence_slots is not None else None,
                close_rows=closing if prefill and self.scheme.is_kivi else None,
                stage_in_store=self.scheme.is_kivi and not staging_overwrites_reads(query_start[: n_seqs + 1],
                                                                                    seq_lens[:n_seqs])))

        self.decode = metadata(decodes, decodes, None)
        self.mixed = metadata(decodes + 1, tokens, PrefillPlan(
            num_decodes=decodes, num_decode_tokens=decodes, decode_max_query_len=1, cu_pages=plan.cu_pages,
            flash=plan.flash, max_query_len=prompt, max_seq_len=prompt, dense_k=dense_k,
            dense_v=torch.empty_like(dense_k), fa_version=3))

    def impl(self):
        """S4KVAttentionImpl as the engine makes it for this layer, without vLLM's config (its checks are start-up
        only)."""
        from s4kv.runtime.plugin.backend import S4KVAttentionImpl

        impl = object.__new__(S4KVAttentionImpl)
        impl.scheme, impl.scale, impl.head_size = self.scheme, HEAD_DIM ** -0.5, HEAD_DIM
        impl.num_heads, impl.num_kv_heads, impl.staged_keys = Q_HEADS, KV_HEADS, self.pool
        impl._load_kernels()
        return impl


def measure(decodes: int, context: int, prompt: int, calls: int) -> dict[str, dict[str, float | int]]:
    """Host us per call, or launches per layer: {row name: {scheme: value}}."""
    from s4kv.kernels import attention, dense, store
    from s4kv.kernels.staging import STAGE_IN_STORE
    from s4kv.runtime.plugin import backend

    stub_launches()
    rows: dict[str, dict[str, float]] = {}
    for name in SCHEMES:
        layer = Layer(name, decodes, context, prompt)
        impl = layer.impl()
        m = layer.mixed
        p, d, r = m.prefill, m.decode_rows, m.prefill_rows
        n = decodes
        own = ({"new_keys": layer.key, "staged_keys": layer.pool} if layer.scheme.is_kivi else {})

        def step(metadata):
            def run():
                impl.do_kv_cache_update(layer, layer.key, layer.value, layer.cache, metadata.slot_mapping)
                impl.forward(layer, layer.query, layer.key, layer.value, layer.cache, metadata, layer.output)
            return run

        # int4_kivi's KV update reads the step's metadata from vLLM's forward context, which only an engine sets
        current = {}
        backend.layer_metadata = lambda _layer: current["metadata"]
        timed = {}
        for kind, metadata in (("decode", layer.decode), ("mixed", m)):
            current["metadata"] = metadata
            timed[f"{kind} layer: KV update + forward"] = host_us(step(metadata), calls)
            timed[f"{kind} layer: Triton launches"] = launches_of(step(metadata))
        current["metadata"] = m
        stage = dict(staged_keys=layer.pool, staging_slots=m.staging_slots, stage=STAGE_IN_STORE,
                     close_rows=m.close_rows) if layer.scheme.is_kivi else {}
        wrappers = {
            "store_kv": lambda: store.store_kv(layer.key, layer.value, layer.cache, m.slot_mapping, layer.scheme,
                                               **stage),
            "paged_attention (the decodes)": lambda: attention.paged_attention(
                layer.query[:n], layer.cache, d.block_table, d.seq_lens, d.query_start_loc, 1, impl.scale,
                layer.scheme, layer.output[:n], workspace=m.workspace,
                **({**own, "sequence_slots": d.sequence_slots} if own else {})),
            "gather_dense_kv": lambda: dense.gather_dense_kv(
                layer.cache, r.block_table, r.seq_lens, p.cu_pages, p.max_seq_len, layer.scheme, p.dense_k,
                p.dense_v, HEAD_DIM, **({**own, "sequence_slots": r.sequence_slots,
                                         "query_start_loc": r.query_start_loc} if own else {})),
        }
        for label, call in wrappers.items():
            timed[label] = host_us(call, calls)
        for label, us in timed.items():
            rows.setdefault(label, {})[name] = us
    return rows


def table(rows: dict[str, dict[str, float | int]], decodes: int, context: int, prompt: int, calls: int) -> str:
    lines = [f"Host us per call, launches as no-ops (counted in the launch rows): {decodes} decodes of {context} "
             f"tokens, a mixed layer adds one {prompt}-token prompt (Llama-3.1-8B attention: {Q_HEADS} query heads, "
             f"{KV_HEADS} KV heads, head_dim {HEAD_DIM}); medians of {calls} calls, one thread.", "",
             "| call | " + " | ".join(SCHEMES) + " |", "|---|" + "---:|" * len(SCHEMES)]
    for label, per_scheme in rows.items():
        cells = [("-" if s not in per_scheme else f"{per_scheme[s]}" if isinstance(per_scheme[s], int)
                  else f"{per_scheme[s]:.1f}") for s in SCHEMES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.prompt % 128 or args.prompt < 128:
        parser.error("--prompt must be a positive multiple of 128 (the mixed layer's prompt closes whole blocks)")
    torch.set_num_threads(1)
    rows = measure(args.decodes, args.context, args.prompt, args.calls)
    print(table(rows, args.decodes, args.context, args.prompt, args.calls))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
