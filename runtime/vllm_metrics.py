"""vLLM's Prometheus histograms as its /metrics page shows them: cumulative counts per bucket bound, and the bucket
that holds a percentile. Read by the serving benchmark (runtime/bench/serve.py) and the endpoint's CloudWatch
publisher (runtime/publish_metrics.py)."""

from __future__ import annotations

import math


def histogram_buckets(metrics_text: str, family: str) -> dict[float, float]:
    """One histogram family's cumulative count per upper bound (``le``; inf last), summed over its label sets (one
    per data-parallel engine); empty where the page has none."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[float, float] = {}
    for parsed in text_string_to_metric_families(metrics_text):
        if parsed.name != family:
            continue
        for sample in parsed.samples:
            if sample.name == f"{family}_bucket":
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return dict(sorted(counts.items()))


def bucket_percentile(counts: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket that holds the q-th percentile of cumulative ``counts`` (inf: beyond the last
    finite bound); None for an empty histogram."""
    total = max(counts.values(), default=0.0)
    if not total > 0:
        return None
    return next(bound for bound, cumulative in sorted(counts.items()) if cumulative >= total * q / 100)


def largest_finite_bound(counts: dict[float, float]) -> float:
    return max((bound for bound in counts if not math.isinf(bound)), default=0.0)
