"""Settings, built once at the edge from ``ATTENTION_MONITOR_*`` environment variables
(or a ``.env`` file) and handed down as plain values. Secrets are ``SecretStr``."""

from __future__ import annotations

import os
import socket
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from monitor.broker.connection import Connection
from monitor.core.detect import DetectorConfig
from monitor.errors import ConfigurationError
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import Limits
from monitor.protocol.topics import DEFAULT, OUTCOME_WINDOW_S, Topics

CommaList = Annotated[list[str], NoDecode]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ATTENTION_MONITOR_", env_file=".env", frozen=True,
                                      extra="ignore")

    # Kafka
    bootstrap_servers: str = Field("127.0.0.1:9092", description="comma-separated host:port")
    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] = "SCRAM-SHA-512"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    sasl_password_file: Path | None = Field(None, description="read the SASL password from this file (a secret)")
    group_id: str = "attention-monitor"
    client_id: str = "attention-monitor"
    traces_topic: str = DEFAULT.traces
    outcomes_topic: str = DEFAULT.outcomes
    contracts_topic: str = DEFAULT.contracts
    anomalies_topic: str = DEFAULT.anomalies
    dead_letter_topic: str = DEFAULT.dead_letter
    references_topic: str = DEFAULT.references
    observations_topic: str = DEFAULT.observations
    judge_state_topic: str = DEFAULT.judge_state
    pending_topic: str = DEFAULT.pending
    batch_max_records: int = Field(500, gt=0)
    fetch_partition_bytes: int = Field(2 * 1024 * 1024, gt=0, description="fetch size per partition (memory bound)")
    poll_timeout_ms: int = Field(500, gt=0)
    batches_in_flight: int = Field(2, gt=0, description="polled batches measured or accounted for at once; more "
                                   "keep the measuring process busy, each holds one poll's records in memory")
    commit_interval_ms: int = Field(100, ge=0, description="finished batches wait up to this long to be committed "
                                    "together, in one transaction (0: each as it finishes)")
    startup_timeout_s: float = Field(60.0, gt=0, description="how long to wait for the broker at start")
    static_membership: bool = Field(True, description="join the group as <client_id>-<host> (group.instance.id): a "
                                    "restart within the session timeout keeps its partitions, no rebalance")
    session_timeout_ms: int = Field(15_000, ge=6_000, description="a member silent this long loses its partitions")
    heartbeat_interval_ms: int = Field(3_000, gt=0)
    rebalance_timeout_ms: int = Field(60_000, ge=6_000, description="how long the broker waits for every member to "
                                      "rejoin in a rebalance, and a joining member for its answer, plus 3 s "
                                      "(librdkafka's max.poll.interval.ms): a join lost to a broker restart is sent "
                                      "again after it; at least SESSION_TIMEOUT_MS")
    delivery_timeout_ms: int = Field(120_000, gt=0, description="how long one output transaction may try to "
                                     "deliver before it is aborted and sent again")
    ssl_cafile: Path | None = Field(None, description="CA bundle that signs the brokers' certificates (SSL, "
                                    "SASL_SSL; default: the system's)")
    ssl_certfile: Path | None = Field(None, description="client certificate, for brokers that require one (mTLS)")
    ssl_keyfile: Path | None = Field(None, description="the client certificate's key")

    # Access
    keyring_file: Path | None = None
    keyring_json: SecretStr | None = Field(None, description='inline keyring: {"key-id": "secret"}')
    allowed_scopes: CommaList = Field(default_factory=list, description="tenant:data_class pairs this monitor may "
                                      "process, comma-separated (required; * matches any)")
    max_contracts: int = Field(1000, gt=0, description="model contracts kept; beyond, the oldest goes (counted)")
    max_record_bytes: int = Field(Limits.max_record_bytes, gt=0)
    max_heads: int = Field(Limits.max_heads, gt=0)
    max_rows: int = Field(Limits.max_rows, gt=0)
    max_keys: int = Field(Limits.max_keys, gt=0)

    # Detection and join
    reference_traces: int = Field(DetectorConfig.reference_traces, gt=1, description="traces of a revision, of "
                                  "any lengths, its reference learns before it judges; the finding and page "
                                  "thresholds allow for the error of a reference this size, so a smaller one "
                                  "judges with higher thresholds (docs/detection.md)")
    reference_pool: int = Field(DetectorConfig.pool, gt=1, description="traces of the nearest lengths a reference "
                                "pools to judge one trace")
    false_alarm_arl: float = Field(DetectorConfig.false_alarm_arl, gt=1, description="expected traces between false "
                                   "findings (evidence records, which page nothing) per (layer, kind)")
    false_pages_per_week: float = Field(DetectorConfig.false_pages_per_week, gt=0, description="expected false "
                                        "pages per model revision and week at its observed request rate (at least "
                                        "1 a second), split over all the revision's streams (docs/detection.md)")
    min_effect: float = Field(DetectorConfig.min_effect, ge=0)
    reference_pins: CommaList = Field(default_factory=list, description="model@revision=reference_revision, ...")
    #: removed: every stream is judged in one place whatever the number of instances (the
    #: former JUDGING=fleet); a deployment still setting it is told so (_removed)
    judging: str | None = Field(None, exclude=True, description="removed (each stream is judged in one place)")
    incident_quiet_s: float = Field(600.0, gt=0, description="an incident closes after this long without a new "
                                    "anomaly of its family on its layer")
    #: short because a trace reaches its judge only when it leaves the join: a page comes at
    #: most this much later than its evidence (docs/detection.md); an outcome after it still
    #: counts, through the pending table (OUTCOME_WINDOW_S)
    join_ttl_s: float = Field(5.0, gt=0, description="how long a trace waits for its outcome before it goes on to "
                              "its judge (an outcome after it counts late)")
    join_max_entries: int = Field(200_000, gt=0)
    outcome_window_s: float = Field(OUTCOME_WINDOW_S, gt=0, description="how long after its request's first trace "
                                    "an outcome is still attributed (one that comes after the join window counts "
                                    "late); past it the request counts missing")
    outcome_max_requests: int = Field(250_000, gt=0, description="requests awaiting their outcome past the join "
                                      "window, at most, per instance (about 480 bytes each: 120 MB by default); "
                                      "beyond, the oldest counts missing")
    dedupe_window: int = Field(100_000, gt=0)
    state_dir: Path | None = Field(None, description="where this instance saves and reloads its reference state")
    state_save_interval_s: float = Field(30.0, ge=0, description="how often reference state is saved, and "
                                         "the judges' state written to the judge-state topic (0: every batch)")
    reuse_freed_memory: bool = Field(True, description="keep freed memory for reuse (glibc), so records do not "
                                                       "fault in fresh pages; resident memory stays at its peak")
    measure_processes: int | None = Field(None, ge=0, le=64, description="child processes that decode, verify "
                                          "and measure beside the consumer (the service's process judges, in "
                                          "order; default: one per core, at most 8); 0: a thread of the service's "
                                          "own process")

    # Export
    metrics_address: str = "127.0.0.1"
    metrics_port: int = Field(9464, ge=0, le=65535)
    metrics_tls_cert: Path | None = None
    metrics_tls_key: Path | None = None
    metrics_basic_auth_user: str | None = None
    metrics_basic_auth_password: SecretStr | None = None
    metrics_idle_timeout_s: float = Field(10.0, gt=0, description="an idle /metrics connection is closed after this")
    triage_records: int = Field(2000, ge=0, description="records read from the end of each anomalies partition "
                                "for a /triage/ page (0: no triage pages)")
    triage_url: str | None = Field(None, description="where on-call's browser reaches this instance's /triage/ "
                                   "pages (e.g. https://monitor-1.example.com); alerts link there (default: "
                                   "the address Prometheus scrapes, over http)")
    detail_level: Literal["layer", "head"] = "layer"
    max_model_revisions: int = Field(20, gt=0, description="distinct model/revision label pairs before 'other'")
    model_allowlist: CommaList = Field(default_factory=list, description="if set, only these model ids get labels")
    max_layer_series: int = Field(512, gt=0, description="distinct (model, revision, layer) label sets before "
                                  "layer='other' (each layer costs 103 series or more; docs/metrics.md)")
    max_references: int = Field(1024, gt=0, description="(model, revision, layer) references kept; beyond, the one "
                                "unused longest goes (counted)")

    @field_validator("allowed_scopes", "reference_pins", "model_allowlist", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _removed(self) -> Settings:
        if self.judging is not None:
            raise ValueError(
                f"ATTENTION_MONITOR_JUDGING (here {self.judging!r}) was removed: every stream is now judged in one "
                "place whatever the number of instances (what JUDGING=fleet did; docs/scaling.md). Remove the "
                "setting; every instance needs the attention-observations and attention-judge-state topics "
                "(attention-monitor topics create makes the missing ones)")
        return self

    @model_validator(mode="after")
    def _pairs(self) -> Settings:
        if (self.metrics_tls_cert is None) != (self.metrics_tls_key is None):
            raise ValueError("ATTENTION_MONITOR_METRICS_TLS_CERT and ATTENTION_MONITOR_METRICS_TLS_KEY go together")
        if (self.metrics_basic_auth_user is None) != (self.metrics_basic_auth_password is None):
            raise ValueError("ATTENTION_MONITOR_METRICS_BASIC_AUTH_USER and "
                             "ATTENTION_MONITOR_METRICS_BASIC_AUTH_PASSWORD go together")
        if self.security_protocol.startswith("SASL") and not (
                self.sasl_username and (self.sasl_password or self.sasl_password_file)):
            raise ValueError("SASL needs ATTENTION_MONITOR_SASL_USERNAME and ATTENTION_MONITOR_SASL_PASSWORD (or "
                             "ATTENTION_MONITOR_SASL_PASSWORD_FILE)")
        if self.rebalance_timeout_ms < self.session_timeout_ms:
            raise ValueError(f"ATTENTION_MONITOR_REBALANCE_TIMEOUT_MS ({self.rebalance_timeout_ms}) must be at least "
                             f"ATTENTION_MONITOR_SESSION_TIMEOUT_MS ({self.session_timeout_ms})")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ATTENTION_MONITOR_SSL_CERTFILE and ATTENTION_MONITOR_SSL_KEYFILE go together")
        if self.triage_url is not None:
            parts = urllib.parse.urlsplit(self.triage_url)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
                raise ValueError(f"ATTENTION_MONITOR_TRIAGE_URL must be an http(s) address such as "
                                 f"https://monitor.example.com, got {self.triage_url!r}")
        return self

    # --- derived plain values -----------------------------------------------------

    def keyring(self) -> Keyring:
        if self.keyring_json is not None:
            return Keyring.from_json(self.keyring_json.get_secret_value(), "keyring_json")
        if self.keyring_file is not None:
            return Keyring.from_file(self.keyring_file)
        raise ConfigurationError("no keyring: set ATTENTION_MONITOR_KEYRING_FILE or ATTENTION_MONITOR_KEYRING_JSON "
                                 "(`attention-monitor keyring new` makes one)")

    def instance(self) -> str:
        """This instance's stable name: its state file, transactional id and group
        instance id."""
        return f"{self.group_id}-{self.client_id}-{socket.gethostname()}".replace(os.sep, "_")

    def measuring_processes(self) -> int:
        """MEASURE_PROCESSES, or one per core (at most 8): the consumer's own process
        needs a fraction of a core, librdkafka parsing records in its own threads."""
        if self.measure_processes is not None:
            return self.measure_processes
        return max(1, min(8, os.cpu_count() or 2))

    def measuring_warning(self) -> str | None:
        """Why MEASURE_PROCESSES, as set, may be slower here than its default; None when
        it is not."""
        processes, cores = self.measuring_processes(), os.cpu_count() or 1
        if processes == 0:
            return ("MEASURE_PROCESSES=0 measures in a thread of the service's process, taking turns with the "
                    "consumer on one interpreter lock: slower than one child process at about the same CPU a trace")
        if processes <= max(1, cores):
            return None
        return (f"MEASURE_PROCESSES={processes} on {cores} cores: more measuring processes than cores take turns "
                "on them, and each adds its own memory")

    def topics(self) -> Topics:
        return Topics(self.traces_topic, self.outcomes_topic, self.contracts_topic, self.anomalies_topic,
                      self.dead_letter_topic, self.references_topic, self.observations_topic,
                      self.judge_state_topic, self.pending_topic)

    def scopes(self) -> ScopePolicy:
        if not self.allowed_scopes:
            raise ConfigurationError("no ALLOWED_SCOPES: set ATTENTION_MONITOR_ALLOWED_SCOPES to the tenant:data_class "
                                     "pairs this monitor may process (e.g. team-a:internal; * matches any)")
        return ScopePolicy.parse(self.allowed_scopes)

    def limits(self) -> Limits:
        return Limits(max_record_bytes=self.max_record_bytes, max_heads=self.max_heads, max_rows=self.max_rows,
                      max_keys=self.max_keys)

    def detector(self) -> DetectorConfig:
        pins = {}
        for entry in self.reference_pins:
            target, sep, reference = entry.partition("=")
            model, at, revision = target.rpartition("@")
            if not sep or not at or not model or not revision or not reference:
                raise ConfigurationError(f"reference pin {entry!r} must be model@revision=reference_revision")
            pins[(model, revision)] = reference
        return DetectorConfig(reference_traces=self.reference_traces, pool=self.reference_pool,
                              false_alarm_arl=self.false_alarm_arl, false_pages_per_week=self.false_pages_per_week,
                              min_effect=self.min_effect, pins=pins,
                              max_references=self.max_references)

    def kafka_connection(self) -> Connection:
        """How every Kafka client of the monitor connects."""
        def path(value: Path | None) -> str | None:
            return None if value is None else str(value)

        return Connection(self.bootstrap_servers, self.client_id, self.security_protocol, self.sasl_mechanism,
                          self.sasl_username, self._sasl_password() if self.security_protocol.startswith("SASL")
                          else None, path(self.ssl_cafile), path(self.ssl_certfile), path(self.ssl_keyfile))

    def _sasl_password(self) -> str:
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        assert self.sasl_password_file is not None
        try:
            return self.sasl_password_file.read_text().strip()
        except OSError as exc:
            raise ConfigurationError(f"cannot read sasl_password_file {self.sasl_password_file}: "
                                     f"{exc.strerror}") from exc

    def masked(self) -> dict[str, Any]:
        """Every setting in use, secrets shown as ``**********``."""
        out = {}
        for name, field in type(self).model_fields.items():
            if field.exclude:  # a removed setting, refused when set (JUDGING)
                continue
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                value = "**********"
            elif isinstance(value, Path):
                value = str(value)
            out[name] = value
        return out
