"""Builds the Grafana dashboards of the attention trace monitor as JSON files, with
Grafana's own typed builders (``grafana-foundation-sdk``, the release for Grafana 11):

    python dashboards/build.py          # rewrites dashboards/*.json

The JSON is committed; tests/alerting checks it equals what this script builds, that
every panel has a unit, a description and a query on a real metric, and that every
query returns data from a real Prometheus scraping a real monitor. Panels link to the
runbooks of their alerts and to the monitor's triage pages (``$monitor``: the URL at
which browsers reach a monitor instance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DynamicConfigValue,
    GridPos,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

HERE = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SELECTOR = 'model=~"$model",revision=~"$revision",layer=~"$layer"'
RUNBOOKS = "https://github.com/attention-monitor/attention-monitor/blob/main/alerts/runbooks/"
#: where browsers reach a monitor instance (its /triage/ pages); a dashboard variable
MONITOR_URL = "http://localhost:9464"
TRIAGE_INDEX = "${monitor}/triage/"
TRIAGE_LAYER = "${monitor}/triage/layer?model=${model}&revision=${revision}&layer=${layer}"
#: a data link from a series that carries model, revision and layer labels to its layer's page
TRIAGE_SERIES = ("${monitor}/triage/layer?model=${__field.labels.model}&revision=${__field.labels.revision}"
                 "&layer=${__field.labels.layer}")


def link(title: str, url: str) -> db.DashboardLink:
    return db.DashboardLink(title).url(url).target_blank(True)


def runbook(alert: str) -> db.DashboardLink:
    return link(f"Runbook: {alert}", f"{RUNBOOKS}{alert}.md")


def rate_ratio(metric: str, by: str, selector: str = SELECTOR) -> str:
    """Mean of a histogram's observations: rate of its sum over rate of its count."""
    return (f"sum by ({by}) (rate({metric}_sum{{{selector}}}[$__rate_interval]))\n  /\n"
            f"sum by ({by}) (rate({metric}_count{{{selector}}}[$__rate_interval]))")


def panel(title: str, description: str, expr: str | list[tuple[str, str]], unit: str, legend: str = "", *, x: int,
          y: int, w: int = 12, h: int = 8, kind: str = "timeseries", minimum: float | None = None,
          maximum: float | None = None, links: tuple[db.DashboardLink, ...] = (), series_links: bool = False
          ) -> Any:
    """A panel of Prometheus queries; ``links`` are panel links, ``series_links`` adds a
    data link from each series to its layer's triage page."""
    queries = [(expr, legend)] if isinstance(expr, str) else expr
    built: Any = (timeseries.Panel() if kind == "timeseries" else stat.Panel())
    built = (built.title(title).description(description).datasource(DATASOURCE).unit(unit)
             .grid_pos(GridPos(x=x, y=y, w=w, h=h)))
    if kind == "timeseries":
        built = built.legend(VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                             .placement(LegendPlacement.BOTTOM))
    if minimum is not None:
        built = built.min(minimum)
    if maximum is not None:
        built = built.max(maximum)
    for n, (query, legend_format) in enumerate(queries):
        built = built.with_target(prometheus.Dataquery().expr(query).legend_format(legend_format)
                                  .ref_id(chr(ord("A") + n)).datasource(DATASOURCE))
    if links:
        built = built.links(list(links))
    if series_links:
        built = built.data_links([link("Triage page of ${__field.labels.model} ${__field.labels.revision} layer "
                                       "${__field.labels.layer}", TRIAGE_SERIES)])
    return built


#: the two-sided 95 % normal quantile and its square, for Wilson intervals in PromQL
Z, Z2 = "1.959963984540054", "3.8414588206941254"


def outcome_counts(outcome: str, selector: str, window: str = "1h") -> str:
    """A revision's traces with that outcome over ``window``, per layer averaged over its
    layers (each request counts once a layer, so the average is about its requests)."""
    return (f"avg by (model, revision) (sum by (model, revision, layer) "
            f"(increase(attention_trace_outcomes_total{{outcome=~\"{outcome}\",{selector}}}[{window}])))")


def wilson(failures: str, joined: str, bound: str) -> str:
    """PromQL of the Wilson score 95 % interval's ``low``, ``high`` bound or its centre
    (``rate``: the failure rate itself) of ``failures`` among ``joined``."""
    p, n = f"({failures}) / ({joined})", f"({joined})"
    if bound == "rate":
        return p
    centre = f"({p} + {Z2} / (2 * {n})) / (1 + {Z2} / {n})"
    half = f"{Z} * sqrt({p} * (1 - {p}) / {n} + {Z2} / (4 * {n} ^ 2)) / (1 + {Z2} / {n})"
    return f"{centre} {'-' if bound == 'low' else '+'} {half}"


def judged_against(expr: str) -> str:
    """``expr`` (by model, revision) of each selected revision's *reference*: the revision
    whose reference judges it (``attention_reference_judge``), as a series of the selected
    revision with a ``reference`` label."""
    return ('max by (model, revision, reference) (attention_reference_judge{model=~"$model",revision=~"$revision"})'
            '\n  * on (model, reference) group_left\n'
            f'label_replace({expr}, "reference", "$1", "revision", "(.*)")')


def failure_rate_against_reference() -> Any:
    """The revision's failure rate against its judging reference revision's, with intervals."""
    mine = 'model=~"$model",revision=~"$revision",layer=~"$layer"'
    theirs = 'model=~"$model",layer=~"$layer"'
    queries = []
    for bound, suffix in (("rate", ""), ("low", " 95 % low"), ("high", " 95 % high")):
        queries.append((wilson(outcome_counts("failure", mine), outcome_counts("success|failure", mine), bound),
                        "{{revision}}" + suffix))
    for bound, suffix in (("rate", ""), ("low", " 95 % low"), ("high", " 95 % high")):
        queries.append((judged_against(wilson(outcome_counts("failure", theirs),
                                              outcome_counts("success|failure", theirs), bound)),
                        "reference of {{revision}}: {{reference}}" + suffix))
    built = panel(
        "Failure rate against the reference revision",
        "Did this revision hurt users? The share of its requests that failed over the last hour (outcome failure; "
        "late outcomes count when they come), against the revision whose reference judges it (a canary's pin; a "
        "revision that judges itself is its own reference), with 95 % Wilson intervals (dashed). Per-layer counts "
        "averaged over the selected layers, about one per request. For a fault of the whole revision this is the "
        "contrast that shows harm; the anomalous traces' outcomes (above, and on the triage page) answer whether "
        "anomalous traces fail more within a revision. Correlational: traffic mix moves it too.",
        queries, "percentunit", x=0, y=32, w=24, h=9, minimum=0, maximum=1,
        links=(link("Triage page of this layer", TRIAGE_LAYER),))
    return built.override_by_regexp(".* 95 % (low|high)$", [
        DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [6, 4]}),
        DynamicConfigValue(id_val="custom.lineWidth", value=1)])


def variable(name: str, query: str, label: str) -> db.QueryVariable:
    return (db.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).multi(True).all_value(".*")
            .current(VariableOption(text="All", value="$__all")).sort(VariableSort.ALPHABETICAL_ASC))


def dashboard(uid: str, title: str, description: str, panels: list[Any], with_layers: bool = True) -> Any:
    built = (db.Dashboard(title).uid(uid).description(description).tags(["attention-monitor"]).editable()
             .timezone("").refresh("30s").time("now-6h", "now")
             .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(variable("model", "label_values(attention_traces_total, model)", "Model"))
             .with_variable(variable("revision", 'label_values(attention_traces_total{model=~"$model"}, revision)',
                                     "Revision")))
    if with_layers:
        built = built.with_variable(variable(
            "layer", 'label_values(attention_traces_total{model=~"$model",revision=~"$revision"}, layer)', "Layer"))
    built = built.with_variable(db.TextBoxVariable("monitor").label("Monitor URL").default_value(MONITOR_URL)
                                .description("Where your browser reaches a monitor instance, for its triage pages"))
    built = built.link(link("Triage: incidents", TRIAGE_INDEX))
    for i, p in enumerate(panels, start=1):
        built = built.with_panel(p.id(i))
    return built


POLICY = ("Anomalies are prompts for investigation, not pruning commands; head existence does not establish "
          "specialization (that needs task metrics plus controlled head ablation).")


def fleet() -> Any:
    sel = 'model=~"$model",revision=~"$revision"'
    return dashboard("attention-fleet", "Attention — fleet overview", "Every model revision at a glance. " + POLICY, [
        panel("Traces processed", "Verified traces measured per second, by model revision.",
              f"sum by (model, revision) (rate(attention_traces_total{{{sel}}}[$__rate_interval]))", "ops",
              "{{model}} {{revision}}", x=0, y=0),
        panel("Anomalies by kind", "Anomalies raised per second, by kind. " + POLICY,
              f"sum by (kind) (rate(attention_anomalies_total{{{sel}}}[$__rate_interval]))", "ops", "{{kind}}",
              x=12, y=0),
        panel("Open incidents", "1 while an incident is open on a layer (diversity: its heads became alike; "
              "head: some heads attend unlike their reference); the alerts page on these. Click a series for the "
              "layer's triage page. " + POLICY,
              f"max by (model, revision, layer, family) (attention_incident_open{{{sel}}})", "none",
              "{{model}} {{revision}} layer {{layer}} {{family}}", x=0, y=8, minimum=0, maximum=1,
              links=(link("Triage: incidents", TRIAGE_INDEX), runbook("AttentionLowHeadDiversity"),
                     runbook("AttentionHeadPatternShift")), series_links=True),
        panel("Low-diversity share per layer", "Share of a layer's traces flagged low_diversity over 10 minutes "
              "(evidence; the alert pages on the incident).",
              f'model_revision_layer_kind:attention_anomaly_ratio:rate10m{{kind="low_diversity",{sel}}}',
              "percentunit", "{{model}} {{revision}} layer {{layer}}", x=0, y=24, minimum=0, series_links=True),
        panel("Mean head diversity", "1 − mean pairwise head similarity, averaged over layers and traces, by "
              "model revision. Lower: heads attend more alike.", rate_ratio("attention_layer_diversity",
                                                                            "model, revision", sel),
              "percentunit", "{{model}} {{revision}}", x=12, y=8, minimum=0, maximum=1),
        panel("Failure-rate lift of anomalous traces", "Failure rate among anomalous traces over the layer's "
              "failure rate, last hour (alert above 1.5 with at least 50 joined anomalous traces). An "
              "association, not a cause.",
              "model_revision_layer_kind:attention_anomaly_failure_ratio:1h\n  / ignoring (kind) group_left\n"
              "model_revision_layer:attention_trace_failure_ratio:1h", "none",
              "{{model}} {{revision}} layer {{layer}} {{kind}}", x=0, y=16, minimum=0,
              links=(runbook("AttentionAnomalyOutcomeAssociation"),), series_links=True),
        panel("Outcomes of joined traces", "Joined traces per second by task outcome (missing: none within the "
              "join TTL).", f"sum by (outcome) (rate(attention_trace_outcomes_total{{{sel}}}[$__rate_interval]))",
              "ops", "{{outcome}}", x=12, y=16),
    ], with_layers=False)


def drilldown() -> Any:
    head_note = " Per-head series need the monitor's detail_level=head."
    return dashboard("attention-drilldown", "Attention — model drill-down",
                     "One model revision and layer: per-head entropy, concentration and sink share, layer "
                     "diversity, anomalies and outcomes. " + POLICY, [
        panel("Layer head diversity", "Mean over traces of 1 − mean pairwise Bhattacharyya similarity of the "
              "layer's heads.", rate_ratio("attention_layer_diversity", "model, revision, layer"), "percentunit",
              "{{revision}} layer {{layer}}", x=0, y=0, minimum=0, maximum=1,
              links=(link("Triage page of this layer", TRIAGE_LAYER), runbook("AttentionLowHeadDiversity")),
              series_links=True),
        panel("Effective heads", "Participation ratio H²/‖S‖² of the head similarity matrix: 1 when every head "
              "attends alike, H when all differ.", rate_ratio("attention_layer_effective_heads",
                                                             "model, revision, layer"), "none",
              "{{revision}} layer {{layer}}", x=12, y=0, minimum=1),
        panel("Per-head entropy", "Normalised attention entropy of each head (0: one key, 1: uniform)." + head_note,
              rate_ratio("attention_head_entropy", "head"), "percentunit", "{{head}}", x=0, y=8, w=8,
              minimum=0, maximum=1, links=(link("Triage page of this layer", TRIAGE_LAYER),
                                           runbook("AttentionHeadPatternShift"))),
        panel("Per-head concentration", "Mean row maximum of each head (near 1: near one-hot; healthy for some "
              "heads)." + head_note, rate_ratio("attention_head_concentration", "head"), "percentunit", "{{head}}",
              x=8, y=8, w=8, minimum=0, maximum=1),
        panel("Per-head sink share", "Mean weight each head puts on the first key (attention sinks are often "
              "healthy)." + head_note, rate_ratio("attention_head_sink_share", "head"), "percentunit", "{{head}}",
              x=16, y=8, w=8, minimum=0, maximum=1),
        panel("Layer entropy, concentration, sink share", "Means over the layer's heads, per trace.",
              [(rate_ratio(f"attention_layer_{m}", "layer"), f"{m} layer {{{{layer}}}}")
               for m in ("entropy", "concentration", "sink_share")], "percentunit", x=0, y=16, minimum=0, maximum=1),
        panel("Anomalies by kind", "Anomalies raised per second for this layer. " + POLICY,
              f"sum by (kind) (rate(attention_anomalies_total{{{SELECTOR}}}[$__rate_interval]))", "ops", "{{kind}}",
              x=12, y=16, links=(link("Triage page of this layer", TRIAGE_LAYER),)),
        panel("Outcomes of anomalous traces", "Joined anomalous traces per second, by task outcome.",
              f"sum by (kind, outcome) (rate(attention_anomaly_outcomes_total{{{SELECTOR}}}[$__rate_interval]))",
              "ops", "{{kind}} {{outcome}}", x=0, y=24, w=24),
        failure_rate_against_reference(),
    ])


def service() -> Any:
    return dashboard("attention-service", "Attention — monitor service health",
                     "The monitor itself: consumption, rejections, latency, lag, join state.", [
        panel("Up", "Whether Prometheus can scrape each monitor instance.", 'up{job="attention-monitor"}', "none",
              "{{instance}}", x=0, y=0, w=6, kind="stat", links=(runbook("AttentionMonitorDown"),)),
        panel("Traces consumed", "Trace records read from Kafka per second.",
              "sum(rate(attention_monitor_traces_consumed_total[$__rate_interval]))", "ops", "consumed",
              x=6, y=0, w=9),
        panel("Rejections by reason", "Trace records refused per second, by reason (dead-lettered without "
              "weights).", "sum by (reason) (rate(attention_monitor_traces_rejected_total[$__rate_interval]))",
              "ops", "{{reason}}", x=15, y=0, w=9,
              links=(runbook("AttentionRejectionsHigh"), runbook("AttentionSignatureOrScopeRejections"))),
        panel("Processing time p99", "99th percentile of the time to verify and measure one trace.",
              "histogram_quantile(0.99, sum by (le) (rate(attention_monitor_processing_seconds_bucket"
              "[$__rate_interval])))", "s", "p99", x=0, y=8, w=8),
        panel("Consumer lag", "Trace records behind the end of the assigned partitions.",
              "sum(attention_monitor_consumer_lag_records)", "short", "lag", x=8, y=8, w=8,
              links=(runbook("AttentionConsumerLagHigh"),)),
        panel("Time since last trace", "Seconds since any instance processed a verified trace.",
              "time() - max(attention_monitor_last_trace_timestamp_seconds)", "s", "age", x=16, y=8, w=8,
              links=(runbook("AttentionTracesAbsent"), runbook("AttentionTracesStalled"))),
        panel("Join buffer", "Traces and outcomes waiting to be joined.", "sum(attention_monitor_join_entries)",
              "short", "entries", x=0, y=16, w=8),
        panel("Join evictions", "Join entries evicted per second, by cause (ttl: no outcome in time).",
              "sum by (reason) (rate(attention_monitor_join_evictions_total[$__rate_interval]))", "ops",
              "{{reason}}", x=8, y=16, w=8),
        panel("Label overflow", "Traces labelled model=\"other\" in the last hour (label cap reached).",
              "sum(increase(attention_monitor_label_overflow_total[1h]))", "short", "overflow", x=16, y=16, w=8,
              links=(runbook("AttentionLabelOverflow"),)),
    ], with_layers=False)


DASHBOARDS = {"fleet.json": fleet, "drilldown.json": drilldown, "service.json": service}


def render(build: Any) -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    for name, build in DASHBOARDS.items():
        (HERE / name).write_text(render(build))
        print(f"wrote dashboards/{name}")


if __name__ == "__main__":
    main()
