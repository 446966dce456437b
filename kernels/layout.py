"""Byte layout of one int4 KV page: the single source of truth for every kernel and the reference.

vLLM 0.26.0 sizes an ``int4_per_token_head`` page as ``block_size * num_kv_heads * 136`` bytes
(head_dim 128: 64 B of K codes + 64 B of V codes + 8 B of scales per token and KV head).
Both S4 KV schemes fill exactly that budget. The cache tensor handed to a backend is
``uint8[num_blocks, num_kv_heads, block_size * 136]``: one contiguous region per (block, KV head)::

    [0,        64*B)    K codes, token-major: token t at 64*t .. 64*t + 63
    [64*B,    128*B)    V codes, channel-major: code byte j of token t at 64*B + j*B + t
    [128*B,   132*B)    V params: token t -> (fp16 scale, fp16 min)
    [132*B,   136*B)    K params: int4_saw and an open int4_kivi block: token t -> (fp16 scale, fp16 min);
                        a closed int4_kivi block: channel c -> (fp16 scale, fp16 min)  (needs B == 128)

A code byte j holds channel j in its low nibble and channel j + 64 in its high nibble, so
each half of a head vector is a contiguous slice. Dequantization is ``x = code * scale + min``.

Why V is channel-major: attention reads V as the second operand of P @ V, whose reduction runs over tokens, so
a tensor-core fragment pairs consecutive tokens of one channel. Channel-major, those are adjacent bytes
(vector loads); token-major, they are 64 bytes apart and the kernel gathers them one byte at a time. K is the
second operand of Q K^T, reduced over channels: token-major keeps its channels adjacent.
"""

from __future__ import annotations

from dataclasses import dataclass

from s4kv.runtime.schemes import HEAD_DIM, KV_FORMATS

HALF_DIM = HEAD_DIM // 2
BYTES_PER_TOKEN = KV_FORMATS["int4"].bytes_per_head_token(HEAD_DIM)  # K codes 64 + V codes 64 + V params 4 + K params 4
KIVI_BLOCK_SIZE = 128  # a KIVI key group is one page: 128 channels x (scale, min) fill the K params


@dataclass(frozen=True)
class PageLayout:
    """Offsets inside the region of one (block, KV head), in bytes unless the name says fp16."""

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")

    @property
    def page_bytes(self) -> int:
        return self.block_size * BYTES_PER_TOKEN

    @property
    def k_codes(self) -> int:
        return 0

    @property
    def v_codes(self) -> int:
        return HALF_DIM * self.block_size

    @property
    def v_params(self) -> int:
        return HEAD_DIM * self.block_size

    @property
    def k_params(self) -> int:
        return (HEAD_DIM + 4) * self.block_size


def tile_tokens(block_size: int, max_tile: int) -> int:
    """Tokens per kernel tile: a power of two (Triton ranges) that divides the page, so no tile straddles two
    pages, and at most max_tile. Pages are multiples of 16 tokens, so a tile has at least 16."""
    return min(block_size & -block_size, max_tile)


def cache_shape(num_blocks: int, num_kv_heads: int, block_size: int) -> tuple[int, int, int]:
    """Shape of the uint8 cache tensor vLLM allocates for one layer."""
    return (num_blocks, num_kv_heads, PageLayout(block_size).page_bytes)
