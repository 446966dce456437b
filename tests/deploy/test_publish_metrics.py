"""runtime/publish_metrics.py's reading of vLLM's latency histograms: the observations between two runs as
CloudWatch value/count pairs (the whole publisher against a real server and moto: test_boot.py)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("prometheus_client")
from s4kv.runtime import publish_metrics, vllm_metrics  # noqa: E402

PAGE = """\
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 4.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="m"} 9.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 10.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.9
vllm:inter_token_latency_seconds_bucket{engine="1",le="0.01",model_name="m"} 1.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="0.05",model_name="m"} 1.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="+Inf",model_name="m"} 1.0
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 1.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 0.005
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_the_histograms_are_read_per_bound_summed_over_engines():
    assert vllm_metrics.histogram_buckets(PAGE, "vllm:inter_token_latency_seconds") == {
        0.01: 5.0, 0.05: 10.0, math.inf: 11.0}
    assert vllm_metrics.histogram_buckets(PAGE, "vllm:time_to_first_token_seconds") == {}


def test_new_observations_are_each_buckets_growth_at_its_upper_bound():
    now = {0.01: 5.0, 0.05: 10.0, math.inf: 11.0}
    assert publish_metrics.new_observations(now, {}) == ([0.01, 0.05, 0.05], [5.0, 5.0, 1.0])  # inf: last bound
    # since a reading of 3 gaps under 10 ms, 1 more under 50 and 1 over: 2 + 4 new, none over 50 ms
    assert publish_metrics.new_observations(now, {0.01: 3.0, 0.05: 4.0, math.inf: 5.0}) == ([0.01, 0.05], [2.0, 4.0])
    assert publish_metrics.new_observations(now, now) == ([], [])
    # counts that fell: the server restarted, so everything it counted is new
    restarted = {0.01: 1.0, 0.05: 1.0, math.inf: 1.0}
    assert publish_metrics.new_observations(restarted, now) == ([0.01], [1.0])
