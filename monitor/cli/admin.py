"""Administration and on-call: topics, keyrings, reference decisions, triage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from monitor.cli.app import (
    EXIT_USAGE,
    acls_app,
    app,
    keyring_app,
    load_settings,
    reference_app,
    topics_app,
)
from monitor.errors import ExitCode


@topics_app.command("create")
def topics_create(
    partitions: Annotated[int, typer.Option(min=1, help="partitions of the traces, outcomes, anomalies, observations, "
                                            "judge-state and pending-outcomes topics: at most this many instances "
                                            "share the work")] = 12,
    replication_factor: Annotated[int, typer.Option(help="-1: the broker's default.replication.factor")] = -1,
) -> None:
    """Create the monitor's topics on the broker of ATTENTION_MONITOR_BOOTSTRAP_SERVERS,
    with their configured names: traces, outcomes, anomalies (same partition count, so a
    trace and its outcome meet in one instance), compacted contracts, dead letters, and
    the internal observations, judge state and pending outcomes (kept a day longer than
    OUTCOME_WINDOW_S).
    Topics that already exist are left as they are. Exits 3 when the broker refuses."""
    from monitor.broker.admin import create_topics
    from monitor.errors import InfrastructureError
    from monitor.protocol.topics import layout

    settings = load_settings()
    specs = layout(settings.topics(), partitions, settings.outcome_window_s)
    try:
        done = create_topics(settings.kafka_connection(), specs, replication_factor, settings.startup_timeout_s)
    except InfrastructureError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    for spec in specs:
        configs = " ".join(f"{k}={v}" for k, v in spec.configs.items())
        typer.echo(f"{spec.name}: {done.get(spec.name, 'exists')} ({spec.partitions} partitions{' ' if configs else ''}"
                   f"{configs})")


@acls_app.command("apply")
def acls_apply(
    principal: Annotated[str, typer.Option(help="e.g. User:monitor")],
    role: Annotated[str, typer.Option(help="monitor, model-server or operator")],
) -> None:
    """Create the ACLs a principal of the given role needs (and nothing more), on the
    topics and group of these settings, as a principal allowed to alter ACLs (the
    admin). The broker denies everything else (allow.everyone.if.no.acl.found=false)."""
    from monitor.broker.acls import ROLES, apply_acls
    from monitor.errors import InfrastructureError

    if role not in ROLES or not principal.startswith("User:"):
        typer.echo(f"error: --role must be one of {', '.join(ROLES)} and --principal User:<name>", err=True)
        raise typer.Exit(EXIT_USAGE)
    settings = load_settings()
    try:
        count = apply_acls(settings.kafka_connection(), principal, role, settings.topics(), settings.group_id)
    except InfrastructureError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    typer.echo(f"{principal}: {count} ACLs of role {role}")


@keyring_app.command("new")
def keyring_new(
    path: Annotated[Path, typer.Argument(help="the keyring file to write (refused if it exists)")],
    key_id: Annotated[list[str], typer.Option("--key-id", help="a key id (repeatable), e.g. the team or server "
                                              "that signs with it")],
    tenant: Annotated[list[str] | None, typer.Option("--tenant", help="a tenant the keys may sign traces of "
                                                     "(repeatable; default: each key's own id)")] = None,
    contracts: Annotated[bool, typer.Option(help="the keys may publish model contracts")] = True,
) -> None:
    """Write a new keyring: one random 32-byte secret per key id, as JSON, readable by
    its owner only. Each key may sign only its tenants' traces and, unless
    --no-contracts, publish model contracts. Give the same file to the monitor
    (ATTENTION_MONITOR_KEYRING_FILE) and to each signer its own key id and secret."""
    import os
    import secrets

    from monitor.errors import ConfigurationError
    from monitor.protocol.access import Keyring

    tenants = {kid: tenant or [kid] for kid in key_id}
    doc = {kid: {"secret": secrets.token_urlsafe(32), "tenants": tenants[kid], "contracts": contracts}
           for kid in key_id}
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
    typer.echo(f"wrote {path}: " + "; ".join(f"{k} signs tenants {', '.join(t)}" for k, t in tenants.items()))


def _decide(target: str, action: str, reference: str | None, by: str | None) -> None:
    import getpass
    import time

    from pydantic import ValidationError

    from monitor.broker.admin import publish_decision
    from monitor.errors import InfrastructureError
    from monitor.protocol.decisions import ReferenceDecision, parse_target

    settings = load_settings()
    try:
        model, revision = parse_target(target)
        decision = ReferenceDecision(model_id=model, revision=revision, action=action, reference=reference,
                                     at=time.time(), by=by or getpass.getuser())
    except (ValueError, ValidationError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        publish_decision(settings.kafka_connection(), settings.references_topic, decision)
    except InfrastructureError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    typer.echo(f"{decision.key}: {action}{' to ' + reference if reference else ''} published on "
               f"{settings.references_topic} (by {decision.by}); every monitor instance applies it and logs it")


@reference_app.command("promote")
def reference_promote(
    target: Annotated[str, typer.Argument(help="MODEL@REVISION")],
    by: Annotated[str | None, typer.Option(help="who decides (default: your user name)")] = None,
) -> None:
    """Make a revision its own reference: it learns a reference afresh from its next traces.

    The only way a pinned revision stops being judged by its pin. Do it once someone has
    checked the revision is healthy: a promoted regression becomes the new normal."""
    _decide(target, "promote", None, by)


@reference_app.command("pin")
def reference_pin(
    target: Annotated[str, typer.Argument(help="MODEL@REVISION")],
    to: Annotated[str, typer.Option("--to", help="the revision whose reference judges it")],
    by: Annotated[str | None, typer.Option(help="who decides (default: your user name)")] = None,
) -> None:
    """Judge a revision by another revision's reference (it learns none of its own)."""
    _decide(target, "pin", to, by)


@reference_app.command("list")
def reference_list() -> None:
    """The reference decisions on the references topic, the latest per revision."""
    from monitor.broker.admin import read_decisions
    from monitor.errors import InfrastructureError

    settings = load_settings()
    try:
        table = read_decisions(settings.kafka_connection(), settings.references_topic, settings.startup_timeout_s)
    except InfrastructureError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    for d in sorted(table.decisions.values(), key=lambda d: d.key):
        what = f"pinned to {d.reference}" if d.action == "pin" else "promoted"
        typer.echo(f"{d.key}: {what} by {d.by} at {d.at:.0f}")
    if not table.decisions:
        typer.echo("no decisions: every revision learns its own reference (unless pinned in the settings)")


@app.command()
def triage(
    model: Annotated[str | None, typer.Option(help="model id")] = None,
    revision: Annotated[str | None, typer.Option(help="model revision")] = None,
    layer: Annotated[int | None, typer.Option(help="layer number")] = None,
    kind: Annotated[str | None, typer.Option(help="low_diversity, entropy_collapse, concentration_spike, sink_shift")]
    = None,
    incident: Annotated[str | None, typer.Option(help="one incident id (as the alert or `triage` names it)")] = None,
    html: Annotated[Path | None, typer.Option(help="write self-contained HTML instead of text: a file for --incident "
                                              "or a full --model/--revision/--layer selection, otherwise a "
                                              "directory with index.html and one page per incident")] = None,
    last: Annotated[int, typer.Option(help="records to read from the end of each partition")] = 2000,
) -> None:
    """Summarise recent incidents and anomaly records for on-call, as text or as HTML
    pages (head-similarity heatmaps against the reference, per-head timelines, the
    strongest evidence, the outcome association).

    Heads involved, values against the reference, outcomes, contract ids. With
    --incident, or a full --model/--revision/--layer selection, the text and the page
    show the same incident: the same findings, traces and heads. A prompt for
    investigation, never a pruning command."""
    from monitor.broker.tail import read_tail
    from monitor.errors import InfrastructureError
    from monitor.triage import evidence, outcomes, page, site
    from monitor.triage.text import report, select

    settings = load_settings()
    try:
        records = read_tail(settings.kafka_connection(), [settings.anomalies_topic], last)
    except InfrastructureError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    case = None
    if incident is not None or None not in (model, revision, layer):  # the text and the page show one case
        case = (evidence.for_incident(records, incident) if incident is not None
                else evidence.for_layer(records, str(model), str(revision), int(layer or 0)))
        if case is None:
            typer.echo(f"error: no incident {incident!r} in the last {last} records of each partition of "
                       f"{settings.anomalies_topic}", err=True)
            raise typer.Exit(EXIT_USAGE)
    if html is None:
        if case is not None:
            shown = [r for r in case.records if kind is None or r.get("kind") == kind]
            typer.echo(report(shown, [case] if case.incident is not None else [], records), nl=False)
            if case.incident is None and not case.healthy:  # an incident's are in its lines
                typer.echo("\n".join(outcomes.describe(case.outcomes)))
        else:
            typer.echo(report(select(records, model, revision, layer, kind),
                              evidence.incident_cases(records, model, revision, layer), records), nl=False)
        return
    if case is not None:
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text(page.render(case), encoding="utf-8")
        typer.echo(f"wrote {html}" + (" (nothing to investigate)" if case.healthy else ""))
        return
    written = site.write_site(records, html, model, revision, layer)
    typer.echo(f"wrote {written[0]} and {len(written) - 1} incident pages")
