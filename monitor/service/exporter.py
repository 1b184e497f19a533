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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from monitor.core.detect import KINDS, Verdict
from monitor.core.incidents import FAMILIES
from monitor.core.join import MISSING
from monitor.core.metrics import HeadMetrics
from monitor.core.outcome import PENDING as _PENDING
from monitor.errors import RejectReason
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.schema import OUTCOMES as OUTCOME_WORDS

UNIT_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DIVERSITY_BUCKETS = (0.02, 0.05, *UNIT_BUCKETS[:-1], 1.0)
EFFECTIVE_HEAD_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 16, 32)
HEAD_BUCKETS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
PROCESSING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
OUTCOMES = (*OUTCOME_WORDS, MISSING)
PENDING = _PENDING.result
OTHER = "other"


@dataclass
class LabelGuard:
    """Bounds the model/revision label values."""

    max_pairs: int
    allowlist: frozenset[str] = frozenset()
    _seen: set[tuple[str, str]] = field(default_factory=set)

    def labels(self, model: str, revision: str) -> tuple[str, str] | None:
        """The label pair to use, or None when it overflows into ``other``."""
        if self.allowlist:
            return (model, revision) if model in self.allowlist and self._admit(model, revision) else None
        return (model, revision) if self._admit(model, revision) else None

    def _admit(self, model: str, revision: str) -> bool:
        pair = (model, revision)
        if pair in self._seen:
            return True
        if len(self._seen) >= self.max_pairs:
            return False
        self._seen.add(pair)
        return True


class MonitorMetrics:
    """The monitor's metrics on one registry; the pipeline reports through it."""

    def __init__(self, registry: CollectorRegistry, *, detail_level: str = "layer", max_model_revisions: int = 20,
                 model_allowlist: Iterable[str] = (), max_layer_series: int = 512):
        self.registry = registry
        self.per_head = detail_level == "head"
        self.guard = LabelGuard(max_model_revisions, frozenset(model_allowlist))
        self.max_layer_series = max_layer_series
        layer = ["model", "revision", "layer"]
        r = registry
        self.traces = Counter("attention_traces", "Verified traces processed, per model revision and layer.", layer,
                              registry=r)
        self.diversity = Histogram("attention_layer_diversity", "Layer head diversity: 1 - mean pairwise head "
                                   "similarity (Bhattacharyya), per trace.", layer, buckets=DIVERSITY_BUCKETS,
                                   registry=r)
        self.effective_heads = Histogram("attention_layer_effective_heads", "Participation ratio of the head "
                                         "similarity matrix, per trace (1 = all heads alike, H = all distinct).",
                                         layer, buckets=EFFECTIVE_HEAD_BUCKETS, registry=r)
        self.layer_metric = {
            name: Histogram(f"attention_layer_{name}", f"Mean over heads of the per-head {text}, per trace.", layer,
                            buckets=UNIT_BUCKETS, registry=r)
            for name, text in (("entropy", "normalised entropy"), ("concentration", "mean row maximum"),
                               ("sink_share", "mean weight on the first key"))
        }
        #: only for layers whose traces carry them (a learned sink, decoding rows)
        self.generation_metric = {
            name: Histogram(f"attention_layer_{metric}", f"Mean over heads of the per-head {text}, per trace that "
                            "has it.", layer, buckets=UNIT_BUCKETS, registry=r)
            for name, metric, text in (("prompt_mass", "prompt_mass", "share of decoding rows' attention on the "
                                        "prompt (lookback ratio)"),
                                       ("learned_sink", "learned_sink_mass", "mass on the learned attention sink"))
        }
        self.head_metric = {
            name: Histogram(f"attention_head_{name}", f"Per-head {name.replace('_', ' ')}, per trace "
                            "(detail_level=head).", [*layer, "head"], buckets=HEAD_BUCKETS, registry=r)
            for name in ("entropy", "concentration", "sink_share")
        } if self.per_head else {}
        self.anomalies = Counter("attention_anomalies", "Anomalies raised (prompts for investigation, never pruning "
                                 "commands).", [*layer, "kind"], registry=r)
        self.trace_outcomes = Counter("attention_trace_outcomes", "Traces by task outcome, counted when it is "
                                      "known: joined, or come late within OUTCOME_WINDOW_S (missing: none by "
                                      "then).", [*layer, "outcome"], registry=r)
        self.trace_outcomes_pending = Gauge("attention_trace_outcomes_pending", "Traces whose join window closed "
                                            "without an outcome, still awaiting one (within OUTCOME_WINDOW_S).",
                                            layer, registry=r)
        self.anomaly_outcomes = Counter("attention_anomaly_outcomes", "Joined anomalous traces by anomaly kind and "
                                        "task outcome.", [*layer, "kind", "outcome"], registry=r)
        s = "attention_monitor_"
        self.consumed = Counter(f"{s}traces_consumed", "Trace records read from Kafka and accounted for.",
                                registry=r)
        self.polled = Counter(f"{s}records_polled", "Trace and outcome records polled and handed to the pipeline "
                              "(some may still be in the service's hands).", registry=r)
        self.outcomes_consumed = Counter(f"{s}outcomes_consumed", "Outcome records read from Kafka.", registry=r)
        self.rejected = Counter(f"{s}traces_rejected", "Trace records refused, by reason.", ["reason"], registry=r)
        self.outcomes_rejected = Counter(f"{s}outcomes_rejected", "Outcome records refused, by reason.", ["reason"],
                                         registry=r)
        self.duplicates = Counter(f"{s}duplicates", "Records skipped as already processed (by trace id).",
                                  registry=r)
        self.processing = Histogram(f"{s}processing_seconds", "Time to verify and measure one trace.",
                                    buckets=PROCESSING_BUCKETS, registry=r)
        self.lag = Gauge(f"{s}consumer_lag_records", "Records behind the end of the assigned trace partitions.",
                         registry=r)
        self.join_entries = Gauge(f"{s}join_entries", "Traces and outcomes waiting in the join buffer.", registry=r)
        self.join_evictions = Counter(f"{s}join_evictions", "Join buffer entries evicted, by reason (ttl, capacity).",
                                      ["reason"], registry=r)
        self.outcomes_late = Counter(f"{s}outcomes_late", "Outcomes that came after their request's join window "
                                     "and were attributed to it (within OUTCOME_WINDOW_S).", registry=r)
        self.outcomes_unmatched = Counter(f"{s}outcomes_unmatched", "Outcome records that met no trace: their "
                                          "request was not sampled, its outcome was counted already, or it came "
                                          "after OUTCOME_WINDOW_S.", registry=r)
        self.pending_requests = Gauge(f"{s}pending_requests", "Requests awaiting their outcome past the join window "
                                      "(at most OUTCOME_MAX_REQUESTS).", registry=r)
        self.pending_evictions = Counter(f"{s}pending_evictions", "Requests whose outcome never came, by reason "
                                         "(window: OUTCOME_WINDOW_S closed; capacity: OUTCOME_MAX_REQUESTS).",
                                         ["reason"], registry=r)
        self.reference_traces = Gauge("attention_reference_traces", "Traces learnt by the reference that judges "
                                      "the layer (or is learning to).", layer, registry=r)
        self.reference_ready = Gauge("attention_reference_ready", "1 when a ready reference judges the layer's "
                                     "traces, 0 while none does.", layer, registry=r)
        self.reference_judge = Gauge("attention_reference_judge", "1 for the revision whose reference judges the "
                                     "layer (label reference).", [*layer, "reference"], registry=r)
        self.unjudged = Counter("attention_traces_unjudged", "Traces no reference judged, by reason (learning: "
                                "they teach their revision's reference; no_reference: pinned to a reference not "
                                "ready).", [*layer, "reason"], registry=r)
        self.incident_open = Gauge("attention_incident_open", "1 while an incident of the family is open on the "
                                   "layer (prompts for investigation, never pruning commands).", [*layer, "family"],
                                   registry=r)
        self.incidents = Counter("attention_incidents", "Incidents opened, by family.", [*layer, "family"],
                                 registry=r)
        self.incident_heads = Gauge("attention_incident_heads", "Heads an open incident of the family names on the "
                                    "layer, each with how many of its traces' findings name it (as its latest "
                                    "incident record has them).", [*layer, "family", "head"], registry=r)
        self._registry = r
        self._last_trace: Gauge | None = None  #: created by the first trace: absent until then
        self.overflow = Counter(f"{s}label_overflow", "Traces whose model/revision labels were replaced by 'other'.",
                                registry=r)
        self.references_evicted = Counter(f"{s}references_evicted", "References dropped beyond MAX_REFERENCES "
                                          "(the one unused longest).", registry=r)
        self.layer_overflow = Counter(f"{s}layer_overflow", "Traces whose layer label was replaced by 'other' "
                                      "(beyond MAX_LAYER_SERIES layers across model revisions).", registry=r)
        self.contracts = Gauge(f"{s}contracts", "Model contracts known from the contracts topic.", registry=r)
        self.contracts_refused = Counter(f"{s}contracts_refused", "Contract records refused, by reason (unsigned, "
                                         "unknown_key, not_allowed, bad_signature, id_mismatch, malformed).",
                                         ["reason"], registry=r)
        self.contracts_evicted = Counter(f"{s}contracts_evicted", "Contracts dropped beyond MAX_CONTRACTS.",
                                         registry=r)
        self.pin_unmatched = Gauge(f"{s}pin_unmatched", "1 while a pin names a model revision no known contract "
                                   "has (its traces may carry another revision, which then goes unpinned).",
                                   ["model", "revision", "reference"], registry=r)
        self._contract_counts: dict[str, int] = {}
        for reason in ("unsigned", "unknown_key", "not_allowed", "bad_signature", "id_mismatch", "malformed"):
            self.contracts_refused.labels(reason)
        self.commits = Counter(f"{s}commits", "Transactions committing a batch's outputs with its offsets.",
                               registry=r)
        self.output_failures = Counter(f"{s}output_failures", "Output transactions that failed, by reason "
                                       "(aborted: sent again; stalled: waiting for the broker beyond the delivery "
                                       "timeout; group_moved; fenced).", ["reason"], registry=r)
        for reason in ("aborted", "stalled", "group_moved", "fenced"):
            self.output_failures.labels(reason)
        self._layers: dict[tuple[tuple[str, str], int | str], LayerSeries] = {}
        self.measuring_processes = Gauge(f"{s}measuring_processes", "Child processes measuring traces (0: a thread "
                                         "of the service's own process).", registry=r)
        self.kafka_client = Info(f"{s}kafka_client", "The client consuming traces (confluent-kafka) and "
                                 "its versions.", registry=r)
        self.triage = Info(f"{s}triage", "Where on-call's browser reaches this instance's /triage/ pages "
                           "(TRIAGE_URL; alerts link there). Absent when not set.", registry=None)
        self.judged_here = Counter(f"{s}observations_judged", "Traces judged by this instance from the "
                                   "observations topic, wherever they were measured.", registry=r)
        self.rebalances = Counter(f"{s}rebalances", "Partition assignment changes (partitions revoked or assigned).",
                                  registry=r)
        for reason in ("ttl", "capacity"):
            self.join_evictions.labels(reason)
        for reason in ("window", "capacity"):
            self.pending_evictions.labels(reason)
        for rejected in RejectReason:  # a closed set: every reason exists from the start, at 0
            self.rejected.labels(rejected.value)
        self.outcomes_rejected.labels(RejectReason.MALFORMED.value)

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


class LayerSeries:
    """The labelled children of one (model, revision, layer), looked up once: observing
    a trace then costs no ``labels()`` call (prometheus_client hashes and locks on each).
    Every series of the layer exists from creation, at zero, so rates exist before the
    first event."""

    def __init__(self, metrics: MonitorMetrics, labels: tuple[str, str], layer: int | str):
        self.labels = labels
        key = (*labels, str(layer))
        self.traces = metrics.traces.labels(*key)
        self.diversity = metrics.diversity.labels(*key)
        self.effective_heads = metrics.effective_heads.labels(*key)
        self.layer_metric = {name: family.labels(*key) for name, family in metrics.layer_metric.items()}
        self._generation: dict[str, Any] = {}  #: created by the first trace that has the metric
        self._head_families = metrics.head_metric
        self._key = key
        self._heads: dict[str, list[tuple[str, Any]]] = {}
        self.anomalies = {kind: metrics.anomalies.labels(*key, kind) for kind in KINDS}
        self.trace_outcomes = {outcome: metrics.trace_outcomes.labels(*key, outcome) for outcome in OUTCOMES}
        self.pending = metrics.trace_outcomes_pending.labels(*key)
        #: the layer's traces judged here by their outcome (``pending`` while it may still
        #: come), since start, as anomaly records carry them (the one tally: its judge
        #: judges all the fleet's traces); late outcomes move a trace from ``pending``
        self.outcomes = dict.fromkeys((*OUTCOMES, PENDING), 0)
        self.anomaly_outcomes = {(kind, outcome): metrics.anomaly_outcomes.labels(*key, kind, outcome)
                                 for kind in KINDS for outcome in OUTCOMES}
        self.reference_traces = metrics.reference_traces.labels(*key)
        self.reference_ready = metrics.reference_ready.labels(*key)
        self.unjudged = {reason: metrics.unjudged.labels(*key, reason) for reason in ("learning", "no_reference")}
        self.incident_open = {family: metrics.incident_open.labels(*key, family) for family in FAMILIES}
        self.incidents = {family: metrics.incidents.labels(*key, family) for family in FAMILIES}
        self._incident_heads: dict[str, set[str]] = {}
        self._metrics = metrics
        self._judge: str | None = None

    def observe_trace(self, heads: Sequence[str], metrics: HeadMetrics) -> None:
        entropy, concentration = metrics.entropy.tolist(), metrics.concentration.tolist()
        sink_share = metrics.sink_share.tolist()
        diversity, effective_heads = float(metrics.diversity), float(metrics.effective_heads)
        self.traces.inc()
        if diversity == diversity:  # NaN (a single head) is not observed
            self.diversity.observe(diversity)
        if effective_heads == effective_heads:
            self.effective_heads.observe(effective_heads)
        values = {"entropy": entropy, "concentration": concentration, "sink_share": sink_share}
        for name, per_head in values.items():
            finite = [v for v in per_head if v == v]
            if finite:
                self.layer_metric[name].observe(sum(finite) / len(finite))
        for name in ("prompt_mass", "learned_sink"):
            array = getattr(metrics, name)
            finite = [] if array is None else [v for v in array.tolist() if v == v]
            if finite:
                child = self._generation.get(name)
                if child is None:
                    child = self._generation[name] = self._metrics.generation_metric[name].labels(*self._key)
                child.observe(sum(finite) / len(finite))
        if self._head_families:
            for i, children in enumerate(self._head_children(heads)):
                for name, child in children:
                    value = values[name][i]
                    if value == value:
                        child.observe(value)

    def _head_children(self, heads: Sequence[str]) -> list[list[tuple[str, Any]]]:
        out = []
        for head in heads:
            children = self._heads.get(head)
            if children is None:
                children = self._heads[head] = [(name, family.labels(*self._key, head))
                                                for name, family in self._head_families.items()]
            out.append(children)
        return out

    def incident_heads(self, family: str, counts: dict[str, int]) -> None:
        """``attention_incident_heads`` of the layer's incident of ``family``: the heads
        it names and the traces naming each (none: it closed)."""
        gauge = self._metrics.incident_heads
        for head in self._incident_heads.get(family, set()) - counts.keys():
            gauge.remove(*self._key, family, head)
        for head, n in counts.items():
            gauge.labels(*self._key, family, head).set(n)
        self._incident_heads[family] = set(counts)

    def observe_anomaly(self, kind: str) -> None:
        self.anomalies[kind].inc()

    def observe_verdict(self, verdict: Verdict) -> None:
        """Readiness: how many traces the judging reference holds, whether it judges, by
        which revision; and the traces nothing judged."""
        self.reference_traces.set(verdict.reference_traces)
        self.reference_ready.set(1 if verdict.ready else 0)
        if verdict.judged_by is None:
            self.unjudged["learning" if verdict.learning else "no_reference"].inc()
            return
        judge = self._metrics.guard.labels(self.labels[0], verdict.judged_by)
        value = OTHER if judge is None else judge[1]
        if value != self._judge:
            if self._judge is not None:
                self._metrics.reference_judge.remove(*self._key, self._judge)
            self._metrics.reference_judge.labels(*self._key, value).set(1)
            self._judge = value

    def observe_joined(self, outcome: str) -> None:
        """A trace measured here joined to its outcome (``attention_trace_outcomes``)."""
        self.trace_outcomes[outcome].inc()

    def observe_judged(self, outcome: str, kinds: Iterable[str]) -> None:
        """A trace judged here, with the outcome it was joined to and its anomalies' kinds
        (the tally, and ``attention_anomaly_outcomes`` once the outcome is known)."""
        self.outcomes[outcome] += 1
        if outcome != PENDING:
            for kind in set(kinds):
                self.anomaly_outcomes[(kind, outcome)].inc()

    def observe_late(self, outcome: str, kinds: Iterable[str]) -> None:
        """A trace judged here ``pending`` got its outcome late (or ``missing``): the
        tally moves it, ``attention_anomaly_outcomes`` counts it for ``kinds``."""
        if self.outcomes[PENDING] > 0:  # judged before this judge started: not in its tally
            self.outcomes[PENDING] -= 1
        self.observe_judged(outcome, kinds)
