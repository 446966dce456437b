"""Publishes the server's health and vLLM's main Prometheus metrics to CloudWatch (namespace S4KV, dimension
StackName), once; s4kv-metrics.timer runs it every minute with the runtime's Python.

Healthy: 1 when /health answers 200, else 0 (the stack's alarm watches it). From /metrics, summed over the
data-parallel engines: KvCacheUsage (vllm:kv_cache_usage_perc, 0..1, the mean), RequestsRunning, RequestsWaiting,
and the cumulative GenerationTokens, TtftSecondsSum/Count, ItlSecondsSum/Count (the dashboard turns these into
tokens/s and mean TTFT and ITL with RATE). The API key is sent on both requests and goes to no log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

NAMESPACE = "S4KV"
GAUGES = {"vllm:num_requests_running": "RequestsRunning", "vllm:num_requests_waiting": "RequestsWaiting"}
COUNTERS = {"vllm:generation_tokens_total": "GenerationTokens",
            "vllm:time_to_first_token_seconds_sum": "TtftSecondsSum",
            "vllm:time_to_first_token_seconds_count": "TtftSecondsCount",
            "vllm:inter_token_latency_seconds_sum": "ItlSecondsSum",
            "vllm:inter_token_latency_seconds_count": "ItlSecondsCount"}


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
    if status == 200:
        values.update(metrics_from(text))
    dimensions = [{"Name": "StackName", "Value": settings["S4KV_STACK_NAME"]}]
    data = [{"MetricName": name, "Dimensions": dimensions, "Value": value,
             "Unit": "Count" if name not in ("KvCacheUsage", "TtftSecondsSum", "ItlSecondsSum") else "None"}
            for name, value in sorted(values.items())]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as payload:
        json.dump(data, payload)
        payload.flush()
        aws("cloudwatch", "put-metric-data", "--region", region, "--namespace", NAMESPACE,
            "--metric-data", f"file://{payload.name}")
    print(f"published {', '.join(f'{k}={v:g}' for k, v in sorted(values.items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
