"""The run loop: poll a batch, process it, flush its outputs, commit, repeat.

Delivery is at-least-once: offsets are committed only after the batch's outputs are
flushed, and never past a record still waiting in the join buffer. Re-processing is
idempotent: traces are de-duplicated by trace id within a bounded window, and when a
partition is (re)assigned the tail of the output topics is read back so outputs
already written for it are not written again.

SIGTERM or SIGINT ends the loop after the current batch: outputs are flushed, offsets
committed, reference state saved and clients closed, then the process exits 0.
Exit codes: 0 stopped cleanly; 1 configuration error; 3 Kafka unreachable, a topic
missing or not authorized, or writing outputs failed after retries; 4 the process that
measures traces died.

The trace stage (decode, metrics, detection) runs in a child process by default
(:mod:`monitor.runner`): the service polls the next batch and the child measures it while
a thread of the service accounts for earlier ones (exporter, join, outputs), up to
``batches_in_flight`` batches at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from monitor.broker.consumer import ContractReader, GroupConsumer, OutputProducer, emitted_sources
from monitor.core.detect import Detector
from monitor.errors import InfrastructureError
from monitor.exporter import MonitorMetrics
from monitor.http import MetricsServer
from monitor.memory import reuse_freed_memory
from monitor.model_contract import ContractTable
from monitor.pipeline import Output, Pipeline, Record, Topics
from monitor.runner import StageFailed, StageRunner, StageSpec
from monitor.settings import Settings
from monitor.stage import Result

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Batch:
    outputs: list[Output]
    positions: dict[tuple[str, int], int]  #: next offset to read, after this batch
    committable: dict[tuple[str, int], int]  #: safe to commit once the outputs are flushed
EXIT_OK, EXIT_CONFIG, EXIT_INFRA, EXIT_STAGE = 0, 1, 3, 4
RETRIES = 5


class Service:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        self.topics = Topics(settings.traces_topic, settings.outcomes_topic, settings.contracts_topic,
                             settings.anomalies_topic, settings.dead_letter_topic)
        self.metrics = MonitorMetrics(self.registry, detail_level=settings.detail_level,
                                      max_model_revisions=settings.max_model_revisions,
                                      model_allowlist=settings.model_allowlist)
        self.contracts = ContractTable()
        self.pipeline = Pipeline(metrics=self.metrics, remote_stage=True, topics=self.topics,
                                 join_ttl=settings.join_ttl_s, join_max_entries=settings.join_max_entries)
        self.runner: StageRunner | None = None
        self._state_saving: Future[Any] | None = None
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self._state_path = _state_path(settings)
        self._owned: set[tuple[str, int]] = set()
        self._parked: set[tuple[str, int]] = set()
        #: next offset to read of each partition, after the batches accounted for so far
        #: (the pipeline thread's view; consumer.positions follows it batch by batch)
        self._progress: dict[tuple[str, int], int] = {}
        self._saved_at = time.monotonic()

    def request_stop(self, *_: Any) -> None:
        self.stopping.set()

    def run(self) -> int:
        s = self.settings
        server = MetricsServer(
            self.registry, address=s.metrics_address, port=s.metrics_port, tls_cert=s.metrics_tls_cert,
            tls_key=s.metrics_tls_key, ready=self.ready.is_set,
            basic_auth=(s.metrics_basic_auth_user, s.metrics_basic_auth_password.get_secret_value())
            if s.metrics_basic_auth_user and s.metrics_basic_auth_password else None,
        ).start()
        log.info("serving %s/metrics", server.url)
        kafka = s.kafka_config()
        consumer = reader = producer = None
        try:
            if s.reuse_freed_memory:
                reuse_freed_memory()
            spec = StageSpec(s.keyring(), s.scopes(), s.limits(), s.detector(), s.dedupe_window, self._load_state(),
                             logging.getLogger().getEffectiveLevel(), s.reuse_freed_memory)
            self.runner = StageRunner(spec, processes=1 if s.stage_process else 0)
            reader = ContractReader(kafka, self.topics.contracts, self.contracts)
            log.info("%d model contracts loaded", reader.load(s.startup_timeout_s))
            producer = OutputProducer(kafka)
            consumer = GroupConsumer(kafka, s.group_id, [self.topics.traces, self.topics.outcomes],
                                     max_records=s.batch_max_records,
                                     max_partition_fetch_bytes=s.fetch_partition_bytes)
            consumer.check_topics([self.topics.traces, self.topics.outcomes, self.topics.anomalies,
                                   self.topics.dead_letter])
            consumer.subscribe()
            self._loop(consumer, reader, producer)
            return EXIT_OK
        except InfrastructureError as exc:
            log.error("stopping: %s", exc)
            return EXIT_INFRA
        except StageFailed as exc:
            log.error("stopping: %s", exc)
            return EXIT_STAGE
        finally:
            self.ready.clear()
            self._shut_stage()
            for client in (consumer, reader, producer):
                if client is not None:
                    client.close()
            server.stop()

    def _loop(self, consumer: GroupConsumer, reader: ContractReader, producer: OutputProducer) -> None:
        """Poll a batch and hand its traces to the stage at once, while a thread accounts
        for earlier batches (exporter, join, outputs); flush and commit those in order.
        Up to ``batches_in_flight`` polled batches are measured or accounted for at once,
        so the measuring process always has the next one queued. A rebalance waits for
        every batch in flight, then is acted on, and only then does the stage get the
        poll that brought it. Pipeline state is only touched by that thread, or while it
        is idle."""
        s = self.settings
        runner = self.runner
        assert runner is not None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline") as worker:
            running: deque[Future[_Batch]] = deque()
            while not self.stopping.is_set():
                records = _retry(lambda: consumer.poll(s.poll_timeout_ms), "poll")
                revoked, assigned = consumer.changes.take()
                self._parked |= revoked  # not committed for from here on
                reader.refresh()
                runner.check()  # a dead measuring process stops the service even when no traffic comes
                runner.sync_contracts(self.contracts)
                if revoked or assigned:
                    while running:
                        self._complete(running.popleft().result(), consumer, producer)
                    records = self._apply_rebalance(consumer, revoked, assigned, records)
                measuring = runner.submit(self._traces(records))
                running.append(worker.submit(self._process, records, measuring))
                while len(running) > s.batches_in_flight or (running and running[0].done()):
                    self._complete(running.popleft().result(), consumer, producer)
                self.metrics.contracts.set(len(self.contracts))
                self.metrics.lag.set(consumer.lag(self.topics.traces))
                self.ready.set()
                self._maybe_save_state()
            while running:
                self._complete(running.popleft().result(), consumer, producer)
        log.info("stop requested: last batch flushed and committed")

    def _traces(self, records: list[Record]) -> list[Record]:
        return [r for r in records if r.topic == self.topics.traces]

    def _process(self, records: list[Record], measuring: list[Future[list[Result]]]) -> _Batch:
        assert self.runner is not None
        results = self.runner.results(measuring)
        outputs = []
        for record in records:
            if record.topic == self.topics.traces:
                outputs += self.pipeline.apply(record, next(results))
            else:
                outputs += self.pipeline.process(record)
            self._progress[(record.topic, record.partition)] = record.offset + 1
        outputs += self.pipeline.expire()
        return _Batch(outputs, dict(self._progress), self.pipeline.committable(self._progress))

    def _complete(self, batch: _Batch, consumer: GroupConsumer, producer: OutputProducer) -> None:
        """Flush a batch's outputs, then commit what it allows, for partitions still
        owned (a rebalance while it ran may have moved some elsewhere)."""
        producer.send(batch.outputs)
        _retry(producer.flush, "flush outputs")
        # Positions of parked partitions are kept (they may come back in the new
        # assignment and resume there); only partitions surely still ours are committed.
        consumer.positions.update({tp: o for tp, o in batch.positions.items() if tp in self._owned})
        committing = self._owned - self._parked
        offsets = {tp: o for tp, o in batch.committable.items() if tp in committing}
        if offsets:
            _retry(lambda: consumer.commit(offsets), "commit")
            self.metrics.commits.inc()

    def _apply_rebalance(self, consumer: GroupConsumer, revoked: set[tuple[str, int]],
                         assigned: set[tuple[str, int]], records: list[Record]) -> list[Record]:
        """Act on assignment changes, with the worker idle; returns the records of the
        poll that brought them which are still to be processed. A revocation only parks
        the partitions: the rebalance is complete when the new assignment arrives, and
        only then is the state of partitions that went elsewhere dropped.

        Kept partitions resume where this instance left off. The poll that brought the
        rebalance may already hold records of them, read from wherever the consumer's
        position was reset to: those below the position reached are dropped (processed
        already), and the partition resumes after the last one kept, never before it."""
        if revoked or assigned:
            self.metrics.rebalances.inc()
        if not assigned:
            return records
        lost = self._parked - assigned
        kept = assigned & self._owned
        new = assigned - self._owned
        self._parked, self._owned = set(), set(assigned)
        consumer.forget(lost)
        dropped = self.pipeline.drop_partitions({p for t, p in lost if t == self.topics.traces})
        if self.runner is not None:
            self.runner.forget(dropped)
        reached = {tp: consumer.positions[tp] for tp in kept if tp in consumer.positions}
        records = [r for r in records if (r.topic, r.partition) in assigned
                   and r.offset >= reached.get((r.topic, r.partition), -1)]
        for r in records:
            tp = (r.topic, r.partition)
            if tp in reached:
                reached[tp] = max(reached[tp], r.offset + 1)
        consumer.seek(reached)
        self._progress = {tp: o for tp, o in consumer.positions.items() if tp in assigned}
        if kept:
            log.info("rebalanced; kept %d partitions, resuming them where this instance left off", len(kept))
        if new:
            committed = consumer.committed(new)
            found = emitted_sources(self.settings.kafka_config(), [self.topics.anomalies, self.topics.dead_letter],
                                    new, committed, self.settings.dedupe_window)
            self.pipeline.already_emitted |= found
            log.info("assigned %s; %d outputs already written for them", sorted(new), len(found))
        return records

    def _load_state(self) -> dict[str, Any] | None:
        if self._state_path is None or not self._state_path.exists():
            return None
        try:
            state: dict[str, Any] = json.loads(self._state_path.read_text())
            Detector(self.settings.detector()).merge_state(state)  # refused here, not by the stage at its start
            log.info("reference state loaded from %s", self._state_path)
            return state
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable reference state %s: %s", self._state_path, exc)
            return None

    def _maybe_save_state(self) -> None:
        """Ask the stage for its state every ``state_save_interval_s``; write it when it
        arrives (a later iteration), so the loop never waits for it."""
        if self.runner is None or self._state_path is None:
            return
        if self._state_saving is not None and self._state_saving.done():
            self._write_state(self._state_saving.result())
            self._state_saving = None
        if self._state_saving is None and time.monotonic() - self._saved_at >= self.settings.state_save_interval_s:
            self._saved_at = time.monotonic()
            self._state_saving = self.runner.state_future()

    def _shut_stage(self) -> None:
        """Save the final state and stop the stage (its process, if any)."""
        if self.runner is None:
            return
        try:
            if self._state_path is not None:
                self._write_state(self.runner.state())
        except StageFailed as exc:
            log.error("reference state not saved: %s", exc)
        finally:
            self.runner.close()

    def _write_state(self, state: dict[str, Any]) -> None:
        if self._state_path is None:
            return
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self._state_path)


def _state_path(settings: Settings) -> Path | None:
    if settings.state_dir is None:
        return None
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    name = f"{settings.group_id}-{settings.client_id}-{socket.gethostname()}".replace(os.sep, "_")
    return settings.state_dir / f"reference-{name}.json"


def _retry(action: Any, what: str) -> Any:
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


def run_service(settings: Settings) -> int:
    service = Service(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, service.request_stop)
    return service.run()
