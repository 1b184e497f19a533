"""The tap under transformers' own continuous batching (a paged KV cache, packed batches,
requests joining and leaving): the model serves exactly as untapped, whether the tap is
attached before the manager starts or while it runs, under every implementation
continuous batching accepts on CPU (sdpa, and paged|eager for gpt-oss)."""

from __future__ import annotations

import time

import pytest
import torch

from monitor.integrations.transformers import attach
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


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_generate_batch_serves_the_same_tokens_with_the_tap(name):
    model, _ = sharpened(name)
    inputs = prompts(6)
    config = dict(generation_config=greedy(6), continuous_batching_config=continuous_batching_config())
    untapped = {k: v.generated_tokens for k, v in model.generate_batch(inputs=inputs, **config).items()}
    implementation = model.config._attn_implementation
    tap = attach(model, Collect(), sample_rate=1.0, scope=SCOPE, revision="r1")
    try:
        tapped = {k: v.generated_tokens for k, v in model.generate_batch(inputs=inputs, **config).items()}
        assert model.config._attn_implementation == implementation  # restored by the manager, never renamed
    finally:
        tap.detach(timeout=30)
    assert tapped == untapped
    assert len(untapped) == 6


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
