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
from tests.integrations.models import DECODERS, MODELS, minilm, minilm_path

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


def test_one_checkpoint_one_revision_from_the_files_and_from_any_load(tmp_path):
    """``contract derive`` on the checkpoint directory and the tap on the model loaded
    from it, in float32, float16 or bfloat16, name one revision; a model whose weights
    were changed after loading, or built in memory, gets its own."""
    import torch
    from transformers import AutoModel, LlamaForCausalLM

    from monitor.integrations.transformers import model_revision, weights_revision

    folder = minilm_path()
    out = tmp_path / "contract.json"
    result = runner.invoke(app, ["contract", "derive", folder, "--model-id", "all-MiniLM-L6-v2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    derived = json.loads(out.read_text())["contract"]["model_revision"]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        model = AutoModel.from_pretrained(folder, dtype=dtype)
        assert model_revision(model) == derived, dtype
    with torch.no_grad():
        model.encoder.layer[2].attention.self.query.weight[0, 0] += 1
    changed = model_revision(model)
    assert changed != derived and changed == weights_revision(model)

    llama = DECODERS["llama"][0]("eager")
    assert model_revision(llama) == weights_revision(llama)  # built in memory: no checkpoint
    llama.save_pretrained(tmp_path / "llama")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float16)
    result = runner.invoke(app, ["contract", "derive", str(tmp_path / "llama"), "--model-id", "llama"])
    assert result.exit_code == 0, result.output
    assert model_revision(reloaded) == json.loads(result.output)["contract"]["model_revision"]
    no_config = runner.invoke(app, ["contract", "derive", str(Path(folder) / "model.safetensors"), "--model-id", "m"])
    assert no_config.exit_code == 2 and "give --config" in no_config.output


def test_a_sharded_checkpoint_loaded_in_its_own_dtype_is_compared_byte_for_byte(tmp_path):
    """A bfloat16 checkpoint in several shards, loaded in bfloat16: each tensor is compared
    with the file's bytes, so the model is named as ``contract derive`` names the files;
    the last element of one tensor changed after loading gives it its own revision."""
    import torch
    from transformers import LlamaForCausalLM

    from monitor.integrations.transformers import model_revision, weights_revision

    DECODERS["llama"][0]("eager").to(torch.bfloat16).save_pretrained(tmp_path / "llama", max_shard_size="40KB")
    assert len(list((tmp_path / "llama").glob("*.safetensors"))) > 1
    result = runner.invoke(app, ["contract", "derive", str(tmp_path / "llama"), "--model-id", "llama"])
    assert result.exit_code == 0, result.output
    derived = json.loads(result.output)["contract"]["model_revision"]
    model = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16)
    assert model_revision(model) == derived
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight[-1, -1] += 1
    assert model_revision(model) == weights_revision(model) != derived
