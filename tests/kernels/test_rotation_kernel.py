"""The in-kernel Hadamard rotations (kernels/triton_common.py) against x @ block_hadamard in float64.

rotate_halves builds one quadrant of the sign pattern and derives the other three (Sylvester's [[Q, Q], [Q, -Q]]
for a block spanning both halves, Q repeated on the diagonal otherwise): every block size the schemes allow at
both head_dims, on fresh random rows, rows of one spike (a single nonzero channel picks out one row of the
matrix, so a wrong sign or block shows exactly), and rotate_halves_fp32 on rows far outside fp16's range.
Interpreter on CPU (fp16), compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from s4kv.kernels.hadamard import block_hadamard
from s4kv.kernels.triton_common import rotate_halves, rotate_halves_fp32

ROWS = 16  # a dot needs at least 16 rows


@triton.jit
def _rotate_kernel(x_ptr, y_ptr, HADAMARD_BLOCK: tl.constexpr, HALF: tl.constexpr, FP32: tl.constexpr):
    rows = tl.arange(0, 16)[:, None] * (2 * HALF)
    ch = tl.arange(0, HALF)[None, :]
    x_lo = tl.load(x_ptr + rows + ch)
    x_hi = tl.load(x_ptr + rows + HALF + ch)
    if FP32:
        y_lo, y_hi = rotate_halves_fp32(x_lo, x_hi, HADAMARD_BLOCK, HALF)
    else:
        y_lo, y_hi = rotate_halves(x_lo, x_hi, HADAMARD_BLOCK, HALF)
    tl.store(y_ptr + rows + ch, y_lo)
    tl.store(y_ptr + rows + HALF + ch, y_hi)


def rotated(x: torch.Tensor, block: int, fp32: bool) -> torch.Tensor:
    y = torch.full(x.shape, float("nan"), dtype=torch.float32, device=x.device)
    _rotate_kernel[(1,)](x, y, HADAMARD_BLOCK=block, HALF=x.shape[1] // 2, FP32=fp32)
    return y


CASES = [(dim, block) for dim in (64, 128) for block in (16, 32, 64, 128) if block <= dim]


@pytest.mark.parametrize("dim,block", CASES)
def test_rotate_halves_matches_the_block_hadamard(gen, kernel_device, dim, block):
    x = torch.randn(ROWS, dim, generator=gen).half().to(kernel_device)
    spikes = torch.zeros(ROWS, dim, dtype=torch.float16)
    spikes[torch.arange(ROWS), torch.randperm(dim, generator=gen)[:ROWS]] = 1.0
    r = block_hadamard(block, dim, dtype=torch.float64)
    for rows in (x, spikes.to(kernel_device)):
        want = rows.cpu().double() @ r
        got = rotated(rows, block, fp32=False).cpu().double()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dim,block", CASES)
def test_rotate_halves_fp32_keeps_rows_past_fp16_range(gen, kernel_device, dim, block):
    x = torch.randn(ROWS, dim, generator=gen) * torch.logspace(-3, 9, ROWS)[:, None]
    want = x.double() @ block_hadamard(block, dim, dtype=torch.float64)
    got = rotated(x.to(kernel_device), block, fp32=True).cpu().double()
    assert torch.isfinite(got).all()
    row_error = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(row_error.max()) < 1e-5, row_error
