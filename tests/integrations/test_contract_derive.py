"""``attention-monitor contract derive`` on a real encoder checkpoint (BERT-style tensor
names) and on checkpoints of today's decoders saved by transformers, agreeing with the
contract the attention tap derives from the loaded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from monitor.cli import app
from monitor.integrations.transformers import contract_from_config
from monitor.protocol.model_contract import ModelContract
from tests.integrations.models import DECODERS, MODELS, minilm

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


@pytest.mark.parametrize("name", [*sorted(DECODERS), "gpt2"])
def test_derive_knows_todays_decoders_windows_sinks_and_gpt2s_fused_projection(name, tmp_path):
    """A checkpoint saved by transformers itself (safetensors and config.json): the
    contract derived without loading it is the one the tap derives from the live model,
    sliding windows, learned sinks and scale included."""
    model = MODELS["gpt2"]("eager") if name == "gpt2" else DECODERS[name][0]("eager")
    model.save_pretrained(tmp_path / name)
    files = sorted((tmp_path / name).glob("*.safetensors"))
    out = tmp_path / f"{name}.json"
    config = str(tmp_path / name / "config.json")
    result = runner.invoke(app, ["contract", "derive", *map(str, files), "--config", config,
                                 "--model-id", name, "-o", str(out)])
    assert result.exit_code == 0, result.output
    derived = ModelContract.model_validate(json.loads(out.read_text())["contract"])
    live = contract_from_config(model.config, name, derived.model_revision,
                                scale=next((float(m.scaling) for m in model.modules()
                                            if isinstance(getattr(m, "scaling", None), float)), None))
    assert derived == live
    windows = {"mistral": [6, 6], "gemma3": [6, None], "gpt_oss": [6, None]}.get(name, [None, None])
    assert [layer.window for layer in derived.layers] == windows
    assert all(bool(layer.learned_sink) == (name == "gpt_oss") for layer in derived.layers)
