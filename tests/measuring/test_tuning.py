"""The process settings the service applies to itself (monitor.measuring.tuning): the
garbage collector's, and the allocator's, measured where they matter: a consumer reading
large records from the real broker."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kafka import KafkaProducer

from monitor.measuring.tuning import YOUNG_THRESHOLD, collect_less

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 300

CONSUME = textwrap.dedent("""
    import resource, sys
    from kafka import KafkaConsumer
    from monitor.measuring.tuning import reuse_freed_memory
    bootstrap, topic, mode, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if mode == "tuned":
        assert reuse_freed_memory()
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, max_partition_fetch_bytes=2 << 20)
    seen, before, counted = 0, None, 0
    while seen < n:
        for batch in consumer.poll(timeout_ms=1000).values():
            if before is None and seen >= n // 3:  # the client's start-up and first fetches are not counted
                before, counted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, seen
            seen += len(batch)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (seen - counted))
""")


# glibc moves its mmap threshold up as large blocks are freed, so how often a default
# process faults in fresh pages depends on its allocation history and the client's version
# (0 to 97 faults a record seen here). Both runs start from glibc's initial threshold,
# fixed (128 KiB, which turns off the moving), so that the default run shows the faulting
# the settings are there to prevent, whatever the history.
ALLOCATOR = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}


def faults_per_record(bootstrap: str, topic: str, mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", CONSUME, bootstrap, topic, mode, str(RECORDS)], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, **ALLOCATOR})
    return float(out.stdout)


@pytest.mark.kafka
def test_a_consumer_of_large_records_stops_faulting_in_fresh_pages(kafka_broker, make_topic):
    topic = make_topic("large", partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, linger_ms=20, batch_size=1 << 20,
                             max_request_size=4 << 20)
    for i in range(RECORDS):
        producer.send(topic, key=str(i).encode(), value=os.urandom(128 * 1024))
    producer.flush()
    producer.close()
    default = faults_per_record(kafka_broker.bootstrap, topic, "default")
    tuned = faults_per_record(kafka_broker.bootstrap, topic, "tuned")
    print(f"page faults per 128 KiB record: {default:.1f} by default, {tuned:.1f} with the settings")
    # a 128 KiB record is 32 pages; by default each one is faulted in several times over
    # from glibc's initial threshold, with the settings a few
    assert default > 20, default
    assert tuned < 32 / 2 and tuned < default / 4, (default, tuned)


def test_collect_less_freezes_what_exists_and_collects_the_young_less_often():
    before = gc.get_threshold()
    try:
        survivor: list[object] = [[]]
        assert any(o is survivor for o in gc.get_objects())
        frozen = collect_less()
        assert frozen == gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        assert not any(o is survivor for o in gc.get_objects())  # out of every generation's reach
        cycle: list[object] = []
        cycle.append(cycle)
        assert any(o is cycle for o in gc.get_objects())  # what is made later is collected as before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
