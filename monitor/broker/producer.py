"""The producer model-server teams use: contracts, signed traces and task outcomes.

    from monitor.producer import TraceProducer

    with TraceProducer(bootstrap_servers="kafka:9092", key_id="team-a", secret=b"...") as producer:
        producer.publish_contract(contract)          # once per model revision, before its traces
        producer.send(header, weights)               # key = header.request_id
        producer.send_outcome(header.request_id, "success")
        producer.send_outcome(other_request_id, label="thumbs_down", score=0.2)  # minutes or days later

Large traces need the limits raised together: the topic's ``max.message.bytes``, the
broker's ``message.max.bytes`` and this producer's ``max_request_size`` (default here
16 MiB + headroom, matching the monitor's default record limit).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from types import TracebackType
from typing import Any

import numpy as np
from kafka import KafkaProducer
from numpy.typing import NDArray

from monitor.protocol.codec import encode
from monitor.protocol.model_contract import ContractTable, ModelContract
from monitor.protocol.schema import TaskOutcome, TraceHeader
from monitor.protocol.topics import DEFAULT, TRACE_RECORD_BYTES, Topics

#: trace ids remembered to refuse a second use (a trace id is unique per request × layer)
RECENT_TRACE_IDS = 100_000


class TraceProducer:
    """Encodes, signs and sends; extra keyword arguments go to ``KafkaProducer``. Every
    ``send`` returns kafka-python's future of the record's metadata."""

    def __init__(self, *, key_id: str, secret: bytes, topics: Topics = DEFAULT, **kafka_config: Any):
        self.topics = topics
        self._key_id = key_id
        self._secret = secret
        self._recent: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()
        kafka_config.setdefault("max_request_size", TRACE_RECORD_BYTES)
        kafka_config.setdefault("linger_ms", 5)
        self._producer = KafkaProducer(**kafka_config)

    def publish_contract(self, contract: ModelContract) -> Any:
        """Publish a model contract on the compacted contracts topic, keyed by its id and
        signed with this producer's key (which the monitor's keyring must allow to
        publish contracts).
        The monitor refuses traces of a contract it does not know (``unknown_contract``):
        wait for the returned future (``.get()``) before sending the contract's first
        traces, and the monitor finds it whatever the timing."""
        key, value = ContractTable.record(contract, self._key_id, self._secret)
        return self._producer.send(self.topics.contracts, key=key, value=value)

    def send(self, header: TraceHeader, weights: NDArray[np.generic], sink: NDArray[np.generic] | None = None) -> Any:
        """Queue one trace (one request × one layer); ``sink``: each row's mass on the
        layer's learned sink, when the header says ``learned_sink``. A ``trace_id``
        already sent (among the last ``RECENT_TRACE_IDS``) raises ``ValueError``: the
        monitor would drop the second record as a duplicate, so a request-level id would
        silently lose every layer but the first."""
        value = encode(header, weights, self._key_id, self._secret, sink)
        with self._lock:
            earlier = self._recent.get(header.trace_id)
            if earlier is not None:
                raise ValueError(f"trace_id {header.trace_id!r} was already sent (request {earlier[0]!r}, layer "
                                 f"{earlier[1]}); a trace id must be unique per request × layer")
            self._recent[header.trace_id] = (header.request_id, header.layer)
            if len(self._recent) > RECENT_TRACE_IDS:
                self._recent.popitem(last=False)
        return self._producer.send(self.topics.traces, key=header.request_id.encode(), value=value)

    def send_outcome(self, request_id: str, outcome: str | None = None, timestamp: float | None = None, *,
                     label: str | None = None, score: float | None = None) -> Any:
        """Queue how a request ended: ``outcome`` ``success`` or ``failure`` (what metrics
        and alerts count), ``label`` how it was given (``thumbs_down``, ``regenerate``,
        ``abandoned``, ``escalated``, ``thumbs_up``, ``accepted`` imply the outcome, which
        may then be left out; any other lower-case word needs it), ``score`` a grade from
        0 to 1, ``timestamp`` when it was given (now by default). It may come minutes to
        days after the request: see ``OUTCOME_WINDOW_S``. A record the monitor would
        refuse raises ``ValueError`` here instead (pydantic's ``ValidationError`` is one).
        The record always names its outcome, so monitors that predate labels read it."""
        record = TaskOutcome.model_validate({
            "request_id": request_id, "outcome": outcome, "label": label, "score": score,
            "timestamp": time.time() if timestamp is None else timestamp})
        return self._producer.send(self.topics.outcomes, key=request_id.encode(),
                                   value=record.model_dump_json(exclude_none=True).encode())

    def flush(self, timeout: float | None = None) -> None:
        self._producer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._producer.close(timeout)

    def __enter__(self) -> TraceProducer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.flush()
        self.close()
