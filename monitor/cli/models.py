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
    checkpoint: Annotated[list[Path], typer.Argument(help="the checkpoint directory (its model.safetensors, or the "
                                                     "files its index names), or safetensors file(s)")],
    model_id: Annotated[str, typer.Option(help="the model id traces will carry")],
    config: Annotated[Path | None, typer.Option(help="the model's config.json (num_attention_heads, …); default: "
                                                "config.json in the checkpoint directory")] = None,
    mask: Annotated[str | None, typer.Option(help="causal or bidirectional (default: bidirectional for "
                                             "encoder model types such as bert, causal otherwise)")] = None,
    scale: Annotated[float | None, typer.Option(help="softmax scale (default head_dim ** -0.5)")] = None,
    revision: Annotated[str | None, typer.Option(help="revision (default: the sha256 of the files' sha256 "
                                                 "digests, as sha256sum lists them; the revision the "
                                                 "transformers tap gives a model loaded from them)")] = None,
    pattern: Annotated[str | None, typer.Option(help="regex naming the attention projection tensors, with groups "
                                                "layer and proj (q|k|v|o, query|key|value, self.query, "
                                                "output.dense, …); default: the decoder, encoder and DistilBERT "
                                                "schemes")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="write here instead of stdout")] = None,
) -> None:
    """Derive the model contract from a checkpoint's tensor shapes and its config.

    Head counts, head dimensions and KV groups come from the tensors themselves; the
    config's num_attention_heads (and head_dim, num_key_value_heads when present) are
    checked against them. Knows decoder (model.layers.N.self_attn.q_proj, Phi-3's
    qkv_proj), BERT-style (encoder.layer.N.attention.self.query), DistilBERT and GPT-2
    (fused c_attn) names; --pattern for others. The revision is the sha256 of the files'
    sha256 digests (taken from the Hub's cache or an earlier naming on this machine when
    known, else read once), the same the transformers tap names a model loaded from this
    checkpoint by (in any dtype), so a pin by this revision pins that model's traces.
    Prints the contract JSON with its contract_id.
    """
    from pydantic import ValidationError

    from monitor.protocol.contract_derivation import CheckpointError, checkpoint_files, derive_contract

    if mask not in (None, "causal", "bidirectional"):
        typer.echo(f"error: --mask must be causal or bidirectional, got {mask!r}", err=True)
        raise typer.Exit(EXIT_USAGE)
    directory = checkpoint[0] if len(checkpoint) == 1 and checkpoint[0].is_dir() else None
    if config is None:
        if directory is None:
            typer.echo("error: give --config (config.json) when naming checkpoint files", err=True)
            raise typer.Exit(EXIT_USAGE)
        config = directory / "config.json"
    cfg = load_json(config, "config")
    try:
        files = checkpoint if directory is None else checkpoint_files(directory)
        model = derive_contract(files, cfg, model_id=model_id, mask=mask, scale=scale, revision=revision,
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


@app.command()
def study(
    models: Annotated[list[str], typer.Argument(help="model directories (or hub ids already cached): each is one "
                                                "checkpoint or revision; the study repeats on each")],
    eval_set: Annotated[Path, typer.Option("--eval", help="JSONL evaluation set: per line 'text' (or 'input_ids') "
                                           "and what the metric needs ('label', 'labels', 'candidates')")],
    heads: Annotated[list[str], typer.Option("--heads", help="a head set under study, as LAYER.HEAD list "
                                             "('2.3,2.4') or as incidents name them ('2:head-3'); repeatable")],
    metric: Annotated[str, typer.Option(help="accuracy (sequence classification), loglik (causal LM), retrieval "
                                        "(embedding model: 'candidates' and 'label'), or module:function")]
    = "accuracy",
    seeds: Annotated[str, typer.Option(help="comma-separated seeds: each repeat splits, draws controls and "
                                       "resamples anew")] = "0,1,2",
    mode: Annotated[str, typer.Option(help="mean: a head's output becomes its mean over the selection split; "
                                      "zero: it becomes zero")] = "mean",
    controls: Annotated[int, typer.Option(min=2, help="draws per control family (random, magnitude-matched)")] = 20,
    holdout: Annotated[float, typer.Option(min=0.05, max=0.95, help="share of examples held out for the "
                                           "verdict")] = 0.5,
    resamples: Annotated[int, typer.Option(min=100, help="bootstrap resamples")] = 2000,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    output: Annotated[Path, typer.Option("--output", "-o", help="directory for result.json, report.html and the "
                                         "scores that let an interrupted study resume")] = Path("study"),
    progress: Annotated[bool, typer.Option(help="progress bar on stderr")] = True,
) -> None:
    """A controlled head-ablation study: does ablating these heads hurt the task more
    than ablating random heads and heads of the same output magnitude?

    On held-out examples, with bootstrap intervals, repeated over seeds and models.
    Verdict per head set: ESTABLISHED only when every repeat agrees, else
    NOT_ESTABLISHED with the reason. Evidence about what heads do; never a
    recommendation to prune. Needs the transformers extra. docs/study.md explains.
    """
    try:
        from monitor.integrations.ablation_study import EvalSet, StudyConfig, load_metric, load_models, run_study
        from monitor.study.design import parse_heads
        from monitor.study.report import render
    except ImportError as exc:
        typer.echo(f"error: the study needs torch and transformers: pip install 'attention-monitor[transformers]' "
                   f"({exc})", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        head_sets = tuple(parse_heads(text) for text in heads)
        seed_list = tuple(int(s) for s in seeds.split(",") if s.strip())
        if mode not in ("mean", "zero"):
            raise ValueError(f"--mode must be mean or zero, got {mode!r}")
        score = load_metric(metric)
        evalset = EvalSet.load(eval_set)
        if not seed_list:
            raise ValueError("give at least one seed")
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        checkpoints, tokenizer = load_models(models, metric, needs_tokenizer=any("input_ids" not in row
                                                                                 for row in evalset.rows))
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    config = StudyConfig(head_sets, seed_list, mode, controls, holdout=holdout, resamples=resamples,  # type: ignore[arg-type]
                         batch_size=batch_size)
    try:
        result = run_study(checkpoints, tokenizer, evalset, metric, config, metric=score, cache_dir=output,
                           progress=progress).to_dict()
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    (output / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (output / "report.html").write_text(render(result))
    for head_set in result["head_sets"]:
        typer.echo(f"{', '.join(head_set['heads'])}: {head_set['verdict']} — {head_set['reasons'][0]}")
    typer.echo(f"wrote {output / 'result.json'} and {output / 'report.html'} ({result['seconds']} s)")
