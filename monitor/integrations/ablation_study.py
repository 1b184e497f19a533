"""``attention-monitor study``: a controlled head-ablation study of a transformers model,
the evidence the policy asks for before anyone says what a head does.

Protocol, in this order, for every checkpoint (or revision) given and every seed:

1. the task metric on the unablated model, every example (the reference population);
2. a split of the evaluation set, with the seed, into a selection part (whose head
   outputs give the means that mean ablation substitutes, and the output norms that
   magnitude matching uses) and a held-out part the choice of heads never saw;
3. on the held-out part: each head set under study ablated, and each of its heads
   alone; for each, ``controls`` random head sets of the same size and layer mix and
   ``controls`` magnitude-matched sets;
4. bootstrap intervals over held-out examples and the verdict
   (:mod:`monitor.study.verdict`): ``ESTABLISHED`` only when every repeat agrees.

Ablation runs through the attention wrapper of the tap
(:class:`~monitor.integrations.ablation.HeadAblation`). Scores of every intervention are
appended to ``cache_dir/scores.jsonl`` as they are computed, so an interrupted study
resumes where it stopped. Never a recommendation to prune.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from monitor.core.policy import policy_fields
from monitor.integrations.ablation import HeadAblation, Mode
from monitor.integrations.hf_contract import contract_from_config, model_revision
from monitor.study.design import Head, head_name, magnitude_controls, random_controls, split
from monitor.study.verdict import LEVEL, HeadSetResult, Interval, bootstrap, judge

Rows = list[dict[str, Any]]
Metric = Callable[[Any, Any, Rows], list[float]]  #: (model, tokenizer, examples) → a score per example


# --- the evaluation set --------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSet:
    path: str
    rows: Rows
    content_id: str  #: sha256 of the file's bytes

    @classmethod
    def load(cls, path: Path) -> EvalSet:
        data = path.read_bytes()
        rows = []
        for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc.msg}") from exc
            if not isinstance(row, dict) or not ({"text", "input_ids"} & row.keys()):
                raise ValueError(f"{path}:{number}: an example is an object with 'text' or 'input_ids'")
            rows.append(row)
        if len(rows) < 4:
            raise ValueError(f"{path}: {len(rows)} examples; a study needs at least 4 (two per split)")
        return cls(str(path), rows, "sha256:" + hashlib.sha256(data).hexdigest())


# --- task metrics (higher is better) -------------------------------------------------------


def _padded(rows: Rows, tokenizer: Any, field_name: str = "text") -> dict[str, torch.Tensor]:
    if all("input_ids" in r for r in rows):
        length = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask}
    if tokenizer is None:
        raise ValueError("examples with 'text' need the model's tokenizer")
    encoded = tokenizer([r[field_name] for r in rows], padding=True, truncation=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def accuracy(model: Any, tokenizer: Any, rows: Rows) -> list[float]:
    """Sequence classification: 1 when the arg-max class is the example's ``label``."""
    logits = model(**_padded(rows, tokenizer)).logits
    return [float(int(p) == int(r["label"])) for p, r in zip(logits.argmax(-1).tolist(), rows, strict=True)]


def loglik(model: Any, tokenizer: Any, rows: Rows) -> list[float]:
    """Causal language modelling: mean log-probability of the scored tokens, each given
    the ones before it; ``labels`` (as in transformers: -100 = not scored) choose them,
    otherwise every token after the first."""
    batch = _padded(rows, tokenizer)
    logp = torch.log_softmax(model(**batch).logits.float(), dim=-1)
    scores = []
    for i, r in enumerate(rows):
        ids = batch["input_ids"][i]
        real = int(batch["attention_mask"][i].sum())
        labels = torch.tensor(r["labels"]) if "labels" in r else torch.cat((torch.tensor([-100]), ids[1:real]))
        positions = [t for t in range(1, real) if int(labels[t]) != -100]
        if not positions:
            raise ValueError("an example scores no token")
        scores.append(float(np.mean([float(logp[i, t - 1, int(labels[t])]) for t in positions])))
    return scores


def retrieval(model: Any, tokenizer: Any, rows: Rows, temperature: float = 0.05) -> list[float]:
    """Embedding models: log-probability of the ``label``-th of ``candidates`` under a
    softmax of cosine similarities (mean-pooled last hidden states) to ``text``."""
    def embed(texts: list[str]) -> torch.Tensor:
        encoded = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        hidden = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"][:, :, None].to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    unique = sorted({t for r in rows for t in (r["text"], *r["candidates"])})
    index = {t: i for i, t in enumerate(unique)}
    vectors = embed(unique)  # every distinct text of the batch once, in one forward pass
    scores = []
    for r in rows:
        query, candidates = vectors[index[r["text"]]], vectors[[index[c] for c in r["candidates"]]]
        logits = (candidates @ query) / temperature
        scores.append(float(torch.log_softmax(logits, dim=0)[int(r["label"])]))
    return scores


METRICS: dict[str, Metric] = {"accuracy": accuracy, "loglik": loglik, "retrieval": retrieval}


def load_metric(name: str) -> Metric:
    """A built-in metric, or ``package.module:function`` (called as ``function(model,
    tokenizer, examples)`` and returning a score per example, higher is better)."""
    if name in METRICS:
        return METRICS[name]
    if ":" not in name:
        raise ValueError(f"metric {name!r}: one of {', '.join(METRICS)}, or module:function")
    module, function = name.split(":", 1)
    found = getattr(importlib.import_module(module), function, None)
    if not callable(found):
        raise ValueError(f"metric {name!r}: {module} has no function {function}")
    return found  # type: ignore[no-any-return]


#: the transformers class a built-in metric needs (a custom metric gets AutoModel)
MODEL_CLASSES = {"accuracy": "AutoModelForSequenceClassification", "loglik": "AutoModelForCausalLM",
                 "retrieval": "AutoModel"}


def load_models(paths: Sequence[str], metric: str, needs_tokenizer: bool) -> tuple[list[tuple[str, Any]], Any]:
    """Each model directory (or cached hub id) as ``(name, model)``, and the first one's
    tokenizer (None when it has none and ``needs_tokenizer`` is false)."""
    import transformers

    loader = getattr(transformers, MODEL_CLASSES.get(metric, "AutoModel"))
    checkpoints, tokenizer = [], None
    for path in paths:
        try:
            checkpoints.append((Path(path).name or path, loader.from_pretrained(path)))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load {path} as {loader.__name__}: {exc}") from exc
        if tokenizer is None:
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError) as exc:
                if needs_tokenizer:
                    raise ValueError(f"examples with 'text' need a tokenizer, and {path} has none: {exc}") from exc
    return checkpoints, tokenizer


# --- the study -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyConfig:
    head_sets: tuple[tuple[Head, ...], ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    mode: Mode = "mean"
    controls: int = 20  #: draws per control family
    pool: int = 3  #: magnitude matching picks among this many nearest heads
    holdout: float = 0.5
    resamples: int = 2000
    batch_size: int = 16

    def units(self) -> list[tuple[Head, ...]]:
        """Each head set, then each of its heads alone (once)."""
        out: list[tuple[Head, ...]] = []
        for heads in self.head_sets:
            for unit in (tuple(sorted(heads)), *((h,) for h in sorted(heads))):
                if unit not in out:
                    out.append(unit)
        return out


@dataclass
class StudyResult:
    models: list[dict[str, Any]]
    eval_set: dict[str, Any]
    metric: str
    config: StudyConfig
    baselines: dict[str, Interval] = field(default_factory=dict)
    results: list[HeadSetResult] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "schema": "attention-study/1",
            "models": self.models,
            "eval_set": self.eval_set,
            "metric": self.metric,
            "protocol": {"mode": c.mode, "seeds": list(c.seeds), "controls": c.controls, "pool": c.pool,
                         "holdout": c.holdout, "resamples": c.resamples, "level": LEVEL,
                         "control_quantile": 0.975},
            "baselines": {name: vars(i) for name, i in self.baselines.items()},
            "head_sets": [r.to_dict() for r in self.results],
            "seconds": round(self.seconds, 1),
            "policy": policy_fields(),
        }


class _Scores:
    """Per-example scores of every (checkpoint, seed, intervention), appended to a JSONL
    file as they come, so a study resumes."""

    def __init__(self, directory: Path | None):
        self.path = None if directory is None else directory / "scores.jsonl"
        self.known: dict[str, list[float]] = {}
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    doc = json.loads(line)
                    self.known[doc["key"]] = doc["scores"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by a crash: computed again
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def get(self, key: str, compute: Callable[[], list[float]]) -> np.ndarray:
        if key not in self.known:
            self.known[key] = compute()
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps({"key": key, "scores": self.known[key]}) + "\n")
        return np.asarray(self.known[key], dtype=np.float64)


def layout(model: Any) -> dict[int, int]:
    """Heads per layer, from the model's contract."""
    contract = contract_from_config(model.config, "study", "study")
    return {layer.layer: len(layer.heads) for layer in contract.layers}


def run_study(checkpoints: Sequence[tuple[str, Any]], tokenizer: Any, evalset: EvalSet, metric_name: str,
              config: StudyConfig, *, metric: Metric | None = None, cache_dir: Path | None = None,
              progress: bool = True) -> StudyResult:
    """Run the protocol on every ``(name, model)`` of ``checkpoints`` (repeats across
    checkpoints or revisions) and every seed of ``config``."""
    started = time.monotonic()
    score = metric or load_metric(metric_name)
    scores = _Scores(cache_dir)
    units = config.units()
    result = StudyResult([], {"path": evalset.path, "content_id": evalset.content_id,
                              "examples": len(evalset.rows)}, metric_name, config)
    by_unit = {unit: HeadSetResult([head_name(h) for h in unit]) for unit in units}
    per_repeat = len(units) * (1 + 2 * config.controls)
    bar = tqdm(total=len(checkpoints) * len(config.seeds) * per_repeat, desc="ablations", unit="ablation",
               disable=not progress)
    for name, model in checkpoints:
        heads = layout(model)
        for unit in units:
            for layer, head in unit:
                if layer not in heads or not 0 <= head < heads[layer]:
                    raise ValueError(f"head {layer}.{head} is not in {name} ({len(heads)} layers)")
        revision = model_revision(model)
        result.models.append({"name": name, "model_id": getattr(model.config, "name_or_path", "") or name,
                              "revision": revision, "config": type(model.config).__name__})
        model.eval()
        ablation = HeadAblation(model)
        try:
            with torch.no_grad():
                run = _Run(model, tokenizer, evalset.rows, score, config, ablation, scores, f"{revision}")
                baseline = run.evaluate("baseline", range(len(evalset.rows)), None)
                result.baselines[name] = bootstrap(baseline, config.resamples, np.random.default_rng(0))
                for seed in config.seeds:
                    run.repeat(name, seed, baseline, heads, units, by_unit, bar)
        finally:
            ablation.restore()
    bar.close()
    result.results = [by_unit[u] for u in units]
    result.seconds = time.monotonic() - started
    return result


@dataclass
class _Run:
    model: Any
    tokenizer: Any
    rows: Rows
    score: Metric
    config: StudyConfig
    ablation: HeadAblation
    scores: _Scores
    checkpoint: str

    def evaluate(self, key: str, indices: Sequence[int] | np.ndarray, heads: tuple[Head, ...] | None) -> np.ndarray:
        index = [int(i) for i in indices]

        def compute() -> list[float]:
            out: list[float] = []
            for start in range(0, len(index), self.config.batch_size):
                batch = [self.rows[i] for i in index[start:start + self.config.batch_size]]
                if heads is None:
                    out += self.score(self.model, self.tokenizer, batch)
                else:
                    with self.ablation.ablating(heads, self.config.mode):
                        out += self.score(self.model, self.tokenizer, batch)
            if len(out) != len(index) or not all(math.isfinite(v) for v in out):
                raise ValueError("the metric must return one finite score per example")
            return out

        return self.scores.get(f"{self.checkpoint}/{key}", compute)

    def repeat(self, name: str, seed: int, baseline: np.ndarray, heads: dict[int, int],
               units: list[tuple[Head, ...]], by_unit: dict[tuple[Head, ...], HeadSetResult], bar: Any) -> None:
        rng = np.random.default_rng([seed, 0])
        selection, held = split(len(self.rows), self.config.holdout, rng)
        self.ablation.reset()
        with self.ablation.observing():  # the selection part: the means and norms of every head
            for start in range(0, len(selection), self.config.batch_size):
                self.score(self.model, self.tokenizer,
                           [self.rows[int(i)] for i in selection[start:start + self.config.batch_size]])
        sums = self.ablation.snapshot()
        self.ablation.use_means(sums)
        norms = {(layer, h): float(norm[h]) / max(tokens, 1.0)
                 for layer, (_, norm, tokens) in sums.items() for h in range(heads[layer])}
        base = baseline[held]
        for unit in units:
            tag = f"seed-{seed}/{self.config.mode}"
            drop = base - self.evaluate(f"{tag}/{_key(unit)}", held, unit)
            bar.update(1)
            controls = {}
            for family, draws in (("random", random_controls(unit, heads, self.config.controls, rng)),
                                  ("magnitude", magnitude_controls(unit, norms, self.config.controls, rng,
                                                                   self.config.pool))):
                drops = []
                for draw in draws:
                    drops.append(base - self.evaluate(f"{tag}/{_key(draw)}", held, draw))
                    bar.update(1)
                controls[family] = (np.stack(drops), [[head_name(h) for h in d] for d in draws])
            by_unit[unit].repeats.append(judge(name, seed, base, drop, controls, self.config.resamples,
                                               np.random.default_rng([seed, 1, len(unit)])))


def _key(heads: tuple[Head, ...]) -> str:
    return "+".join(head_name(h) for h in sorted(heads))
