"""The engine-neutral paged recompute against the dense one (``recompute.row_weights`` over
the same keys laid out contiguously): causal rows, sliding windows, softcapping, learned
sinks, GQA; keys scattered over a cache through a shuffled block table, in transformers'
layout (blocks wider than their pages) and vLLM's (slot = block · size + offset), and read
from a page view."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monitor.integrations.paged_recompute import paged_rows, rows_over_keys, slots
from monitor.integrations.recompute import row_weights

pytestmark = pytest.mark.models

HEADS, GROUPS, DIM, LENGTH, BLOCK = 8, 2, 16, 45, 8


def sequence(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, HEADS, LENGTH, DIM, generator=generator) * 2
    key = torch.randn(1, GROUPS, LENGTH, DIM, generator=generator) * 2
    return query, key


def scattered(key: torch.Tensor, stride: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """The sequence's keys written into a cache of 20 blocks ``stride`` slots apart, in a
    shuffled order, everything else noise."""
    blocks = -(-LENGTH // BLOCK)
    table = torch.randperm(20, generator=torch.Generator().manual_seed(seed))[:blocks].tolist()
    cache = torch.randn(20 * stride + BLOCK, GROUPS, DIM)
    positions = torch.arange(LENGTH)
    cache[slots(table, positions, BLOCK, stride)] = key[0].transpose(0, 1)
    return cache, table


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("stride", [BLOCK, 3 * BLOCK])
def test_paged_rows_are_the_dense_rows(window, softcap, with_sinks, stride):
    query, key = sequence(1)
    cache, table = scattered(key, stride, 2)
    rows = torch.tensor([0, 5, 17, 30, 44])
    sinks = torch.linspace(-2.0, 3.0, HEADS) if with_sinks else None
    kwargs = {"sliding_window": window, "softcap": softcap}
    dense, dense_sink = row_weights(query, key, torch.tensor([0]), rows[None], torch.ones(1, LENGTH, dtype=torch.bool),
                                    0, 0.25, None, kwargs, True, sinks)
    weights, sink = paged_rows(query[0][:, rows], rows, cache, table, BLOCK, 0.25, block_stride=stride, window=window,
                               softcap=softcap, sinks=sinks)
    assert weights.shape == (HEADS, len(rows), 45)  # over the keys up to the last row
    np.testing.assert_allclose(weights.numpy(), dense[0].numpy(), atol=1e-6)
    if with_sinks:
        np.testing.assert_allclose(sink.numpy(), dense_sink[0].numpy(), atol=1e-6)
        assert float(sink.max()) > 0.3
    else:
        assert sink is None and dense_sink is None


def test_a_page_view_and_rows_below_the_end():
    query, key = sequence(3)
    cache, table = scattered(key, BLOCK, 4)
    pages = cache[: 20 * BLOCK].reshape(20, BLOCK, GROUPS, DIM)
    rows = torch.tensor([3, 9])
    weights, _ = paged_rows(query[0][:, rows], rows, pages, table, BLOCK, 0.25)
    assert weights.shape == (HEADS, 2, 10)  # keys 0..9: nothing after the last row is read
    dense, _ = row_weights(query, key, torch.tensor([0]), rows[None], torch.ones(1, LENGTH, dtype=torch.bool), 0, 0.25,
                           None, {}, True, None)
    np.testing.assert_allclose(weights.numpy(), dense[0, :, :, :10].numpy(), atol=1e-6)
    assert float(weights[:, 0, 4:].abs().max()) == 0.0  # causal


def test_rows_over_keys_of_a_ring_buffer_order():
    """Keys in any order (a sliding layer's ring buffer): each row sees its own by position."""
    query, key = sequence(5)
    order = torch.randperm(LENGTH, generator=torch.Generator().manual_seed(6))
    rows = torch.tensor([10, 40])
    weights, _ = rows_over_keys(query[0][:, rows], rows, key[0][:, order], order, 0.25, window=6)
    dense, _ = row_weights(query, key, torch.tensor([0]), rows[None], torch.ones(1, LENGTH, dtype=torch.bool), 0, 0.25,
                           None, {"sliding_window": 6}, True, None)
    np.testing.assert_allclose(weights[:, :, torch.argsort(order)].numpy(), dense[0].numpy(), atol=1e-6)


def test_bad_input_is_refused_clearly():
    query, key = sequence(7)
    cache, table = scattered(key, BLOCK, 8)
    with pytest.raises(ValueError, match="beyond the 6 blocks"):
        paged_rows(query[0][:, :1], torch.tensor([60]), cache, table, BLOCK, 0.25)
    with pytest.raises(ValueError, match="cannot share"):
        rows_over_keys(torch.zeros(3, 1, DIM), torch.tensor([0]), torch.zeros(2, 1, DIM), torch.tensor([0]), 1.0)
