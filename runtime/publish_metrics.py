"""Publishes the served endpoint's health and vLLM's main Prometheus metrics to CloudWatch (namespace S4KV,
dimension StackName), once: ``python -m s4kv.runtime.publish_metrics``, which the deployment's s4kv-metrics.timer
runs every minute with the runtime's Python (settings from S4KV_ENV_FILE, the AWS CLI for Secrets Manager and
CloudWatch).

Healthy: 1 when /health answers 200, else 0 (the stack's alarm watches it). From /metrics, summed over the
data-parallel engines: KvCacheUsage (vllm:kv_cache_usage_perc, 0..1, the mean), RequestsRunning, RequestsWaiting,
and the cumulative GenerationTokens, TtftSecondsSum/Count, ItlSecondsSum/Count (the dashboard turns these into
tokens/s and mean TTFT and ITL with RATE). TtftSeconds and ItlSeconds: the requests' times to first token and
inter-token gaps since the last run, as CloudWatch value/count pairs (each gap counted at the upper bound of its
bucket in vLLM's histogram), so that CloudWatch's p50 and p99 statistics read them at the histogram's resolution;
the last run's cumulative bucket counts are kept in $STATE_DIRECTORY (systemd's StateDirectory=), and a server
restart (counts that fell) starts the differences afresh. The API key is sent on both requests and goes to no log.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from s4kv.runtime.vllm_metrics import histogram_buckets, largest_finite_bound

NAMESPACE = "S4KV"
GAUGES = {"vllm:num_requests_running": "RequestsRunning", "vllm:num_requests_waiting": "RequestsWaiting"}
COUNTERS = {"vllm:generation_tokens_total": "GenerationTokens",
            "vllm:time_to_first_token_seconds_sum": "TtftSecondsSum",
            "vllm:time_to_first_token_seconds_count": "TtftSecondsCount",
            "vllm:inter_token_latency_seconds_sum": "ItlSecondsSum",
            "vllm:inter_token_latency_seconds_count": "ItlSecondsCount"}
HISTOGRAMS = {"vllm:time_to_first_token_seconds": "TtftSeconds", "vllm:inter_token_latency_seconds": "ItlSeconds"}
STATE_FILE = "histograms.json"


def env_file(path: str) -> dict[str, str]:
    values = {}
    for line in open(path):
        name, _, value = line.strip().partition("=")
        if name and not name.startswith("#"):
            values[name] = value.strip("'")
    return values


def aws(*args: str) -> str:
    return subprocess.run(["aws", *args], check=True, capture_output=True, text=True).stdout


def get(url: str, key: str) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def new_observations(now: dict[float, float], before: dict[float, float]) -> tuple[list[float], list[float]]:
    """The observations between two readings of one cumulative histogram (vllm_metrics.histogram_buckets), as
    CloudWatch Values and Counts: each bucket's new count at its upper bound (the last finite bound for inf).
    Counts that fell mean the server restarted: everything in ``now`` is new."""
    if any(now.get(bound, 0.0) < count for bound, count in before.items()):
        before = {}
    values, counts, below_now, below_before = [], [], 0.0, 0.0
    for bound, cumulative in sorted(now.items()):
        in_bucket = (cumulative - below_now) - (before.get(bound, 0.0) - below_before)
        below_now, below_before = cumulative, before.get(bound, 0.0)
        if in_bucket > 0:
            values.append(largest_finite_bound(now) if math.isinf(bound) else bound)
            counts.append(in_bucket)
    return values, counts


def metrics_from(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    usage = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:kv_cache_usage_perc":
                usage.append(sample.value)
            name = GAUGES.get(sample.name) or COUNTERS.get(sample.name)
            if name:
                totals[name] = totals.get(name, 0.0) + sample.value
    if usage:
        totals["KvCacheUsage"] = sum(usage) / len(usage)
    return totals


def main() -> int:
    settings = env_file(os.environ.get("S4KV_ENV_FILE", "/etc/s4kv/server.env"))
    region = settings["AWS_REGION"]
    key = aws("secretsmanager", "get-secret-value", "--region", region, "--secret-id",
              settings["S4KV_API_KEY_SECRET_ARN"], "--query", "SecretString", "--output", "text").strip()
    base = f"http://127.0.0.1:{settings['S4KV_PORT']}"
    health, _ = get(f"{base}/health", key)
    values = {"Healthy": 1.0 if health == 200 else 0.0}
    status, text = get(f"{base}/metrics", key)
    buckets = {}
    if status == 200:
        values.update(metrics_from(text))
        buckets = {name: histogram_buckets(text, family) for family, name in HISTOGRAMS.items()}
    state_dir = os.environ.get("STATE_DIRECTORY")
    if buckets and not state_dir:
        print("STATE_DIRECTORY is not set (the unit's StateDirectory= sets it): TtftSeconds and ItlSeconds are not "
              "published", file=sys.stderr)
        buckets = {}
    state = Path(state_dir) / STATE_FILE if buckets else None
    # JSON keys are strings: the state holds [bound, count] pairs (inf as Infinity, which json reads back)
    before = ({name: dict(map(tuple, pairs)) for name, pairs in json.loads(state.read_text()).items()}
              if state and state.is_file() else {})
    dimensions = [{"Name": "StackName", "Value": settings["S4KV_STACK_NAME"]}]
    data = [{"MetricName": name, "Dimensions": dimensions, "Value": value,
             "Unit": "Count" if name not in ("KvCacheUsage", "TtftSecondsSum", "ItlSecondsSum") else "None"}
            for name, value in sorted(values.items())]
    observed = {}
    for name, now in sorted(buckets.items()):
        obs_values, obs_counts = new_observations(now, before.get(name, {}))
        observed[name] = sum(obs_counts)
        if obs_values:
            data.append({"MetricName": name, "Dimensions": dimensions, "Values": obs_values, "Counts": obs_counts,
                         "Unit": "Seconds"})
    with tempfile.NamedTemporaryFile("w", suffix=".json") as payload:
        json.dump(data, payload)
        payload.flush()
        aws("cloudwatch", "put-metric-data", "--region", region, "--namespace", NAMESPACE,
            "--metric-data", f"file://{payload.name}")
    if state:
        state.write_text(json.dumps({name: sorted(counts.items()) for name, counts in buckets.items()}))
    print(f"published {', '.join(f'{k}={v:g}' for k, v in sorted(values.items()))}"
          + "".join(f", {name}: {count:g} new" for name, count in observed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
