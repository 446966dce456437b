"""What an operator watches: a dashboard of the server's metrics and an alarm on its health, from what
runtime/publish_metrics.py puts into CloudWatch every minute (namespace S4KV, dimension StackName)."""

from __future__ import annotations

from aws_cdk import Aws, Duration, aws_cloudwatch as cloudwatch
from constructs import Construct

from constructs_lib.server_role import METRICS_NAMESPACE


class ServerOperations(Construct):
    def __init__(self, scope: Construct, id: str) -> None:
        super().__init__(scope, id)

        def metric(name: str, statistic: str = "Average", label: str | None = None) -> cloudwatch.Metric:
            return cloudwatch.Metric(namespace=METRICS_NAMESPACE, metric_name=name, statistic=statistic, label=label,
                                     dimensions_map={"StackName": Aws.STACK_NAME}, period=Duration.minutes(1))

        def rate_ratio(label: str, numerator: str, denominator: str) -> cloudwatch.MathExpression:
            return cloudwatch.MathExpression(expression="RATE(n) / RATE(d)", label=label, period=Duration.minutes(1),
                                             using_metrics={"n": metric(numerator, "Maximum"),
                                                            "d": metric(denominator, "Maximum")})

        # Three missing or failed minutes in a row: the server is down, or the instance is gone. No action is
        # attached (add an SNS topic to it); it is created once the instance has signalled it is ready.
        self.health_alarm = cloudwatch.Alarm(
            self, "HealthAlarm", metric=metric("Healthy", "Minimum"), threshold=1, evaluation_periods=3,
            comparison_operator=cloudwatch.ComparisonOperator.LESS_THAN_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.BREACHING,
            alarm_description="S4 KV server: /health not 200 (or no report) for 3 minutes")
        self.dashboard = cloudwatch.Dashboard(self, "Dashboard", widgets=[[
            cloudwatch.GraphWidget(title="Healthy (1 = /health 200)", left=[metric("Healthy", "Minimum")], width=8),
            cloudwatch.GraphWidget(title="KV cache usage (0..1)", left=[metric("KvCacheUsage", "Maximum")], width=8),
            cloudwatch.GraphWidget(title="Requests", left=[metric("RequestsRunning", "Maximum"),
                                                           metric("RequestsWaiting", "Maximum")], width=8),
        ], [
            cloudwatch.GraphWidget(title="Generated tokens/s", width=8, left=[cloudwatch.MathExpression(
                expression="RATE(t)", label="tokens/s", period=Duration.minutes(1),
                using_metrics={"t": metric("GenerationTokens", "Maximum")})]),
            # p50 and p99 at the resolution of vLLM's histogram buckets (runtime/publish_metrics.py), the mean exact
            cloudwatch.GraphWidget(title="Time to first token (s)", width=8,
                                   left=[rate_ratio("mean", "TtftSecondsSum", "TtftSecondsCount"),
                                         metric("TtftSeconds", "p50", "p50"), metric("TtftSeconds", "p99", "p99")]),
            cloudwatch.GraphWidget(title="Inter-token latency (s)", width=8,
                                   left=[rate_ratio("mean", "ItlSecondsSum", "ItlSecondsCount"),
                                         metric("ItlSeconds", "p50", "p50"), metric("ItlSeconds", "p99", "p99")]),
        ]])
