#!/usr/bin/env python3
"""Split-KV sweep of the decode attention kernel: every split count per (shape, scheme, batch, context).

    python -m tools.device.sweep_splits --out DIR       # H200: about five minutes; DIR/sweep_splits.{json,md}

For each attention shape (bench_kernels.SHAPES), batch and context, FA3 on bf16 and on fp8 run first where vLLM
is importable (the times to compare with), then each scheme's cache is filled once by our store kernel and read at
its decode launch (DECODE_LAUNCH) with the split workspace forced to each split count in turn
(split_candidates). Outputs are checked finite and against the scheme's first candidate (split counts change only
the order of the sums: within SPLIT_MAX_REL_DIFF) and
FA3's (bench_kernels' sanity bound); times are medians of CUDA-graph replays.

The plan chosen per scheme for a batch size (kernels.attention.DecodePlan: split count and the fewest tiles a split
takes) is the candidate with the smallest worst-case slowdown against the fastest split count over the
contexts and shapes measured at its KV-head programs (batch x KV heads), each time taken with a layer's fixed rest
(LAYER_REST_US): the rule must depend on the batch only (CUDA graphs are captured per batch size), so one plan
serves every context. Each case also times the committed plan.
Printed after a sweep, or from a saved one with ``--choose``; ``--apply`` writes it into kernels/attention.py's
DECODE_SPLITS.

    python -m tools.device.sweep_splits --choose DIR/sweep_splits.json --apply
    python -m tools.device.sweep_splits --choose OLDER/sweep_splits.json DIR/sweep_splits.json   # cases DIR lacks
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import traceback
from pathlib import Path

import torch

from tools.device import bench_kernels as bk

SCHEMES = ("int4_kivi", "int4_saw")
DEFAULT_BATCHES = "256,32,1,128,64,8"
DEFAULT_CONTEXTS = "1024,4096,16384,32768"
MAX_SPLITS = 128
MAX_PROGRAMS_PER_SM = 64
# Split counts change only the order of the sums, but on random data the output is a near-cancelling mean (|out| ~
# |v| / sqrt(context)) and P is rounded to 16 bits against unsigned codes: counts measured 1-4% apart at 4k-32k. A
# split that dropped or doubled a part of the context is off by tens of percent.
SPLIT_MAX_REL_DIFF = 0.1
# A candidate's min_split_tiles (DecodePlan) is estimated, not timed: at each case it leaves some splits empty, so
# its time is taken as the time measured at exactly the live split count (a candidate leaving a count not measured
# is out), times this factor for the empty splits' programs and the merge over the wider grid (measured 2-5% at 1k).
# One live split is out too: the plan still writes the workspace and runs the merge kernel, which the one-split
# candidate does not (measured 5-9 us more at 1k). Every sweep also times the committed plan in each case (rows
# marked "committed"); where a candidate is that plan, its measured time replaces the estimate, and where the plan is
# a plain split count (no split left empty), the faster of its two timings counts.
MIN_TILES_MARGIN = 1.03
# A slowdown is the decode step's, not the attention's alone: each layer's attention adds to a fixed rest, at least
# reading the layer's weights once. 30 us is a 3B model's (Qwen2.5-3B: 77M bf16 parameters a layer at 4.8 TB/s), a
# third of the 7-8B shapes swept. So 4 us lost at 1k weighs less than 40 us lost at 32k, where the plain ratio weighed
# them alike (it picked one split at 256 KV-head programs, measured 1.13x slower at 16k-32k to be 4 us faster at 1k);
# any rest from 30 to 90 us picks the committed table.
LAYER_REST_US = 30.0
MIN_SPLIT_TILES_CANDIDATES = tuple(1 << i for i in range(9))


def split_candidates(batch: int, num_kv_heads: int, num_sms: int) -> list[int]:
    """Powers of two up to MAX_SPLITS whose grid holds between num_sms / 4 and MAX_PROGRAMS_PER_SM * num_sms
    programs (1 when even one split is above that). Splits past a short context exit at once and the merge reads
    only the live ones: one count must serve every context of a batch size."""
    counts = [1 << i for i in range(int(math.log2(MAX_SPLITS)) + 1)]
    programs = batch * num_kv_heads
    fits = [s for s in counts if programs * s <= MAX_PROGRAMS_PER_SM * num_sms]
    return [s for s in fits if 4 * programs * s >= num_sms] or fits[-1:] or [1]


def launch_tile(scheme_name: str) -> int:
    """Tokens per tile of a scheme's decode launch on our 128-token pages."""
    from s4kv.kernels.attention import DECODE_LAUNCH
    from s4kv.kernels.layout import tile_tokens

    return tile_tokens(bk.S4KV_BLOCK_SIZE, DECODE_LAUNCH[scheme_name].tile)


def choose_splits(rows: list[dict]) -> dict[str, dict[int, dict]]:
    """scheme -> KV-head programs of a batch unsplit (batch x KV heads) -> {"splits", "min_split_tiles": the
    candidate with the smallest worst-case slowdown of a layer (its time + LAYER_REST_US) against the fastest split
    count over every (shape, context) measured there, "worst": that slowdown, "cases": {(shape, context): (its time,
    fastest time)}}. A candidate is a split count measured in every case, with a min_split_tiles estimated from the
    counts measured (MIN_TILES_MARGIN says how)."""
    from s4kv.kernels.attention import DecodePlan

    groups: dict[str, dict[int, dict[tuple, dict[int, float]]]] = {}
    tiles: dict[str, int] = {}
    timed_plans: dict[tuple, float] = {}  # (scheme, programs, shape, context, DecodePlan) -> its time as committed
    for r in rows:
        # sweeps before 2026-12-05 also timed a warp-split decode loop, since removed: not a candidate
        if r.get("us") is None or r["method"] not in SCHEMES or r.get("warp_split"):
            continue
        programs = r["batch"] * bk.SHAPES[r["shape"]][1]
        if r.get("committed"):
            plan = DecodePlan(r["splits"], r.get("min_split_tiles", 1))
            timed_plans[(r["method"], programs, r["shape"], r["context"], plan)] = r["us"]
            continue
        cases = groups.setdefault(r["method"], {}).setdefault(programs, {})
        cases.setdefault((r["shape"], r["context"]), {})[r["splits"]] = r["us"]
        tiles[r["method"]] = r.get("tile") or launch_tile(r["method"])
    chosen: dict[str, dict[int, dict]] = {}
    for scheme, by_programs in groups.items():
        for programs, cases in by_programs.items():
            common = set.intersection(*(set(t) for t in cases.values()))
            if not common:
                continue

            def estimate(candidate, case, times):
                plan = DecodePlan(*candidate)
                timed = timed_plans.get((scheme, programs, *case, plan), math.inf)
                num_tiles = math.ceil(case[1] / tiles[scheme])
                live = plan.live_splits(num_tiles)
                if live == plan._replace(min_split_tiles=1).live_splits(num_tiles):
                    # the split count's own launch: two timings of one kernel on the same data, and the later one
                    # can meet a lower clock (measured up to 1.19x at batch 256 x 32k): the faster counts
                    return min(timed, times[plan.splits])
                if timed < math.inf:
                    return timed
                if live == 1:  # merged all the same: not the one-split candidate's time (MIN_TILES_MARGIN)
                    return math.inf
                # a live count not measured: no estimate
                return times.get(live, math.inf) * MIN_TILES_MARGIN

            def worst(candidate):
                return max((estimate(candidate, c, t) + LAYER_REST_US) / (min(t.values()) + LAYER_REST_US)
                           for c, t in cases.items())

            best = min(((s, m) for s in sorted(common) for m in (MIN_SPLIT_TILES_CANDIDATES if s > 1 else (1,))),
                       key=worst)  # one split takes every tile, whatever its minimum
            chosen.setdefault(scheme, {})[programs] = {
                "splits": best[0], "min_split_tiles": best[1], "worst": worst(best),
                "cases": {c: (estimate(best, c, t), min(t.values())) for c, t in cases.items()}}
    return chosen


def split_table(chosen: dict[int, dict], num_sms: int) -> tuple[tuple[float, int, int], ...]:
    """One scheme's DECODE_SPLITS entry from its chosen candidates: each measured point's plan (splits, min split
    tiles) holds up to the geometric mean of its KV-head programs and the next point's (per SM); the last holds
    beyond; equal neighbours merge. A point never gets more splits than the point before it (a larger batch already
    fills the SMs: where a sweep says otherwise, the counts were within a few percent)."""
    points = sorted(chosen)
    table: list[tuple[float, int, int]] = []
    for here, after in zip(points, points[1:] + [None]):
        bound = math.inf if after is None else round(math.sqrt(here * after) / num_sms, 3)
        splits = chosen[here]["splits"] if not table else min(chosen[here]["splits"], table[-1][1])
        min_split_tiles = 1 if splits == 1 else chosen[here].get("min_split_tiles", 1)  # one split takes every tile
        if table and table[-1][1:] == (splits, min_split_tiles):
            table[-1] = (bound, splits, min_split_tiles)
        else:
            table.append((bound, splits, min_split_tiles))
    return tuple(table)


def tables_source(tables: dict[str, tuple], width: int = 120) -> str:
    """The DECODE_SPLITS assignment, each scheme's entries wrapped to ``width`` columns (the lint's line length)."""
    def entry(scheme, table):
        head = f'    "{scheme}": ('
        lines, line = [], head
        for b, s, m in table:
            item = f"({'math.inf' if b == math.inf else b}, {s}, {m}), "
            if len(line) + len(item.rstrip()) > width - 2 and line.strip() != head.strip():
                lines.append(line.rstrip())
                line = " " * len(head)
            line += item
        return "\n".join(lines + [line.rstrip().rstrip(",") + "),"]) + "\n"

    return "DECODE_SPLITS = {\n" + "".join(entry(scheme, table) for scheme, table in tables.items()) + "}\n"


ATTENTION_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "attention.py"
DECODE_SPLITS_BLOCK = re.compile(r"^DECODE_SPLITS = \{\n.*?^\}\n", re.MULTILINE | re.DOTALL)


def apply_split_tables(source: str, tables: dict[str, tuple]) -> str:
    """kernels/attention.py's text with its DECODE_SPLITS block replaced by ``tables`` (every scheme needs one)."""
    missing = [s for s in SCHEMES if s not in tables]
    if missing:
        raise ValueError(f"no split table for {', '.join(missing)}: the sweep has no complete case of it")
    if len(DECODE_SPLITS_BLOCK.findall(source)) != 1:
        raise ValueError("expected exactly one `DECODE_SPLITS = {...}` block in kernels/attention.py")
    return DECODE_SPLITS_BLOCK.sub(lambda _: tables_source(tables), source)


def committed_rows(rows: list[dict]) -> list[dict]:
    """A sweep's measured FA3 rows and, per scheme and case, the row of the plan kernels/attention.py's DECODE_SPLITS
    picks (what the backend runs), as bench_kernels' decode rows (method, ms, gbps), for plot_kernels: its
    "committed" row, or in a sweep without those, the row of its split count (its min_split_tiles not applied)."""
    from s4kv.kernels.attention import DECODE_SPLITS, DecodePlan, decode_plan

    timed = {(r["shape"], r["batch"], r["context"], r["method"]) for r in rows if r.get("committed")}
    picked = []
    for r in rows:
        if r.get("us") is None:
            continue
        if r["method"] in SCHEMES:
            plan = decode_plan(r["batch"], bk.SHAPES[r["shape"]][1], r["num_sms"], DECODE_SPLITS[r["method"]])
            if (r["shape"], r["batch"], r["context"], r["method"]) in timed:
                if not r.get("committed"):
                    continue
            elif r.get("warp_split") or DecodePlan(r["splits"]) != plan._replace(min_split_tiles=1):
                continue
        picked.append({"shape": r["shape"], "batch": r["batch"], "context": r["context"], "method": r["method"],
                       "ms": r["us"] / 1e3, "gbps": r["gbps"]})
    return picked


def candidate_name(splits: int, min_split_tiles: int = 1) -> str:
    """/N: at least N tiles per split."""
    return f"{splits}" + (f"/{min_split_tiles}" if min_split_tiles > 1 else "")


def render(rows: list[dict]) -> str:
    """One line per (shape, scheme, batch, context): FA3 times, then each split count's time (fastest starred)."""
    by_case: dict[tuple, list[dict]] = {}
    for r in rows:
        by_case.setdefault((r["shape"], r["batch"], r["context"]), []).append(r)
    lines = ["| shape | batch | context | fa3_bf16 | fa3_fp8 | scheme | us per candidate: split count (fastest *) "
             "| committed plan (/N: at least N tiles per split): us |",
             "|---|---|---|---|---|---|---|---|"]
    for (shape, batch, context), case in by_case.items():
        ref = {r["method"]: r for r in case if r["method"].startswith("fa3")}
        fa3 = lambda m: f"{ref[m]['us']:,.0f}" if m in ref and ref[m]["us"] else "-"  # noqa: E731
        for scheme in SCHEMES:
            timed = [r for r in case if r["method"] == scheme and r["us"] and not r.get("committed")]
            if not timed:
                continue
            fastest = min(r["us"] for r in timed)
            cells = " ".join(f"{candidate_name(r['splits'])}:{r['us']:,.0f}"
                             f"{'*' if r['us'] == fastest else ''}" for r in timed)
            committed = timed[0].get("committed_splits")
            committed_us = [r["us"] for r in case if r["method"] == scheme and r.get("committed") and r["us"]]
            if committed_us:
                committed += f": {committed_us[0]:,.0f}"
            lines.append(f"| {shape} | {batch} | {context:,} | {fa3('fa3_bf16')} | {fa3('fa3_fp8')} | {scheme} | "
                         f"{cells} | {committed} |")
    return "\n".join(lines) + "\n"


def fa3_available() -> bool:
    try:
        import vllm.vllm_flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def sweep(shapes, batches, contexts, budget_s: float, out: Path) -> list[dict]:
    from s4kv.kernels.attention import SplitWorkspace
    from s4kv.kernels.scheme import Int4Scheme

    start = time.monotonic()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    pool_tokens = min(max(batches) * max(contexts), bk.FILL_CHUNK_TOKENS)
    pools = {s: torch.randn(2, pool_tokens, bk.SHAPES[s][1], bk.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
             for s in shapes}
    rows: list[dict] = []
    for batch in batches:
        for context in contexts:
            for shape in shapes:
                if time.monotonic() - start > budget_s:
                    print(f"budget: skipped {shape} batch {batch} context {context}", flush=True)
                    continue
                rows += sweep_case(shape, batch, context, pools[shape], generator, num_sms, SplitWorkspace,
                                   Int4Scheme)
                (out / "sweep_splits.json").write_text(json.dumps(rows, indent=1))
    return rows


def _candidates(scheme_name, batch, num_q_heads, num_kv_heads, num_sms, device, workspace_cls, rule):
    """(row fields, workspace) per candidate: every split count at the scheme's decode launch, then the committed
    plan (``rule``, the scheme's DECODE_SPLITS workspace)."""
    for splits in split_candidates(batch, num_kv_heads, num_sms):
        yield (dict(splits=splits, tile=launch_tile(scheme_name)),
               workspace_cls.allocate(num_q_heads, num_kv_heads, bk.HEAD_DIM, device, max_num_seqs=batch,
                                      num_splits=splits))
    plan = rule.plan(batch)
    yield (dict(splits=plan.splits, min_split_tiles=plan.min_split_tiles, tile=launch_tile(scheme_name),
                committed=True), rule)


def sweep_case(shape, batch, context, kv_pool, generator, num_sms, workspace_cls, scheme_cls) -> list[dict]:
    num_q_heads, num_kv_heads = bk.SHAPES[shape]
    query = torch.randn(batch, num_q_heads, bk.HEAD_DIM, dtype=kv_pool.dtype, device=kv_pool.device)
    problem = bk.DecodeProblem(batch, context, query, kv_pool)
    tables = {size: bk.shuffled_block_table(batch, math.ceil(context / size), generator).to(kv_pool.device)
              for size in (bk.VLLM_BLOCK_SIZE, bk.S4KV_BLOCK_SIZE)}
    base = dict(shape=shape, batch=batch, context=context, num_sms=num_sms)
    rows, reference = [], None
    for method, fp8 in ((("fa3_bf16", False), ("fa3_fp8", True)) if fa3_available() else ()):
        out = torch.full_like(query, float("nan"))
        try:
            us = bk.median_ms(bk.build_fa3(problem, tables[bk.VLLM_BLOCK_SIZE], out, fp8=fp8)) * 1e3
            mhz = bk.sm_clock_mhz()
            if not torch.isfinite(out).all():
                raise RuntimeError("output has NaN/inf")
            if reference is None:
                reference = out.float()
            rows.append(dict(base, method=method, splits=None, us=us, sm_mhz=mhz,
                             gbps=bk.decode_bytes(batch, context, "fp8" if fp8 else "bf16", num_q_heads,
                                                  num_kv_heads) / us / 1e3))
        except Exception as exc:
            traceback.print_exc()
            rows.append(dict(base, method=method, splits=None, us=None, error=f"{type(exc).__name__}: {exc}"))
        torch.cuda.empty_cache()
    nbytes = bk.decode_bytes(batch, context, "int4", num_q_heads, num_kv_heads)
    for scheme_name in SCHEMES:
        scheme = scheme_cls.parse({"scheme": scheme_name})
        cache = bk.fill_s4kv_cache(scheme, problem, tables[bk.S4KV_BLOCK_SIZE])
        rule = workspace_cls.allocate(num_q_heads, num_kv_heads, bk.HEAD_DIM, kv_pool.device, scheme_name,
                                      max_num_seqs=batch)
        plan = rule.plan(batch)
        committed = candidate_name(*plan)
        first = None  # the first candidate's output: every other one must match it
        for fields, workspace in _candidates(scheme_name, batch, num_q_heads, num_kv_heads, num_sms, kv_pool.device,
                                             workspace_cls, rule):
            out = torch.full_like(query, float("nan"))
            row = dict(base, method=scheme_name, committed_splits=committed, **fields)
            try:
                us = bk.median_ms(bk.s4kv_decode_call(scheme, problem, cache, tables[bk.S4KV_BLOCK_SIZE], out,
                                                      workspace), rep_ms=60) * 1e3
                mhz = bk.sm_clock_mhz()
                if not torch.isfinite(out).all():
                    raise RuntimeError("output has NaN/inf (unwritten or broken)")
                err = (float((out.float() - reference).norm() / reference.norm()) if reference is not None
                       else None)
                if err is not None and err > bk.SANITY_MAX_REL_ERR:
                    raise RuntimeError(f"output differs from FA3's by {err:.3f} (relative)")
                if first is None:
                    first = out.float()
                diff = float((out.float() - first).norm() / first.norm())
                if diff > SPLIT_MAX_REL_DIFF:
                    raise RuntimeError(f"output differs from the first candidate's by {diff:.2e} (relative)")
                rows.append(dict(row, us=us, gbps=nbytes / us / 1e3, rel_err_vs_fa3=err, sm_mhz=mhz))
            except Exception as exc:
                traceback.print_exc()
                rows.append(dict(row, us=None, error=f"{type(exc).__name__}: {exc}"))
            del workspace
        del cache
        torch.cuda.empty_cache()
    line = " ".join(f"{r['method']}/{'committed ' if r.get('committed') else ''}"
                    f"{candidate_name(r['splits'], r.get('min_split_tiles', 1))}"
                    f":{r['us']:,.0f}" for r in rows if r.get("us"))
    print(f"{shape} b={batch} ctx={context}: {line}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--shapes", default=",".join(bk.SHAPES))
    parser.add_argument("--batches", default=DEFAULT_BATCHES)
    parser.add_argument("--contexts", default=DEFAULT_CONTEXTS)
    parser.add_argument("--budget-s", type=float, default=180, help="start no new case after this many seconds")
    parser.add_argument("--choose", type=Path, nargs="+", metavar="SWEEP_JSON",
                        help="print the split count per batch (no GPU); of several sweeps, a later one's time of a "
                             "candidate replaces an earlier one's")
    parser.add_argument("--apply", action="store_true", help="write the chosen table into DECODE_SPLITS")
    args = parser.parse_args()
    if args.choose:
        rows = [row for path in args.choose for row in json.loads(path.read_text())]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("sweep_splits.py needs a CUDA GPU (or --choose SWEEP_JSON)")
        args.out.mkdir(parents=True, exist_ok=True)
        rows = sweep([s for s in args.shapes.split(",") if s], [int(b) for b in args.batches.split(",")],
                     [int(c) for c in args.contexts.split(",")], args.budget_s, args.out)
        (args.out / "sweep_splits.md").write_text(render(rows))
        print(render(rows))
    chosen = choose_splits(rows)
    for scheme, by_programs in sorted(chosen.items()):
        for programs, pick in sorted(by_programs.items()):
            at_least = f", at least {pick['min_split_tiles']} tiles each" if pick["min_split_tiles"] > 1 else ""
            print(f"{scheme} at {programs} KV-head programs: {pick['splits']} splits{at_least}, worst case "
                  f"{pick['worst']:.2f}x the layer at the fastest split count over {len(pick['cases'])} cases")
    tables = {scheme: split_table(chosen[scheme], rows[0]["num_sms"]) for scheme in SCHEMES if scheme in chosen}
    print(tables_source(tables), end="")
    if args.apply:
        ATTENTION_SOURCE.write_text(apply_split_tables(ATTENTION_SOURCE.read_text(), tables))
        print(f"written into {ATTENTION_SOURCE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
