"""CPU run of tools/device/tune_attention.py's sweep on tiny shapes (Triton interpreter, fp16, a stand-in timer): the
logic a GPU call relies on, checked before device time is spent on it. The timings are the GPU's business."""

from __future__ import annotations

import json

import pytest
import torch
from repo_tools import code_path_of
from tools.device import tune_attention

needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real sweep")


@pytest.fixture(scope="module")
def tune():
    return tune_attention


def tiny_sweep(tune):
    return tune.Sweep(decode_cases=((2, 300),), prefill_cases=((1, 256, 16),),
                      decode_grid=tune.launch_grid((64, 128), (4,), (2,)),
                      prefill_grid=tune.launch_grid((64,), (4,), (2,)))


def fake_timer(seconds_by_tile):
    def time_ms(fn):
        fn()
        time_ms.calls += 1
        return seconds_by_tile.pop(0) if seconds_by_tile else 1.0
    time_ms.calls = 0
    return time_ms


@needs_interpreter
def test_sweep_times_every_runnable_config_and_picks_per_scheme(tune, tmp_path, capsys):
    timer = fake_timer([])
    results = tune.run_sweep(tiny_sweep(tune), "cpu", time_ms=timer, dtype=torch.float16, out_dir=str(tmp_path),
                             num_splits=2)
    out = capsys.readouterr().out
    # the interpreter cannot run inline PTX: those configs are reported and skipped, never timed as something else
    assert out.count("skip biased+ptx") == out.count("skip subnormal+ptx") == 2 * 3 and "ValueError" in out
    runnable = {"biased", "subnormal"}
    assert {r["codes"] for r in results} == runnable
    # 2 schemes x (2 decode tiles + 1 prefill tile) x 2 runnable code paths
    assert len(results) == timer.calls == 2 * 3 * 2
    assert json.loads((tmp_path / "tune_attention.json").read_text()) == results
    best = tune.best_configs(results)
    assert set(best) == {(s, k) for s in tune.SCHEMES for k in ("decode", "prefill")}
    assert all(codes in runnable for codes, *_ in best.values())


@needs_interpreter
def test_a_wrong_fast_config_cannot_win(tune, monkeypatch, capsys):
    real = tune.paged_attention

    def broken_when_subnormal(*args, **kwargs):
        real(*args, **kwargs)
        if args[-1].subnormal_codes:
            args[8].mul_(2)  # out: a kernel that computes the wrong attention

    monkeypatch.setattr(tune, "paged_attention", broken_when_subnormal)
    sweep = tune.Sweep(decode_cases=((2, 300),), prefill_cases=(), decode_grid=tune.launch_grid((64,), (4,), (2,)),
                       prefill_grid=())
    timings = iter([1.0, 0.1] * 2)  # per scheme: the default path 1 ms, the broken subnormal one "faster"
    results = tune.run_sweep(sweep, "cpu", time_ms=lambda fn: (fn(), next(timings))[1], dtype=torch.float16,
                             num_splits=2)
    assert "WRONG subnormal" in capsys.readouterr().out
    assert {r["codes"] for r in results} == {"biased"}
    assert {codes for codes, *_ in tune.best_configs(results).values()} == {"biased"}


def test_apply_writes_the_decode_winners_into_attention_source(tune):
    source = tune.ATTENTION_SOURCE.read_text()
    from s4kv.kernels.attention import DECODE_LAUNCH

    current = {(scheme, "decode"): (code_path_of(launch), launch.tile, launch.num_warps, launch.num_stages)
               for scheme, launch in DECODE_LAUNCH.items()}
    assert tune.apply_decode_launch(source, current) == source  # today's defaults render as the file has them

    rows = [dict(scheme=s, kind="decode", batch=b, ctx=4096, codes=codes, tile=tile, warps=2, stages=3, us=us)
            for s in tune.SCHEMES for b in (1, 32)
            for codes, tile, us in (("biased", 64, 10.0), ("subnormal+ptx", 128, 7.0 if s == "int4_saw" else 12.0))]
    best = tune.best_configs(rows)
    applied = tune.apply_decode_launch(source, best)
    namespace = {"LaunchConfig": tune.LaunchConfig}
    exec(tune.DECODE_LAUNCH_BLOCK.search(applied).group(0), namespace)
    assert namespace["DECODE_LAUNCH"] == {  # the swept fields from the winners, the load options kept
        "int4_kivi": tune.LaunchConfig(64, 2, 3, **tune.kept_launch_options("int4_kivi")),
        "int4_saw": tune.LaunchConfig(128, 2, 3, subnormal_codes=True, ptx_unpack=True,
                                      **tune.kept_launch_options("int4_saw"))}
    assert namespace["DECODE_LAUNCH"]["int4_kivi"].paired_param_loads
    assert applied.replace(tune.DECODE_LAUNCH_BLOCK.search(applied).group(0), "") == \
        source.replace(tune.DECODE_LAUNCH_BLOCK.search(source).group(0), "")  # nothing else changes

    with pytest.raises(ValueError, match="no decode winner for int4_saw"):
        tune.apply_decode_launch(source, {k: v for k, v in best.items() if k[0] != "int4_saw"})
