"""A served LLM with the attention tap, in the process that runs the model.

An HTTP server such as transformers' ``transformers serve`` loads its model in a process
of its own (spawned), which sees requests by internal ids only. :class:`TappedLoader`
wraps the server's model loader: that process loads the model as the server would, then
:meth:`ServedModel.start` attaches the tap, publishes the model contract (acknowledged
before the first request is served) and logs the revision. Each request reaches the
model with its trace id among its generation settings (:data:`REQUEST_ID_KEY`, put there
by :class:`~monitor.integrations.serving_ids.RequestIds` in the API process):

- plain ``generate`` (no continuous batching): :meth:`ServedModel.generate` takes the id
  out and runs the generation inside ``tap.request(id)``, on the thread that generates;
- continuous batching: :meth:`ServedModel.identify` tells the tap (``tap.identify``),
  before the request joins the batch, which id the engine's request is traced under.

Everything here is plain values and the tap's own verbs; how a particular server version
is reached is in :mod:`monitor.integrations.serving_transformers`. Counts (requests,
sampled, untraced by reason, and the tap's traces) are logged by the model's process
every ``log_interval_s`` while they change, and when it stops (SIGTERM flushes what is
queued first).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monitor.integrations.serving_ids import REQUEST_ID_KEY
from monitor.integrations.transformers import AttentionTap, attach
from monitor.producer import Scope, Topics, TraceProducer
from monitor.protocol.schema import IDENTIFIER_RULE, check_identifier

log = logging.getLogger(__name__)

#: why a request reaching the model is not traced (closed set, with the API side's)
MODEL_UNTRACED_REASONS = ("no_request_id", "invalid_request_id")


@dataclass(frozen=True)
class Publisher:
    """How the model's process reaches Kafka: kafka-python keyword arguments, the topics,
    and the key its traces and contracts are signed with (plain values from the
    ``ATTENTION_MONITOR_*`` settings, built once where the command starts)."""

    kafka: Mapping[str, Any]
    topics: Topics
    key_id: str
    secret: bytes = field(repr=False)

    def producer(self) -> TraceProducer:
        return TraceProducer(key_id=self.key_id, secret=self.secret, topics=self.topics, **dict(self.kafka))


@dataclass(frozen=True)
class ServeTap:
    """What the served model's tap does (see :func:`monitor.integrations.transformers.attach`
    for ``sample_rate``, ``rows``, ``decode_rows``, ``layers``, ``seed``, ``revision``).
    ``model_id``: the id traces carry (default: :func:`default_model_id` of the served
    name); ``continuous_batching``: the server batches continuously; ``log_interval_s``:
    how often the model's process logs its counts while they change;
    ``contract_timeout_s``: how long the contract's publication may take at start."""

    publisher: Publisher
    scope: Scope
    sample_rate: float = 0.01
    rows: int = 4
    decode_rows: int = 4
    layers: tuple[int, ...] | None = None
    seed: int = 0
    model_id: str | None = None
    revision: str | None = None
    producer_id: str | None = None
    queue_size: int = 1024
    continuous_batching: bool = False
    log_interval_s: float = 60.0
    contract_timeout_s: float = 30.0


def default_model_id(name: str) -> str:
    """The model id of a model served by ``name``: a local checkpoint's directory name,
    or a hub repository's id without its ``@revision`` or ``:file.gguf``."""
    repo = name.rpartition(":")[0] if name.endswith(".gguf") else name
    path = Path(repo)
    model_id = path.resolve().name if path.exists() else repo.partition("@")[0]
    try:
        return check_identifier(model_id, "model id")
    except ValueError as exc:
        raise ValueError(f"{exc}: give the model id traces carry with --model-id") from exc


class TappedLoader:
    """A server's model loader whose models are tapped: ``load_model_and_processor``
    loads as ``loader`` does, then starts the tap (:meth:`ServedModel.start`); every other
    attribute is ``loader``'s. Pickled into the model's process with the server's own."""

    def __init__(self, loader: Any, tap: ServeTap):
        self.loader = loader
        self.tap = tap

    def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> tuple[Any, Any]:
        model, processor = self.loader.load_model_and_processor(model_id, on_progress=on_progress)
        self.started(ServedModel.start(model, model_id, self.tap))
        return model, processor

    def started(self, served: ServedModel) -> None:
        """Called in the model's process once the tap is on (a server adapter's hook)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("loader", "tap"):  # unpickling asks before __dict__ is set
            raise AttributeError(name)
        return getattr(self.loader, name)


@dataclass
class ServeCounts:
    """Requests that reached the model: how many, how many sampled, untraced by reason."""

    requests: int = 0
    sampled: int = 0
    untraced: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODEL_UNTRACED_REASONS, 0))

    def line(self) -> str:
        reasons = " ".join(f"untraced_{reason}={n}" for reason, n in self.untraced.items())
        return f"requests={self.requests} sampled={self.sampled} {reasons}"


class ServedModel:
    """The tapped model in the model's process; made by :meth:`start`."""

    def __init__(self, model: Any, tap: AttentionTap, producer: TraceProducer, settings: ServeTap):
        self.model, self.tap, self.producer, self.settings = model, tap, producer, settings
        self.counts = ServeCounts()
        self._lock = threading.Lock()
        self._generate = model.generate
        self._closed = threading.Event()

    @classmethod
    def start(cls, model: Any, name: str, settings: ServeTap) -> ServedModel:
        """Attach the tap to ``model`` (served as ``name``), publish its contract and wait
        for the broker's acknowledgement; RuntimeError, saying why, when that fails (the
        server then stops: a model served without its contract would have every trace
        refused). Its ``generate`` is then traced by request id."""
        log_to_stderr()
        publisher = settings.publisher
        try:
            producer = publisher.producer()
        except Exception as exc:
            raise RuntimeError(f"attention tap: cannot reach Kafka at {publisher.kafka.get('bootstrap_servers')} "
                               f"(ATTENTION_MONITOR_BOOTSTRAP_SERVERS): {exc}") from exc
        try:
            tap = attach(model, producer, rows=settings.rows, sample_rate=settings.sample_rate,
                         layers=settings.layers, seed=settings.seed,
                         model_id=settings.model_id or default_model_id(name), revision=settings.revision,
                         scope=settings.scope, producer_id=settings.producer_id, queue_size=settings.queue_size,
                         decode_rows=settings.decode_rows)
        except Exception:
            producer.close(0)
            raise
        contract = tap.contract()
        try:
            producer.publish_contract(contract).get(timeout=settings.contract_timeout_s)
        except Exception as exc:
            tap.detach(0)
            producer.close(0)
            raise RuntimeError(f"attention tap: the contract of {contract.model_id} revision "
                               f"{contract.model_revision} was not acknowledged on {publisher.topics.contracts} "
                               f"within {settings.contract_timeout_s:g} s: {type(exc).__name__}: {exc}") from exc
        served = cls(model, tap, producer, settings)
        model.generate = served.generate
        log.info("attention tap on %s revision %s (contract %s, published to %s): sampling %g %% of requests, "
                 "%d prompt rows and %d decoding steps per layer, traces to %s", contract.model_id,
                 contract.model_revision, contract.contract_id, publisher.topics.contracts, settings.sample_rate * 100,
                 settings.rows, settings.decode_rows, publisher.topics.traces)
        threading.Thread(target=served._report, name="attention-tap-counts", daemon=True).start()
        served._stop_on_sigterm()
        return served

    # --- requests ------------------------------------------------------------------------

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate``, inside ``tap.request(id)`` when the request
        brought its trace id (:data:`REQUEST_ID_KEY`, taken out of ``kwargs``)."""
        with self.request(kwargs.pop(REQUEST_ID_KEY, None)):
            return self._generate(*args, **kwargs)

    @contextlib.contextmanager
    def request(self, request_id: Any) -> Iterator[None]:
        """Trace what runs inside under ``request_id`` (counted; untraced, never
        refused, without a valid one)."""
        reason = self._admit(request_id)
        if reason is not None:
            with self.tap.untraced():  # counted here, by reason: not also as the tap's outside_request
                yield
            return
        with self.tap.request(request_id):
            yield

    def identify(self, engine_id: str, request_id: Any) -> None:
        """Continuous batching: trace the engine's request ``engine_id`` under
        ``request_id``; call before the request joins the batch. (A request that came
        without a valid id is counted here; the tap then goes by its engine id.)"""
        if self._admit(request_id) is None:
            self.tap.identify(engine_id, request_id)

    def _admit(self, request_id: Any) -> str | None:
        """Count a request; None if it is traced under ``request_id``, else why not."""
        reason = None
        if request_id is None:
            reason = "no_request_id"
        else:
            try:
                check_identifier(request_id, "request id")
            except ValueError:
                reason = "invalid_request_id"
        with self._lock:
            self.counts.requests += 1
            if reason is not None:
                first = not self.counts.untraced[reason]
                self.counts.untraced[reason] += 1
            else:
                first = False
                self.counts.sampled += self.tap.sampled(request_id)
        if first:
            why = ("a generation reached the model without a trace id (from an endpoint that is not traced, such "
                   "as /v1/systemone)" if reason == "no_request_id" else
                   f"the X-Request-ID header {request_id!r} cannot be a trace's request id: it {IDENTIFIER_RULE} "
                   "(docs/serving.md)")
            log.warning("attention tap: %s; the request is served untraced, later ones are counted, not logged "
                        "(untraced_%s in the counts line)", why, reason)
        return reason

    # --- counts and stopping -------------------------------------------------------------

    def line(self) -> str:
        with self._lock:
            served = self.counts.line()
        return f"{served} traces: {self.tap.counts.line()}"

    def _report(self) -> None:
        last = self.line()
        while not self._closed.wait(self.settings.log_interval_s):
            line = self.line()
            if line != last:
                log.info("attention tap counts: %s", line)
                last = line

    def close(self, timeout: float = 3.0) -> None:
        """Hand what is queued to Kafka (within ``timeout`` seconds) and log the counts."""
        if self._closed.is_set():
            return
        self._closed.set()
        flushed = self.tap.flush(timeout)
        with contextlib.suppress(Exception):  # stopping: a broker error must not hide the counts line
            self.producer.flush(timeout)
        log.info("attention tap stopped: %s%s", self.line(), "" if flushed else " (queue not drained in time)")

    def _stop_on_sigterm(self) -> None:
        """The server stops its model's process with SIGTERM: flush first."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum: int, _frame: Any) -> None:
            self.close()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, stop)


def log_to_stderr() -> None:
    """The server's spawned processes do not configure logging: the tap's lines (start,
    counts, warnings) go to stderr at INFO."""
    logger = logging.getLogger("monitor")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
