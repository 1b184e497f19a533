"""The triage pages as a small site over the monitor's records, the same for the
service (``/triage/…``) and the command line (``triage --html``):

``/triage/``                                   the incidents, newest first
``/triage/incident/<incident id>``             one incident's page
``/triage/layer?model=M&revision=R&layer=L``   a layer's page (its newest incident, or
                                               "nothing to investigate")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from monitor.triage import evidence, page

Records = Callable[[], list[dict[str, Any]]]


class NotFound(LookupError):
    """No page at that address (an unknown incident, a malformed selection)."""


def respond(records: list[dict[str, Any]], path: str, query: str) -> str:
    """The HTML of the page at ``path`` (below ``/triage/``) and ``query``; raises
    :class:`NotFound`."""
    path = path.strip("/")
    if path in ("", "index.html"):
        cases = evidence.incident_cases(records)
        return page.render_index(cases, {c.incident_id: page.incident_href(c.incident_id) for c in cases})
    if path.startswith("incident/"):
        case = evidence.for_incident(records, unquote(path.removeprefix("incident/")))
        if case is None:
            raise NotFound(f"no incident {unquote(path.removeprefix('incident/'))!r} in the records read")
        return page.render(case)
    if path == "layer":
        args = {k: v[-1] for k, v in parse_qs(query).items()}
        try:
            model, revision, layer = args["model"], args["revision"], int(args["layer"])
        except (KeyError, ValueError) as exc:
            raise NotFound("a layer page needs model, revision and layer (a number)") from exc
        return page.render(evidence.for_layer(records, model, revision, layer))
    raise NotFound(f"no triage page {path!r}")


def write_site(records: list[dict[str, Any]], directory: Path, model: str | None = None,
               revision: str | None = None, layer: int | None = None) -> list[Path]:
    """``index.html`` and one page per incident matching the filters, in ``directory``;
    the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    cases = evidence.incident_cases(records, model, revision, layer)
    links = {c.incident_id: page.file_name(c.incident_id) for c in cases}
    written = []
    for case in cases:
        target = directory / links[case.incident_id]
        target.write_text(page.render(case), encoding="utf-8")
        written.append(target)
    index = directory / "index.html"
    index.write_text(page.render_index(cases, links), encoding="utf-8")
    return [index, *written]
