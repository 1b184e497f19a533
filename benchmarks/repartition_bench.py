"""Re-keying observations through Kafka, exactly once: the project's own clients against
quix-streams' ``group_by``, on one broker, in one run.

    python benchmarks/repartition_bench.py [--records 20000] [--size 3900] \\
        [--quix-python /path/to/a/python/with/quixstreams]

Judging a (model, revision, layer) stream in one place needs a second hop: what the
detector needs of each trace (``--size`` bytes: the pickled observation,
``benchmarks/judge_bench.py`` prints it) leaves the instance that measured it, keyed by
its stream, and the instance that owns the stream's partition keeps the state. Both
sides do exactly that on the same records (keyed by request id, ``--streams`` stream
keys), in one process each, and both hops in Kafka transactions:

- own: a :class:`~monitor.broker.group.GroupMember` (confluent-kafka) subscribed to the
  source and the repartition topic, and the service's transactional
  :class:`~monitor.broker.outputs.OutputProducer` (kafka-python): a poll's source records
  go to the repartition topic re-keyed, its repartition records are counted per stream
  and each stream counted in the poll writes its state to a compacted changelog, all in
  one transaction with the poll's offsets;
- own-batched: the same, but each transaction carries one record per stream key holding
  that stream's values of the transaction, in order (length-prefixed);
- own-rdk: as own, its transactions on confluent-kafka's producer (librdkafka) instead,
  as quix-streams has them;
- quix-streams: ``Application(processing_guarantee="exactly-once")``, ``group_by`` on the
  stream key, a stateful count (RocksDB, with its changelog topic). quix-streams pins
  confluent-kafka below this project's version, so it runs in the interpreter given by
  ``--quix-python`` (a separate virtualenv); without it that side is skipped.

It prints records/s from the first record to the last counted and CPU seconds per 1,000
records of each side's process (the broker's own CPU aside), each side twice,
alternating; both commit at most every 0.1 s, as the service does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka import Producer, TopicPartition
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from devstack.kafka import KafkaBroker, start_broker
from monitor.broker.group import GroupMember
from monitor.broker.outputs import OutputProducer
from monitor.protocol.records import Output

PARTITIONS = 4
COMMIT_INTERVAL_S = 0.1  #: both sides commit at most this often (the service's COMMIT_INTERVAL_MS is 100)

#: the quix-streams side, run by --quix-python: argv bootstrap, source topic, records, group
QUIX = r"""
import json, sys, time
from quixstreams import Application

bootstrap, source, total, group = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
app = Application(broker_address=bootstrap, consumer_group=group, processing_guarantee="exactly-once",
                  auto_offset_reset="earliest", commit_interval=0.1, state_dir=sys.argv[5])
topic = app.topic(source, value_deserializer="bytes", key_deserializer="bytes")
seen = {"n": 0, "first": None, "last": None}

def read(value):
    seen["first"] = seen["first"] or time.perf_counter()

def count(value, state):
    state.set("n", state.get("n", 0) + 1)
    seen["n"] += 1
    if seen["n"] == total:
        seen["last"] = time.perf_counter()
        app.stop()

sdf = app.dataframe(topic)
sdf = sdf.update(read)
sdf = sdf.group_by(lambda value: value[: value.index(b"\n")].decode(), name="stream",
                   value_deserializer="bytes", value_serializer="bytes",
                   key_serializer="str", key_deserializer="str")
sdf = sdf.update(count, stateful=True)
cpu = time.process_time()
app.run()
print(json.dumps({"seconds": seen["last"] - seen["first"], "cpu": time.process_time() - cpu, "n": seen["n"]}))
"""


def fill(bootstrap: str, topic: str, records: int, size: int, streams: int) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=1 << 20, acks="all")
    for i in range(records):
        head = f"model-{i % 3}\x00rev-1\x00layer-{i % (streams // 3)}\n".encode()
        producer.send(topic, key=f"req-{i // 12}".encode(), value=head + b"x" * (size - len(head)))
    producer.flush()
    producer.close()


def frame(values: list[bytes]) -> bytes:
    """A stream's values of one transaction as one record: each with its length."""
    return b"".join(len(v).to_bytes(4, "big") + v for v in values)


def unframe(blob: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(blob):
        size = int.from_bytes(blob[at: at + 4], "big")
        out.append(blob[at + 4: at + 4 + size])
        at += 4 + size
    return out


class LibrdkafkaTransactions:
    """The same transactions on confluent-kafka's producer (librdkafka), for comparison:
    the service keeps its outputs on kafka-python because librdkafka's
    ``send_offsets_to_transaction`` can hang after a broker outage."""

    def __init__(self, bootstrap: str, transactional_id: str, member: GroupMember):
        self._producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id,
                                   "linger.ms": 5, "enable.idempotence": True})
        self._producer.init_transactions(30)
        self._member = member

    def commit(self, outputs: list[Output], offsets: dict[tuple[str, int], int], _: object) -> None:
        self._producer.begin_transaction()
        for out in outputs:
            self._producer.produce(out.topic, out.value, out.key)
            self._producer.poll(0)
        self._producer.send_offsets_to_transaction(
            [TopicPartition(t, p, o) for (t, p), o in offsets.items()],
            self._member._consumer.consumer_group_metadata(), 30)  # the raw metadata librdkafka wants
        self._producer.commit_transaction(30)

    def close(self) -> None:
        self._producer.flush(10)


def own(broker: KafkaBroker, source: str, records: int, run: int, client: str) -> dict[str, float]:
    connection = broker.connection()
    repartition, changelog = f"{client}-repartition-{run}", f"{client}-changelog-{run}"
    admin = KafkaAdminClient(**broker.client_config())
    admin.create_topics([NewTopic(repartition, PARTITIONS, 1),
                         NewTopic(changelog, PARTITIONS, 1, topic_configs={"cleanup.policy": "compact"})])
    admin.close()
    member = GroupMember(connection, f"{client}-{run}", [source, repartition], max_records=2000,
                         max_partition_fetch_bytes=1 << 20)
    member.subscribe()
    producer: OutputProducer | LibrdkafkaTransactions = (
        OutputProducer(connection, f"{client}-{run}") if client in ("own", "own-batched") else
        LibrdkafkaTransactions(broker.bootstrap, f"{client}-{run}", member))
    counts: Counter[bytes] = Counter()
    first = last = None
    outputs: list[Output] = []
    offsets: dict[tuple[str, int], int] = {}
    changed: set[bytes] = set()
    forward: dict[bytes, list[bytes]] = {}  #: stream key -> its values read since the last commit, in order
    batched = client == "own-batched"
    committed_at = 0.0
    cpu = time.process_time()
    try:
        while sum(counts.values()) < records:
            polled = member.poll(100)
            first = first or (time.perf_counter() if polled else None)
            for r in polled:
                offsets[(r.topic, r.partition)] = r.offset + 1
                value = bytes(r.value or b"")
                if r.topic == source:
                    forward.setdefault(value[: value.index(b"\n")], []).append(value)
                else:
                    counts[r.key or b""] += 1 if not batched else len(unframe(value))
                    changed.add(r.key or b"")
            if offsets and time.monotonic() - committed_at >= COMMIT_INTERVAL_S:
                for key, values in forward.items():
                    outputs += ([Output(repartition, key, frame(values), ("", 0, 0))] if batched else
                                [Output(repartition, key, v, ("", 0, 0)) for v in values])
                forward = {}
                outputs += [Output(changelog, key, str(counts[key]).encode(), ("", 0, 0)) for key in changed]
                producer.commit(outputs, offsets, member.group_metadata())
                committed_at = time.monotonic()
                outputs, offsets, changed = [], {}, set()
        last = time.perf_counter()
    finally:
        member.close()
        producer.close()
    assert first is not None and last is not None
    return {"seconds": last - first, "cpu": time.process_time() - cpu, "n": sum(counts.values())}


def quix(python: str, bootstrap: str, source: str, records: int, run: int, state_dir: Path) -> dict[str, float]:
    done = subprocess.run([python, "-c", QUIX, bootstrap, source, str(records), f"quix-{run}", str(state_dir)],
                          capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the quix-streams side failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=3_900, help="bytes a record (the pickled observation)")
    parser.add_argument("--streams", type=int, default=96, help="stream keys (3 revisions x 32 layers)")
    parser.add_argument("--quix-python", help="an interpreter that imports quixstreams (skipped when absent)")
    args = parser.parse_args()

    broker = start_broker()
    try:
        source = "observations-source"
        admin = KafkaAdminClient(**broker.client_config())
        admin.create_topics([NewTopic(source, PARTITIONS, 1)])
        admin.close()
        fill(broker.bootstrap, source, args.records, args.size, args.streams)
        print(f"{args.records:,} records of {args.size:,} bytes, {args.streams} stream keys, {PARTITIONS} partitions; "
              "exactly once, both hops")
        sides = ["own", "own-batched", "own-rdk", *(["quix"] if args.quix_python else [])]
        for run in range(2):
            for side in sides:
                if side != "quix":
                    got = own(broker, source, args.records, run, side)
                else:
                    got = quix(args.quix_python, broker.bootstrap, source, args.records, run,
                               Path(broker.workdir) / f"quix-state-{run}")
                if got["n"] != args.records:
                    raise SystemExit(f"{side} counted {got['n']} of {args.records}")
                print(f"  {side:<11} run {run + 1}: {args.records / got['seconds']:8,.0f} records/s   "
                      f"{got['cpu'] / args.records * 1000:6.2f} CPU s per 1,000 records")
    finally:
        broker.stop()


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    main()
