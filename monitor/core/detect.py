"""Anomaly detection against a learnt, length-aware reference, with a calibrated
sequential test.

Reference
    For every (model, revision, layer) the detector learns, from the revision's first
    ``reference_traces`` traces, a :class:`~monitor.core.reference.LengthReference` of
    layer diversity and of each head's entropy, concentration, sink share and mean
    similarity to the other heads, as functions of sequence length. From then on it
    judges every trace of the layer, whatever its length. A revision can instead be
    *pinned* to another revision's reference (to catch a regression at deploy): a pinned
    revision never learns a reference of its own, and only an explicit promotion
    (:meth:`Detector.promote`) makes a revision its own reference. Pins and promotions
    are part of the state, so a restart without the setting keeps judging the pinned
    revision by its pin.

Per-head references mean there is no global threshold: a near one-hot head, or one
that parks most of its weight on the first token, is judged against its own normal.

Decision
    Each observation is standardised against the reference at its length,
    ``z = (x − μ(L)) / (σ(L) · scale)`` with ``σ`` floored (``min_sd``) so constant heads
    do not make noise look huge, ``scale`` the reference's calibrated scale
    (:mod:`monitor.core.calibration`: how much wider its errors are on traces it did not
    learn from), signed so that the bad direction is positive (diversity and entropy
    down, concentration up, sink share either way), and clipped at ``clip`` so that no
    single heavy-tailed outlier decides alone. Each stream feeds two one-sided CUSUMs
    ``S ← max(0, S + z − k)`` with ``k = shift / 2``. The *finding* CUSUM raises an
    anomaly record (evidence) when it crosses ``h`` and the trace's own effect size
    ``z ≥ min_effect``; the *page* CUSUM, with a higher threshold, marks the anomaly
    ``pages`` when it crosses (the incident tracker opens an incident on it); each
    restarts at 0 when it crosses. With the defaults (``shift`` 1.5: ``k`` 0.75) a collapse
    of 10 sd is a finding after six traces and pages after ten (MiniLM's 6 layers of 12
    heads at a request a second); a 1.5 sd shift takes about 27 traces, a 1 sd shift about
    80.

Calibration
    Findings: ``h`` makes the in-control average run length (expected traces between
    false findings) of one (layer, kind) ``false_alarm_arl`` (``FALSE_ALARM_ARL``): head
    kinds have one stream per head, each calibrated to ``H · false_alarm_arl`` (a
    two-sided sink test to twice that per side); low diversity has the layer's stream and
    the heads' similarity streams. Pages: every stream of a revision gets the run length
    that spends ``false_pages_per_week`` (``FALSE_PAGES_PER_WEEK``) over all of the
    revision's streams at its observed request rate (at least 1 a second;
    :func:`~monitor.core.calibration.page_arl`). Both thresholds come from Siegmund's
    approximation for a CUSUM of unit-variance normal increments,
    ``ARL₀ ≈ (e^{2kb} − 2kb − 1) / (2k²)`` with ``b = h + 1.166``, averaged over the error
    of a reference of ``reference_traces`` traces (``REFERENCE_TRACES``) in each stream's
    mean and variance (:func:`~monitor.core.calibration.corrected_threshold`): without
    that correction healthy replays paged and found many times more often than the
    budgets.
    The effect-size gate only removes alarms, so the realised rates are at most those.
    The defaults were chosen on real traffic of a real checkpoint (``benchmarks/soak.py``,
    ``benchmarks/false_pages.py``, ``docs/detection.md``).

Many traces at once
    Standardising a trace is array work that does not depend on the traces before it
    once its reference is ready; the CUSUM does. :meth:`Detector.ahead` standardises a
    chunk's traces together (:mod:`monitor.core.standardise`) and :meth:`Detector.observe`
    then judges them one by one, in order, with exactly the verdicts of observing each
    alone (half the cost per trace on the service's chunks).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from monitor.core.calibration import RATE_FLOOR, corrected_threshold, cross_fitted_scale, page_arl
from monitor.core.converging import named_heads
from monitor.core.key_state import (
    RATE_WINDOW,
    STATE_VERSION,
    KeyState,
    LayerEvidence,
    LayerKey,
    read_reference_item,
    reference_item,
)
from monitor.core.pins import Decision, Pins
from monitor.core.reference import LengthReference
from monitor.core.standardise import HEAD_METRICS, Standardised, Streams, standardise, stream_values
from monitor.core.verdict import Ahead, Anomaly, Evidence, Observation, Verdict

__all__ = ["KINDS", "RATE_WINDOW", "STATE_VERSION", "Ahead", "Anomaly", "Decision", "Detector", "DetectorConfig",
           "Evidence", "KeyState", "LayerKey", "Observation", "Verdict", "cusum_threshold"]

KINDS = ("low_diversity", "entropy_collapse", "concentration_spike", "sink_shift", "learned_sink_shift",
         "prompt_mass_shift")
Revision = tuple[str, str]  # model, revision


@dataclass(frozen=True)
class DetectorConfig:
    reference_traces: int = 200
    #: observations a length-aware fit pools at least (nearest lengths first)
    pool: int = 60
    #: expected traces between false findings (evidence records) per (layer, kind)
    false_alarm_arl: float = 1_000_000.0
    #: expected false pages per model revision and week, at its observed request rate
    false_pages_per_week: float = 0.05
    #: the shift (in sd) the CUSUMs are tuned to, ``k = shift / 2``: at 1.5 a reference's
    #: error in a stream's mean moves its drift less than at 1.0, so the thresholds that
    #: allow for that error are lower and a strong fault pages sooner (docs/detection.md)
    shift: float = 1.5
    min_effect: float = 1.0
    #: standardised observations are clipped to ±clip before they enter the CUSUM, so one
    #: heavy-tailed outlier cannot cross the threshold alone (real head metrics are not normal)
    clip: float = 3.0
    #: folds of the reference's own traces that measure its scale (0: no calibration)
    calibration_folds: int = 5
    min_sd: Mapping[str, float] = field(default_factory=lambda: {
        "diversity": 0.01, "entropy": 0.02, "concentration": 0.02, "sink_share": 0.02, "similarity": 0.01,
        "learned_sink": 0.02, "prompt_mass": 0.02})
    #: a low-diversity finding names the heads whose similarity to their nearest other head rose this many sd
    head_z: float = 3.0
    #: (model, revision) -> the revision whose reference judges it
    pins: Mapping[tuple[str, str], str] = field(default_factory=dict)
    #: references kept; beyond, the one unused longest goes (a flood of invented revisions stays bounded)
    max_references: int = 1024


def _rounded_up(rate: float | None) -> float:
    """A request rate rounded up to a quarter octave (thresholds then take few values)."""
    if rate is None or rate <= RATE_FLOOR:
        return RATE_FLOOR
    return float(2.0 ** (math.ceil(math.log2(rate) * 4) / 4))


@functools.lru_cache(maxsize=256)
def cusum_threshold(arl: float, k: float) -> float:
    """``h`` with Siegmund's in-control ARL of a one-sided CUSUM equal to ``arl`` (for an
    exact reference; the detector's thresholds also allow for its estimation error:
    :func:`~monitor.core.calibration.corrected_threshold`)."""
    if arl <= 1 or k <= 0:
        raise ValueError("arl must exceed 1 and k must be positive")

    def run_length(h: float) -> float:
        a = 2 * k * (h + 1.166)
        return (math.exp(a) - a - 1) / (2 * k * k)

    lo, hi = 0.0, 1.0
    while run_length(hi) < arl:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run_length(mid) < arl else (lo, mid)
    return hi


class Detector:
    """Learns references and judges observations; see the module documentation."""

    def __init__(self, config: DetectorConfig | None = None):
        self.config = config or DetectorConfig()
        self.references: OrderedDict[LayerKey, LengthReference] = OrderedDict()  #: least recently used first
        self.pins = Pins(self.config.pins)  #: which revision judges which (:mod:`monitor.core.pins`)
        #: every judged layer's CUSUMs, trace times and page threshold (bounded in number)
        self._evidence: dict[LayerKey, LayerEvidence] = {}
        self._references_version = 0  #: counts changes of the set of references (page thresholds depend on it)
        self._announced: set[tuple[str, LayerKey]] = set()
        self._k = self.config.shift / 2
        self._streams: dict[int, Streams] = {}  #: by head count

    # --- who judges whom --------------------------------------------------------------

    @property
    def decisions(self) -> dict[Revision, Decision]:
        return self.pins.decisions

    def judge_revision(self, model: str, revision: str) -> str:
        return self.pins.judge_revision(model, revision)

    def pin(self, model: str, revision: str, reference: str, at: float, source: str = "pin") -> None:
        """Judge ``revision`` by ``reference``'s reference from now on; it learns none of its own."""
        self.pins.pin(model, revision, reference, at, source)

    def promote(self, model: str, revision: str, at: float) -> None:
        """Make ``revision`` its own reference: it learns one afresh from its next traces."""
        self.pins.promote(model, revision, at)
        self._drop_references(model, revision)

    def decide(self, model: str, revision: str, reference: str | None, at: float) -> bool:
        """A decision of the references topic (:meth:`Pins.decide`); whether it took effect."""
        if not self.pins.decide(model, revision, reference, at):
            return False
        if reference is None:
            self._drop_references(model, revision)
        return True

    def _drop_references(self, model: str, revision: str) -> None:
        for key in [k for k in self.references if k[:2] == (model, revision)]:
            del self.references[key]
            self._forget_layer(key)

    # --- observations -------------------------------------------------------------------

    def ahead(self, observations: Sequence[Observation]) -> list[Ahead]:
        """What :meth:`observe` will need of each observation, worked out for all of them
        together (traces of equal head count share each array operation, which costs
        most of judging one trace alone). Touches no state: observe the same observations
        in the same order, each with its own, and the verdicts are exactly those of
        observing them alone."""
        by_heads: dict[int, list[int]] = {}
        for i, obs in enumerate(observations):
            by_heads.setdefault(len(obs.heads), []).append(i)
        out: list[Ahead] = [Ahead(np.empty(0))] * len(observations)
        for members in by_heads.values():
            group = [observations[i] for i in members]
            values = stream_values([obs.metrics for obs in group])
            judged: dict[int, LengthReference] = {}  #: place in the group -> the ready reference judging it
            for j, obs in enumerate(group):
                ref = self.references.get((obs.model, self._judged_by(obs), obs.layer))
                if ref is not None and self._judges(ref, values.shape[1]):
                    judged[j] = ref
            table = self._standardise(list(judged.values()), [group[j].key_count for j in judged],
                                      values[list(judged)]) if judged else None
            rows = {j: row for row, j in enumerate(judged)}
            for j, i in enumerate(members):
                out[i] = Ahead(values[j], table if j in rows else None, rows.get(j, 0))
        return out

    def observe(self, obs: Observation, ahead: Ahead | None = None) -> Verdict:
        """Learn from ``obs`` while its revision's own reference is young (never for a
        pinned revision); judge it once the reference that judges it is ready.
        ``ahead``: what :meth:`ahead` worked out for it (else it is worked out here)."""
        h = len(obs.heads)
        judge_revision = self._judged_by(obs)
        events: list[str] = []
        ahead = ahead or self.ahead([obs])[0]
        values = ahead.values
        own_key = (obs.model, obs.revision, obs.layer)
        evicted = 0
        if judge_revision == obs.revision:
            ref = self._use(own_key)
            if ref is None or ref.streams != values.size:
                evicted = self._make_room()
                ref = self.references[own_key] = LengthReference(values.size)
                self._references_version += 1
            if ref.traces < self.config.reference_traces:
                ref.update(obs.key_count, values)
                ref.update_matrix(obs.metrics.similarity)
                ref.samples.append((obs.key_count, np.array(values, dtype=np.float64)))
                if ref.traces == self.config.reference_traces:
                    self._calibrate(ref, h)
                    scale = "" if ref.scale is None else f"; effects scaled by {float(ref.scale.max()):.2f} at most"
                    events.append(f"reference of {obs.model} {obs.revision} layer {obs.layer} ready "
                                  f"({ref.traces} traces{scale})")
                return Verdict([], None, True, ref.traces, ref.traces >= self.config.reference_traces,
                               tuple(events), evicted)
        judge_key = (obs.model, judge_revision, obs.layer)
        ref = self._use(judge_key)
        count = 0 if ref is None else ref.traces
        if ref is None or not self._judges(ref, values.size):
            if self._announce("waiting", own_key):
                events.append(f"{obs.model} {obs.revision} layer {obs.layer} is pinned to {judge_revision}, "
                              f"whose reference is not ready ({count} traces): its traces are not judged")
            return Verdict([], None, False, count, False, tuple(events))
        if judge_revision != obs.revision and self._announce("pinned", own_key):
            events.append(f"{obs.model} {obs.revision} layer {obs.layer} is judged by the reference of "
                          f"{judge_revision} ({self.pins.source(obs.model, obs.revision) or 'its judge key'})")
        table, row = ahead.standardised, ahead.row
        if table is None or table.references[row] is not ref:  # it became ready since
            table, row = self._standardise([ref], [obs.key_count], values[None]), 0
        layer = self._layer_evidence(own_key)
        if obs.timestamp > 0:
            layer.times.append(obs.timestamp)
        anomalies, evidence = self._judge(own_key, layer, ref, obs, table, row, h, judge_revision)
        return Verdict(anomalies, judge_revision, False, ref.traces, True, tuple(events), evidence=evidence)

    def _judged_by(self, obs: Observation) -> str:
        """The revision whose reference judges ``obs``: the one its judge key names, else
        by the rule (:meth:`Pins.judge_revision`)."""
        return obs.judged_by or self.pins.judge_revision(obs.model, obs.revision)

    def _judges(self, ref: LengthReference, streams: int) -> bool:
        """``ref`` is ready and has the streams of the trace to judge. A ready reference
        learns no more, so what was standardised against it stays right."""
        return ref.traces >= self.config.reference_traces and ref.streams == streams

    def _use(self, key: LayerKey) -> LengthReference | None:
        ref = self.references.get(key)
        if ref is not None:
            self.references.move_to_end(key)
        return ref

    def _make_room(self) -> int:
        """Drop the references unused longest until a new one fits; how many went."""
        evicted = 0
        while len(self.references) >= self.config.max_references:
            key, _ = self.references.popitem(last=False)
            self._forget_layer(key)
            evicted += 1
        return evicted

    def _forget_layer(self, key: LayerKey) -> None:
        self._references_version += 1
        self._evidence.pop(key, None)
        self._announced = {a for a in self._announced if a[1] != key}

    def _announce(self, what: str, key: LayerKey) -> bool:
        if (what, key) in self._announced:
            return False
        if len(self._announced) >= 4 * self.config.max_references:
            self._announced.clear()  # bounded: at worst a pin is announced again
        self._announced.add((what, key))
        return True

    def _stream_table(self, h: int) -> Streams:
        streams = self._streams.get(h)
        if streams is None:
            streams = self._streams[h] = Streams.of(h, self.config.min_sd, self._threshold)
        return streams

    def _standardise(self, refs: list[LengthReference], key_counts: list[int],
                     values: NDArray[np.float64]) -> Standardised:
        c = self.config
        return standardise(self._stream_table((values.shape[1] - 1) // len(HEAD_METRICS)), refs, key_counts, values,
                           pool=min(c.pool, c.reference_traces), clip=c.clip, k=self._k, min_effect=c.min_effect)

    def _layer_evidence(self, key: LayerKey) -> LayerEvidence:
        """The layer's evidence (new, the oldest layer's dropped beyond twice ``max_references``)."""
        layer = self._evidence.get(key)
        if layer is None:
            while len(self._evidence) >= 2 * self.config.max_references:
                del self._evidence[next(iter(self._evidence))]
            layer = self._evidence[key] = LayerEvidence()
        return layer

    def _judge(self, key: LayerKey, layer: LayerEvidence, ref: LengthReference, obs: Observation,
               table: Standardised, row: int, h: int, ref_revision: str) -> tuple[list[Anomaly], Evidence | None]:
        """Every stream of the layer in one vector, in both CUSUMs. Low diversity: layer
        diversity down, and each head's similarity to its nearest other head up (a group
        of heads turning into copies of each other may barely move the layer's mean); then
        per head entropy down, concentration up, sink share up and sink share down. A
        low-diversity finding names the heads whose nearest-neighbour similarity rose, and
        those of the pairs whose similarity rose most above the reference's mean matrix."""
        c = self.config
        streams = self._stream_table(h)
        step = table.step[row]
        s = np.maximum(0.0, _statistic(layer.cusum, step) + step)
        p = np.maximum(0.0, _statistic(layer.page_cusum, step) + step)
        large = table.large[row]
        hit = (s > streams.thresholds) & large
        paged = (p > self.page_threshold(key, ref_revision)) & large
        if not (hit.any() or paged.any()):
            layer.cusum, layer.page_cusum = s, p
            return [], None
        x, mean, z = table.x[row], table.mean[row], table.z[row]
        found = []
        either = hit | paged
        if either[: 1 + h].any():
            strongest = int(np.argmax(np.where(either[: 1 + h], z[: 1 + h], -np.inf)))
            core = {i for i in range(h) if either[1 + i] or z[1 + i] >= c.head_z}
            m = obs.metrics
            heads = named_heads(obs.heads, core, z[1 : 1 + h], m.similarity, ref.mean_matrix())
            score = float(np.maximum(s, p)[: 1 + h][either[: 1 + h]].max())
            found.append(Anomaly("low_diversity", obs.layer, heads, float(m.diversity), float(mean[0]),
                                 float(z[strongest]), score, ref_revision, bool(paged[: 1 + h].any())))
        kinds = ("entropy_collapse", "concentration_spike", "sink_shift", "sink_shift", "learned_sink_shift",
                 "learned_sink_shift", "prompt_mass_shift", "prompt_mass_shift")
        for i in np.flatnonzero(either[1 + h :]).tolist():
            j = 1 + h + i
            found.append(Anomaly(kinds[i // h], obs.layer, (obs.heads[i % h],), float(x[j]), float(mean[j]),
                                 float(z[j]), float(max(s[j], p[j])), ref_revision, bool(paged[j])))
        s[hit] = 0.0
        p[paged] = 0.0
        layer.cusum, layer.page_cusum = s, p
        m = obs.metrics
        shown = {"entropy": m.entropy, "concentration": m.concentration, "sink_share": m.sink_share}
        for name in ("learned_sink", "prompt_mass"):  # when the trace has them
            value = getattr(m, name)
            if value is not None and np.isfinite(value).any():
                shown[name] = value
        band = {name: streams.block[name] for name in shown}
        fit_mean, sd = table.value_mean[row], table.value_sd[row]
        evidence = Evidence(obs.heads, obs.key_count, m.similarity, ref.mean_matrix(), shown,
                            {name: fit_mean[i] for name, i in band.items()}, {name: sd[i] for name, i in band.items()},
                            (float(m.diversity), float(fit_mean[0]), float(sd[0])))
        return found, evidence

    def _threshold(self, streams: int) -> float:
        return corrected_threshold(self.config.false_alarm_arl * streams, self._k, self.config.reference_traces)

    def page_threshold(self, key: LayerKey, ref_revision: str) -> float:
        """Every stream's page threshold for the revision of ``key``: the false-page
        budget split over all the streams of the reference revision's layers, at the
        layer's observed request rate rounded up to a quarter octave, corrected for the
        reference's estimation error (``REFERENCE_TRACES``). Worked out again
        when the references change or every ``RATE_WINDOW / 8`` traces."""
        layer = self._evidence.get(key)
        timed = 0 if layer is None else len(layer.times)
        cached = None if layer is None else layer.page_h
        if cached is not None and cached[0] == self._references_version and abs(cached[1] - timed) < RATE_WINDOW // 8:
            return cached[2]
        model = key[0]
        streams = sum(self._judged_streams(r) for k, r in self.references.items()
                      if k[0] == model and k[1] == ref_revision)
        arl = page_arl(streams, _rounded_up(self.rate(key)), self.config.false_pages_per_week)
        # a budget beyond a page a trace: every crossing pages
        h = corrected_threshold(max(arl, 2.0), self._k, self.config.reference_traces)
        if layer is not None:
            layer.page_h = (self._references_version, timed, h)
        return h

    def _judged_streams(self, ref: LengthReference) -> int:
        """The streams a reference judges: those of values it has seen (a prefill-only
        producer's prompt mass, or a layer without a learned sink, judge nothing)."""
        h = (ref.streams - 1) // len(HEAD_METRICS)
        return int(ref.observed()[self._stream_table(h).pick].sum())

    def rate(self, key: LayerKey) -> float | None:
        """The layer's request rate (traces a second) over its latest judged traces, from
        their timestamps; None before two distinct ones."""
        times = None if key not in self._evidence else self._evidence[key].times
        if not times or len(times) < 2:
            return None
        span = max(times) - min(times)
        return (len(times) - 1) / span if span > 0 else None

    def _calibrate(self, ref: LengthReference, h: int) -> None:
        """Measure the ready reference's scale on its own traces, held out in folds."""
        c = self.config
        if c.calibration_folds:
            ref.scale = cross_fitted_scale(self._stream_table(h), ref.samples, pool=min(c.pool, c.reference_traces),
                                           clip=c.clip, folds=c.calibration_folds)
        ref.samples = []

    def statistics(self) -> dict[LayerKey, NDArray[np.float64]]:
        """A copy of every layer's CUSUM statistics, ``[2, streams]``: the finding and the
        page CUSUM of each stream in judging order (:class:`~monitor.core.standardise.Streams`):
        the evidence gathered so far, which verdicts show only once it crosses a threshold."""
        return {key: np.stack([e.cusum, np.zeros_like(e.cusum) if e.page_cusum is None else e.page_cusum])
                for key, e in self._evidence.items() if e.cusum is not None}

    # --- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The references and decisions, as the state file keeps them (:meth:`merge_state`)."""
        return {"version": STATE_VERSION,
                "references": [reference_item(k, r.to_dict()) for k, r in self.references.items()],
                "decisions": self.pins.to_list()}

    def judge_state(self, model: str, judged_by: str) -> KeyState:
        """Everything one judge key holds (the revision ``judged_by`` of ``model``, and the
        revisions pinned to it): its references, and the evidence of every layer it judges,
        frozen now. :meth:`install` on another detector: the two judge what follows alike."""
        revisions = self.pins.pinned_to(model, judged_by)
        return KeyState(model, judged_by,
                        tuple((k, r.to_dict()) for k, r in self.references.items() if k[:2] == (model, judged_by)),
                        tuple(e.frozen(k) for k, e in sorted(self._evidence.items())
                              if k[0] == model and k[1] in revisions))

    def install(self, state: KeyState) -> None:
        """Replace one judge key's references and evidence by ``state`` (decisions are not
        part of it: every instance reads them from the references topic)."""
        model, judged_by = state.key
        for key in [k for k in self.references if k[:2] == (model, judged_by)]:
            del self.references[key]
        revisions = self.pins.pinned_to(model, judged_by)
        for key in [k for k in self._evidence if k[0] == model and k[1] in revisions]:
            self._forget_layer(key)
        for key, doc in state.references:
            if len(self.references) >= self.config.max_references:
                self._make_room()
            self.references[key] = LengthReference.from_dict(dict(doc))
        for layer in state.layers:
            self._evidence[layer.key] = LayerEvidence.of(layer)
        self._references_version += 1

    def key_state(self, model: str, judged_by: str) -> dict[str, Any]:
        """:meth:`judge_state` in its JSON form (:meth:`KeyState.to_dict`)."""
        return self.judge_state(model, judged_by).to_dict()

    def restore_key(self, doc: Mapping[str, Any]) -> None:
        """:meth:`install` from the JSON form."""
        self.install(KeyState.from_dict(doc))

    def merge_state(self, doc: Mapping[str, Any]) -> None:
        """Merge references and decisions from a saved state (another instance, or
        before a restart): references add up; of two decisions about a revision the
        later one holds, and any saved decision overrides a pin from the settings."""
        if doc.get("version") != STATE_VERSION:
            raise ValueError(f"reference state version {doc.get('version', 1)} is not {STATE_VERSION}: "
                             "references are learnt afresh")
        self.pins.merge(doc.get("decisions", []))
        for item in doc.get("references", []):
            key, other_ref = read_reference_item(item)
            mine_ref = self.references.get(key)
            merged = (other_ref if mine_ref is None or mine_ref.streams != other_ref.streams
                      else mine_ref.merge(other_ref))
            if merged.scale is None and merged.traces >= self.config.reference_traces:
                self._calibrate(merged, (merged.streams - 1) // len(HEAD_METRICS))  # halves that made a ready one
            self.references[key] = merged
        self._references_version += 1
        while len(self.references) > self.config.max_references:
            self.references.popitem(last=False)



def _statistic(old: NDArray[np.float64] | None, like: NDArray[np.float64]) -> NDArray[np.float64]:
    """A layer's CUSUM statistics (zeros the first time)."""
    return np.zeros_like(like) if old is None or old.shape != like.shape else old
