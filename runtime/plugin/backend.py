"""S4 KV as a vLLM 0.26.0 v1 attention backend (registered as ``CUSTOM``; the CUDA path, Triton kernels).

Layout: vLLM sizes an ``int4_per_token_head`` page at ``block_size * num_kv_heads * (head_dim + 8)`` bytes; our cache
tensor is exactly that, ``uint8[num_blocks, num_kv_heads, block_size * (head_dim + 8)]`` (kernels/layout.py), physical
== logical.
The store runs in ``do_kv_cache_update`` (before attention, as for TRITON_ATTN). Decode tokens read the int4 cache
directly (memory-bound: 3.8x fewer bytes than bf16). Prefill chunks are compute-bound, so their sequences' K/V,
dequantized from the int4 cache (the chunk's own tokens included), are gathered into dense pages and run through
vLLM's own FlashAttention (FA3 on Hopper, FA2 elsewhere) in one causal pass: for int4_saw an entry per sequence, for
int4_kivi an entry per segment of a sequence's queries in one block (earlier blocks per channel, the own block from
its original keys; kernels/prefill_plan.py); the batch is reordered decodes-first to split it. The CPU path
(cpu_backend.py) reuses the backend, metadata and builder defined here and swaps the kernels for torch ones.
int4_kivi layers also own a staging pool (the open blocks' original keys); the builder assigns its slots per step
(staging.py) and the store closes every block per channel from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from s4kv.kernels.layout import bytes_per_token, cache_shape
from s4kv.kernels.prefill_plan import PAGE, FlashPass, plan_prefill_pass
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import STAGE_BY_CALLER, STAGE_IN_STORE, staging_overwrites_reads
from s4kv.runtime.schemes import ATTENTION_BACKEND, CONFIG_KEY, KIVI, KV_CACHE_DTYPE, SAW

from .config import BLOCK_SIZE, S4KVConfigError, check_vllm_config
from .cuda_graphs import warn_missing_decode_graph
from .staging import StagingBuffers, block_closing_rows, install_step_hook
from .warmup import install_warmup_hook

logger = init_logger("vllm.s4kv")


class S4KVAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # Head size and KV-cache dtype are judged in supports_combination (config.py), which names the cause in a
    # sentence; vLLM's generic checks are left open so its terse reasons do not duplicate ours.
    supported_kv_cache_dtypes: ClassVar[list] = []

    @staticmethod
    def get_name() -> str:
        # vLLM maps the name back to its enum (attention.py: AttentionBackendEnum[get_name()]).
        return ATTENTION_BACKEND

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # The only kernel block size; vLLM then picks 128 as the default block size.
        return [BLOCK_SIZE]

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        if cache_dtype_str != KV_CACHE_DTYPE or head_size not in SUPPORTED_HEAD_DIMS or block_size != BLOCK_SIZE:
            raise ValueError(
                f"S4 KV pages need kv_cache_dtype {KV_CACHE_DTYPE}, head_size "
                f"{' or '.join(map(str, SUPPORTED_HEAD_DIMS))} and block_size {BLOCK_SIZE}; "
                f"got {cache_dtype_str}, {head_size} and {block_size}"
            )
        return cache_shape(num_blocks, num_kv_heads, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        if include_num_layers_dimension:
            # One region per (block, KV head) is the page format; a layers dimension in between would split it.
            raise NotImplementedError("S4 KV pages have no cross-layer layout")
        return (0, 1, 2)

    @staticmethod
    def get_impl_cls() -> type["S4KVAttentionImpl"]:
        return S4KVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["S4KVMetadataBuilder"]:
        return S4KVMetadataBuilder

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        try:
            config = check_vllm_config(get_current_vllm_config())
        except S4KVConfigError as err:
            return str(err)
        if config is None:
            return (
                f'the {ATTENTION_BACKEND} attention backend is S4 KV and needs its options: additional_config '
                f'{{"{CONFIG_KEY}": {{"scheme": "{KIVI}"}}}} (or "{SAW}").'
            )
        return None


@dataclass
class S4KVMetadata:
    num_actual_tokens: int  # tokens in the batch without CUDA-graph padding
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_seq_len: int
    seq_lens: torch.Tensor  # [num_seqs] int32, including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    workspace: Any = None  # kernels.attention.SplitWorkspace on CUDA
    prefill: "PrefillPlan | None" = None  # set when prefill sequences go through FlashAttention
    # int4_kivi (staging.py): the staging-pool slot of each token's open block (what the store closes from and
    # stages into), and of each sequence's open block after the step (-1 where its last block is closed)
    staging_slots: torch.Tensor | None = None  # [num_tokens] int32
    sequence_slots: torch.Tensor | None = None  # [num_seqs] int32
    # int4_kivi steps with prefill: the rows that write their block's last slot (the store's close runs over them
    # alone); None for decode-only steps, whose close runs a program per row (a grid of the batch size: CUDA graphs)
    close_rows: torch.Tensor | None = None  # [n] int32
    # int4_kivi: the store stages the keys of blocks still open in its own launch, before the close and attention
    # read the pool; False where this step's staging would overwrite rows they read (kernels/staging.py), or the
    # KV update may run inside a piecewise CUDA graph (kv_update_runs_eagerly): then the forward stages after attention
    stage_in_store: bool = False
    # steps with a PrefillPlan: the decodes' and the prefills' metadata, sliced once for every layer
    decode_rows: "SequenceRows | None" = None
    prefill_rows: "SequenceRows | None" = None


@dataclass
class SequenceRows:
    """The sequences [first, end) of a batch: their rows of the step's metadata (query_start_loc with the part's
    end, as rows of the whole batch)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    sequence_slots: torch.Tensor | None  # int4_kivi (S4KVMetadata.sequence_slots)

    @classmethod
    def of(cls, m: S4KVMetadata, first: int, end: int | None = None) -> "SequenceRows":
        """Sequences first .. end - 1 of ``m`` (end None: to the last)."""
        return cls(m.block_table[first:end], m.seq_lens[first:end],
                   m.query_start_loc[first : None if end is None else end + 1],
                   None if m.sequence_slots is None else m.sequence_slots[first:end])


@dataclass
class PrefillPlan:
    """The prefill part of a decodes-first batch, for FlashAttention over dense K/V pages (kernels/prefill_plan.py)."""

    num_decodes: int  # sequences [0, num_decodes) are decodes: 1 token, or 1 + speculative drafts
    num_decode_tokens: int
    decode_max_query_len: int  # 1 without drafts (then the decode part may split the context)
    cu_pages: torch.Tensor  # [num_prefills + 1] int32: prefill sequence i's dense pages start at cu_pages[i]
    flash: FlashPass  # on the device
    max_query_len: int
    max_seq_len: int
    dense_k: torch.Tensor  # [pages, 128, Hkv, head_dim], model dtype
    dense_v: torch.Tensor
    fa_version: int | None


class S4KVMetadataBuilder(AttentionMetadataBuilder[S4KVMetadata]):
    # Full CUDA graphs for batches whose queries all have one length (decode, and decode + drafts): the attention
    # launch depends on max_query_len (decode kernel vs prefill kernel), which is constant only in such batches.
    # Mixed prefill/decode batches run piecewise, attention eager.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # Largest dense K+V buffer (bytes) of the prefill sequences' pages a batch may take beside the KV cache; a batch
    # needing more (many long prefixes at once) runs its prefills through the int4 kernel instead: same cache, same
    # numbers, slower. int4_kivi's own pages come on top (at most one per 128 tokens of this step's chunks), so
    # a prompt that fits bf16's pages keeps FlashAttention at every chunk.
    dense_budget_bytes: ClassVar[int] = 512 << 20

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first, then prefills, so the prefill sequences are one contiguous slice of the batch. A decode
        # is a query of at most 1 + num_speculative_tokens tokens: with drafts, vLLM's host sequence lengths of
        # decode rows are only upper bounds (async scheduling assumes every draft accepted), so those rows must
        # stay out of the host-planned prefill path; the fused kernel reads the exact lengths on the device.
        # Batches of decodes alone (vLLM captures them in full CUDA graphs, drafts included) are never planned.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        config = check_vllm_config(vllm_config)
        if config is None:
            raise S4KVConfigError(f'S4 KV\'s attention backend needs additional_config["{CONFIG_KEY}"].')
        self.workspace = self._allocate_workspace(config.scheme)
        self.staging = self._allocate_staging(config.scheme)
        self.update_runs_eagerly = kv_update_runs_eagerly(vllm_config.compilation_config)
        warn_missing_decode_graph(vllm_config)

    def _allocate_staging(self, scheme: Int4Scheme) -> StagingBuffers | None:
        # int4_kivi: one staging slot per running sequence (a sequence has at most one open block)
        if not scheme.is_kivi:
            return None
        scheduler = self.vllm_config.scheduler_config
        return StagingBuffers(scheduler.max_num_seqs, self.kv_cache_spec.block_size,
                              scheduler.max_num_batched_tokens, self.device)

    def _allocate_workspace(self, scheme: Int4Scheme) -> Any:
        # Split-KV decode buffers, once per builder, before any CUDA-graph capture; no decode batch holds more
        # sequences than the scheduler's max_num_seqs.
        from s4kv.kernels.attention import SplitWorkspace

        model_config = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        return SplitWorkspace.allocate(
            model_config.get_num_attention_heads(parallel), model_config.get_num_kv_heads(parallel),
            model_config.get_head_size(), self.device, scheme_name=scheme.name,
            max_num_seqs=self.vllm_config.scheduler_config.max_num_seqs
        )

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> S4KVMetadata:
        m = common_attn_metadata
        has_prefill = m.max_query_len > self.reorder_batch_threshold  # run eagerly, never in a full CUDA graph
        staging_slots = sequence_slots = close_rows = None
        stage_in_store = False
        if self.staging is not None:
            # exact host lengths: int4_kivi runs without speculative decoding (config.py), so the upper bound is exact
            seq_lens = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens_cpu
            staging_slots, sequence_slots = self.staging.build(m.slot_mapping.shape[0], m.num_reqs,
                                                               m.query_start_loc_cpu, seq_lens)
            if has_prefill and self.update_runs_eagerly:
                close_rows = self._list_closing_rows(m, seq_lens)
            stage_in_store = self.update_runs_eagerly and not staging_overwrites_reads(
                m.query_start_loc_cpu[: m.num_reqs + 1].numpy(), seq_lens[: m.num_reqs].numpy())
        metadata = S4KVMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            workspace=self.workspace,
            prefill=self._plan_prefill(m) if has_prefill else None,
            staging_slots=staging_slots,
            sequence_slots=sequence_slots,
            close_rows=close_rows,
            stage_in_store=stage_in_store,
        )
        return with_sequence_rows(metadata)

    def _list_closing_rows(self, m: CommonAttentionMetadata, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """The rows of an eager step that write their block's last slot (S4KVMetadata.close_rows), on the device."""
        rows = block_closing_rows(m.query_start_loc_cpu[: m.num_reqs + 1].numpy(), seq_lens[: m.num_reqs].numpy(),
                                  self.kv_cache_spec.block_size)
        return torch.from_numpy(rows).to(self.device, non_blocking=True)

    def _plan_prefill(self, m: CommonAttentionMetadata) -> PrefillPlan | None:
        # Mixed batches run eagerly (piecewise CUDA graphs), so host-side planning is allowed here.
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.v1.attention.backends.utils import split_decodes_and_prefills

        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            m, decode_threshold=self.reorder_batch_threshold)
        if num_prefills == 0:
            return None
        seq_lens = (m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens_cpu)
        seq_lens = seq_lens[num_decodes : m.num_reqs].to(torch.int32)
        q_lens = m.query_start_loc_cpu[1 : m.num_reqs + 1] - m.query_start_loc_cpu[: m.num_reqs]
        plan = plan_prefill_pass(seq_lens, q_lens[num_decodes:], self.staging is not None)
        spec = self.kv_cache_spec
        dtype = self.vllm_config.model_config.dtype
        page_shape = (PAGE, spec.num_kv_heads, spec.head_size)
        if 2 * (plan.num_pages - plan.own_pages) * math.prod(page_shape) * dtype.itemsize > self.dense_budget_bytes:
            return None
        dense_k = torch.empty(plan.num_pages, *page_shape, dtype=dtype, device=self.device)
        return PrefillPlan(
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_max_query_len=int(q_lens[:num_decodes].max()) if num_decodes else 0,
            cu_pages=plan.cu_pages.to(self.device, non_blocking=True),
            flash=plan.flash.to(self.device),
            max_query_len=int(q_lens[num_decodes:].max()),
            max_seq_len=int(seq_lens.max()),
            dense_k=dense_k,
            dense_v=torch.empty_like(dense_k),
            fa_version=get_flash_attn_version(),
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> S4KVMetadata:
        metadata = self.build(0, common_attn_metadata)
        # As TRITON_ATTN does: capture with 1-token contexts (capture is slow with max_model_len ones); replays
        # read the real seq_lens from the same buffer.
        metadata.seq_lens.fill_(1)
        return metadata


def with_sequence_rows(m: S4KVMetadata) -> S4KVMetadata:
    """``m`` with its decode and prefill rows sliced (S4KVMetadata.decode_rows, prefill_rows) where it has a
    PrefillPlan; unchanged otherwise."""
    if m.prefill is not None:
        nd = m.prefill.num_decodes
        m.decode_rows = SequenceRows.of(m, 0, nd) if nd else None
        m.prefill_rows = SequenceRows.of(m, nd)
    return m


def kv_update_runs_eagerly(compilation: Any) -> bool:
    """Whether vLLM runs the KV-cache update outside its piecewise CUDA graphs in steps with prefill: no piecewise
    graphs, or graphs split at the update (vLLM's default). Only then may the store's close launch a grid of the
    step's closing rows; a configuration that captures the update inside the graphs keeps the close's per-row grid,
    which writes the same bytes."""
    if not compilation.cudagraph_mode.has_piecewise_cudagraphs():
        return True
    return not compilation.use_inductor_graph_partition and compilation.splitting_ops_contain_kv_cache_update()


def layer_metadata(layer: Any) -> "S4KVMetadata | None":
    """The current step's metadata of an attention layer (None in a profiling run)."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # [0] is the target model's, as vLLM's get_attention_context reads it
        metadata = metadata[0]
    return metadata.get(layer.layer_name) if isinstance(metadata, dict) else metadata


class S4KVAttentionImpl(AttentionImpl[S4KVMetadata]):
    """Decoder self-attention over the int4 cache; rejects every feature the kernels do not implement."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **extra: Any) -> None:
        config = check_vllm_config(get_current_vllm_config())
        if config is None:
            raise S4KVConfigError(f'S4 KV\'s attention backend needs additional_config["{CONFIG_KEY}"].')
        self.scheme: Int4Scheme = config.scheme
        unsupported = {
            f"head_size {head_size}": head_size not in SUPPORTED_HEAD_DIMS,
            "ALiBi": alibi_slopes is not None,
            "sliding-window attention": sliding_window is not None,
            "logits soft-capping": bool(logits_soft_cap),
            f"{attn_type} attention": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
            f"kv_cache_dtype {kv_cache_dtype}": kv_cache_dtype != KV_CACHE_DTYPE,
            "attention sinks": extra.get("sinks") is not None,
            "dual-chunk attention": extra.get("dual_chunk_attention_config") is not None,
        }
        causes = [name for name, present in unsupported.items() if present]
        if causes:
            raise S4KVConfigError(f"{self.scheme.name} does not support {', '.join(causes)} in this layer.")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        install_warmup_hook()
        self.staged_keys = self._allocate_staging_pool(get_current_vllm_config()) if self.scheme.is_kivi else None
        self._load_kernels()

    def _allocate_staging_pool(self, vllm_config: VllmConfig) -> torch.Tensor:
        """int4_kivi's staging pool of this layer (kernels/staging.py), allocated with the model, before vLLM
        profiles memory, so the KV capacity it reports leaves room for it."""
        from s4kv.kernels.staging import allocate_pool

        install_step_hook()
        num_slots = vllm_config.scheduler_config.max_num_seqs
        dtype = vllm_config.model_config.dtype
        pool = allocate_pool(num_slots, self.num_kv_heads, BLOCK_SIZE, self.head_size, dtype,
                             vllm_config.device_config.device)
        size = pool.nbytes
        token_bytes = self.num_kv_heads * bytes_per_token(self.head_size)
        logger.info_once(
            "S4 KV int4_kivi staging pool: %d slots (max_num_seqs) x %d KV heads x %d x %d %s = %.1f MiB per "
            "attention layer, the room of %d int4 tokens of KV cache per layer", num_slots, self.num_kv_heads,
            BLOCK_SIZE, self.head_size, str(dtype).removeprefix("torch."), size / 2**20, size // token_bytes)
        return pool

    def _load_kernels(self) -> None:
        from s4kv.kernels.attention import paged_attention
        from s4kv.kernels.store import stage_open_keys, store_kv

        self._store_kv = store_kv
        self._stage_open_keys = stage_open_keys
        self._paged_attention = paged_attention

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        # key/value may carry CUDA-graph padding rows past the slot mapping; only mapped rows are stored.
        num_tokens = slot_mapping.shape[0]
        if self.staged_keys is None:
            self._store_kv(key[:num_tokens], value[:num_tokens], kv_cache, slot_mapping, self.scheme)
            return
        metadata = layer_metadata(layer)
        if metadata is None:  # a profiling run: every slot is -1, nothing is stored
            return
        close_rows = {} if metadata.close_rows is None else {"close_rows": metadata.close_rows}
        stage = STAGE_IN_STORE if metadata.stage_in_store else STAGE_BY_CALLER  # else after attention (forward)
        self._store_kv(key[:num_tokens], value[:num_tokens], kv_cache, slot_mapping, self.scheme, self.staged_keys,
                       metadata.staging_slots, stage=stage, **close_rows)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: S4KVMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("S4 KV attention does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        self._attend(query, key, value, kv_cache, attn_metadata, output)
        if self.staged_keys is not None and not attn_metadata.stage_in_store:
            # after attention: a step that closes the block it starts in and ends inside the next one re-keys the
            # slot, and attention still reads the first block's earlier keys from it
            n = attn_metadata.slot_mapping.shape[0]
            self._stage_open_keys(key[:n], attn_metadata.slot_mapping, self.staged_keys, attn_metadata.staging_slots)
        return output

    def _attend(self, query, key, value, kv_cache, m: S4KVMetadata, output) -> None:
        if m.prefill is None:
            self._paged_attention(query, kv_cache, m.block_table, m.seq_lens, m.query_start_loc, m.max_query_len,
                                  self.scale, self.scheme, output, workspace=m.workspace,
                                  **self._pool_read(m.sequence_slots, key))
            return
        p, d = m.prefill, m.decode_rows
        ndt = p.num_decode_tokens
        if d is not None:
            self._paged_attention(query[:ndt], kv_cache, d.block_table, d.seq_lens, d.query_start_loc,
                                  p.decode_max_query_len, self.scale, self.scheme, output[:ndt],
                                  workspace=m.workspace, **self._pool_read(d.sequence_slots, key))
        self._prefill_with_flash_attention(query, key, kv_cache, m, output)

    def _pool_read(self, sequence_slots: torch.Tensor | None, key: torch.Tensor) -> dict[str, Any]:
        """int4_kivi: what attention reads each query's own block from (docs/kernel-api.md): this step's keys
        (vLLM's ``key``; rows past num_actual_tokens are CUDA-graph padding, never read) and the staging pool at
        ``sequence_slots`` (the attended sequences'); nothing for int4_saw."""
        if self.staged_keys is None:
            return {}
        return {"new_keys": key, "staged_keys": self.staged_keys, "sequence_slots": sequence_slots}

    def _prefill_with_flash_attention(self, query, key, kv_cache, m: S4KVMetadata, output) -> None:
        p, rows = m.prefill, m.prefill_rows
        ndt, end = p.num_decode_tokens, m.num_actual_tokens
        flash_prefill(query[ndt:end], kv_cache, rows.block_table, rows.seq_lens, rows.query_start_loc, p,
                      self.scheme, self.scale, self.head_size, output[ndt:end],
                      **self._pool_read(rows.sequence_slots, key))


def flash_prefill(query, kv_cache, block_table, seq_lens, query_start_loc, p: PrefillPlan, scheme: Int4Scheme,
                  softmax_scale: float, head_dim: int, out, new_keys=None, staged_keys=None,
                  sequence_slots=None) -> None:
    """FlashAttention of the prefill queries ``query`` (the prefill part of the batch, [T, Hq, D]) over their
    sequences' K/V dequantized into dense pages (kernels/prefill_plan.py), into ``out``, in one causal pass; for
    int4_kivi the blocks' original keys (``new_keys`` rows at ``query_start_loc``, the pool at ``sequence_slots``)
    go into their own pages in the same gather."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    from s4kv.kernels.dense import gather_dense_kv

    own = (dict(new_keys=new_keys, staged_keys=staged_keys, sequence_slots=sequence_slots,
                query_start_loc=query_start_loc) if scheme.is_kivi else {})
    gather_dense_kv(kv_cache, block_table, seq_lens, p.cu_pages, p.max_seq_len, scheme, p.dense_k, p.dense_v,
                    head_dim, **own)
    f = p.flash
    flash_attn_varlen_func(
        q=query, k=p.dense_k, v=p.dense_v, out=out, cu_seqlens_q=f.cu_seqlens_q, max_seqlen_q=f.max_seqlen_q,
        seqused_k=f.seqused_k, max_seqlen_k=f.max_seqlen_k, block_table=f.block_table, softmax_scale=softmax_scale,
        causal=True, fa_version=p.fa_version)
