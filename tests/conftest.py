"""Session-wide set-up, loaded before any test module.

Without a GPU the Triton kernels run under Triton's interpreter. ``triton`` reads ``TRITON_INTERPRET`` when
its language module and each kernel are *defined*, and other test folders import vLLM (which imports triton),
so the variable is set here, before anything can import triton. On a CUDA machine nothing changes.
"""

import os

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
