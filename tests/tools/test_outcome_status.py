"""``status``'s outcomes: each revision's failure rate against its judging reference's,
added up over instances, from real exporters' /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from monitor.core.verdict import Verdict
from monitor.service.exporter import MonitorMetrics
from monitor.tools.status import Status, from_metrics, report
from monitor.triage.outcomes import wilson


def instance(canary: tuple[int, int, int], healthy: tuple[int, int]) -> str:
    """One instance's /metrics: two layers of each revision, canary pinned to healthy."""
    metrics = MonitorMetrics(CollectorRegistry())
    for layer in (0, 1):
        for revision, (failed, succeeded, *pending) in (("canary", canary), ("healthy", healthy)):
            series = metrics.layer("m", revision, layer)
            for _ in range(failed):
                series.observe_joined("failure")
            for _ in range(succeeded):
                series.observe_joined("success")
            for _ in range(pending[0] if pending else 0):
                series.pending.inc()
            series.observe_verdict(Verdict([], "healthy", revision == "healthy", 200, True))
    return generate_latest(metrics.registry).decode()


def test_status_adds_up_the_instances_and_compares_a_canary_with_its_reference():
    status = Status()
    from_metrics(status, instance((30, 50, 3), (10, 100)))
    from_metrics(status, instance((27, 53, 2), (16, 90)))
    text = report(status, 200)
    low, high = wilson(57, 160)
    assert f"m canary: 57/160 failed = 0.356 (95 % {low:.3f} to {high:.3f}); 5 awaiting an outcome\n" \
        "    against its reference healthy: 26/216 failed = 0.120 (95 % 0.083 to 0.171); difference +0.236" in text
    assert "m healthy: 26/216 failed" in text and "its reference" not in text.split("m healthy:")[1]
