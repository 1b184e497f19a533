"""The tap under transformers' own continuous batching (a paged KV cache, packed batches,
requests joining and leaving): the model serves exactly as untapped, whether the tap is
attached before the manager starts or while it runs, under every implementation
continuous batching accepts on CPU (sdpa, and paged|eager for gpt-oss); every sampled
request is traced under its own id, once, when it finishes; every row, prompt (also
prefilled in chunks, or after a shared prefix) and decoding step alike, is the dense
eager row at its position within 1e-3, and a learned sink's mass what the eager row
leaves to it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from monitor.integrations.transformers import attach
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import decode, encode
from monitor.protocol.schema import Scope
from tests.integrations.models import continuous_batching_config, greedy, sharpened

pytestmark = pytest.mark.models

SCOPE = Scope(tenant="team-a", data_class="internal")


def prompts(count: int, seed: int = 7) -> list[list[int]]:
    """Prompts of varied lengths (5 to 60 tokens: several 16-token pages, some split into
    chunks by a 256-token batch)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 61, (count,), generator=generator).tolist()
    return [torch.randint(3, 100, (n,), generator=generator).tolist() for n in lengths]


def serve(model, inputs, new_tokens, during=None) -> dict[str, list[int]]:
    """Every request queued before the manager starts (so the schedule does not depend on
    timing), request ``i`` asking for ``new_tokens[i]`` tokens, then served;
    ``during(results_so_far)`` runs after each finished request."""
    manager = model.init_continuous_batching(generation_config=greedy(max(new_tokens)),
                                             continuous_batching_config=continuous_batching_config())
    ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
           for i, (p, n) in enumerate(zip(inputs, new_tokens, strict=True))]
    manager.start()
    results: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    try:
        while len(results) < len(ids) and time.monotonic() < deadline:
            output = manager.get_result(timeout=1)
            if output is not None and output.is_finished():
                assert output.error is None, output.error
                results[output.request_id] = list(output.generated_tokens)
                if during is not None:
                    during(results)
    finally:
        manager.stop(block=True, timeout=30)
    assert len(results) == len(ids), "not every request finished"
    return results


class Collect:
    def __init__(self) -> None:
        self.traces: list[tuple] = []

    def __call__(self, header, weights, sink=None) -> None:
        self.traces.append((header, weights, sink))


def check_rows(traces, eager, sequences: dict[str, list[int]], prompt_lengths: dict[str, int]) -> int:
    """Each trace's rows against the eager model run once over its whole sequence (the
    tokens up to the last row); returns how many decoding rows were checked."""
    decoding = 0
    for header, weights, sink in traces:
        tokens = sequences[header.request_id][: header.key_count]
        assert len(tokens) == header.key_count
        with torch.no_grad():
            layer = eager(input_ids=torch.tensor([tokens]), output_attentions=True).attentions[header.layer][0].numpy()
        expected = layer[:, list(header.query_positions)]
        assert weights.shape == expected.shape
        np.testing.assert_allclose(weights.astype(np.float32), expected, atol=1e-3)
        if sink is not None:
            np.testing.assert_allclose(sink.astype(np.float32), 1.0 - expected.sum(-1), atol=1e-3)
        if header.prompt_length is not None:
            assert header.prompt_length == prompt_lengths[header.request_id]
            decoding += sum(p >= header.prompt_length for p in header.query_positions)
        else:
            assert header.key_count == prompt_lengths[header.request_id]
    return decoding


@pytest.mark.parametrize(("name", "batch_tokens"), [("llama", 256), ("llama", 24), ("gpt_oss", 24)])
def test_generate_batch_serves_the_same_tokens_and_traces_every_request_at_its_positions(name, batch_tokens):
    """24 tokens a batch: every longer prompt is prefilled in chunks, beside other requests' steps."""
    model, eager = sharpened(name)
    inputs = prompts(6)
    config = dict(generation_config=greedy(6), continuous_batching_config=continuous_batching_config(
        max_batch_tokens=batch_tokens))
    untapped = {k: v.generated_tokens for k, v in model.generate_batch(inputs=inputs, **config).items()}
    implementation = model.config._attn_implementation
    sink = Collect()
    tap = attach(model, sink, sample_rate=1.0, rows=5, decode_rows=3, scope=SCOPE, revision="r1")
    try:
        tapped = {k: v.generated_tokens for k, v in model.generate_batch(inputs=inputs, **config).items()}
        assert model.config._attn_implementation == implementation  # restored by the manager, never renamed
    finally:
        counts = tap.detach(timeout=30)
    assert tapped == untapped and len(untapped) == 6
    assert (counts.published, counts.failed, dict(counts.untraced)) == (12, 0, {}), counts.line()
    assert sorted((h.request_id, h.layer) for h, _, _ in sink.traces) == [(f"req_{i}", n) for i in range(6)
                                                                          for n in (0, 1)]
    sequences = {f"req_{i}": p + tapped[f"req_{i}"] for i, p in enumerate(inputs)}
    decoding = check_rows(sink.traces, eager, sequences, {f"req_{i}": len(p) for i, p in enumerate(inputs)})
    assert decoding == 12 * 4  # three steps spread over the five, and the last
    contract, secret = tap.contract(), b"0123456789abcdef"
    keyring, scopes = Keyring({"k": secret}), ScopePolicy.parse(["team-a:internal"])
    for header, weights, mass in sink.traces:
        assert header.key_count == len(sequences[header.request_id]) - 1  # the last token is never attended
        assert sum(p < header.prompt_length for p in header.query_positions) == 5
        decoded = decode(encode(header, weights, "k", secret, mass), keyring=keyring, scopes=scopes,
                         contracts={contract.contract_id: contract})  # the monitor takes them as they are
        assert (decoded.sink is None) == (name != "gpt_oss")


def test_attaching_and_detaching_while_a_manager_runs_never_changes_a_token():
    model, _ = sharpened("llama")
    inputs = prompts(8, seed=11)
    lengths = [3 + 4 * i for i in range(8)]  # requests leave the batch one by one
    untapped = serve(model, inputs, lengths)
    taps = []

    def attach_then_detach(results):
        if len(results) == 1:
            taps.append(attach(model, Collect(), sample_rate=1.0, scope=SCOPE, revision="r1"))
        elif len(results) == 5:
            taps[0].detach(timeout=30)

    tapped = serve(model, inputs, lengths, during=attach_then_detach)
    assert tapped == untapped
    assert [len(tapped[f"r{i}"]) for i in range(8)] == lengths
    assert taps and not taps[0].attached


def drain(manager, until, tokens=None, finished=None, deadline_s: float = 120) -> dict[str, list[int]]:
    """Outputs as they come (streamed ones too) into ``tokens`` (request id → its tokens so
    far), until ``until(finished)`` holds for the ids finished (kept in ``finished``)."""
    tokens = {} if tokens is None else tokens
    finished = set() if finished is None else finished
    deadline = time.monotonic() + deadline_s
    while not until(finished) and time.monotonic() < deadline:
        output = manager.get_result(timeout=0.5)
        if output is not None:
            assert output.error is None, output.error
            tokens[output.request_id] = list(output.generated_tokens)
            if output.is_finished():
                finished.add(output.request_id)
    assert until(finished), f"finished: {sorted(finished)}"
    return tokens


def test_requests_joining_and_leaving_sampled_or_not_traced_once_under_their_own_ids():
    model, eager = sharpened("llama")
    sink = Collect()
    tap = attach(model, sink, sample_rate=0.5, seed=3, rows=4, decode_rows=2, scope=SCOPE, revision="r1")
    manager = model.init_continuous_batching(generation_config=greedy(10),
                                             continuous_batching_config=continuous_batching_config(max_batch_tokens=32))
    inputs = prompts(8, seed=5)
    first = [f"a{i}" for i in range(4)]
    # a second wave joins while the first runs: one shares the first request's 40-token prefix (its
    # cached blocks are reused, so that request computes from position 32), one is served under an id
    # of the caller's (a completion id) and another scope
    candidates = [f"b{i}" for i in range(40)]
    sharing = next(c for c in candidates if tap.sampled(c))
    plain = [c for c in candidates if c != sharing][:2]
    completion = next(f"chatcmpl-{i}" for i in range(40) if tap.sampled(f"chatcmpl-{i}"))
    other_scope = Scope(tenant="team-b", data_class="internal")
    prompt_of = dict(zip(first, inputs[:4], strict=True))
    prompt_of[sharing] = inputs[0][:40] + inputs[4][:10]
    prompt_of.update(zip(plain, inputs[5:7], strict=True))
    prompt_of["engine-7"] = inputs[7]
    manager.start()
    try:
        for i, rid in enumerate(first):
            manager.add_request(prompt_of[rid], request_id=rid, max_new_tokens=4 + 2 * i)
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        drain(manager, lambda done: "a0" in done, tokens, finished)
        assert tap.flush(timeout=30)
        if tap.sampled("a0"):  # published when it finished, while the others still run
            assert {h.layer for h, _, _ in sink.traces if h.request_id == "a0"} == {0, 1}
        tap.identify("engine-7", completion, scope=other_scope)
        for rid in [sharing, *plain, "engine-7"]:
            manager.add_request(prompt_of[rid], request_id=rid, max_new_tokens=5)
        drain(manager, lambda done: len(done) == 8, tokens, finished)
    finally:
        manager.stop(block=True, timeout=30)
    counts = tap.detach(timeout=30)
    traced_as = {rid: rid for rid in prompt_of} | {"engine-7": completion}
    expected = sorted(traced_as[rid] for rid in prompt_of if tap.sampled(traced_as[rid]))
    assert 2 <= len(expected) < 8  # sampled and unsampled requests shared the batches
    published = sorted((h.request_id, h.layer) for h, _, _ in sink.traces)
    assert published == [(rid, n) for rid in expected for n in (0, 1)]  # each once, under its own id
    assert (counts.published, counts.failed) == (2 * len(expected), 0)
    sequences = {traced_as[rid]: prompt_of[rid] + tokens[rid] for rid in prompt_of}
    check_rows(sink.traces, eager, sequences, {traced_as[rid]: len(prompt_of[rid]) for rid in prompt_of})
    assert all(h.scope == other_scope for h, _, _ in sink.traces if h.request_id == completion)
    assert all(h.scope == SCOPE for h, _, _ in sink.traces if h.request_id != completion)
    shared = [h for h, _, _ in sink.traces if h.request_id == sharing]
    assert all(p >= 32 for h in shared for p in h.query_positions)  # the prefix's rows were never computed


def test_a_sampled_request_joining_a_running_batch_of_unsampled_ones_is_traced_at_its_positions():
    """While every request of the batch is unsampled and none is traced, a pass is told
    from its request ids alone; a sampled request joining that batch mid-run (the others
    unchanged, decoding) is traced all the same, prompt rows and decoding steps, under
    its own id, and so is a second one joining after the first has left."""
    model, eager = sharpened("llama")
    sink = Collect()
    tap = attach(model, sink, sample_rate=0.5, seed=5, rows=4, decode_rows=2, scope=SCOPE, revision="r1")
    candidates = [f"c{i}" for i in range(40)]
    unsampled = [c for c in candidates if not tap.sampled(c)][:3]
    joining = [c for c in candidates if tap.sampled(c)][:2]
    inputs = prompts(5, seed=23)
    prompt_of = dict(zip([*unsampled, *joining], inputs, strict=True))
    manager = model.init_continuous_batching(generation_config=greedy(40),
                                             continuous_batching_config=continuous_batching_config())
    manager.start()
    try:
        for rid in unsampled:
            manager.add_request(prompt_of[rid], request_id=rid, max_new_tokens=40, streaming=rid == unsampled[0])
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        drain(manager, lambda _: len(tokens.get(unsampled[0], [])) >= 4, tokens, finished)  # all three decoding
        manager.add_request(prompt_of[joining[0]], request_id=joining[0], max_new_tokens=6)
        drain(manager, lambda done: joining[0] in done, tokens, finished)
        assert tap.flush(timeout=30)
        assert sorted((h.request_id, h.layer) for h, _, _ in sink.traces) == [(joining[0], 0), (joining[0], 1)]
        assert not finished & set(unsampled)  # it joined and left a batch the others stayed in
        manager.add_request(prompt_of[joining[1]], request_id=joining[1], max_new_tokens=6)
        drain(manager, lambda done: len(done) == 5, tokens, finished)
    finally:
        manager.stop(block=True, timeout=30)
    counts = tap.detach(timeout=30)
    assert (counts.published, counts.failed, dict(counts.untraced)) == (4, 0, {}), counts.line()
    assert sorted((h.request_id, h.layer) for h, _, _ in sink.traces) == [(rid, n) for rid in joining for n in (0, 1)]
    decoding = check_rows(sink.traces, eager, {rid: prompt_of[rid] + tokens[rid] for rid in joining},
                          {rid: len(prompt_of[rid]) for rid in joining})
    assert decoding == 4 * 3  # two steps spread over the six, and the last


def test_a_cancelled_request_is_published_with_the_rows_it_got_and_the_others_run_on():
    model, eager = sharpened("llama")
    sink = Collect()
    tap = attach(model, sink, sample_rate=1.0, rows=3, decode_rows=3, scope=SCOPE, revision="r1")
    manager = model.init_continuous_batching(generation_config=greedy(60),
                                             continuous_batching_config=continuous_batching_config())
    inputs = prompts(2, seed=9)
    manager.start()
    try:
        manager.add_request(inputs[0], request_id="long", max_new_tokens=60, streaming=True)
        manager.add_request(inputs[1], request_id="short", max_new_tokens=20)
        tokens: dict[str, list[int]] = {}
        deadline = time.monotonic() + 60
        while len(tokens.get("long", [])) < 5 and time.monotonic() < deadline:
            output = manager.get_result(timeout=0.5)
            if output is not None:
                tokens[output.request_id] = list(output.generated_tokens)
        manager.cancel_request("long")
        tokens.update(drain(manager, lambda done: "short" in done))
    finally:
        manager.stop(block=True, timeout=30)
    while (output := manager.get_result(timeout=0.1)) is not None:  # streamed outputs still queued
        tokens[output.request_id] = list(output.generated_tokens)
    counts = tap.detach(timeout=30)
    assert counts.failed == 0 and len(tokens["short"]) == 20
    cancelled = [h for h, _, _ in sink.traces if h.request_id == "long"]
    assert sorted(h.layer for h in cancelled) == [0, 1]  # once, with what it had
    assert all(5 <= h.key_count - len(inputs[0]) < 60 for h in cancelled)
    check_rows(sink.traces, eager, {"long": inputs[0] + tokens["long"], "short": inputs[1] + tokens["short"]},
               {"long": len(inputs[0]), "short": len(inputs[1])})


def test_requests_it_cannot_name_are_served_untraced_and_counted(caplog):
    model, _ = sharpened("llama")
    untapped = serve(model, prompts(2), [4, 4])
    sink = Collect()
    tap = attach(model, sink, sample_rate=1.0, scope=SCOPE, revision="r1")
    manager = model.init_continuous_batching(generation_config=greedy(4),
                                             continuous_batching_config=continuous_batching_config())
    manager.add_request(prompts(2)[0], request_id="has space", max_new_tokens=4)
    manager.add_request(prompts(2)[1], request_id="r1", max_new_tokens=4)
    manager.start()
    try:
        tokens = drain(manager, lambda done: len(done) == 2)
    finally:
        manager.stop(block=True, timeout=30)
    counts = tap.detach(timeout=30)
    assert tokens == {"has space": untapped["r0"], "r1": untapped["r1"]}
    assert counts.untraced == {"request_id": 1} and {h.request_id for h, _, _ in sink.traces} == {"r1"}
    assert "counted in tap.counts.untraced['request_id']" in caplog.text


def test_every_returned_sequence_of_a_sampled_request_is_traced_at_its_positions():
    """num_return_sequences=3, sampled: the engine prefills each prompt but its last token
    (in chunks here), then forks two children sharing its cached keys. Each returned
    sequence of a sampled request is traced (the children under ``<id>__child-<i>``) with
    the request's prompt rows and its own decoding steps; an unsampled request's none."""
    from transformers import GenerationConfig

    model, eager = sharpened("llama")
    inputs = prompts(4, seed=13)
    config = dict(generation_config=GenerationConfig(max_new_tokens=6, do_sample=True, num_return_sequences=3,
                                                     eos_token_id=-1),
                  continuous_batching_config=continuous_batching_config(max_batch_tokens=24))

    def run() -> dict[str, list[int]]:
        torch.manual_seed(1)  # the generation thread samples from the global generator
        return {k: list(v.generated_tokens) for k, v in model.generate_batch(inputs=inputs, **config).items()}

    untapped = run()
    sink = Collect()
    tap = attach(model, sink, sample_rate=0.5, seed=4, rows=4, decode_rows=2, scope=SCOPE, revision="r1")
    tapped = run()
    counts = tap.detach(timeout=30)
    assert tapped == untapped and len(tapped) == 12
    sampled = [i for i in range(4) if tap.sampled(f"req_{i}")]
    assert sampled == [0, 1]
    traced_as = {f"req_{i}": (i, f"req_{i}") for i in sampled} | \
        {f"req_{i}__child#{c}": (i, f"req_{i}__child-{c}") for i in sampled for c in (0, 1)}
    published = sorted((h.request_id, h.layer) for h, _, _ in sink.traces)
    assert published == sorted((name, n) for _, name in traced_as.values() for n in (0, 1))
    assert (counts.published, counts.failed, dict(counts.untraced)) == (12, 0, {}), counts.line()
    sequences = {name: inputs[i] + tapped[engine] for engine, (i, name) in traced_as.items()}
    decoding = check_rows(sink.traces, eager, sequences, {name: len(inputs[i]) for i, name in traced_as.values()})
    assert decoding == 12 * 3  # two steps spread over the six, and the last
    for i in sampled:  # one request's sequences: the same prompt rows, their own decoding
        family = [(h, w) for h, w, _ in sink.traces if h.layer == 1 and h.request_id.split("__")[0] == f"req_{i}"]
        prompt = [p for p in family[0][0].query_positions if p < len(inputs[i])]
        assert len(family) == 3 and len(prompt) == 4
        assert all(h.query_positions[:4] == tuple(prompt) for h, _ in family)
        assert all(np.array_equal(w[:, :4], family[0][1][:, :4]) for _, w in family)
        assert len({tuple(sequences[h.request_id]) for h, _ in family}) > 1  # sampling made them differ


def test_a_batch_it_cannot_read_is_served_untraced_counted_and_said_once(monkeypatch, caplog):
    """A transformers whose batch processor or paged cache is laid out otherwise (simulated:
    the attribute read missing), or a batch read that does not match its pass (simulated:
    the packing order misread): tokens unchanged, nothing published, one reason, said once."""
    from monitor.integrations import batch_processor, continuous_batching

    model, _ = sharpened("llama")
    inputs = prompts(3, seed=17)
    config = dict(generation_config=greedy(4), continuous_batching_config=continuous_batching_config())
    untapped = {k: v.generated_tokens for k, v in model.generate_batch(inputs=inputs, **config).items()}
    def reversed_batch(processor):
        batch = processor.inputs_and_outputs.requests_in_batch[::-1]
        return batch_processor.batch_members(SimpleNamespace(inputs_and_outputs=SimpleNamespace(
            requests_in_batch=batch)))

    def renamed_cache(self, batch, *args):  # as if the cache's allocators were renamed
        return batch.cache.allocators_by_layer

    misread = [("batch_members", lambda processor: batch_processor.batch_members(
                    SimpleNamespace(inputs_and_outputs=SimpleNamespace()))),
               ("batch_members", reversed_batch), ("_around", renamed_cache)]
    for (name, read), message in zip(misread, ["has no batch in inputs_and_outputs.requests_in_batch",
                                               "query lengths", "paged cache has no allocators_by_layer"],
                                     strict=True):
        monkeypatch.undo()
        where = continuous_batching if name == "batch_members" else continuous_batching.ContinuousBatching
        monkeypatch.setattr(where, name, read)
        caplog.clear()
        sink = Collect()
        tap = attach(model, sink, sample_rate=1.0, scope=SCOPE, revision="r1")
        tapped = {k: v.generated_tokens for k, v in model.generate_batch(inputs=inputs, **config).items()}
        counts = tap.detach(timeout=30)
        assert tapped == untapped
        assert not sink.traces and counts.failed == 0
        assert set(counts.untraced) == {"continuous_batching_unreadable"}, counts.line()
        said = [r.getMessage() for r in caplog.records if "continuous_batching_unreadable" in r.getMessage()]
        assert len(said) == 1 and message in said[0], said


def test_a_cache_no_processor_holds_is_refused_with_what_was_looked_for():
    from monitor.integrations.batch_processor import ProcessorLookup, Unreadable

    with pytest.raises(Unreadable, match=r"no ContinuousBatchProcessor .* holds the paged cache"):
        ProcessorLookup().find(object())


def test_streamed_by_request_id_iter_and_delivered_to_result_handlers_as_untapped():
    """The manager's other ways to hand out results, with the tap attached: a streaming
    request read with ``request_id_iter`` and one delivered to ``register_result_handler``
    get the untapped tokens, and both are traced once."""
    import asyncio

    model, eager = sharpened("llama")
    inputs = prompts(2, seed=19)
    untapped = serve(model, inputs, [6, 6])
    sink = Collect()
    tap = attach(model, sink, sample_rate=1.0, rows=3, decode_rows=2, scope=SCOPE, revision="r1")
    manager = model.init_continuous_batching(generation_config=greedy(6),
                                             continuous_batching_config=continuous_batching_config())
    handled: list = []

    async def read() -> list[list[int]]:
        finished = asyncio.Event()  # handlers are called on the registering event loop

        def handler(output):
            handled.append(output)
            if output.is_finished():
                finished.set()

        manager.register_result_handler("handled", handler)
        manager.add_request(inputs[1], request_id="handled", max_new_tokens=6)
        manager.add_request(inputs[0], request_id="streamed", max_new_tokens=6, streaming=True)
        streamed = await asyncio.to_thread(
            lambda: [list(output.generated_tokens) for output in manager.request_id_iter("streamed")])
        await asyncio.wait_for(finished.wait(), 60)
        return streamed

    manager.start()
    try:
        streamed = asyncio.run(read())
    finally:
        manager.stop(block=True, timeout=30)
    counts = tap.detach(timeout=30)
    assert streamed[-1] == untapped["r0"] and len(streamed) > 1  # one output a token
    assert list(handled[-1].generated_tokens) == untapped["r1"]
    assert sorted((h.request_id, h.layer) for h, _, _ in sink.traces) == [("handled", 0), ("handled", 1),
                                                                           ("streamed", 0), ("streamed", 1)]
    assert counts.failed == 0 and not counts.untraced
    check_rows(sink.traces, eager, {"streamed": inputs[0] + streamed[-1], "handled": inputs[1] + untapped["r1"]},
               {"streamed": len(inputs[0]), "handled": len(inputs[1])})


def test_a_manager_made_after_attach_is_found_by_its_public_batch_processor():
    """From a thread outside the manager's generation step (no calling frame holds the
    processor), the processor of the cache is found through the manager the model made;
    closing the lookup unwraps the model."""
    from monitor.integrations.batch_processor import ProcessorLookup

    model, _ = sharpened("llama")
    lookup = ProcessorLookup()
    lookup.watch(model)
    manager = model.init_continuous_batching(generation_config=greedy(2),
                                             continuous_batching_config=continuous_batching_config())
    manager.start()
    try:
        manager.add_request(prompts(1)[0], request_id="r", max_new_tokens=2)
        drain(manager, lambda done: "r" in done)
        assert lookup.find(manager.batch_processor.cache) is manager.batch_processor
    finally:
        manager.stop(block=True, timeout=30)
        lookup.close()
    assert "init_continuous_batching" not in model.__dict__
