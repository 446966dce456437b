"""The eval report's check of the targets: each scheme against vLLM's int4 of the same run, and int4_kivi against
int4_saw, metric by metric."""

import random

from s4kv.runtime.eval import report as eval_report


def metrics(top1: float, ppl_delta: float, kl: float, exact: float) -> dict:
    return {"top1_agreement": top1, "perplexity_delta_pct": ppl_delta, "mean_kl": kl, "exact_match": exact}


def result_with(kivi: dict, saw: dict | None = None) -> dict:
    reference = metrics(0.88, 3.0, 2.5e-2, 0.10)
    formats = {"bf16_fa3": {"short": metrics(1.0, 0.0, 0.0, 1.0)}, "vllm_int4": {"short": reference},
               "s4kv_kivi": {"short": kivi}}
    if saw is not None:
        formats["s4kv_saw"] = {"short": saw}
    return {"engine": "vllm", "regimes": {"short": {}}, "formats": formats}


def test_each_metric_is_judged_in_its_own_direction():
    better = metrics(0.89, 2.5, 2.0e-2, 0.20)
    worse = metrics(0.87, 3.5, 3.0e-2, 0.05)
    lines = eval_report.target_check(result_with(better, worse))
    assert len(lines) == 3
    kivi, saw, kivi_saw = lines
    assert kivi.startswith("s4kv_kivi short vs vLLM int4_per_token_head:")
    assert "MISSED" not in kivi and kivi.count(": ok") == 4
    assert saw.count("MISSED") == 4
    assert "KL 3.00e-02 vs 2.50e-02 (1.20x): MISSED" in saw
    assert kivi_saw.startswith("s4kv_kivi short vs s4kv int4_saw:") and kivi_saw.count(": ok") == 4


def test_a_tie_meets_the_target_and_one_worse_metric_is_named():
    tie = metrics(0.88, 3.0, 2.5e-2, 0.10)
    worse_kl = dict(tie, mean_kl=2.5e-2 * random.uniform(1.01, 1.5))
    (line,) = eval_report.target_check(result_with(worse_kl))
    assert line.count(": ok") == 3 and line.count("MISSED") == 1 and "KL" in line.split("MISSED")[0].split(";")[-1]


def test_no_reference_in_the_run_means_no_verdict():
    result = result_with(metrics(0.9, 1.0, 1e-2, 0.5))
    del result["formats"]["vllm_int4"]
    assert eval_report.target_check(result) == []


def test_the_kl_ratio_carries_its_interval_when_the_run_kept_windows():
    kivi = dict(metrics(0.89, 2.5, 2.0e-2, 0.2), window_kl=[1.9e-2, 2.1e-2, 2.0e-2, 2.0e-2])
    result = result_with(kivi)
    result["formats"]["vllm_int4"]["short"]["window_kl"] = [2.4e-2, 2.6e-2, 2.5e-2, 2.5e-2]
    (line,) = eval_report.target_check(result)
    low, high = (float(x) for x in line.split("95% CI ")[1].split(")")[0].split("-"))
    assert low <= 0.8 <= high and high - low < 0.1


def test_the_perplexity_ratio_carries_its_interval_when_the_run_kept_windows():
    kivi = dict(metrics(0.89, 2.5, 2.0e-2, 0.2), perplexity=10.0, window_nll=[2.0, 2.5, 2.2, 2.4])
    result = result_with(kivi)
    result["formats"]["vllm_int4"]["short"].update(perplexity=10.5, window_nll=[2.05, 2.55, 2.25, 2.45])
    (line,) = eval_report.target_check(result)
    # every window is 0.05 nats better: the interval of the perplexity ratio is exactly exp(-0.05)
    assert "ppl delta +2.50% vs +3.00% (ppl 0.952x, 95% CI 0.951-0.951): ok" in line


def test_the_check_renders_as_a_markdown_list():
    text = eval_report.render_target_check(result_with(metrics(0.9, 1.0, 1e-2, 0.5), metrics(0.8, 5.0, 5e-2, 0.0)))
    assert [line[:12] for line in text.splitlines()] == ["- s4kv_kivi ", "- s4kv_saw s", "- s4kv_kivi "]
