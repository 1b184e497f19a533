"""The triage pages of a real run (real broker, the service, a collapsed revision judged
by its healthy predecessor's reference), opened in Debian's headless Chromium: written by
``attention-monitor triage --html`` and served by the service at ``/triage/`` behind its
basic auth."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.service.harness import Monitor, make_topics, monitor_env, publish_contracts, send_requests, series
from tests.triage.cases import COLLAPSED, COLLAPSED_HEADS, HEALTHY

pytestmark = [pytest.mark.kafka, pytest.mark.browser]
USER, PASSWORD = "oncall", "triage-password"


def open_page(browser, url: str, screenshot, **context_options):
    """Load ``url`` in a window 1,280 px wide; the page, its console errors and every
    request it made."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, **context_options)
    page = context.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    response = page.goto(url, wait_until="load")
    page.screenshot(path=str(screenshot), full_page=True)
    return page, response, errors, requests, context


def test_an_incident_page_of_a_real_run_opens_offline_in_chromium(kafka_broker, make_topic, unique_name, tmp_path,
                                                                  chromium):
    topics = make_topics(make_topic)
    publish_contracts(kafka_broker.bootstrap, topics, [HEALTHY.contract(), COLLAPSED.contract()])
    env = monitor_env(kafka_broker.bootstrap, topics, unique_name("group"), tmp_path, join_ttl_s=2,
                      reference_pins="scenario-lm@r2=r1", metrics_basic_auth_user=USER,
                      metrics_basic_auth_password=PASSWORD)
    for name in ("REFERENCE_TRACES", "MIN_EFFECT", "FALSE_ALARM_ARL"):  # the shipped defaults, not the harness's
        env.pop(f"ATTENTION_MONITOR_{name}")
    monitor = Monitor(env, tmp_path / "monitor.log")
    try:
        monitor.wait_ready()
        send_requests(kafka_broker.bootstrap, topics, HEALTHY, np.random.default_rng(1), range(210),
                      lambda i: "failure" if i % 10 == 0 else "success")  # the reference: 200 a layer
        monitor.wait_until(lambda: monitor.value(series("attention_reference_ready", model="scenario-lm",
                                                        revision="r1", layer="2")) == 1,
                           timeout=60, what="r1's reference of layer 2 ready")
        send_requests(kafka_broker.bootstrap, topics, COLLAPSED, np.random.default_rng(2), range(16),
                      lambda i: "failure" if i % 2 == 0 else "success")
        # which requests raise the findings depends on how the two partitions interleave
        # (the CUSUM restarts after each), so their outcomes may all be failures or all
        # successes: wait for the joins, whichever
        joined = [series("attention_anomaly_outcomes_total", model="scenario-lm", revision="r2", layer="2",
                         kind="low_diversity", outcome=outcome) for outcome in ("failure", "success")]
        monitor.wait_until(lambda: sum(monitor.value(name) for name in joined) >= 1,
                           timeout=60, what="low-diversity findings on r2 layer 2 joined to their outcomes")

        pages = tmp_path / "pages"
        cli = [sys.executable, "-m", "monitor", "triage", "--html"]
        run_env = {**os.environ, **env}
        done = subprocess.run([*cli, str(pages)], env=run_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        incident_pages = [p for p in pages.iterdir() if p.name != "index.html"]
        assert len(incident_pages) == 1 and "r2_layer-2_diversity" in incident_pages[0].name, done.stdout
        healthy = tmp_path / "healthy.html"
        done = subprocess.run([*cli, str(healthy), "--model", "scenario-lm", "--revision", "r1", "--layer", "2"],
                              env=run_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "nothing to investigate" in done.stdout, done.stderr

        url = incident_pages[0].as_uri()
        page, _, errors, requests, context = open_page(chromium, url, tmp_path / "incident.png")
        assert errors == [] and requests == [url]  # the document itself, nothing else
        chips = page.locator("#involved [data-head]")
        involved = {chips.nth(i).get_attribute("data-head") for i in range(chips.count())}
        assert involved == COLLAPSED_HEADS
        for i in range(chips.count()):  # each head with the traces naming it, as the incident's record has it
            head, count = chips.nth(i).inner_text().split()
            assert head in COLLAPSED_HEADS and int(count) >= 2
        for name in ("this", "reference", "difference"):
            heatmap = page.locator(f"#heatmap-{name}")
            assert heatmap.count() == 1 and heatmap.bounding_box()["width"] > 50
        labels = set(page.locator("#heatmaps svg text").evaluate_all("nodes => nodes.map(n => n.textContent)"))
        assert {f"head-{h}" for h in range(8)} <= labels
        # at 1,280 px nothing is cut off or scrolls sideways: every chart fits the page
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
        for chart in ("#heatmaps svg", "#timelines svg"):
            box = page.locator(chart).bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= 1280, (chart, box)
        right = page.locator("#heatmap-difference").bounding_box()
        assert right["x"] + right["width"] <= 1280  # the difference heatmap, rightmost, whole
        # heads over the selection: small multiples, one row of panels per head, never overlapping
        assert page.locator("#timelines svg").count() == 1
        panels = page.locator('#timelines svg [id^="timeline-"]')
        names = panels.evaluate_all("nodes => nodes.map(n => n.id)")
        heads = {n.removeprefix("timeline-").rsplit("-", 1)[0] for n in names}
        assert len(names) == 3 * len(heads) and heads >= COLLAPSED_HEADS
        boxes = [panels.nth(i).bounding_box() for i in range(panels.count())]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                apart = (a["x"] + a["width"] <= b["x"] + 1 or b["x"] + b["width"] <= a["x"] + 1
                         or a["y"] + a["height"] <= b["y"] + 1 or b["y"] + b["height"] <= a["y"] + 1)
                assert apart, (a, b)
        assert page.locator('[data-field="model"]').inner_text() == "scenario-lm"
        assert page.locator('[data-field="reference_revision"]').inner_text() == "r1"
        assert page.locator("#policy").inner_text().count("pruning") == 1  # "not an automatic pruning command"
        context.close()
        assert (tmp_path / "incident.png").stat().st_size > 20_000

        page, _, errors, requests, context = open_page(chromium, healthy.as_uri(), tmp_path / "healthy.png")
        assert errors == [] and requests == [healthy.as_uri()]
        assert "Nothing to investigate" in page.locator("#verdict").inner_text()
        assert page.locator("svg").count() == 0
        context.close()

        served = f"http://127.0.0.1:{monitor.port}/triage/"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(served, timeout=30)
        assert refused.value.code == 401  # the same basic auth as /metrics
        page, response, errors, requests, context = open_page(
            chromium, served, tmp_path / "served-index.png", http_credentials={"username": USER, "password": PASSWORD})
        assert response.status == 200 and errors == []
        assert "default-src 'none'" in response.headers["content-security-policy"]
        page.locator("#incidents a").first.click()
        page.wait_for_load_state("load")
        assert "/triage/incident/" in page.url and errors == []
        chips = page.locator("#involved [data-head]")
        assert {chips.nth(i).get_attribute("data-head") for i in range(chips.count())} == COLLAPSED_HEADS
        page.screenshot(path=str(tmp_path / "served-incident.png"), full_page=True)
        # the index links every layer this instance has seen; a healthy layer's page names
        # the reference that judges it and its contract, which no record of it does
        page.goto(served, wait_until="load")
        seen = page.locator("#layers-seen a").count()
        assert seen >= 2 * len(HEALTHY.contract().layers)
        page.locator('#layers-seen tr[data-layer="scenario-lm r1 0"] a').click()
        page.wait_for_load_state("load")
        assert page.locator('[data-field="reference_revision"]').inner_text() == "r1"
        assert page.locator('[data-field="contract_id"]').inner_text() == HEALTHY.contract().contract_id
        page.screenshot(path=str(tmp_path / "served-layer.png"), full_page=True)
        assert errors == []
        # a typo is a 404 listing the layers seen, a missing parameter a 400 naming it
        response = page.goto(served + "layer?model=nosuch&revision=x&layer=9", wait_until="load")
        assert response.status == 404 and "no traces of model 'nosuch'" in page.locator("#notice").inner_text()
        assert page.locator("#layers-seen a").count() == seen
        page.screenshot(path=str(tmp_path / "served-unseen.png"), full_page=True)
        response = page.goto(served + "layer?model=scenario-lm&revision=r1", wait_until="load")
        assert response.status == 400 and "layer is missing" in page.locator("#notice").inner_text()
        context.close()
    finally:
        monitor.process.stop()
