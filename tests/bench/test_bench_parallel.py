"""`s4kv bench` on several GPUs, without a GPU: the --tensor-parallel-size / --data-parallel-size options,
the engine arguments and replica environments they give, time budgets scaled to a 70B at TP 2, data-parallel
replicas with a stand-in engine (split requests, barrier, summed throughput, a failing replica ends the other),
the table rows of several layouts and models, and tools/device/parallel.sh's dry run."""

import argparse
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from bench_helpers import bench_args

from s4kv.runtime.bench import runner as bench, report as bench_report
from s4kv.runtime import cli
from s4kv.runtime.bench.engine import engine_kwargs, replica_prompts, token_prompts, wait_for_replicas
from s4kv.runtime.bench.matrix import (ALL_WORKLOADS, ENGINE_START_S, EXTRA_WORKLOADS, FULL_CARD, MEASURED_WALL_S,
                                       WORKLOADS, EngineSettings, ModelScale, expected_engine_s, parse_names)

REPO = Path(__file__).resolve().parents[2]
LLAMA70B = REPO / "configs" / "llama-3.1-70b-instruct.json"
LLAMA8B = REPO / "configs" / "llama-3.1-8b-instruct.json"
QWEN7B = REPO / "configs" / "qwen2.5-7b-instruct.json"
TP2 = EngineSettings(gpu_memory_utilization=0.90, max_num_seqs=128, tensor_parallel_size=2)
DP2 = EngineSettings(gpu_memory_utilization=0.90, max_num_seqs=256, data_parallel_size=2)

# A replica of a data-parallel run: prints its GPUs, vLLM's capacity line and a result over its share of requests,
# after the same barrier the real engine uses. Rank 1 of s4kv_saw crashes at once; rank 0 then waits forever.
FAKE_REPLICA = textwrap.dedent("""
    import json, os, sys, time
    from s4kv.runtime.bench.engine import RESULT_PREFIX, replica_prompts, wait_for_replicas
    from s4kv.runtime.bench.matrix import Workload
    spec = json.load(open(sys.argv[1]))
    replica = spec.get("replica") or {"rank": 0, "size": 1}
    print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    print("VLLM_CACHE_ROOT=" + os.environ.get("VLLM_CACHE_ROOT", "unset"))
    if spec["format"] == "s4kv_saw" and replica["rank"] == 1:
        print("RuntimeError: CUDA error: out of memory")
        sys.exit(1)
    kv = {"bf16_fa3": 2043840, "s4kv_kivi": 7694464, "s4kv_saw": 7694464}[spec["format"]] - replica["rank"] * 128
    print(f"(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: {kv:,} tokens", flush=True)
    results = {}
    for w in spec["workloads"]:
        workload = Workload.from_spec(w)
        prompts = replica_prompts(workload, spec["vocab_size"], replica["rank"], replica["size"])
        wait_for_replicas(spec.get("replica"), workload.name)
        start = time.time()
        time.sleep(0.2 * (replica["rank"] + 1))
        end = time.time()
        out = len(prompts) * workload.output_len
        results[workload.name] = {"wall_s": end - start, "output_tokens": out, "input_tokens": len(prompts) * 1024,
                                  "output_tok_s": out / (end - start), "total_tok_s": 1.0,
                                  "start_unix": start, "end_unix": end, "requests": len(prompts),
                                  "triton_compiles": replica["rank"]}
    print("S4KV_BENCH_RESULT " + json.dumps({"startup_s": 2.0, "warmup_s": 0.5, "gpu": "Fake GPU", "vllm": "0.26.0",
                                             "workloads": results}), flush=True)
""")


def parse_cli(*argv: str) -> argparse.Namespace:
    sys_argv = sys.argv
    sys.argv = ["s4kv", "bench", *argv]
    try:
        return cli.build_parser().parse_args(["bench", *argv])
    finally:
        sys.argv = sys_argv


# ------------------------------------------------------------------------------------------ options and planning
def test_parallel_options_parse_and_default_to_one_gpu():
    args = parse_cli("--tensor-parallel-size", "2", "--data-parallel-size", "4", "--in-order",
                     "--configs", "s4kv_kivi,bf16_fa3")
    assert (args.tensor_parallel_size, args.data_parallel_size, args.in_order) == (2, 4, True)
    plain = parse_cli()
    assert (plain.tensor_parallel_size, plain.data_parallel_size, plain.in_order) == (1, 1, False)
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            parse_cli("--tensor-parallel-size", bad)


def test_in_order_keeps_the_given_order_and_all_stays_the_standard_matrix():
    assert parse_names("s4kv_kivi,bf16_fa3,s4kv_saw,s4kv_kivi", {"bf16_fa3": 1, "s4kv_kivi": 2, "s4kv_saw": 3},
                       "configs", keep_order=True) == ["s4kv_kivi", "bf16_fa3", "s4kv_saw"]
    plan = bench.build_plan(bench_args(Path("x"), configs="s4kv_kivi,bf16_fa3,s4kv_saw", in_order=True,
                                       workloads="short128", tensor_parallel_size=2))
    assert [fmt for fmt, _, _ in plan] == ["s4kv_kivi", "bf16_fa3", "s4kv_saw"]
    assert {settings for _, settings, _ in plan} == {TP2}
    assert plan[0][1].key == "gmu0.90-seqs128-tp2"
    table_order = bench.build_plan(bench_args(Path("x"), configs="s4kv_kivi,bf16_fa3"))
    assert [fmt for fmt, _, _ in table_order][:2] == ["bf16_fa3", "s4kv_kivi"]
    # short128 is picked by name only: 'all' is still the standard matrix
    everything = bench.build_plan(bench_args(Path("x"), configs="bf16_fa3"))
    assert sorted(n for _, _, names in everything for n in names) == sorted(WORKLOADS)
    assert set(ALL_WORKLOADS) == set(WORKLOADS) | set(EXTRA_WORKLOADS)


def test_engine_keys_stay_plain_on_one_gpu():
    assert FULL_CARD.key == "gmu0.90-seqs256" and not FULL_CARD.parallel
    assert DP2.key == "gmu0.90-seqs256-dp2" and DP2.num_gpus == 2
    both = EngineSettings(0.9, 128, tensor_parallel_size=2, data_parallel_size=4)
    assert both.key == "gmu0.90-seqs128-tp2-dp4" and both.num_gpus == 8
    assert both.parallel_label.startswith("TP 2 x DP 4")
    # results.json of earlier calls have no parallel fields: they read back as one GPU
    old = {"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_model_len": 20480}
    assert EngineSettings(**old) == FULL_CARD


H200_TOTAL_BYTES = 143_771 * 2**20  # NVML's total, as nvidia-smi prints it
H100_TOTAL_BYTES = 81_559 * 2**20


def test_a_card_size_becomes_the_share_of_the_gpu_the_engine_meets():
    card = WORKLOADS["24gb"].engine
    assert card.key == "24gb-seqs256" and card.memory_label == "24 GB"
    assert card.memory_share(H200_TOTAL_BYTES) == pytest.approx(0.16, abs=0.001)  # the H200's earlier gmu 0.16
    assert card.memory_share(H100_TOTAL_BYTES) == pytest.approx(0.281, abs=0.001)
    assert FULL_CARD.memory_share(None) == 0.90 and FULL_CARD.memory_share(H100_TOTAL_BYTES) == 0.90
    with pytest.raises(ValueError, match="does not fit a GPU of 16.0 GB"):
        card.memory_share(16 * 10**9)
    with pytest.raises(ValueError, match="needs the GPU's total memory"):
        card.memory_share(None)
    for both_or_neither in ({"gpu_memory_utilization": 0.9, "gpu_memory_gb": 24.0}, {"gpu_memory_utilization": None}):
        with pytest.raises(ValueError, match="one of gpu_memory_utilization and gpu_memory_gb"):
            EngineSettings(max_num_seqs=256, **both_or_neither)
    spec = {"format": "bf16_fa3", "model": "/m", "load_format": "dummy", "vocab_size": 152064,
            "workloads": [WORKLOADS["24gb"].to_spec()]}
    assert engine_kwargs(spec, H100_TOTAL_BYTES)["gpu_memory_utilization"] == pytest.approx(24e9 / H100_TOTAL_BYTES)
    # a record's engine reads back as it was written, card size included
    assert EngineSettings(**card.as_dict()) == card


def test_int4_kivi_runs_at_the_max_num_seqs_its_deployment_would():
    # `s4kv capacity` caps int4_kivi's max_num_seqs so that its staging pool (an int4 page of bf16 keys per slot in
    # every layer and KV head: 128 x 128 x 2 bytes x 32 layers x 8 heads = 8 MiB for Llama-3.1-8B) takes at most an
    # eighth of the KV pool: on a 24 GB card 24e9 - 2 GiB reserve - 16.06e9 of weights = 5.79e9, an eighth of it 86
    # slots, 80 in steps of 16. The card is 24 GB on any GPU, so the cap is the same on the H100 and the H200.
    def kwargs(fmt: str, workload: str, total: int, model: Path = LLAMA8B) -> dict:
        spec = {"format": fmt, "model": str(model), "load_format": "dummy", "vocab_size": 128256,
                "workloads": [WORKLOADS[workload].to_spec()]}
        return engine_kwargs(spec, total)

    for total in (H100_TOTAL_BYTES, H200_TOTAL_BYTES):
        assert kwargs("s4kv_kivi", "24gb", total)["max_num_seqs"] == 80
        assert kwargs("s4kv_saw", "24gb", total)["max_num_seqs"] == 256
        assert kwargs("bf16_fa3", "24gb", total)["max_num_seqs"] == 256
    # Qwen2.5-7B's slot is 3.5 MiB (28 layers, 4 KV heads): 6.62e9 / 8 of room is 225 slots
    assert kwargs("s4kv_kivi", "24gb", H100_TOTAL_BYTES, QWEN7B)["max_num_seqs"] == 224
    # a full H100 (0.9 of 85.5e9) leaves 58.8e9 of KV pool: 875 slots, under many's 1,024, above short's 256
    assert kwargs("s4kv_kivi", "many", H100_TOTAL_BYTES)["max_num_seqs"] == 864
    assert kwargs("s4kv_kivi", "short", H100_TOTAL_BYTES)["max_num_seqs"] == 256
    assert kwargs("s4kv_kivi", "many", H200_TOTAL_BYTES)["max_num_seqs"] == 1024  # 1,750 slots of room
    assert kwargs("s4kv_kivi", "many", None)["max_num_seqs"] == 1024  # no GPU: nothing to cap against


def test_tensor_parallel_size_must_split_the_heads(tmp_path, capsys):
    scale, shape = bench.model_scale(LLAMA70B)
    assert shape.num_heads == 64 and shape.num_kv_heads == 8 and scale.layers == 80
    assert bench.parallel_error(shape, 2) is None and bench.parallel_error(shape, 8) is None
    assert bench.parallel_error(shape, 16) is None  # 8 KV heads replicated over 16 GPUs
    assert "attention heads" in bench.parallel_error(shape, 3)
    code = bench.run(bench_args(tmp_path, model=QWEN7B, tensor_parallel_size=8, dry_run=True))
    assert code == 2 and "28 attention heads cannot be split over tensor parallel size 8" in capsys.readouterr().err


def test_dry_run_prints_the_parallel_plan(tmp_path, capsys):
    code = bench.run(bench_args(tmp_path / "out", model=LLAMA70B, configs="s4kv_kivi,bf16_fa3,s4kv_saw",
                                in_order=True, workloads="short128", tensor_parallel_size=2, dry_run=True))
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and not (tmp_path / "out").exists()
    assert [line.split()[2] for line in lines] == ["s4kv_kivi", "bf16_fa3", "s4kv_saw"]
    assert all("gmu0.90-seqs128-tp2" in line and line.endswith("on 2 GPUs: TP 2") for line in lines)
    code = bench.run(bench_args(tmp_path / "out", configs="bf16_fa3", workloads="short", data_parallel_size=2,
                                dry_run=True))
    assert code == 0 and "gmu0.90-seqs256-dp2" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ time estimates
def test_budget_estimates_scale_with_model_and_layout():
    measured = MEASURED_WALL_S["short"]
    # the 7B on one GPU: unchanged, start plus the measured (or slowest) wall time
    assert expected_engine_s("bf16_fa3", ["short"]) == ENGINE_START_S + measured["bf16_fa3"]
    assert expected_engine_s("s4kv_saw_rotv", ["short"], ModelScale(), FULL_CARD) == \
        ENGINE_START_S + max(measured.values())
    assert expected_engine_s("bf16_fa3", ["short"], bench.model_scale(QWEN7B)[0], FULL_CARD) == \
        pytest.approx(expected_engine_s("bf16_fa3", ["short"]))
    # a 70B at TP 2: a slower start (80 layers, workers) and 35 B parameters per GPU against 7.6 B
    llama = bench.model_scale(LLAMA70B)[0]
    tp_need = expected_engine_s("s4kv_kivi", ["short128"], llama, TP2)
    assert 180 < tp_need < 240
    assert expected_engine_s("bf16_fa3", ["short128"], llama, TP2) < tp_need
    # data parallel: each replica serves half the requests, replicas start side by side
    dp_need = expected_engine_s("bf16_fa3", ["short"], ModelScale(), DP2)
    assert dp_need < expected_engine_s("bf16_fa3", ["short"]) + 10
    assert dp_need > ENGINE_START_S + measured["bf16_fa3"] / 2
    # a start measured earlier in the same call replaces the estimated start, not the workload's time
    workload_s = expected_engine_s("s4kv_kivi", ["short128"], llama, TP2, start_s=0.0)
    assert 30 < workload_s < 60
    assert expected_engine_s("s4kv_kivi", ["short128"], llama, TP2, start_s=10.0) == pytest.approx(10.0 + workload_s)


def test_measured_start_lets_a_later_engine_fit(tmp_path, stand_in):
    """The first 70B engine fits the budget by its estimate and starts in 2 s; the second, whose estimated start
    would no longer fit, is budgeted from that measured start and runs."""
    stand_in(FAKE_REPLICA + "\ntime.sleep(3)\n", "fake_replica")
    llama = bench.model_scale(LLAMA70B)[0]
    first = expected_engine_s("s4kv_kivi", ["short128"], llama, TP2)
    assert expected_engine_s("s4kv_saw", ["short128"], llama, TP2) > first - 3
    out = tmp_path / "out"
    code = bench.run(bench_args(out, model=LLAMA70B, configs="s4kv_kivi,s4kv_saw", in_order=True,
                                workloads="short128", tensor_parallel_size=2, budget_s=first + 1))
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert code == 0, runs
    assert [r["status"] for r in runs] == ["ok", "ok"]
    assert runs[0]["model"] == "llama-3.1-70b-instruct" and runs[0]["engine"]["tensor_parallel_size"] == 2


# ------------------------------------------------------------------------------------------ one engine process
def test_engine_kwargs_carry_tensor_parallel_size_but_no_data_parallel_size():
    workload = EXTRA_WORKLOADS["short128"]
    spec = {"format": "s4kv_kivi", "model": str(LLAMA8B), "load_format": "dummy", "vocab_size": 128256,
            "workloads": [bench.dataclasses.replace(workload, engine=TP2).to_spec()]}
    kwargs = engine_kwargs(spec, H100_TOTAL_BYTES)
    assert kwargs["tensor_parallel_size"] == 2 and "data_parallel_size" not in kwargs
    assert kwargs["max_num_seqs"] == 128 and kwargs["gpu_memory_utilization"] == 0.90
    assert kwargs["kv_cache_dtype"] == "int4_per_token_head" and kwargs["attention_backend"] == "CUSTOM"
    assert kwargs["additional_config"] == {"s4kv": {"scheme": "int4_kivi"}}
    replica = dict(spec, format="bf16_fa3",
                   workloads=[bench.dataclasses.replace(WORKLOADS["short"], engine=DP2).to_spec()],
                   replica={"rank": 1, "size": 2, "barrier": "/b"})
    kwargs = engine_kwargs(replica)
    assert kwargs["tensor_parallel_size"] == 1 and "data_parallel_size" not in kwargs
    assert kwargs["kv_cache_dtype"] == "auto" and kwargs["attention_backend"] == "FLASH_ATTN"


def test_replicas_split_the_requests_without_overlap():
    workload = WORKLOADS["short"]
    everything = token_prompts(workload, 152064)
    shares = [replica_prompts(workload, 152064, rank, 2) for rank in range(2)]
    assert [len(s) for s in shares] == [128, 128]
    assert sorted(tuple(p["prompt_token_ids"][:8]) for s in shares for p in s) == \
        sorted(tuple(p["prompt_token_ids"][:8]) for p in everything)
    assert replica_prompts(workload, 152064) == everything
    with pytest.raises(ValueError):
        replica_prompts(workload, 152064, 2, 2)


def test_replica_environment_pins_each_replica_to_its_gpus():
    base = {"PATH": "/bin", "HOME": "/root"}
    assert bench.replica_env(0, FULL_CARD, base) == base
    assert bench.replica_env(0, TP2, base) == base  # one engine over both GPUs: vLLM places its workers
    envs = [bench.replica_env(rank, DP2, base) for rank in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
    assert envs[0]["VLLM_CACHE_ROOT"] != envs[1]["VLLM_CACHE_ROOT"]
    assert envs[0]["VLLM_CACHE_ROOT"].startswith("/root/.cache/vllm")
    wide = EngineSettings(0.9, 128, tensor_parallel_size=2, data_parallel_size=2)
    visible = dict(base, CUDA_VISIBLE_DEVICES="4,5,6,7", VLLM_CACHE_ROOT="/c")
    assert [bench.replica_env(r, wide, visible)["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["4,5", "6,7"]
    assert bench.replica_env(1, wide, visible)["VLLM_CACHE_ROOT"] == "/c/dp-replica1"
    with pytest.raises(ValueError, match="4 GPUs needed"):
        bench.replica_env(0, wide, dict(base, CUDA_VISIBLE_DEVICES="0,1"))


def test_barrier_waits_for_every_replica(tmp_path):
    wait_for_replicas(None, "short")  # alone: nothing to wait for
    released = []

    def replica(rank: int, delay: float) -> None:
        time.sleep(delay)
        wait_for_replicas({"rank": rank, "size": 3, "barrier": str(tmp_path)}, "short", timeout=10)
        released.append(time.monotonic())

    threads = [threading.Thread(target=replica, args=(rank, 0.3 * rank)) for rank in range(3)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert min(released) - start >= 0.55  # nobody left before the last one arrived
    assert max(released) - min(released) < 0.3
    with pytest.raises(TimeoutError, match="'long'"):
        wait_for_replicas({"rank": 0, "size": 2, "barrier": str(tmp_path)}, "long", timeout=0.1)


def test_combined_replicas_sum_tokens_over_the_common_interval():
    def part(start, end, tokens, compiles):
        return {"wall_s": end - start, "output_tokens": tokens, "input_tokens": tokens * 4, "output_tok_s": 0.0,
                "total_tok_s": 0.0, "start_unix": start, "end_unix": end, "triton_compiles": compiles}
    records = [{"status": "ok", "kv_cache_tokens": 7_694_464, "log": "r0.log", "startup_s": 50.0, "warmup_s": 5.0,
                "gpu": "G", "vllm": "0.26.0", "exit": "clean", "results": {"short": part(100.0, 104.0, 32768, 0)}},
               {"status": "ok", "kv_cache_tokens": 7_694_336, "log": "r1.log", "startup_s": 55.0, "warmup_s": 4.0,
                "gpu": "G", "vllm": "0.26.0", "exit": "clean", "results": {"short": part(100.1, 105.0, 32768, 2)}}]
    combined = bench.combine_replicas(records)
    short = combined["results"]["short"]
    assert combined["status"] == "ok" and combined["startup_s"] == 55.0 and combined["warmup_s"] == 5.0
    assert combined["kv_cache_tokens"] == 7_694_336 and combined["kv_cache_tokens_replicas"] == [7_694_464, 7_694_336]
    assert short["wall_s"] == pytest.approx(5.0) and short["output_tokens"] == 65536
    assert short["output_tok_s"] == pytest.approx(65536 / 5.0)
    assert short["total_tok_s"] == pytest.approx(65536 * 5 / 5.0)
    assert len(short["replicas"]) == 2
    assert short["triton_compiles"] == 2  # a compilation in any replica's timed run counts
    crashed = {"status": "failed", "kv_cache_tokens": None, "log": "r1.log", "error": "exit code 1: OOM"}
    stopped = {"status": "failed", "kv_cache_tokens": 7_694_464, "log": "r0.log",
               "error": "stopped: replica 1 failed first: no result line"}
    failed = bench.combine_replicas([stopped, crashed])
    assert failed["status"] == "failed" and failed["error"] == "replica 1: exit code 1: OOM"
    assert failed["kv_cache_tokens"] is None


# ------------------------------------------------------------------------------------------ replicas end to end
def test_data_parallel_run_with_stand_in_replicas(tmp_path, stand_in, monkeypatch):
    stand_in(FAKE_REPLICA, "fake_replica")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = tmp_path / "out"
    start = time.monotonic()
    code = bench.run(bench_args(out, configs="s4kv_kivi,bf16_fa3,s4kv_saw", in_order=True, workloads="short",
                                data_parallel_size=2))
    assert time.monotonic() - start < 60  # the crashed replica's partner did not wait out its barrier
    assert code == 1  # s4kv_saw's replica 1 failed
    runs = {r["format"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert list(runs) == ["s4kv_kivi", "bf16_fa3", "s4kv_saw"]
    kivi = runs["s4kv_kivi"]
    assert kivi["status"] == "ok" and kivi["engine"]["data_parallel_size"] == 2
    assert kivi["kv_cache_tokens"] == 7_694_464 - 128 and kivi["kv_cache_tokens_replicas"] == [7_694_464, 7_694_336]
    short = kivi["results"]["short"]
    assert short["output_tokens"] == 256 * 256
    assert [p["requests"] for p in short["replicas"]] == [128, 128]
    assert short["triton_compiles"] == 1  # replica 1 of the stand-in compiled one kernel inside its timed run
    assert short["wall_s"] == pytest.approx(max(p["end_unix"] for p in short["replicas"])
                                            - min(p["start_unix"] for p in short["replicas"]))
    assert abs(short["replicas"][0]["start_unix"] - short["replicas"][1]["start_unix"]) < 0.5  # the barrier
    logs = [Path(p).read_text() for p in kivi["log"]]
    assert ["CUDA_VISIBLE_DEVICES=0" in logs[0], "CUDA_VISIBLE_DEVICES=1" in logs[1]] == [True, True]
    assert "dp-replica0" in logs[0] and "dp-replica1" in logs[1]
    saw = runs["s4kv_saw"]
    assert saw["status"] == "failed" and saw["error"].startswith("replica 1: exit code 1")
    table = (out / "table.md").read_text()
    assert "KV capacity (tokens per engine), gmu 0.90, max_num_seqs 256, DP 2" in table
    assert "short: 256 x 1024 in / 256 out (output tok/s), DP 2" in table
    assert "7,694,336 (3.76x)" in table


# ------------------------------------------------------------------------------------------ table of several layouts
def test_table_keeps_layouts_and_models_apart():
    def run(fmt, model, engine, workload, kv, speed):
        return {"format": fmt, "model": model, "engine": engine.as_dict(), "workloads": [workload], "status": "ok",
                "kv_cache_tokens": kv, "startup_s": 1.0, "results": {workload: {"output_tok_s": speed}}}
    doc = {"meta": {}, "runs": [
        run("bf16_fa3", "llama-3.1-70b-instruct", TP2, "short128", 360_000, 1000.0),
        run("s4kv_kivi", "llama-3.1-70b-instruct", TP2, "short128", 1_355_000, 990.0),
        run("bf16_fa3", "qwen2.5-7b-instruct", DP2, "short", 2_043_840, 14_000.0),
        run("s4kv_kivi", "qwen2.5-7b-instruct", DP2, "short", 7_694_464, 14_200.0),
        run("bf16_fa3", "qwen2.5-7b-instruct", FULL_CARD, "short", 2_043_840, 7_368.0),
    ]}
    rows = {row.key: row for row in bench_report.build_table(doc)}
    assert set(rows) == {"kv:gmu0.90-seqs128-tp2:llama-3.1-70b-instruct", "kv:gmu0.90-seqs256-dp2:qwen2.5-7b-instruct",
                         "kv:gmu0.90-seqs256:qwen2.5-7b-instruct", "short@dp2:qwen2.5-7b-instruct",
                         "short:qwen2.5-7b-instruct", "short128@tp2:llama-3.1-70b-instruct"}
    tp_kv = rows["kv:gmu0.90-seqs128-tp2:llama-3.1-70b-instruct"]
    assert tp_kv.title.startswith("llama-3.1-70b-instruct: KV capacity (tokens per engine)")
    assert tp_kv.cells["s4kv_kivi"].ratio == pytest.approx(1_355_000 / 360_000)
    assert rows["short@dp2:qwen2.5-7b-instruct"].cells["s4kv_kivi"].ratio == pytest.approx(14_200 / 14_000)
    assert rows["short:qwen2.5-7b-instruct"].cells["s4kv_kivi"].note == "not run"  # not mixed with the DP row
    text = bench_report.render_markdown(list(rows.values()))
    assert "short128: 128 x 1024 in / 128 out, max_num_seqs 128 (output tok/s), TP 2" in text
    # one model, one GPU: the plain keys and titles of the single-GPU table
    single = {"meta": {}, "runs": doc["runs"][4:]}
    assert [row.key for row in bench_report.build_table(single)] == ["kv:gmu0.90-seqs256", "short"]


# ------------------------------------------------------------------------------------------ the device script
def test_device_script_dry_run_plans_both_layouts(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               WORK_DIR=str(tmp_path / "work"))
    (tmp_path / "out").mkdir()
    done = subprocess.run(["bash", str(REPO / "tools" / "device" / "parallel.sh")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    plans = [line for line in done.stdout.splitlines() if line.startswith("[bench] plan:")]
    assert [line.split()[2] for line in plans] == ["s4kv_kivi", "bf16_fa3", "s4kv_saw"] * 2
    assert all("seqs128-tp2 short128" in line for line in plans[:3])
    assert all("seqs256-dp2 short" in line for line in plans[3:])
    assert "[parallel] step 1: tp" in (tmp_path / "out" / "parallel.log").read_text()
    later = subprocess.run(["bash", str(REPO / "tools" / "device" / "parallel.sh"), "dp=bf16_fa3", "tp=s4kv_saw"],
                           env=env, capture_output=True, text=True, timeout=120, check=False)
    plans = [line.split()[2:4] for line in later.stdout.splitlines() if line.startswith("[bench] plan:")]
    assert later.returncode == 0 and plans == [["bf16_fa3", "gmu0.90-seqs256-dp2"], ["s4kv_saw", "gmu0.90-seqs128-tp2"]]
    bad = subprocess.run(["bash", str(REPO / "tools" / "device" / "parallel.sh"), "pp"], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "usage" in bad.stdout


def test_device_script_uses_every_gpu_of_the_machine(tmp_path):
    """On an 8-GPU machine (p4d/p5 shape) the same call plans the 70B at TP 8 and the 7B at DP 8."""
    env = dict(os.environ, DRY_RUN="1", GPUS="8", OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               WORK_DIR=str(tmp_path / "work"))
    (tmp_path / "out").mkdir()
    script = str(REPO / "tools" / "device" / "parallel.sh")
    done = subprocess.run(["bash", script, "tp=s4kv_kivi", "dp=s4kv_saw", "serve"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    plans = [line.split()[2:5] for line in done.stdout.splitlines() if line.startswith("[bench] plan:")]
    assert plans == [["s4kv_kivi", "gmu0.90-seqs128-tp8", "short128"], ["s4kv_saw", "gmu0.90-seqs256-dp8", "short"]]
    assert "--tensor-parallel-size 8" in done.stdout and "--data-parallel-size 8" in done.stdout  # the servers
