"""What a new owner of a trace partition pays to rebuild its requests awaiting a late
outcome, and what the table costs in memory, in one run.

    python benchmarks/pending_bench.py [--per-second 1] [--window-days 3] [--max-requests 250000]

The partition's ``attention-pending-outcomes`` records are written as the service writes
them (one every ``FLUSH_S`` with the requests whose join window closed meanwhile, from
``--per-second`` sampled requests of two traced layers; windows closing; the oldest
pushed out beyond ``--max-requests``) to a real broker; then the partition is read back
(the reference: what reading alone costs) and the table rebuilt from it
(:meth:`monitor.service.late.Late.rebuild`). Printed: records, requests, seconds and CPU
seconds of each step and the rebuild's ratio to the read, and the table's memory per
request (``tracemalloc``).
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafka import KafkaAdminClient, KafkaProducer
from prometheus_client import CollectorRegistry

from devstack.kafka import start_broker
from monitor.broker.tail import read_range
from monitor.core.pending import PendingOutcomes
from monitor.protocol import pending
from monitor.protocol.topics import Topics
from monitor.service.exporter import MonitorMetrics
from monitor.service.late import FLUSH_S, Late


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-second", type=float, default=1.0, help="sampled requests a second on the partition")
    parser.add_argument("--window-days", type=float, default=3.0, help="OUTCOME_WINDOW_S, in days")
    parser.add_argument("--max-requests", type=int, default=250_000, help="OUTCOME_MAX_REQUESTS")
    args = parser.parse_args()
    window = args.window_days * 86400
    flushes = int(window / FLUSH_S)
    per_flush = max(1, round(args.per_second * FLUSH_S))

    def fill(table: PendingOutcomes, send=lambda value: None) -> int:
        """The partition's traffic over the window, its deltas to ``send``; how many."""
        sent = 0
        for flush in range(flushes):
            now = 1.7e9 + FLUSH_S * flush
            for _ in range(per_flush):
                request = f"chatcmpl-{uuid.uuid4()}"
                for layer in (0, 1):
                    table.add(request, "org/model-7b", "rev-a", "rev-a", layer, 0, now)
            table.expire(now)
            for value in pending.encode(table.take_deltas(now)[0]):
                send(value)
                sent += 1
        return sent

    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    table = PendingOutcomes(window, args.max_requests)
    fill(table)
    memory = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    broker = start_broker()
    try:
        KafkaAdminClient(bootstrap_servers=broker.bootstrap).create_topics(
            {"pending": {"num_partitions": 1, "replication_factor": 1}})
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=20)
        written = fill(PendingOutcomes(window, args.max_requests), lambda value: producer.send("pending", value,
                                                                                             partition=0))
        producer.flush()

        wall, cpu = time.perf_counter(), time.process_time()
        values = [v for _, _, v in read_range(broker.connection(), "pending", 0, None, None, timeout_s=600)]
        read_wall, read_cpu = time.perf_counter() - wall, time.process_time() - cpu
        late = Late(MonitorMetrics(CollectorRegistry()), Topics(), window, args.max_requests, time.monotonic)
        wall, cpu = time.perf_counter(), time.process_time()
        waiting = late.rebuild(0, values)
        rebuild_wall, rebuild_cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        broker.stop()
    print(f"{args.per_second:g} sampled requests/s of 2 layers over {args.window_days:g} days, one record every "
          f"{FLUSH_S:g} s: {written} records, {len(table)} requests waiting (cap {args.max_requests})")
    print(f"read the partition: {read_wall:.2f} s, {read_cpu:.2f} s CPU")
    print(f"rebuild {waiting} requests: {rebuild_wall:.2f} s, {rebuild_cpu:.2f} s CPU "
          f"({rebuild_cpu / max(read_cpu, 1e-9):.2f}x the read's CPU)")
    print(f"memory of the table: {memory / max(len(table), 1):.0f} bytes a request (request ids included)")


if __name__ == "__main__":
    main()
