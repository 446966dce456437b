"""The probe of job 4, run as a test in tests/kernels/test_own_block_gpu.py (not kept: its premise failed). It asks
whether copying the prefill plan's host tensors from pageable memory waits for the GPU's queued work, as a stream
sync would, and whether pinned copies do not. Result (4_pageable_copy_test.log): the pageable copies returned in
0.001 s with about 0.2 s of GPU work queued, so they do not wait, and pinning them changes nothing.

    python -m pytest -q tests/kernels/test_own_block_gpu.py -k reaches_the_gpu   # with the test below added
"""
import time

import torch

from s4kv.kernels.prefill_plan import plan_prefill_passes


def host_to_device(tensor, device):  # the candidate change: pin, then copy without blocking
    device = torch.device(device)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def test_prefill_plan_reaches_the_gpu_without_waiting_for_it():
    plan = plan_prefill_passes(torch.tensor([4096, 700, 300]), torch.tensor([512, 700, 200]), True)
    tensors = [plan.cu_pages] + [t for p in plan.passes for t in (p.cu_seqlens_q, p.block_table, p.seqused_k)]

    def host_seconds(copy):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # clock cycles: about 0.2 s at the H200's 1.98 GHz
        start = time.perf_counter()
        copies = [copy(t) for t in tensors]
        seconds = time.perf_counter() - start
        torch.cuda.synchronize()
        assert all(torch.equal(c.cpu(), t) for c, t in zip(copies, tensors))
        return seconds

    pageable = host_seconds(lambda t: t.to("cuda", non_blocking=True))
    pinned = host_seconds(lambda t: host_to_device(t, "cuda"))
    assert pageable > 0.1, f"pageable copies returned in {pageable:.3f} s: the premise does not hold here"
    assert pinned < 0.02, f"the plan's copies waited {pinned:.3f} s for the GPU"
