"""The triage pages as a small site over the monitor's records, the same for the
service (``/triage/…``) and the command line (``triage --html``):

``/triage/``                                   the incidents, newest first
``/triage/incident/<incident id>``             one incident's page
``/triage/layer?model=M&revision=R&layer=L``   a layer's page (its newest incident, or
                                               "nothing to investigate")

Every answer is an HTTP status and a page: 404 (an unknown incident or page) and 400 (a
layer address without its model, revision or layer) say what was wrong and link back to
the index, so that a typo never reads as a healthy layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from monitor.triage import evidence, page
from monitor.triage.seen import Key, SeenLayer

#: what a layer page's address must carry
LAYER_PARAMETERS = ("model", "revision", "layer")


class BadRequest(ValueError):
    """A layer address without one of its parameters, or with a layer that is no number."""


def respond(records: list[dict[str, Any]], path: str, query: str,
            seen: Mapping[Key, SeenLayer] | None = None) -> tuple[int, str]:
    """The HTTP status and HTML of the page at ``path`` (below ``/triage/``) and ``query``.

    ``seen``: the layers the serving instance has seen (:mod:`monitor.triage.seen`); the
    index lists them, a layer page takes its judge and contract from them, and a layer
    neither they nor the records name is a 404. None (pages written to disk): every
    layer without records is shown as healthy."""
    path = path.strip("/")
    index = "../" * path.count("/")  # relative links on a page below /triage/incident/ climb back
    layers = None if seen is None else list(seen.values())
    if path in ("", "index.html"):
        cases = evidence.incident_cases(records)
        return 200, page.render_index(cases, {c.incident_id: page.incident_href(c.incident_id) for c in cases},
                                      layers)
    if path.startswith("incident/"):
        incident_id = unquote(path.removeprefix("incident/"))
        case = evidence.for_incident(records, incident_id)
        if case is None:
            return 404, page.render_notice("No such incident", f"No incident {incident_id!r} in the records this "
                                           "instance read from the anomalies topic.", index)
        return 200, page.render(case)
    if path == "layer":
        try:
            key = layer_selection(query)
        except BadRequest as exc:
            return 400, page.render_notice("Not a layer page address", str(exc), index, layers)
        case = evidence.for_layer(records, *key)
        if seen is not None:
            case.seen = seen.get(key)
            if case.seen is None and case.healthy:
                model, revision, layer = key
                return 404, page.render_notice(
                    "No traces of this layer seen",
                    f"This instance has seen no traces of model {model!r} revision {revision!r} layer {layer} since it "
                    "started, and the records it read from the anomalies topic name none: not a healthy layer, one "
                    "this monitor knows nothing of (a typo, traces yet to come, or another instance's).", index, layers)
        return 200, page.render(case)
    return 404, page.render_notice("No such page", f"There is no triage page {path!r}.", index)


def layer_selection(query: str) -> tuple[str, str, int]:
    """The (model, revision, layer) a layer page's ``query`` names; raises
    :class:`BadRequest` naming every missing parameter, or a layer that is no number."""
    args = {k: v[-1] for k, v in parse_qs(query).items() if v[-1].strip()}
    missing = [name for name in LAYER_PARAMETERS if name not in args]
    if missing:
        given = ", ".join(f"{k}={v}" for k, v in args.items() if k in LAYER_PARAMETERS) or "none of them"
        raise BadRequest(f"A layer page needs {_listed(LAYER_PARAMETERS)}: {_listed(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing (given: {given}). "
                         "Its address reads layer?model=M&revision=R&layer=L.")
    try:
        layer = int(args["layer"])
    except ValueError as exc:
        raise BadRequest(f"layer must be a layer number (0, 1, …), got {args['layer']!r}.") from exc
    return args["model"], args["revision"], layer


def _listed(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


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
