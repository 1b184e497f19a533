"""How many traces one judge handles on one stream (a hot key), next to the cost of
measuring them, in one run.

    python benchmarks/judge_bench.py [--traces 3000] [--heads 16] [--keys 512] [--rows 16]

Judging a (model, revision, layer) stream is sequential: its reference learns in trace
order and its CUSUMs add one trace after the other, so however many instances measure,
one stream is judged in one place. This bench gives that place's capacity. On signed
traces of one layer of a synthetic model (requests of varied lengths, as the service
bench's), in one process:

- measuring: :meth:`Measurer.observe` on the service's chunks (decode, verify, check,
  head metrics): the work that spreads over instances and cores;
- learning: :meth:`Measurer.judge` while the stream's reference is learning
  (``REFERENCE_TRACES`` traces, then its calibration);
- judging: :meth:`Measurer.judge` once it judges (standardise, CUSUMs, de-duplication);
- what judging needs of a trace: the pickled :class:`Observed` (identity, head ids,
  metrics; never weights), the size a second hop would carry.

Ratios, not absolute times, are the result: one judge keeps up with as many measuring
cores as its per-trace time divides into measuring's.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from monitor.core.detect import DetectorConfig
from monitor.measuring.measurer import Measured, Measurer, MeasurerSpec, Observed
from monitor.measuring.workers import chunks
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import Limits, encode
from monitor.protocol.model_contract import ContractTable
from monitor.protocol.records import Record
from monitor.tools.synthetic import SyntheticModel, layer_roles, make_header, sample_positions, trace_weights

KEY_ID, SECRET = "bench", b"bench-secret-0123456789"
LENGTHS = 16  #: distinct request lengths, between half of --keys and all of it


def make_records(n: int, heads: int, keys: int, rows: int) -> tuple[ContractTable, list[Record]]:
    """``n`` signed traces of layer 0 of one revision: one stream, every trace distinct."""
    model = SyntheticModel("bench-lm", "rev-1", layers=1, heads=heads, kv_groups=max(1, heads // 4))
    contract = model.contract()
    table = ContractTable()
    table.add(contract)
    rng = np.random.default_rng(0)
    lengths = sorted(rng.integers(keys // 2, keys + 1, LENGTHS).tolist())
    pool = []
    for length in lengths:
        positions = sample_positions(rng, length, rows)
        pool.append((positions, length, trace_weights(rng, layer_roles(0, heads), positions, length)))
    records = []
    for i in range(n):
        positions, length, w = pool[int(rng.integers(len(pool)))]
        header = make_header(contract, 0, positions, length, request_id=f"req-{i}")
        records.append(Record("bench-traces", 0, i, header.request_id.encode(), encode(header, w, KEY_ID, SECRET)))
    return table, records


def measurer(table: ContractTable, reference_traces: int) -> Measurer:
    spec = MeasurerSpec(Keyring({KEY_ID: SECRET}), ScopePolicy.parse(["*:*"]), Limits(),
                        DetectorConfig(reference_traces=reference_traces), 1_000_000)
    built = spec.build()
    built.set_contracts(list(table.contracts()))
    return built


def per_trace(seconds: list[float], counts: list[int]) -> float:
    """The median over chunks of seconds per trace."""
    return statistics.median(s / c for s, c in zip(seconds, counts, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=3000, help="traces judged once the reference is ready")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--keys", type=int, default=512, help="the longest request's key count")
    parser.add_argument("--rows", type=int, default=16, help="query rows a trace carries")
    parser.add_argument("--reference-traces", type=int, default=DetectorConfig().reference_traces)
    args = parser.parse_args()

    table, records = make_records(args.reference_traces + args.traces, args.heads, args.keys, args.rows)
    m = measurer(table, args.reference_traces)
    observed: list[list[Observed]] = []
    measure_s, measure_n = [], []
    for chunk, _ in chunks(records):
        start = time.perf_counter()
        out = m.observe(chunk)
        measure_s.append(time.perf_counter() - start)
        measure_n.append(len(chunk))
        observed.append([o for o in out if isinstance(o, Observed)])
    if sum(map(len, observed)) != len(records):
        raise SystemExit("some traces were rejected: the bench's records are wrong")

    flat = [o for chunk in observed for o in chunk]
    learning, judging = flat[: args.reference_traces], flat[args.reference_traces:]
    per_chunk = len(observed[0])  # the service judges a measured chunk at a time
    start = time.perf_counter()
    for at in range(0, len(learning), per_chunk):
        m.judge(learning[at: at + per_chunk])
    learn = (time.perf_counter() - start) / len(learning)
    judge_s, judge_n = [], []
    size = max(len(pickle.dumps(o)) for o in judging[:100])
    for at in range(0, len(judging), per_chunk):
        part = judging[at: at + per_chunk]
        start = time.perf_counter()
        verdicts = m.judge(part)
        judge_s.append(time.perf_counter() - start)
        judge_n.append(len(part))
    last = verdicts[-1]
    if not isinstance(last, Measured) or not last.verdict.ready:
        raise SystemExit("the stream's reference never became ready")
    measure, judge = per_trace(measure_s, measure_n), per_trace(judge_s, judge_n)
    print(f"one stream: {args.heads} heads, requests of {args.keys // 2}-{args.keys} keys, {args.rows} rows; "
          f"{len(learning)} traces learning, {len(judging)} judged, {per_chunk} a chunk")
    print(f"  measuring (decode, verify, metrics)  {measure * 1e6:8.1f} us a trace   the reference")
    print(f"  learning the reference               {learn * 1e6:8.1f} us a trace   {learn / measure:.2f}x")
    print(f"  judging (standardise, CUSUMs)        {judge * 1e6:8.1f} us a trace   {judge / measure:.2f}x")
    print(f"  one judge handles {1 / judge:,.0f} traces/s on one stream: the measuring work of "
          f"{measure / judge:.1f} cores")
    print(f"  what judging needs of a trace: {size:,} bytes pickled (the trace itself: "
          f"{len(records[0].value or b''):,} bytes)")


if __name__ == "__main__":
    main()
