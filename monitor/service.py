"""The Kafka loop: poll a batch, hand it to the pipeline, flush its outputs, commit, repeat.

Delivery is at-least-once: offsets are committed only after the batch's outputs are
flushed, and never past a trace still waiting in the join buffer; re-processing after a
crash is idempotent by trace id (the measurer's de-duplication window, plus a read-back
of the output topics when a partition changes hands).

SIGTERM or SIGINT ends the loop after the current batch: outputs are flushed, offsets
committed, reference state saved and clients closed, then the process exits 0. Exit
codes are :class:`~monitor.errors.ExitCode`: 1 configuration error; 3 Kafka unreachable,
a topic missing or not authorized, or writing outputs failed after retries; 4 the
process that measures traces died.

Measuring (decode, metrics, detection) runs in a child process by default
(:mod:`monitor.measuring`): the service polls the next batch while the child measures
this one and the pipeline's thread accounts for earlier ones, up to
``batches_in_flight`` batches at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from monitor.assignment import Assignment
from monitor.broker.group import GroupConsumer
from monitor.broker.outputs import OutputProducer
from monitor.broker.tables import TableReader
from monitor.broker.tail import emitted_sources
from monitor.errors import ExitCode, InfrastructureError, MeasuringFailed
from monitor.exporter import MonitorMetrics
from monitor.http import MetricsServer
from monitor.measure import MeasurerSpec
from monitor.measuring import MeasuringProcess, MeasuringThread, start_measuring
from monitor.memory import reuse_freed_memory
from monitor.model_contract import ContractTable
from monitor.pipeline import Batch, Pipeline
from monitor.records import Record
from monitor.references import ReferenceTable
from monitor.settings import Settings
from monitor.state_file import StateFile

log = logging.getLogger(__name__)
RETRIES = 5
T = TypeVar("T")


class Service:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        self.topics = settings.topics()
        self.metrics = MonitorMetrics(self.registry, detail_level=settings.detail_level,
                                      max_model_revisions=settings.max_model_revisions,
                                      model_allowlist=settings.model_allowlist)
        self.contracts = ContractTable()
        self.references = ReferenceTable()
        self.assignment = Assignment()
        self.state_file = None if settings.state_dir is None else StateFile.for_instance(
            settings.state_dir, settings.group_id, settings.client_id)
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self._state_saving: Future[dict[str, Any]] | None = None
        self._saved_at = time.monotonic()

    def request_stop(self, *_: Any) -> None:
        self.stopping.set()

    def run(self) -> ExitCode:
        s = self.settings
        server = MetricsServer(
            self.registry, address=s.metrics_address, port=s.metrics_port, tls_cert=s.metrics_tls_cert,
            tls_key=s.metrics_tls_key, ready=self.ready.is_set,
            basic_auth=(s.metrics_basic_auth_user, s.metrics_basic_auth_password.get_secret_value())
            if s.metrics_basic_auth_user and s.metrics_basic_auth_password else None,
        ).start()
        log.info("serving %s/metrics", server.url)
        kafka = s.kafka_config()
        consumer = producer = None
        readers: list[TableReader] = []
        measuring: MeasuringThread | MeasuringProcess | None = None
        pipeline: Pipeline | None = None
        try:
            if s.reuse_freed_memory:
                reuse_freed_memory()
            detector = s.detector()
            state = None if self.state_file is None else self.state_file.load(detector)
            spec = MeasurerSpec(s.keyring(), s.scopes(), s.limits(), detector, s.dedupe_window, state,
                                logging.getLogger().getEffectiveLevel(), s.reuse_freed_memory)
            measuring = start_measuring(spec, s.measure_processes)
            pipeline = Pipeline(measuring, metrics=self.metrics, topics=self.topics, join_ttl=s.join_ttl_s,
                                join_max_entries=s.join_max_entries, incident_quiet=s.incident_quiet_s)
            for topic, table in ((self.topics.contracts, self.contracts), (self.topics.references, self.references)):
                readers.append(TableReader(kafka, topic, table))
                readers[-1].load(s.startup_timeout_s)
            log.info("%d model contracts and %d reference decisions loaded", len(self.contracts),
                     len(self.references.decisions))
            producer = OutputProducer(kafka)
            consumer = GroupConsumer(kafka, s.group_id, [self.topics.traces, self.topics.outcomes],
                                     max_records=s.batch_max_records,
                                     max_partition_fetch_bytes=s.fetch_partition_bytes)
            consumer.check_topics([self.topics.traces, self.topics.outcomes, self.topics.anomalies,
                                   self.topics.dead_letter])
            consumer.subscribe()
            self._loop(consumer, readers, producer, measuring, pipeline)
            return ExitCode.OK
        except InfrastructureError as exc:
            log.error("stopping: %s", exc)
            return ExitCode.INFRASTRUCTURE
        except MeasuringFailed as exc:
            log.error("stopping: %s", exc)
            return ExitCode.MEASURING
        finally:
            self.ready.clear()
            if pipeline is not None:
                pipeline.close()
            if measuring is not None:
                self._save_final_state(measuring)
                measuring.close()
            for client in (consumer, *readers, producer):
                if client is not None:
                    client.close()
            server.stop()

    def _loop(self, consumer: GroupConsumer, readers: list[TableReader], producer: OutputProducer,
              measuring: MeasuringThread | MeasuringProcess, pipeline: Pipeline) -> None:
        """Poll a batch and hand it to the pipeline at once; flush and commit batches in
        order as they complete. Up to ``batches_in_flight`` polled batches are measured
        or accounted for at once, so the measuring worker always has the next one
        queued. A rebalance waits for every batch in flight, then is acted on, and only
        then does the pipeline get the poll that brought it."""
        s = self.settings
        running: deque[Future[Batch]] = deque()
        while not self.stopping.is_set():
            records = _retry(lambda: consumer.poll(s.poll_timeout_ms), "poll")
            revoked, assigned = consumer.changes.take()
            self.assignment.revoke(revoked)  # not committed for from here on
            for reader in readers:
                reader.refresh()
            if any(r.topic == self.topics.traces for r in records):
                # a model server publishes a contract just before its first traces: read the
                # contracts topic to its end as of now, so those traces find it
                _retry(lambda: readers[0].load(s.startup_timeout_s), "read contracts")
            measuring.check()  # a dead measuring process stops the service even when no traffic comes
            measuring.sync_contracts(self.contracts)
            measuring.sync_decisions(self.references)
            if revoked or assigned:
                self.metrics.rebalances.inc()
                while running:
                    self._complete(running.popleft().result(), consumer, producer)
                if assigned:
                    records = self._reassign(consumer, pipeline, assigned, records)
            running.append(pipeline.process(records))
            while len(running) > s.batches_in_flight or (running and running[0].done()):
                self._complete(running.popleft().result(), consumer, producer)
            self.metrics.contracts.set(len(self.contracts))
            self.metrics.lag.set(consumer.lag(self.topics.traces))
            self.ready.set()
            self._maybe_save_state(measuring)
        while running:
            self._complete(running.popleft().result(), consumer, producer)
        log.info("stop requested: last batch flushed and committed")

    def _complete(self, batch: Batch, consumer: GroupConsumer, producer: OutputProducer) -> None:
        """Flush a batch's outputs, then commit what it allows, for partitions still
        owned (a rebalance while it ran may have moved some elsewhere)."""
        producer.send(batch.outputs)
        _retry(producer.flush, "flush outputs")
        # Positions of parked partitions are kept (they may come back in the new
        # assignment and resume there); only partitions surely still ours are committed.
        owned = self.assignment.owned
        consumer.positions.update({tp: o for tp, o in batch.positions.items() if tp in owned})
        committing = self.assignment.committing
        offsets = {tp: o for tp, o in batch.committable.items() if tp in committing}
        if offsets:
            _retry(lambda: consumer.commit(offsets), "commit")
            self.metrics.commits.inc()

    def _reassign(self, consumer: GroupConsumer, pipeline: Pipeline, assigned: set[tuple[str, int]],
                  records: list[Record]) -> list[Record]:
        """Act on a completed rebalance, with no batch in flight; returns the records of
        the poll that brought it still to process (see :mod:`monitor.assignment`)."""
        change = self.assignment.assign(assigned, records, consumer.positions)
        consumer.forget(change.lost)
        consumer.seek(change.resume)
        emitted = set()
        if change.new:
            committed = consumer.committed(change.new)
            emitted = emitted_sources(self.settings.kafka_config(), [self.topics.anomalies, self.topics.dead_letter],
                                      change.new, committed, self.settings.dedupe_window)
            log.info("assigned %s; %d outputs already written for them", sorted(change.new), len(emitted))
        if change.kept:
            log.info("rebalanced; kept %d partitions, resuming them where this instance left off", len(change.kept))
        pipeline.reassign({tp: o for tp, o in consumer.positions.items() if tp in assigned},
                          {p for t, p in change.lost if t == self.topics.traces}, emitted)
        return change.records

    def _maybe_save_state(self, measuring: MeasuringThread | MeasuringProcess) -> None:
        """Ask the measurer for its state every ``state_save_interval_s``; write it when
        it arrives (a later iteration), so the loop never waits for it."""
        if self.state_file is None:
            return
        if self._state_saving is not None and self._state_saving.done():
            self.state_file.save(self._state_saving.result())
            self._state_saving = None
        if self._state_saving is None and time.monotonic() - self._saved_at >= self.settings.state_save_interval_s:
            self._saved_at = time.monotonic()
            self._state_saving = measuring.state()

    def _save_final_state(self, measuring: MeasuringThread | MeasuringProcess) -> None:
        if self.state_file is None:
            return
        try:
            self.state_file.save(measuring.state().result())
        except MeasuringFailed as exc:
            log.error("reference state not saved: %s", exc)


def _retry(action: Callable[[], T], what: str) -> T:
    delay = 0.2
    for attempt in range(RETRIES):
        try:
            return action()
        except InfrastructureError as exc:
            if not exc.retriable or attempt == RETRIES - 1:
                raise
            log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def run_service(settings: Settings) -> ExitCode:
    service = Service(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, service.request_stop)
    return service.run()
