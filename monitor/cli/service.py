"""Commands that run or look at the service: run, demo, produce, status, check-config, version."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from monitor.cli.app import (
    EXIT_FAILED,
    EXIT_USAGE,
    app,
    load_settings,
    setup_logging,
)


@app.command()
def run(log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = "INFO") -> None:
    """Consume traces and outcomes from Kafka, detect anomalies, serve /metrics.

    Configured by ATTENTION_MONITOR_* environment variables (see `check-config`).
    Needs every topic `topics create` makes, the internal observations, judge-state and
    pending-outcomes topics too (each stream is judged in one place, whatever the number
    of instances: docs/scaling.md); it refuses to start without them, naming them.
    Instances in one group (GROUP_ID) share the work; on one host each needs its own
    METRICS_PORT, CLIENT_ID and STATE_DIR.
    Stops cleanly on SIGTERM/SIGINT after flushing and committing the current batch.
    Exit codes: 0 stopped cleanly, 1 configuration error, 3 Kafka unreachable, a topic
    missing or not authorized, or outputs could not be written, 4 the measuring process
    (decode, metrics, detection run in a child process) died.
    """
    from monitor.errors import ConfigurationError
    from monitor.service.app import run_service

    setup_logging(log_level)
    settings = load_settings()
    try:
        code = run_service(settings)
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    raise typer.Exit(code)


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

    from monitor.service.http import MetricsServer
    from monitor.tools.demo import run_demo, summary

    setup_logging("ERROR")  # the summary reports the rejections; no per-record warnings here
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
    tenant: Annotated[str, typer.Option(help="the traces' tenant: one the key may sign")] = "demo",
    data_class: Annotated[str, typer.Option(help="the traces' data class")] = "synthetic",
) -> None:
    """Publish a synthetic model's contract, signed traces and outcomes to Kafka.

    Uses the same ATTENTION_MONITOR_* settings as `run` (broker, topics, keyring), so a
    deployment can be smoke-tested end to end. The traces are scoped --tenant and
    --data-class (demo:synthetic by default): the key must be allowed to sign that tenant
    and publish contracts, and the monitor's ALLOWED_SCOPES must allow the scope, or the
    monitor refuses every trace (scope_denied). With the README's keyring (key team-a)
    and scopes: --tenant team-a --data-class internal.
    """
    from monitor.errors import ConfigurationError
    from monitor.tools.produce import SyntheticTraffic, produce_synthetic, refusal

    if not synthetic:
        typer.echo("error: only --synthetic traffic can be produced", err=True)
        raise typer.Exit(EXIT_USAGE)
    settings = load_settings()
    try:
        keyring = settings.keyring()
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    kid = key_id or next(iter(sorted(keyring.keys)), None)
    key = keyring.key(kid) if kid else None
    if kid is None or key is None:
        typer.echo(f"error: key {kid!r} is not in the keyring", err=True)
        raise typer.Exit(EXIT_USAGE)
    refused = refusal(key, kid, tenant, data_class, settings.allowed_scopes)
    if refused is not None:
        typer.echo(f"error: {refused}", err=True)
        raise typer.Exit(EXIT_USAGE)
    traffic = SyntheticTraffic(model_id=model_id, revision=revision, requests=requests, rate=rate,
                               collapse_layer=collapse_layer, collapse_after=collapse_after, tenant=tenant,
                               data_class=data_class)
    sent = produce_synthetic(settings, traffic, kid, key.secret)
    typer.echo(f"published the contract of {model_id} {revision} and {sent} traces with outcomes")


@app.command()
def status(
    url: Annotated[list[str] | None, typer.Option(
        help="a live instance's /metrics (default: from the settings); give every instance's, --url once each, "
             "for the fleet's view")] = None,
) -> None:
    """Which reference judges every layer, whether it is ready, and what is open.

    Per model revision and layer: the revision whose reference judges it, the traces
    that reference holds and whether it is ready, traces nothing judged (learning, or
    pinned to a reference not ready), and open incidents; then the pins and promotions.
    Read from the saved reference state (ATTENTION_MONITOR_STATE_DIR) and the live
    services' /metrics: with several --url, traces add up and a layer is ready when the
    instance that judges it says so. A --url may leave out http:// (host:port/metrics).
    Exits 1 when nothing can be read: no instance answered and no saved state."""
    from monitor.tools.status import gather, report

    settings = load_settings()
    s = settings
    host = "127.0.0.1" if s.metrics_address in ("0.0.0.0", "::", "") else s.metrics_address
    targets = url or [f"{'https' if s.metrics_tls_cert else 'http'}://{host}:{s.metrics_port}/metrics"]
    auth = (s.metrics_basic_auth_user, s.metrics_basic_auth_password.get_secret_value()) \
        if s.metrics_basic_auth_user and s.metrics_basic_auth_password else None
    found = gather(s.state_dir, targets, settings.detector(), auth, s.metrics_tls_cert)
    typer.echo(report(found, s.reference_traces), nl=False)
    if not found.answered and not found.layers and not found.decisions:
        raise typer.Exit(EXIT_FAILED)


@app.command("check-config")
def check_config() -> None:
    """Print the effective settings (secrets masked) and check they can be used."""
    from monitor.errors import ConfigurationError

    settings = load_settings()
    for name, value in settings.masked().items():
        typer.echo(f"{name}={value}")
    try:
        keyring = settings.keyring()
        settings.scopes()
        settings.detector()
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    if (warning := settings.measuring_warning()) is not None:
        typer.echo(f"warning: {warning}")
    for key_id in keyring.legacy:
        typer.echo(f"warning: key {key_id} is a bare secret: it may sign any tenant and publish contracts; "
                   "give it tenants (attention-monitor keyring new writes the form)")
    typer.echo("configuration ok")


@app.command()
def version() -> None:
    """Print the version."""
    from monitor import __version__

    typer.echo(__version__)
