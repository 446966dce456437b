"""Parsing engine logs, merging runs and the table with ratios to bf16 + FA3 (no GPU, no vLLM)."""

import json
import random

import pytest

from s4kv.runtime.bench import report as bench_report
from s4kv.runtime.bench.engine import RESULT_PREFIX
from s4kv.runtime.bench.matrix import FULL_CARD, WORKLOADS

# the first measured baseline (H200, vLLM 0.26.0): capacity, short tok/s, long wall s
ISSUE_NUMBERS = {
    "bf16_fa3": (2_043_840, 7378.0, 16.2),
    "fp8_fa3": (4_087_680, 7636.0, 15.3),
    "vllm_int4": (7_694_464, 4516.0, 87.9),
}


def engine_log(kv_tokens: int, payload: dict | None) -> str:
    lines = [
        "INFO 11-30 08:00:01 [core.py:100] Initializing a V1 LLM engine (v0.26.0)",
        f"(EngineCore pid=4242) INFO 11-30 08:00:40 [kv_cache_utils.py:2177] GPU KV cache size: {kv_tokens:,} tokens",
        "(EngineCore pid=4242) INFO 11-30 08:00:40 [kv_cache_utils.py:2179] Maximum concurrency for 20,480 tokens "
        "per request: 99.80x",
    ]
    if payload is not None:
        lines.append(RESULT_PREFIX + json.dumps(payload))
    return "\n".join(lines) + "\n"


def run_record(fmt: str, kv: int, results: dict, status: str = "ok", engine=FULL_CARD) -> dict:
    record = {"format": fmt, "engine": engine.as_dict(), "workloads": list(results) or ["short", "long"],
              "status": status}
    if status == "ok":
        record.update(kv_cache_tokens=kv, startup_s=50.0, results=results)
    else:
        record.update(error="exit code 1; log tail:\nTraceback ...")
    return record


def issue_doc() -> dict:
    runs = []
    for fmt, (kv, short, long_s) in ISSUE_NUMBERS.items():
        runs.append(run_record(fmt, kv, {"short": {"output_tok_s": short, "wall_s": 65536 / short},
                                         "long": {"output_tok_s": 8192 / long_s, "wall_s": long_s}}))
    return {"meta": {"gpu": "NVIDIA H200"}, "runs": runs}


def test_kv_cache_line_is_parsed_with_thousands_separators():
    kv = random.randint(10_000, 9_000_000)
    assert bench_report.parse_kv_cache_tokens(engine_log(kv, None)) == kv
    assert bench_report.parse_kv_cache_tokens("no such line\n") is None


def test_last_kv_cache_line_wins():
    log = engine_log(1_000, None) + engine_log(2_345_678, None)
    assert bench_report.parse_kv_cache_tokens(log) == 2_345_678


def test_result_line_round_trips_and_missing_result_is_none():
    payload = {"startup_s": random.random() * 60, "gpu": "NVIDIA H200", "vllm": "0.26.0",
               "workloads": {"short": {"output_tok_s": random.random() * 1e4}}}
    assert bench_report.parse_engine_result(engine_log(5, payload)) == payload
    assert bench_report.parse_engine_result(engine_log(5, None)) is None


def test_table_reproduces_issue_ratios():
    rows = bench_report.build_table(issue_doc())
    by_key = {row.key: row for row in rows}
    capacity = by_key[f"kv:{FULL_CARD.key}"].cells
    assert capacity["bf16_fa3"].ratio == pytest.approx(1.0)
    assert capacity["vllm_int4"].ratio == pytest.approx(7_694_464 / 2_043_840)
    assert by_key["short"].cells["vllm_int4"].ratio == pytest.approx(4516 / 7378)
    assert by_key["long"].cells["vllm_int4"].ratio == pytest.approx(87.9 / 16.2)
    # our schemes were not in this document: their columns are absent, not invented
    assert "s4kv_kivi" not in capacity
    text = bench_report.render_markdown(rows)
    assert "7,694,464 (3.76x)" in text
    assert "4,516 (0.61x)" in text
    assert "87.9 s (5.43x)" in text
    assert "| bf16 + FA3 | fp8 + FA3 | vLLM int4_per_token_head |" in text


def test_failed_and_missing_cells_say_so():
    doc = issue_doc()
    doc["runs"].append(run_record("s4kv_saw", 0, {}, status="failed"))
    rows = bench_report.build_table(doc, ["bf16_fa3", "s4kv_saw", "s4kv_kivi"])
    short = next(r for r in rows if r.key == "short")
    assert short.cells["s4kv_saw"].render("tok/s") == "failed"
    assert short.cells["s4kv_kivi"].render("tok/s") == "not run"
    assert short.cells["bf16_fa3"].render("tok/s") == "7,378 (1.00x)"


def test_merge_takes_medians_and_ratios_within_each_call():
    first = issue_doc()
    first["meta"]["date"] = "call 1"
    faster = random.uniform(8000, 9000)
    int4 = random.uniform(4000, 5000)
    second = {"meta": {"date": "call 2"},
              "runs": [run_record("bf16_fa3", 2_043_840, {"short": {"output_tok_s": faster}}),
                       run_record("vllm_int4", 7_694_464, {"short": {"output_tok_s": int4}})]}
    third = {"meta": {"date": "call 3"}, "runs": [run_record("bf16_fa3", 0, {"short": {}}, status="failed")]}
    merged = bench_report.merge([first, second, third])
    assert merged["meta"]["gpu"] == "NVIDIA H200"
    assert len(merged["runs"]) == len(first["runs"]) + 3
    assert {run["call"] for run in merged["runs"]} == {"call 1 #1", "call 2 #2", "call 3 #3"}
    assert merged["meta"]["date"] == "call 1 to call 3 (3 calls)"
    short = next(r for r in bench_report.build_table(merged) if r.key == "short")
    # the later failure erases nothing; two ok runs each: the median value, the median of same-call ratios
    assert short.cells["bf16_fa3"].value == pytest.approx((7378 + faster) / 2)
    assert short.cells["bf16_fa3"].ratio == pytest.approx(1.0)
    assert short.cells["vllm_int4"].value == pytest.approx((4516 + int4) / 2)
    assert short.cells["vllm_int4"].ratio == pytest.approx((4516 / 7378 + int4 / faster) / 2)
    assert short.cells["vllm_int4"].runs == 2 and not short.cells["vllm_int4"].other_call
    cell = short.cells["vllm_int4"]
    assert cell.render("tok/s") == f"{cell.value:,.0f} ({cell.ratio:.2f}x, median of 2)"
    # merging the merged document again keeps each run's call
    again = bench_report.merge([merged])
    assert [run["call"] for run in again["runs"]] == [run["call"] for run in merged["runs"]]


def test_two_calls_with_one_date_stay_apart():
    """device_pair.sh starts two benches in the same second, one per GPU: each keeps its own baseline."""
    gpus = [{"meta": {"date": "same second"},
             "runs": [run_record("bf16_fa3", 1, {"short": {"output_tok_s": base}}),
                      run_record("s4kv_saw", 1, {"short": {"output_tok_s": base * ratio}})]}
            for base, ratio in ((7000.0, 1.02), (8000.0, 1.04))]
    short = next(r for r in bench_report.build_table(bench_report.merge(gpus)) if r.key == "short")
    assert short.cells["s4kv_saw"].ratio == pytest.approx(1.03)


def test_a_run_without_a_same_call_baseline_is_marked():
    doc = issue_doc()
    doc["meta"]["date"] = "call 1"
    lone = {"meta": {"date": "call 2"},
            "runs": [run_record("s4kv_saw", 7_694_464, {"short": {"output_tok_s": 7600.0}})]}
    rows = bench_report.build_table(bench_report.merge([doc, lone]))
    cell = next(r for r in rows if r.key == "short").cells["s4kv_saw"]
    assert cell.other_call and cell.ratio == pytest.approx(7600 / 7378)
    assert cell.render("tok/s") == "7,600 (1.03x)" + bench_report.OTHER_CALL_MARK
    assert "had no bf16 + FA3 run" in bench_report.render_markdown(rows)
    # a single call's table carries no mark and no footnote
    assert "had no" not in bench_report.render_markdown(bench_report.build_table(issue_doc()))


def test_merge_rejects_other_json():
    with pytest.raises(ValueError, match="no 'runs'"):
        bench_report.merge([{"decode": []}])


def test_target_check_flags_misses():
    doc = issue_doc()
    doc["runs"].append(run_record("s4kv_kivi", 7_694_464, {"short": {"output_tok_s": 7500.0},
                                                           "long": {"wall_s": 17.0}}))
    verdicts = bench_report.target_check(bench_report.build_table(doc), "s4kv_kivi")
    assert any(v.startswith("capacity") and v.endswith("ok") for v in verdicts)
    assert any(v.startswith("short 1.017x") and v.endswith("ok") for v in verdicts)
    assert any(v.startswith("long 1.049x") and v.endswith("MISSED") for v in verdicts)


def test_target_check_shows_a_near_miss_in_digits_that_explain_it():
    doc = issue_doc()
    baseline = next(r for r in doc["runs"] if r["format"] == "bf16_fa3")["results"]["short"]["output_tok_s"]
    doc["runs"].append(run_record("s4kv_kivi", 7_694_464, {"short": {"output_tok_s": baseline * 0.999}}))
    verdicts = bench_report.target_check(bench_report.build_table(doc), "s4kv_kivi")
    assert "short 0.999x (target >= 1.0x): MISSED" in verdicts


def test_standard_workloads():
    shapes = {name: (w.num_requests, w.input_len, w.output_len, w.engine.max_num_seqs,
                     w.engine.gpu_memory_utilization, w.engine.gpu_memory_gb)
              for name, w in WORKLOADS.items()}
    assert shapes == {"short": (256, 1024, 256, 256, 0.90, None), "long": (32, 16384, 256, 256, 0.90, None),
                      "many": (1024, 2048, 512, 1024, 0.90, None), "24gb": (256, 2048, 512, 256, None, 24.0)}


def test_the_jit_note_names_each_engines_compiled_kernels_or_says_none():
    kivi = {"format": "s4kv_kivi", "log": "/tmp/logs/s4kv_kivi-gmu0.90-seqs256.log",
            "jit_compiled": ["_compute_slot_mapping_kernel"]}
    bf16 = {"format": "bf16_fa3", "log": "/tmp/logs/bf16_fa3-gmu0.90-seqs256.log", "jit_compiled": []}
    note = bench_report.jit_note([bf16, kivi])
    assert note.splitlines()[1:] == ["- s4kv int4_kivi (s4kv_kivi-gmu0.90-seqs256.log): `_compute_slot_mapping_kernel`"]
    assert bench_report.jit_note([bf16]).endswith("(vLLM's JIT monitor): none.\n")
    assert bench_report.jit_note([{"format": "bf16_fa3"}]) == ""  # runs saved before it was recorded


def test_the_staging_note_gives_int4_kivis_pool_beside_its_cache():
    # the plugin's line as an H100 engine logged it (Llama-3.1-8B shape, max_num_seqs 1,024)
    line = ("(EngineCore pid=2351) INFO 12-06 16:17:21 [backend.py:382] S4 KV int4_kivi staging pool: 1024 slots "
            "(max_num_seqs) x 8 KV heads x 128 x 128 bfloat16 = 256.0 MiB per attention layer, the room of 246723 "
            "int4 tokens of KV cache per layer")
    assert bench_report.parse_staging_room(engine_log(1_409_280, None) + line + "\n") == 246_723
    assert bench_report.parse_staging_room(engine_log(444_928, None)) is None
    kivi = {**run_record("s4kv_kivi", 1_409_280, {}), "staging_room_tokens": 246_723}
    saw = {**run_record("s4kv_saw", 1_675_008, {}), "staging_room_tokens": None}
    failed = {**run_record("s4kv_kivi", 0, {}, status="failed"), "staging_room_tokens": 246_723}
    assert bench_report.staging_note([saw, kivi, failed]) == (
        f"int4_kivi's staging pool at max_num_seqs {FULL_CARD.max_num_seqs} (gmu "
        f"{FULL_CARD.gpu_memory_utilization:.2f}) takes the room of 246,723 int4 tokens: 1,409,280 in the cache, "
        "1,656,003 with the pool's room.\n")
    assert bench_report.staging_note([saw, {"format": "s4kv_kivi", "status": "ok"}]) == ""  # runs saved before
    # an engine the staging cap held below its setting's max_num_seqs says so
    card = {**run_record("s4kv_kivi", 131_072, {}), "engine": WORKLOADS["24gb"].engine.as_dict(),
            "staging_room_tokens": 19_275, "max_num_seqs": 80}
    assert bench_report.staging_note([card]) == (
        "int4_kivi's staging pool at max_num_seqs 80, capped from the setting's 256 (24 GB) takes the room of "
        "19,275 int4 tokens: 131,072 in the cache, 150,347 with the pool's room.\n")
    assert bench_report.staging_note([{**kivi, "max_num_seqs": FULL_CARD.max_num_seqs}]).startswith(
        f"int4_kivi's staging pool at max_num_seqs {FULL_CARD.max_num_seqs} (gmu")
