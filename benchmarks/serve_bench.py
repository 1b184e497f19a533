"""What the attention tap costs ``transformers serve``: requests/s and tokens/s through the
real server, tapped at 0 %, 1 % and 100 % against untapped, at a fixed concurrency, in one run.

    python benchmarks/serve_bench.py [--rounds 5] [--requests 16] [--concurrency 4]
                                     [--new-tokens 32] [--threads 1] [--continuous-batching]

A Llama of realistic width (8 layers of 8 query heads sharing 4 KV heads, hidden 512,
random weights, about 25 M parameters; the byte-level tokenizer of the tests) is saved
with ``save_pretrained``; a real Kafka broker (devstack) takes the traces. Five servers run
side by side on CPU: transformers' own ``transformers serve`` twice (the reference, and
again, to show what noise alone looks like) and ``attention-monitor serve`` at sample rates
0, 0.01 and 1 (4 prompt rows and 4 decoding steps per layer). After a warm-up, each round
sends ``--requests`` greedy chat completions (half of them streamed) at ``--concurrency``
to each server in turn, the order rotating every round, and times the burst: requests/s
and completion tokens/s (the usage the server reports). Each figure is the median over
rounds; the ratio is the median over rounds of each server's figure over the reference's
of the same round. The answers of every server must be the same text (greedy): the run
says whether they are. Every server's torch runs ``--threads`` threads (OMP_NUM_THREADS):
with the default of one, five servers on a small machine do not spin-wait on each
other's cores (with two threads each on a 2-core machine, the untapped server's bursts
swung fourfold from one to the next). Goal: at 1 % within 2 % of untapped tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devstack.kafka import start_broker
from monitor.broker.admin import create_topics
from monitor.protocol.topics import layout
from tests.integrations.serve_checkpoints import BOS, EOS, PAD, PROMPTS, save, tokenizer
from tests.integrations.serve_harness import Server, ask

#: name -> (tapped, sample rate)
CONFIGS = {"untapped": (False, None), "untapped again": (False, None), "tap 0 %": (True, 0.0),
           "tap 1 %": (True, 0.01), "tap 100 %": (True, 1.0)}


def checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=len(tokenizer()), max_position_embeddings=1024,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return save(LlamaForCausalLM(config).eval(), path)


def burst(server: Server, model: str, prompts: list[str], concurrency: int,
          new_tokens: int) -> tuple[float, int, list[str]]:
    """Seconds, completion tokens and answers of one burst of requests."""
    client = server.client()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda ip: ask(client, model, ip[1], "chat-stream" if ip[0] % 2 else "chat",
                                               max_tokens=new_tokens), enumerate(prompts)))
    return time.perf_counter() - started, sum(a.tokens for a in answers), [a.text for a in answers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16, help="requests per burst")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server (OMP_NUM_THREADS)")
    parser.add_argument("--continuous-batching", action="store_true", help="every server batches continuously")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"serve_bench at {commit}: {' '.join(sys.argv[1:]) or '(defaults)'}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    model = str(checkpoint(work / "bench-llama"))
    broker = start_broker("plaintext", work / "kafka")
    servers: dict[str, Server] = {}
    try:
        create_topics(broker.connection(), layout(partitions=2), replication_factor=1)
        keyring = work / "keyring.json"
        keyring.write_text(json.dumps({"bench": "b" * 32}))
        env = {"ATTENTION_MONITOR_BOOTSTRAP_SERVERS": broker.bootstrap, "ATTENTION_MONITOR_KEYRING_FILE": str(keyring),
               "OMP_NUM_THREADS": str(args.threads)}
        batching = ["--continuous-batching"] if args.continuous_batching else []
        for name, (tapped, rate) in CONFIGS.items():
            tap = ["--sample-rate", str(rate), "--tap-log-interval", "3600"] if tapped else []
            options = [model, *batching, *tap]
            servers[name] = Server(env, options, work / f"{name.replace(' ', '-').replace('%', 'pct')}.log",
                                   tapped=tapped, name=name)
        for server in servers.values():
            server.wait_ready(timeout=900)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        for server in servers.values():  # warm-up: every path once
            burst(server, model, prompts[: args.concurrency], args.concurrency, args.new_tokens)

        names = list(servers)
        seconds: dict[str, list[float]] = {n: [] for n in names}
        tokens: dict[str, list[int]] = {n: [] for n in names}
        answers: dict[str, list[str]] = {}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                took, generated, texts = burst(servers[name], model, prompts, args.concurrency, args.new_tokens)
                seconds[name].append(took)
                tokens[name].append(generated)
                answers.setdefault(name, texts)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        broker.stop()

    print(f"\n{args.requests} requests a burst at concurrency {args.concurrency}, up to {args.new_tokens} new "
          f"tokens, {'continuous batching' if args.continuous_batching else 'generate (one request at a time)'}, "
          f"{args.threads} torch thread(s) a server; median of {args.rounds} rounds")
    print(f"{'server':<16}{'requests/s':>12}{'tokens/s':>10}{'ratio':>8}")
    reference = "untapped"
    for name in names:
        rps = [args.requests / s for s in seconds[name]]
        tps = [t / s for t, s in zip(tokens[name], seconds[name], strict=True)]
        ratio = statistics.median(t / (tr / sr) for t, tr, sr in zip(tps, tokens[reference], seconds[reference],
                                                                      strict=True))
        print(f"{name:<16}{statistics.median(rps):>12.2f}{statistics.median(tps):>10.1f}{ratio:>8.3f}")
    same = all(texts == answers[reference] for texts in answers.values())
    print(f"answers identical across servers (greedy): {'yes' if same else 'NO'}")
    for name, server in servers.items():
        stopped = [line for line in server.log().splitlines() if "attention tap stopped:" in line]
        if stopped:
            print(f"{name}: {stopped[-1].split('attention tap stopped: ')[1]}")


if __name__ == "__main__":
    main()
