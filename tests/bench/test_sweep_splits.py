"""CPU checks of tools/device/sweep_splits.py: which split counts it times and which one it picks per batch."""

from __future__ import annotations

from tools.device import sweep_splits


def test_candidates_bound_the_grid_by_programs_per_sm():
    # Qwen2.5 (4 KV heads) on 132 SMs: at least 132 / 4 programs, at most 64 per SM
    assert sweep_splits.split_candidates(1, 4, 132) == [16, 32, 64, 128]
    assert sweep_splits.split_candidates(32, 4, 132) == [1, 2, 4, 8, 16, 32, 64]
    assert sweep_splits.split_candidates(256, 4, 132) == [1, 2, 4, 8]  # 1024 * 8 <= 64 * 132 < 1024 * 16
    assert sweep_splits.split_candidates(256, 8, 132) == [1, 2, 4]
    # even one split above the bound: 1 is kept
    assert sweep_splits.split_candidates(4096, 8, 132) == [1]


def rows(times_by_case):
    return [dict(shape="qwen2.5-7b", batch=32, context=context, method=scheme, splits=splits, us=us)
            for (scheme, context), by_split in times_by_case.items() for splits, us in by_split.items()]


def test_choose_minimizes_the_worst_slowdown_over_contexts_and_schemes():
    measured = rows({("int4_kivi", 4096): {4: 100.0, 8: 90.0, 32: 150.0},
                     ("int4_kivi", 32768): {4: 600.0, 8: 500.0, 32: 450.0},
                     ("int4_saw", 32768): {4: 500.0, 8: 420.0, 32: 400.0}})
    measured.append(dict(shape="qwen2.5-7b", batch=32, context=4096, method="fa3_bf16", splits=None, us=80.0))
    pick = sweep_splits.choose_splits(measured)[("qwen2.5-7b", 32)]
    # 8: worst 500/450 = 1.11x; 32: 150/90 = 1.67x; 4: 600/450 = 1.33x
    assert pick["splits"] == 8
    assert abs(pick["worst"] - 500 / 450) < 1e-9


def test_choose_ignores_counts_missing_from_a_case():
    measured = rows({("int4_kivi", 4096): {8: 90.0, 16: 50.0}, ("int4_kivi", 32768): {8: 500.0}})
    assert sweep_splits.choose_splits(measured)[("qwen2.5-7b", 32)]["splits"] == 8


def test_render_marks_the_fastest_count():
    measured = rows({("int4_saw", 4096): {4: 100.0, 8: 90.0}})
    measured[0]["committed_splits"] = 8
    table = sweep_splits.render(measured)
    assert "4:100 8:90* | 8 |" in table
