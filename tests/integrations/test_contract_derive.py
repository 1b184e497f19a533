"""``attention-monitor contract derive`` on a real encoder checkpoint (BERT-style tensor
names), agreeing with the contract the attention tap derives from the loaded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from monitor.cli import app
from monitor.integrations.transformers import contract_from_config
from monitor.protocol.model_contract import ModelContract
from tests.integrations.models import minilm

pytestmark = pytest.mark.models

runner = CliRunner()


def test_derive_reads_bert_names_and_agrees_with_the_live_model(tmp_path):
    model, _ = minilm()
    folder = Path(model.name_or_path)
    out = tmp_path / "contract.json"
    result = runner.invoke(app, ["contract", "derive", str(folder / "model.safetensors"), "--config",
                                 str(folder / "config.json"), "--model-id", "all-MiniLM-L6-v2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    derived = ModelContract.model_validate(json.loads(out.read_text())["contract"])
    assert derived.mask == "bidirectional"  # an encoder, without --mask
    assert (len(derived.layers), len(derived.layers[0].heads), derived.layers[0].head_dim) == (6, 12, 32)
    assert derived == contract_from_config(model.config, "all-MiniLM-L6-v2", derived.model_revision)


def test_a_pattern_that_matches_nothing_says_what_it_tried(tmp_path):
    model, _ = minilm()
    folder = Path(model.name_or_path)
    result = runner.invoke(app, ["contract", "derive", str(folder / "model.safetensors"), "--config",
                                 str(folder / "config.json"), "--model-id", "m", "--pattern",
                                 r"blocks\.(?P<layer>\d+)\.attn\.(?P<proj>[qkvo])\.weight$"])
    assert result.exit_code == 1
    assert "no attention projections match" in result.output and "embeddings" in result.output
    bad = runner.invoke(app, ["contract", "derive", str(folder / "model.safetensors"), "--config",
                              str(folder / "config.json"), "--model-id", "m", "--pattern", r"layer\.(\d+)"])
    assert bad.exit_code == 1 and "must name the groups layer and proj" in bad.output
