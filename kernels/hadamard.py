"""Block-diagonal normalized Hadamard rotations (SAW-INT4's BDR)."""

from __future__ import annotations

import torch


def sylvester_hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1), n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def block_hadamard(block: int, dim: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``diag(H_b, ..., H_b) / sqrt(b)``: orthonormal and symmetric, so it is its own inverse.

    Rotating a row vector is ``x @ R``; un-rotating is ``y @ R`` again.
    """
    if dim % block:
        raise ValueError(f"Hadamard block {block} does not divide head_dim {dim}")
    h = sylvester_hadamard(block) / block**0.5
    return torch.block_diag(*[h] * (dim // block)).to(device=device, dtype=dtype)
