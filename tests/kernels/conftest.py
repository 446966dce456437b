"""Shared set-up of the kernel tests.

Without a GPU the Triton kernels run under Triton's interpreter (fp16 only). ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is *defined*, so it must be set here, at import time, before any test
module imports ``s4kv.kernels.store`` or ``s4kv.kernels.attention``. With CUDA present the same tests run
the compiled kernels on the GPU instead.
"""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    _interpreting_already = os.environ.get("TRITON_INTERPRET") == "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _early = [m for m in ("s4kv.kernels.store", "s4kv.kernels.attention") if m in sys.modules]
    if _early and not _interpreting_already:
        raise pytest.UsageError(
            f"{_early} were imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1, so their "
            "kernels cannot run on this CPU-only machine: run pytest with TRITON_INTERPRET=1 in the environment"
        )

KERNEL_DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded by the test's own id: fresh data per test, reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def kernel_device() -> torch.device:
    return KERNEL_DEVICE
