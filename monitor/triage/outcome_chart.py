"""The outcomes' chart on the triage page: each group's failure rate as a dot on its 95 %
interval, the two contrasts one above the other on one scale, so that whether the
intervals overlap is seen at a glance. Plain SVG written here (a few lines and labels;
no plotting library needed)."""

from __future__ import annotations

import math
from html import escape

from monitor.triage.outcomes import Group, Outcomes

WIDTH, LABEL, ROW, PAD = 760, 300, 24, 14
COLOURS = {"group": "#c0392b", "baseline": "#2c6fbb"}


def intervals(outcomes: Outcomes) -> str:
    """The SVG (empty when no group has a known outcome)."""
    rows: list[tuple[str, Group, str]] = []
    for contrast, tag in ((outcomes.revision, "revision"), (outcomes.anomalous, "anomalous")):
        if contrast is None:
            continue
        rows.append((tag, contrast.group, "group"))
        if contrast.baseline is not None:
            rows.append((tag, contrast.baseline, "baseline"))
    rows = [r for r in rows if r[1].rate.joined]
    if not rows:
        return ""
    top = max(r[1].rate.interval[1] for r in rows)
    step = 0.1 if top > 0.4 else 0.05 if top > 0.15 else 0.02
    scale = min(1.0, step * math.ceil(max(top, step) / step + 1e-9))  # the upper bounds, up to a tick
    plot = WIDTH - LABEL - PAD

    def x(value: float) -> float:
        return LABEL + plot * min(value, scale) / scale

    height = PAD + ROW * len(rows) + 30
    parts = [f'<svg id="outcome-intervals" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
             f'width="{WIDTH}" height="{height}" role="img" aria-label="failure rates with 95 % intervals">']
    for tick in range(round(scale / step) + 1):
        value = step * tick
        parts.append(f'<line x1="{x(value):.1f}" x2="{x(value):.1f}" y1="{PAD - 6}" y2="{height - 24}" '
                     f'stroke="#e3e6eb"/><text x="{x(value):.1f}" y="{height - 10}" font-size="11" '
                     f'text-anchor="middle" fill="#5b6472">{value:.2f}</text>')
    previous = None
    for i, (tag, group, side) in enumerate(rows):
        y = PAD + ROW * i + ROW / 2
        if previous is not None and tag != previous:
            parts.append(f'<line x1="0" x2="{WIDTH}" y1="{y - ROW / 2:.1f}" y2="{y - ROW / 2:.1f}" '
                         'stroke="#9aa3af" stroke-dasharray="4 3"/>')
        previous = tag
        low, high = group.rate.interval
        colour = COLOURS[side]
        parts.append(
            f'<g id="interval-{tag}-{side}"><text x="{LABEL - 8}" y="{y + 4:.1f}" font-size="12" text-anchor="end" '
            f'fill="#1d2330">{escape(group.name)}</text>'
            f'<line x1="{x(low):.1f}" x2="{x(high):.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" '
            f'stroke-width="3"/><circle cx="{x(group.rate.value):.1f}" cy="{y:.1f}" r="5" fill="{colour}"/></g>')
    parts.append("</svg>")
    return "".join(parts)
