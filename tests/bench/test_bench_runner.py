"""`s4kv bench` orchestration with a stand-in engine process: one process per configuration, logs parsed,
failures and time-outs recorded (the engine process group is taken down), outputs written and merged."""

import json
import os
import textwrap
import time
from pathlib import Path

import pytest
from bench_helpers import bench_args

from s4kv.runtime.bench import runner as bench
from s4kv.runtime.bench.engine import FIRST_SPECIAL_TOKEN, cached_kernels, pin_triton_cache, token_prompts
from s4kv.runtime.bench.matrix import (FORMATS, MEASURED_MARGIN, WORKLOADS, engine_groups, expected_engine_s,
                                       expected_workload_s, parse_names)

# Prints what vLLM and bench_engine print; capacity and speed depend on the format, s4kv_saw crashes.
FAKE_ENGINE = textwrap.dedent("""
    import json, sys
    spec = json.load(open(sys.argv[1]))
    if spec["format"] == "s4kv_saw":
        print("Traceback (most recent call last):\\nRuntimeError: CUDA error: an illegal memory access")
        print("WARNING [utils.py:626] [shutdown] Process manager: force killing remaining processes count=1")
        sys.exit(1)
    speed = {"bf16_fa3": 1.0, "vllm_int4": 0.6, "s4kv_kivi": 1.1}[spec["format"]]
    kv = {"bf16_fa3": 2043840, "vllm_int4": 7694464, "s4kv_kivi": 7694464}[spec["format"]]
    print(f"(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: {kv:,} tokens")
    if spec["format"] == "s4kv_kivi":
        print("(EngineCore pid=1) WARNING [jit_monitor.py:135] Triton kernel JIT compilation during inference: "
              "_kivi_close_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.")
    results = {w["name"]: {"wall_s": 10 / speed, "output_tok_s": 1000 * speed, "output_tokens": 1, "total_tok_s": 1}
               for w in spec["workloads"]}
    print("S4KV_BENCH_RESULT " + json.dumps({"startup_s": 1.0, "gpu": "Fake GPU", "vllm": "0.26.0",
                                             "workloads": results}))
""")

# Starts a grandchild (as vLLM starts its engine core) and hangs.
HANGING_ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(sys.argv[1] + ".grandchild", "w").write(str(child.pid))
    time.sleep(120)
""")


def test_parse_names_keeps_table_order_and_rejects_unknown():
    assert parse_names("s4kv_saw,bf16_fa3,s4kv_saw", {"bf16_fa3": 1, "s4kv_saw": 2}, "configs") == \
        ["bf16_fa3", "s4kv_saw"]
    assert parse_names("all", WORKLOADS, "workloads") == ["short", "long", "many", "24gb"]
    with pytest.raises(ValueError, match="unknown workloads"):
        parse_names("short,huge", WORKLOADS, "workloads")


def test_all_means_the_issue_formats_and_an_option_runs_when_named(tmp_path):
    """`--configs all` (the default) runs the five standard formats; int4_saw's rotate_values option is a
    format of its own, run only when named, with its option in the engine's additional_config."""
    plan = bench.build_plan(bench_args(tmp_path, workloads="short"))
    assert [fmt for fmt, _, _ in plan] == ["bf16_fa3", "fp8_fa3", "vllm_int4", "s4kv_kivi", "s4kv_saw"]
    plan = bench.build_plan(bench_args(tmp_path, configs="s4kv_saw_rotv,bf16_fa3", workloads="short"))
    assert [fmt for fmt, _, _ in plan] == ["bf16_fa3", "s4kv_saw_rotv"]
    assert FORMATS["s4kv_saw_rotv"].engine_kwargs()["additional_config"] == \
        {"s4kv": {"scheme": "int4_saw", "rotate_values": True}}


def test_short_and_long_share_an_engine():
    groups = engine_groups(["24gb", "long", "short", "many"])
    assert [names for _, names in groups] == [["24gb"], ["long", "short"], ["many"]]


def test_prompts_are_distinct_token_ids_of_the_right_length():
    workload = WORKLOADS["short"]
    prompts = token_prompts(workload, vocab_size=152064)
    assert len(prompts) == workload.num_requests
    ids = [p["prompt_token_ids"] for p in prompts]
    assert all(len(p) == workload.input_len for p in ids)
    assert len({tuple(p[:8]) for p in ids}) == len(ids)  # no shared prefixes for prefix caching to reuse
    assert max(max(p) for p in ids) < FIRST_SPECIAL_TOKEN and min(min(p) for p in ids) >= 0


def test_full_run_writes_table_plot_and_records_failures(tmp_path, stand_in, capsys):
    stand_in(FAKE_ENGINE, "fake_engine")
    out = tmp_path / "out"
    code = bench.run(bench_args(out, configs="bf16_fa3,vllm_int4,s4kv_kivi,s4kv_saw", workloads="short,long,24gb"))
    assert code == 1  # s4kv_saw failed
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["runs"]) == 8  # 4 formats x 2 engine settings, one process each
    assert doc["meta"]["gpu"] == "Fake GPU"
    saw = [r for r in doc["runs"] if r["format"] == "s4kv_saw"]
    # the first line of the error, which the summary prints, is the exception, not vLLM's shutdown noise
    assert all(r["status"] == "failed" and "illegal memory access" in r["error"].splitlines()[0] for r in saw)
    table = (out / "table.md").read_text()
    assert "7,694,464 (3.76x)" in table
    assert "1,100 (1.10x)" in table  # s4kv_kivi short throughput vs bf16
    assert "9.1 s (0.91x)" in table  # s4kv_kivi long wall time
    assert (out / "plot.svg").read_text().startswith("<svg")
    assert (out / "model" / "config.json").is_file()
    # vLLM's JIT monitor lines: the kernels each engine compiled after its start-up, under the table
    assert {r["format"]: r["jit_compiled"] for r in doc["runs"] if r["format"] != "s4kv_saw"} == {
        "bf16_fa3": [], "vllm_int4": [], "s4kv_kivi": ["_kivi_close_kernel"]}
    assert "- s4kv int4_kivi (s4kv_kivi-" in table and table.count("`_kivi_close_kernel`") == 2  # both engines
    printed = capsys.readouterr().out
    assert "s4kv_kivi: capacity" in printed and "MISSED" not in printed.split("s4kv_kivi:")[1].splitlines()[0]


def test_triton_cache_is_pinned_once_and_counts_kernel_folders(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cache = pin_triton_cache()
    assert cache == tmp_path / ".triton" / "cache" and os.environ["TRITON_CACHE_DIR"] == str(cache)
    assert cached_kernels(cache) == 0  # not created yet
    (cache / "HASH1").mkdir(parents=True)
    (cache / "HASH2").mkdir()
    (cache / "lock").write_text("")  # a file is not a compiled kernel
    assert cached_kernels(cache) == 2
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "chosen"))
    assert pin_triton_cache() == tmp_path / "chosen"  # a cache the user chose stays


def test_summary_names_a_compilation_inside_a_timed_run():
    record = {"format": "s4kv_kivi", "engine": {"gpu_memory_utilization": 0.9, "max_num_seqs": 256},
              "status": "ok", "kv_cache_tokens": 7_606_656, "startup_s": 60.0,
              "results": {"short": {"output_tok_s": 6103.0, "triton_compiles": 3},
                          "long": {"wall_s": 17.0, "triton_compiles": 0}}}
    line = bench.summarize(record)
    assert "short 6,103 tok/s, short timed a compilation: 3 Triton kernels compiled inside it" in line
    assert "long timed" not in line
    del record["results"]["short"]["triton_compiles"]  # a record kept before the count was
    assert "compil" not in bench.summarize(record)


def test_merge_of_two_calls(tmp_path, stand_in):
    stand_in(FAKE_ENGINE, "fake_engine")
    assert bench.run(bench_args(tmp_path / "a", configs="bf16_fa3", workloads="short")) == 0
    assert bench.run(bench_args(tmp_path / "b", configs="s4kv_kivi", workloads="short")) == 0
    merged = tmp_path / "merged"
    assert bench.run(bench_args(merged, merge=[tmp_path / "a" / "results.json", tmp_path / "b" / "results.json"])) == 0
    assert "1,100 (1.10x)" in (merged / "table.md").read_text()


def test_repeats_start_every_engine_once_per_round_and_keep_each_log(tmp_path, stand_in, capsys):
    stand_in(FAKE_ENGINE, "fake_engine")
    out = tmp_path / "out"
    assert bench.run(bench_args(out, configs="s4kv_kivi,bf16_fa3", in_order=True, workloads="short", repeats=2)) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["format"], r["round"]) for r in runs] == [("s4kv_kivi", 1), ("bf16_fa3", 1), ("s4kv_kivi", 2),
                                                          ("bf16_fa3", 2)]
    assert len({r["log"] for r in runs}) == 4 and all(Path(r["log"]).is_file() for r in runs)
    assert "1,100 (1.10x, median of 2)" in (out / "table.md").read_text()
    assert "2 rounds" in capsys.readouterr().out


def test_repeats_are_refused_for_the_serving_benchmark(tmp_path, capsys):
    assert bench.run(bench_args(tmp_path, serve=True, repeats=2)) == 2
    assert "--repeats applies to the offline benchmark" in capsys.readouterr().err


def test_budget_skips_engines_instead_of_starting_them(tmp_path, stand_in):
    stand_in(FAKE_ENGINE, "fake_engine")
    out = tmp_path / "out"
    # s4kv_saw_rotv, without a measured speed in the table, is budgeted at the slowest format's speed: more than
    # bf16 + FA3
    assert expected_engine_s("s4kv_saw_rotv", ["short"]) > expected_engine_s("bf16_fa3", ["short"])
    budget = expected_engine_s("bf16_fa3", ["short"]) - 1
    assert bench.run(bench_args(out, configs="bf16_fa3", workloads="short", budget_s=budget)) == 0
    run, = json.loads((out / "results.json").read_text())["runs"]
    assert run["status"] == "skipped" and "time budget" in run["error"]
    assert not (out / "logs").exists()


def test_timeout_takes_down_the_whole_engine_process_group(tmp_path, stand_in):
    stand_in(HANGING_ENGINE, "hanging_engine")
    model_dir = bench.prepare_model(bench.DEFAULT_MODEL, tmp_path / "model")
    record = bench.run_engine("bf16_fa3", [WORKLOADS["short"]], model_dir, "dummy", 152064, tmp_path, timeout=3)
    assert record["status"] == "failed" and "timed out" in record["error"]
    spec = tmp_path / "logs" / f"bf16_fa3-{WORKLOADS['short'].engine.key}.spec.json"
    grandchild = int(Path(str(spec) + ".grandchild").read_text())
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(grandchild, 0)


def test_result_printed_before_a_stalled_shutdown_still_counts(tmp_path, stand_in):
    stand_in(FAKE_ENGINE + "\nimport time\ntime.sleep(120)\n", "stalling_engine")
    model_dir = bench.prepare_model(bench.DEFAULT_MODEL, tmp_path / "model")
    record = bench.run_engine("s4kv_kivi", [WORKLOADS["short"]], model_dir, "dummy", 152064, tmp_path, timeout=3)
    assert record["status"] == "ok" and record["exit"].startswith("timed out")
    assert record["kv_cache_tokens"] == 7_694_464 and record["results"]["short"]["output_tok_s"] == 1100


def test_missing_model_config_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="not found"):
        bench.prepare_model(tmp_path / "nope.json", tmp_path / "model")


# Reports a wall 50x the table's estimate for every workload (the result line is the engine's own measurement).
SLOW_ENGINE = FAKE_ENGINE.replace('"wall_s": 10 / speed', '"wall_s": 445 / speed')


def test_a_workload_slower_than_estimated_scales_the_later_engines_budget(tmp_path, stand_in):
    """Once an engine of the call has run a workload, the later engines' estimates use its measured pace: an engine
    the table's speed would fit but the measured pace would not is skipped, not started and cut off."""
    stand_in(SLOW_ENGINE, "slow_engine")
    out = tmp_path / "out"
    budget = expected_engine_s("bf16_fa3", ["short"]) + 30
    assert expected_engine_s("s4kv_kivi", ["short"], start_s=1.0 * MEASURED_MARGIN) < budget - 60
    assert bench.run(bench_args(out, configs="bf16_fa3,s4kv_kivi", workloads="short", budget_s=budget)) == 0
    first, second = json.loads((out / "results.json").read_text())["runs"]
    assert first["format"] == "bf16_fa3" and first["status"] == "ok"
    pace = 445 / expected_workload_s("bf16_fa3", "short")
    need = expected_engine_s("s4kv_kivi", ["short"], start_s=1.0 * MEASURED_MARGIN,
                             pace={"short": pace * MEASURED_MARGIN})
    assert second["format"] == "s4kv_kivi" and second["status"] == "skipped"
    assert second["error"].endswith(f"the engine may need {need:.0f} s")
