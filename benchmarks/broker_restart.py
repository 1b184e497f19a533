"""Transactions committed across a restart of the development broker (one node, KRaft):
does the broker keep every transaction it said was committed?

    python benchmarks/broker_restart.py [--rounds 10] [--producers 8] [--restart graceful|crash]

Each round, on a topic of its own, ``--producers`` kafka-python transactional producers
commit transactions as fast as they can, each writing one record to three partitions and
a consumer group's offset (as the monitor's transactions do), until the broker is
stopped: with SIGTERM (``graceful``, a controlled shutdown) or SIGKILL (``crash``). The
broker starts again on the same data; a new producer with each transactional id ends
what its predecessor left open (as the monitor's next producer does); then every record
of every transaction whose ``commit_transaction`` returned is looked for with a
``read_committed`` reader, and partitions whose last stable offset stays below their end
(a transaction no producer will end, which ``read_committed`` readers never pass) are
counted.

Measured on 2026-12-06 (docs/real-services.md): with ``graceful``, Kafka 4.3.1 now and
then records a transaction as committed (``CompleteCommit`` in ``__transaction_state``)
without writing its commit markers; its records are aborted when the producer's next
epoch ends the transaction that follows, so a reader never sees them, or, in a
partition that transaction did not write, stay open for good. That is why the rebalance
torture restarts its broker with SIGKILL (benchmarks/rebalance_torture.py).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.structs import OffsetAndMetadata

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devstack.kafka import KafkaBroker, start_broker
from monitor.broker.offsets import Offsets

SOURCE, GROUP = "restart-source", "restart-group"
PARTITIONS = 6


@dataclass
class Committed:
    """What the producers were told was committed, and when."""

    records: list[bytes] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def produce(bootstrap: str, topic: str, transactional_id: str, k: int, stop: threading.Event,
            committed: Committed) -> None:
    """Commit transactions until the broker goes away (the first error ends it)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=transactional_id, linger_ms=5,
                             request_timeout_ms=3000, max_block_ms=3000)
    producer.init_transactions()
    n = 0
    try:
        while not stop.is_set():
            producer.begin_transaction()
            values = [f"{k}-{n}-{i}".encode() for i in range(3)]
            sent = [producer.send(topic, value=v, partition=(k + i) % PARTITIONS) for i, v in enumerate(values)]
            producer.send_offsets_to_transaction(
                {TopicPartition(SOURCE, k % PARTITIONS): OffsetAndMetadata(n, "", -1)}, GROUP)
            producer.flush(3)
            for future in sent:
                future.get(timeout=3)
            producer.commit_transaction()
            with committed.lock:
                committed.records += values
                committed.at.append(time.monotonic())
            n += 1
    except Exception:  # the broker went away: this round's producing is over
        pass
    finally:
        threading.Thread(target=close, args=(producer,), daemon=True).start()


def close(producer: KafkaProducer) -> None:
    """Close without waiting for what the broker will never take (kafka-python raises then)."""
    with contextlib.suppress(Exception):
        producer.close(timeout=0)


def readable(bootstrap: str, topic: str) -> set[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                             auto_offset_reset="earliest", consumer_timeout_ms=6000, enable_auto_commit=False)
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        return {m.value for m in consumer}
    finally:
        consumer.close()


def hanging(broker: KafkaBroker, topic: str) -> int:
    """Partitions whose last stable offset stays below their end: a transaction left open
    that no producer will end (readers ``read_committed`` never pass it)."""
    offsets = Offsets(broker.connection())
    try:
        tps = [(topic, p) for p in range(PARTITIONS)]
        ends, stable = offsets.end(tps, 10), offsets.end(tps, 10, committed=True)
        return sum(stable[tp] < ends[tp] for tp in tps)
    finally:
        offsets.close()


def one_round(broker: KafkaBroker, topic: str, producers: int, restart: str,
              seconds: float) -> tuple[int, int, int, int]:
    """(transactions committed, of them after the stop signal, records of them not
    readable, partitions left with a transaction no one ends)."""
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    admin.close()
    committed, stop = Committed(), threading.Event()
    ids = [f"restart-{uuid.uuid4()}" for _ in range(producers)]
    threads = [threading.Thread(target=produce, args=(broker.bootstrap, topic, tid, k, stop, committed), daemon=True)
               for k, tid in enumerate(ids)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    signalled = time.monotonic()
    if restart == "crash":
        broker.kill()
    else:
        broker.process.stop()
    stop.set()
    deadline = time.monotonic() + 30  # a producer still starting when the broker went waits without a limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    broker.restart()
    for tid in ids:  # each id's next producer ends what the last one left open
        fencing = KafkaProducer(bootstrap_servers=broker.bootstrap, transactional_id=tid)
        fencing.init_transactions()
        fencing.close()
    seen = readable(broker.bootstrap, topic)
    lost = [v for v in committed.records if v not in seen]
    return len(committed.at), sum(t > signalled for t in committed.at), len(lost), hanging(broker, topic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--restart", choices=("graceful", "crash"), default="graceful")
    parser.add_argument("--seconds", type=float, default=3.0, help="producing before each stop")
    args = parser.parse_args()
    broker = start_broker("plaintext")
    try:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics([NewTopic(SOURCE, PARTITIONS, 1)])
        admin.close()
        totals = [0, 0, 0, 0, 0]
        for r in range(args.rounds):  # a topic each round: one left hanging would hide the next rounds' records
            done, after, lost, stuck = one_round(broker, f"restart-outputs-{r}", args.producers, args.restart,
                                                 args.seconds)
            totals = [totals[0] + done, totals[1] + after, totals[2] + lost, totals[3] + (lost > 0), totals[4] + stuck]
            print(f"round {r + 1}: {done} transactions committed ({after} after the stop signal); {lost} of their "
                  f"records not readable committed; {stuck} partitions left with a transaction no one ends",
                  flush=True)
        print(f"{args.restart} restarts: {args.rounds} rounds, {totals[0]} transactions committed ({totals[1]} after "
              f"the stop signal); {totals[2]} records lost, in {totals[3]} rounds; {totals[4]} partitions left "
              "hanging")
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
