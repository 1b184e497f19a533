"""``attention-monitor triage``: what the recent incidents of a model and their anomaly
records say, for on-call. Reads the tail of ``attention-anomalies``; never touches
weights."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from statistics import median
from typing import Any

from monitor.core.policy import NOT_PRUNING, SPECIALIZATION
from monitor.triage import outcomes
from monitor.triage.evidence import Case
from monitor.triage.generation import LayerRows


def select(records: Iterable[dict[str, Any]], model: str | None, revision: str | None, layer: int | None,
           kind: str | None) -> list[dict[str, Any]]:
    return [r for r in records if r.get("schema", "").startswith("attention-anomaly")
            and (model is None or r.get("model_id") == model)
            and (revision is None or r.get("model_revision") == revision)
            and (layer is None or r.get("layer") == layer)
            and (kind is None or r.get("kind") == kind)]


def also_changed(note: dict[str, Any], rows: LayerRows | None = None) -> str:
    """One annotation of an incident: another layer that changed while it was open, and
    what the rows its findings were measured on say (prompt rows, rows of generated tokens)."""
    said = "" if rows is None else (f"; {rows.prompt} on prompt rows, {rows.decoding} on rows of generated tokens: "
                                    + rows.reading(str(note["relation"])))
    findings = max(int(note["findings"]), 0 if rows is None else rows.prompt + rows.decoding + rows.unknown)
    return (f"layer {note['layer']} ({note['relation']}, {findings} findings"
            + (", its evidence alone would have paged" if note.get("paged") else "") + said + ")")


def heads_line(case: Case) -> str:
    """The heads an incident names, as its alert and record name them, with how many of
    its traces' findings name each."""
    if not case.involved:
        named = "none named yet"
    else:
        named = ", ".join(f"{h} ({case.head_counts.get(h, 0)})" for h in case.involved)
    line = f"heads involved: {named} (traces whose findings name each, of {case.evidence_traces})"
    if case.others_named:
        line += "; named by fewer: " + ", ".join(f"{h} ({n})" for h, n in case.others_named.items())
    return line


def incident_lines(cases: list[Case]) -> list[str]:
    """Each incident as its triage page has it: its findings, traces and heads are those
    of its record (:class:`~monitor.triage.evidence.Case`), the page's and the alert's own."""
    lines = [f"{len(cases)} incidents", ""]
    for case in sorted(cases, key=lambda c: float((c.incident or {})["opened_at"])):
        i = case.incident or {}
        strongest = case.strongest[0] if case.strongest else (i.get("strongest") or {})
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted((i.get("kinds") or case.kinds).items())) or "none"
        lines += [
            f"{i['incident_id']}: {i['model_id']} {i['model_revision']} layer {i['layer']} {i['family']}, {i['state']}",
            f"  {i.get('anomalies', len(case.evidence))} findings on {case.evidence_traces} traces against "
            f"{', '.join(case.reference_revisions)} ({kinds})",
            "  " + heads_line(case),
            "  side effects: " + (", ".join(f"{k}={v}" for k, v in sorted(i.get("side_effects", {}).items()))
                                  or "none"),
            "  other layers: " + (", ".join(also_changed(a, case.rows.get(a["layer"]))
                                            for a in i.get("also_changed", [])) or "none"),
        ]
        if strongest:
            lines.append(f"  strongest: {strongest.get('kind')} value {strongest.get('value', 0):.3f} against "
                         f"{strongest.get('reference', 0):.3f}, effect {strongest.get('effect_size', 0):.1f} sd, "
                         f"heads {', '.join(strongest.get('heads', [])) or '-'}, trace {strongest.get('trace_id')}")
        lines += ["  " + line for line in outcomes.describe(case.outcomes)]
        lines.append("")
    return lines


def report(records: list[dict[str, Any]], cases: list[Case] | None = None,
           every: list[dict[str, Any]] | None = None) -> str:
    """Incidents (``cases``), then the anomaly records grouped by layer and kind (their
    outcomes with the late outcome records among ``every`` record read)."""
    late = outcomes.late_outcomes(every or [])
    if not records and not cases:
        return "no incident or anomaly records match\n\nPolicy: " + NOT_PRUNING
    lines = incident_lines(cases) if cases else []
    lines += [f"{len(records)} anomaly records" + (" (the incidents' evidence)" if cases else ""), ""]
    groups = Counter((r["model_id"], r["model_revision"], r["layer"], r["kind"]) for r in records)
    for (model, revision, layer, kind), n in groups.most_common():
        mine = [r for r in records if (r["model_id"], r["model_revision"], r["layer"], r["kind"])
                == (model, revision, layer, kind)]
        heads = Counter(h for r in mine for h in r["heads"])
        said = Counter(str(outcomes.resolved(r, late)["outcome"]) for r in mine)
        refs = sorted({r["reference_revision"] for r in mine})
        contracts = sorted({r["contract_id"] for r in mine})
        lines += [
            f"{model} {revision} layer {layer} {kind}: {n} records",
            f"  value {median(r['value'] for r in mine):.3f} against reference "
            f"{median(r['reference'] for r in mine):.3f} (median; reference revision {', '.join(refs)})",
            f"  effect size median {median(r['effect_size'] for r in mine):.1f} sd",
            "  heads its findings name most: " + ", ".join(f"{h} ({c})" for h, c in heads.most_common(6)),
            "  outcomes: " + ", ".join(f"{o}={c}" for o, c in sorted(said.items())),
            "  contract: " + ", ".join(contracts),
            f"  example: trace {mine[-1]['trace_id']} request {mine[-1]['request_id']}",
            "",
        ]
    lines += ["Policy:", f"  {NOT_PRUNING}", f"  {SPECIALIZATION}",
              "Next: compare with the previous revision's dashboards, check the deploy, and before any claim "
              "about what a head does, gather the task-metric and ablation evidence above."]
    return "\n".join(lines) + "\n"
