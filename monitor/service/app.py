"""The service, wired: settings in, clients, measuring, pipeline and loop built, run,
and everything closed on the way out.

SIGTERM or SIGINT ends the loop after the current batch: outputs are flushed, offsets
committed, reference state saved and clients closed, then the process exits 0. Exit
codes are :class:`~monitor.errors.ExitCode`: 1 configuration error; 3 Kafka unreachable,
a topic missing or not authorized, or writing outputs failed after retries; 4 the
process that measures traces died.

Every instance measures the traces of its trace partitions and judges the streams whose
observations partitions it owns (:mod:`monitor.service.fleet`): the observations and
judge-state topics are part of every deployment. An instance that cannot find a topic it
reads or writes refuses to start before anything else, naming every missing one and the
command that creates them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import Any

from prometheus_client import CollectorRegistry

from monitor.broker.admin import partition_counts
from monitor.broker.connection import Connection
from monitor.broker.group import GroupMember, client_versions
from monitor.broker.outputs import OutputProducer
from monitor.broker.tables import TableReader
from monitor.core.pins import Pins
from monitor.errors import ExitCode, InfrastructureError, MeasuringFailed
from monitor.measuring.measurer import MeasurerSpec
from monitor.measuring.tuning import YOUNG_THRESHOLD, collect_less, reuse_freed_memory
from monitor.measuring.workers import Measuring
from monitor.protocol.access import contract_verifier
from monitor.protocol.decisions import ReferenceTable
from monitor.protocol.model_contract import ContractTable
from monitor.service.assignment import Assignment
from monitor.service.delivery import Delivery, rejoin_timeout_s
from monitor.service.exporter import MonitorMetrics
from monitor.service.health import Health
from monitor.service.http import MetricsServer
from monitor.service.loop import LAG_INTERVAL_S, Loop
from monitor.service.pins import PinCheck, follow
from monitor.service.pipeline import Pipeline
from monitor.service.state_file import StateFile, StateSaver
from monitor.settings import Settings

__all__ = ["Service", "run_service"]

log = logging.getLogger(__name__)


class Service:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        self.topics = settings.topics()
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
        self._pins_version = 0  #: the references table's decisions taken into the routing rule
        self.assignment = Assignment()
        self.state_file = None if settings.state_dir is None else StateFile(settings.state_dir, settings.instance())
        self.stopping = threading.Event()
        self.health = Health(stale_s=max(15.0, 3 * LAG_INTERVAL_S))

    def request_stop(self, *_: Any) -> None:
        self.stopping.set()

    def triage_page(self, path: str, query: str) -> tuple[int, str]:
        """A /triage/ page and its HTTP status, from the committed tail of the anomalies
        topic (read afresh for every page: an on-call page, not a dashboard) and the
        layers this instance has seen, as its metrics and contracts have them."""
        from monitor.broker.tail import read_tail
        from monitor.triage.seen import from_metrics
        from monitor.triage.site import respond

        records = read_tail(self.settings.kafka_connection(), [self.topics.anomalies], self.settings.triage_records,
                            timeout_s=15.0)
        return respond(records, path, query, from_metrics(self.registry.collect(), self.contracts.contracts()))

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
        saver: StateSaver | None = None
        try:
            if s.reuse_freed_memory:
                reuse_freed_memory()
            detector = s.detector()
            keyring = s.keyring()
            self.contracts = ContractTable(contract_verifier(keyring), s.max_contracts)
            state = None if self.state_file is None else self.state_file.load(detector)
            self._check_topics(kafka)
            spec = MeasurerSpec(keyring, s.scopes(), s.limits(), detector, s.dedupe_window, state,
                                logging.getLogger().getEffectiveLevel(), s.reuse_freed_memory)
            processes = s.measuring_processes()
            measuring = Measuring(spec, processes)
            self.routing = spec.pins()  # the judge's own rule, fed as the judge's from here on
            self.pins = PinCheck(self.routing)
            saver = StateSaver(self.state_file, measuring, s.state_save_interval_s)
            self.metrics.measuring_processes.set(processes)
            log.info("measuring in %s", "a thread of this process" if processes == 0 else
                     f"{processes} child process{'es' if processes > 1 else ''} ({os.cpu_count()} cores)")
            if (warning := s.measuring_warning()) is not None:
                log.warning("%s", warning)
            pipeline = Pipeline(measuring, metrics=self.metrics, topics=self.topics, join_ttl=s.join_ttl_s,
                                join_max_entries=s.join_max_entries, incident_quiet=s.incident_quiet_s,
                                outcome_window=s.outcome_window_s, outcome_max_requests=s.outcome_max_requests,
                                judged_by=self.routing.judge_revision, state_interval=s.state_save_interval_s)
            for topic, table in ((self.topics.contracts, self.contracts), (self.topics.references, self.references)):
                readers.append(TableReader(kafka, topic, table))
                readers[-1].load(s.startup_timeout_s)
            log.info("%d model contracts and %d reference decisions loaded", len(self.contracts),
                     len(self.references.decisions))
            self.follow_pins()
            self.metrics.observe_pins(*self.pins.check(self.contracts))
            log.info("each stream is judged by the instance that owns its key on %s, its state kept on %s every "
                     "%.0f s (STATE_SAVE_INTERVAL_S)", self.topics.observations, self.topics.judge_state,
                     s.state_save_interval_s)
            frozen = collect_less()
            log.info("garbage collector: %d objects made while starting frozen, the youngest generation "
                     "collected every %d allocations", frozen, YOUNG_THRESHOLD)
            producer, consumer = self._clients(kafka)
            consumer.subscribe()
            log.info("committing finished batches together at most every %d ms (COMMIT_INTERVAL_MS)",
                     s.commit_interval_ms)
            delivery = Delivery(producer, consumer, pipeline, self.assignment, self.metrics, self.health,
                                self.stopping, saver.now, rejoin_timeout_s=rejoin_timeout_s(s.rebalance_timeout_ms))
            Loop(self, consumer, readers, delivery, measuring, pipeline, saver).run()
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
                assert saver is not None
                saver.last()
                measuring.close()
            for client in (consumer, *readers, producer):
                if client is not None:
                    client.close()
            server.stop()

    def follow_pins(self) -> None:
        """The references topic's new decisions, taken into the routing rule in order."""
        self._pins_version = follow(self.routing, self.references, self._pins_version)

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
            consumer = GroupMember(kafka, s.group_id, [self.topics.traces, self.topics.outcomes,
                                                       self.topics.observations],
                                   max_records=s.batch_max_records, max_partition_fetch_bytes=s.fetch_partition_bytes,
                                   group_instance_id=f"{s.client_id}-{socket.gethostname()}"
                                   if s.static_membership else None,
                                   session_timeout_ms=s.session_timeout_ms,
                                   heartbeat_interval_ms=s.heartbeat_interval_ms,
                                   rebalance_timeout_ms=s.rebalance_timeout_ms)
        except InfrastructureError:
            producer.close()
            raise
        return producer, consumer

    def _check_topics(self, kafka: Connection) -> None:
        """Every topic the service reads or writes, there and describable, checked before
        anything starts: all the missing ones named at once with the command that creates
        them (the internal ones too: each stream's judging and the late outcomes go
        through them); the pending outcomes with at least as many partitions as the
        traces."""
        t = self.topics
        internal = (t.observations, t.judge_state, t.pending)
        counts = partition_counts(kafka, (t.traces, t.outcomes, t.contracts, t.references, t.anomalies,
                                          t.dead_letter, *internal), self.settings.startup_timeout_s)
        missing = [topic for topic, count in counts.items() if count is None]
        partitions = counts[t.traces]
        if missing:
            names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
            why = (f" Every instance judges through {t.observations} and {t.judge_state} (docs/scaling.md) and "
                   f"keeps the requests whose outcome may come late on {t.pending} (docs/delivery.md)."
                   if any(topic in internal for topic in missing) else "")
            count, note = ((partitions, f"as many partitions as {t.traces}") if partitions is not None else
                           ("N", "N: at most this many instances share the work, docs/scaling.md"))
            raise InfrastructureError(
                f"topic{'s' if len(missing) > 1 else ''} {names} missing or not describable.{why} Create them with "
                f"`attention-monitor topics create --partitions {count}` ({note}; topics that exist are left as "
                f"they are), or grant this principal DESCRIBE on them (`attention-monitor acls apply`)",
                retriable=False)
        assert partitions is not None
        pending = counts[t.pending]
        if pending is not None and pending < partitions:  # trace partition i keeps its requests on partition i
            raise InfrastructureError(
                f"topic {t.pending} has {pending} partitions, fewer than the {partitions} of {t.traces}: "
                f"each trace partition keeps its requests awaiting a late outcome on the partition of the same "
                f"number. Add partitions (kafka-topics --alter --partitions {partitions}) or create it anew",
                retriable=False)


def run_service(settings: Settings) -> ExitCode:
    service = Service(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, service.request_stop)
    return service.run()
