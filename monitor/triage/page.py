"""The triage page: one self-contained HTML document per incident or layer selection
(inline CSS and SVG, no script, no external asset: it opens offline), rendered by
Jinja2 from a :class:`~monitor.triage.evidence.Case`; and an index of incidents."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from monitor.core.policy import NOT_PRUNING, SPECIALIZATION
from monitor.triage import charts, outcome_chart
from monitor.triage.evidence import Case
from monitor.triage.seen import SeenLayer

#: every template is HTML (``*.html.j2``): what records and addresses carry (model ids,
#: heads, labels, a query) is escaped, the charts alone are passed as markup
_ENV = Environment(loader=PackageLoader("monitor.triage", "templates"),
                   autoescape=select_autoescape(["html.j2"], default_for_string=True, default=True),
                   trim_blocks=True, lstrip_blocks=True)


def _number(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{float(value):.{digits}f}"


def _when(seconds: Any) -> str:
    if not seconds:
        return "–"
    return datetime.fromtimestamp(float(seconds), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


_ENV.filters["number"] = _number
_ENV.filters["when"] = _when


def incident_href(incident_id: str) -> str:
    """Where the service serves an incident's page, relative to ``/triage/``."""
    return "incident/" + quote(incident_id, safe="")


def layer_href(model: str, revision: str, layer: int) -> str:
    """Where the service serves a layer's page, relative to ``/triage/``."""
    return "layer?" + urlencode({"model": model, "revision": revision, "layer": layer})


_ENV.globals["layer_href"] = layer_href


def file_name(incident_id: str) -> str:
    """A file name for an incident's page (the CLI's directory mode)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", incident_id) + ".html"


def render(case: Case) -> str:
    """The page of one case."""
    heatmap = timeline = None
    if case.latest is not None and case.latest.get("evidence"):
        heatmap = Markup(charts.heatmaps(case.latest["evidence"], case.involved))
        timeline = Markup(charts.timelines(case.timelines))
    intervals = Markup(outcome_chart.intervals(case.outcomes)) if case.outcomes is not None else None
    return _ENV.get_template("case.html.j2").render(
        case=case, heatmap=heatmap, timeline=timeline, outcome_chart=intervals, not_pruning=NOT_PRUNING,
        specialization=SPECIALIZATION,
        generated=_when(datetime.now(UTC).timestamp()))


def render_index(cases: list[Case], links: dict[str, str], layers: list[SeenLayer] | None = None) -> str:
    """A list of incidents, each linked to its page (``links``: incident id → href),
    with the findings and heads its page shows; then the ``layers`` the serving instance
    has seen, each linked to its page (None: written to disk, no instance to ask)."""
    return _ENV.get_template("index.html.j2").render(
        cases=cases, links=links, layers=layers, not_pruning=NOT_PRUNING,
        generated=_when(datetime.now(UTC).timestamp()))


def render_notice(title: str, message: str, index: str, layers: list[SeenLayer] | None = None) -> str:
    """A page that says why there is nothing to show at an address (an unknown incident
    or layer, a malformed layer address), with a link back to the index (``index``: its
    href) and the ``layers`` the serving instance has seen, each linked to its page."""
    return _ENV.get_template("notice.html.j2").render(title=title, message=message, index=index, layers=layers,
                                                      generated=_when(datetime.now(UTC).timestamp()))
