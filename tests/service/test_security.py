"""The monitor against the SASL/SCRAM broker with default-deny ACLs."""

from __future__ import annotations

import pytest

from devstack.kafka import create_scram_user
from devstack.wait import wait_for
from monitor.broker.acls import apply_acls
from tests.service.harness import Monitor, make_topics, monitor_env

pytestmark = pytest.mark.kafka


def test_missing_acls_end_the_monitor_with_a_clear_reason_and_granted_acls_let_it_run(
        scram_broker, scram_admin, make_scram_topic, unique_name, tmp_path):
    topics = make_topics(make_scram_topic)
    user, password = unique_name("monitor"), "monitor-password"
    create_scram_user(scram_admin, user, password)
    group = unique_name("group")
    env = monitor_env(scram_broker.bootstrap, topics, group, tmp_path, security_protocol="SASL_PLAINTEXT",
                      sasl_username=user, sasl_password=password, startup_timeout_s=15)

    denied = Monitor(env, tmp_path / "denied.log", "denied")
    assert denied.process.proc.wait(60) == 3
    log = denied.process.log_path.read_text()
    # every topic named at once (without DESCRIBE a topic looks absent), with both remedies
    refusal = next((line for line in log.splitlines() if "missing or not describable" in line), log[-2000:])
    assert all(topic in refusal for topic in (topics.traces, topics.contracts, topics.observations)), refusal
    assert "grant this principal DESCRIBE on them (`attention-monitor acls apply`)" in refusal

    # 4 topics read (2 ACLs each), 5 read and written (3 each: anomalies, dead letters,
    # observations, judge state, pending outcomes), the group, the transactional ids (2)
    assert apply_acls(scram_broker.connection(), f"User:{user}", "monitor", topics, group) == 26
    allowed = Monitor(env, tmp_path / "allowed.log", "allowed")
    try:
        allowed.wait_ready(timeout=60)
        wait_for(lambda: allowed.value("attention_monitor_rebalances_total") >= 1, timeout=30,
                 what="partitions assigned under the granted ACLs")
    finally:
        allowed.process.stop()
