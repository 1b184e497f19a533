"""What every confluent-kafka client of the monitor shares: librdkafka's logs and
errors routed to the monitor's log (repeats held back), and the consumer's group
metadata in the form the output producer needs.

The output producer (kafka-python's transactional producer; why, in
``docs/delivery.md``) commits the consumer's offsets in its transactions with the
consumer's group metadata (KIP-447). :func:`group_metadata` reads librdkafka's
serialisation of it (``rd_kafka_consumer_group_metadata_write``: the magic ``CGMDv2:``,
the generation as a native int32, then NUL-terminated group id and member id, a byte
that is 1 when there is no group instance id, else 0 and the NUL-terminated instance
id). That format is librdkafka's own, not an API: ``pyproject.toml`` pins
confluent-kafka to the versions tested here, and a format it does not know stops the
service at its first commit with a clear error instead of committing wrongly.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time

from confluent_kafka import KafkaError
from kafka.structs import ConsumerGroupMetadata

#: a message repeated within this long (the same but for its numbers) is counted, not logged
REPEAT_S = 30.0

#: what librdkafka's group metadata starts with (its format version)
METADATA_MAGIC = b"CGMDv2:"


def group_metadata(raw: bytes) -> ConsumerGroupMetadata:
    """kafka-python's group metadata from librdkafka's serialised one (see above);
    ``ValueError`` for any other format (a librdkafka that changed it)."""
    if not raw.startswith(METADATA_MAGIC) or len(raw) < len(METADATA_MAGIC) + 4:
        raise ValueError(f"librdkafka's group metadata is not in the format this service reads: {raw[:16]!r}")
    at = len(METADATA_MAGIC)
    generation = int.from_bytes(raw[at:at + 4], sys.byteorder, signed=True)
    try:
        group_id, member_id, rest = raw[at + 4:].split(b"\0", 2)
    except ValueError:
        raise ValueError(f"librdkafka's group metadata ends early: {raw!r}") from None
    if rest[:1] == b"\x00" and rest.endswith(b"\0"):
        instance: str | None = rest[1:-1].decode()
    elif rest == b"\x01":
        instance = None
    else:
        raise ValueError(f"librdkafka's group metadata has an unreadable group instance id: {raw!r}")
    return ConsumerGroupMetadata(group_id.decode(), generation, member_id.decode(), instance)


class QuietRepeats(logging.Filter):
    """Lets a message through once every ``REPEAT_S`` (the same but for its numbers: a
    broker address, a duration), then says how many like it were held back. librdkafka
    reports every failed reconnection: hundreds a minute while a broker is away."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], tuple[float, int]] = {}  #: key -> (last logged, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, re.sub(r"\d+", "#", record.getMessage())[:120])
        now = time.monotonic()
        with self._lock:
            logged, held = self._seen.get(key, (-REPEAT_S, 0))
            if now - logged < REPEAT_S:
                self._seen[key] = (logged, held + 1)
                return False
            self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} like it in the last {now - logged:.0f} s)"
            record.args = ()
        return True


#: librdkafka's own log lines (handed to ``logger``), repeats held back
client_log = logging.getLogger("monitor.broker.librdkafka.client")
client_log.addFilter(QuietRepeats())
_errors = logging.getLogger("monitor.broker.librdkafka.errors")
_errors.addFilter(QuietRepeats())


def client_error(error: KafkaError) -> None:
    """``error_cb``: errors of the client as a whole (librdkafka retries them itself)."""
    _errors.warning("Kafka client: %s: %s", error.name(), error.str())
