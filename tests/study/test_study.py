"""The head-ablation study on transformers' own GPT-2 with hand-set weights: the head
the task needs is established and no other, a model where no head matters establishes
nothing, verdicts hold across seeds, intervals shrink with more examples, an
interrupted study resumes, and the command line writes its result and report."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from monitor.integrations.ablation_study import EvalSet, StudyConfig, loglik, run_study
from monitor.study.design import magnitude_controls, parse_heads, random_controls, split
from monitor.study.verdict import ESTABLISHED, NOT_ESTABLISHED
from tests.study.copy_model import build, examples

pytestmark = pytest.mark.models

SINGLE_HEADS = tuple(((0, h),) for h in range(4))
FAST = {"controls": 8, "resamples": 400}


def evalset(tmp_path, n: int, seed: int = 0) -> EvalSet:
    path = tmp_path / f"eval-{n}-{seed}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in examples(n, seed)))
    return EvalSet.load(path)


def study(model, data, **overrides):
    config = StudyConfig(**{"head_sets": SINGLE_HEADS, "seeds": (0, 1, 2), **FAST, **overrides})
    return run_study([("copy-gpt2", model)], None, data, "loglik", config, progress=False)


def test_the_head_the_task_needs_is_established_and_no_other_across_three_seeds(tmp_path):
    result = study(build(), evalset(tmp_path, 60))
    verdicts = {r.heads[0]: r.verdict for r in result.results}
    assert verdicts == {"0.0": ESTABLISHED, "0.1": NOT_ESTABLISHED, "0.2": NOT_ESTABLISHED, "0.3": NOT_ESTABLISHED}
    copy = result.results[0]
    assert [r.seed for r in copy.repeats] == [0, 1, 2] and all(r.established for r in copy.repeats)
    for repeat in copy.repeats:  # its controls do not reach it: they are the other heads
        assert {c.family for c in repeat.controls} == {"random", "magnitude"}
        assert all("0.0" not in draw for c in repeat.controls for draw in c.draws)
        assert all(c.upper < repeat.effect.lo for c in repeat.controls)
    for other in result.results[1:]:
        assert all(not r.established for r in other.repeats)
        assert "does not exclude zero" in other.reasons[0] or "does not exceed" in other.reasons[0]
    doc = result.to_dict()
    assert doc["eval_set"]["content_id"].startswith("sha256:") and doc["models"][0]["revision"]
    assert "pruning" in doc["policy"]["alerts"] and "ablation" in doc["policy"]["specialization"]


def test_a_model_where_no_head_matters_establishes_nothing(tmp_path):
    result = study(build(copy_head_useful=False), evalset(tmp_path, 60))
    assert [r.verdict for r in result.results] == [NOT_ESTABLISHED] * 4


def test_intervals_shrink_as_examples_are_added(tmp_path):
    widths = []
    for n in (40, 320):
        result = study(build(), evalset(tmp_path, n), head_sets=(((0, 0),),), seeds=(0,))
        widths.append(result.results[0].repeats[0].effect.width)
    assert widths[1] < 0.6 * widths[0], widths  # ~1/sqrt(8) expected


def test_an_interrupted_study_resumes_from_its_scores(tmp_path):
    data = evalset(tmp_path, 40)
    calls = []

    def counted(model, tokenizer, rows):
        calls.append(len(rows))
        return loglik(model, tokenizer, rows)

    config = StudyConfig(head_sets=(((0, 0), (0, 1)),), seeds=(0,), **FAST)
    first = run_study([("m", build())], None, data, "loglik", config, metric=counted, cache_dir=tmp_path / "s",
                      progress=False)
    done = sum(calls)
    calls.clear()
    again = run_study([("m", build())], None, data, "loglik", config, metric=counted, cache_dir=tmp_path / "s",
                      progress=False)
    assert sum(calls) == 20  # only the selection split, observed again for the means; every ablation was kept
    assert done > 4 * sum(calls)
    assert again.to_dict()["head_sets"] == first.to_dict()["head_sets"]
    assert [r.heads for r in again.results] == [["0.0", "0.1"], ["0.0"], ["0.1"]]  # the set, then each head alone


def test_the_command_line_writes_a_result_and_a_report(tmp_path):
    model_dir = tmp_path / "copy-gpt2"
    build().save_pretrained(model_dir)
    data = evalset(tmp_path, 40)
    out = tmp_path / "study"
    done = subprocess.run([sys.executable, "-m", "monitor", "study", str(model_dir), "--eval", data.path,
                           "--metric", "loglik", "--heads", "0:head-0", "--heads", "0.2", "--seeds", "0,1",
                           "--controls", "5", "--resamples", "300", "--output", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "0.0: ESTABLISHED" in done.stdout and "0.2: NOT_ESTABLISHED" in done.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["schema"] == "attention-study/1" and result["protocol"]["seeds"] == [0, 1]
    html = (out / "report.html").read_text()
    assert html.count("data-verdict") == 2 and "<svg" in html and "<script" not in html
    assert "never a recommendation to remove" in html
    bad = subprocess.run([sys.executable, "-m", "monitor", "study", str(model_dir), "--eval", data.path,
                          "--heads", "0.9", "--metric", "loglik", "--output", str(tmp_path / "bad"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "head 0.9 is not in" in bad.stderr


def test_heads_parse_and_controls_keep_size_layer_mix_and_magnitude():
    assert parse_heads("2.3, 2:head-4 5.0") == ((2, 3), (2, 4), (5, 0))
    for wrong in ("2", "a.b", "2.3,2.3", ""):
        with pytest.raises(ValueError):
            parse_heads(wrong)
    rng = np.random.default_rng(0)
    target = ((0, 1), (0, 2), (3, 0))
    for draw in random_controls(target, {0: 8, 3: 4}, 50, rng):
        assert sorted(layer for layer, _ in draw) == [0, 0, 3] and not set(draw) & set(target)
    norms = {(0, h): float(2**h) for h in range(8)}
    for draw in magnitude_controls(((0, 4),), norms, 30, rng, pool=2):
        assert draw[0] in {(0, 3), (0, 5)}
    selection, held = split(10, 0.5, rng)
    assert len(held) == 5 and not set(selection) & set(held) and len(selection) + len(held) == 10
