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
    cache[slots(table, LENGTH, BLOCK, block_stride=stride)] = key[0].transpose(0, 1)
    return cache, table


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("stride", [BLOCK, 3 * BLOCK])
@pytest.mark.parametrize("positions", [[0, 5, 17, 30, 44], [44]])  # prompt rows; one decoding step (no mask built)
def test_paged_rows_are_the_dense_rows(window, softcap, with_sinks, stride, positions):
    query, key = sequence(1)
    cache, table = scattered(key, stride, 2)
    rows = torch.tensor(positions)
    sinks = torch.linspace(-2.0, 3.0, HEADS) if with_sinks else None
    kwargs = {"sliding_window": window, "softcap": softcap}
    dense, dense_sink = row_weights(query, key, torch.tensor([0]), rows[None], torch.ones(1, LENGTH, dtype=torch.bool),
                                    0, 0.25, None, kwargs, True, sinks)
    weights, sink = paged_rows(query[0][:, rows], rows.tolist(), cache, torch.tensor(table, dtype=torch.int32), BLOCK,
                               0.25, block_stride=stride, window=window, softcap=softcap, sinks=sinks)
    assert weights.shape == (HEADS, len(rows), 45)  # over the keys up to the last row
    np.testing.assert_allclose(weights.numpy(), dense[0].numpy(), atol=1e-6)
    if with_sinks:
        np.testing.assert_allclose(sink.numpy(), dense_sink[0].numpy(), atol=1e-6)
        assert float(sink.max()) > 0.3 or positions == [44]  # row 0's few keys leave the sink much
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
        paged_rows(query[0][:, :1], [60], cache, table, BLOCK, 0.25)
    with pytest.raises(ValueError, match="beyond the 6 blocks"):  # a device table's length is a shape: no read back
        paged_rows(query[0][:, :1], [48], cache, torch.tensor(table), BLOCK, 0.25)
    with pytest.raises(ValueError, match="at least one query row"):
        paged_rows(query[0][:, :0], [], cache, table, BLOCK, 0.25)
    with pytest.raises(ValueError, match="cannot share"):
        rows_over_keys(torch.zeros(3, 1, DIM), torch.tensor([0]), torch.zeros(2, 1, DIM), torch.tensor([0]), 1.0)


def test_slots_of_a_range_in_both_layouts():
    table = [5, 2, 9]
    assert slots(table, 20, 8).tolist() == [40 + p for p in range(8)] + [16 + p for p in range(8)] + \
        [72 + p for p in range(4)]
    assert slots(table, 19, 8, start=17, block_stride=24).tolist() == [9 * 24 + 1, 9 * 24 + 2]
    assert slots(torch.tensor(table, dtype=torch.int32), 3, 8).dtype == torch.long
    with pytest.raises(ValueError, match="not a range"):
        slots(table, 2, 8, start=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a device synchronisation only exists there")
def test_no_device_synchronisation_on_a_gpu():
    """Keys, block table and query on the GPU, positions on the host: under
    ``set_sync_debug_mode("error")`` any read back from the device raises."""
    query, key = sequence(9)
    cache, table = scattered(key, 3 * BLOCK, 10)
    device = torch.device("cuda")
    rows = [4, 20, 44]
    dense, _ = paged_rows(query[0][:, rows], rows, cache, table, BLOCK, 0.25, block_stride=3 * BLOCK, window=7)
    q, cache, table_on_gpu = query[0][:, rows].to(device), cache.to(device), torch.tensor(table, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weights, _ = paged_rows(q, rows, cache, table_on_gpu, BLOCK, 0.25, block_stride=3 * BLOCK, window=7)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    np.testing.assert_allclose(weights.cpu().numpy(), dense.numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="on the host"):
        paged_rows(q, torch.tensor(rows, device=device), cache, table_on_gpu, BLOCK, 0.25)
