"""Every kernel launch the backend makes compiles for Hopper (sm_90), checked on a machine with no GPU.

The interpreter tests run the kernels' Python; what only the GPU compiler rejects they cannot see (see
tools/device/hopper_compile.py). This runs the real wrappers with launches made compile-only, in a process without
TRITON_INTERPRET, so a kernel that would fail to compile on the H200 fails here first.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from repo_tools import run_compile_only_tool


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile every launch for real")
def test_every_launch_compiles_for_sm90(tmp_path):
    result = run_compile_only_tool("hopper_compile", cache_dir=tmp_path / "triton-cache")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    launches = Counter(line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("_"))
    # per scheme (kivi, saw, saw with 32-blocks and rotated values) x query dtype (bf16, fp16), at head_dim 128:
    # attention 4 code paths x (split decode, plain decode, prefill), merge 4 x 1, store 1 (K and V), dense gather
    # 1; at head_dim 64 the default code path only: attention 3, merge 1, store 1, dense 1; and per head_dim and
    # dtype, KIVI's store with its staging pool also closes over every row and stages (1 + 1) and a second store
    # stages in its own launch and closes over listed rows (store 1, close 1); per scheme, head_dim and dtype the split
    # decode with every tile masked and the row sums in two reductions (attention and merge, 12 each), and the
    # prefill with unmasked full tiles (attention 12); per int4_saw scheme, head_dim and dtype the split decode with
    # the query rows as the MMA's N (attention and merge, 8 each)
    assert launches == {"_paged_attention_kernel": 72 + 18 + 12 + 12 + 8, "_merge_splits_kernel": 24 + 6 + 12 + 8,
                        "_store_per_token_kernel": 12 + 4, "_kivi_close_kernel": 4 + 4,
                        "_kivi_stage_kernel": 4, "_gather_dense_kernel": 6 + 6}, launches
    unmasked = Counter(line.split(":")[0] for line in result.stdout.splitlines() if "UNMASKED_FULL_TILES=True" in line)
    # DECODE_LAUNCH's wholly seen tiles unmasked: every other decode launch (48 at head_dim 128, 12 at 64), and the
    # prefill's 12
    assert unmasked == {"_paged_attention_kernel": 48 + 12 + 12}, unmasked
    joint = Counter(line.split(":")[0] for line in result.stdout.splitlines() if "JOINT_ROW_SUMS=True" in line)
    # DECODE_LAUNCH's row sums in one reduction: the same decode launches as its unmasked tiles
    assert joint == {"_paged_attention_kernel": 48 + 12}, joint
    group_as_n = Counter(line.split(":")[0] for line in result.stdout.splitlines() if "GROUP_AS_N=True" in line)
    assert group_as_n == {"_paged_attention_kernel": 8}, group_as_n
