"""Commands about models: the routing audit and model contracts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from monitor.cli.app import (
    EXIT_FAILED,
    EXIT_USAGE,
    app,
    contract_app,
    load_json,
)


@app.command()
def audit(
    contract: Annotated[Path | None, typer.Argument(help="contract JSON (docs/routing-audit.md)")] = None,
    evidence: Annotated[Path | None, typer.Argument(help="evidence JSON (docs/routing-audit.md)")] = None,
    example: Annotated[bool, typer.Option("--example", help="audit the illustrative two-head layer")] = False,
) -> None:
    """Audit one attention layer's frozen head records against its contract.

    Prints content identities of the contract, the projections and the combined
    result, the heads, token 0's combined output, and the decision. Exits 1 on FAIL.
    The audit checks form and identity only; it does not establish what a head does
    (see the policy in the README).
    """
    from monitor.routing.audit import audit_multi_head_routing, report_lines
    from monitor.routing.inputs import AuditInputError, contract_from_mapping, evidence_from_mapping

    if example == (contract is not None or evidence is not None):
        typer.echo("error: give either --example or both CONTRACT and EVIDENCE", err=True)
        raise typer.Exit(EXIT_USAGE)
    if example:
        from monitor.routing.example import example_contract, example_evidence

        docs = example_contract(), example_evidence()
    else:
        if contract is None or evidence is None:
            typer.echo("error: give both CONTRACT and EVIDENCE", err=True)
            raise typer.Exit(EXIT_USAGE)
        docs = load_json(contract, "contract"), load_json(evidence, "evidence")
    try:
        report = audit_multi_head_routing(contract_from_mapping(docs[0]), evidence_from_mapping(docs[1]))
    except AuditInputError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    if example:
        typer.echo("example=illustrative_only")
    for line in report_lines(report):
        typer.echo(line)
    if report.decision != "PASS":
        raise typer.Exit(EXIT_FAILED)


@contract_app.command("derive")
def contract_derive(
    checkpoint: Annotated[list[Path], typer.Argument(help="safetensors file(s) of the checkpoint")],
    config: Annotated[Path, typer.Option(help="the model's config.json (num_attention_heads, …)")],
    model_id: Annotated[str, typer.Option(help="the model id traces will carry")],
    mask: Annotated[str | None, typer.Option(help="causal or bidirectional (default: bidirectional for "
                                             "encoder model types such as bert, causal otherwise)")] = None,
    scale: Annotated[float | None, typer.Option(help="softmax scale (default head_dim ** -0.5)")] = None,
    revision: Annotated[str | None, typer.Option(help="revision (default: sha256 of the files)")] = None,
    pattern: Annotated[str | None, typer.Option(help="regex naming the attention projection tensors, with groups "
                                                "layer and proj (q|k|v|o, query|key|value, self.query, "
                                                "output.dense, …); default: the decoder, encoder and DistilBERT "
                                                "schemes")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="write here instead of stdout")] = None,
) -> None:
    """Derive the model contract from a checkpoint's tensor shapes and its config.

    Head counts, head dimensions and KV groups come from the tensors themselves; the
    config's num_attention_heads (and head_dim, num_key_value_heads when present) are
    checked against them. Knows Llama-style (model.layers.N.self_attn.q_proj) and
    BERT-style (encoder.layer.N.attention.self.query) names; --pattern for others.
    Prints the contract JSON with its contract_id.
    """
    from pydantic import ValidationError

    from monitor.checkpoint import CheckpointError, derive_contract

    if mask not in (None, "causal", "bidirectional"):
        typer.echo(f"error: --mask must be causal or bidirectional, got {mask!r}", err=True)
        raise typer.Exit(EXIT_USAGE)
    cfg = load_json(config, "config")
    try:
        model = derive_contract(checkpoint, cfg, model_id=model_id, mask=mask, scale=scale, revision=revision,
                                pattern=pattern)
    except (CheckpointError, ValidationError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    text = json.dumps({"contract_id": model.contract_id, "contract": model.canonical()}, indent=2)
    if output:
        output.write_text(text + "\n")
        typer.echo(f"contract_id={model.contract_id} written to {output}")
    else:
        typer.echo(text)
