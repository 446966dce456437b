"""CPU checks of tools/device/sweep_splits.py: which split counts it times and which one it picks per batch."""

from __future__ import annotations

import json
import sys

import pytest
from tools.device import sweep_splits


def test_candidates_bound_the_grid_by_programs_per_sm():
    # Qwen2.5 (4 KV heads) on 132 SMs: at least 132 / 4 programs, at most 64 per SM
    assert sweep_splits.split_candidates(1, 4, 132) == [16, 32, 64, 128]
    assert sweep_splits.split_candidates(32, 4, 132) == [1, 2, 4, 8, 16, 32, 64]
    assert sweep_splits.split_candidates(256, 4, 132) == [1, 2, 4, 8]  # 1024 * 8 <= 64 * 132 < 1024 * 16
    assert sweep_splits.split_candidates(256, 8, 132) == [1, 2, 4]
    # even one split above the bound: 1 is kept
    assert sweep_splits.split_candidates(4096, 8, 132) == [1]


def rows(times_by_case, shape="qwen2.5-7b", batch=32, **fields):
    return [dict(shape=shape, batch=batch, context=context, method=scheme, splits=splits, us=us, num_sms=132, **fields)
            for (scheme, context), by_split in times_by_case.items() for splits, us in by_split.items()]


def test_choose_leaves_out_an_older_sweeps_warp_split_rows():
    """Sweeps before the warp-split loop was removed timed it as candidates: a plan cannot name it any more."""
    measured = rows({("int4_saw", 4096): {4: 100.0, 8: 90.0}}) + \
        rows({("int4_saw", 4096): {4: 50.0, 8: 60.0}}, warp_split=True)
    pick = sweep_splits.choose_splits(measured)["int4_saw"][128]
    assert pick["splits"] == 8 and pick["cases"] == {("qwen2.5-7b", 4096): (90.0, 90.0)}


def test_choose_minimizes_the_worst_slowdown_over_contexts_per_scheme():
    measured = rows({("int4_kivi", 4096): {4: 100.0, 8: 90.0, 32: 150.0},
                     ("int4_kivi", 32768): {4: 600.0, 8: 500.0, 32: 450.0},
                     ("int4_saw", 4096): {4: 100.0, 8: 200.0, 32: 300.0}})
    measured.append(dict(shape="qwen2.5-7b", batch=32, context=4096, method="fa3_bf16", splits=None, us=80.0))
    chosen = sweep_splits.choose_splits(measured)
    kivi = chosen["int4_kivi"][32 * 4]  # keyed by KV-head programs: batch x 4 KV heads
    # split counts alone: 8 worst 500/450 = 1.11x; 32: 150/90 = 1.67x; 4: 600/450 = 1.33x. But 32 splits of at least
    # 4 tiles run 8 live splits at 4k (32 tiles) and 32 at 32k (256): the fastest count at both, the 4k one estimated
    # with the margin for its empty splits
    assert (kivi["splits"], kivi["min_split_tiles"]) == (32, 4)
    rest = sweep_splits.LAYER_REST_US
    assert kivi["worst"] == pytest.approx((90.0 * sweep_splits.MIN_TILES_MARGIN + rest) / (90.0 + rest))
    assert kivi["cases"][("qwen2.5-7b", 4096)] == (pytest.approx(90.0 * sweep_splits.MIN_TILES_MARGIN), 90.0)
    assert chosen["int4_saw"][128]["splits"] == 4
    assert set(chosen) == {"int4_kivi", "int4_saw"}


def test_choose_weighs_a_slowdown_with_the_layers_rest():
    # 1 split: 4 us faster at 1k (1.17x as a ratio), 40 us slower at 32k (1.12x): with a layer's fixed rest the 32k
    # loss is the larger slowdown of the step, and 2 splits are chosen
    measured = rows({("int4_saw", 1024): {1: 23.0, 2: 27.0}, ("int4_saw", 32768): {1: 372.0, 2: 333.0}}, batch=64)
    pick = sweep_splits.choose_splits(measured)["int4_saw"][256]
    rest = sweep_splits.LAYER_REST_US
    assert rest >= 30
    assert pick["splits"] == 2
    assert pick["worst"] == pytest.approx((27.0 + rest) / (23.0 + rest))


def test_choose_pools_shapes_with_the_same_kv_head_programs():
    # Qwen2.5 batch 64 and Llama-3.1 batch 32 both give 256 KV-head programs
    measured = rows({("int4_saw", 4096): {2: 100.0, 4: 90.0}}, batch=64) + \
        rows({("int4_saw", 4096): {2: 100.0, 4: 200.0}}, shape="llama-3.1-8b", batch=32)
    pick = sweep_splits.choose_splits(measured)["int4_saw"][256]
    assert pick["splits"] == 2 and len(pick["cases"]) == 2


def test_choose_ignores_counts_missing_from_a_case():
    measured = rows({("int4_kivi", 4096): {8: 90.0, 16: 50.0}, ("int4_kivi", 32768): {8: 500.0}})
    assert sweep_splits.choose_splits(measured)["int4_kivi"][128]["splits"] == 8


def test_split_table_bounds_at_geometric_midpoints_and_merges_equal_neighbours():
    chosen = {4: {"splits": 64}, 32: {"splits": 16}, 128: {"splits": 16}, 1024: {"splits": 2}, 2048: {"splits": 1}}
    table = sweep_splits.split_table(chosen, 132)
    assert table == ((round((4 * 32) ** 0.5 / 132, 3), 64, 1), (round((128 * 1024) ** 0.5 / 132, 3), 16, 1),
                     (round((1024 * 2048) ** 0.5 / 132, 3), 2, 1), (float("inf"), 1, 1))


def test_split_table_carries_min_split_tiles_and_drops_it_at_one_split():
    chosen = {64: {"splits": 16, "min_split_tiles": 2}, 256: {"splits": 4, "min_split_tiles": 8},
              1024: {"splits": 1, "min_split_tiles": 1}, 2048: {"splits": 4, "min_split_tiles": 64}}
    table = sweep_splits.split_table(chosen, 132)
    # 2048's 4 splits are capped at the 1 before them, where a minimum means nothing: it merges into 1024's entry
    assert [entry[1:] for entry in table] == [(16, 2), (4, 8), (1, 1)]


def test_apply_rewrites_the_kernels_tables_and_the_rule_reads_them():
    from s4kv.kernels import attention

    source = sweep_splits.ATTENTION_SOURCE.read_text()
    tables = {"int4_kivi": ((0.5, 32, 1), (2.0, 4, 2), (float("inf"), 1, 1)),
              "int4_saw": ((1.0, 8, 4), (float("inf"), 2, 1))}
    written = sweep_splits.apply_split_tables(source, tables)
    assert written.count("DECODE_SPLITS = {") == 1
    namespace = {"math": __import__("math")}
    exec(sweep_splits.DECODE_SPLITS_BLOCK.search(written).group(0), namespace)
    assert namespace["DECODE_SPLITS"] == tables
    kivi, saw = namespace["DECODE_SPLITS"]["int4_kivi"], namespace["DECODE_SPLITS"]["int4_saw"]
    assert attention.decode_plan(33, 4, 132, kivi) == attention.DecodePlan(4, 2)  # 1.0 per SM
    assert attention.decode_plan(33, 4, 132, saw) == attention.DecodePlan(8, 4)
    assert attention.decode_plan(34, 4, 132, saw) == attention.DecodePlan(2, 1)
    with pytest.raises(ValueError, match="no split table for int4_saw"):
        sweep_splits.apply_split_tables(source, {"int4_kivi": tables["int4_kivi"]})


def test_render_marks_the_fastest_count():
    measured = rows({("int4_saw", 4096): {4: 100.0, 8: 90.0, 16: 95.0}})
    measured[0]["committed_splits"] = "16/2"
    table = sweep_splits.render(measured)
    assert "4:100 8:90* 16:95 | 16/2 |" in table


def test_committed_rows_keep_fa3_and_the_rules_candidate_per_scheme(tmp_path):
    from s4kv.kernels.attention import DECODE_SPLITS, decode_plan
    from tools.device import plot_kernels

    measured = []
    for batch in (1, 32, 256):
        for scheme in sweep_splits.SCHEMES:
            by_split = {s: 10.0 * s for s in (1, 2, 4, 8, 16, 32, 64)}
            measured += rows({(scheme, 4096): by_split}, batch=batch)
        measured.append(dict(shape="qwen2.5-7b", batch=batch, context=4096, method="fa3_bf16", splits=None,
                             us=80.0, gbps=1000.0, num_sms=132))
    for r in measured:
        r.setdefault("gbps", 500.0)
    measured.append(dict(measured[-1], method="fa3_fp8", us=None, error="boom"))  # a failed row is left out
    picked = sweep_splits.committed_rows(measured)
    assert [r["method"] for r in picked].count("fa3_bf16") == 3 and "fa3_fp8" not in {r["method"] for r in picked}
    for batch in (1, 32, 256):
        for scheme in sweep_splits.SCHEMES:
            (row,) = [r for r in picked if r["method"] == scheme and r["batch"] == batch]
            plan = decode_plan(batch, 4, 132, DECODE_SPLITS[scheme])
            assert row["ms"] == pytest.approx(10.0 * plan.splits / 1e3)
    source = tmp_path / "sweep_splits.json"
    source.write_text(json.dumps(measured))
    assert plot_kernels.main([str(source), "--sweep", "--out", str(tmp_path / "decode.png")]) == 0
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --methods picks among the rows the sweep's conversion gives
    assert plot_kernels.main([str(source), "--sweep", "--methods", "fa3_bf16,int4_saw",
                              "--out", str(tmp_path / "saw.png")]) == 0


def test_committed_rows_prefer_the_timed_committed_plan():
    measured = rows({("int4_saw", 4096): {1: 50.0, 2: 60.0}}, batch=256)
    measured.append(dict(measured[0], splits=4, min_split_tiles=8, committed=True, us=42.0))
    for r in measured:
        r["gbps"] = 1.0
    (row,) = sweep_splits.committed_rows(measured)
    assert row["ms"] == pytest.approx(0.042)
    # and the chooser leaves it out: it is not a split count
    assert set(sweep_splits.choose_splits(measured)["int4_saw"][1024]["cases"].values()) == {(50.0, 50.0)}


def test_choose_estimates_min_split_tiles_from_the_counts_measured():
    # 1k (8 tiles) is fastest at 1 split, 32k (256 tiles) at 8: 8 splits of at least 4 tiles runs 2 splits at 1k and
    # 8 at 32k, estimated at those counts' times (with the margin where splits are left empty)
    measured = rows({("int4_saw", 1024): {1: 50.0, 2: 52.0, 8: 80.0},
                     ("int4_saw", 32768): {1: 900.0, 2: 600.0, 8: 400.0}}, batch=64)
    for r in measured:
        r["tile"] = 128
    pick = sweep_splits.choose_splits(measured)["int4_saw"][256]
    assert (pick["splits"], pick["min_split_tiles"]) == (8, 4)
    margin, rest = sweep_splits.MIN_TILES_MARGIN, sweep_splits.LAYER_REST_US
    assert pick["worst"] == pytest.approx((52 * margin + rest) / (50 + rest))
    assert pick["cases"][("qwen2.5-7b", 1024)] == (pytest.approx(52 * margin), 50.0)
    # without a gain beyond the margin for the unmeasured empty splits, the plain split count stands
    close = rows({("int4_saw", 1024): {1: 50.0, 2: 51.0, 8: 52.0}, ("int4_saw", 32768): {1: 900.0, 2: 600.0, 8: 400.0}},
                 batch=64)
    pick = sweep_splits.choose_splits(close)["int4_saw"][256]
    assert (pick["splits"], pick["min_split_tiles"]) == (8, 1)


def test_choose_never_estimates_one_live_split_from_the_unsplit_time():
    # 8 splits of at least 8 tiles leave 1 live split at 1k, but the plan still writes the workspace and merges:
    # the one-split candidate's 50 us is no estimate of it, so the plan whose 1k runs 2 live splits is chosen
    measured = rows({("int4_saw", 1024): {1: 50.0, 2: 60.0, 8: 80.0},
                     ("int4_saw", 32768): {1: 900.0, 2: 600.0, 8: 400.0}}, batch=64)
    pick = sweep_splits.choose_splits(measured)["int4_saw"][256]
    assert (pick["splits"], pick["min_split_tiles"]) == (8, 4)
    assert pick["cases"][("qwen2.5-7b", 1024)] == (pytest.approx(60 * sweep_splits.MIN_TILES_MARGIN), 50.0)


def test_choose_takes_the_committed_plans_measured_time_over_its_estimate():
    # the committed 8/4 was timed at 1k: 70 us, not the 2-split estimate of 52 (x margin); 8/2 (4 live at 1k) is
    # then better
    measured = rows({("int4_saw", 1024): {1: 50.0, 2: 52.0, 4: 55.0, 8: 80.0},
                     ("int4_saw", 32768): {1: 900.0, 2: 600.0, 4: 500.0, 8: 400.0}}, batch=64)
    measured.append(dict(measured[0], splits=8, min_split_tiles=4, committed=True, us=70.0))
    pick = sweep_splits.choose_splits(measured)["int4_saw"][256]
    assert (pick["splits"], pick["min_split_tiles"]) == (8, 2)
    assert pick["cases"][("qwen2.5-7b", 1024)] == (pytest.approx(55 * sweep_splits.MIN_TILES_MARGIN), 50.0)


def test_choose_gives_one_split_no_minimum():
    # one split takes every tile: a minimum would only pick between two timings of the same plan
    measured = rows({("int4_saw", 4096): {1: 50.0, 2: 60.0}}, batch=256)
    measured.append(dict(measured[0], committed=True, min_split_tiles=1, us=52.0))
    pick = sweep_splits.choose_splits(measured)["int4_saw"][1024]
    assert (pick["splits"], pick["min_split_tiles"]) == (1, 1)
    assert pick["cases"][("qwen2.5-7b", 4096)] == (50.0, 50.0)


def test_choose_takes_the_faster_of_two_timings_of_one_split_count():
    # the committed plan is the plain 2 splits, timed again after the candidates and slower (a lower clock): the
    # candidate's own 400 us counts, and 2 splits, the faster at 32k, stays ahead of 1 split
    measured = rows({("int4_saw", 4096): {1: 50.0, 2: 52.0}, ("int4_saw", 32768): {1: 420.0, 2: 400.0}}, batch=256)
    measured.append(dict(measured[-1], committed=True, min_split_tiles=1, us=480.0))
    pick = sweep_splits.choose_splits(measured)["int4_saw"][1024]
    assert (pick["splits"], pick["min_split_tiles"]) == (2, 1)
    assert pick["cases"][("qwen2.5-7b", 32768)] == (400.0, 400.0)


def test_choose_reads_several_sweeps_the_later_replacing_the_earlier(tmp_path, capsys, monkeypatch):
    older = rows({("int4_saw", 4096): {1: 100.0, 2: 90.0}}, batch=256) + \
        rows({("int4_saw", 4096): {1: 30.0, 2: 40.0}}, batch=8)
    newer = rows({("int4_saw", 4096): {1: 80.0, 2: 95.0}}, batch=256)
    paths = [tmp_path / "older.json", tmp_path / "newer.json"]
    for path, data in zip(paths, (older, newer)):
        path.write_text(json.dumps(data))
    monkeypatch.setattr(sys, "argv", ["sweep_splits", "--choose", *map(str, paths)])
    assert sweep_splits.main() == 0
    printed = capsys.readouterr().out
    # batch 256 (1024 KV-head programs) by the newer sweep, batch 8 (32) by the older one, which the newer lacks
    assert "int4_saw at 1024 KV-head programs: 1 splits, worst case 1.00x" in printed
    assert "int4_saw at 32 KV-head programs: 1 splits, worst case 1.00x" in printed


def test_each_case_times_every_count_then_the_committed_plan():
    from s4kv.kernels.attention import SplitWorkspace

    rule = SplitWorkspace.allocate(28, 4, 128, "cpu", "int4_saw", max_num_seqs=8, num_sms=132)
    candidates = list(sweep_splits._candidates("int4_saw", 8, 28, 4, 132, "cpu", SplitWorkspace, rule))
    counts = sweep_splits.split_candidates(8, 4, 132)
    assert [(f["splits"], ws.plan(8).splits) for f, ws in candidates[:-1]] == [(s, s) for s in counts]
    fields, workspace = candidates[-1]
    plan = rule.plan(8)
    assert workspace is rule
    assert fields == dict(splits=plan.splits, min_split_tiles=plan.min_split_tiles, tile=128, committed=True)
