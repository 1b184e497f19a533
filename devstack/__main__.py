"""Start the development services by hand.

    python -m devstack kafka [--profile plaintext|scram] [--partitions N] [--no-topics]
    python -m devstack prometheus --target JOB=HOST:PORT [--alertmanager]
    python -m devstack classpath

Each command prints how to connect and runs until interrupted (Ctrl-C), then stops
the service cleanly and removes its temporary data. The broker starts with the
monitor's topics created as ``attention-monitor topics create`` (and docker-compose.yml)
creates them.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from devstack import kafka, prometheus
from devstack.process import ServiceError
from monitor.errors import MonitorError


def _block_until_interrupted() -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("kafka", help="run a single-node KRaft broker on 127.0.0.1")
    k.add_argument("--profile", choices=kafka.PROFILES, default="plaintext",
                   help="plaintext, or SASL/SCRAM-SHA-512 with ACLs and default deny")
    k.add_argument("--partitions", type=int, default=2, help="partitions of the traces, outcomes and anomalies "
                   "topics (default 2)")
    k.add_argument("--no-topics", action="store_true", help="start without the monitor's topics")
    p = sub.add_parser("prometheus", help="run Prometheus on deploy/prometheus/prometheus.yml")
    p.add_argument("--target", action="append", default=[], metavar="JOB=HOST:PORT",
                   help="a scrape target (repeatable), e.g. attention-monitor=127.0.0.1:9464")
    p.add_argument("--alertmanager", action="store_true", help="also run Alertmanager")
    p.add_argument("--webhook", default="http://127.0.0.1:5001/alerts",
                   help="where Alertmanager sends notifications")
    sub.add_parser("classpath", help="resolve (and cache) the broker classpath, print its size")
    args = parser.parse_args(argv)

    try:
        if args.command == "classpath":
            cp = kafka.classpath()
            print(f"{len(cp.split(':'))} jars resolved, cached under {kafka.CACHE}")
            return 0
        if args.command == "kafka":
            broker = kafka.start_broker(args.profile)
            print(f"kafka ({args.profile}) ready: bootstrap {broker.bootstrap}")
            if args.profile == "scram":
                print(f"  super user {kafka.ADMIN_USER} / {kafka.ADMIN_PASSWORD}, {kafka.MECHANISM}")
            if not args.no_topics:
                from monitor.broker.admin import create_topics
                from monitor.protocol.topics import layout

                specs = layout(partitions=args.partitions)
                create_topics(broker.connection(), specs, replication_factor=1)
                print(f"  topics {', '.join(spec.name for spec in specs)}")
            print(f"  export ATTENTION_MONITOR_BOOTSTRAP_SERVERS={broker.bootstrap}")
            print(f"  log {broker.process.log_path}")
            _block_until_interrupted()
            broker.stop()
            return 0
        targets: dict[str, list[str]] = {}
        for item in args.target:
            job, _, addr = item.partition("=")
            if not job or not addr:
                parser.error(f"--target wants JOB=HOST:PORT, got {item!r}")
            targets.setdefault(job, []).append(addr)
        am = prometheus.start_alertmanager(args.webhook) if args.alertmanager else None
        prom = prometheus.start_prometheus(targets, [am.address] if am else None)
        print(f"prometheus ready: {prom.url}")
        if am:
            print(f"alertmanager ready: {am.url} (notifications to {args.webhook})")
        _block_until_interrupted()
        prom.stop()
        if am:
            am.stop()
        return 0
    except (ServiceError, MonitorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
