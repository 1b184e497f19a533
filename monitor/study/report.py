"""A study's HTML report: one self-contained page (inline SVG, no script, no external
asset) with, per head set, its verdict in the policy's words and the ablation effect
with its interval in every repeat beside the control draws' effects; model identities
and the evaluation set's content id."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from monitor.core.policy import NOT_PRUNING, SPECIALIZATION

_ENV = Environment(loader=PackageLoader("monitor.study", "templates"), autoescape=select_autoescape(),
                   trim_blocks=True, lstrip_blocks=True)
STYLE: Any = {"svg.fonttype": "none", "font.size": 9, "svg.hashsalt": "attention-monitor"}


def effects_chart(head_set: dict[str, Any]) -> str:
    """Per repeat: the set's drop with its interval, and every control draw's drop."""
    repeats = head_set["repeats"]
    with plt.rc_context(STYLE):
        figure, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(repeats) + 2), 3.0), layout="constrained")
        for x, repeat in enumerate(repeats):
            for offset, control, color in ((-0.18, "random", "#7f8c8d"), (0.18, "magnitude", "#2980b9")):
                found = [c for c in repeat["controls"] if c["family"] == control]
                if found:
                    ax.scatter([x + offset] * len(found[0]["effects"]), found[0]["effects"], s=9, color=color,
                               alpha=0.6, label=f"{control} controls" if x == 0 else None)
                    ax.hlines(found[0]["upper"], x + offset - 0.12, x + offset + 0.12, color=color, linewidth=1.5)
            effect = repeat["effect"]
            ax.errorbar([x], [effect["mean"]], yerr=[[effect["mean"] - effect["lo"]], [effect["hi"] - effect["mean"]]],
                        fmt="o", color="#c0392b", capsize=4, label="heads under study" if x == 0 else None)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(repeats)), [f"{r['checkpoint']}\nseed {r['seed']}" for r in repeats])
        ax.set_ylabel("drop of the task metric")
        ax.legend(loc="best", fontsize=7)
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg", metadata={"Date": None})
        plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def render(result: dict[str, Any]) -> str:
    """The report of a study result (``StudyResult.to_dict()``)."""
    charts = {i: Markup(effects_chart(s)) for i, s in enumerate(result["head_sets"])}
    return _ENV.get_template("report.html.j2").render(result=result, charts=charts, not_pruning=NOT_PRUNING,
                                                      specialization=SPECIALIZATION)
