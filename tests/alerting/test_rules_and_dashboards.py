"""Alert rules, runbooks, Alertmanager routing and dashboards, checked as files and with
promtool/amtool (the real binaries)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from devstack.prometheus import start_alertmanager
from devstack.wait import wait_for
from devstack.webhook import WebhookReceiver
from monitor.core.policy import NOT_PRUNING, SPECIALIZATION

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "attention.rules.yml"
RUNBOOKS = REPO / "alerts" / "runbooks"
ALERTMANAGER = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
ANOMALY_ALERTS = {"AttentionLowHeadDiversity", "AttentionHeadPatternShift", "AttentionAnomalyOutcomeAssociation"}
SEVERITIES = {"critical", "warning", "info"}


def alerts() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


@pytest.mark.prometheus
def test_promtool_checks_and_unit_tests_pass(promtool):
    check = run(promtool, "check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr
    tests = sorted((REPO / "alerts" / "tests").glob("*.test.yml"))
    assert tests
    result = run(promtool, "test", "rules", *map(str, tests))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_just_before_and_after_its_for():
    covered: dict[str, list] = {}
    for path in (REPO / "alerts" / "tests").glob("*.test.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                covered.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    for rule in alerts():
        assert set(covered.get(rule["alert"], [])) == {False, True}, rule["alert"]


def test_alerts_follow_the_house_conventions():
    names = [r["alert"] for r in alerts()]
    assert len(names) == len(set(names)) >= 10
    severities = []
    for rule in alerts():
        name, labels, notes = rule["alert"], rule["labels"], rule["annotations"]
        assert re.fullmatch(r"Attention[A-Z][A-Za-z]+", name), name
        assert labels["severity"] in SEVERITIES, name
        severities.append(labels["severity"])
        assert "for" in rule, name
        assert "{{" not in notes["summary"], f"{name}: the summary must be static"
        assert "{{" in notes["description"], f"{name}: the description must be templated"
        assert notes["runbook_url"].endswith(f"/alerts/runbooks/{name}.md"), name
        assert (RUNBOOKS / f"{name}.md").exists(), name
        if name in ANOMALY_ALERTS:  # the policy's own sentences, word for word
            policy = " ".join(notes["policy"].split())
            assert NOT_PRUNING in policy and SPECIALIZATION in policy, name
    # page only for what is worth waking someone for: the monitor down (silent), and an
    # incident, which opens only on evidence past the false-page budget
    assert {r["alert"] for r in alerts() if r["labels"]["severity"] == "critical"} == {
        "AttentionMonitorDown", "AttentionLowHeadDiversity", "AttentionHeadPatternShift"}


def test_one_runbook_per_alert_with_the_four_sections_and_no_pruning():
    names = {r["alert"] for r in alerts()}
    assert {p.stem for p in RUNBOOKS.glob("*.md")} == names
    for name in names:
        text = (RUNBOOKS / f"{name}.md").read_text()
        assert text.startswith(f"# {name}\n")
        for section in ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation"):
            assert section in text, f"{name}: {section}"
        diagnosis = text.split("## Diagnosis")[1].split("## Mitigation")[0]
        assert re.search(r"`[^`]*(rate|increase|attention_|up\{)[^`]*`", diagnosis), f"{name}: no PromQL"
        mitigation = text.split("## Mitigation")[1].lower()
        for line in mitigation.splitlines():
            if re.search(r"prun|disable heads|mask heads", line):
                assert re.search(r"\bdo not\b|\bnot\b|\bnever\b", line), f"{name}: {line}"
        if name in ANOMALY_ALERTS:
            assert "ablation" in text, f"{name} must point to the evidence a specialization claim needs"


@pytest.mark.prometheus
def test_alertmanager_config_and_routing(amtool):
    check = run(amtool, "check-config", str(ALERTMANAGER))
    assert check.returncode == 0, check.stdout + check.stderr
    for labels, receiver in ((["severity=critical"], "pager"), (["severity=warning"], "tickets"),
                             (["severity=info"], "chat"), (["severity=warning", "team=security"], "security")):
        route = run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels)
        assert route.stdout.strip() == receiver, (labels, route.stdout, route.stderr)
    for name in ("AttentionLowHeadDiversity", "AttentionHeadPatternShift"):
        route = run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}", f"alertname={name}",
                    "severity=critical", "model=m", "revision=r", "layer=2")
        assert route.stdout.strip() == "pager", (name, route.stdout, route.stderr)


def test_alertmanager_names_only_alerts_that_exist_and_groups_a_revisions_pages():
    """An inhibit rule or route naming an alert the rules do not define silences nothing
    and routes nothing, without an error anywhere."""
    config = yaml.safe_load(ALERTMANAGER.read_text())
    names = {r["alert"] for r in alerts()}
    matchers = [m for rule in config["inhibit_rules"] for m in rule["source_matchers"] + rule["target_matchers"]]
    matchers += [m for route in config["route"]["routes"] for m in route.get("matchers", [])]
    named = set()
    for matcher in matchers:
        found = re.fullmatch(r'alertname(=~?)"([^"]+)"', matcher)
        if found:
            named |= set(found.group(2).split("|")) if found.group(1) == "=~" else {found.group(2)}
    assert named and named <= names, sorted(named - names)
    pages = next(r for r in config["route"]["routes"] if any("AttentionLowHeadDiversity" in m for m in r["matchers"]))
    assert pages["group_by"] == ["model", "revision"] and pages["receiver"] == "pager"


def seconds(duration: str) -> float:
    found = re.fullmatch(r"(\d+)(ms|s|m|h)", str(duration))
    assert found, duration
    return int(found[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[found[2]]


def test_a_page_leaves_within_30_s_of_its_evidence_with_the_shipped_configuration():
    """The worst case from the page threshold's crossing (the incident gauge set) to the
    notification: the next scrape of the monitor, the next evaluation of the anomaly rules,
    their `for:`, then the page route's group_wait. The soak measures it end to end."""
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "attention-monitor")
    scrape = seconds(job.get("scrape_interval", prometheus["global"]["scrape_interval"]))
    group = next(g for g in yaml.safe_load(RULES.read_text())["groups"] if g["name"] == "attention-anomalies")
    evaluation = seconds(group.get("interval", prometheus["global"]["evaluation_interval"]))
    route = yaml.safe_load(ALERTMANAGER.read_text())["route"]
    pages = next(r for r in route["routes"] if any("AttentionLowHeadDiversity" in m for m in r["matchers"]))
    group_wait = seconds(pages.get("group_wait", route.get("group_wait", "30s")))
    for rule in group["rules"]:
        if rule.get("labels", {}).get("severity") == "critical":
            worst = scrape + evaluation + seconds(rule["for"]) + group_wait
            assert worst <= 15, (rule["alert"], scrape, evaluation, rule["for"], group_wait)
            # a scrape gap (a restart, a moved judge) must not resolve the page and page again
            assert seconds(rule["keep_firing_for"]) >= 4 * scrape, rule["alert"]


# --- dashboards --------------------------------------------------------------------------

DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))


def test_dashboards_are_what_build_py_builds():
    from dashboards import build

    assert {p.name for p in DASHBOARDS} == set(build.DASHBOARDS)
    for path in DASHBOARDS:
        assert path.read_text() == build.render(build.DASHBOARDS[path.name]), f"{path.name}: run dashboards/build.py"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_conventions(path):
    doc = json.loads(path.read_text())
    assert doc.get("id") is None and re.fullmatch(r"attention-[a-z]+", doc["uid"])
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"model", "revision"} <= variables.keys()
    for panel in doc["panels"]:
        title = panel["title"]
        assert panel["description"], title
        assert panel["fieldConfig"]["defaults"]["unit"], title
        assert panel["datasource"]["uid"] == "${datasource}", title
        for target in panel["targets"]:
            assert target["refId"] and target["expr"], title
            assert target["datasource"]["uid"] == "${datasource}", title
            for window in re.findall(r"\b(?:rate|irate)\([^\[]*\[([^\]]+)\]", target["expr"]):
                assert window == "$__rate_interval", f"{title}: rate over {window}"


def test_panel_links_reach_runbooks_that_exist_and_the_triage_pages():
    runbooks = {p.stem for p in (REPO / "alerts" / "runbooks").glob("*.md")}
    linked_runbooks, triage = set(), []
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        assert "monitor" in {v["name"] for v in doc["templating"]["list"]}, path.name
        assert any(link["url"] == "${monitor}/triage/" for link in doc["links"]), path.name
        for panel in doc["panels"]:
            urls = [link["url"] for link in panel.get("links", [])]
            urls += [link["url"] for link in panel["fieldConfig"]["defaults"].get("links", [])]
            for url in urls:
                if "/alerts/runbooks/" in url:
                    linked_runbooks.add(url.rsplit("/", 1)[-1].removesuffix(".md"))
                else:
                    assert url.startswith("${monitor}/triage/"), (path.name, panel["title"], url)
                    triage.append(url)
    assert linked_runbooks <= runbooks, linked_runbooks - runbooks
    assert {"AttentionLowHeadDiversity", "AttentionHeadPatternShift", "AttentionAnomalyOutcomeAssociation"} \
        <= linked_runbooks
    assert "${monitor}/triage/layer?model=${model}&revision=${revision}&layer=${layer}" in triage
    assert any("${__field.labels.layer}" in url for url in triage)  # series link to their own layer


def test_drilldown_has_per_head_panels_and_layer_variable():
    doc = json.loads((REPO / "dashboards" / "drilldown.json").read_text())
    assert "layer" in {v["name"] for v in doc["templating"]["list"]}
    exprs = " ".join(t["expr"] for p in doc["panels"] for t in p["targets"])
    for metric in ("attention_head_entropy", "attention_head_concentration", "attention_head_sink_share",
                   "attention_layer_diversity"):
        assert metric in exprs


def test_provisioning_points_at_the_dashboards():
    prov = REPO / "dashboards" / "provisioning"
    datasource = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus"
    provider = yaml.safe_load((prov / "dashboards" / "attention.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["grafana"]["volumes"]
    assert "./dashboards:/var/lib/grafana/dashboards:ro" in compose
    assert "./dashboards/provisioning:/etc/grafana/provisioning:ro" in compose


@pytest.mark.prometheus
def test_the_inhibit_rules_silence_what_they_say_on_the_real_alertmanager(tmp_path):
    """Alerts posted to the Debian Alertmanager on the shipped configuration: a revision's
    low-diversity page inhibits its head-pattern page (not another revision's); the
    monitor down inhibits its silence about traces; stalled consumption inhibits lag; an
    outcome association (a ticket) on the page's own layer leaves the page alone."""
    webhook = WebhookReceiver()
    am = start_alertmanager(webhook.url, tmp_path / "alertmanager")
    try:
        def alert(name: str, **labels: str) -> dict:
            return {"labels": {"alertname": name, **labels}, "annotations": {}}

        critical = {"severity": "critical"}
        posted = [
            alert("AttentionLowHeadDiversity", model="m", revision="r", layer="3", **critical),
            alert("AttentionHeadPatternShift", model="m", revision="r", layer="4", **critical),
            alert("AttentionHeadPatternShift", model="m", revision="r2", layer="4", **critical),
            alert("AttentionLowHeadDiversity", model="m", revision="r3", layer="1", **critical),
            alert("AttentionAnomalyOutcomeAssociation", model="m", revision="r3", layer="1", kind="low_diversity",
                  severity="warning"),
            alert("AttentionMonitorDown", instance="monitor:9464", **critical),
            alert("AttentionTracesStalled", instance="monitor:9464", severity="warning"),
            alert("AttentionTracesAbsent", severity="warning"),
            alert("AttentionConsumerLagHigh", instance="monitor:9464", severity="warning"),
        ]
        request = urllib.request.Request(f"{am.url}/api/v2/alerts", data=json.dumps(posted).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass

        def states() -> dict[tuple[str, str], str]:
            return {(a["labels"]["alertname"], a["labels"].get("revision", "")): a["status"]["state"]
                    for a in am.alerts()}

        expected = {("AttentionLowHeadDiversity", "r"): "active", ("AttentionHeadPatternShift", "r"): "suppressed",
                    ("AttentionHeadPatternShift", "r2"): "active", ("AttentionMonitorDown", ""): "active",
                    ("AttentionLowHeadDiversity", "r3"): "active",
                    ("AttentionAnomalyOutcomeAssociation", "r3"): "active",
                    ("AttentionTracesStalled", ""): "suppressed", ("AttentionTracesAbsent", ""): "suppressed",
                    ("AttentionConsumerLagHigh", ""): "suppressed"}
        wait_for(lambda: states() == expected, timeout=30, what=f"the inhibitions applied (now {states()})")
    finally:
        am.stop()
        webhook.close()
