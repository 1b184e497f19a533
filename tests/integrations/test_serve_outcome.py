"""``attention-monitor outcome``: one outcome by id (with its label and score), or many as
JSON lines, acknowledged on the outcomes topic keyed by the id as
``TraceProducer.send_outcome`` writes them; bad input refused before anything is sent; an
unreachable broker is exit 3."""

from __future__ import annotations

import json

import pytest
from kafka import KafkaConsumer
from typer.testing import CliRunner

from monitor.cli import app

runner = CliRunner()


def outcome(*args, env=None, stdin=None):
    return runner.invoke(app, ["outcome", *args], env=env, input=stdin)


@pytest.mark.parametrize(("args", "stdin", "message"), [
    ([], None, "give ID and OUTCOME (or --label), or --from FILE, not both"),
    (["chatcmpl-1", "success", "--from", "-"], "", "give ID and OUTCOME (or --label), or --from FILE, not both"),
    (["chatcmpl-1"], None, "error: no outcome: give success or failure"),
    (["chatcmpl-1", "--label", "wrong_citation"], None, "no outcome"),
    (["chatcmpl-1", "success", "--label", "thumbs_down"], None, "label"),
    (["chatcmpl-1", "failure", "--score", "1.5"], None, "score"),
    (["has space", "success"], None, "request_id: 'has space' must be 1-128 characters of A-Z a-z 0-9"),
    (["chatcmpl-1", "maybe"], None, "outcome"),
    (["--from", "-"], '{"request_id": "a", "outcome": "success"}\nnot json\n', "stdin line 2 is not JSON"),
    (["--from", "-"], '{"request_id": "a", "outcome": "success"}\n{"request_id": "b"}\n', "stdin line 2: no outcome"),
    (["--from", "-"], "\n\n", "holds no outcome"),
    (["--from", "/nonexistent/outcomes.jsonl"], None, "cannot read"),
])
def test_bad_input_is_refused_with_exit_2_before_anything_is_sent(args, stdin, message):
    # a broker that does not exist: reaching for it would be exit 3, not 2
    result = outcome(*args, stdin=stdin, env={"ATTENTION_MONITOR_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.exit_code == 2, result.output
    assert message in result.output and "Value error" not in result.output


def test_an_unreachable_broker_is_exit_3_naming_the_setting():
    result = outcome("chatcmpl-1", "success", "--timeout", "2",
                     env={"ATTENTION_MONITOR_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.exit_code == 3, result.output
    assert "cannot reach Kafka at 127.0.0.1:1 (ATTENTION_MONITOR_BOOTSTRAP_SERVERS): " in result.output
    name = result.output.split("ATTENTION_MONITOR_BOOTSTRAP_SERVERS): ")[1].split(":")[0]
    assert result.output.count(name) == 1, result.output  # the exception's name once


def test_unusable_settings_are_exit_1_naming_the_variable():
    result = outcome("chatcmpl-1", "success", env={"ATTENTION_MONITOR_COMMIT_INTERVAL_MS": "soon"})
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: unusable settings: ATTENTION_MONITOR_COMMIT_INTERVAL_MS='soon': ")
    assert "validation error" not in result.output


@pytest.mark.kafka
def test_outcomes_are_acknowledged_on_the_outcomes_topic_keyed_by_the_completions_id(kafka_broker, make_topic):
    topic = make_topic("outcomes", partitions=2)
    env = {"ATTENTION_MONITOR_BOOTSTRAP_SERVERS": kafka_broker.bootstrap, "ATTENTION_MONITOR_OUTCOMES_TOPIC": topic}
    one = outcome("chatcmpl-0a1b", "failure", "--timestamp", "1764500000.5", env=env)
    assert one.exit_code == 0, one.output
    assert one.output.startswith(f"outcome failure of chatcmpl-0a1b acknowledged by Kafka on {topic} (partition ")
    assert "attention_monitor_outcomes_unmatched_total" in one.output  # acknowledged is not matched
    graded = outcome("chatcmpl-0a1c", "--label", "thumbs_down", "--score", "0.2", env=env)
    assert graded.exit_code == 0, graded.output
    assert graded.output.startswith("outcome failure label thumbs_down score 0.2 of chatcmpl-0a1c acknowledged by")
    lines = "".join(json.dumps({"request_id": f"cmpl-{i}", "outcome": "success"}) + "\n" for i in range(5))
    many = outcome("--from", "-", stdin=lines, env=env)
    assert many.exit_code == 0, many.output
    assert many.output.splitlines()[0] == f"5 outcomes acknowledged by Kafka on {topic}"

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka_broker.bootstrap, group_id=None,
                             auto_offset_reset="earliest", consumer_timeout_ms=5000)
    records = {r.key.decode(): json.loads(r.value) for r in consumer}
    consumer.close()
    assert set(records) == {"chatcmpl-0a1b", "chatcmpl-0a1c", *(f"cmpl-{i}" for i in range(5))}
    assert {k: v for k, v in records["chatcmpl-0a1c"].items() if k != "timestamp"} == {
        "request_id": "chatcmpl-0a1c", "outcome": "failure", "label": "thumbs_down", "score": 0.2}
    assert records["chatcmpl-0a1b"] == {"request_id": "chatcmpl-0a1b", "outcome": "failure",
                                        "timestamp": 1764500000.5}
    assert all(records[f"cmpl-{i}"]["outcome"] == "success" and records[f"cmpl-{i}"]["timestamp"] > 1.7e9
               for i in range(5))
