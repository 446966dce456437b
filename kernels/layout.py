"""Byte layout of one int4 KV page: the single source of truth for every kernel and the reference.

vLLM 0.26.0 sizes an ``int4_per_token_head`` page as ``block_size * num_kv_heads * (head_dim + 8)`` bytes
(head_dim / 2 B of K codes + head_dim / 2 B of V codes + 8 B of scales per token and KV head: 136 at head_dim 128,
72 at head_dim 64). Both S4 KV schemes fill exactly that budget. The cache tensor handed to a backend is
``uint8[num_blocks, num_kv_heads, block_size * (head_dim + 8)]``: one contiguous region per (block, KV head).
With ``D`` = head_dim, ``H = D / 2`` and ``B`` = block_size::

    [0,          H*B)    K codes, token-major: token t at H*t .. H*t + H - 1
    [H*B,        D*B)    V codes, channel-major: code byte j of token t at H*B + j*B + t
    [D*B,    (D+4)*B)    V params: token t -> (fp16 scale, fp16 min)
    [(D+4)*B,(D+8)*B)    K params: int4_saw and an open int4_kivi block: token t -> (fp16 scale, fp16 min);
                         a closed int4_kivi block: channel c -> (fp16 scale, fp16 min)  (needs B == 128, so the
                         D channels' params fit the 4 * 128 bytes)

A code byte j holds channel j in its low nibble and channel j + H in its high nibble, so
each half of a head vector is a contiguous slice. Dequantization is ``x = code * scale + min``.

Why V is channel-major: attention reads V as the second operand of P @ V, whose reduction runs over tokens, so
a tensor-core fragment pairs consecutive tokens of one channel. Channel-major, those are adjacent bytes
(vector loads); token-major, they are H bytes apart and the kernel gathers them one byte at a time. K is the
second operand of Q K^T, reduced over channels: token-major keeps its channels adjacent.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from s4kv.runtime.schemes import KV_FORMATS, SUPPORTED_HEAD_DIMS

# The kernels split a head into two halves of head_dim / 2 channels, each a power of two of at least 16 (Triton
# ranges and tensor-core dots), and a closed KIVI block keeps head_dim per-channel (scale, min) pairs in the
# 4 bytes per token of its K params: head_dim <= 128. 64 and 128 are the sizes built and tested.
PARAM_BYTES = 4  # (fp16 scale, fp16 min) of one vector
KIVI_BLOCK_SIZE = 128  # a KIVI key group is one page: its channels' (scale, min) fill the K params


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"S4 KV pages support head_dim {' and '.join(map(str, SUPPORTED_HEAD_DIMS))}, got {head_dim}")


def bytes_per_token(head_dim: int) -> int:
    """int4 bytes of one token's K and V for one KV head: codes for both plus the two (scale, min) pairs."""
    return KV_FORMATS["int4"].bytes_per_head_token(head_dim)


@dataclass(frozen=True)
class PageLayout:
    """Offsets inside the region of one (block, KV head), in bytes."""

    block_size: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        check_head_dim(self.head_dim)

    @classmethod
    def of_cache(cls, kv_cache, head_dim: int) -> "PageLayout":
        """The layout of a cache tensor [num_blocks, num_kv_heads, page_bytes] holding head_dim-wide heads."""
        if kv_cache.dim() != 3:
            raise ValueError(f"kv_cache must be [blocks, kv_heads, page bytes], got {tuple(kv_cache.shape)}")
        return _layout_of_page(kv_cache.shape[2], head_dim)

    @property
    def half_dim(self) -> int:
        return self.head_dim // 2

    @property
    def page_bytes(self) -> int:
        return self.block_size * bytes_per_token(self.head_dim)

    @property
    def k_codes(self) -> int:
        return 0

    @property
    def v_codes(self) -> int:
        return self.half_dim * self.block_size

    @property
    def v_params(self) -> int:
        return self.head_dim * self.block_size

    @property
    def k_params(self) -> int:
        return (self.head_dim + PARAM_BYTES) * self.block_size


# Every kernel wrapper reads the layout for every layer of an eagerly run step: computed once per page size.
@lru_cache(maxsize=None)
def _layout_of_page(page_bytes: int, head_dim: int) -> PageLayout:
    check_head_dim(head_dim)
    if page_bytes % bytes_per_token(head_dim):
        raise ValueError(f"kv_cache must be [blocks, kv_heads, block_size * {bytes_per_token(head_dim)}] for "
                         f"head_dim {head_dim}, got pages of {page_bytes} bytes")
    return PageLayout(page_bytes // bytes_per_token(head_dim), head_dim)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid sizes. Plain integer arithmetic: triton.cdiv is a constexpr function, whose
    call from Python costs microseconds, paid by every launch of an eagerly run step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), on the host (triton.next_power_of_2 costs as triton.cdiv does)."""
    return 1 << (n - 1).bit_length()


def tile_tokens(block_size: int, max_tile: int) -> int:
    """Tokens per kernel tile: a power of two (Triton ranges) that divides the page, so no tile straddles two
    pages, and at most max_tile. Pages are multiples of 16 tokens, so a tile has at least 16."""
    return min(block_size & -block_size, max_tile)


def cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
    """Shape of the uint8 cache tensor vLLM allocates for one layer."""
    return (num_blocks, num_kv_heads, PageLayout(block_size, head_dim).page_bytes)
