"""Sweep the attention kernel's launch configurations on the GPU and print the fastest per shape.

python tools/tune_attention.py   (H200: about five minutes: every tile/warps/stages config with every code path of
attention.CODE_PATHS, per scheme). The winners become DECODE_LAUNCH / PREFILL_LAUNCH in
kernels/attention.py; the tuning log in docs/performance.md keeps what was measured.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import torch
import triton

from s4kv.kernels.attention import CODE_PATHS, LaunchConfig, SplitWorkspace, paged_attention
from s4kv.kernels.scheme import Int4Scheme

B = 128
HQ, HKV = 28, 4  # Qwen2.5-7B attention shape


def make_case(batch, ctx, q_len, scheme):
    blocks = -(-ctx // B)
    nb = batch * blocks
    cache = torch.randint(0, 256, (nb, HKV, B * 136), dtype=torch.uint8, device="cuda")
    # finite params everywhere: random bytes can decode to inf/NaN fp16 scales
    params = cache[:, :, 128 * B :].view(torch.float16)
    params.copy_(torch.rand_like(params, dtype=torch.float16) * 0.1)
    bt = torch.randperm(nb, device="cuda").view(batch, blocks).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, HQ, 128, device="cuda", dtype=torch.bfloat16)
    return cache, bt, seq_lens, qsl, q


def main():
    results = []
    decode_cases = [(1, 32768), (32, 16384), (256, 4096)]
    prefill_cases = [(4, 4096, 512)]
    # warps 2: the static count (tools/sass_stats.py) says fewer warps per tile re-load q less often; 8 never won
    decode_grid = [(codes, LaunchConfig(t, w, s, **CODE_PATHS[codes]))
                   for codes, t, w, s in itertools.product(CODE_PATHS, (64, 128), (2, 4), (2, 3))]
    prefill_grid = [(codes, LaunchConfig(t, w, s, **CODE_PATHS[codes]))
                    for codes, t, w, s in itertools.product(CODE_PATHS, (32, 64), (4, 8), (2,))]
    for scheme in (Int4Scheme("int4_kivi"), Int4Scheme("int4_saw")):
        for kind, cases, grid in (("decode", decode_cases, decode_grid), ("prefill", prefill_cases, prefill_grid)):
            for case in cases:
                batch, ctx = case[:2]
                q_len = case[2] if kind == "prefill" else 1
                cache, bt, sl, qsl, q = make_case(batch, ctx, q_len, scheme)
                out = torch.empty_like(q)
                expected = None  # the first config's output (the default code path): every other must match it
                for targets in (4,):
                    ws = SplitWorkspace.allocate(HQ, HKV, "cuda", target_programs=targets * 132) if kind == "decode" else None
                    for codes, cfg in grid:
                        try:
                            ms = triton.testing.do_bench(
                                lambda: paged_attention(q, cache, bt, sl, qsl, q_len, 0.088, scheme, out, ws, cfg),
                                warmup=10, rep=40, return_mode="median")
                        except Exception as exc:  # out of shared memory / registers for this config
                            print(f"skip {cfg}: {type(exc).__name__}")
                            continue
                        if expected is None:
                            expected = out.float().clone()
                        err = float((out.float() - expected).norm() / expected.norm())
                        if not err < 1e-2:  # a fast wrong kernel must not win the sweep
                            print(f"WRONG {codes} {cfg}: relative difference {err:.3g} from the default path")
                            continue
                        nbytes = batch * ctx * HKV * 136
                        results.append(dict(scheme=scheme.name, kind=kind, batch=batch, ctx=ctx, q_len=q_len,
                                            targets=targets, codes=codes, tile=cfg.tile, warps=cfg.num_warps,
                                            stages=cfg.num_stages, us=ms * 1e3, gbps=nbytes / ms / 1e6))
                best = min((r for r in results if (r["scheme"], r["kind"], r["batch"], r["ctx"]) ==
                            (scheme.name, kind, batch, ctx)), key=lambda r: r["us"])
                print(f"{scheme.name:10s} {kind:7s} b={batch:<4d} ctx={ctx:<6d} q={q_len:<5d} best {best['us']:8.1f} us "
                      f"{best['gbps']:6.0f} GB/s codes={best['codes']} tile={best['tile']} warps={best['warps']} "
                      f"stages={best['stages']} targets={best['targets']}", flush=True)
                del cache
                save(results)  # after every shape: a call cut short keeps what it measured
    # one config per scheme and kind for all its shapes: the lowest geometric-mean time
    def config(r):
        return r["codes"], r["tile"], r["warps"], r["stages"], r["targets"]

    for scheme_name, kind in itertools.product(("int4_kivi", "int4_saw"), ("decode", "prefill")):
        rows = [r for r in results if (r["scheme"], r["kind"]) == (scheme_name, kind)]
        shapes = {(r["batch"], r["ctx"]) for r in rows}

        def score(key):
            sel = [r["us"] for r in rows if config(r) == key]
            return math.exp(sum(map(math.log, sel)) / len(sel)) if len(sel) == len(shapes) else float("inf")

        best = min({config(r) for r in rows}, key=score)
        print(f"overall best {scheme_name} {kind}: codes,tile,warps,stages,targets={best} "
              f"geomean {score(best):.1f} us")
    save(results)


def save(results):
    with open(os.path.join(os.environ.get("OUT", "."), "tune_attention.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
