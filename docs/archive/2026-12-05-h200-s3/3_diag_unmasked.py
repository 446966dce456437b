"""The prefill launch of paged_attention over the batch of test_unmasked_full_tiles_match_the_reference
(STRADDLING and MIXED specs, GQA 7), int4_saw at head_dim 128 and 64: every combination of the tile (64, 128), the
wide code loads, the unmasked tiles and the PTX unpack, error per sequence against the reference. From the repository
root on a GPU (DIAG_DEV=cpu with TRITON_INTERPRET=1 runs the paths the interpreter can)."""

import dataclasses
import os
import sys
import zlib

sys.path[:0] = ["tests/kernels", "tests"]
import test_attention_kernel as t  # noqa: E402
import torch  # noqa: E402
from kv_batches import cache_with_prefix, make_paged_batch, relative_error, with_guard_blocks  # noqa: E402

from s4kv.kernels import reference as ref  # noqa: E402
from s4kv.kernels.attention import PREFILL_LAUNCH  # noqa: E402

dev = torch.device(os.environ.get("DIAG_DEV", "cuda"))
FAILING = ("tests/kernels/test_attention_kernel.py::test_unmasked_full_tiles_match_the_reference"
           "[saw128-128-mixed-wide-codes]")


def per_sequence_errors(out, expected, qsl, specs) -> list[str]:
    bad = []
    for i in range(len(qsl) - 1):
        o, e = out[qsl[i]:qsl[i + 1]].float(), expected[qsl[i]:qsl[i + 1]].float()
        d = (o - e).abs().max().item() if o.numel() else 0.0
        if not d < 2e-2 + 2e-2 * e.abs().max().item():
            rows = ((o - e).abs().flatten(1).amax(1) > 0.05).nonzero().flatten().tolist()
            bad.append(f"seq{i}{specs[i]} maxdiff {d:.3g} rows {rows[:12]}")
    return bad


for seed_name in [FAILING, "a", "b"]:
    for specs_name in ["STRADDLING", "MIXED"]:
        specs = getattr(t, specs_name)
        for scheme_name, head_dim in [("saw128", 128), ("saw64-rotv", 64)]:
            gen = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))
            scheme = t.SCHEMES[scheme_name]
            nq, nkv = t.heads_for(7)
            batch = make_paged_batch(gen, specs, nq, nkv, block_size=128, dtype=torch.float16, device=dev,
                                     num_padding=1, head_dim=head_dim)
            cache = with_guard_blocks(cache_with_prefix(batch, scheme, gen, dev), gen)
            ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
            expected = t.run_reference(batch, cache, scheme)
            qsl = batch.query_start_loc.tolist()
            for tile in [64, 128]:
                for wide in [False, True]:
                    for unmasked in [False, True]:
                        for ptx in [False, True]:
                            what = (f"{seed_name[-12:]} {specs_name} {scheme_name} tile{tile} wide={wide} "
                                    f"unmasked={unmasked} ptx={ptx}")
                            launch = dataclasses.replace(PREFILL_LAUNCH, tile=tile, ptx_unpack=ptx,
                                                         subnormal_codes=False, wide_code_loads=wide,
                                                         unmasked_full_tiles=unmasked)
                            try:
                                out = t.run_kernel(batch, cache, scheme, None, launch)
                                if dev.type == "cuda":
                                    torch.cuda.synchronize()
                            except Exception as e:
                                print(f"{what}: {type(e).__name__} {e}"[:300])
                                continue
                            err = relative_error(out, expected)
                            bad = per_sequence_errors(out, expected, qsl, specs)
                            flag = "FAIL" if (err >= 1e-2 or bad) else "ok"
                            print(f"{flag} {what}: rel {err:.2e} {'; '.join(bad)}", flush=True)
