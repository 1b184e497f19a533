"""The dashboard's failure-rate panel, evaluated by the real promtool on known counts: a
canary's failure rate and its pinned reference's, with Wilson intervals equal to the
triage page's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from monitor.triage.outcomes import wilson

REPO = Path(__file__).resolve().parents[2]
TITLE = "Failure rate against the reference revision"
#: per layer, over the hour: the issue's canary (57 of 160 failed) and its reference (26 of 216)
COUNTS = {"canary": (57, 103), "healthy": (26, 190)}


def panel_targets() -> list[dict]:
    panels = json.loads((REPO / "dashboards" / "drilldown.json").read_text())["panels"]
    return next(p for p in panels if p["title"] == TITLE)["targets"]


@pytest.mark.prometheus
def test_the_panel_shows_the_canary_against_its_reference_with_the_triage_pages_intervals(promtool, tmp_path):
    targets = panel_targets()
    assert [t["legendFormat"] for t in targets] == [
        "{{revision}}", "{{revision}} 95 % low", "{{revision}} 95 % high", "reference of {{revision}}: {{reference}}",
        "reference of {{revision}}: {{reference}} 95 % low", "reference of {{revision}}: {{reference}} 95 % high"]
    rules = [{"record": f"panel:target_{n}", "expr": t["expr"].replace("$model", "m").replace("$revision", "canary")
              .replace("$layer", ".*")} for n, t in enumerate(targets)]
    (tmp_path / "panel.rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "panel", "rules": rules}]}))
    series = []
    for revision, (failed, succeeded) in COUNTS.items():
        for layer in ("0", "1"):  # two layers: each request counts once a layer
            for outcome, count in (("failure", failed), ("success", succeeded), ("missing", 7)):
                labels = f'model="m",revision="{revision}",layer="{layer}",outcome="{outcome}",instance="a"'
                series.append({"series": f"attention_trace_outcomes_total{{{labels}}}",
                               "values": f"0+{count / 60}x60"})
        judge = f'model="m",revision="{revision}",layer="0",reference="healthy",instance="a"'
        series.append({"series": f"attention_reference_judge{{{judge}}}", "values": "1x60"})
    expected = []
    for n, (revision, bound) in enumerate([(r, b) for r in ("canary", "healthy") for b in ("rate", "low", "high")]):
        failed, succeeded = COUNTS[revision]
        value = {"rate": failed / (failed + succeeded), "low": wilson(failed, failed + succeeded)[0],
                 "high": wilson(failed, failed + succeeded)[1]}[bound]
        labels = {"model": "m", "revision": "canary"} | ({"reference": "healthy"} if revision == "healthy" else {})
        expected.append({"expr": f"round(panel:target_{n} * 1e6)", "eval_time": "60m",
                         "exp_samples": [{"labels": "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}",
                                          "value": round(value * 1e6)}]})
    (tmp_path / "panel.test.yml").write_text(yaml.safe_dump({
        "rule_files": ["panel.rules.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": expected}]}))
    result = subprocess.run([promtool, "test", "rules", str(tmp_path / "panel.test.yml")], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
