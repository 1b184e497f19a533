"""The triage page's charts, drawn by matplotlib as inline SVG (text kept as text, so
head labels stay readable and searchable; no external fonts or images).

Heatmaps: the trace's head-similarity matrix, the reference's mean matrix and their
difference, head ids on both axes, the cells between involved heads outlined (each
outline an SVG group ``involved-<head>-<head>``). Timelines, as small multiples (a row
per head, a column per metric): each involved head's entropy, concentration and sink
share on its anomalous traces, against its reference band (mean ± 2 sd at the trace's
length). The page scales every chart to its width (``base.html.j2``)."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; before pyplot is imported

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from monitor.triage.evidence import Point

STYLE: Any = {"svg.fonttype": "none", "font.size": 9, "svg.hashsalt": "attention-monitor"}
LABELS = {"entropy": "entropy (normalised)", "concentration": "concentration", "sink_share": "sink share",
          "learned_sink": "learned sink mass", "prompt_mass": "prompt mass (decoding rows)"}


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline: no XML prolog or DOCTYPE


def heatmaps(evidence: dict[str, Any], involved: list[str]) -> str:
    """Now, reference and difference, side by side (the reference panels say so when the
    reference has no mean matrix)."""
    heads = list(evidence["heads"])
    now = _matrix(evidence["similarity"])
    reference = None if evidence.get("reference_similarity") is None else _matrix(evidence["reference_similarity"])
    panels = [("this trace", now, "viridis", (0.0, 1.0))]
    if reference is not None and reference.shape == now.shape:
        diff = now - reference
        limit = max(float(np.nanmax(np.abs(diff))) if np.isfinite(diff).any() else 0.0, 0.05)
        panels += [("reference (mean)", reference, "viridis", (0.0, 1.0)),
                   ("difference (trace − reference)", diff, "RdBu_r", (-limit, limit))]
    size = max(2.6, 0.22 * len(heads) + 1.4)
    with plt.rc_context(STYLE):
        figure, axes = plt.subplots(1, len(panels), figsize=((size + 0.8) * len(panels), size), squeeze=False,
                                    layout="constrained")
        for ax, (title, matrix, cmap, (lo, hi)) in zip(axes[0], panels, strict=True):
            image = ax.imshow(np.ma.masked_invalid(matrix), cmap=cmap, vmin=lo, vmax=hi)
            image.set_gid(f"heatmap-{title.split()[0]}")
            ax.set_title(title)
            ax.set_xticks(range(len(heads)), heads, rotation=90)
            ax.set_yticks(range(len(heads)), heads)
            for label in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
                if label.get_text() in involved:
                    label.set_fontweight("bold")
                    label.set_color("#c0392b")
            _outline(ax, heads, involved)
            figure.colorbar(image, ax=ax, shrink=0.8)
        if reference is None:
            axes[0][0].set_xlabel("the reference holds no mean matrix (learnt before it was recorded)")
        return _svg(figure)


def _matrix(rows: list[list[float | None]]) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=np.float64)


def _outline(ax: Any, heads: list[str], involved: list[str]) -> None:
    """A box around each cell whose two heads are both involved (off the diagonal)."""
    index = [heads.index(h) for h in involved if h in heads]
    for i in index:
        for j in index:
            if i != j:
                box = Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#c0392b", linewidth=1.6)
                box.set_gid(f"involved-{heads[i]}-{heads[j]}")
                ax.add_patch(box)


def timelines(series: dict[str, dict[str, list[Point]]]) -> str:
    """Small multiples: one row per head, one column per metric; in each panel the head's
    values on its anomalous traces against its own reference band, so no head's band
    hides another's. Each panel is an SVG group ``timeline-<head>-<metric>``."""
    metrics = [m for m in series if series[m]]
    heads = sorted({head for m in metrics for head in series[m]}, key=_head_order)
    with plt.rc_context(STYLE):
        rows, columns = max(len(heads), 1), max(len(metrics), 1)
        figure, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 1.45 * rows + 0.6), sharex=True,
                                    squeeze=False, layout="constrained")
        for row, head in enumerate(heads):
            for column, metric in enumerate(metrics):
                ax = axes[row][column]
                ax.set_gid(f"timeline-{head}-{metric}")
                points = series[metric].get(head, [])
                at = [datetime.fromtimestamp(p.at, UTC) for p in points]
                mean = np.array([p.mean for p in points])
                sd = np.array([p.sd for p in points])
                ax.fill_between(at, mean - 2 * sd, mean + 2 * sd, color="#1f77b4", alpha=0.18, linewidth=0)
                ax.plot(at, [p.value for p in points], marker="o", markersize=3, color="#c0392b")
                if row == 0:
                    ax.set_title(LABELS.get(metric, metric))
                if column == 0:
                    ax.set_ylabel(head, rotation=0, ha="right", va="center", fontweight="bold")
                locator = time_locator()
                ax.xaxis.set_major_locator(locator)
                ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
                ax.tick_params(labelsize=7)
        if not heads or not metrics:
            axes[0][0].text(0.5, 0.5, "no per-head evidence in the records", ha="center", va="center")
            axes[0][0].set_axis_off()
        figure.supxlabel("detected at (UTC); red: the head's value on each anomalous trace; blue: its reference "
                         "mean ± 2 sd at that trace's length", fontsize=8)
        return _svg(figure)


#: tick intervals per unit: enough multiples that any span of an incident (a second to
#: weeks) gets 2–4 ticks (matplotlib's own lists leave gaps, where it warns that it
#: could not pick an interval)
TICK_INTERVALS = {mdates.SECONDLY: [1, 2, 5, 10, 15, 20, 30, 60, 120],
                  mdates.MINUTELY: [1, 2, 5, 10, 15, 20, 30, 60, 120],
                  mdates.HOURLY: [1, 2, 3, 4, 6, 8, 12, 24, 48],
                  mdates.DAILY: [1, 2, 3, 4, 7, 14, 21, 28, 56]}


def time_locator() -> mdates.AutoDateLocator:
    """A date locator of 2–4 ticks for any time span, without warnings."""
    locator = mdates.AutoDateLocator(minticks=2, maxticks=4)  # type: ignore[no-untyped-call]
    locator.intervald.update({unit: list(steps) for unit, steps in TICK_INTERVALS.items()})
    return locator


def _head_order(head: str) -> tuple[int, str]:
    """``head-10`` after ``head-9``."""
    prefix, _, number = head.rpartition("-")
    return (int(number), prefix) if number.isdigit() else (1 << 30, head)
