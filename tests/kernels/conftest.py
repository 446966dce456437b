"""Shared set-up of the kernel tests.

Without a GPU the Triton kernels run under Triton's interpreter (fp16 only); tests/conftest.py sets
``TRITON_INTERPRET`` before anything imports triton. With CUDA present the same tests run the compiled
kernels on the GPU instead.
"""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    # tests/conftest.py sets TRITON_INTERPRET=1 before any test module can import triton; if it is not set
    # now (pytest started below tests/, or the variable was set to something else), the kernels cannot run.
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
        raise pytest.UsageError(
            "triton was imported without TRITON_INTERPRET=1 on this CPU-only machine, so the kernels cannot run: "
            "run pytest from the repository root (tests/conftest.py sets it) or with TRITON_INTERPRET=1"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded by the test's own id: fresh data per test, reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def kernel_device() -> torch.device:
    return KERNEL_DEVICE
