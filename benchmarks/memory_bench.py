"""Memory of the service over a long run on the real broker: does it plateau?

    python benchmarks/memory_bench.py [--traces 60000] [--rate 400] [--keys 512]

Starts a plaintext Kafka broker (devstack) and ``python -m monitor run`` with
``--processes`` measuring processes and the service's default settings (join TTL,
de-duplication window, pending table; every stream judged in one place, its observations
through the broker), as :mod:`benchmarks.service_bench` does; then produces signed traces
*while* the service consumes them, at a steady ``--rate`` (traces/s) held back whenever
the service falls more than ``--max-lag`` traces behind: steady state, not a backlog, so
the run measures what the service holds while it keeps up. Traces are generated as they
are sent (a pool of weight tensors under fresh headers), never all held in memory.

The traffic: requests of three model revisions (two of one model, one of another with
more layers), a trace a layer, each trace with its own trace id and each request its own
id, ``[16, --rows, --keys]`` float16 weights (129 KiB at the defaults). Of every eight
requests, five get their outcome at once (one a failure), so the join matches them; one
gets it after the join window (``JOIN_TTL_S`` + 10 s), so its request waits in the
pending table and is settled there; two never get one, so their requests stay in the
pending table for ``OUTCOME_WINDOW_S`` (three days), as a deployment's unanswered
requests do.

Printed: the service's PSS (its process, its measuring processes, the total), sampled
every 0.2 s and grouped by the quarter of the traces consumed when sampled, the median of
each quarter, the last quarter against the first and the growth per 10,000 traces
(between the quarters' medians, and fitted by least squares within each quarter); with
``--samples FILE``, every sample as CSV (traces consumed, KiB of each); and at the end
the join's entries, the pending table's requests and the outcome counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from confluent_kafka import Producer

from benchmarks.service_bench import (
    CONSUMED,
    KEY_ID,
    SCRAPE_S,
    SECRET,
    metrics,
    prepare_topics,
    pss_kib,
    start_service,
    tree,
)
from devstack.kafka import start_broker
from monitor.protocol.codec import encode
from monitor.protocol.schema import TaskOutcome
from monitor.settings import Settings
from monitor.tools.synthetic import SyntheticModel, layer_roles, make_header, sample_positions, trace_weights

#: the revisions whose requests are produced, in turn
MODELS = (SyntheticModel("bench-lm", "rev-1", layers=4, heads=16, kv_groups=4),
          SyntheticModel("bench-lm", "rev-2", layers=4, heads=16, kv_groups=4),
          SyntheticModel("chat-lm", "rev-7", layers=6, heads=16, kv_groups=4))
#: weight tensors per (revision, layer) in the pool, reused under fresh headers
POOL = 4
#: what each of eight requests in turn gets: an outcome at once, after the join window, or none
PLAN = ("success", "success", "success", "failure", "success", "late", "none", "none")
SAMPLE_S = 0.2  #: seconds between PSS samples, as service_bench samples
GAUGES = ("attention_monitor_join_entries", "attention_monitor_pending_requests",
          "attention_monitor_outcomes_late_total", "attention_monitor_outcomes_unmatched_total",
          "attention_monitor_traces_rejected_total", "attention_monitor_duplicates_total",
          "attention_monitor_observations_judged_total", "attention_monitor_join_evictions_total",
          "attention_monitor_pending_evictions_total")


class Traffic:
    """Requests generated one at a time: each layer's trace signed under a fresh header."""

    def __init__(self, keys: int, rows: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.contracts = [m.contract() for m in MODELS]
        self.pool = {(i, layer, k): (positions, trace_weights(rng, layer_roles(layer, m.heads), positions, keys))
                     for i, m in enumerate(MODELS) for layer in range(m.layers) for k in range(POOL)
                     for positions in [sample_positions(rng, keys, rows)]}
        self.keys = keys

    def request(self, n: int) -> tuple[str, list[bytes]]:
        """Request ``n``: its id and its signed traces, one a layer."""
        model = n % len(MODELS)
        request_id = f"req-{n}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        traces = []
        for layer in range(MODELS[model].layers):
            positions, weights = self.pool[model, layer, (n // len(MODELS)) % POOL]
            header = make_header(self.contracts[model], layer, positions, self.keys, request_id=request_id,
                                 timestamp=now)
            traces.append(encode(header, weights, KEY_ID, SECRET))
        return request_id, traces


def outcome_value(request_id: str, outcome: str) -> bytes:
    return TaskOutcome(request_id=request_id, outcome=outcome, timestamp=time.time()).model_dump_json().encode()


@dataclass
class Sample:
    consumed: float  #: traces consumed by the last scrape before the sample
    service: int  #: KiB, the service's process
    children: int  #: KiB, its measuring processes


@dataclass
class Run:
    traces: int
    seconds: float  #: from the first trace produced to the last consumed
    samples: list[Sample] = field(default_factory=list)
    at_end: dict[str, float] = field(default_factory=dict)  #: gauges when the last trace was consumed
    drained: dict[str, float] = field(default_factory=dict)  #: gauges once every trace was judged
    late_sent: int = 0


def sample(pid: int, consumed: float) -> Sample:
    own = pss_kib(pid)
    return Sample(consumed, own, sum(pss_kib(p) for p in tree(pid)[1:]))


def send(producer: Producer, topic: str, key: bytes, value: bytes) -> None:
    """Queue one message, waiting for room in the producer's bounded queue."""
    while True:
        try:
            producer.produce(topic, key=key, value=value)
            return
        except BufferError:
            producer.poll(0.05)


def run(bootstrap: str, args: argparse.Namespace, traffic: Traffic) -> Run:
    join_ttl = args.join_ttl if args.join_ttl is not None else Settings.model_fields["join_ttl_s"].default
    late_after = join_ttl + 10.0
    service, port, work = start_service(bootstrap, "memory-bench", args.processes, args.join_ttl)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "queue.buffering.max.kbytes": 65536})
    late: deque[tuple[float, str]] = deque()  #: (when due, request id)
    try:
        deadline = time.monotonic() + 120
        while True:  # until the service answers
            service.check_alive()
            try:
                metrics(port, CONSUMED)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the service did not start within 120 s; see {work / 'monitor.log'}") from None
                time.sleep(0.2)
        result = Run(args.traces, 0.0)
        produced, requests, consumed = 0, 0, 0.0
        allowance, last = 0.0, time.monotonic()
        started = next_sample = scraped = last
        while consumed < args.traces:
            now = time.monotonic()
            allowance = min(allowance + (now - last) * args.rate, args.rate * 0.5)  # at most half a second's burst
            last = now
            if now >= next_sample:
                service.check_alive()
                result.samples.append(sample(service.pid, consumed))
                next_sample += SAMPLE_S
            if now - scraped >= SCRAPE_S:
                scraped = now
                consumed = metrics(port, CONSUMED)[0]
            while late and late[0][0] <= now:
                _, request_id = late.popleft()
                send(producer, "b-outcomes", request_id.encode(), outcome_value(request_id, "success"))
                result.late_sent += 1
            if produced < args.traces and allowance >= 1 and produced - consumed < args.max_lag:
                request_id, traces = traffic.request(requests)
                plan = PLAN[requests % len(PLAN)]
                requests += 1
                for value in traces[: args.traces - produced]:
                    send(producer, "b-traces", request_id.encode(), value)
                produced += min(len(traces), args.traces - produced)
                allowance -= len(traces)
                if plan in ("success", "failure"):
                    send(producer, "b-outcomes", request_id.encode(), outcome_value(request_id, plan))
                elif plan == "late":
                    late.append((now + late_after, request_id))
                producer.poll(0)
            else:
                producer.poll(0.005)
            if now - started > args.timeout:
                raise SystemExit(f"{consumed:.0f} of {args.traces} traces consumed after {args.timeout:.0f} s; "
                                 f"see {work / 'monitor.log'}")
        result.seconds = time.monotonic() - started
        result.samples.append(sample(service.pid, consumed))
        result.at_end = dict(zip(GAUGES, metrics(port, *GAUGES), strict=True))
        # the last traces leave the join after its TTL; the late outcomes still due are sent
        deadline = time.monotonic() + late_after + 60
        while time.monotonic() < deadline:
            while late and late[0][0] <= time.monotonic():
                _, request_id = late.popleft()
                send(producer, "b-outcomes", request_id.encode(), outcome_value(request_id, "success"))
                result.late_sent += 1
            producer.poll(0.2)
            drained = dict(zip(GAUGES, metrics(port, *GAUGES), strict=True))
            if not late and drained["attention_monitor_observations_judged_total"] >= args.traces and \
                    not drained["attention_monitor_join_entries"]:
                break
            time.sleep(SCRAPE_S)
        producer.flush(30)
        result.drained = dict(zip(GAUGES, metrics(port, *GAUGES), strict=True))
        final = sample(service.pid, consumed)
        print(f"once every trace was judged and every late outcome read: PSS service {final.service / 1024:.0f} MiB, "
              f"measuring {final.children / 1024:.0f} MiB, total {(final.service + final.children) / 1024:.0f} MiB")
    finally:
        service.stop()
    if result.drained["attention_monitor_traces_rejected_total"]:
        raise SystemExit(f"the service rejected {result.drained['attention_monitor_traces_rejected_total']:.0f} "
                         f"traces; see {work / 'monitor.log'}")
    return result


def slope(samples: list[Sample], part: str) -> float:
    """MiB per 10,000 traces, least squares over ``samples``."""
    if len(samples) < 2 or len({s.consumed for s in samples}) < 2:
        return float("nan")
    y = [(s.service if part == "service" else s.children if part == "measuring" else s.service + s.children) / 1024
         for s in samples]
    return float(np.polyfit([s.consumed for s in samples], y, 1)[0] * 10_000)


def report(result: Run, args: argparse.Namespace) -> None:
    n = result.traces
    during = [s for s in result.samples if s.consumed > 0]
    quarters: list[list[Sample]] = [[], [], [], []]
    for s in during:
        quarters[min(3, int(s.consumed * 4 // n))].append(s)
    print(f"{n} traces in {result.seconds:.0f} s ({n / result.seconds:.0f} traces/s consumed; asked "
          f"{args.rate:.0f}/s, at most {args.max_lag} behind); {len(during)} PSS samples")
    parts: dict[str, Any] = {"service": lambda s: s.service, "measuring": lambda s: s.children,
                             "total": lambda s: s.service + s.children}
    for name, of in parts.items():
        medians = [statistics.median(of(s) for s in q) / 1024 if q else float("nan") for q in quarters]
        per_10k = (medians[3] - medians[0]) / (n / 2) * 10_000  # quarters' midpoints are n/2 apart
        print(f"  PSS {name:9s} median by quarter {', '.join(f'{m:.0f}' for m in medians)} MiB; last against first "
              f"quarter {medians[3] - medians[0]:+.1f} MiB ({medians[3] / medians[0]:.2f}x), {per_10k:+.1f} MiB per "
              f"10,000 traces; fitted within each quarter {', '.join(f'{slope(q, name):+.1f}' for q in quarters)} "
              "MiB per 10,000")
    for label, gauges in (("when the last trace was consumed", result.at_end),
                          ("once every trace was judged", result.drained)):
        print(f"  {label}: " + ", ".join(f"{k.removeprefix('attention_monitor_')} {v:.0f}" for k, v in gauges.items()))
    print(f"  late outcomes sent {result.late_sent}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=60_000, help="traces to produce and consume (default 60000)")
    parser.add_argument("--rate", type=float, default=400.0,
                        help="traces a second to produce (default 400), held back while the service is more than "
                             "--max-lag behind")
    parser.add_argument("--max-lag", type=int, default=4000,
                        help="produce nothing while this many traces wait unconsumed (default 4000)")
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2, help="measuring processes (default 2)")
    parser.add_argument("--join-ttl", type=float, default=None,
                        help="the service's join TTL in seconds (default: the service's own, JOIN_TTL_S)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="give up when the traces are not consumed within this many seconds (default 900)")
    parser.add_argument("--samples", type=Path, default=None, help="write every PSS sample to this CSV file")
    args = parser.parse_args()
    if args.traces < 4 or args.rate <= 0 or args.max_lag < 8:
        parser.error("--traces at least 4, --rate positive, --max-lag at least 8")
    traffic = Traffic(args.keys, args.rows)
    size = sum(len(v) for v in traffic.request(0)[1]) / MODELS[0].layers
    print(f"{args.traces} traces of [16, {args.rows}, {args.keys}] float16, {size / 1024:.1f} KiB each, "
          f"{len(MODELS)} revisions, {args.processes} measuring processes")
    broker = start_broker("plaintext")
    try:
        prepare_topics(broker.bootstrap, traffic.contracts)
        result = run(broker.bootstrap, args, traffic)
    finally:
        broker.stop()
    if args.samples:
        args.samples.write_text("consumed,service_kib,measuring_kib\n" + "".join(
            f"{s.consumed:.0f},{s.service},{s.children}\n" for s in result.samples))
    report(result, args)


if __name__ == "__main__":
    main()
