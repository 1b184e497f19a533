"""Measuring trace records: decode → verify → contract check → metrics → detector.

Everything a trace needs that neither writes outputs nor touches the join buffer or the
exporter lives here, so it can run in a thread or a separate process while the service
keeps consuming (:mod:`monitor.measuring.workers`). Its results are small picklable values: a
trace's identity and metrics, the anomalies it raised, or why it was rejected. Never
weights.

Measuring is two steps. :meth:`Measurer.observe` decodes, verifies and measures: it
depends on nothing but the record and the contracts, so several processes may share it.
:meth:`Measurer.judge` then takes the observed traces in record order, skips those seen
before (the de-duplication window) and runs the detector, whose references depend on
that order. :meth:`Measurer.measure` is both, in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from monitor.core._blocks import Scratch
from monitor.core.detect import Ahead, Anomaly, Detector, DetectorConfig, Observation, Verdict
from monitor.core.generation import learned_sink_mass, prompt_mass
from monitor.core.join import RecentKeys
from monitor.core.key_state import KeyState
from monitor.core.mass import row_mass
from monitor.core.metrics import HeadMetrics, head_metrics
from monitor.core.pins import Pins
from monitor.errors import RejectReason, TraceRejected
from monitor.measuring import batching
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import Limits, Trace, check_mass, check_values, decode, masses_within
from monitor.protocol.decisions import ReferenceDecision
from monitor.protocol.model_contract import ContractTable, ModelContract
from monitor.protocol.observations import Forwarded
from monitor.protocol.records import Record, TraceIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Observed:
    """A verified trace, measured and not yet judged: who it is, its head ids and the
    metrics core's result (without the row masses decode checked). Never weights."""

    identity: TraceIdentity
    heads: tuple[str, ...]
    metrics: HeadMetrics
    seconds: float  #: time spent decoding and measuring (a batch's metrics time shared equally)

    def observation(self) -> Observation:
        """What the detector judges."""
        i = self.identity
        return Observation(i.model_id, i.model_revision, i.layer, i.key_count, self.heads, self.metrics,
                           i.trace_timestamp)


@dataclass(frozen=True)
class Measured:
    """A trace that passed every check, measured and judged."""

    identity: TraceIdentity
    heads: tuple[str, ...]
    metrics: HeadMetrics
    seconds: float  #: time spent decoding, measuring and judging
    verdict: Verdict = field(default_factory=lambda: Verdict([], None, False, 0, False))

    @property
    def anomalies(self) -> list[Anomaly]:
        return self.verdict.anomalies


class ObservedChunk(list["Observed | Rejected"]):
    """A chunk's observations, in record order. It crosses from a measuring process to
    the judge in one pickle with each metric of its traces stacked into one array (per
    trace arrays cost several times more to pickle and unpickle); unpickled, it is a plain
    list again and each trace's arrays are views of those."""

    def __reduce__(self) -> tuple[Any, ...]:
        traces = [(i, item) for i, item in enumerate(self) if isinstance(item, Observed)]
        shapes = {(o.metrics.entropy.shape, o.metrics.similarity.shape) for _, o in traces}
        if len(shapes) != 1:  # none, or traces of several head counts: each as it is
            return list, (list(self),)
        rest = [None if isinstance(item, Observed) else item for item in self]
        fields = [(i, o.identity, o.heads, o.seconds) for i, o in traces]
        heads = traces[0][1].metrics.entropy.shape
        arrays = [np.stack([np.asarray(getattr(o.metrics, name)) for _, o in traces]) for name in _STACKED]
        arrays += [np.stack([np.full(heads, np.nan) if getattr(o.metrics, name) is None else getattr(o.metrics, name)
                             for _, o in traces]) for name in _OPTIONAL]
        return _unstack, (rest, fields, *arrays)


_STACKED = ("entropy", "concentration", "sink_share", "similarity", "diversity", "effective_heads")
_OPTIONAL = ("prompt_mass", "learned_sink")


def _unstack(rest: list[Any], fields: list[tuple[Any, ...]],
             *arrays: NDArray[np.float64]) -> list[Observed | Rejected]:
    for row, (i, identity, heads, seconds) in enumerate(fields):
        values = dict(zip((*_STACKED, *_OPTIONAL), (a[row] for a in arrays), strict=True))
        rest[i] = Observed(identity, heads, HeadMetrics(**values), seconds)
    return rest


@dataclass(frozen=True)
class Rejected:
    reason: RejectReason
    detail: str
    header: Any  #: the verified header, when the signature checked out


@dataclass(frozen=True)
class Duplicate:
    trace_id: str


Result = Measured | Rejected | Duplicate


@dataclass(frozen=True)
class MeasurerSpec:
    """Everything needed to build a :class:`Measurer`; picklable, so a child process can
    build its own."""

    keyring: Keyring
    scopes: ScopePolicy
    limits: Limits
    detector: DetectorConfig
    dedupe_window: int
    state: Mapping[str, Any] | None = None  #: detector reference state to start from
    log_level: int = logging.INFO
    reuse_freed_memory: bool = True  #: see :mod:`monitor.measuring.tuning`

    def pins(self) -> Pins:
        """The rule its judge starts with: the settings' pins and the saved state's
        (:mod:`monitor.core.pins`), for routing traces to the judge the same way."""
        pins = Pins(self.detector.pins)
        pins.merge([] if self.state is None else self.state.get("decisions", []))
        return pins

    def observer(self) -> Observer:
        """What a measuring child builds: it observes, and holds no detector or window."""
        return Observer(keyring=self.keyring, scopes=self.scopes, contracts=ContractTable(), limits=self.limits)

    def build(self) -> Measurer:
        """The service's judge: it de-duplicates the traces observed here and judges only
        those that reach it through the observations topic (:meth:`Measurer.judge_forwarded`)."""
        detector = Detector(self.detector)
        if self.state is not None:
            detector.merge_state(self.state)
        return Measurer(keyring=self.keyring, scopes=self.scopes, contracts=ContractTable(), detector=detector,
                        limits=self.limits, dedupe_window=self.dedupe_window, judges=False)


class Observer:
    """Decodes, verifies and measures trace records: what a measuring process does, and
    all it does (no detector, no de-duplication window)."""

    def __init__(self, *, keyring: Keyring, scopes: ScopePolicy, contracts: ContractTable,
                 limits: Limits | None = None):
        self.keyring, self.scopes, self.contracts = keyring, scopes, contracts
        self.limits = limits or Limits()
        self._scratch = Scratch()

    def observe(self, records: list[Record]) -> ObservedChunk:
        """Decode, verify and measure, in record order; depends on no earlier record.
        Traces of the same shape are measured as one batch (the metrics core is batched:
        per-call overhead is shared)."""
        results: list[Observed | Rejected | None] = [None] * len(records)
        accepted: list[tuple[int, Trace, float]] = []
        for i, record in enumerate(records):
            started = time.perf_counter()
            outcome = self._decode(record)
            if isinstance(outcome, Trace):
                accepted.append((i, outcome, time.perf_counter() - started))
            else:
                results[i] = outcome
        measured = self._metrics([trace for _, trace, _ in accepted])
        for (i, trace, spent), (metrics, shared, mass_ok) in zip(accepted, measured, strict=True):
            results[i] = self._checked(records[i], trace, metrics, spent + shared, mass_ok)
        return ObservedChunk(r for r in results if r is not None)

    def _decode(self, record: Record) -> Trace | Rejected:
        try:
            return decode(record.value or b"", keyring=self.keyring, scopes=self.scopes,
                          contracts=self.contracts.get, limits=self.limits, check_mass=False, check_values=False)
        except TraceRejected as exc:
            return Rejected(exc.reason, exc.detail, exc.header)
        except Exception as exc:
            log.exception("decode failed unexpectedly at %s/%d@%d", record.topic, record.partition, record.offset)
            return Rejected(RejectReason.MALFORMED, f"internal error: {type(exc).__name__}", None)

    def _metrics(self, traces: list[Trace]) -> list[tuple[HeadMetrics | Exception, float, bool]]:
        """Each trace's metrics (or the error measuring it raised), its share of the time
        spent and whether its row masses passed decode's checks already, batching traces
        of the same heads, rows and dtype and close key counts (:mod:`monitor.measuring.batching`)."""
        unmeasured: tuple[HeadMetrics | Exception, float, bool] = (ValueError("not measured"), 0.0, False)
        out = [unmeasured] * len(traces)
        shown = [_prompt_rows(t) for t in traces]  # a generation trace's head metrics are its prompt rows'
        for members in batching.groups(shown):
            started = time.perf_counter()
            try:
                passed = np.zeros(len(members), dtype=bool)
                if len(members) == 1:
                    t = shown[members[0]]
                    batch = [head_metrics(t.weights, t.valid, scratch=self._scratch, with_mass=True)]
                else:
                    weights, valid = batching.batch([shown[j] for j in members])
                    whole = head_metrics(weights, valid, scratch=self._scratch, with_mass=True)
                    assert whole.row_mass is not None and whole.hidden_mass is not None
                    passed = masses_within(whole.row_mass, whole.hidden_mass, valid, traces[members[0]].header.dtype,
                                           self.limits)
                    # rows with a learned sink sum to one with it, and a generation trace's decoding
                    # rows were not in this pass: each of those is checked alone, in _checked
                    passed &= np.array([traces[j].sink is None and shown[j] is traces[j] for j in members])
                    batch = _split(whole)
            except Exception as exc:
                if len(members) == 1:
                    out[members[0]] = (exc, time.perf_counter() - started, False)
                    continue
                for j in members:  # one trace's failure must not cost the others their metrics
                    out[j] = self._metrics([traces[j]])[0]
                continue
            share = (time.perf_counter() - started) / len(members)
            for k, (j, metrics) in enumerate(zip(members, batch, strict=True)):
                out[j] = (metrics, share, bool(passed[k]))
        return out

    def _checked(self, record: Record, trace: Trace, metrics: HeadMetrics | Exception,
                 spent: float, mass_ok: bool = False) -> Observed | Rejected:
        """The trace's metrics after decode's last checks (on this pass's sums)."""
        started = time.perf_counter()
        try:
            if isinstance(metrics, Exception):
                check_values(trace)  # weights the core refused: say which fault, as decode would
                raise metrics
            assert metrics.row_mass is not None and metrics.hidden_mass is not None
            if trace.header.prompt_length is not None and not mass_ok:  # every row, decoding ones too
                check_mass(trace, *row_mass(trace.weights, trace.valid), self.limits)
            elif not mass_ok:  # the batch's check passed it already
                check_mass(trace, metrics.row_mass, metrics.hidden_mass, self.limits)
        except TraceRejected as exc:
            return Rejected(exc.reason, exc.detail, exc.header)
        except Exception as exc:  # a verified record must not stop the partition either
            log.error("measuring failed unexpectedly at %s/%d@%d", record.topic, record.partition, record.offset,
                      exc_info=exc)
            return Rejected(RejectReason.MALFORMED, f"internal error: {type(exc).__name__}", trace.header)
        heads = len(trace.header.heads)
        header = trace.header
        kept = replace(metrics, row_mass=None, hidden_mass=None,  # checked: they go no further
                       prompt_mass=np.full(heads, np.nan) if header.prompt_length is None else
                       prompt_mass(trace.weights, trace.valid, header.query_positions, header.prompt_length),
                       learned_sink=np.full(heads, np.nan) if trace.sink is None else learned_sink_mass(trace.sink))
        return Observed(trace_identity(trace, record), tuple(trace.header.heads), kept,
                        spent + time.perf_counter() - started)

    def set_contracts(self, contracts: list[ModelContract]) -> None:
        table = ContractTable(max_contracts=max(len(contracts), 1))  # verified by the service already
        for contract in contracts:
            table.add(contract)
        self.contracts = table


class Measurer(Observer):
    """The judge's side, in record order: de-duplication by trace id and the detector,
    for traces observed here and traces measured elsewhere alike (:meth:`judge_forwarded`)."""

    def __init__(
        self,
        *,
        keyring: Keyring,
        scopes: ScopePolicy,
        contracts: ContractTable,
        detector: Detector,
        limits: Limits | None = None,
        dedupe_window: int = 100_000,
        judges: bool = True,
    ):
        super().__init__(keyring=keyring, scopes=scopes, contracts=contracts, limits=limits)
        self.detector = detector
        self.judges = judges
        self.recent = RecentKeys(dedupe_window)

    def measure(self, records: list[Record]) -> list[Result]:
        """Results in record order; never raises for anything a producer can send."""
        return self.judge(self.observe(records))

    def judge(self, observed: list[Observed | Rejected]) -> list[Result]:
        """De-duplicate and, when this measurer ``judges`` what it observes (in-process
        use; the service judges each stream in one place instead), run the detector, in
        the order given (record order)."""
        traces = [item for item in observed if isinstance(item, Observed)]
        if not self.judges:
            fresh = iter([self.recent.add(("trace", item.identity.trace_id)) for item in traces])
            return [item if isinstance(item, Rejected) else Measured(item.identity, item.heads, item.metrics,
                                                                     item.seconds)
                    if next(fresh) else Duplicate(item.identity.trace_id) for item in observed]
        verdicts = iter(self._verdicts(traces, "trace"))
        out: list[Result] = []
        for item in observed:
            if isinstance(item, Rejected):
                out.append(item)
                continue
            verdict, spent = next(verdicts)
            out.append(verdict if not isinstance(verdict, Verdict) else
                       Measured(item.identity, item.heads, item.metrics, item.seconds + spent, verdict))
        return out

    def judge_forwarded(self, entries: list[Forwarded], again: bool = False) -> list[Verdict | Duplicate | Rejected]:
        """Judge traces measured elsewhere, in the order given, as :meth:`judge` judges
        those observed here; a trace judged before is a :class:`Duplicate` (the judge's
        own window, apart from the measuring side's). ``again``: a partition's traces
        judged again to rebuild its judges' state after it moved here; every one is
        judged (this instance may have judged them before it lost the partition) and
        remembered."""
        return [verdict for verdict, _ in self._verdicts(entries, "judged", again)]

    def _verdicts(self, items: Sequence[Observed | Forwarded], window: str, again: bool = False
                  ) -> list[tuple[Verdict | Duplicate | Rejected, float]]:
        """The one way a trace is judged: skipped when its id is in ``window`` already
        (unless ``again``), else the detector's verdict, with the seconds it took. What the
        detector can work out before judging is worked out for all of them at once
        (:meth:`Detector.ahead`; the verdicts are the same)."""
        started = time.perf_counter()
        fresh = [item for item in items if self.recent.add((window, item.identity.trace_id)) or again]
        observations = [item.observation() for item in fresh]
        try:
            worked_out: list[Ahead | None] = list(self.detector.ahead(observations))
        except Exception as exc:  # each is judged alone below, and fails alone
            log.error("judging %d traces together failed unexpectedly", len(fresh), exc_info=exc)
            worked_out = [None] * len(fresh)
        ahead = {id(item): (o, w) for item, o, w in zip(fresh, observations, worked_out, strict=True)}
        shared = (time.perf_counter() - started) / max(len(fresh), 1)  #: each trace's share of that
        out: list[tuple[Verdict | Duplicate | Rejected, float]] = []
        for item in items:
            trace_id = item.identity.trace_id
            if id(item) not in ahead:
                out.append((Duplicate(trace_id), 0.0))
                continue
            observation, worked = ahead[id(item)]
            started = time.perf_counter() - shared
            try:
                verdict = self.detector.observe(observation, worked)
            except Exception as exc:  # a verified record must not stop the partition either
                log.error("judging %s failed unexpectedly", trace_id, exc_info=exc)
                out.append((Rejected(RejectReason.MALFORMED, f"internal error: {type(exc).__name__}", None), 0.0))
                continue
            for event in verdict.events:
                log.info("%s", event)
            out.append((verdict, time.perf_counter() - started))
        return out

    def key_states(self, keys: list[tuple[str, str]]) -> list[KeyState]:
        """The state of these judge keys (model, judged_by), as they stand now."""
        return [self.detector.judge_state(model, judged_by) for model, judged_by in keys]

    def restore(self, states: list[KeyState]) -> None:
        """Install judge keys' states written by another instance (their partition moved here)."""
        for state in states:
            self.detector.install(state)

    def remember(self, trace_ids: list[str]) -> None:
        """Treat these traces as processed already (their outputs were read back)."""
        for trace_id in trace_ids:
            self.recent.add(("trace", trace_id))

    def forget(self, trace_ids: list[str]) -> None:
        """Let these traces through again (their partition went elsewhere un-committed)."""
        for trace_id in trace_ids:
            self.recent.discard(("trace", trace_id))

    def decide(self, decisions: list[ReferenceDecision]) -> None:
        """Apply pins and promotions from the references topic, in order; a decision no
        later than the one the state holds for its revision changes nothing."""
        for d in decisions:
            if not self.detector.decide(d.model_id, d.revision, d.reference if d.action == "pin" else None, d.at):
                continue
            if d.action == "promote":
                log.info("%s %s promoted to be its own reference (by %s): it learns a reference from its next "
                         "traces", d.model_id, d.revision, d.by)
            else:
                log.info("%s %s pinned to the reference of %s (by %s)", d.model_id, d.revision, d.reference, d.by)


@dataclass(frozen=True)
class _Rows:
    """Some rows of a trace, for the metrics core."""

    weights: NDArray[np.generic]
    valid: NDArray[np.bool_]


def _prompt_rows(trace: Trace) -> Trace | _Rows:
    """The rows the classic head metrics are taken over: a generation trace's prompt rows
    (its decoding rows give its prompt mass), any other trace's every row."""
    length = trace.header.prompt_length
    if length is None:
        return trace
    prompt = np.array([p < length for p in trace.header.query_positions])
    if prompt.all() or not prompt.any():
        return trace
    return _Rows(np.ascontiguousarray(trace.weights[:, prompt]), np.ascontiguousarray(trace.valid[prompt]))


def _split(m: HeadMetrics) -> list[HeadMetrics]:
    """The per-trace metrics of a batch ``[B, ...]``."""
    assert m.row_mass is not None and m.hidden_mass is not None
    return [HeadMetrics(m.entropy[b], m.concentration[b], m.sink_share[b], m.similarity[b], m.diversity[b],
                        m.effective_heads[b], m.row_mass[b], m.hidden_mass[b]) for b in range(len(m.diversity))]



def trace_identity(trace: Trace, record: Record) -> TraceIdentity:
    h = trace.header
    decoding = 0 if h.prompt_length is None else sum(p >= h.prompt_length for p in h.query_positions)
    return TraceIdentity(h.trace_id, h.request_id, h.model_id, h.model_revision, h.contract_id, h.layer, h.key_count,
                         h.timestamp, (record.topic, record.partition, record.offset),
                         (len(h.query_positions) - decoding, decoding))
