"""What the monitor exports to Prometheus. Every metric lives on the registry it is
given (never the global one), and every label value comes from a closed set.

Domain metrics (prefix ``attention_``), labels ``model``, ``revision``, ``layer`` and,
at ``detail_level=head``, ``head``; anomaly and outcome counters add ``kind`` and
``outcome``, incidents ``family``, unjudged traces ``reason``, and the judging revision
is ``reference``. Service metrics (prefix ``attention_monitor_``) carry at most
``reason``.

Bounded labels: model and revision values pass a :class:`LabelGuard` — an allow-list
of model ids when configured, otherwise the first ``max_model_revisions`` distinct
(model, revision) pairs — and anything else becomes ``other``/``other`` and counts in
``attention_monitor_label_overflow_total``. Layers and heads come from verified model
contracts. Series per model revision with ``L`` traced layers of ``H`` heads (see
``docs/metrics.md``; ``_created`` series disabled): ``96·L`` at ``layer`` detail, plus
``27·L·H`` at ``head`` detail; and at most ``H`` heads of each open incident.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Gauge

from monitor.protocol.model_contract import ContractTable
from monitor.service.label_guard import OTHER, LabelGuard
from monitor.service.layer_series import LayerSeries
from monitor.service.metric_families import MetricFamilies

__all__ = ["OTHER", "LabelGuard", "LayerSeries", "MonitorMetrics"]


class MonitorMetrics(MetricFamilies):
    """The monitor's metrics on one registry (:mod:`monitor.service.metric_families`);
    the pipeline reports through it."""

    def __init__(self, registry: CollectorRegistry, *, detail_level: str = "layer", max_model_revisions: int = 20,
                 model_allowlist: Iterable[str] = (), max_layer_series: int = 512):
        super().__init__(registry, detail_level=detail_level, max_model_revisions=max_model_revisions,
                         model_allowlist=model_allowlist, max_layer_series=max_layer_series)
        self._layers: dict[tuple[tuple[str, str], int | str], LayerSeries] = {}

    def observe_contracts(self, table: ContractTable) -> None:
        """The contract table's size, and what it refused or evicted since last asked."""
        self.contracts.set(len(table))
        for reason, count in [*table.refusals.items(), ("evicted", table.evicted)]:
            new = count - self._contract_counts.get(reason, 0)
            if new > 0:
                (self.contracts_evicted if reason == "evicted" else self.contracts_refused.labels(reason)).inc(new)
                self._contract_counts[reason] = count

    def triage_at(self, url: str) -> None:
        """Export ``attention_monitor_triage_info{url}``: alert annotations link there."""
        self._registry.register(self.triage)
        self.triage.info({"url": url.rstrip("/")})

    def observe_pins(self, began: dict[tuple[str, str], str], ended: dict[tuple[str, str], str]) -> None:
        """Pins whose revision no contract has (see :mod:`monitor.service.pins`): one series
        each while it lasts (pins are few and made by operators)."""
        for (model, revision), reference in ended.items():
            self.pin_unmatched.remove(model, revision, reference)
        for (model, revision), reference in began.items():
            self.pin_unmatched.labels(model, revision, reference).set(1)

    def trace_processed(self, now: float) -> None:
        """Set the last-trace timestamp (the series exists from the first trace on)."""
        if self._last_trace is None:
            self._last_trace = Gauge("attention_monitor_last_trace_timestamp_seconds", "Unix time the last verified "
                                     "trace was processed (absent until the first).", registry=self._registry)
        self._last_trace.set(now)

    def layer(self, model: str, revision: str, layer: int) -> LayerSeries:
        """The series of one model revision's layer (model and revision bounded by the
        guard), created at zero the first time it is asked for."""
        return self.layer_of(self.model_labels(model, revision), layer)

    def layer_of(self, labels: tuple[str, str], layer: int | str) -> LayerSeries:
        """Bounded: beyond ``max_layer_series`` layers, a new one is labelled ``other``."""
        key = (labels, layer)
        series = self._layers.get(key)
        if series is None:
            if len(self._layers) >= self.max_layer_series and layer != OTHER:
                self.layer_overflow.inc()
                return self.layer_of(labels, OTHER)
            series = self._layers[key] = LayerSeries(self, labels, layer)
        return series

    def model_labels(self, model: str, revision: str) -> tuple[str, str]:
        pair = self.guard.labels(model, revision)
        if pair is None:
            self.overflow.inc()
            return OTHER, OTHER
        return pair
