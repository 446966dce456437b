"""Compile every S4 KV Triton kernel for Hopper (sm_90) as the real wrappers launch it, on a machine with no GPU.

The Triton interpreter that CI runs the kernels under executes Python, so it cannot see what only the GPU
compiler rejects (a kernel that runs in the interpreter but does not compile: an early return of one dtype inside
a constexpr `if` beside another did exactly that). Triton compiles for sm_90 on any machine (ptxas ships in the
wheel), so this module swaps in a driver that names a Hopper target and makes every launch compile-only, then calls
the real wrappers (``paged_attention``, ``store_kv``, ``gather_dense_kv``) on small CPU
tensors in every configuration the backend uses. The kernels are specialized exactly as on the GPU (argument
types, 16-byte alignment of pointers and strides, constexprs, warps and stages); nothing runs.

    python tools/device/hopper_compile.py          # compile them all; prints one line per kernel variant

Must run in a process where TRITON_INTERPRET is unset (the interpreter replaces @triton.jit).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from dataclasses import dataclass, replace

import torch

HOPPER = ("cuda", 90, 128)


@dataclass
class Compiled:
    kernel: str  # the @triton.jit function's name
    constexprs: dict
    num_warps: int
    num_stages: int
    cubin: bytes
    shared_bytes: int


class _CompileOnlyDriver:
    """Just enough of a Triton driver for JITFunction.run(warmup=True): a device, a stream and a target."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*HOPPER)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only():
    """Inside, every Triton launch compiles for sm_90 and records a Compiled instead of running."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("hopper_compile needs TRITON_INTERPRET unset: the interpreter replaces @triton.jit")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list[Compiled] = []
    original_run = JITFunction.run

    def run_compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {self.arg_names[path[0]]: value for path, value in kernel.src.constants.items()}
        compiled.append(Compiled(self.fn.__name__, constexprs, kernel.metadata.num_warps,
                                 kernel.metadata.num_stages, kernel.asm["cubin"], kernel.metadata.shared))
        return kernel

    previous = driver._active  # reset_active() would look for a real driver, which a CPU machine lacks
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = run_compile_only
    try:
        yield compiled
    finally:
        JITFunction.run = original_run
        driver._active = previous


def launch_all(dtypes=(torch.bfloat16, torch.float16), group: int = 7, num_kv_heads: int = 4) -> None:
    """Every launch the backend makes, once per head_dim, scheme and query dtype (compile_only records them): at
    head_dim 128 with every attention code path (attention.CODE_PATHS, which the benchmark and tuning tools sweep),
    at head_dim 64 the backend's own launches; the launch options (int4_saw's group_as_n among them); int4_kivi's
    store and attention with its staging pool (kernels/staging.py), its close over listed rows, and its gather of
    the original keys."""
    from s4kv.kernels import attention
    from s4kv.kernels.dense import gather_dense_kv
    from s4kv.kernels.layout import KIVI_BLOCK_SIZE, cache_shape
    from s4kv.kernels.scheme import Int4Scheme
    from s4kv.kernels.staging import STAGE_IN_STORE
    from s4kv.kernels.store import store_kv
    from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS

    num_q_heads = group * num_kv_heads
    block_size, num_blocks, num_seqs = KIVI_BLOCK_SIZE, 8, 2
    block_table = torch.arange(num_seqs * 4, dtype=torch.int32).view(num_seqs, 4)
    seq_lens = torch.tensor([300, 17], dtype=torch.int32)
    schemes = (Int4Scheme("int4_kivi"), Int4Scheme("int4_saw"), Int4Scheme("int4_saw", 32, True))
    for head_dim, scheme, dtype in itertools.product(SUPPORTED_HEAD_DIMS, schemes, dtypes):
        cache = torch.zeros(cache_shape(num_blocks, num_kv_heads, block_size, head_dim), dtype=torch.uint8)
        kv = torch.zeros(5, num_kv_heads, head_dim, dtype=dtype)
        pool = torch.zeros(num_seqs, num_kv_heads, block_size, head_dim, dtype=dtype)
        staging = dict(staged_keys=pool, staging_slots=torch.zeros(5, dtype=torch.int64)) if scheme.is_kivi else {}
        store_kv(kv, kv, cache, torch.arange(5, dtype=torch.int64), scheme, **staging)
        if scheme.is_kivi:  # an eager step's store: staging in its launch, the close over the rows the builder lists
            store_kv(kv, kv, cache, torch.arange(5, dtype=torch.int64), scheme, **staging, stage=STAGE_IN_STORE,
                     close_rows=torch.tensor([4], dtype=torch.int32))
        # head_dim 64: the backend's own launches (launch=None), which pick the code path that head_dim allows
        code_paths = attention.CODE_PATHS.values() if head_dim == 128 else [None]
        # what int4_kivi's attention reads beside the cache: the step's keys and the pool
        own_block = dict(new_keys=torch.zeros(20, num_kv_heads, head_dim, dtype=dtype), staged_keys=pool,
                         sequence_slots=torch.arange(num_seqs, dtype=torch.int32)) if scheme.is_kivi else {}
        for code_path in code_paths:
            decode_launch = None if code_path is None else replace(attention.DECODE_LAUNCH[scheme.name], **code_path)
            prefill_launch = None if code_path is None else replace(attention.PREFILL_LAUNCH, **code_path)
            workspace = attention.SplitWorkspace.allocate(num_q_heads, num_kv_heads, head_dim, "cpu", scheme.name)
            q = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=dtype)
            decode_qsl = torch.arange(num_seqs + 1, dtype=torch.int32)
            for ws in (workspace, None):  # split-KV decode, and one program per sequence
                attention.paged_attention(q, cache, block_table, seq_lens, decode_qsl, 1, 0.1, scheme,
                                          torch.empty_like(q), workspace=ws, launch=decode_launch, **own_block)
            q = torch.zeros(20, num_q_heads, head_dim, dtype=dtype)
            prefill_qsl = torch.tensor([0, 3, 20], dtype=torch.int32)
            attention.paged_attention(q, cache, block_table, seq_lens, prefill_qsl, 17, 0.1, scheme,
                                      torch.empty_like(q), workspace=workspace, launch=prefill_launch, **own_block)
        # the decode launch with every tile masked and a tile's row sums in two reductions
        # (LaunchConfig.unmasked_full_tiles and joint_row_sums off)
        optioned = replace(attention.DECODE_LAUNCH[scheme.name], unmasked_full_tiles=False,
                           joint_row_sums=False,
                           subnormal_codes=attention.DECODE_LAUNCH[scheme.name].subnormal_codes
                           and head_dim in attention.SUBNORMAL_HEAD_DIMS)
        q = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=dtype)
        attention.paged_attention(q, cache, block_table, seq_lens, torch.arange(num_seqs + 1, dtype=torch.int32), 1,
                                  0.1, scheme, torch.empty_like(q),
                                  workspace=attention.SplitWorkspace.allocate(num_q_heads, num_kv_heads, head_dim,
                                                                              "cpu", scheme.name),
                                  launch=optioned, **own_block)
        # prefill with the tiles every row of a query tile sees wholly unmasked (LaunchConfig.unmasked_full_tiles)
        q = torch.zeros(20, num_q_heads, head_dim, dtype=dtype)
        attention.paged_attention(q, cache, block_table, seq_lens, torch.tensor([0, 3, 20], dtype=torch.int32), 17,
                                  0.1, scheme, torch.empty_like(q),
                                  launch=replace(attention.PREFILL_LAUNCH, unmasked_full_tiles=True), **own_block)
        if not scheme.is_kivi:  # split decode with the query rows as the MMA's N (LaunchConfig.group_as_n)
            q = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=dtype)
            attention.paged_attention(
                q, cache, block_table, seq_lens, torch.arange(num_seqs + 1, dtype=torch.int32), 1, 0.1, scheme,
                torch.empty_like(q),
                workspace=attention.SplitWorkspace.allocate(num_q_heads, num_kv_heads, head_dim, "cpu", scheme.name),
                launch=replace(attention.DECODE_LAUNCH[scheme.name].with_group_as_n(),
                               subnormal_codes=head_dim in attention.SUBNORMAL_HEAD_DIMS))
        dense_k = torch.empty(6, block_size, num_kv_heads, head_dim, dtype=dtype)
        dense_v = torch.empty_like(dense_k)
        cu_pages = torch.tensor([0, 3, 4], dtype=torch.int32)
        own = (dict(own_block, query_start_loc=torch.tensor([0, 3, 20], dtype=torch.int32)) if scheme.is_kivi
               else {})
        gather_dense_kv(cache, block_table, seq_lens, cu_pages, 300, scheme, dense_k, dense_v, head_dim, **own)


def main() -> int:
    with compile_only() as compiled:
        launch_all()
    for c in compiled:
        flags = ", ".join(f"{k}={v}" for k, v in sorted(c.constexprs.items()))
        print(f"{c.kernel}: {c.num_warps} warps, {c.num_stages} stages, {c.shared_bytes} B shared; {flags}")
    print(f"[hopper_compile] {len(compiled)} launches compiled for sm_{HOPPER[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
