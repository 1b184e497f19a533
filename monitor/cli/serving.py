"""Commands for a served LLM: serve it with the attention tap, and send the outcomes of its
completions by the ids the API returned."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from monitor.cli.app import EXIT_FAILED, EXIT_USAGE, app, load_settings, plain_problems
from monitor.errors import ExitCode

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _share(value: float) -> float:
    """A share from 0 to 1 (checked here rather than by typer's range, whose
    ``[0.0<=x<=1.0]`` does not fit a narrow terminal's option column)."""
    if not 0.0 <= value <= 1.0:
        raise typer.BadParameter(f"{value} is not a share from 0 to 1")
    return value


@app.command(context_settings=_PASS_THROUGH, options_metavar="[MODEL] [OPTIONS]")
def serve(
    ctx: typer.Context,
    sample_rate: Annotated[float, typer.Option(metavar="SHARE", callback=_share,
                                               help="share of requests traced, 0 to 1, decided by a hash of "
                                               "the request's id")] = 0.01,
    rows: Annotated[int, typer.Option(min=1, help="prompt rows per trace")] = 4,
    decode_rows: Annotated[int, typer.Option(min=0, help="decoding steps per trace, spread over the answer plus "
                                             "the last (0: none)")] = 4,
    layers: Annotated[str | None, typer.Option(help="comma-separated layers to trace (default: all)")] = None,
    sample_seed: Annotated[int, typer.Option(help="seed of the sampling hash and of the rows chosen")] = 0,
    model_id: Annotated[str | None, typer.Option(help="the model id traces carry (default: the checkpoint "
                                                 "directory's name, or the hub repository's id)")] = None,
    model_revision: Annotated[str | None, typer.Option(help="the revision traces carry (default: the checkpoint "
                                                       "files' sha256, as `contract derive` names it)")] = None,
    tenant: Annotated[str, typer.Option(help="scope of the traces: tenant")] = "default",
    data_class: Annotated[str, typer.Option(help="scope of the traces: data class")] = "internal",
    key_id: Annotated[str | None, typer.Option(help="keyring key that signs traces and the contract (default: the "
                                               "first)")] = None,
    producer_id: Annotated[str | None, typer.Option(help="producer id traces carry (default: the host name)")]
    = None,
    queue_size: Annotated[int, typer.Option(min=1, help="traces waiting to be sent; beyond, dropped and "
                                            "counted (generation never waits)")] = 1024,
    tap_log_interval: Annotated[float, typer.Option(min=1.0, help="seconds between the model process's counts "
                                                    "lines (while they change)")] = 60.0,
    contract_timeout: Annotated[float, typer.Option(min=1.0, help="seconds the model contract's publication may "
                                                    "take at start")] = 30.0,
) -> None:
    """Run transformers' own OpenAI-compatible server with the attention tap.

    Give the MODEL to serve (a checkpoint directory or a hub id), then, in any order, the
    options below and those of `transformers serve`. Every option not listed here is
    `transformers serve`'s own, passed on as is
    (`transformers serve --help` lists them: --port, --host, --continuous-batching,
    --attn-implementation, --api-server-count, --device, ...).

    The model's process attaches the tap after loading the model and publishes the model
    contract before the first request; it logs the revision, then its counts every
    --tap-log-interval seconds. Each completion is traced under the id its client knows:
    the X-Request-ID it sent, or else the id the API returns (chatcmpl-..., cmpl-...,
    resp_...). Send its outcome later with `attention-monitor outcome ID success|failure`.

    Kafka, topics and keyring come from the ATTENTION_MONITOR_* settings, as for `run`.
    Exit codes: 0 stopped (Ctrl-C, SIGTERM or SIGINT to its process or its process
    group), 1 unusable settings, an unsupported transformers, or the server stopped on an
    error (the model or its contract could not be loaded or published), 2 bad usage, 3
    the server could not start (its --host and --port in use). docs/serving.md explains.
    """
    from monitor.errors import ConfigurationError
    from monitor.producer import Scope

    settings = load_settings()
    try:
        keyring = settings.keyring()
        scope = Scope(tenant=tenant, data_class=data_class)
        chosen = _layers(layers)
    except ConfigurationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    kid = key_id or next(iter(sorted(keyring.keys)), None)
    secret = keyring.secret(kid) if kid else None
    if kid is None or secret is None:
        typer.echo(f"error: key {kid!r} is not in the keyring", err=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        from monitor.integrations.serving import Publisher, ServeTap
        from monitor.integrations.serving_transformers import serve_command, unsupported
    except ImportError as exc:
        typer.echo(f"error: serving needs torch and transformers' server: pip install 'attention-monitor[serving]' "
                   f"({exc})", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    if (problem := unsupported()) is not None:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(EXIT_FAILED)
    tap = ServeTap(Publisher(settings.kafka_connection().kafka_python(), settings.topics(), kid, secret), scope,
                   sample_rate=sample_rate, rows=rows, decode_rows=decode_rows, layers=chosen, seed=sample_seed,
                   model_id=model_id, revision=model_revision, producer_id=producer_id, queue_size=queue_size,
                   log_interval_s=tap_log_interval, contract_timeout_s=contract_timeout)
    _run(serve_command(tap), ctx.args)


def _layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"--layers must be comma-separated layer numbers, got {text!r}") from exc


def _run(command: Any, args: list[str]) -> None:
    """Run transformers' server command on ``args``: SIGTERM and SIGINT stop it cleanly
    (exit 0), its usage errors exit 2, its failures 1, a server that cannot start (its
    address in use) 3."""
    import click

    try:
        with _stopped_cleanly():
            try:
                code = command.main(args=list(args), prog_name="attention-monitor serve", standalone_mode=False)
            finally:
                _children_stopped(CHILDREN_STOP_S)
    except _Stop:
        code = 0
    except SystemExit as exc:
        if exc.code != UVICORN_STARTUP_FAILURE:
            raise
        typer.echo("error: the server could not start (the error above; a --host and --port in use by another "
                   "process is the usual cause)", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    except click.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    except click.exceptions.Abort as exc:
        raise typer.Exit(ExitCode.INTERRUPTED) from exc
    except (RuntimeError, ValueError, ImportError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc
    raise typer.Exit(code if isinstance(code, int) else 0)


#: the exit code uvicorn ends the process with when the server cannot start (its address in use)
UVICORN_STARTUP_FAILURE = 3
#: seconds the server's processes get to stop once it has (the model's flushes the tap's queue)
CHILDREN_STOP_S = 10.0


def _children_stopped(timeout: float) -> None:
    """Wait for the processes the server spawned (the model's, API processes) to exit,
    terminating, then killing, those still running after ``timeout`` seconds."""
    import multiprocessing
    import time

    deadline = time.monotonic() + timeout
    children = multiprocessing.active_children()
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.terminate()
            child.join(2)
        if child.is_alive():
            child.kill()
            child.join()


class _Stop(BaseException):
    """SIGTERM or SIGINT before the server took its signals over (while loading)."""


@contextlib.contextmanager
def _stopped_cleanly() -> Iterator[None]:
    """SIGTERM and SIGINT stop the server with exit 0. uvicorn takes both over while it
    serves: it stops the server (whose shutdown stops the model's process, which flushes
    the tap), then raises the signal again; our handler, restored by then, makes that a
    clean stop instead of the default death by SIGTERM (143) or KeyboardInterrupt (130).
    Before uvicorn serves (the model loading) the same handler stops the command; the
    spawned processes exit with it. Several API processes: transformers' own handlers
    exit 0 the same way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise _Stop

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@app.command()
def outcome(
    request_id: Annotated[str | None, typer.Argument(metavar="ID", help="the completion's id, as the API returned "
                                                     "it (or the X-Request-ID the client sent)")] = None,
    result: Annotated[str | None, typer.Argument(metavar="OUTCOME", help="success or failure (what metrics and "
                                                 "alerts count); may be left out when --label implies it")] = None,
    label: Annotated[str | None, typer.Option(help="how it was given: thumbs_down, regenerate, abandoned, escalated "
                                              "(failure), thumbs_up, accepted (success), or any lower-case word")]
    = None,
    score: Annotated[float | None, typer.Option(help="a grade from 0 to 1")] = None,
    from_file: Annotated[Path | None, typer.Option("--from", help="send many instead: JSON lines as the outcomes "
                                                   'topic holds them, {"request_id": ..., "outcome": ..., "label": '
                                                   '..., "score": ..., "timestamp": ...} (all but the id optional '
                                                   "as above); - reads stdin")] = None,
    timestamp: Annotated[float | None, typer.Option(help="when the outcome was known, epoch seconds (default: "
                                                    "now)")] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for Kafka, to connect and for its "
                                           "acknowledgement")] = 30.0,
) -> None:
    """Send the outcome of a completion, joined by the monitor to its traces.

    ID is the id the API returned (chatcmpl-..., cmpl-..., resp_...) or the X-Request-ID
    the client sent. The outcome goes to the outcomes topic keyed by the id, as
    TraceProducer.send_outcome sends it (docs/wire-format.md), so it meets the
    completion's traces in one monitor instance. Kafka settings come from
    ATTENTION_MONITOR_* as for `run` (no keyring needed: outcomes are not signed; Kafka's
    ACLs decide who may write them).
    Exit codes: 0 every outcome acknowledged, 1 unusable settings, 2 bad usage or an
    invalid id, outcome or line (nothing is sent then), 3 Kafka unreachable or did not
    acknowledge. Acknowledged is stored, not matched: an outcome whose id no trace has
    counts in the monitor's attention_monitor_outcomes_unmatched_total once its join
    window (ATTENTION_MONITOR_JOIN_TTL_S) has passed.
    """
    records = _outcomes(request_id, result, from_file, {"label": label, "score": score, "timestamp": timestamp})
    settings = load_settings()
    topic = settings.topics().outcomes
    try:
        sent = _send(records, settings, timeout)
    except _NotAcknowledged as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(ExitCode.INFRASTRUCTURE) from exc
    if len(records) == 1:
        record = records[0]
        graded = "".join(f" {name} {value}" for name, value in (("label", record.label), ("score", record.score))
                         if value is not None)
        typer.echo(f"outcome {record.outcome}{graded} of {record.request_id} acknowledged by Kafka on {topic} "
                   f"(partition {sent[0][0]}, offset {sent[0][1]})")
    else:
        typer.echo(f"{len(records)} outcomes acknowledged by Kafka on {topic}")
    typer.echo(_UNMATCHED_NOTE)


#: what an acknowledgement does not say (an outcome is matched to traces later, by the monitor)
_UNMATCHED_NOTE = ("(Kafka's acknowledgement says the outcome was stored, not that a trace has its id: an outcome "
                   "that meets no trace within the monitor's join window, ATTENTION_MONITOR_JOIN_TTL_S, counts in "
                   "attention_monitor_outcomes_unmatched_total)")


class _NotAcknowledged(Exception):
    pass


def _outcomes(request_id: str | None, result: str | None, from_file: Path | None,
              options: dict[str, Any]) -> list[Any]:
    """The outcome records to send, every one validated first (exit 2 naming the first
    bad one); ``options``: what the command line gives every record (a line's own win)."""
    import time

    from pydantic import ValidationError

    from monitor.producer import TaskOutcome

    if (request_id is None) == (from_file is None) or (from_file is not None and result is not None):
        typer.echo("error: give ID and OUTCOME (or --label), or --from FILE, not both", err=True)
        raise typer.Exit(EXIT_USAGE)
    given = {name: value for name, value in options.items() if value is not None}
    given.setdefault("timestamp", time.time())
    source = "stdin" if str(from_file) == "-" else str(from_file)
    if from_file is None:
        entries: list[tuple[str, Any]] = [("", {"request_id": request_id, "outcome": result, **given})]
    else:
        try:
            text = sys.stdin.read() if str(from_file) == "-" else from_file.read_text()
        except OSError as exc:
            typer.echo(f"error: cannot read {source}: {exc.strerror}", err=True)
            raise typer.Exit(EXIT_USAGE) from exc
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                typer.echo(f"error: {source} line {number} is not JSON: {exc}", err=True)
                raise typer.Exit(EXIT_USAGE) from exc
            entries.append((f"{source} line {number}: ", {**given, **entry} if isinstance(entry, dict) else entry))
    records = []
    for where, entry in entries:
        try:
            records.append(TaskOutcome.model_validate(entry))
        except ValidationError as exc:
            typer.echo(f"error: {where}{plain_problems(exc)} (docs/wire-format.md says what an outcome record holds)",
                       err=True)
            raise typer.Exit(EXIT_USAGE) from exc
    if not records:
        typer.echo(f"error: {source} holds no outcome", err=True)
        raise typer.Exit(EXIT_USAGE)
    return records


def _send(records: list[Any], settings: Any, timeout: float) -> list[tuple[int, int]]:
    """Send and wait for each record's acknowledgement: (partition, offset) of each."""
    from monitor.producer import TraceProducer

    connection = settings.kafka_connection()
    try:
        # outcomes are not signed: the producer's key is never used for them
        producer = TraceProducer(key_id="outcomes", secret=b"", topics=settings.topics(),
                                 **{**connection.kafka_python(), "bootstrap_timeout_ms": int(timeout * 1000)})
    except Exception as exc:  # kafka-python's errors (no broker, bad security settings)
        raise _NotAcknowledged(f"cannot reach Kafka at {connection.bootstrap_servers} "
                               "(ATTENTION_MONITOR_BOOTSTRAP_SERVERS): "
                               f"{_reason(exc)}") from exc
    try:
        futures = [producer.send_outcome(r.request_id, r.outcome, r.timestamp, label=r.label, score=r.score)
                   for r in records]
        sent = []
        for record, future in zip(records, futures, strict=True):
            try:
                metadata = future.get(timeout=timeout)
            except Exception as exc:
                raise _NotAcknowledged(f"the outcome of {record.request_id} was not acknowledged on "
                                       f"{settings.topics().outcomes} within {timeout:g} s: "
                                       f"{_reason(exc)}") from exc
            sent.append((int(metadata.partition), int(metadata.offset)))
        return sent
    finally:
        producer.close(timeout)


def _reason(exc: BaseException) -> str:
    """An exception as ``Name: message``, once (kafka-python's messages often begin with
    their class's name already)."""
    name, message = type(exc).__name__, str(exc)
    return message if message.startswith(name) else f"{name}: {message}" if message else name
