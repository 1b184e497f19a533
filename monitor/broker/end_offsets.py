"""End offsets asked on a connection of their own.

A consumer's connection to the broker carries its long-poll fetches, and the broker
answers one connection's requests in order: ``end_offsets`` on a consumer that is
fetching waited behind the fetch for up to ``fetch_max_wait_ms`` (500 ms). The service
asked for the contracts topic's end before every batch of traces, and spent 93 % of its
main thread there (91 traces/s on the service bench). A client that never fetches
answers in a round trip.
"""

from __future__ import annotations

from typing import Any

from kafka import KafkaConsumer, TopicPartition


class EndOffsets:
    def __init__(self, kafka_config: dict[str, Any]):
        self._client = KafkaConsumer(enable_auto_commit=False, group_id=None, **kafka_config)

    def __call__(self, partitions: list[TopicPartition], timeout_ms: int) -> dict[TopicPartition, int]:
        result: dict[TopicPartition, int] = self._client.end_offsets(partitions, timeout_ms=timeout_ms)
        return result

    def close(self) -> None:
        self._client.close(autocommit=False)
