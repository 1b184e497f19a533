"""``attention-monitor triage``: what the recent anomaly records of a model say, for
on-call. Reads the tail of ``attention-anomalies``; never touches weights."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from statistics import median
from typing import Any

from monitor.core.policy import NOT_PRUNING, SPECIALIZATION


def select(records: Iterable[dict[str, Any]], model: str | None, revision: str | None, layer: int | None,
           kind: str | None) -> list[dict[str, Any]]:
    return [r for r in records if r.get("schema", "").startswith("attention-anomaly")
            and (model is None or r.get("model_id") == model)
            and (revision is None or r.get("model_revision") == revision)
            and (layer is None or r.get("layer") == layer)
            and (kind is None or r.get("kind") == kind)]


def report(records: list[dict[str, Any]]) -> str:
    if not records:
        return "no anomaly records match\n\nPolicy: " + NOT_PRUNING
    lines = [f"{len(records)} anomaly records", ""]
    groups = Counter((r["model_id"], r["model_revision"], r["layer"], r["kind"]) for r in records)
    for (model, revision, layer, kind), n in groups.most_common():
        mine = [r for r in records if (r["model_id"], r["model_revision"], r["layer"], r["kind"])
                == (model, revision, layer, kind)]
        heads = Counter(h for r in mine for h in r["heads"])
        outcomes = Counter(r["outcome"] for r in mine)
        refs = sorted({r["reference_revision"] for r in mine})
        contracts = sorted({r["contract_id"] for r in mine})
        lines += [
            f"{model} {revision} layer {layer} {kind}: {n} records",
            f"  value {median(r['value'] for r in mine):.3f} against reference "
            f"{median(r['reference'] for r in mine):.3f} (median; reference revision {', '.join(refs)})",
            f"  effect size median {median(r['effect_size'] for r in mine):.1f} sd",
            "  heads most involved: " + ", ".join(f"{h} ({c})" for h, c in heads.most_common(6)),
            "  outcomes: " + ", ".join(f"{o}={c}" for o, c in sorted(outcomes.items())),
            "  contract: " + ", ".join(contracts),
            f"  example: trace {mine[-1]['trace_id']} request {mine[-1]['request_id']}",
            "",
        ]
    lines += ["Policy:", f"  {NOT_PRUNING}", f"  {SPECIALIZATION}",
              "Next: compare with the previous revision's dashboards, check the deploy, and before any claim "
              "about what a head does, gather the task-metric and ablation evidence above."]
    return "\n".join(lines) + "\n"
