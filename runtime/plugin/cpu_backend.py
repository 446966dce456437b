"""S4 KV on vLLM's CPU platform: the same backend, pages and checks as the CUDA path, with torch in place of the
Triton kernels: the reference store (kernels/reference.py) and the batched attention of kernels/cpu_attention.py,
which reads the cache as the reference's attention does.

vLLM's CPU platform ignores --attention-backend and always resolves CPU_ATTN, so the plugin routes CPU_ATTN here
when (and only when) ``additional_config["s4kv"]`` is given (plugin.py). This is the path the offline demo and CI
run.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport

from s4kv.kernels import cpu_attention, reference
from s4kv.kernels.scheme import Int4Scheme

from .backend import S4KVAttentionBackend, S4KVAttentionImpl, S4KVMetadata, S4KVMetadataBuilder


class S4KVCpuAttentionBackend(S4KVAttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        # The enum member this class stands in for (vLLM maps get_name() back to AttentionBackendEnum).
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type["S4KVCpuAttentionImpl"]:
        return S4KVCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["S4KVCpuMetadataBuilder"]:
        return S4KVCpuMetadataBuilder


class S4KVCpuMetadataBuilder(S4KVMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER  # no CUDA graphs on the CPU

    def _allocate_workspace(self, scheme: Int4Scheme) -> Any:
        return None  # the CPU attention needs no split-KV buffers

    def _plan_prefill(self, m) -> None:
        return None  # no FlashAttention on the CPU: every token is attended from the int4 cache

    def _list_closing_rows(self, m, seq_lens) -> None:
        return None  # the torch store (reference.store_kv) finds the closing rows in the slot mapping


class S4KVCpuAttentionImpl(S4KVAttentionImpl):
    def _load_kernels(self) -> None:
        self._store_kv = reference.store_kv
        self._stage_open_keys = reference.stage_open_keys

    def _attend(self, query, key, value, kv_cache, m: S4KVMetadata, output) -> None:
        """Every query through kernels/cpu_attention (which returns float32); ``key`` is the step's keys, from which
        int4_kivi reads a query's own block (docs/format.md, the read rule)."""
        output.copy_(cpu_attention.paged_attention(query, kv_cache, m.block_table, m.seq_lens, m.query_start_loc,
                                               self.scale, self.scheme, **self._pool_read(m.sequence_slots, key)))
