"""The ``attention-monitor`` command line.

Exit codes (:class:`monitor.errors.ExitCode`): 0 success; 1 a check failed (an audit
FAIL, an invalid configuration); 2 bad usage or unreadable input; 3 an infrastructure
error (broker unreachable, authorization refused) after retries; 4 the service's
measuring process died; 130 interrupted.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from monitor.errors import ExitCode

app = typer.Typer(
    name="attention-monitor",
    help="Watch the attention heads of transformer models in production.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
contract_app = typer.Typer(help="Model contracts: what a model revision's attention layers are.",
                           no_args_is_help=True)
app.add_typer(contract_app, name="contract")
topics_app = typer.Typer(help="The monitor's Kafka topics.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")
keyring_app = typer.Typer(help="Keyrings: the HMAC keys traces are signed with.", no_args_is_help=True)
app.add_typer(keyring_app, name="keyring")

EXIT_FAILED = ExitCode.FAILED
EXIT_USAGE = ExitCode.USAGE


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        typer.echo(f"error: cannot read {what} {path}: {exc.strerror}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    except json.JSONDecodeError as exc:
        typer.echo(f"error: {what} {path} is not JSON: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc


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
        docs = _load_json(contract, "contract"), _load_json(evidence, "evidence")
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
    cfg = _load_json(config, "config")
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


@topics_app.command("create")
def topics_create(
    partitions: Annotated[int, typer.Option(min=1, help="partitions of the traces, outcomes and anomalies topics: "
                                            "at most this many instances share the work")] = 12,
    replication_factor: Annotated[int, typer.Option(help="-1: the broker's default.replication.factor")] = -1,
) -> None:
    """Create the monitor's topics on the broker of ATTENTION_MONITOR_BOOTSTRAP_SERVERS,
    with their configured names: traces, outcomes, anomalies (same partition count, so a
    trace and its outcome meet in one instance), compacted contracts, dead letters.
    Topics that already exist are left as they are. Exits 3 when the broker refuses."""
    from monitor.broker.admin import create_topics
    from monitor.errors import InfrastructureError
    from monitor.topics import layout

    settings = _settings()
    specs = layout(settings.topics(), partitions)
    try:
        done = create_topics(settings.kafka_config(), specs, replication_factor, settings.startup_timeout_s)
    except InfrastructureError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    for spec in specs:
        configs = " ".join(f"{k}={v}" for k, v in spec.configs.items())
        typer.echo(f"{spec.name}: {done.get(spec.name, 'exists')} ({spec.partitions} partitions{' ' if configs else ''}"
                   f"{configs})")


@keyring_app.command("new")
def keyring_new(
    path: Annotated[Path, typer.Argument(help="the keyring file to write (refused if it exists)")],
    key_id: Annotated[list[str], typer.Option("--key-id", help="a key id (repeatable), e.g. the team or server "
                                              "that signs with it")],
) -> None:
    """Write a new keyring: one random 32-byte secret per key id, as JSON, readable by
    its owner only. Give the same file to the monitor (ATTENTION_MONITOR_KEYRING_FILE)
    and to each signer its own key id and secret."""
    import os
    import secrets

    from monitor.access import Keyring
    from monitor.errors import ConfigurationError

    doc = {kid: secrets.token_urlsafe(32) for kid in key_id}
    try:
        Keyring.from_json(json.dumps(doc))
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        typer.echo(f"error: cannot create {path}: {exc.strerror}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    typer.echo(f"wrote {path} with key ids {', '.join(doc)}")


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="where /metrics is served while the demo runs (0: any free port)")] = 9464,
    pace: Annotated[float, typer.Option(help="seconds between simulated requests")] = 0.03,
    requests: Annotated[int, typer.Option(help="requests per model revision")] = 240,
    keep_serving: Annotated[bool, typer.Option("--keep-serving", help="keep /metrics up after the summary")] = False,
) -> None:
    """Run the monitor's pipeline on built-in synthetic traces; no Kafka needed.

    Two revisions of a synthetic model; the second is pinned to the first's reference
    and develops low head diversity in layer 2. Serves /metrics while it runs, then
    prints per-layer metrics, the anomalies raised with their outcomes, and the policy.
    """
    from prometheus_client import CollectorRegistry

    from monitor.http import MetricsServer
    from monitor.tools.demo import run_demo, summary

    _logging("ERROR")  # the summary reports the rejections; no per-record warnings here
    registry = CollectorRegistry()
    try:
        server = MetricsServer(registry, address="127.0.0.1", port=port).start()
    except OSError as exc:
        typer.echo(f"error: cannot serve /metrics on port {port}: {exc.strerror}; try --port 0", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    typer.echo(f"attention-monitor demo: serving {server.url}/metrics; simulating {requests} requests per revision")
    result = run_demo(registry, requests=requests, pace=pace)
    typer.echo(summary(result, registry))
    if keep_serving:
        typer.echo(f"/metrics stays up at {server.url}/metrics; Ctrl-C to stop")
        import signal
        import threading

        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        with contextlib.suppress(KeyboardInterrupt):
            done.wait()
    server.stop()


def _settings() -> Any:
    from pydantic import ValidationError

    from monitor.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        typer.echo(f"error: invalid settings:\n{exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)


@app.command()
def run(log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = "INFO") -> None:
    """Consume traces and outcomes from Kafka, detect anomalies, serve /metrics.

    Configured by ATTENTION_MONITOR_* environment variables (see `check-config`).
    Stops cleanly on SIGTERM/SIGINT after flushing and committing the current batch.
    Exit codes: 0 stopped cleanly, 1 configuration error, 3 Kafka unreachable, a topic
    missing or not authorized, or outputs could not be written, 4 the measuring process
    (decode, metrics, detection run in a child process) died.
    """
    from monitor.errors import ConfigurationError
    from monitor.service import run_service

    _logging(log_level)
    settings = _settings()
    try:
        code = run_service(settings)
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    raise typer.Exit(code)


@app.command()
def produce(
    synthetic: Annotated[bool, typer.Option("--synthetic", help="built-in synthetic traffic (required)")] = False,
    requests: Annotated[int, typer.Option(help="requests to simulate (one trace per layer each)")] = 1000,
    rate: Annotated[float, typer.Option(help="requests per second")] = 20.0,
    model_id: Annotated[str, typer.Option(help="model id of the synthetic model")] = "demo-lm",
    revision: Annotated[str, typer.Option(help="its revision")] = "rev-1",
    collapse_layer: Annotated[int | None, typer.Option(help="a layer whose heads drift together")] = None,
    collapse_after: Annotated[int, typer.Option(help="requests before the drift starts")] = 300,
    key_id: Annotated[str | None, typer.Option(help="keyring key to sign with (default: the first)")] = None,
) -> None:
    """Publish a synthetic model's contract, signed traces and outcomes to Kafka.

    Uses the same ATTENTION_MONITOR_* settings as `run` (broker, topics, keyring), so a
    deployment can be smoke-tested end to end. Traces are scoped tenant demo, data class
    synthetic: allow that scope in the monitor.
    """
    from monitor.errors import ConfigurationError
    from monitor.tools.produce import SyntheticTraffic, produce_synthetic

    if not synthetic:
        typer.echo("error: only --synthetic traffic can be produced", err=True)
        raise typer.Exit(EXIT_USAGE)
    settings = _settings()
    try:
        keyring = settings.keyring()
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    kid = key_id or next(iter(sorted(keyring.keys)), None)
    secret = keyring.secret(kid) if kid else None
    if kid is None or secret is None:
        typer.echo(f"error: key {kid!r} is not in the keyring", err=True)
        raise typer.Exit(EXIT_USAGE)
    traffic = SyntheticTraffic(model_id=model_id, revision=revision, requests=requests, rate=rate,
                               collapse_layer=collapse_layer, collapse_after=collapse_after)
    sent = produce_synthetic(settings, traffic, kid, secret)
    typer.echo(f"published the contract of {model_id} {revision} and {sent} traces with outcomes")


@app.command()
def triage(
    model: Annotated[str | None, typer.Option(help="model id")] = None,
    revision: Annotated[str | None, typer.Option(help="model revision")] = None,
    layer: Annotated[int | None, typer.Option(help="layer number")] = None,
    kind: Annotated[str | None, typer.Option(help="low_diversity, entropy_collapse, concentration_spike, sink_shift")]
    = None,
    last: Annotated[int, typer.Option(help="records to read from the end of each partition")] = 2000,
) -> None:
    """Summarise recent anomaly records for on-call: heads involved, values against the
    reference, outcomes, contract ids. A prompt for investigation, never a pruning command."""
    from monitor.broker.tail import read_tail
    from monitor.errors import InfrastructureError
    from monitor.tools.triage import report, select

    settings = _settings()
    try:
        records = read_tail(settings.kafka_config(), [settings.anomalies_topic], last)
    except InfrastructureError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    typer.echo(report(select(records, model, revision, layer, kind)), nl=False)


@app.command("check-config")
def check_config() -> None:
    """Print the effective settings (secrets masked) and check they can be used."""
    from monitor.errors import ConfigurationError

    settings = _settings()
    for name, value in settings.masked().items():
        typer.echo(f"{name}={value}")
    try:
        settings.keyring()
        settings.scopes()
        settings.detector()
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    typer.echo("configuration ok")


@app.command()
def version() -> None:
    """Print the version."""
    from monitor import __version__

    typer.echo(__version__)


def main() -> None:
    import prometheus_client

    # `_created` samples would double every counter and histogram series (docs/metrics.md).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    app()
