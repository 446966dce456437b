"""Sweep the attention kernel's launch configurations on the GPU and print the fastest per shape and scheme.

    python tools/device/tune_attention.py      # H200: about five minutes; writes $OUT/tune_attention.json (or ./)
    python tools/device/tune_attention.py --apply tune_attention.json   # its decode winners become DECODE_LAUNCH

Every tile x warps x stages config runs with every code path of attention.CODE_PATHS, per scheme, on random
pages in shuffled order. Each config's output is checked against the first (default) config's, so that a fast
wrong kernel cannot win; results are saved after every shape, so a call cut short keeps what it measured. The
winners (lowest geometric-mean time over a scheme's shapes) are printed; `--apply` writes the decode winners
into DECODE_LAUNCH in kernels/attention.py (PREFILL_LAUNCH, one for both schemes, is set by hand). What was
measured: docs/performance.md (levers) and docs/archive/2026-11-30-performance.md (the tuning log).
"""

from __future__ import annotations

import itertools
import argparse
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from s4kv.kernels.attention import CODE_PATHS, LaunchConfig, SplitWorkspace, kept_launch_options, paged_attention
from s4kv.kernels.scheme import Int4Scheme
from s4kv.runtime.schemes import SCHEMES

BLOCK = 128
HQ, HKV = 28, 4  # Qwen2.5-7B attention shape


@dataclass(frozen=True)
class Sweep:
    decode_cases: tuple  # (batch, context)
    prefill_cases: tuple  # (batch, context, query length)
    decode_grid: tuple  # (code path, LaunchConfig)
    prefill_grid: tuple


def launch_grid(tiles, warps, stages) -> tuple:
    return tuple((codes, LaunchConfig(t, w, s, **CODE_PATHS[codes]))
                 for codes, t, w, s in itertools.product(CODE_PATHS, tiles, warps, stages))


H200_SWEEP = Sweep(
    decode_cases=((1, 32768), (32, 16384), (256, 4096)),
    prefill_cases=((4, 4096, 512),),
    # warps 2: the static count (tools/device/sass_stats.py) says fewer warps per tile re-load q less often; 8 never
    # won. Stages 5: the first count whose loads keep a prefetch distance of 2 past the block-table read (DECODE_LAUNCH)
    decode_grid=launch_grid((64, 128), (2, 4), (3, 5)),
    prefill_grid=launch_grid((32, 64), (4, 8), (2,)),
)


def make_case(batch, ctx, q_len, device, dtype=torch.bfloat16):
    blocks = -(-ctx // BLOCK)
    nb = batch * blocks
    cache = torch.randint(0, 256, (nb, HKV, BLOCK * 136), dtype=torch.uint8, device=device)
    # finite params everywhere: random bytes can decode to inf/NaN fp16 scales
    params = cache[:, :, 128 * BLOCK :].view(torch.float16)
    params.copy_(torch.rand_like(params, dtype=torch.float16) * 0.1)
    bt = torch.randperm(nb, device=device).view(batch, blocks).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    q = torch.randn(batch * q_len, HQ, 128, device=device, dtype=dtype)
    return cache, bt, seq_lens, qsl, q


def own_block_inputs(scheme, batch, q, device) -> dict:
    """int4_kivi reads each query's own block from the original keys: the step's keys and a staging-pool slot per
    sequence, as the backend passes them."""
    if not scheme.is_kivi:
        return {}
    return dict(new_keys=torch.randn(q.shape[0], HKV, 128, device=device, dtype=q.dtype),
                staged_keys=torch.randn(batch, HKV, BLOCK, 128, device=device, dtype=q.dtype),
                sequence_slots=torch.arange(batch, dtype=torch.int32, device=device))


def cuda_median_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def run_sweep(sweep: Sweep, device, time_ms=cuda_median_ms, dtype=torch.bfloat16, out_dir: str | None = None,
              num_splits: int | None = None) -> list[dict]:
    """Time every (scheme, shape, config); returns one dict per config that ran and matched the default's output.
    Decode splits by DECODE_SPLITS, or ``num_splits`` for every case."""
    results = []
    for scheme_name in SCHEMES:
        scheme = Int4Scheme(scheme_name)
        for kind, cases, grid in (("decode", sweep.decode_cases, sweep.decode_grid),
                                  ("prefill", sweep.prefill_cases, sweep.prefill_grid)):
            for case in cases:
                batch, ctx = case[:2]
                q_len = case[2] if kind == "prefill" else 1
                cache, bt, sl, qsl, q = make_case(batch, ctx, q_len, device, dtype)
                own_block = own_block_inputs(scheme, batch, q, device)
                out = torch.empty_like(q)
                ws = SplitWorkspace.allocate(HQ, HKV, 128, device, None if num_splits else scheme_name,
                                             max_num_seqs=batch, num_splits=num_splits) \
                    if kind == "decode" else None
                expected = None  # the first config's output (the default code path): every other must match it
                for codes, cfg in grid:
                    if kind == "decode":
                        cfg = replace(cfg, **kept_launch_options(scheme_name))
                    try:
                        ms = time_ms(lambda: paged_attention(q, cache, bt, sl, qsl, q_len, 0.088, scheme, out, ws, cfg,
                                                             **own_block))
                    except Exception as exc:  # out of shared memory / registers, or a path this machine lacks
                        print(f"skip {codes} {cfg}: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    if expected is None:
                        expected = out.float().clone()
                    err = float((out.float() - expected).norm() / expected.norm())
                    if not err < 1e-2:  # a fast wrong kernel must not win the sweep
                        print(f"WRONG {codes} {cfg}: relative difference {err:.3g} from the default path", flush=True)
                        continue
                    results.append(dict(scheme=scheme_name, kind=kind, batch=batch, ctx=ctx, q_len=q_len,
                                        codes=codes, tile=cfg.tile, warps=cfg.num_warps, stages=cfg.num_stages,
                                        us=ms * 1e3, gbps=batch * ctx * HKV * 136 / ms / 1e6))
                shape = [r for r in results if (r["scheme"], r["kind"], r["batch"], r["ctx"]) ==
                         (scheme_name, kind, batch, ctx)]
                if shape:
                    best = min(shape, key=lambda r: r["us"])
                    print(f"{scheme_name:10s} {kind:7s} b={batch:<4d} ctx={ctx:<6d} q={q_len:<5d} best "
                          f"{best['us']:8.1f} us {best['gbps']:6.0f} GB/s codes={best['codes']} tile={best['tile']} "
                          f"warps={best['warps']} stages={best['stages']}", flush=True)
                if out_dir is not None:
                    save(results, out_dir)
    return results


def best_configs(results: list[dict]) -> dict[tuple[str, str], tuple]:
    """(scheme, kind) -> (code path, tile, warps, stages) with the lowest geometric-mean time over all its shapes
    (a config that missed a shape, by failing or mismatching, cannot win)."""
    def config(r):
        return r["codes"], r["tile"], r["warps"], r["stages"]

    best = {}
    for scheme_name, kind in itertools.product(SCHEMES, ("decode", "prefill")):
        rows = [r for r in results if (r["scheme"], r["kind"]) == (scheme_name, kind)]
        shapes = {(r["batch"], r["ctx"]) for r in rows}

        def geomean(key):
            times = [r["us"] for r in rows if config(r) == key]
            return math.exp(sum(map(math.log, times)) / len(times)) if len(times) == len(shapes) else math.inf

        if rows:
            winner = min({config(r) for r in rows}, key=geomean)
            if math.isfinite(geomean(winner)):
                best[(scheme_name, kind)] = winner
                print(f"overall best {scheme_name} {kind}: codes,tile,warps,stages={winner} "
                      f"geomean {geomean(winner):.1f} us", flush=True)
    return best


def save(results: list[dict], out_dir: str) -> None:
    with open(os.path.join(out_dir, "tune_attention.json"), "w") as f:
        json.dump(results, f, indent=1)


ATTENTION_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "attention.py"
DECODE_LAUNCH_BLOCK = re.compile(r"^DECODE_LAUNCH = \{.*?\}\n", re.MULTILINE | re.DOTALL)


def decode_launch_source(best: dict) -> str:
    """The DECODE_LAUNCH assignment for each scheme's decode winner (every scheme needs one)."""
    missing = [s for s in SCHEMES if (s, "decode") not in best]
    if missing:
        raise ValueError(f"no decode winner for {', '.join(missing)}: the sweep did not finish those shapes")
    entries = []
    for scheme_name in SCHEMES:
        codes, tile, warps, stages = best[(scheme_name, "decode")]
        fields = [f"tile={tile}", f"num_warps={warps}", f"num_stages={stages}"]
        fields += [f"{name}={value}" for name, value in CODE_PATHS[codes].items()]
        defaults = LaunchConfig(tile, warps, stages)
        fields += [f"{name}={value}" for name, value in kept_launch_options(scheme_name).items()
                   if value != getattr(defaults, name)]
        entries.append(wrap_call(f'"{scheme_name}": LaunchConfig(', fields, len("DECODE_LAUNCH = {")))
    return "DECODE_LAUNCH = {" + (",\n" + " " * len("DECODE_LAUNCH = {")).join(entries) + "}\n"


def wrap_call(head: str, fields: list[str], indent: int, width: int = 120) -> str:
    """``head`` + the comma-separated fields + ")", wrapped so that no line (at ``indent``) passes ``width``; the
    continuation lines start under the first field."""
    lines, line = [], head
    for i, field in enumerate(fields):
        piece = field + (")" if i == len(fields) - 1 else ",")
        if line not in (head,) and indent + len(line) + 1 + len(piece) + 1 > width:
            lines.append(line)
            line = " " * len(head) + piece
        else:
            line += ("" if line == head else " ") + piece
    lines.append(line)
    return ("\n" + " " * indent).join(lines)


def apply_decode_launch(source: str, best: dict) -> str:
    """kernels/attention.py's text with its DECODE_LAUNCH block replaced by the winners'."""
    if len(DECODE_LAUNCH_BLOCK.findall(source)) != 1:
        raise ValueError("expected exactly one `DECODE_LAUNCH = {...}` block in kernels/attention.py")
    return DECODE_LAUNCH_BLOCK.sub(lambda _: decode_launch_source(best), source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--apply", metavar="TUNE_JSON",
                        help="write the decode winners of a saved sweep into DECODE_LAUNCH (no GPU needed)")
    args = parser.parse_args()
    if args.apply:
        best = best_configs(json.loads(Path(args.apply).read_text()))
        ATTENTION_SOURCE.write_text(apply_decode_launch(ATTENTION_SOURCE.read_text(), best))
        print(f"DECODE_LAUNCH in {ATTENTION_SOURCE} is now:\n{decode_launch_source(best)}", end="")
        return
    out_dir = os.environ.get("OUT", ".")
    results = run_sweep(H200_SWEEP, "cuda", out_dir=out_dir)
    best_configs(results)
    save(results, out_dir)


if __name__ == "__main__":
    main()
