"""`s4kv bench --serve` (runtime/bench/serve.py): the statistics and tables on hand-made records, the argument
checks, and one real run: vLLM 0.26.0's OpenAI server on the CPU engine with int4_kivi, a tiny config.json (dummy
weights, no tokenizer), driven through the openai client with a very short sweep (a few minutes, nearly all of it the
server's start)."""

from __future__ import annotations

import json
import math
import http.server
import os
import subprocess
import sys
import threading
import time
import unittest.mock
from pathlib import Path
from types import SimpleNamespace

import pytest

from s4kv.runtime import cli, vllm_metrics
from s4kv.runtime.bench import report as bench_report
from s4kv.runtime.bench import serve as bench_serve
from s4kv.runtime.bench.runner import prepare_model
from s4kv.runtime.bench.serve import RequestRecord, SweepPoint

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": 1000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": None,
    "bos_token_id": 1, "eos_token_id": 2,
}
KV_BYTES = 64 * 2**20
LLAMA8B = Path(__file__).resolve().parents[2] / "configs" / "llama-3.1-8b-instruct.json"


def parse_serve(*argv: str):
    """`s4kv bench --serve ARGV` parsed as the command line would be (the parser adds a subcommand's options only when
    sys.argv names it)."""
    argv = ["bench", "--serve", *argv]
    with unittest.mock.patch.object(sys, "argv", ["s4kv", *argv]):
        return cli.build_parser().parse_args(argv)


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert bench_serve.percentile(values, 50) == 3.0
    assert bench_serve.percentile(values, 99) == pytest.approx(4.96)  # numpy.percentile(values, 99)
    assert bench_serve.percentile(values, 0) == 1.0 and bench_serve.percentile([], 50) is None


def test_a_point_counts_only_finished_requests_and_samples_the_gauges():
    point = SweepPoint("rate", 4.0, 3)
    records = [RequestRecord(ttft_s=0.1, e2e_s=0.5, output_tokens=4, itl_s=[0.1, 0.1, 0.2]),
               RequestRecord(ttft_s=0.3, e2e_s=0.9, output_tokens=4, itl_s=[0.2, 0.2, 0.2]),
               RequestRecord(error="APIConnectionError: refused")]
    result = bench_serve.summarize_point(point, records, wall_s=2.0, gauges=[(1, 0), (2, 1), (3, 4)])
    assert result["label"] == "rate 4/s" and result["requests"] == 3 and result["failed"] == 1
    assert result["first_error"] == "APIConnectionError: refused"
    assert result["output_tokens"] == 8 and result["output_tok_s"] == 4.0 and result["request_s"] == 1.0
    assert result["ttft_p50_s"] == pytest.approx(0.2) and result["e2e_p99_s"] == pytest.approx(0.896)
    assert result["itl_p50_s"] == pytest.approx(0.2) and result["itl_p99_s"] == pytest.approx(0.2)
    assert result["running_mean"] == 2.0 and result["running_max"] == 3 and result["waiting_max"] == 4


METRICS_PAGE = """\
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_sum{engine="0",model_name="bench"} 9.5
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="bench"} 40.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="bench"} 90.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="bench"} 98.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.2",model_name="bench"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="bench"} 100.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="bench"} 100.0
vllm:num_requests_running{engine="0",model_name="bench"} 3.0
"""


def test_the_engines_itl_percentiles_are_the_buckets_of_its_histogram_that_hold_them():
    counts = vllm_metrics.histogram_buckets(METRICS_PAGE, "vllm:inter_token_latency_seconds")
    assert counts == {0.01: 40.0, 0.025: 90.0, 0.05: 98.0, 0.2: 100.0, math.inf: 100.0}
    assert vllm_metrics.bucket_percentile(counts, 50) == 0.025
    assert vllm_metrics.bucket_percentile(counts, 99) == 0.2
    assert vllm_metrics.bucket_percentile({0.01: 0.0, math.inf: 0.0}, 99) is None
    # a point reports the histogram's growth over the point: 70 gaps, 2 of them over 50 ms
    before = {0.01: 30.0, 0.025: 30.0, 0.05: 30.0, 0.2: 30.0, math.inf: 30.0}
    over_point = {bound: counts[bound] - before[bound] for bound in counts}
    result = bench_serve.summarize_point(SweepPoint("rate", 4.0, 1), [RequestRecord(ttft_s=0.1, e2e_s=0.2)], 1.0,
                                         [], over_point)
    assert result["engine_itl_count"] == 70
    assert result["engine_itl_p50_le_s"] == 0.025 and result["engine_itl_p99_le_s"] == 0.2


def test_a_rate_point_keeps_one_poisson_schedule_over_its_client_processes():
    point = SweepPoint("rate", 8.0, 7)
    shares = bench_serve.client_shares(point, 3, seed=5)
    assert [share.indices for share in shares] == [(0, 3, 6), (1, 4), (2, 5)]
    assert all(share.in_flight is None for share in shares)
    # the offsets of one process's schedule, merged back, are the one schedule a single process keeps
    merged = dict(pair for share in shares for pair in zip(share.indices, share.offsets))
    single = bench_serve.client_shares(point, 1, seed=5)[0]
    assert [merged[i] for i in range(7)] == list(single.offsets)
    assert single.offsets[0] == 0.0 and all(b > a for a, b in zip(single.offsets, single.offsets[1:]))
    assert bench_serve.client_shares(SweepPoint("rate", math.inf, 3), 2, seed=0)[1].offsets == (0.0,)
    assert len(bench_serve.client_shares(SweepPoint("rate", 2.0, 2), 4, seed=0)) == 2  # no process without a request


def test_a_concurrency_point_splits_its_in_flight_count_over_the_client_processes():
    shares = bench_serve.client_shares(SweepPoint("concurrency", 10, 20), 4, seed=0)
    assert [share.in_flight for share in shares] == [3, 3, 2, 2]
    assert sorted(i for share in shares for i in share.indices) == list(range(20))
    assert all(share.offsets is None for share in shares)
    assert [s.in_flight for s in bench_serve.client_shares(SweepPoint("concurrency", 2, 8), 4, seed=0)] == [1, 1]


class _StreamingCompletions(http.server.BaseHTTPRequestHandler):
    """A stand-in for the server's /v1/completions: streams ``max_tokens`` chunks of one token id each, 5 ms apart,
    and keeps each request's prompt."""

    prompts: list = []

    def do_POST(self):  # noqa: N802  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).prompts.append(body["prompt"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(0.005)
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "text": "a", "finish_reason": None, "token_ids": [7]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *_):
        pass


def test_client_processes_stream_every_request_and_send_the_token_ids_whole():
    pytest.importorskip("openai")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StreamingCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = bench_serve.random_prompts(5, 300, 1000, seed=1)
        records, lags, start, end = bench_serve.drive_clients(
            f"http://127.0.0.1:{server.server_address[1]}", SweepPoint("rate", 50.0, 5), prompts, 6, seed=0,
            processes=2)
    finally:
        server.shutdown()
    assert sorted(map(tuple, _StreamingCompletions.prompts)) == sorted(map(tuple, prompts))
    assert [r.error for r in records] == [None] * 5 and all(r.output_tokens == 6 for r in records)
    assert all(len(r.itl_s) == 5 and min(r.itl_s) > 0 for r in records)
    assert lags and all(lag >= 0 for lag in lags)
    assert max(r.e2e_s for r in records) <= end - start < 30


def _point(kind, value, ttft_p99, itl_p99=0.02, tok_s=100.0, failed=0):
    return {"kind": kind, "value": value, "label": SweepPoint(kind, value, 8).label, "requests": 8, "failed": failed,
            "output_tok_s": tok_s, "ttft_p50_s": ttft_p99 / 2, "ttft_p99_s": ttft_p99, "itl_p50_s": itl_p99 / 2,
            "itl_p99_s": itl_p99, "engine_itl_p99_le_s": 0.025, "client_lag_p99_s": 0.002, "e2e_p50_s": 1.0,
            "e2e_p99_s": 2.0, "running_mean": 3.0, "running_max": 5, "waiting_max": 0}


def _doc():
    runs = [
        {"format": "bf16_fa3", "label": "bf16 + FA3", "status": "ok", "kv_cache_tokens": 107824, "startup_s": 80.0,
         "jit_compiled": [],
         "points": [_point("rate", 2, 0.5), _point("rate", 4, 2.5), _point("rate", 8, 0.9),
                    _point("concurrency", 16, 0.4, tok_s=900.0)]},
        {"format": "s4kv_kivi", "label": "s4kv int4_kivi", "status": "ok", "kv_cache_tokens": 403840,
         "startup_s": 85.0, "jit_compiled": ["_kivi_close_kernel", "_gather_dense_kernel"],
         "points": [_point("rate", 2, 0.4), _point("rate", 4, 0.6), _point("rate", 8, 1.9, itl_p99=0.03),
                    {**asdict_point(SweepPoint("concurrency", 16, 8)), "skipped": "time budget"}]},
    ]
    return {"meta": {"model": "qwen2.5-7b-instruct.json", "input_len": 2048, "output_len": 256, "requests": 8,
                     "gpu_memory_utilization": 0.16, "max_num_seqs": 256, "date": "2026-12-01"}, "runs": runs}


def asdict_point(point: SweepPoint) -> dict:
    return {"kind": point.kind, "value": point.value, "label": point.label}


def test_sustained_rate_is_the_highest_rate_below_which_every_p99_ttft_passes():
    """bf16 misses at 4/s: 8/s does not count even though it passes (an overloaded queue can drain by chance)."""
    assert bench_serve.sustained_rates(_doc()) == {"bf16_fa3": 2, "s4kv_kivi": 8}


def test_the_kernels_vllms_jit_monitor_saw_compiled_are_read_from_the_server_log():
    log = ("(EngineCore pid=955) INFO 12-06 00:50:34 [jit_monitor.py:79] Kernel JIT monitor activated; monitored JIT "
           "compilations during inference will use mode=warn.\n"
           "(EngineCore pid=955) WARNING 12-06 00:50:39 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: _kivi_close_kernel. This causes a latency spike; consider extending warmup to cover this "
           "shape/config.\n"
           "(EngineCore pid=955) WARNING 12-06 00:50:46 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: _paged_attention_kernel. This causes a latency spike; consider extending warmup.\n")
    assert bench_report.parse_jit_compiled(log) == ["_kivi_close_kernel", "_paged_attention_kernel"]
    saved_before = dict(_doc()["runs"][0])
    del saved_before["jit_compiled"]
    table = bench_serve.render_markdown({**_doc(), "runs": [saved_before]})
    assert "| bf16 + FA3 | 107,824 | 256 | 80 s | - |" in table  # max_num_seqs: the command's, saved before


def test_tables_and_plot_show_every_point_and_the_skipped_ones():
    doc = _doc()
    table = bench_serve.render_markdown(doc)
    assert "| bf16 + FA3 | 107,824 | 256 | 80 s | none |" in table
    assert "| s4kv int4_kivi | 403,840 | 256 | 85 s | `_kivi_close_kernel`, `_gather_dense_kernel` |" in table
    assert ("| rate 8/s | s4kv int4_kivi | 100 | 950 | 1,900 | 15 | 30 | <= 25 | 2 | 1,000 | 2,000 | 3 / 5 | 0 | 0 |"
            in table)
    assert "| concurrency 16 | s4kv int4_kivi | skipped: time budget |" in table
    assert "highest request rate with p99 TTFT under 2 s: bf16 + FA3 2/s; s4kv int4_kivi 8/s" in table
    svg = bench_serve.render_svg(doc)
    assert svg.count('class="series"') == 2 + 2 + 1  # ITL and TTFT per format; concurrency: bf16 only
    assert 'data-format="s4kv_kivi" data-panel="itl_p99_s"' in svg


@pytest.mark.parametrize("flags, message", [
    (["--rates", "1,x"], "--rates must be a comma list of numbers"),
    (["--concurrency", "0"], "--concurrency must be positive"),
    (["--client-processes", "0"], "--client-processes must be at least 1"),
    (["--prefill-tokens-per-step", "-1"], "--prefill-tokens-per-step must be a number of tokens"),
    (["--input-len", "4000", "--output-len", "200"], "exceeds --max-model-len 4096"),
    (["--configs", "bf16_fa3,int8"], "unknown configs"),
])
def test_bad_sweeps_are_refused_before_any_server_starts(capsys, flags, message):
    assert cli.main(["bench", "--serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_merge_joins_the_configurations_of_several_calls(tmp_path):
    doc = _doc()
    for i, run in enumerate(doc["runs"]):
        (tmp_path / f"part{i}.json").write_text(json.dumps({"meta": doc["meta"], "runs": [run]}))
    out = tmp_path / "merged"
    assert cli.main(["bench", "--serve", "--merge", str(tmp_path / "part0.json"), str(tmp_path / "part1.json"),
                     "--out", str(out)]) == 0
    merged = json.loads((out / "serve.json").read_text())
    assert [r["format"] for r in merged["runs"]] == ["bf16_fa3", "s4kv_kivi"]
    assert (out / "serve.md").read_text() == bench_serve.render_markdown(doc)
    assert (out / "serve.svg").read_text().startswith("<svg")


@pytest.mark.slow
def test_real_openai_server_on_the_cpu_engine(tmp_path):
    """The path the H200 runs: a fixed KV budget (servers started side by side, here one), warm-up, one rate and one
    concurrency point, every streamed token counted, the server's capacity line read."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_QWEN2))
    out = tmp_path / "out"
    status = cli.main(["bench", "--serve", "--configs", "s4kv_kivi", "--model", str(config), "--out", str(out),
                       "--rates", "8", "--concurrency", "2", "--requests", "3", "--input-len", "64",
                       "--output-len", "8", "--max-model-len", "512", "--max-num-seqs", "4",
                       "--client-processes", "2", "--server-arg=--enforce-eager",
                       "--kv-cache-memory-bytes", str(KV_BYTES), "--budget-s", "900"])
    doc = json.loads((out / "serve.json").read_text())
    run = doc["runs"][0]
    assert status == 0, run.get("error")
    assert run["status"] == "ok"
    # the fixed budget, in whole 128-token pages of 136 bytes per token, KV head and layer
    assert run["kv_cache_tokens"] == KV_BYTES // (128 * 136 * 2) * 128
    assert run["warmup"]["failed"] == 0
    assert run["jit_compiled"] == []  # the CPU engine's attention runs no Triton kernels
    assert [p["label"] for p in run["points"]] == ["rate 8/s", "concurrency 2"]
    for point in run["points"]:
        assert point["failed"] == 0 and point["requests"] == 3, point
        assert point["output_tokens"] == 3 * 8  # ignore_eos + min_tokens: every token streamed and counted
        assert 0 < point["ttft_p50_s"] <= point["ttft_p99_s"] <= point["e2e_p99_s"]
        assert point["itl_p99_s"] is not None and point["itl_p50_s"] <= point["itl_p99_s"]
        assert point["engine_itl_count"] == 3 * 7  # the engine's histogram saw the same gaps the client timed
        assert point["engine_itl_p50_le_s"] <= point["engine_itl_p99_le_s"] < math.inf
        assert point["output_tok_s"] == pytest.approx(24 / point["wall_s"])
        assert math.isfinite(point["running_max"])
        assert math.isfinite(point["client_lag_p99_s"]) and point["client_lag_p99_s"] >= 0  # the clients' loops timed
    assert doc["meta"]["client_processes"] == 2
    assert (out / "serve.md").is_file() and 'class="series"' in (out / "serve.svg").read_text()


def test_int4_kivi_serves_at_its_staging_cap_where_the_share_sizes_the_kv(tmp_path, monkeypatch):
    """As `s4kv serve` would run it by itself: on an H200's 24 GB share (gmu 0.16) the Llama-3.1-8B shape's pool of
    8 MiB a slot may take an eighth of 24.1e9 - 2 GiB - 16.06e9, 88 slots: 80. The server's record and table say so."""
    monkeypatch.setattr(bench_serve, "gpu_total_bytes", lambda: 143_771 * 2**20)
    started = []
    monkeypatch.setattr(bench_serve.subprocess, "Popen", lambda argv, **_: started.append(argv) or SimpleNamespace())
    model_dir = prepare_model(LLAMA8B, tmp_path / "model")
    seqs = {name: bench_serve.start_server(name, model_dir, parse_serve(), tmp_path).record["max_num_seqs"]
            for name in ("s4kv_kivi", "s4kv_saw", "bf16_fa3")}
    assert seqs == {"s4kv_kivi": 80, "s4kv_saw": 256, "bf16_fa3": 256}
    assert [argv[argv.index("--max-num-seqs") + 1] for argv in started] == ["80", "256", "256"]
    # a fixed KV budget is not shared with the pool: every server at --max-num-seqs
    fixed = parse_serve("--kv-cache-memory-bytes", str(2 << 30))
    assert bench_serve.server_max_num_seqs(bench_serve.FORMATS["s4kv_kivi"], model_dir, fixed) == 256
    run = {**_doc()["runs"][1], "max_num_seqs": 80}
    assert "| s4kv int4_kivi | 403,840 | 80 |" in bench_serve.render_markdown({**_doc(), "runs": [run]})


def test_int4_kivi_servers_start_on_vllms_v1_runner_and_the_others_on_its_default(tmp_path, monkeypatch):
    """Each server gets its own environment: int4_kivi's the V1 model runner (as `s4kv serve` selects it, or vLLM's
    V2 default refuses the scheme at start-up), the other formats vLLM's default, whatever order they start in."""
    started = {}

    class FakePopen:
        def __init__(self, argv, env, **_):
            config = json.loads(argv[argv.index("--additional-config") + 1])
            started[argv[argv.index("--kv-cache-dtype") + 1], config.get("s4kv", {}).get("scheme")] = env
            self.pid = 0

    monkeypatch.setattr(bench_serve.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(bench_serve, "gpu_total_bytes", lambda: None)  # no GPU: int4_kivi at --max-num-seqs
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    args = parse_serve()
    for name in ("s4kv_kivi", "bf16_fa3", "s4kv_saw"):
        bench_serve.start_server(name, tmp_path, args, tmp_path)
    runner = {key: env.get("VLLM_USE_V2_MODEL_RUNNER") for key, env in started.items()}
    assert runner == {("int4_per_token_head", "int4_kivi"): "0", ("auto", None): None,
                      ("int4_per_token_head", "int4_saw"): None}
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # the bench process itself keeps vLLM's default


def test_servers_start_in_as_few_even_waves_as_fit_the_gpus_free_memory():
    formats = ["bf16_fa3", "fp8_fa3", "s4kv_kivi", "s4kv_saw"]
    gib = 2**30
    assert bench_serve.server_waves(formats, 22 * gib, 139 * gib) == [formats]  # the H200: all four side by side
    assert bench_serve.server_waves(formats, 22 * gib, 79 * gib) == [formats[:2], formats[2:]]  # the H100: 3 fit, 2 + 2
    assert bench_serve.server_waves(formats, 22 * gib, 30 * gib) == [[f] for f in formats]
    assert bench_serve.server_waves(formats, 22 * gib, 10 * gib) == [[f] for f in formats]  # none fits: each alone
    assert bench_serve.server_waves(formats, 22 * gib, None) == [formats]  # no GPU to read: one wave


def test_the_free_memory_is_read_from_nvidia_smi_of_the_first_visible_gpu(monkeypatch):
    calls = []

    def fake_run(command, **_):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="81000\n", stderr="")

    monkeypatch.setattr(bench_serve.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    assert bench_serve.gpu_free_bytes() == 81000 * 2**20
    assert calls[-1][-2:] == ["-i", "3"]

    def no_smi(command, **_):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench_serve.subprocess, "run", no_smi)
    assert bench_serve.gpu_free_bytes() is None


@pytest.mark.parametrize("flags, cap", [([], 2048), (["--prefill-tokens-per-step", "1024"], 1024)])
def test_every_server_runs_the_plugins_prefill_capped_scheduler_as_s4kv_serve_does(tmp_path, flags, cap):
    args = parse_serve(*flags)
    for name, s4kv in (("s4kv_kivi", {"scheme": "int4_kivi"}), ("bf16_fa3", None)):
        argv = bench_serve.server_command(bench_serve.FORMATS[name], tmp_path, 8000, args, args.max_num_seqs)
        assert argv[argv.index("--scheduler-cls") + 1] == "s4kv.runtime.plugin.scheduler.prefill_capped_scheduler"
        config = json.loads(argv[argv.index("--additional-config") + 1])
        assert config.pop("s4kv_scheduler") == {"prefill_tokens_per_step": cap}
        assert config.get("s4kv") == s4kv and set(config) <= {"s4kv"}
    doc = _doc()
    doc["meta"]["prefill_tokens_per_step"] = cap
    assert f", the prefill-capped scheduler ({cap} prompt tokens a step that decodes);" in (
        bench_serve.render_markdown(doc).splitlines()[0])


def test_a_cap_of_0_runs_vllms_own_scheduler(tmp_path):
    args = parse_serve("--prefill-tokens-per-step", "0")
    argv = bench_serve.server_command(bench_serve.FORMATS["bf16_fa3"], tmp_path, 8000, args, args.max_num_seqs)
    assert "--scheduler-cls" not in argv and "--additional-config" not in argv
    doc = _doc()
    doc["meta"]["prefill_tokens_per_step"] = 0
    assert ", vLLM's scheduler;" in bench_serve.render_markdown(doc).splitlines()[0]


def test_a_client_process_that_dies_fails_the_point_with_its_exit_code(monkeypatch):
    monkeypatch.setattr(bench_serve, "_client_process", _exit_at_once)
    with pytest.raises(RuntimeError, match="a client process exited with code 3 before reporting"):
        bench_serve.drive_clients("http://127.0.0.1:9", SweepPoint("concurrency", 1, 1), [[1]], 1, seed=0,
                                  processes=1)


def _exit_at_once(*_):
    os._exit(3)
