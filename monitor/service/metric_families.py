"""The monitor's metric families: each one's name, help, labels and buckets, on the
registry it is given (never the global one); every label value comes from a closed set.
Their labelled children per layer: :mod:`monitor.service.layer_series`; what the
service reports through: :mod:`monitor.service.exporter`."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from monitor.core.join import MISSING
from monitor.core.outcome import PENDING as _PENDING
from monitor.errors import RejectReason
from monitor.protocol.schema import OUTCOMES as OUTCOME_WORDS
from monitor.service.label_guard import LabelGuard

UNIT_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DIVERSITY_BUCKETS = (0.02, 0.05, *UNIT_BUCKETS[:-1], 1.0)
EFFECTIVE_HEAD_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 16, 32)
HEAD_BUCKETS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
PROCESSING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
OUTCOMES = (*OUTCOME_WORDS, MISSING)
PENDING = _PENDING.result


class MetricFamilies:
    """Every metric family of the monitor on one registry (with the label guard that
    bounds their model and revision values)."""

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
