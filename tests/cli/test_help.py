"""Every ``--help`` reads as prose at any terminal width: a description's lines break only
where the next word would not fit, in the command's own text and in the command lists of
its group, never where the source's docstring happened to break."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from monitor.cli import app

WIDTHS = (50, 80, 132, 200)
BOX = "│"


def commands() -> list[tuple[list[str], Any]]:
    root = get_command(app)
    found: list[tuple[list[str], Any]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        found.append((path, cmd))
        if hasattr(cmd, "commands"):  # a group (typer vendors its own click)
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])

    walk(root, [])
    return found


def rendered(path: list[str], width: int) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(width), "TERM": "dumb",
                                                              "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def broken_lines(text: str, width: int) -> list[str]:
    """Places where a line of prose ends although the next line's first word would have
    fitted on it: in the description (before the first panel), and inside panels, where
    a continuation line starts blank up to the text column of the line it continues."""
    lines = text.splitlines()
    bad = []
    first_panel = next((i for i, line in enumerate(lines) if line.lstrip().startswith("╭")), len(lines))
    for a, b in itertools.pairwise(lines[:first_panel]):
        prose = a.strip() and b.strip() and not b.strip().startswith("Usage:")
        if prose and len(a.rstrip()) + 1 + len(b.split()[0]) <= width - 1:
            bad.append(f"{a.strip()!r} | {b.strip()!r}")
    for a, b in itertools.pairwise(lines[first_panel:]):
        if not (a.startswith(BOX) and b.startswith(BOX)):
            continue
        inner_a, inner_b = a[1:a.rindex(BOX)], b[1:b.rindex(BOX)]
        text_b = inner_b.lstrip()
        column = len(inner_b) - len(text_b)
        if not text_b or column < 6 or not text_b[0].isalnum():  # a new row, typer's [default: …], a metavar
            continue
        if len(inner_a) < column or inner_a[column - 1] != " " or not inner_a[column:].strip():
            continue  # not the same column of text
        used = len(inner_a.rstrip())
        if used + 1 + len(text_b.split()[0]) <= len(inner_a) - 1:
            bad.append(f"{inner_a.strip()!r} | {text_b.strip()!r}")
    return bad


@pytest.mark.parametrize("width", WIDTHS)
def test_every_help_wraps_as_prose(width):
    problems = {}
    for path, _ in commands():
        bad = broken_lines(rendered(path, width), width)
        if bad:
            problems[" ".join(path) or "attention-monitor"] = bad
    assert not problems, problems


def test_a_long_docstring_is_one_paragraph_on_a_wide_terminal():
    """The triage command's first paragraph spans three source lines: it is
    one line in the command list and in its own help on a terminal wide enough."""
    triage = dict((tuple(p), c) for p, c in commands())[("triage",)]
    first = " ".join((triage.help or "").split("\n\n")[0].split())
    assert len(first) < 230
    assert first in [line.strip() for line in rendered(["triage"], 260).splitlines()]
    listed = [line for line in rendered([], 260).splitlines() if "triage" in line]
    assert len(listed) == 1 and re.search(r"association\)\.\s*│$", listed[0]), listed


def test_the_checker_sees_a_broken_sentence():
    text = " Usage: x\n\n Summarise recent incidents and anomaly records for on-call, as text or as HTML\n pages.\n"
    assert broken_lines(text, 120) and not broken_lines(text, 82)
