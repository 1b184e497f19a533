"""attention-monitor audit and contract derive."""

from __future__ import annotations

import json
import struct

import pytest
from typer.testing import CliRunner

from monitor.cli import app
from monitor.protocol.contract_derivation import CheckpointError, derive_contract
from monitor.routing.example import example_contract, example_evidence

runner = CliRunner()


def test_audit_example_prints_the_documented_lines_in_order():
    result = runner.invoke(app, ["audit", "--example"])
    assert result.exit_code == 0, result.output
    keys = [line.split("=", 1)[0] for line in result.output.splitlines()]
    assert keys == ["example", "contract_id", "projection_id", "head_ids", "token0_output", "specialization",
                    "required_evidence", "material_id", "decision"]
    lines = dict(line.split("=", 1) for line in result.output.splitlines())
    assert lines["example"] == "illustrative_only"
    assert lines["head_ids"] == "head-0,head-1"
    assert lines["token0_output"] == "0.731,0.500"
    assert lines["specialization"] == "NOT_ESTABLISHED_FROM_HEAD_EXISTENCE"
    assert lines["required_evidence"] == "TASK_METRICS_PLUS_CONTROLLED_HEAD_ABLATION"
    assert lines["decision"] == "PASS"
    assert lines["contract_id"].startswith("multi-head-contract@sha256:")
    assert lines["projection_id"].startswith("multi-head-projections@")
    assert lines["material_id"].startswith("multi-head-material@")


def test_audit_files_pass_and_fail_with_exit_codes(tmp_path):
    contract, evidence = tmp_path / "c.json", tmp_path / "e.json"
    contract.write_text(json.dumps(example_contract()))
    evidence.write_text(json.dumps(example_evidence()))
    ok = runner.invoke(app, ["audit", str(contract), str(evidence)])
    assert ok.exit_code == 0 and "decision=PASS" in ok.output and "example=" not in ok.output
    bad = example_evidence()
    bad["applied"]["scale"] = 2.0
    evidence.write_text(json.dumps(bad))
    failed = runner.invoke(app, ["audit", str(contract), str(evidence)])
    assert failed.exit_code == 1
    assert "decision=FAIL" in failed.output and "reason=evidence applied scale 2.0" in failed.output


def test_audit_bad_input_is_a_usage_error(tmp_path):
    contract = tmp_path / "c.json"
    contract.write_text("{not json")
    result = runner.invoke(app, ["audit", str(contract), str(tmp_path / "missing.json")])
    assert result.exit_code == 2
    assert runner.invoke(app, ["audit", "--example", str(contract)]).exit_code == 2


def write_safetensors(path, shapes):
    header = {name: {"dtype": "F16", "shape": list(shape), "data_offsets": [0, 0]} for name, shape in shapes.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def llama_like(layers=2, heads=8, kv=2, head_dim=16, d_model=96, v_dim=None):
    v_dim = v_dim or head_dim
    shapes = {"model.embed_tokens.weight": (1000, d_model)}
    for i in range(layers):
        p = f"model.layers.{i}.self_attn."
        shapes |= {p + "q_proj.weight": (heads * head_dim, d_model), p + "k_proj.weight": (kv * head_dim, d_model),
                   p + "v_proj.weight": (kv * v_dim, d_model), p + "o_proj.weight": (d_model, heads * v_dim)}
    return shapes


def test_derive_takes_dimensions_from_the_tensors(tmp_path):
    ckpt = tmp_path / "model.safetensors"
    # head_dim 16 while d_model / heads = 12: the tensors, not the ratio, decide.
    write_safetensors(ckpt, llama_like(heads=8, kv=2, head_dim=16, d_model=96))
    contract = derive_contract([ckpt], {"num_attention_heads": 8, "num_key_value_heads": 2}, model_id="m")
    layer = contract.layers[0]
    assert (layer.d_model, layer.head_dim, layer.value_dim) == (96, 16, 16)
    assert layer.kv_groups == (0, 0, 0, 0, 1, 1, 1, 1)
    assert len(contract.layers) == 2 and contract.scale == pytest.approx(0.25)
    assert contract.model_revision.startswith("sha256:")
    assert contract.contract_id.startswith("attention-model-contract@sha256:")


def test_derive_refuses_a_config_the_tensors_contradict(tmp_path):
    ckpt = tmp_path / "model.safetensors"
    write_safetensors(ckpt, llama_like(heads=8, kv=2, head_dim=16))
    with pytest.raises(CheckpointError, match="num_key_value_heads 8 but k_proj gives 2"):
        derive_contract([ckpt], {"num_attention_heads": 8}, model_id="m")
    with pytest.raises(CheckpointError, match="head_dim 12 but q_proj gives 16"):
        derive_contract([ckpt], {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 12}, model_id="m")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointError, match="too short"):
        derive_contract([tmp_path / "junk.safetensors"], {"num_attention_heads": 8}, model_id="m")


def test_contract_derive_command(tmp_path):
    ckpt, config = tmp_path / "model.safetensors", tmp_path / "config.json"
    write_safetensors(ckpt, llama_like(layers=1, heads=4, kv=1, head_dim=8, d_model=32))
    config.write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 1}))
    result = runner.invoke(app, ["contract", "derive", str(ckpt), "--config", str(config), "--model-id", "tiny"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["contract"]["layers"][0]["kv_groups"] == [0, 0, 0, 0]  # MQA
    assert doc["contract_id"].startswith("attention-model-contract@sha256:")
