"""How the monitor reaches Kafka: one typed value for every client it starts.

Settings build one :class:`Connection` at the edge (``BOOTSTRAP_SERVERS``,
``SECURITY_PROTOCOL``, ``SASL_*``, ``SSL_*``); each client translates it into its own
library's words (:meth:`Connection.librdkafka` for confluent-kafka, which consumes,
reads tables and administers; :meth:`Connection.kafka_python` for the transactional
output producer and the model servers' producer). The password never appears in
``repr``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

SecurityProtocol = Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"]
SaslMechanism = Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"]


@dataclass(frozen=True)
class Connection:
    bootstrap_servers: str  #: comma-separated host:port
    client_id: str = "attention-monitor"
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism = "SCRAM-SHA-512"
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None  #: CA bundle that signs the brokers' certificates (default: the system's)
    ssl_certfile: str | None = None  #: client certificate, for brokers that ask for one (mTLS)
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("bootstrap_servers names no broker")
        if self.sasl and not (self.sasl_username and self.sasl_password is not None):
            raise ValueError(f"{self.security_protocol} needs a SASL username and password")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together")

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()]

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL")

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def librdkafka(self) -> dict[str, Any]:
        """Configuration properties of a confluent-kafka client."""
        config: dict[str, Any] = {"bootstrap.servers": ",".join(self.servers), "client.id": self.client_id,
                                  "security.protocol": self.security_protocol}
        if self.sasl:
            config |= {"sasl.mechanism": self.sasl_mechanism, "sasl.username": self.sasl_username,
                       "sasl.password": self.sasl_password}
        if self.tls:
            config |= {k: v for k, v in (("ssl.ca.location", self.ssl_cafile),
                                         ("ssl.certificate.location", self.ssl_certfile),
                                         ("ssl.key.location", self.ssl_keyfile)) if v is not None}
        return config

    def kafka_python(self) -> dict[str, Any]:
        """Keyword arguments of a kafka-python client."""
        config: dict[str, Any] = {"bootstrap_servers": self.servers, "client_id": self.client_id,
                                  "security_protocol": self.security_protocol}
        if self.sasl:
            config |= {"sasl_mechanism": self.sasl_mechanism, "sasl_plain_username": self.sasl_username,
                       "sasl_plain_password": self.sasl_password}
        if self.tls:
            config |= {k: v for k, v in (("ssl_cafile", self.ssl_cafile), ("ssl_certfile", self.ssl_certfile),
                                         ("ssl_keyfile", self.ssl_keyfile)) if v is not None}
        return config
