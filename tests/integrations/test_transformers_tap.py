"""The attention tap on transformers' own model classes: under sdpa, the sampled rows are
the eager implementation's attention weights (within float16 rounding), the model's
outputs are bit-identical, the traces pass the monitor's own checks, sampling is
reproducible and honours its rate, and a slow sink never blocks the forward pass."""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
import pytest
import torch

from monitor.integrations.transformers import attach, contract_from_config
from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import decode, encode
from monitor.protocol.schema import Scope
from tests.integrations.models import MODELS, twins

pytestmark = pytest.mark.models

SCOPE = Scope(tenant="team-a", data_class="internal")
LENGTH = 12


def batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences; the second padded (left for the decoders, right for BERT)."""
    ids = torch.randint(1, 100, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    if name == "bert":
        mask[1, -4:] = 0
    else:
        mask[1, :4] = 0
    return ids, mask


class Collect:
    def __init__(self) -> None:
        self.traces: list = []

    def __call__(self, header, weights) -> None:
        self.traces.append((header, weights))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sampled_rows_are_the_eager_weights_and_outputs_are_bit_identical(name):
    fused, eager = twins(name)
    ids, mask = batch(name)
    with torch.no_grad():
        untapped = fused(input_ids=ids, attention_mask=mask)[0]
        reference = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    sink = Collect()
    tap = attach(fused, sink, sample_rate=1.0, rows=4, scope=SCOPE, model_id=f"tiny-{name}")
    assert fused.config._attn_implementation == "sdpa"  # the model's implementation is never renamed
    with tap.request(["seq-a", "seq-b"]), torch.no_grad():
        tapped = fused(input_ids=ids, attention_mask=mask)[0]
    counts = tap.detach()
    assert torch.equal(tapped, untapped)
    assert (counts.sampled, counts.published, counts.dropped, counts.failed) == (4, 4, 0, 0)

    contract = tap.contract()
    assert contract.mask == ("bidirectional" if name == "bert" else "causal")
    keyring, scopes = Keyring({"k": b"0123456789abcdef"}), ScopePolicy.parse(["team-a:internal"])
    for header, weights in sink.traces:
        b = ("seq-a", "seq-b").index(header.request_id)
        real = np.flatnonzero(mask[b].numpy())
        assert header.key_count == len(real) == (LENGTH if b == 0 else LENGTH - 4)
        rows = real[list(header.query_positions)]
        expected = reference[header.layer][b].numpy()[:, rows][:, :, real]
        assert weights.dtype == np.float16 and weights.shape == expected.shape
        np.testing.assert_allclose(weights.astype(np.float32), expected, atol=2e-3, rtol=2e-3)
        # and the monitor accepts it as it is: signature, contract, mask, row sums
        decoded = decode(encode(header, weights, "k", b"0123456789abcdef"), keyring=keyring, scopes=scopes,
                         contracts={contract.contract_id: contract})
        assert decoded.header.weights_source == "recomputed"
    assert {h.layer for h, _ in sink.traces} == {0, 1}
    assert len({h.trace_id for h, _ in sink.traces}) == 4  # unique per request × layer


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_contract_comes_from_the_config(name):
    model = MODELS[name]("sdpa")
    contract = contract_from_config(model.config, "m", "r1")
    heads = model.config.num_attention_heads
    groups = getattr(model.config, "num_key_value_heads", None) or heads
    assert len(contract.layers) == model.config.num_hidden_layers == 2
    layer = contract.layers[0]
    assert len(layer.heads) == heads and len(set(layer.kv_groups)) == groups
    assert layer.head_dim == model.config.hidden_size // heads
    assert contract.scale == layer.head_dim**-0.5
    tap = attach(model, Collect(), model_id="m", revision="r1")
    try:
        assert tap.contract() == contract  # the live model's modules agree with its config
    finally:
        tap.detach()


def test_the_revision_defaults_to_a_hash_of_the_weights():
    a, b = twins("llama")
    tap_a, tap_b = attach(a, Collect()), attach(b, Collect())
    try:
        assert tap_a.contract().model_revision == tap_b.contract().model_revision  # same weights, same revision
        assert tap_a.contract().model_revision.startswith("sha256:")
    finally:
        tap_a.detach()
        tap_b.detach()
    with torch.no_grad():
        b.lm_head.weight[0, 0] += 1
    tap_b = attach(b, Collect())
    assert tap_b.contract().model_revision != tap_a.contract().model_revision
    tap_b.detach()


def test_generation_traces_prompt_and_decoding_steps_and_generates_the_same_tokens():
    model, _ = twins("llama")
    prompt = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(3))
    untapped = model.generate(prompt, max_new_tokens=4, do_sample=False)
    sink = Collect()
    tap = attach(model, sink, sample_rate=1.0)
    with tap.request("gen-1"):
        tapped = model.generate(prompt, max_new_tokens=4, do_sample=False)
    tap.detach()
    assert torch.equal(tapped, untapped)
    # 8 prompt keys and the keys of the three decoding steps (the fourth token is never attended)
    assert sorted((h.layer, h.key_count, h.prompt_length) for h, _ in sink.traces) == [(0, 11, 8), (1, 11, 8)]
    assert all(h.query_positions[-1] == 10 for h, _ in sink.traces)  # the last step, at its position


def test_sampling_is_reproducible_and_honours_its_rate():
    model = MODELS["gpt2"]("sdpa")
    taps = [attach(model, Collect(), sample_rate=rate, seed=seed) for rate, seed in ((0.01, 0), (0.01, 0), (0.01, 7),
                                                                                      (0.3, 0))]
    try:
        ids = [f"req-{i}" for i in range(10_000)]
        picked = [[t.sampled(r) for r in ids] for t in taps]
    finally:
        for t in taps:
            t.detach()
    assert picked[0] == picked[1]  # the same ids and seed sample the same requests
    assert picked[0] != picked[2]  # another seed, another sample
    for rate, chosen in ((0.01, picked[0]), (0.01, picked[2]), (0.3, picked[3])):
        n, k = len(chosen), sum(chosen)
        sd = math.sqrt(n * rate * (1 - rate))
        assert abs(k - n * rate) < 4.5 * sd, (rate, k)  # a binomial interval (p ≈ 1e-5 of a false failure)
    # one hash per request: a higher rate samples every request a lower rate does (same seed)
    assert all(high for low, high in zip(picked[0], picked[3], strict=True) if low)


def test_unsampled_requests_cost_no_trace_and_bad_request_ids_are_refused():
    model, _ = twins("llama")
    sink = Collect()
    tap = attach(model, sink, sample_rate=0.0)
    with tap.request("never"), torch.no_grad():
        model(input_ids=torch.ones(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="request id"), tap.request("spaces are not allowed"):
        pass
    tap.detach()
    assert tap.counts.sampled == 0 and not sink.traces


def test_a_full_sink_queue_drops_and_counts_and_never_blocks(caplog):
    model, _ = twins("llama")
    release = threading.Event()
    seen = []

    def slow_sink(header, weights):
        seen.append(header.trace_id)
        release.wait(30)

    tap = attach(model, slow_sink, sample_rate=1.0, queue_size=2)
    ids = torch.randint(1, 100, (1, 6))

    def serve() -> None:
        for i in range(5):  # 5 requests × 2 layers = 10 traces, while the sink hangs on the first
            with tap.request(f"r{i}"), torch.no_grad():
                model(input_ids=ids)

    worker = threading.Thread(target=serve)
    worker.start()
    worker.join(60)
    try:
        assert not worker.is_alive(), "the forward pass waited for the sink"
        counts = tap.counts
        assert counts.sampled == 10 and counts.published == 0
        assert counts.dropped >= 10 - 3 and counts.queued + counts.dropped == 10  # one in the sink, two queued
    finally:
        release.set()
    with caplog.at_level(logging.INFO, logger="monitor.integrations.transformers"):
        counts = tap.detach(timeout=30)
    assert counts.published == 10 - counts.dropped and counts.queued == 0
    assert f"published={counts.published} dropped={counts.dropped}" in caplog.text


def test_a_failing_sink_is_counted_and_the_model_runs_on():
    model, _ = twins("bert")

    def broken(header, weights):
        raise ConnectionError("broker gone")

    tap = attach(model, broken, sample_rate=1.0)
    with tap.request("r"), torch.no_grad():
        model(input_ids=torch.ones(1, 5, dtype=torch.long))
    counts = tap.detach()
    assert (counts.sampled, counts.published, counts.failed) == (2, 0, 2)


def test_softcapping_and_sliding_windows_under_eager():
    """Gemma 2 softcaps its attention logits and alternates sliding-window and full
    layers; it runs eager (sdpa refuses softcapping), which the tap wraps as well."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def gemma(implementation):
        torch.manual_seed(0)
        return Gemma2ForCausalLM(Gemma2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=100, sliding_window=4, attn_logit_softcapping=5.0, query_pre_attn_scalar=16,
            attn_implementation=implementation)).eval()

    model = gemma("eager")
    ids = torch.randint(1, 100, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(input_ids=ids, output_attentions=True)
    sink = Collect()
    tap = attach(model, sink, sample_rate=1.0, rows=6)
    with tap.request("gemma-1"), torch.no_grad():
        tapped = model(input_ids=ids, output_attentions=True)
    tap.detach()
    assert torch.equal(tapped.logits, reference.logits)
    assert tap.contract().scale == 16**-0.5
    windows = {layer: bool((reference.attentions[layer][0, :, -1, :5] == 0).all()) for layer in (0, 1)}
    assert windows == {0: True, 1: False}  # layer 0 slides (4 keys), layer 1 sees everything
    for header, weights in sink.traces:
        rows = list(header.query_positions)
        expected = reference.attentions[header.layer][0].numpy()[:, rows]
        np.testing.assert_allclose(weights.astype(np.float32), expected, atol=2e-3, rtol=2e-3)


def test_an_unknown_attention_kernel_is_served_untraced_and_counted(caplog):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("house-kernel", sdpa_attention_forward)
    model, _ = twins("llama")
    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        untapped = model(input_ids=ids).logits
    model.set_attn_implementation("house-kernel")
    sink = Collect()
    tap = attach(model, sink, sample_rate=1.0)
    with tap.request("r1"), torch.no_grad():
        tapped = model(input_ids=ids).logits
    counts = tap.detach()
    assert torch.equal(tapped, untapped)
    assert not sink.traces and counts.untraced == {"unknown_kernel": 1} and counts.failed == 0
    assert "'house-kernel' is not one whose rows the tap knows how to recompute" in caplog.text


def test_only_the_tapped_model_is_traced_and_the_lookup_is_restored():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tapped, other = twins("llama")  # sdpa and eager: both implementations pass through the wrapped lookup
    ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = tapped(input_ids=ids).logits, other(input_ids=ids).logits
    sink = Collect()
    wrapped_before = "get_interface" in ALL_ATTENTION_FUNCTIONS.__dict__  # by another wrapper still installed
    tap = attach(tapped, sink, sample_rate=1.0)
    assert "get_interface" in ALL_ATTENTION_FUNCTIONS.__dict__
    with tap.request("r1"), torch.no_grad():
        outputs = tapped(input_ids=ids).logits, other(input_ids=ids).logits
    tap.detach()
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert {h.request_id for h, _ in sink.traces} == {"r1"} and len(sink.traces) == 2  # the tapped model's layers
    assert ("get_interface" in ALL_ATTENTION_FUNCTIONS.__dict__) == wrapped_before  # the class's own lookup again
