"""check-config and the embedded demo."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from monitor.cli import app
from monitor.settings import Settings
from monitor.tools.demo import run_demo, summary

runner = CliRunner()


def usable(monkeypatch, **settings: str) -> None:
    """A configuration check-config accepts (scopes and a bare key), and ``settings`` (names
    without the prefix) on top."""
    monkeypatch.setenv("ATTENTION_MONITOR_KEYRING_JSON", '{"k": "a-very-secret-value-123"}')
    monkeypatch.setenv("ATTENTION_MONITOR_ALLOWED_SCOPES", "team-a:internal")
    for name, value in settings.items():
        monkeypatch.setenv(f"ATTENTION_MONITOR_{name}", value)


def test_check_config_masks_secrets(monkeypatch):
    usable(monkeypatch, SECURITY_PROTOCOL="SASL_PLAINTEXT", SASL_USERNAME="monitor", SASL_PASSWORD="hunter2-password")
    result = runner.invoke(app, ["check-config"])
    assert result.exit_code == 0, result.output
    assert "a-very-secret-value" not in result.output and "hunter2" not in result.output
    assert "sasl_password=**********" in result.output and "configuration ok" in result.output
    assert "judging=" not in result.output  # a removed setting is not shown as if it were in use
    assert "warning: key k is a bare secret: it may sign any tenant" in result.output


def test_check_config_wants_scopes_and_reads_tenant_bound_keys(monkeypatch):
    monkeypatch.setenv("ATTENTION_MONITOR_KEYRING_JSON", '{"k": {"secret": "a-very-secret-value-123", '
                       '"tenants": ["team-a"], "contracts": true}}')
    result = runner.invoke(app, ["check-config"])
    assert result.exit_code == 1 and "no ALLOWED_SCOPES" in result.output  # no wildcard by default
    monkeypatch.setenv("ATTENTION_MONITOR_ALLOWED_SCOPES", "team-a:internal")
    result = runner.invoke(app, ["check-config"])
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    monkeypatch.setenv("ATTENTION_MONITOR_KEYRING_JSON", '{"k": {"secret": "a-very-secret-value-123"}}')
    result = runner.invoke(app, ["check-config"])
    assert result.exit_code == 1 and "must be {\"secret\"" in result.output


def test_check_config_reports_bad_settings(monkeypatch):
    usable(monkeypatch, REFERENCE_PINS="no-at-sign")
    result = runner.invoke(app, ["check-config"])
    assert result.exit_code == 1 and "model@revision=reference_revision" in result.output
    monkeypatch.setenv("ATTENTION_MONITOR_DETAIL_LEVEL", "everything")
    assert runner.invoke(app, ["check-config"]).exit_code == 1


def test_demo_raises_low_diversity_on_the_drifting_layer_only_in_the_second_revision():
    registry = CollectorRegistry()
    result = run_demo(registry, requests=160, reference_traces=100)
    low = [a for a in result.anomalies if a["kind"] == "low_diversity"]
    drifting = [a for a in low if a["model_revision"] == "rev-2026-11-15" and a["layer"] == 2]
    assert len(drifting) >= 20 and len(drifting) >= 0.9 * len(low)
    assert {a["outcome"] for a in drifting} <= {"success", "failure", "pending"}
    assert {d["reason"] for d in result.dead_letters} == {"unknown_key"}
    text = summary(result, registry)
    assert "low_diversity" in text and "not an automatic pruning command" in text
    assert "controlled head ablation" in text
    value = registry.get_sample_value("attention_anomalies_total", {"model": "demo-lm", "revision": "rev-2026-11-15",
                                                                   "layer": "2", "kind": "low_diversity"})
    assert value == len(drifting)


def test_demo_command_finishes_and_exits_zero():
    result = runner.invoke(app, ["demo", "--port", "0", "--pace", "0", "--requests", "130"])
    assert result.exit_code == 0, result.output
    assert "serving http://127.0.0.1:" in result.output and "Anomalies raised" in result.output


def test_check_config_warns_when_measuring_processes_compete_with_the_consumer(monkeypatch):
    default = 2
    monkeypatch.setenv("ATTENTION_MONITOR_ALLOWED_SCOPES", "team-a:internal")
    monkeypatch.setenv("ATTENTION_MONITOR_KEYRING_JSON", '{"k": {"secret": "a-very-secret-value-123", '
                       '"tenants": ["team-a"]}}')
    monkeypatch.setattr("monitor.settings.os.cpu_count", lambda: 2)
    crowded = "MEASURE_PROCESSES=3 on 2 cores: more measuring processes than cores"
    expected = {None: None, "1": None, str(default): None, str(default + 1): crowded,
                "0": "MEASURE_PROCESSES=0 measures in a thread of the service's process"}
    for processes, warning in expected.items():
        if processes is None:
            monkeypatch.delenv("ATTENTION_MONITOR_MEASURE_PROCESSES", raising=False)
        else:
            monkeypatch.setenv("ATTENTION_MONITOR_MEASURE_PROCESSES", processes)
        result = runner.invoke(app, ["check-config"])
        assert result.exit_code == 0, result.output
        if processes is None:
            assert Settings().measuring_processes() == default
        if warning is None:
            assert "warning" not in result.output, (processes, result.output)
        else:
            assert f"warning: {warning}" in result.output, (processes, result.output)
    monkeypatch.setattr("monitor.settings.os.cpu_count", lambda: 8)  # one a core at most, and at most 8
    monkeypatch.delenv("ATTENTION_MONITOR_MEASURE_PROCESSES")
    assert Settings().measuring_processes() == 8


def test_triage_url_is_exported_for_alerts_and_checked(monkeypatch):
    """TRIAGE_URL becomes attention_monitor_triage_info{url}, which the alerts' triage_url
    links to (alerts/tests cover the template); an address that is not http(s) is refused
    by check-config with the reason."""
    from monitor.service.app import Service

    monkeypatch.setenv("ATTENTION_MONITOR_TRIAGE_URL", "https://monitor-1.example.com/")
    service = Service(Settings())
    assert service.registry.get_sample_value("attention_monitor_triage_info",
                                             {"url": "https://monitor-1.example.com"}) == 1
    monkeypatch.delenv("ATTENTION_MONITOR_TRIAGE_URL")
    assert not any(m.name == "attention_monitor_triage" for m in Service(Settings()).registry.collect())
    monkeypatch.setenv("ATTENTION_MONITOR_TRIAGE_URL", "monitor-1:9464")
    result = runner.invoke(app, ["check-config"])
    assert result.exit_code == 1, result.output
    assert "ATTENTION_MONITOR_TRIAGE_URL must be an http(s) address" in result.output


def test_a_rebalance_timeout_shorter_than_the_session_is_refused(monkeypatch):
    """librdkafka refuses max.poll.interval.ms below session.timeout.ms at the consumer's
    start; check-config says so first, naming both settings."""
    usable(monkeypatch, SESSION_TIMEOUT_MS="20000", REBALANCE_TIMEOUT_MS="10000")
    result = runner.invoke(app, ["check-config"])
    assert result.exit_code == 1, result.output
    assert ("ATTENTION_MONITOR_REBALANCE_TIMEOUT_MS (10000) must be at least ATTENTION_MONITOR_SESSION_TIMEOUT_MS "
            "(20000)") in result.output
    monkeypatch.setenv("ATTENTION_MONITOR_REBALANCE_TIMEOUT_MS", "20000")
    assert runner.invoke(app, ["check-config"]).exit_code == 0


def test_produce_refuses_a_scope_the_monitor_would_refuse_before_sending_anything(monkeypatch, tmp_path):
    """The README's keyring (key team-a, tenant team-a) and scopes (team-a:internal): the
    default synthetic scope, demo:synthetic, would be refused trace by trace by the
    monitor, which only counts it; produce says so and sends nothing. Nothing listens at
    the bootstrap address: a refusal that came after connecting would fail otherwise."""
    keyring = tmp_path / "keyring.json"
    assert runner.invoke(app, ["keyring", "new", str(keyring), "--key-id", "team-a"]).exit_code == 0
    monkeypatch.setenv("ATTENTION_MONITOR_KEYRING_FILE", str(keyring))
    monkeypatch.setenv("ATTENTION_MONITOR_ALLOWED_SCOPES", "team-a:internal")
    monkeypatch.setenv("ATTENTION_MONITOR_BOOTSTRAP_SERVERS", "127.0.0.1:9")

    result = runner.invoke(app, ["produce", "--synthetic", "--requests", "1"])
    assert result.exit_code == 2, result.output
    assert "key team-a may sign traces of team-a only, not of tenant demo" in result.output
    assert "--tenant team-a" in result.output

    result = runner.invoke(app, ["produce", "--synthetic", "--requests", "1", "--tenant", "team-a"])
    assert result.exit_code == 2, result.output
    assert "ALLOWED_SCOPES (team-a:internal) does not allow team-a:synthetic" in result.output

    contracts_barred = tmp_path / "no-contracts.json"
    assert runner.invoke(app, ["keyring", "new", str(contracts_barred), "--key-id", "team-a",
                               "--no-contracts"]).exit_code == 0
    monkeypatch.setenv("ATTENTION_MONITOR_KEYRING_FILE", str(contracts_barred))
    result = runner.invoke(app, ["produce", "--synthetic", "--requests", "1", "--tenant", "team-a",
                                 "--data-class", "internal"])
    assert result.exit_code == 2 and "may not publish model contracts" in result.output, result.output
