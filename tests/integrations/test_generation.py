"""The tap on today's decoder families (transformers' own classes, tiny configs, attention
sharpened): prefill and ``generate``, batched with left padding, a dynamic and a static
cache. Every published row, prompt and decoding step alike, is the eager attention row
at its position (``output_attentions=True``, within float16 rounding); a learned sink's
mass is what the eager row leaves to it; windows are declared; outputs and generated
tokens are bit-identical with and without the tap; beam search is refused clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monitor.integrations.transformers import attach
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import decode, encode, valid_keys
from monitor.protocol.schema import Scope
from tests.integrations.models import DECODERS, sharpened

pytestmark = pytest.mark.models

SCOPE = Scope(tenant="team-a", data_class="internal")
SECRET = b"0123456789abcdef"
TOLERANCE = 1e-3  #: float16 rows against float32 eager ones


class Collect:
    def __init__(self) -> None:
        self.traces: list[tuple] = []

    def __call__(self, header, weights, sink=None) -> None:
        self.traces.append((header, weights, sink))


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 9 and 6 real tokens, the second left-padded."""
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def check_rows(traces, model, sequences, mask, prompt_lengths):
    """Each trace's rows against the eager model run once over the whole sequences."""
    with torch.no_grad():
        eager = model(input_ids=sequences, attention_mask=mask, output_attentions=True).attentions
    contract_check = {}
    for header, weights, sink in traces:
        b = ("seq-a", "seq-b").index(header.request_id) if sequences.shape[0] > 1 else 0
        real = np.flatnonzero(mask[b].numpy())
        assert header.key_count == len(real) == weights.shape[-1]
        if prompt_lengths is not None:
            assert header.prompt_length == prompt_lengths[b]
        layer = eager[header.layer][b].float().numpy()  # [H, Q, K]
        rows = real[list(header.query_positions)]
        expected = layer[:, rows][:, :, real]
        np.testing.assert_allclose(weights.astype(np.float32), expected, atol=TOLERANCE)
        if sink is not None:  # what the eager row leaves to the learned sink
            np.testing.assert_allclose(sink.astype(np.float32), 1.0 - layer[:, rows].sum(-1), atol=TOLERANCE)
            assert float(sink.max()) > 0.3  # the sinks matter here, so the check means something
        visible = valid_keys(header)  # the monitor's idea of what each row sees: no weight beyond it
        assert float(np.abs(weights.astype(np.float32) * ~visible[None]).max()) == 0.0
        contract_check[header.layer] = header.window
    return contract_check


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_prefill_rows_are_the_eager_rows_with_windows_and_sinks(name):
    tapped, eager = sharpened(name)
    ids, mask = prompts()
    with torch.no_grad():
        untapped = tapped(input_ids=ids, attention_mask=mask).logits
    sink = Collect()
    tap = attach(tapped, sink, sample_rate=1.0, rows=4, scope=SCOPE)
    with tap.request(["seq-a", "seq-b"]), torch.no_grad():
        out = tapped(input_ids=ids, attention_mask=mask).logits
    counts = tap.detach(timeout=30)
    assert torch.equal(out, untapped)
    assert (counts.published, counts.failed) == (4, 0)
    windows = check_rows(sink.traces, eager, ids, mask, None)
    contract = tap.contract()
    assert windows == {layer.layer: layer.window for layer in contract.layers}
    expected_windows = {"mistral": [6, 6], "gemma3": [6, None], "gpt_oss": [6, None]}.get(name, [None, None])
    assert [layer.window for layer in contract.layers] == expected_windows
    assert all(bool(layer.learned_sink) == (name == "gpt_oss") for layer in contract.layers)
    keyring, scopes = Keyring({"k": SECRET}), ScopePolicy.parse(["team-a:internal"])
    for header, weights, mass in sink.traces:  # the monitor takes them as they are
        record = encode(header, weights, "k", SECRET, mass)
        decoded = decode(record, keyring=keyring, scopes=scopes, contracts={contract.contract_id: contract})
        assert (decoded.sink is None) == (mass is None)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_generation_traces_prompt_and_decoding_rows_at_their_positions(name, cache):
    tapped, eager = sharpened(name)
    ids, mask = prompts()
    options = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        options["cache_implementation"] = "static"
    with torch.no_grad():
        untapped = tapped.generate(input_ids=ids, attention_mask=mask, **options)
    sink = Collect()
    tap = attach(tapped, sink, sample_rate=1.0, rows=3, decode_rows=3, scope=SCOPE)
    with tap.request(["seq-a", "seq-b"]), torch.no_grad():
        generated = tapped.generate(input_ids=ids, attention_mask=mask, **options)
    counts = tap.detach(timeout=30)
    assert torch.equal(generated, untapped)
    assert (counts.published, counts.failed) == (4, 0), counts.line()
    full = torch.cat([mask, torch.ones(2, generated.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    # the last token generated is never attended: the last decoding step is the one before it
    check_rows(sink.traces, eager, generated[:, :-1], full[:, :-1], prompt_lengths=(9, 6))
    for header, weights, _ in sink.traces:
        decoding = [p for p in header.query_positions if p >= header.prompt_length]
        assert len(decoding) == 4  # three spread over the nine steps, and the last
        assert decoding[-1] == header.key_count - 1 and decoding[0] == header.prompt_length
        assert weights.shape[1] == 3 + 4


def test_beam_search_is_served_untraced_and_counted(caplog):
    tapped, _ = sharpened("llama")
    ids, mask = prompts()
    options = {"max_new_tokens": 3, "num_beams": 2, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        untapped = tapped.generate(input_ids=ids, attention_mask=mask, **options)
    tap = attach(tapped, Collect(), sample_rate=1.0)
    with tap.request(["seq-a", "seq-b"]), torch.no_grad():
        generated = tapped.generate(input_ids=ids, attention_mask=mask, **options)
    counts = tap.detach(timeout=30)
    assert torch.equal(generated, untapped)
    assert (counts.published, counts.failed, dict(counts.untraced)) == (0, 0, {"beam_search": 2})
    assert "beam search and num_return_sequences > 1" in caplog.text


def long_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of 51 and 40 real tokens, the second left-padded."""
    ids = torch.randint(3, 100, (2, 51), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 51, dtype=torch.long)
    mask[1, :11] = 0
    ids[1, :11] = 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_chunked_prefill_traces_the_whole_prompt(name):
    """prefill_chunk_size=8: the 51-token prompt in seven passes (beyond a 6-key window on
    sliding layers); rows sampled over the whole prompt, each computed in its own chunk."""
    tapped, eager = sharpened(name)
    ids, mask = long_prompts()
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "prefill_chunk_size": 8}
    with torch.no_grad():
        untapped = tapped.generate(input_ids=ids, attention_mask=mask, **options)
    sink = Collect()
    tap = attach(tapped, sink, sample_rate=1.0, rows=6, decode_rows=2, scope=SCOPE)
    with tap.request(["seq-a", "seq-b"]), torch.no_grad():
        generated = tapped.generate(input_ids=ids, attention_mask=mask, **options)
    counts = tap.detach(timeout=30)
    assert torch.equal(generated, untapped)
    assert (counts.published, counts.failed, dict(counts.untraced)) == (4, 0, {}), counts.line()
    full = torch.cat([mask, torch.ones(2, generated.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    check_rows(sink.traces, eager, generated[:, :-1], full[:, :-1], prompt_lengths=(51, 40))
    for header, _, _ in sink.traces:
        prompt_rows = [p for p in header.query_positions if p < header.prompt_length]
        assert len(prompt_rows) == 6 and max(prompt_rows) >= 16  # beyond the first two chunks


@pytest.mark.parametrize("speculation", ["prompt_lookup", "draft_model"])
def test_speculative_decoding_traces_the_prompt_rows_only_and_counts(speculation):
    tapped, eager = sharpened("llama")
    ids = torch.randint(3, 30, (1, 51), generator=torch.Generator().manual_seed(4))  # repeats: lookups hit
    options: dict = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    if speculation == "prompt_lookup":
        options["prompt_lookup_num_tokens"] = 3
    else:
        torch.manual_seed(1)
        options["assistant_model"] = DECODERS["llama"][0]("sdpa")
    with torch.no_grad():
        untapped = tapped.generate(input_ids=ids, **options)
    sink = Collect()
    tap = attach(tapped, sink, sample_rate=1.0, rows=5, scope=SCOPE)
    with tap.request("seq-a"), torch.no_grad():
        generated = tapped.generate(input_ids=ids, **options)
    counts = tap.detach(timeout=30)
    assert torch.equal(generated, untapped)
    assert (counts.published, dict(counts.untraced)) == (2, {"speculative_decoding": 1}), counts.line()
    for header, _, _ in sink.traces:
        assert header.key_count == 51 and header.prompt_length is None and max(header.query_positions) < 51
    check_rows(sink.traces, eager, ids, torch.ones_like(ids), prompt_lengths=None)


def test_a_request_carried_onto_worker_threads_is_traced(caplog):
    """transformers' streaming pattern (TextIteratorStreamer, generate on a Thread) and an
    executor: the request's context does not follow by itself (counted, said once);
    tap.carry binds the call to it, and the traces wait for the call to return."""
    import asyncio
    import functools
    import threading

    from transformers import AutoTokenizer, TextIteratorStreamer

    from tests.integrations.models import minilm_path

    tapped, eager = sharpened("llama")
    ids, mask = prompts()
    options = {"input_ids": ids[:1], "attention_mask": mask[:1], "max_new_tokens": 6, "do_sample": False,
               "pad_token_id": 0}
    with torch.no_grad():
        untapped = tapped.generate(**options)
    sink = Collect()
    tap = attach(tapped, sink, sample_rate=1.0, rows=3, decode_rows=2, scope=SCOPE)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())  # any tokenizer decodes ids below 100

    def stream(target) -> str:
        streamer = TextIteratorStreamer(tokenizer)
        worker = threading.Thread(target=target, kwargs={**options, "streamer": streamer})
        worker.start()
        text = "".join(streamer)
        worker.join(30)
        return text

    with tap.request("seq-a"):  # the plain pattern: nothing traced, counted
        stream(tapped.generate)
    assert tap.flush(timeout=30) and not sink.traces and tap.counts.untraced["outside_request"] == 6  # one a pass
    assert "run the call through tap.carry" in caplog.text
    with tap.request("seq-a"):
        text = stream(tap.carry(tapped.generate))
    assert text

    async def serve() -> torch.Tensor:
        with tap.request("seq-b"):
            call = functools.partial(tapped.generate, **options)
            return await asyncio.get_running_loop().run_in_executor(None, tap.carry(call))

    generated = asyncio.run(serve())
    counts = tap.detach(timeout=30)
    assert torch.equal(generated, untapped)
    assert counts.published == 4 and counts.untraced == {"outside_request": 6}
    sequence = torch.cat([generated, generated])[:, :-1]
    check_rows(sink.traces, eager, sequence, torch.ones_like(sequence), prompt_lengths=(9, 9))
