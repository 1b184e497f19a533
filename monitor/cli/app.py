"""The ``attention-monitor`` application, its command groups and what the commands share.

Exit codes (:class:`monitor.errors.ExitCode`): 0 success; 1 a check failed (an audit
FAIL, an invalid configuration); 2 bad usage or unreadable input; 3 an infrastructure
error (broker unreachable, authorization refused) after retries; 4 the service's
measuring process died; 130 interrupted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import typer

from monitor.errors import ExitCode

#: help texts are Markdown: a docstring's paragraphs wrap at the terminal's width (in
#: Typer's "rich" mode the line breaks of the source were kept, breaking sentences)
HELP_MARKUP: Literal["markdown"] = "markdown"

app = typer.Typer(
    name="attention-monitor",
    help="Watch the attention heads of transformer models in production.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)


def _group(help_text: str) -> typer.Typer:
    return typer.Typer(help=help_text, no_args_is_help=True, rich_markup_mode=HELP_MARKUP)


contract_app = _group("Model contracts: what a model revision's attention layers are.")
app.add_typer(contract_app, name="contract")
topics_app = _group("The monitor's Kafka topics.")
app.add_typer(topics_app, name="topics")
keyring_app = _group("Keyrings: the HMAC keys traces are signed with.")
app.add_typer(keyring_app, name="keyring")
reference_app = _group("Which revision's reference judges a model revision: pins and promotions.")
app.add_typer(reference_app, name="reference")
acls_app = _group("Kafka ACLs for the deployment's principals.")
app.add_typer(acls_app, name="acls")

EXIT_FAILED = ExitCode.FAILED
EXIT_USAGE = ExitCode.USAGE


def load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        typer.echo(f"error: cannot read {what} {path}: {exc.strerror}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc
    except json.JSONDecodeError as exc:
        typer.echo(f"error: {what} {path} is not JSON: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from exc


def load_settings() -> Any:
    """The ``ATTENTION_MONITOR_*`` settings; exit 1 naming each unusable variable (every
    command reads its settings through here)."""
    from pydantic import ValidationError

    from monitor.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        typer.echo(f"error: unusable settings: {settings_problems(exc)}", err=True)
        raise typer.Exit(EXIT_FAILED) from exc


def plain_problems(exc: Any, where: Any = None) -> str:
    """A pydantic ``ValidationError`` as plain sentences, ``; ``-separated: each problem's
    place (``where(error)``, default the dotted field path; none for the whole record) and
    its message, a validator's own as written (without pydantic's ``Value error, ``)."""
    from monitor.protocol.schema import IDENTIFIER_PATTERN, IDENTIFIER_RULE

    problems = []
    for error in exc.errors():
        ctx = error.get("ctx") or {}
        message = str(ctx["error"]) if error["type"] == "value_error" and "error" in ctx else error["msg"]
        if error["type"] == "string_pattern_mismatch" and ctx.get("pattern") == IDENTIFIER_PATTERN:
            message = f"{error['input']!r} {IDENTIFIER_RULE}"
        place = where(error) if where is not None else ".".join(str(part) for part in error["loc"])
        problems.append(f"{place}: {message}" if place else message)
    return "; ".join(problems)


def settings_problems(exc: Any) -> str:
    """Settings' problems under the names they are set by (``ATTENTION_MONITOR_<FIELD>``),
    with the value given unless the setting is a secret."""
    from monitor.settings import Settings

    def where(error: Any) -> str:
        if not error["loc"]:
            return ""
        name = str(error["loc"][0])
        field = Settings.model_fields.get(name)
        shown = field is not None and "Secret" not in str(field.annotation) and "input" in error
        return f"ATTENTION_MONITOR_{name.upper()}" + (f"={error['input']!r}" if shown else "")

    return plain_problems(exc, where)


def setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
