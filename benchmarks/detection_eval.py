"""How well the detector's settings work on realistic traffic: the evidence behind the
defaults (docs/detection.md).

    python benchmarks/detection_eval.py [--seeds 5] [--healthy 1500] [--grid]

Traffic is monitor.tools.scenario's: mostly short requests, heads whose similarity falls
with length, healthy sinks and previous-token heads. For each seed, a reference
revision serves ``--reference`` requests (its reference learns from them), then
``--healthy`` more requests (4 traces each) judge the false-alarm rate, then two faulty
revisions pinned to it: a layer whose group of heads collapses onto one pattern, and a
head that becomes an attention sink. Printed per setting: anomalies per 1,000 healthy
traces by kind, and for each fault the traces of the faulty layer until the first right
finding (right kind, layer and head) and any finding elsewhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from monitor.core.detect import Detector, DetectorConfig, Observation
from monitor.core.metrics import head_metrics
from monitor.protocol.codec import valid_keys
from monitor.tools.scenario import Fault, Scenario

HEALTHY = Scenario(revision="r-ok")
FAULTS = {
    "collapse": Scenario(revision="r-collapse", faults=(Fault("collapse", 2, (1, 2, 3, 4)),)),
    "weak collapse": Scenario(revision="r-weak", faults=(Fault("collapse", 2, (1, 2, 3, 4), strength=0.5),)),
    "sink": Scenario(revision="r-sink", faults=(Fault("sink", 1, (3,)),)),
}
EXPECTED = {"collapse": ("low_diversity", 2, {"head-1", "head-2", "head-3", "head-4"}),
            "weak collapse": ("low_diversity", 2, {"head-1", "head-2", "head-3", "head-4"}),
            "sink": ("sink_shift", 1, {"head-3"})}


def observations(scenario: Scenario, seed: int, requests: int) -> list[Observation]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(requests):
        for header, weights in scenario.request(rng):
            m = head_metrics(weights, valid_keys(header))
            out.append(Observation(header.model_id, header.model_revision, header.layer, header.key_count,
                                   header.heads, m))
    return out


def run(config: DetectorConfig, data: dict[str, list[Observation]]) -> dict[str, object]:
    pins = {("scenario-lm", s.revision): HEALTHY.revision for s in FAULTS.values()}
    detector = Detector(DetectorConfig(**{**config.__dict__, "pins": pins}))
    for obs in data["reference"]:
        detector.observe(obs)
    false = Counter(a.kind for obs in data["healthy"] for a in detector.observe(obs).anomalies)
    result: dict[str, object] = {"false": false, "healthy": len(data["healthy"])}
    for name, (kind, layer, heads) in EXPECTED.items():
        seen, first, wrong = 0, None, 0
        for obs in data[name]:
            found = detector.observe(obs).anomalies
            if obs.layer == layer:
                seen += 1
            for a in found:
                right = a.kind == kind and a.layer == layer and set(a.heads) <= heads
                if right and first is None:
                    first = seen
                # the faulty heads' other metrics move too: side effects, not errors
                wrong += 0 if a.layer == layer and set(a.heads) <= heads else 1
        result[name] = (first, wrong)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--reference", type=int, default=150, help="requests of the reference revision")
    parser.add_argument("--healthy", type=int, default=1500, help="healthy requests judged afterwards")
    parser.add_argument("--grid", action="store_true", help="several reference sizes and pools, not only the defaults")
    args = parser.parse_args()
    settings = [DetectorConfig()]
    if args.grid:
        settings = [DetectorConfig(reference_traces=n, pool=p, false_alarm_arl=arl, min_effect=e)
                    for n in (50, 100, 200) for p in (20, 40, 80) if p <= n
                    for arl in (1e4, 1e5) for e in (1.0, 2.0)]
    datasets = []
    for seed in range(args.seeds):
        data = {"reference": observations(HEALTHY, seed, args.reference),
                "healthy": observations(HEALTHY, 1000 + seed, args.healthy)}
        data |= {name: observations(s, 2000 + seed, 20) for name, s in FAULTS.items()}
        datasets.append(data)
    print(f"{args.seeds} seeds; reference revision {args.reference} requests, then {args.healthy} healthy requests "
          f"({4 * args.healthy} traces), then 20 requests of each faulty revision")
    for config in settings:
        runs = [run(config, data) for data in datasets]
        per_k = [1000 * sum(r["false"].values()) / r["healthy"] for r in runs]  # type: ignore[attr-defined]
        kinds = sum((r["false"] for r in runs), Counter())  # type: ignore[arg-type]
        print(f"reference_traces={config.reference_traces} pool={config.pool}: false anomalies per 1,000 healthy "
              f"traces median {statistics.median(per_k):.2f}, max {max(per_k):.2f} ({dict(kinds)})")
        for name in EXPECTED:
            firsts = [r[name][0] for r in runs]  # type: ignore[index]
            wrong = sum(r[name][1] for r in runs)  # type: ignore[index]
            shown = ", ".join("never" if f is None else str(f) for f in firsts)
            print(f"  {name:<14} first right finding after {shown} traces of the layer; {wrong} findings elsewhere")


if __name__ == "__main__":
    main()
