"""``attention-monitor serve`` refuses what it cannot serve before starting anything:
transformers' own options checked by transformers' own parser (exit 2), options of ours
that need a model, an unsupported transformers (exit 1)."""

from __future__ import annotations

import json

import pytest
import transformers
from typer.testing import CliRunner

from monitor.cli import app
from monitor.integrations import serving_transformers

pytestmark = pytest.mark.models
runner = CliRunner()


@pytest.fixture
def env(tmp_path):
    keyring = tmp_path / "keyring.json"
    keyring.write_text(json.dumps({"team-a": "s" * 32}))
    return {"ATTENTION_MONITOR_KEYRING_FILE": str(keyring), "ATTENTION_MONITOR_BOOTSTRAP_SERVERS": "127.0.0.1:1"}


@pytest.mark.parametrize(("args", "code", "message"), [
    (["./model", "--no-such-option"], 2, "No such option: --no-such-option"),
    (["./model", "--port", "not-a-port"], 2, "'--port'"),
    (["--model-id", "my-llm"], 2, "give its MODEL"),
    (["./model", "--sample-rate", "2"], 2, "--sample-rate"),
    (["./model", "--layers", "0,x"], 2, "--layers must be comma-separated"),
    (["./model", "--tenant", "no spaces"], 2, "tenant"),
    (["./model", "--key-id", "team-b"], 2, "key 'team-b' is not in the keyring"),
])
def test_bad_options_are_refused_before_a_server_starts(env, args, code, message):
    result = runner.invoke(app, ["serve", *args], env=env)
    assert result.exit_code == code, result.output
    assert message in result.output


def test_a_transformers_version_it_was_not_written_for_is_refused_with_the_supported_range(env, monkeypatch):
    assert serving_transformers.unsupported() is None
    monkeypatch.setattr(transformers, "__version__", "5.26.0")
    result = runner.invoke(app, ["serve", "./model"], env=env)
    assert result.exit_code == 1, result.output
    assert "transformers 5.26.0 is installed" in result.output and "<5.26,>=5.25" in result.output
