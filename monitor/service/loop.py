"""The Kafka loop: poll a batch, hand it to the pipeline, commit its outputs with its
offsets, repeat.

The batches that finish within ``COMMIT_INTERVAL_MS`` have their outputs and
offsets committed together, in one Kafka transaction (:mod:`monitor.service.delivery`), never
past a trace still waiting in the join buffer;
re-processing after a crash is idempotent by trace id (the measurer's de-duplication
window, rebuilt from the committed outputs whenever a partition is assigned).

SIGTERM or SIGINT ends the loop after the current batch: outputs are flushed, offsets
committed, reference state saved and clients closed, then the process exits 0. Exit
codes are :class:`~monitor.errors.ExitCode`: 1 configuration error; 3 Kafka unreachable,
a topic missing or not authorized, or writing outputs failed after retries; 4 the
process that measures traces died.

Measuring (decode, metrics, detection) runs in a child process by default
(:mod:`monitor.measuring.workers`): the service polls the next batch while the child measures
this one and the pipeline's thread accounts for earlier ones, up to
``batches_in_flight`` batches at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from monitor.broker.connection import Connection
from monitor.broker.group import GroupMember, client_versions
from monitor.broker.outputs import OutputProducer
from monitor.broker.tables import TableReader
from monitor.broker.tail import read_back, read_range
from monitor.core.key_state import KeyState
from monitor.core.pins import Pins
from monitor.errors import ExitCode, InfrastructureError, MeasuringFailed, TraceRejected
from monitor.measuring.measurer import MeasurerSpec
from monitor.measuring.tuning import YOUNG_THRESHOLD, collect_less, reuse_freed_memory
from monitor.measuring.workers import Measuring
from monitor.protocol import judge_state, observations
from monitor.protocol.access import contract_verifier
from monitor.protocol.codec import named_contract
from monitor.protocol.decisions import ReferenceTable
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Record, Source
from monitor.service.assignment import Assignment
from monitor.service.delivery import Delivery
from monitor.service.exporter import MonitorMetrics
from monitor.service.health import Health
from monitor.service.http import MetricsServer
from monitor.service.pins import PinCheck, follow
from monitor.service.pipeline import Batch, Pipeline
from monitor.service.state_file import StateFile
from monitor.settings import Settings

log = logging.getLogger(__name__)
RETRIES = 5
#: how often the broker is asked for the trace partitions' end offsets (lag and liveness)
LAG_INTERVAL_S = 2.0
#: how often the contracts and references topics are read for news (a trace naming a
#: contract not known yet makes the service read the contracts topic to its end at once)
TABLES_INTERVAL_S = 0.25
T = TypeVar("T")


class Service:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        self.topics = settings.topics()
        self.limits = settings.limits()
        self.metrics = MonitorMetrics(self.registry, detail_level=settings.detail_level,
                                      max_model_revisions=settings.max_model_revisions,
                                      model_allowlist=settings.model_allowlist,
                                      max_layer_series=settings.max_layer_series)
        if settings.triage_url and settings.triage_records:
            self.metrics.triage_at(settings.triage_url)
        elif settings.triage_url:
            log.warning("TRIAGE_URL is set but TRIAGE_RECORDS is 0: no triage pages are served, alerts link to none")
        self.contracts = ContractTable()  # verifying, once the keyring is read (run)
        self.references = ReferenceTable()
        #: which revision judges which, for routing a trace to its judge: the settings' pins,
        #: the saved state's and the references topic's, by the judge's own rule (run)
        self.routing = Pins()
        self.pins = PinCheck(self.routing)
        self._partitions: dict[str, int] = {}  #: partition counts of the topics checked at start
        self._warned_shared = False
        self._pins_version = 0  #: the references table's decisions taken into the routing rule
        self.assignment = Assignment()
        self.state_file = None if settings.state_dir is None else StateFile(settings.state_dir, settings.instance())
        self.stopping = threading.Event()
        self.health = Health(stale_s=max(15.0, 3 * LAG_INTERVAL_S))
        self._state_saving: Future[dict[str, Any]] | None = None
        self._saved_at = time.monotonic()

    def request_stop(self, *_: Any) -> None:
        self.stopping.set()

    def triage_page(self, path: str, query: str) -> str:
        """A /triage/ page, from the committed tail of the anomalies topic (read afresh
        for every page: an on-call page, not a dashboard)."""
        from monitor.broker.tail import read_tail
        from monitor.triage.site import respond

        records = read_tail(self.settings.kafka_connection(), [self.topics.anomalies], self.settings.triage_records,
                            timeout_s=15.0)
        return respond(records, path, query)

    def run(self) -> ExitCode:
        s = self.settings
        server = MetricsServer(
            self.registry, address=s.metrics_address, port=s.metrics_port, tls_cert=s.metrics_tls_cert,
            tls_key=s.metrics_tls_key, ready=self.health.ready, idle_timeout_s=s.metrics_idle_timeout_s,
            basic_auth=(s.metrics_basic_auth_user, s.metrics_basic_auth_password.get_secret_value())
            if s.metrics_basic_auth_user and s.metrics_basic_auth_password else None,
            pages=self.triage_page if s.triage_records else None,
        ).start()
        log.info("serving %s/metrics", server.url)
        kafka = s.kafka_connection()
        consumer = producer = None
        readers: list[TableReader] = []
        measuring: Measuring | None = None
        pipeline: Pipeline | None = None
        try:
            if s.reuse_freed_memory:
                reuse_freed_memory()
            detector = s.detector()
            keyring = s.keyring()
            self.contracts = ContractTable(contract_verifier(keyring), s.max_contracts)
            state = None if self.state_file is None else self.state_file.load(detector)
            spec = MeasurerSpec(keyring, s.scopes(), s.limits(), detector, s.dedupe_window, state,
                                logging.getLogger().getEffectiveLevel(), s.reuse_freed_memory,
                                judges=s.judging == "instance")
            processes = s.measuring_processes()
            measuring = Measuring(spec, processes)
            self.metrics.measuring_processes.set(processes)
            log.info("measuring in %s", "a thread of this process" if processes == 0 else
                     f"{processes} child process{'es' if processes > 1 else ''} ({os.cpu_count()} cores)")
            if (warning := s.measuring_warning()) is not None:
                log.warning("%s", warning)
            pipeline = Pipeline(measuring, metrics=self.metrics, topics=self.topics, join_ttl=s.join_ttl_s,
                                join_max_entries=s.join_max_entries, incident_quiet=s.incident_quiet_s,
                                judging=s.judging, judged_by=self._judged_by, state_interval=s.state_save_interval_s)
            for topic, table in ((self.topics.contracts, self.contracts), (self.topics.references, self.references)):
                readers.append(TableReader(kafka, topic, table))
                readers[-1].load(s.startup_timeout_s)
            log.info("%d model contracts and %d reference decisions loaded", len(self.contracts),
                     len(self.references.decisions))
            self.routing = Pins(detector.pins)
            self.routing.merge([] if state is None else state.get("decisions", []))
            self.pins = PinCheck(self.routing)
            self._follow_pins()
            self.metrics.observe_pins(*self.pins.check(self.contracts))
            if s.judging == "fleet":
                log.info("JUDGING=fleet: each stream is judged by the instance that owns its key on %s, its state "
                         "kept on %s every %.0f s (STATE_SAVE_INTERVAL_S)", self.topics.observations,
                         self.topics.judge_state, s.state_save_interval_s)
            frozen = collect_less()
            log.info("garbage collector: %d objects made while starting frozen, the youngest generation "
                     "collected every %d allocations", frozen, YOUNG_THRESHOLD)
            producer, consumer = self._clients(kafka)
            needed = [self.topics.traces, self.topics.outcomes, self.topics.anomalies, self.topics.dead_letter,
                      *self._internal(), *([self.topics.judge_state] if s.judging == "fleet" else [])]
            self._partitions = consumer.check_topics(needed)
            consumer.subscribe()
            log.info("committing finished batches together at most every %d ms (COMMIT_INTERVAL_MS)",
                     s.commit_interval_ms)
            delivery = Delivery(producer, consumer, pipeline, self.assignment, self.metrics, self.health,
                                self.stopping, lambda: self._save_state(measuring))
            self._loop(consumer, readers, delivery, measuring, pipeline)
            return ExitCode.OK
        except InfrastructureError as exc:
            log.error("stopping: %s", exc)
            return ExitCode.INFRASTRUCTURE
        except MeasuringFailed as exc:
            log.error("stopping: %s", exc)
            return ExitCode.MEASURING
        finally:
            self.health.assigned(False)
            if pipeline is not None:
                pipeline.close()
            if measuring is not None:
                self._save_final_state(measuring)
                measuring.close()
            for client in (consumer, *readers, producer):
                if client is not None:
                    client.close()
            server.stop()

    def _clients(self, kafka: Connection) -> tuple[OutputProducer, GroupMember]:
        """The output producer and the group member."""
        s = self.settings
        versions = client_versions()
        self.metrics.kafka_client.info({"client": "confluent-kafka", **versions})
        log.info("consuming traces with confluent-kafka %s (librdkafka %s)", versions["version"],
                 versions["librdkafka"])
        producer = OutputProducer(kafka, s.instance(), delivery_timeout_ms=s.delivery_timeout_ms,
                                  on_failure=lambda reason: self.metrics.output_failures.labels(reason).inc())
        try:
            consumer = GroupMember(kafka, s.group_id, [self.topics.traces, self.topics.outcomes, *self._internal()],
                              max_records=s.batch_max_records, max_partition_fetch_bytes=s.fetch_partition_bytes,
                              group_instance_id=f"{s.client_id}-{socket.gethostname()}"
                              if s.static_membership else None,
                              session_timeout_ms=s.session_timeout_ms, heartbeat_interval_ms=s.heartbeat_interval_ms)
        except InfrastructureError:
            producer.close()
            raise
        return producer, consumer

    def _loop(self, consumer: GroupMember, readers: list[TableReader], delivery: Delivery,
              measuring: Measuring, pipeline: Pipeline) -> None:
        """Poll a batch and hand it to the pipeline at once; commit batches in order as
        they complete. Up to ``batches_in_flight`` polled batches are measured or
        accounted for at once, so the measuring worker always has the next one queued. A
        rebalance waits for every batch in flight, then is acted on, and only then does
        the pipeline get the poll that brought it."""
        s = self.settings
        running: deque[Future[Batch]] = deque()
        finished: list[Future[Batch]] = []  # done, waiting for the next commit
        lag_at = tables_at = committed_at = 0.0
        while not self.stopping.is_set():
            records = _retry(lambda: consumer.poll(s.poll_timeout_ms), "poll")
            revoked, assigned = consumer.changes.take()
            self.assignment.revoke(revoked)  # not committed for from here on
            if time.monotonic() - tables_at >= TABLES_INTERVAL_S:
                tables_at = time.monotonic()
                for reader in readers:
                    reader.refresh()
            if self._names_unknown_contract(records):
                # a model server publishes a contract just before its first traces: read the
                # contracts topic to its end as of now, so those traces find it
                self._until_done(lambda: readers[0].load(10.0), "reading the contracts topic")
            measuring.check()  # a dead measuring process stops the service even when no traffic comes
            measuring.sync_contracts(self.contracts)
            measuring.sync_decisions(self.references)
            if revoked or assigned:
                self.metrics.rebalances.inc()
                _complete(delivery, [*finished, *running])
                finished.clear()
                running.clear()
                if assigned:
                    records = self._reassign(consumer, pipeline, measuring, assigned, records)
                    self.health.assigned()
                    self._warn_if_shared()
            running.append(pipeline.process(records))
            self.metrics.polled.inc(len(records))
            if len(running) > s.batches_in_flight or running[0].done():
                finished.append(running.popleft())
                while running and running[0].done():
                    finished.append(running.popleft())
            if finished and time.monotonic() - committed_at >= s.commit_interval_ms / 1000:
                # every batch done by now goes in one transaction: its latency and its
                # broker requests are paid once for them all
                committed_at = time.monotonic()
                _complete(delivery, finished)
                finished.clear()
            self.metrics.observe_contracts(self.contracts)
            self._follow_pins()
            self.metrics.observe_pins(*self.pins.check(self.contracts))
            if time.monotonic() - lag_at >= LAG_INTERVAL_S:
                lag_at = time.monotonic()
                self._check_broker(consumer)
            self._maybe_save_state(measuring)
        _complete(delivery, [*finished, *running])
        log.info("stop requested: last batch committed")

    def _warn_if_shared(self) -> None:
        """Once: with JUDGING=instance and other instances in the group, each judges only
        its share of every stream (a canary needs that many times the traffic to be judged)."""
        if self.settings.judging != "instance" or self._warned_shared:
            return
        owned = sum(1 for t, _ in self.assignment.owned if t == self.topics.traces)
        total = self._partitions.get(self.topics.traces, 0)
        if 0 < owned < total:
            self._warned_shared = True
            log.warning("this instance measures %d of the %d trace partitions: with JUDGING=instance it learns "
                        "references and gathers evidence from that share only, so every instance needs a "
                        "reference's worth of a revision's traffic before judging it; set JUDGING=fleet on every "
                        "instance to judge each stream in one place (docs/scaling.md)", owned, total)

    def _internal(self) -> list[str]:
        """The topics between this instance's two steps (JUDGING=fleet): read and written."""
        return [self.topics.observations] if self.settings.judging == "fleet" else []

    def _follow_pins(self) -> None:
        """The references topic's new decisions, taken into the routing rule in order."""
        self._pins_version = follow(self.routing, self.references, self._pins_version)

    def _judged_by(self, model: str, revision: str) -> str:
        """The revision whose reference judges ``revision``'s traces: its judge's key."""
        return self.routing.judge_revision(model, revision)

    def _names_unknown_contract(self, records: list[Record]) -> bool:
        """Whether a trace of the poll names a contract this instance does not know (the
        header read unverified: a wrong name only costs a read of the contracts topic,
        or the trace's own rejection; an unreadable header is rejected whatever the
        contracts)."""
        named = {named_contract(r.value, self.limits) for r in records if r.topic == self.topics.traces}
        return any(name is not None and self.contracts.get(name) is None for name in named)

    def _until_done(self, action: Callable[[], None], what: str) -> None:
        """``action``, retried while the broker is away (not ready meanwhile), until it
        succeeds or a stop is asked for."""
        delay = 0.5
        while True:
            try:
                action()
                self.health.broker_answered()
                return
            except InfrastructureError as exc:
                if not exc.retriable or self.stopping.is_set():
                    raise
                self.health.broker_silent(f"{what}: {exc}")
                time.sleep(delay)
                delay = min(2 * delay, 10.0)

    def _check_broker(self, consumer: GroupMember) -> None:
        """Ask the broker for the trace partitions' end offsets: the lag, and whether it answers."""
        try:
            owned = [tp for tp in self.assignment.owned if tp[0] == self.topics.traces]
            self.metrics.lag.set(self.assignment.lag(consumer.end_offsets(owned)))
            self.health.broker_answered()
        except InfrastructureError as exc:
            self.health.broker_silent(str(exc))

    def _reassign(self, consumer: GroupMember, pipeline: Pipeline,
                  measuring: Measuring, assigned: set[tuple[str, int]],
                  records: list[Record]) -> list[Record]:
        """Act on a completed rebalance, with no batch in flight; returns the records of
        the poll that brought it still to process (see :mod:`monitor.service.assignment`)."""
        change = self.assignment.assign(assigned, records)
        consumer.seek(change.resume)
        emitted: set[Source] = set()
        committed: dict[tuple[str, int], int] = {}
        if change.new:
            committed = consumer.committed(change.new)
            written = read_back(self.settings.kafka_connection(),
                                [self.topics.anomalies, self.topics.dead_letter, *self._internal()],
                                change.new, committed, self.settings.dedupe_window)
            emitted = written.sources
            measuring.remember(written.trace_ids)  # a trace sent again after a restart stays a duplicate
            log.info("assigned %s; %d outputs already written for them, %d trace ids remembered", sorted(change.new),
                     len(emitted), len(written.trace_ids))
        if change.kept:
            log.info("rebalanced; kept %d partitions, resuming them where this instance left off", len(change.kept))
        pipeline.reassign({tp: o for tp, o in self.assignment.positions.items() if tp in assigned},
                          {p for t, p in change.lost if t == self.topics.traces}, emitted)
        for topic, partition in sorted(change.new):
            if topic == self.topics.observations:
                self._take_over(partition, committed[(topic, partition)], measuring, pipeline)
        return change.records

    def _take_over(self, partition: int, committed: int, measuring: Measuring, pipeline: Pipeline) -> None:
        """Make this instance the judge of an observations partition (JUDGING=fleet): the
        latest round of its judges' state, then its observations from that round's offset
        to the committed one judged again, silently (their outputs were written by the
        instance that judged them first). Judge keys without state in the round start
        afresh: they began after it."""
        kafka = self.settings.kafka_connection()
        written = read_range(kafka, self.topics.judge_state, partition, None, None)
        try:
            found = judge_state.latest_round((key, value) for _, key, value in written)
        except TraceRejected as exc:
            log.error("observations partition %d: its judges' state is unreadable (%s); they learn afresh from "
                      "the committed offset %d", partition, exc.detail, committed)
            found = (committed, [], [])
        if found is not None and found[0] > committed:  # the group's offsets start over (a new GROUP_ID)
            log.warning("observations partition %d: its judges' state was written at offset %d, beyond the "
                        "committed %d; it is not this group's, they learn afresh", partition, found[0], committed)
            found = None
        start, docs, incidents = (None, [], []) if found is None else found
        states = [KeyState.from_dict(doc) for doc in docs]
        replayed, keys = [], {state.key for state in states}
        for _, key, value in read_range(kafka, self.topics.observations, partition, start, committed):
            try:
                judge, entries = observations.read(key, value)
                keys.add(judge)
                replayed += entries
            except TraceRejected:
                continue  # refused when it was first judged; nothing to rebuild from it
        empty = [KeyState(m, r) for m, r in sorted(keys - {state.key for state in states})]  # begun after the round
        measuring.restore([*states, *empty])
        # judged again to rebuild the evidence; their records were written when first judged
        verdicts = measuring.judge_forwarded(replayed, again=True).result() if replayed else []
        pipeline.replayed(list(zip(replayed, verdicts, strict=True)), incidents)
        pipeline.restored(partition, keys, committed)
        log.info("judging observations partition %d: %d judge keys' state and %d open incidents from the round at "
                 "offset %s, %d traces judged again up to the committed offset %d", partition, len(states),
                 len(incidents), "-" if found is None else start, len(replayed), committed)

    def _maybe_save_state(self, measuring: Measuring) -> None:
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

    def _save_state(self, measuring: Measuring) -> None:
        """Save the state now (before committing traces that taught a reference); a
        periodic save still pending holds an older state and is dropped."""
        if self.state_file is not None:
            self._state_saving = None
            self.state_file.save(measuring.state().result())
            self._saved_at = time.monotonic()

    def _save_final_state(self, measuring: Measuring) -> None:
        if self.state_file is None:
            return
        try:
            self.state_file.save(measuring.state().result())
        except MeasuringFailed as exc:
            log.error("reference state not saved: %s", exc)


def _complete(delivery: Delivery, batches: Iterable[Future[Batch]]) -> None:
    """Commit these batches, in order, in one transaction (waiting for each to finish)."""
    done = [batch.result() for batch in batches]
    if done:
        delivery.complete(Batch.merged(done))


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
