"""Apache Kafka 4.x from Maven Central, run with ``java`` as a single KRaft node.

Profiles:

``plaintext``
    One PLAINTEXT client listener on 127.0.0.1.
``scram``
    The production security of ``deploy/kafka/secure.properties``: SCRAM-SHA-512 on the
    client listener, SASL/PLAIN with a static user on the controller listener, the
    StandardAuthorizer with default deny, and no anonymous super user. The admin SCRAM
    credential is written at format time (``--add-scram``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devstack.process import ManagedProcess, ServiceError, free_port
from devstack.wait import wait_for
from monitor.broker.connection import Connection

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
LOG4J2 = HERE / "log4j2.properties"
CACHE = Path(os.environ.get("ATTENTION_MONITOR_DEV_CACHE", Path.home() / ".cache" / "attention-monitor"))

SECURE_PROPERTIES = HERE.parent / "deploy" / "kafka" / "secure.properties"
ADMIN_USER = "admin"
ADMIN_PASSWORD = "admin-secret"
CONTROLLER_PASSWORD = "controller-secret"
MECHANISM = "SCRAM-SHA-512"
PROFILES = ("plaintext", "scram")


def java() -> str:
    found = shutil.which("java")
    if not found:
        raise ServiceError("java is not on PATH; Kafka 4.x needs Java 17 or newer")
    return found


def classpath() -> str:
    """The broker's runtime classpath, resolved by Maven once and cached by POM hash."""
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
    cached = CACHE / f"kafka-classpath-{digest}.txt"
    if cached.exists():
        text = cached.read_text().strip()
        if text and all(Path(p).exists() for p in text.split(os.pathsep)):
            return text
    mvn = shutil.which("mvn")
    if not mvn:
        raise ServiceError("mvn is not on PATH; it resolves Kafka from Maven Central")
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    result = subprocess.run(
        [mvn, "-B", "-q", "-f", str(POM), "dependency:build-classpath",
         f"-Dmdep.outputFile={partial}", "-DincludeScope=runtime"],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0 or not partial.exists():
        raise ServiceError(f"mvn could not resolve Kafka:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    partial.replace(cached)
    return cached.read_text().strip()


@dataclass
class KafkaBroker:
    """A running single-node KRaft broker; use :func:`start_broker`."""

    profile: str
    workdir: Path
    port: int
    controller_port: int
    process: ManagedProcess
    _owns_workdir: bool = field(default=False, repr=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client_config(self, user: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> dict[str, Any]:
        """kafka-python keyword arguments to connect as ``user`` (ignored for plaintext)."""
        config: dict[str, Any] = {"bootstrap_servers": self.bootstrap}
        if self.profile == "scram":
            config.update(
                security_protocol="SASL_PLAINTEXT",
                sasl_mechanism=MECHANISM,
                sasl_plain_username=user,
                sasl_plain_password=password,
            )
        return config

    def connection(self, user: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> Connection:
        """The monitor's connection value for ``user`` (ignored for plaintext)."""
        if self.profile == "scram":
            return Connection(self.bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism=MECHANISM,
                              sasl_username=user, sasl_password=password)
        return Connection(self.bootstrap)

    def stop(self) -> int | None:
        code = self.process.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def kill(self) -> None:
        self.process.kill()

    def restart(self, timeout: float = 90.0) -> None:
        """Start the broker again on the same ports and data (after :meth:`kill` or an
        outage a test made), and wait until clients are answered."""
        if self.process.alive():
            raise ServiceError("the broker is still running")
        self.process = ManagedProcess(self.process.name, self.process.argv, self.process.log_path)
        wait_for(lambda: _lists_topics(self), timeout=timeout, what=f"kafka ({self.profile}) answering again")


def _server_properties(profile: str, port: int, controller_port: int, log_dir: Path) -> str:
    lines = [
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
        f"listeners=CLIENT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        f"advertised.listeners=CLIENT://127.0.0.1:{port}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=CLIENT",
        f"log.dirs={log_dir}",
        "num.partitions=1",
        "offsets.topic.replication.factor=1",
        "offsets.topic.num.partitions=4",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        "auto.create.topics.enable=false",
        "log.flush.interval.messages=1000000",
    ]
    if profile == "scram":
        lines.append(SECURE_PROPERTIES.read_text().replace("{admin_password}", ADMIN_PASSWORD)
                     .replace("{controller_password}", CONTROLLER_PASSWORD))
    else:
        lines.append("listener.security.protocol.map=CLIENT:PLAINTEXT,CONTROLLER:PLAINTEXT")
    return "\n".join(lines) + "\n"


def start_broker(profile: str = "plaintext", workdir: Path | None = None, timeout: float = 90.0) -> KafkaBroker:
    """Format KRaft storage, start the broker and wait until a client can list topics."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    owns = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"kafka-{profile}-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    port, controller_port = free_port(), free_port()
    props = workdir / "server.properties"
    props.write_text(_server_properties(profile, port, controller_port, workdir / "data"))
    cp = classpath()
    base = [java(), "-cp", cp, f"-Dlog4j2.configurationFile={LOG4J2}"]
    cluster_id = subprocess.run(
        [*base, "kafka.tools.StorageTool", "random-uuid"], capture_output=True, text=True, check=True
    ).stdout.strip().splitlines()[-1]
    fmt = [*base, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)]
    if profile == "scram":
        fmt += ["--add-scram", f"{MECHANISM}=[name={ADMIN_USER},password={ADMIN_PASSWORD}]"]
    result = subprocess.run(fmt, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServiceError(f"kafka storage format failed:\n{result.stdout}\n{result.stderr}")
    process = ManagedProcess(
        f"kafka-{profile}",
        [java(), "-Xmx512m", "-Xms128m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
         "-cp", cp, f"-Dlog4j2.configurationFile={LOG4J2}", "kafka.Kafka", str(props)],
        workdir / "broker.log",
    )
    broker = KafkaBroker(profile, workdir, port, controller_port, process, owns)
    try:
        wait_for(lambda: _lists_topics(broker), timeout=timeout, what=f"kafka ({profile}) answering clients")
    except BaseException:
        tail = process.log_tail()
        broker.stop()
        raise ServiceError(f"kafka ({profile}) did not become ready; broker log tail:\n{tail}") from None
    return broker


def _lists_topics(broker: KafkaBroker) -> bool:
    broker.process.check_alive()
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(**broker.client_config(), request_timeout_ms=3000)
    try:
        admin.list_topics()
    finally:
        admin.close()
    return True


def create_scram_user(admin: Any, user: str, password: str) -> None:
    """Create or update ``user``'s SCRAM-SHA-512 credential through the admin API."""
    from kafka.admin import UserScramCredentialUpsertion

    result = admin.alter_user_scram_credentials([UserScramCredentialUpsertion(user, MECHANISM, password)])
    if result.get(user):
        raise ServiceError(f"could not create SCRAM user {user}: {result[user]}")


def grant(admin: Any, user: str, *, topics: dict[str, list[str]] | None = None,
          groups: dict[str, list[str]] | None = None) -> None:
    """Allow ``User:user`` operations (e.g. ``{"traces": ["READ", "DESCRIBE"]}``) on
    literal topic and group names."""
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ResourcePattern, ResourceType

    acls = [
        ACL(f"User:{user}", "*", ACLOperation[op], ACLPermissionType.ALLOW, ResourcePattern(rtype, name))
        for rtype, table in ((ResourceType.TOPIC, topics or {}), (ResourceType.GROUP, groups or {}))
        for name, ops in table.items()
        for op in ops
    ]
    result = admin.create_acls(acls)
    if result["failed"]:
        raise ServiceError(f"could not create ACLs for {user}: {result['failed']}")
