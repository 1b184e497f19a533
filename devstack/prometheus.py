"""Prometheus and Alertmanager from the Debian packages, on the repository's own
configuration files.

The files under ``deploy/`` are what ``docker-compose.yml`` mounts. Here they are
loaded, their scrape, Alertmanager and receiver addresses pointed at what a test
chooses, their intervals shortened to one second, and everything else (rule files,
routes, inhibitions) left as it is.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devstack.process import ManagedProcess, ServiceError, free_port
from devstack.wait import wait_for

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
ALERTS_DIR = REPO / "alerts"


def binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise ServiceError(
        f"none of {names} is on PATH; install the Debian packages "
        "prometheus and prometheus-alertmanager (.ci/run does)"
    )


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


@dataclass
class Prometheus:
    url: str
    workdir: Path
    process: ManagedProcess
    _owns_workdir: bool = field(default=False, repr=False)

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = get_json(f"{self.url}/api/v1/{path}{query}")
        if body.get("status") != "success":
            raise ServiceError(f"prometheus {path} failed: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (empty when nothing matches)."""
        data = self.api("query", query=expr)
        return list(data["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])

    def load_rules(self, speedup: float, timeout: float = 30.0) -> None:
        """Write time-scaled copies of the repository's rule files and reload. A test
        calls this once the first scrape is in, so that ``absent(up)`` cannot fire in
        the seconds Prometheus takes to start scraping."""
        for rules in ALERTS_DIR.glob("*.rules.yml"):
            (self.workdir / "alerts" / rules.name).write_text(scaled_rules(rules.read_text(), speedup))
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass
        wait_for(lambda: self.api("rules")["groups"], timeout=timeout, what="rules loaded")

    def stop(self) -> None:
        self.process.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class Alertmanager:
    url: str
    workdir: Path
    process: ManagedProcess
    _owns_workdir: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    def alerts(self) -> list[dict[str, Any]]:
        return list(get_json(f"{self.url}/api/v2/alerts"))

    def stop(self) -> None:
        self.process.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def prometheus_config(
    targets: dict[str, list[str]],
    alertmanagers: list[str] | None = None,
    interval: str = "1s",
    source: Path = PROMETHEUS_YML,
) -> dict[str, Any]:
    """The repository's Prometheus config with addresses replaced.

    ``targets`` maps job names to ``host:port`` lists. Jobs of the file that are not
    named are dropped; named jobs the file does not have are added with the file's
    defaults. ``alertmanagers`` replaces the Alertmanager targets (none: no alerting).
    """
    config: dict[str, Any] = yaml.safe_load(source.read_text())
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    jobs = {job["job_name"]: job for job in config.get("scrape_configs", [])}
    config["scrape_configs"] = [
        {**jobs.get(name, {"job_name": name}), "static_configs": [{"targets": list(addrs)}]}
        for name, addrs in targets.items()
    ]
    if alertmanagers:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]}
    else:
        config.pop("alerting", None)
    return config


_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_RANGE = re.compile(r"\[(\d+)(ms|s|m|h|d)\]")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _scaled(amount: str, unit: str, speedup: float) -> str:
    if int(amount) == 0:
        return "0s"
    seconds = max(1.0, int(amount) * _SECONDS[unit] / speedup)
    return f"{seconds:g}s"


def scaled_rules(text: str, speedup: float) -> str:
    """A rule file with every ``for:`` and every range selector divided by ``speedup``
    (``[10m]`` → ``[10s]`` at 60). Expressions, labels and annotations stay as they are,
    so a test can watch the deployed rules fire in seconds instead of minutes."""
    doc = yaml.safe_load(text)
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            if "for" in rule:
                match = _DURATION.match(str(rule["for"]))
                if match:
                    rule["for"] = _scaled(match[1], match[2], speedup)
            rule["expr"] = _RANGE.sub(lambda m: f"[{_scaled(m[1], m[2], speedup)}]", str(rule["expr"]))
    return yaml.safe_dump(doc, sort_keys=False)


def start_prometheus(
    targets: dict[str, list[str]],
    alertmanagers: list[str] | None = None,
    workdir: Path | None = None,
    timeout: float = 30.0,
    rules: bool = True,
) -> Prometheus:
    """Run ``prometheus`` on the repository config with the given addresses; without
    ``rules``, with none loaded yet (see :meth:`Prometheus.load_rules`)."""
    owns = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="prometheus-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(targets, alertmanagers)))
    link = workdir / "alerts"
    if not rules:
        link.mkdir(exist_ok=True)
    elif not link.exists():
        link.symlink_to(ALERTS_DIR, target_is_directory=True)
    port = free_port()
    process = ManagedProcess(
        "prometheus",
        [binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--web.enable-lifecycle", "--log.level=warn"],
        workdir / "prometheus.log",
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", workdir, process, owns)
    _wait_ready(process, f"{prom.url}/-/ready", timeout, prom.stop)
    return prom


def alertmanager_config(webhook_url: str, source: Path = ALERTMANAGER_YML) -> dict[str, Any]:
    """The repository's Alertmanager config with every webhook sent to ``webhook_url``
    and the grouping waits shortened for tests."""
    config: dict[str, Any] = yaml.safe_load(source.read_text())
    for receiver in config.get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook_url
    route = config["route"]
    route.update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    return config


def start_alertmanager(webhook_url: str, workdir: Path | None = None, timeout: float = 30.0) -> Alertmanager:
    """Run ``prometheus-alertmanager`` on the repository config, receivers pointed at
    ``webhook_url``, clustering off."""
    owns = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="alertmanager-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(alertmanager_config(webhook_url)))
    port = free_port()
    process = ManagedProcess(
        "alertmanager",
        [binary("prometheus-alertmanager", "alertmanager"), f"--config.file={workdir / 'alertmanager.yml'}",
         f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address=", "--log.level=warn"],
        workdir / "alertmanager.log",
    )
    am = Alertmanager(f"http://127.0.0.1:{port}", workdir, process, owns)
    _wait_ready(process, f"{am.url}/-/ready", timeout, am.stop)
    return am


def _wait_ready(process: ManagedProcess, url: str, timeout: float, stop: Any) -> None:
    def ready() -> bool:
        process.check_alive()
        return _http_ok(url)

    try:
        wait_for(ready, timeout=timeout, what=f"{process.name} ready at {url}")
    except BaseException as exc:
        tail = process.log_tail()
        stop()
        raise ServiceError(f"{process.name} did not become ready ({exc}); log tail:\n{tail}") from None
