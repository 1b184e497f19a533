"""Rebalance torture on the real broker: a fleet of ``attention-monitor run`` instances
whose members join and leave every few seconds, whose judge of the canary is killed
(kill -9) in the middle of a rebalance, and whose broker restarts, all while healthy
traffic and a collapsed canary flow; compared with an undisturbed run of one instance
on the same traffic.

    python benchmarks/rebalance_torture.py [--requests 600] [--rounds 3] [--instances 3] \\
        [--rate 8] [--canary-every 4] [--partitions 6] [--workdir DIR] [--json FILE]

The traffic (``tests/service/test_service.py``'s factories): ``REFERENCE_TRACES`` healthy
requests of ``test-model`` ``rev-1`` teach its reference; then ``--requests`` requests,
every ``--canary-every``-th one of the canary ``rev-2`` (its heads collapsed), pinned to
``rev-1`` (``REFERENCE_PINS``), the others healthy ``rev-1``; each request is one trace
and its outcome. Every request of both runs is the same record (trace ids included), so
the runs' anomaly records can be compared one for one.

The disturbed run starts ``--instances`` instances in one group and, while the traffic
flows, repeats ``--rounds`` times: an instance joins; one leaves (SIGTERM); the instance
that judges the canary (the one whose ``attention_monitor_observations_judged_total``
grows) is killed with SIGKILL once a joining instance has put the group into a
rebalance; the broker is killed (SIGKILL) and starts again. Each step waits, with a
deadline, for the group to be stable with every live instance in it and ready.

The broker restart is a crash, not a graceful stop: stopped with SIGTERM, this one-node
Kafka 4.3.1 now and then records a transaction as committed without writing its commit
markers, and its records are aborted later with the transaction after it (in 1 of the
first 8 long runs here: 32 anomaly records lost, each in a transaction the broker had
said was committed; ``benchmarks/broker_restart.py`` shows it without the monitor).
No client can make up for that; docs/real-services.md has the measurements.

It prints and compares, by (trace id, kind): anomaly records lost and doubled, and any
the undisturbed run did not write; incidents opened; the canary request of the first
finding in each run; dead letters; and the disturbance itself (rebalances, group state
at the kill, takeovers, outage seconds, exits). The short version runs in the tests
(``tests/faults/test_rebalance_torture.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from devstack.kafka import KafkaBroker, start_broker
from devstack.wait import DeadlineExceeded, wait_for
from monitor.producer import TraceProducer
from monitor.protocol.topics import Topics
from monitor.tools.synthetic import SyntheticModel
from tests.factories import KEY_ID, SECRET
from tests.service.harness import Monitor, OutputReader, make_topics, monitor_env, publish_contracts, series
from tests.service.test_service import collapsed, healthy

HEALTHY = SyntheticModel("test-model", "rev-1", layers=2, heads=4, kv_groups=2).contract()
CANARY = SyntheticModel("test-model", "rev-2", layers=2, heads=4, kv_groups=2).contract()
PINS = "test-model@rev-2=rev-1"
LAYER = 0
REFERENCE_TRACES = 30  #: the harness's REFERENCE_TRACES
READY = series("attention_reference_ready", layer=LAYER, model="test-model", revision="rev-1")
JUDGED = "attention_monitor_observations_judged_total"
REBALANCING = ("PreparingRebalance", "CompletingRebalance")
#: the instances' own settings beyond the harness's: as shipped, but sessions as short as
#: allowed, and a delivery timeout of 15 s: after the broker restart, a transaction
#: kafka-python leaves unfinished is given up on after it (120 s as shipped)
SETTINGS = {"measure_processes": 0, "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000,
            "state_save_interval_s": 30, "reference_pins": PINS, "delivery_timeout_ms": 15_000}
Finding = tuple[str, str]  #: trace id, kind
#: what the instances log of rebalances, takeovers and transactions (a failure's report shows these lines)
TOLD = ("assigned", "rebalanced", "judging observations partition", "transaction", "in doubt", "sending it again",
        "stopping", "restarting", "consumer failed")


@dataclass(frozen=True)
class Request:
    header: Any
    weights: Any
    canary: int | None  #: the canary's request number (None: a healthy request)


def traffic(requests: int, canary_every: int) -> tuple[list[Request], list[Request]]:
    """The reference's healthy requests, then the flow: ``requests`` requests, every
    ``canary_every``-th the canary's. Trace times one second apart, in the past."""
    canaries = requests // canary_every
    flowing_healthy = iter(healthy(requests - canaries, LAYER, start=REFERENCE_TRACES))
    flowing_canary = iter(collapsed(canaries, LAYER, contract=CANARY))
    flow: list[tuple[Any, Any, int | None]] = []
    for i in range(requests):
        if (i + 1) % canary_every == 0:
            number = sum(c is not None for _, _, c in flow)
            flow.append((*next(flowing_canary), number))
        else:
            flow.append((*next(flowing_healthy), None))
    reference = [(h, w, None) for h, w in healthy(REFERENCE_TRACES, LAYER)]
    start = int(time.time()) - len(reference) - len(flow) - 60
    stamped = [Request(h.model_copy(update={"timestamp": float(start + i)}), w, c)
               for i, (h, w, c) in enumerate(reference + flow)]
    return stamped[:len(reference)], stamped[len(reference):]


class Sender:
    """Model servers: each request's trace, then its outcome, from a thread at a steady
    rate (kafka-python's idempotent producer keeps what it could not send yet through
    an outage)."""

    def __init__(self, bootstrap: str, topics: Topics):
        self.producer = TraceProducer(key_id=KEY_ID, secret=SECRET, topics=topics, bootstrap_servers=bootstrap)
        self.error: BaseException | None = None

    def send(self, requests: list[Request], rate: float | None = None) -> threading.Thread:
        thread = threading.Thread(target=self._send, args=(requests, rate), daemon=True)
        thread.start()
        return thread

    def _send(self, requests: list[Request], rate: float | None) -> None:
        try:
            began = time.monotonic()
            for i, request in enumerate(requests):
                if rate:  # pacing the load, not waiting for anything
                    time.sleep(max(0.0, began + i / rate - time.monotonic()))
                self.producer.send(request.header, request.weights)
                self.producer.send_outcome(request.header.request_id,
                                           "success" if request.canary is None else "failure")
            self.producer.flush(timeout=180)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self, thread: threading.Thread, timeout: float = 240) -> None:
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError(f"the traffic was not sent within {timeout:.0f} s")
        if self.error is not None:
            raise AssertionError(f"sending the traffic failed: {self.error!r}") from self.error

    def close(self) -> None:
        self.producer.close(timeout=10)


def name(monitor: Monitor) -> str:
    return monitor.process.name


class Fleet:
    """The instances of one group: started, stopped, killed, and the group as the broker sees it."""

    def __init__(self, broker: KafkaBroker, topics: Topics, group: str, workdir: Path):
        self.broker, self.topics, self.group, self.workdir = broker, topics, group, workdir
        self.live: list[Monitor] = []
        self.leaving: list[Monitor] = []
        self.exits: dict[str, int | None] = {}  #: every instance gone, and how
        self.rebalances: dict[str, float] = {}  #: each gone instance's last count of its rebalances
        self.started = 0
        self.admin = KafkaAdminClient(**broker.client_config())

    def start(self, wait: bool = True) -> Monitor:
        label = f"monitor-{self.started}"
        self.started += 1
        (self.workdir / label).mkdir(parents=True)
        env = monitor_env(self.broker.bootstrap, self.topics, self.group, self.workdir / label, client_id=label,
                          **SETTINGS)
        monitor = Monitor(env, self.workdir / f"{label}.log", label)
        self.live.append(monitor)
        if wait:
            monitor.wait_ready(timeout=120)
        return monitor

    def leave(self, monitor: Monitor) -> None:
        """SIGTERM: the instance finishes, commits and leaves (reaped by :meth:`close`)."""
        self._note(monitor)
        monitor.process.proc.send_signal(signal.SIGTERM)
        self.live.remove(monitor)
        self.leaving.append(monitor)

    def kill(self, monitor: Monitor) -> None:
        self._note(monitor)
        monitor.process.kill()
        self.live.remove(monitor)
        self.exits[name(monitor)] = monitor.process.proc.returncode

    def _note(self, monitor: Monitor) -> None:
        self.rebalances[name(monitor)] = monitor.value("attention_monitor_rebalances_total")

    def described(self) -> dict[str, Any]:
        described: dict[str, Any] = self.admin.describe_groups([self.group])[self.group]
        return described

    def state(self) -> str:
        return str(self.described()["group_state"])

    def settled(self, timeout: float = 120) -> None:
        """The group stable with exactly the live instances in it, each of them ready."""
        def stable() -> bool:
            self.check_alive()
            described = self.described()
            return (described["group_state"] == "Stable"
                    and sorted(m["client_id"] for m in described["members"]) == sorted(map(name, self.live))
                    and all(m.ready() for m in self.live))

        self.wait(stable, timeout, f"the group stable with its {len(self.live)} live instances, all ready")

    def judge(self, timeout: float = 60) -> Monitor:
        """The live instance that judges the traffic now: the one whose judged traces grow."""
        before = {name(m): m.value(JUDGED) for m in self.live}

        def grown() -> Monitor | None:
            grew = [m for m in self.live if m.value(JUDGED) > before[name(m)]]
            return grew[0] if len(grew) == 1 else None

        return self.wait(grown, timeout, "one instance judging the flowing traffic")

    def check_alive(self) -> None:
        for monitor in self.live:
            monitor.process.check_alive()

    def wait(self, probe: Callable[[], Any], timeout: float, what: str) -> Any:
        """:func:`wait_for`, saying on failure how the broker sees the group, whether
        each live instance is ready and why not, and what each logged last."""
        try:
            return wait_for(probe, timeout=timeout, what=what, interval=0.1)
        except AssertionError as exc:
            try:
                described = self.described()
                group = (f"the group {described['group_state']}, members "
                         f"{sorted(m['client_id'] for m in described['members'])}")
            except Exception as why:  # the report of a failure must not fail
                group = f"the group not described: {why!r}"
            tails = "\n".join(f"--- {name(m)} ({m.readiness()}):\n{m.process.log_tail(15)}" for m in self.live)
            raise AssertionError(f"{exc}\n{group}\n{tails}") from exc

    def rebalance_count(self) -> float:
        return sum(self.rebalances.values()) + sum(m.value("attention_monitor_rebalances_total") for m in self.live)

    def close(self) -> None:
        """Stop every instance; the exit code of each one that left or was stopped."""
        for monitor in list(self.live):
            self.leave(monitor)
        for monitor in self.leaving:
            with contextlib.suppress(subprocess.TimeoutExpired):  # stop() then kills it: exit code -9
                monitor.process.proc.wait(60)
            self.exits[name(monitor)] = monitor.process.stop()
        self.leaving.clear()
        self.admin.close()

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("monitor-*.log")))

    def told(self, words: tuple[str, ...]) -> list[str]:
        """The instances' log lines that say any of ``words``, in time order, each after its instance's name."""
        lines = [(line[:23], f"{path.stem} {line[11:240]}") for path in sorted(self.workdir.glob("monitor-*.log"))
                 for line in path.read_text(errors="replace").splitlines() if any(w in line for w in words)]
        return [text for _, text in sorted(lines)]


@dataclass
class Run:
    """What one run wrote."""

    findings: Counter[Finding] = field(default_factory=Counter)
    opened: list[str] = field(default_factory=list)  #: incident ids, once per "opened" record
    incidents: set[str] = field(default_factory=set)  #: incident ids of every incident record
    first: int | None = None  #: the canary request of the first finding
    dead_letters: int = 0
    seconds: float = 0.0
    converged: bool = True  #: every finding of the undisturbed run written, every record committed
    rebalances: float = 0.0
    exits: dict[str, int | None] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    began: float = 0.0  #: wall-clock time of the run's start
    #: when each finding's records were written (``detected_at``, seconds into the run)
    written_at: dict[Finding, list[float]] = field(default_factory=dict)
    #: the instances' log lines about rebalances, takeovers and transactions, for a report of a failure
    log_lines: list[str] = field(default_factory=list)


def written(records: dict[str, list[dict[str, Any]]], topics: Topics, canary: dict[str, int], run: Run) -> None:
    run.findings, run.opened, run.incidents, run.written_at = Counter(), [], set(), {}
    numbers = []
    for doc in records[topics.anomalies]:
        if doc.get("schema") == "attention-anomaly/1":
            run.findings[(doc["trace_id"], doc["kind"])] += 1
            run.written_at.setdefault((doc["trace_id"], doc["kind"]), []).append(
                float(doc.get("detected_at") or 0.0) - run.began)
            if doc["trace_id"] in canary:
                numbers.append(canary[doc["trace_id"]])
        elif doc.get("schema") == "attention-incident/1":
            run.incidents.add(doc["incident_id"])
            if doc.get("change") == "opened":
                run.opened.append(doc["incident_id"])
    run.first = min(numbers, default=None)
    run.dead_letters = len(records[topics.dead_letter])


def committed_everything(fleet: Fleet, consumer: KafkaConsumer) -> bool:
    """The group's commits on the traces and outcomes at their ends: every request accounted for."""
    partitions = [TopicPartition(t, p) for t in (fleet.topics.traces, fleet.topics.outcomes)
                  for p in consumer.partitions_for_topic(t) or ()]
    ends = consumer.end_offsets(partitions)
    committed = fleet.admin.list_group_offsets(fleet.group)[fleet.group]
    return all(committed.get(tp) is not None and committed[tp].offset >= end for tp, end in ends.items())


class Stage:
    """A run's topics, contracts, reader and fleet on the broker."""

    def __init__(self, broker: KafkaBroker, workdir: Path, label: str, partitions: int):
        self.broker = broker
        admin = KafkaAdminClient(**broker.client_config())
        try:
            def make_topic(kind: str, partitions: int = 1, configs: dict[str, str] | None = None) -> str:
                topic = f"{kind}-{label}"
                admin.create_topics({topic: {"num_partitions": partitions, "replication_factor": 1,
                                             "configs": configs or {}}}, wait_for_metadata=True)
                return topic

            self.topics = make_topics(make_topic, partitions=partitions)
        finally:
            admin.close()
        publish_contracts(broker.bootstrap, self.topics, [HEALTHY, CANARY])
        workdir.mkdir(parents=True)
        self.fleet = Fleet(broker, self.topics, f"group-{label}", workdir)
        self.reader = OutputReader(broker.bootstrap, self.topics.anomalies, self.topics.dead_letter)
        self.sender = Sender(broker.bootstrap, self.topics)

    def reference(self, requests: list[Request]) -> None:
        self.sender.join(self.sender.send(requests))
        self.fleet.wait(lambda: sum(m.value(READY) for m in self.fleet.live) == 1, 120,
                        "rev-1's reference ready")

    def close(self) -> None:
        self.sender.close()
        self.reader.close()
        self.fleet.close()


def undisturbed(broker: KafkaBroker, workdir: Path, reference: list[Request], flow: list[Request],
                partitions: int) -> Run:
    """One instance, nothing disturbing it: what the traffic should give."""
    began = time.monotonic()
    stage = Stage(broker, workdir, f"undisturbed-{time.time_ns()}", partitions)
    run = Run()
    try:
        monitor = stage.fleet.start()
        stage.reference(reference)
        stage.sender.join(stage.sender.send(flow))
        total = len(reference) + len(flow)
        stage.fleet.wait(lambda: monitor.value(JUDGED) >= total, 180, f"all {total} traces judged")
        stage.reader.settle(quiet=3.0)
        run.rebalances = stage.fleet.rebalance_count()
    finally:
        stage.close()
        run.exits = dict(stage.fleet.exits)
    written(stage.reader.records, stage.topics, canary_numbers(flow), run)
    run.seconds = time.monotonic() - began
    return run


def canary_numbers(flow: list[Request]) -> dict[str, int]:
    return {r.header.trace_id: r.canary for r in flow if r.canary is not None}


def disturbed(broker: KafkaBroker, workdir: Path, reference: list[Request], flow: list[Request], partitions: int,
              instances: int, rounds: int, rate: float, expected: set[Finding]) -> Run:
    """The fleet under joins, leaves, kill -9 of the judge mid-rebalance and broker
    restarts while the flow is sent, ``rounds`` times; then until everything the
    undisturbed run wrote is written and every request committed (or a deadline)."""
    began = time.monotonic()
    stage = Stage(broker, workdir, f"disturbed-{time.time_ns()}", partitions)
    fleet, run = stage.fleet, Run(began=time.time())
    steps = 4 * rounds
    segments = [flow[i * len(flow) // steps:(i + 1) * len(flow) // steps] for i in range(steps)]

    def note(event: str) -> None:
        run.events.append(f"{time.monotonic() - began:6.1f} s  {event}")

    try:
        for _ in range(instances):
            fleet.start(wait=False)
        for monitor in fleet.live:
            monitor.wait_ready(timeout=120)
        fleet.settled()
        stage.reference(reference)
        note(f"{instances} instances, rev-1's reference ready")
        for round_ in range(rounds):
            sending = stage.sender.send(segments.pop(0), rate)
            joined = fleet.start()
            fleet.settled()
            note(f"round {round_ + 1}: {name(joined)} joined")
            stage.sender.join(sending)

            sending = stage.sender.send(segments.pop(0), rate)
            judge = fleet.judge()
            leaving = next(m for m in fleet.live if m is not judge)
            fleet.leave(leaving)
            fleet.settled()
            note(f"round {round_ + 1}: {name(leaving)} left")
            stage.sender.join(sending)

            sending = stage.sender.send(segments.pop(0), rate)
            judge = fleet.judge()
            joining = fleet.start(wait=False)
            state = fleet.wait(lambda: (s := fleet.state()) in REBALANCING and s, 120,
                               "the group rebalancing as an instance joins")
            fleet.kill(judge)
            note(f"round {round_ + 1}: {name(judge)}, the judge, killed (-9) with the group {state} as "
                 f"{name(joining)} joined")
            fleet.settled()
            note(f"round {round_ + 1}: the group stable again")
            stage.sender.join(sending)

            sending = stage.sender.send(segments.pop(0), rate)
            down = time.monotonic()
            broker.kill()  # a crash: see the module's docstring for why not SIGTERM
            broker.restart()
            note(f"round {round_ + 1}: the broker restarted ({time.monotonic() - down:.1f} s down)")
            fleet.settled(timeout=180)
            note(f"round {round_ + 1}: the group stable again")
            stage.sender.join(sending)
        consumer = KafkaConsumer(**broker.client_config(), group_id=None, enable_auto_commit=False)
        try:
            try:
                stage.reader.wait(lambda got: {(d.get("trace_id"), d.get("kind")) for d in got[stage.topics.anomalies]}
                                  >= expected, timeout=120, what="every finding of the undisturbed run")
                fleet.wait(lambda: committed_everything(fleet, consumer), 120, "every request committed")
            except DeadlineExceeded as exc:
                run.converged = False
                note(f"not converged: {exc}")
        finally:
            consumer.close()
        stage.reader.settle(quiet=5.0)  # a record written twice would come now
        note("settled")
        run.rebalances = fleet.rebalance_count()
    finally:
        stage.close()
        run.exits = dict(fleet.exits)
    written(stage.reader.records, stage.topics, canary_numbers(flow), run)
    logs = fleet.logs()
    run.events.append(f"takeovers of an observations partition: {logs.count('judging observations partition')}")
    run.log_lines = fleet.told(TOLD)
    run.seconds = time.monotonic() - began
    return run


@dataclass
class Figures:
    requests: int
    canary_requests: int
    undisturbed: Run
    disturbed: Run
    lost: list[Finding]
    doubled: dict[Finding, int]
    unexpected: list[Finding]


def run(workdir: Path, requests: int = 120, rounds: int = 1, instances: int = 3, rate: float = 8.0,
        canary_every: int = 4, partitions: int = 6, broker: KafkaBroker | None = None) -> Figures:
    """Both runs on one broker (started here unless given; it is restarted during the
    disturbed run, so it must be this run's own)."""
    reference, flow = traffic(requests, canary_every)
    own = broker is None
    broker = broker or start_broker("plaintext", workdir / "kafka")
    try:
        calm = undisturbed(broker, workdir / "undisturbed", reference, flow, partitions)
        stormy = disturbed(broker, workdir / "disturbed", reference, flow, partitions, instances, rounds, rate,
                           set(calm.findings))
    finally:
        if own:
            broker.stop()
    return Figures(requests, sum(r.canary is not None for r in flow), calm, stormy,
                   sorted(set(calm.findings) - set(stormy.findings)),
                   {f: n for f, n in stormy.findings.items() if n > 1},
                   sorted(set(stormy.findings) - set(calm.findings)))


def report(figures: Figures) -> str:
    calm, stormy = figures.undisturbed, figures.disturbed
    kinds = Counter(kind for _, kind in calm.findings)
    lines = [
        f"traffic: {REFERENCE_TRACES} reference requests, then {figures.requests} requests "
        f"({figures.canary_requests} of the canary)",
        "",
        *stormy.events,
        "",
        f"{'':28}{'undisturbed':>14}{'disturbed':>14}",
        f"{'anomaly records':28}{sum(calm.findings.values()):>14}{sum(stormy.findings.values()):>14}",
        f"{'  distinct (trace, kind)':28}{len(calm.findings):>14}{len(stormy.findings):>14}",
        f"{'incidents opened':28}{len(calm.opened):>14}{len(stormy.opened):>14}",
        f"{'incident ids in records':28}{len(calm.incidents):>14}{len(stormy.incidents):>14}",
        f"{'first finding (canary req.)':28}{calm.first!s:>14}{stormy.first!s:>14}",
        f"{'dead letters':28}{calm.dead_letters:>14}{stormy.dead_letters:>14}",
        f"{'rebalances (instances sum)':28}{calm.rebalances:>14.0f}{stormy.rebalances:>14.0f}",
        f"{'seconds':28}{calm.seconds:>14.1f}{stormy.seconds:>14.1f}",
        "",
        f"findings by kind (undisturbed): {dict(sorted(kinds.items()))}",
        f"lost: {len(figures.lost)}  doubled: {len(figures.doubled)}  not in the undisturbed run: "
        f"{len(figures.unexpected)}  converged: {stormy.converged}",
        f"exits: {stormy.exits}",
    ]
    for what, items in (("lost", figures.lost[:5]), ("doubled", list(figures.doubled.items())[:5]),
                        ("unexpected", figures.unexpected[:5])):
        if items:
            lines.append(f"  {what}, first: {items}")
    for finding in list(figures.doubled)[:5]:
        at = ", ".join(f"{t:.1f}" for t in stormy.written_at.get(finding, []))
        lines.append(f"  {finding} written at {at} s into the disturbed run")
    if figures.lost or figures.doubled or figures.unexpected:
        lines += ["", f"the instances' logs of rebalances, takeovers and transactions (the run began at "
                      f"{time.strftime('%H:%M:%S', time.localtime(stormy.began))}):", *stormy.log_lines[-80:]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600, help="requests after the reference (default 600)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of join, leave, kill -9 of the judge mid-rebalance, broker restart (default 3)")
    parser.add_argument("--instances", type=int, default=3, choices=(3, 4),
                        help="instances at the start and after each round; one more between a join and a leave")
    parser.add_argument("--rate", type=float, default=8.0, help="requests a second while the fleet is disturbed")
    parser.add_argument("--canary-every", type=int, default=4, help="every n-th request is the canary's (default 4)")
    parser.add_argument("--partitions", type=int, default=6, help="partitions of every topic (default 6)")
    parser.add_argument("--workdir", type=Path, help="keep the broker's data and the instances' logs here")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.requests < 4 * args.rounds * args.canary_every:
        parser.error(f"--requests must be at least {4 * args.rounds * args.canary_every}: every step of every "
                     "round sends some of the canary's")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rebalance-torture-"))
    figures = run(workdir, args.requests, args.rounds, args.instances, args.rate, args.canary_every, args.partitions)
    print(report(figures))
    print(f"logs: {workdir}")
    if args.json:
        doc = asdict(figures)
        for side in ("undisturbed", "disturbed"):
            doc[side]["findings"] = len(doc[side]["findings"])
            doc[side]["written_at"] = [[*f, at] for f, at in doc[side]["written_at"].items()]
            doc[side]["incidents"] = sorted(doc[side]["incidents"])
        doc["lost"] = [list(f) for f in figures.lost]
        doc["doubled"] = [[*f, n] for f, n in figures.doubled.items()]
        doc["unexpected"] = [list(f) for f in figures.unexpected]
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    ok = figures.disturbed.converged and not figures.lost and not figures.doubled and not figures.unexpected
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
