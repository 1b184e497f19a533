"""Prompt mass and learned sink mass (monitor.core.generation) against a plain loop, and
their invariants."""

from __future__ import annotations

import numpy as np
import pytest

from monitor.core.generation import learned_sink_mass, prompt_mass


def loop_prompt_mass(weights, valid, positions, prompt_length):
    out = []
    for h in range(weights.shape[0]):
        shares = []
        for r, p in enumerate(positions):
            if p < prompt_length:
                continue
            row = [float(w) if valid[r][k] else 0.0 for k, w in enumerate(weights[h, r])]
            total = sum(row)
            if total > 0:
                shares.append(sum(row[:prompt_length]) / total)
        out.append(sum(shares) / len(shares) if shares else float("nan"))
    return np.array(out)


@pytest.mark.parametrize("seed", range(5))
def test_prompt_mass_is_the_share_of_decoding_rows_on_the_prompt(seed):
    rng = np.random.default_rng(seed)
    heads, keys, prompt_length = 3, 20, 8
    positions = np.array([2, 5, 7, 8, 12, 19])  # three prompt rows, three decoding rows
    valid = np.arange(keys)[None, :] <= positions[:, None]
    weights = rng.random((heads, len(positions), keys)) * valid
    weights /= weights.sum(-1, keepdims=True)
    weights[:, 1] += rng.random((heads, keys)) * ~valid[1]  # weight a row may not see is not counted
    got = prompt_mass(weights, valid, positions, prompt_length)
    np.testing.assert_allclose(got, loop_prompt_mass(weights, valid, positions, prompt_length), rtol=1e-12)
    assert np.all((got >= 0) & (got <= 1))
    # a decoding row on the prompt's keys only gives 1; on the generated ones only, 0
    only_prompt = weights.copy()
    only_prompt[:, 3:, prompt_length:] = 0
    np.testing.assert_allclose(prompt_mass(only_prompt, valid, positions, prompt_length), 1.0)
    only_generated = weights.copy()
    only_generated[:, 4:, :prompt_length] = 0
    only_generated[:, 3] = 0  # a row with no weight says nothing
    np.testing.assert_allclose(prompt_mass(only_generated, valid, positions, prompt_length), 0.0)


def test_a_trace_without_decoding_rows_has_no_prompt_mass_and_bad_input_is_named():
    weights = np.full((2, 3, 4), 0.25)
    valid = np.ones((3, 4), bool)
    assert np.isnan(prompt_mass(weights, valid, np.array([0, 1, 2]), 3)).all()
    with pytest.raises(ValueError, match="disagree"):
        prompt_mass(weights, valid, np.array([0, 1]), 3)
    with pytest.raises(ValueError, match="prompt_length"):
        prompt_mass(weights, valid, np.array([0, 1, 2]), 0)


def test_learned_sink_mass_is_each_heads_mean_over_rows():
    sink = np.array([[0.9, 0.7], [0.0, 0.2]])
    np.testing.assert_allclose(learned_sink_mass(sink), [0.8, 0.1])
    with pytest.raises(ValueError, match=r"\[H, R\]"):
        learned_sink_mass(np.zeros(3))
